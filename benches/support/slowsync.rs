//! A pass-through FUSE filesystem over one flat directory whose every fsync waits a fixed
//! time after the real one: a disk whose sync is slow (a SATA SSD's cache flush, network
//! block storage), for the group-commit row. This kernel has no dm-delay to do it lower.
//!
//! The kernel's writeback cache is on, so writes land in the page cache as on any disk
//! and reach this filesystem in large blocks when synced; only fsync and fdatasync (of a
//! file or of the directory) pay the delay. On request every sync fails with EIO after
//! the real one (a disk whose flush fails once the data reached it), for the store's
//! fault tests. Needs /dev/fuse, and root or `fusermount3`.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    FileAttr, FileType, Filesystem, KernelConfig, MountOption, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyWrite, Request, TimeOrNow,
};

const ROOT: u64 = 1;
/// Nothing but this filesystem changes the backing directory, so the kernel may cache.
const TTL: Duration = Duration::from_secs(1);

struct SlowFilesystem {
    backing: PathBuf,
    delay: Duration,
    syncs: Arc<AtomicU64>,
    /// While set, every sync fails with EIO once the real one is done.
    fail: Arc<AtomicBool>,
    /// Inode numbers handed to the kernel, by name and back.
    names: HashMap<u64, OsString>,
    inos: HashMap<OsString, u64>,
    next_ino: u64,
    /// Open backing files, by the handle given to the kernel.
    handles: HashMap<u64, File>,
    next_fh: u64,
}

fn errno(e: &std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(libc::EIO)
}

fn time_of(secs: i64, nsecs: i64) -> SystemTime {
    let d = Duration::new(secs.unsigned_abs(), nsecs.clamp(0, 999_999_999) as u32);
    if secs >= 0 {
        UNIX_EPOCH + d
    } else {
        UNIX_EPOCH - d
    }
}

fn attr_of(ino: u64, m: &std::fs::Metadata) -> FileAttr {
    FileAttr {
        ino,
        size: m.size(),
        blocks: m.blocks(),
        atime: time_of(m.atime(), m.atime_nsec()),
        mtime: time_of(m.mtime(), m.mtime_nsec()),
        ctime: time_of(m.ctime(), m.ctime_nsec()),
        crtime: UNIX_EPOCH,
        kind: if m.is_dir() {
            FileType::Directory
        } else {
            FileType::RegularFile
        },
        perm: (m.mode() & 0o7777) as u16,
        nlink: m.nlink() as u32,
        uid: m.uid(),
        gid: m.gid(),
        rdev: 0,
        flags: 0,
        blksize: 4096,
    }
}

impl SlowFilesystem {
    fn path_of(&self, ino: u64) -> Option<PathBuf> {
        if ino == ROOT {
            return Some(self.backing.clone());
        }
        self.names.get(&ino).map(|n| self.backing.join(n))
    }

    fn ino_for(&mut self, name: &OsStr) -> u64 {
        if let Some(&ino) = self.inos.get(name) {
            return ino;
        }
        self.next_ino += 1;
        let ino = self.next_ino;
        self.inos.insert(name.to_os_string(), ino);
        self.names.insert(ino, name.to_os_string());
        ino
    }

    fn stat(&self, ino: u64) -> Result<FileAttr, i32> {
        let path = self.path_of(ino).ok_or(libc::ENOENT)?;
        let m = std::fs::symlink_metadata(path).map_err(|e| errno(&e))?;
        Ok(attr_of(ino, &m))
    }

    fn keep(&mut self, file: File) -> u64 {
        self.next_fh += 1;
        self.handles.insert(self.next_fh, file);
        self.next_fh
    }

    /// The open file behind `fh`, or the file of `ino` opened afresh.
    fn with_file<T>(
        &mut self,
        ino: u64,
        fh: u64,
        f: impl FnOnce(&File) -> std::io::Result<T>,
    ) -> Result<T, i32> {
        if let Some(file) = self.handles.get(&fh) {
            return f(file).map_err(|e| errno(&e));
        }
        let path = self.path_of(ino).ok_or(libc::ENOENT)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| errno(&e))?;
        f(&file).map_err(|e| errno(&e))
    }

    /// The slow disk: after a real sync succeeds, the delay.
    fn slow_sync(&self, synced: Result<(), i32>) -> Result<(), i32> {
        synced?;
        std::thread::sleep(self.delay);
        self.syncs.fetch_add(1, Ordering::Relaxed);
        if self.fail.load(Ordering::Relaxed) {
            return Err(libc::EIO);
        }
        Ok(())
    }
}

impl Filesystem for SlowFilesystem {
    fn init(&mut self, _req: &Request<'_>, config: &mut KernelConfig) -> Result<(), libc::c_int> {
        // Without the writeback cache every write(2) would be a round trip through this
        // process: a cost no real disk has.
        config
            .add_capabilities(fuser::consts::FUSE_WRITEBACK_CACHE)
            .map_err(|_| libc::ENOSYS)?;
        let _ = config.set_max_write(1 << 20);
        Ok(())
    }

    fn lookup(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEntry) {
        if parent != ROOT {
            return reply.error(libc::ENOENT);
        }
        match std::fs::symlink_metadata(self.backing.join(name)) {
            Ok(m) => {
                let ino = self.ino_for(name);
                reply.entry(&TTL, &attr_of(ino, &m), 0)
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn getattr(&mut self, _req: &Request<'_>, ino: u64, _fh: Option<u64>, reply: ReplyAttr) {
        match self.stat(ino) {
            Ok(a) => reply.attr(&TTL, &a),
            Err(e) => reply.error(e),
        }
    }

    fn setattr(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<u64>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<u32>,
        reply: ReplyAttr,
    ) {
        let Some(path) = self.path_of(ino) else {
            return reply.error(libc::ENOENT);
        };
        let mut done = Ok(());
        if let Some(mode) = mode {
            done = done.and_then(|()| {
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode & 0o7777))
                    .map_err(|e| errno(&e))
            });
        }
        if uid.is_some() || gid.is_some() {
            done = done
                .and_then(|()| std::os::unix::fs::lchown(&path, uid, gid).map_err(|e| errno(&e)));
        }
        if let Some(size) = size {
            done = done.and_then(|()| self.with_file(ino, fh.unwrap_or(0), |f| f.set_len(size)));
        }
        match done.and_then(|()| self.stat(ino)) {
            Ok(a) => reply.attr(&TTL, &a),
            Err(e) => reply.error(e),
        }
    }

    fn open(&mut self, _req: &Request<'_>, ino: u64, _flags: i32, reply: ReplyOpen) {
        // Read and write whatever the caller asked: with the writeback cache the kernel
        // reads pages around partial writes, and it applies O_TRUNC and O_APPEND itself.
        let opened = self.path_of(ino).ok_or(libc::ENOENT).and_then(|p| {
            OpenOptions::new()
                .read(true)
                .write(true)
                .open(p)
                .map_err(|e| errno(&e))
        });
        match opened {
            Ok(file) => {
                let fh = self.keep(file);
                reply.opened(fh, fuser::consts::FOPEN_KEEP_CACHE)
            }
            Err(e) => reply.error(e),
        }
    }

    fn create(
        &mut self,
        _req: &Request<'_>,
        parent: u64,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        if parent != ROOT {
            return reply.error(libc::ENOENT);
        }
        let path = self.backing.join(name);
        let mut options = OpenOptions::new();
        options.read(true).write(true).mode(mode & !umask & 0o7777);
        if flags & libc::O_EXCL != 0 {
            options.create_new(true);
        } else {
            options.create(true);
        }
        let created = options.open(&path).and_then(|f| Ok((f.metadata()?, f)));
        match created {
            Ok((m, file)) => {
                let ino = self.ino_for(name);
                let fh = self.keep(file);
                reply.created(&TTL, &attr_of(ino, &m), 0, fh, 0)
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn read(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        fh: u64,
        offset: i64,
        size: u32,
        _flags: i32,
        _lock_owner: Option<u64>,
        reply: ReplyData,
    ) {
        let mut buf = vec![0u8; size as usize];
        let read = self.with_file(ino, fh, |f| {
            let mut got = 0;
            while got < buf.len() {
                match f.read_at(&mut buf[got..], offset.max(0) as u64 + got as u64)? {
                    0 => break,
                    n => got += n,
                }
            }
            Ok(got)
        });
        match read {
            Ok(n) => reply.data(&buf[..n]),
            Err(e) => reply.error(e),
        }
    }

    fn write(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        fh: u64,
        offset: i64,
        data: &[u8],
        _write_flags: u32,
        _flags: i32,
        _lock_owner: Option<u64>,
        reply: ReplyWrite,
    ) {
        match self.with_file(ino, fh, |f| f.write_all_at(data, offset.max(0) as u64)) {
            Ok(()) => reply.written(data.len() as u32),
            Err(e) => reply.error(e),
        }
    }

    fn release(
        &mut self,
        _req: &Request<'_>,
        _ino: u64,
        fh: u64,
        _flags: i32,
        _lock_owner: Option<u64>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.handles.remove(&fh);
        reply.ok()
    }

    fn fsync(&mut self, _req: &Request<'_>, ino: u64, fh: u64, datasync: bool, reply: ReplyEmpty) {
        let synced = self.with_file(ino, fh, |f| {
            if datasync {
                f.sync_data()
            } else {
                f.sync_all()
            }
        });
        match self.slow_sync(synced) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn fsyncdir(
        &mut self,
        _req: &Request<'_>,
        _ino: u64,
        _fh: u64,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let synced = File::open(&self.backing)
            .and_then(|d| d.sync_all())
            .map_err(|e| errno(&e));
        match self.slow_sync(synced) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn unlink(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEmpty) {
        if parent != ROOT {
            return reply.error(libc::ENOENT);
        }
        match std::fs::remove_file(self.backing.join(name)) {
            Ok(()) => {
                if let Some(ino) = self.inos.remove(name) {
                    self.names.remove(&ino);
                }
                reply.ok()
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn rename(
        &mut self,
        _req: &Request<'_>,
        parent: u64,
        name: &OsStr,
        newparent: u64,
        newname: &OsStr,
        _flags: u32,
        reply: ReplyEmpty,
    ) {
        if parent != ROOT || newparent != ROOT {
            return reply.error(libc::ENOENT);
        }
        match std::fs::rename(self.backing.join(name), self.backing.join(newname)) {
            Ok(()) => {
                // The replaced file's inode is gone; the moved one keeps its number.
                if let Some(old) = self.inos.remove(newname) {
                    self.names.remove(&old);
                }
                if let Some(ino) = self.inos.remove(name) {
                    self.inos.insert(newname.to_os_string(), ino);
                    self.names.insert(ino, newname.to_os_string());
                }
                reply.ok()
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn readdir(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        mut reply: ReplyDirectory,
    ) {
        if ino != ROOT {
            return reply.error(libc::ENOTDIR);
        }
        let listed = match std::fs::read_dir(&self.backing) {
            Ok(d) => d,
            Err(e) => return reply.error(errno(&e)),
        };
        let mut entries = vec![
            (ROOT, FileType::Directory, OsString::from(".")),
            (ROOT, FileType::Directory, OsString::from("..")),
        ];
        for entry in listed.flatten() {
            let name = entry.file_name();
            let kind = match entry.file_type() {
                Ok(t) if t.is_dir() => FileType::Directory,
                _ => FileType::RegularFile,
            };
            entries.push((self.ino_for(&name), kind, name));
        }
        for (i, (ino, kind, name)) in entries.into_iter().enumerate().skip(offset as usize) {
            if reply.add(ino, (i + 1) as i64, kind, name) {
                break;
            }
        }
        reply.ok();
    }
}

/// A mounted slow-sync filesystem; unmounted when dropped (after its users stop).
pub struct SlowSync {
    mountpoint: PathBuf,
    syncs: Arc<AtomicU64>,
    fail: Arc<AtomicBool>,
    _session: fuser::BackgroundSession,
    _dir: tempfile::TempDir,
}

impl SlowSync {
    /// Mounts, in a new directory under `under` (whose disk holds the files), a
    /// filesystem whose every fsync takes `delay` longer than that disk's.
    pub fn mount(under: &Path, delay: Duration) -> SlowSync {
        assert!(
            Path::new("/dev/fuse").exists(),
            "the slow-sync row needs /dev/fuse (the fuse kernel module)"
        );
        let dir = tempfile::Builder::new()
            .prefix("slowsync")
            .tempdir_in(under)
            .expect("slow-sync dirs");
        let (backing, mountpoint) = (dir.path().join("backing"), dir.path().join("mnt"));
        std::fs::create_dir(&backing).expect("backing dir");
        std::fs::create_dir(&mountpoint).expect("mountpoint");
        let syncs = Arc::new(AtomicU64::new(0));
        let fail = Arc::new(AtomicBool::new(false));
        let fs = SlowFilesystem {
            backing: backing.clone(),
            delay,
            syncs: syncs.clone(),
            fail: fail.clone(),
            names: HashMap::new(),
            inos: HashMap::new(),
            next_ino: ROOT,
            handles: HashMap::new(),
            next_fh: 0,
        };
        let session = fuser::spawn_mount2(
            fs,
            &mountpoint,
            &[MountOption::FSName("hostdevd-slowsync".into())],
        )
        .unwrap_or_else(|e| {
            panic!(
                "mounting the slow-sync filesystem on {} failed: {e} (needs /dev/fuse, and root or fusermount3 from Debian's fuse3)",
                mountpoint.display()
            )
        });
        // The mount is live once a file made in the backing directory shows through it.
        std::fs::write(backing.join(".probe"), b"").expect("probe file");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !mountpoint.join(".probe").exists() {
            assert!(
                std::time::Instant::now() < deadline,
                "the slow-sync filesystem at {} never answered",
                mountpoint.display()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        std::fs::remove_file(backing.join(".probe")).expect("remove the probe");
        SlowSync {
            mountpoint,
            syncs,
            fail,
            _session: session,
            _dir: dir,
        }
    }

    /// The mounted directory.
    pub fn path(&self) -> &Path {
        &self.mountpoint
    }

    /// How many syncs (each delayed) the filesystem has served.
    #[allow(dead_code)] // Not every user counts them.
    pub fn syncs(&self) -> u64 {
        self.syncs.load(Ordering::Relaxed)
    }

    /// From now on every sync fails with EIO after the real one (`true`), or none does.
    #[allow(dead_code)] // Not every user fails them.
    pub fn fail_syncs(&self, on: bool) {
        self.fail.store(on, Ordering::Relaxed);
    }
}
