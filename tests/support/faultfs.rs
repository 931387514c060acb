//! A FUSE filesystem of flat attribute files whose writes fail with a chosen errno, so
//! that the agent's sysfs writes meet the kernel's error returns (EBUSY, EIO, EINVAL)
//! through real open(2)/write(2) calls. A test replaces an attribute of a fake tree with
//! a symlink into the mount; reads return the file's content, and every write attempt
//! is recorded.
//!
//! Needs /dev/fuse and `fusermount3` (Debian's fuse3, installed by `scripts/deps.sh
//! --tests`); mounting fails loudly without them.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use fuser::{
    FileAttr, FileType, Filesystem, MountOption, ReplyAttr, ReplyData, ReplyDirectory, ReplyEntry,
    ReplyOpen, ReplyWrite, Request, TimeOrNow,
};

const ROOT: u64 = 1;
/// Attributes are never cached: each stat and read asks this filesystem again.
const TTL: Duration = Duration::ZERO;

/// Run inside a write or a read, before it is answered: what the kernel does meanwhile.
type Hook = Box<dyn Fn() + Send>;

#[derive(Default)]
struct File {
    name: String,
    content: Vec<u8>,
    /// The errno every write (and truncation) returns; `None`: writes succeed.
    fail: Option<i32>,
    /// Every write attempt, failed or not.
    attempts: Vec<String>,
    /// Runs during each write, before its answer (e.g. the device is hot-removed).
    during_write: Option<Hook>,
    /// Runs during each read, before its answer (e.g. the kernel holds the device).
    during_read: Option<Hook>,
}

#[derive(Default)]
struct Files(Vec<File>);

impl Files {
    fn ino(&self, name: &OsStr) -> Option<u64> {
        self.0
            .iter()
            .position(|f| OsStr::new(&f.name) == name)
            .map(|i| i as u64 + 2)
    }

    fn get(&mut self, ino: u64) -> Option<&mut File> {
        ino.checked_sub(2).and_then(|i| self.0.get_mut(i as usize))
    }
}

fn attr(ino: u64, size: u64, dir: bool) -> FileAttr {
    FileAttr {
        ino,
        size,
        blocks: size.div_ceil(512),
        atime: UNIX_EPOCH,
        mtime: UNIX_EPOCH,
        ctime: UNIX_EPOCH,
        crtime: UNIX_EPOCH,
        kind: if dir {
            FileType::Directory
        } else {
            FileType::RegularFile
        },
        perm: if dir { 0o755 } else { 0o644 },
        nlink: if dir { 2 } else { 1 },
        uid: 0,
        gid: 0,
        rdev: 0,
        flags: 0,
        blksize: 4096,
    }
}

struct FaultFilesystem(Arc<Mutex<Files>>);

impl FaultFilesystem {
    fn files(&self) -> std::sync::MutexGuard<'_, Files> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn attr_of(&self, ino: u64) -> Option<FileAttr> {
        if ino == ROOT {
            return Some(attr(ROOT, 0, true));
        }
        self.files()
            .get(ino)
            .map(|f| attr(ino, f.content.len() as u64, false))
    }
}

impl Filesystem for FaultFilesystem {
    fn lookup(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEntry) {
        let ino = (parent == ROOT).then(|| self.files().ino(name)).flatten();
        match ino.and_then(|i| self.attr_of(i)) {
            Some(a) => reply.entry(&TTL, &a, 0),
            None => reply.error(libc::ENOENT),
        }
    }

    fn getattr(&mut self, _req: &Request<'_>, ino: u64, _fh: Option<u64>, reply: ReplyAttr) {
        match self.attr_of(ino) {
            Some(a) => reply.attr(&TTL, &a),
            None => reply.error(libc::ENOENT),
        }
    }

    fn setattr(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<std::time::SystemTime>,
        _fh: Option<u64>,
        _crtime: Option<std::time::SystemTime>,
        _chgtime: Option<std::time::SystemTime>,
        _bkuptime: Option<std::time::SystemTime>,
        _flags: Option<u32>,
        reply: ReplyAttr,
    ) {
        let mut files = self.files();
        let Some(f) = files.get(ino) else {
            drop(files);
            return match self.attr_of(ino) {
                Some(a) => reply.attr(&TTL, &a),
                None => reply.error(libc::ENOENT),
            };
        };
        // sysfs ignores O_TRUNC, and so does a failing file here: its error comes from
        // the write(2), as the kernel's does. A passing file empties, so that the stand-in
        // kernel can take what was written to it.
        if let (Some(size), None) = (size, f.fail) {
            f.content.truncate(size as usize);
        }
        let a = attr(ino, f.content.len() as u64, false);
        reply.attr(&TTL, &a)
    }

    fn open(&mut self, _req: &Request<'_>, ino: u64, _flags: i32, reply: ReplyOpen) {
        if self.attr_of(ino).is_none() {
            return reply.error(libc::ENOENT);
        }
        // Direct I/O: every read and write reaches this filesystem, as with sysfs, and a
        // write's errno is the write(2)'s.
        reply.opened(0, fuser::consts::FOPEN_DIRECT_IO);
    }

    fn read(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        size: u32,
        _flags: i32,
        _lock_owner: Option<u64>,
        reply: ReplyData,
    ) {
        let mut files = self.files();
        let Some(f) = files.get(ino) else {
            return reply.error(libc::ENOENT);
        };
        if let Some(hook) = &f.during_read {
            hook();
        }
        let start = (offset.max(0) as usize).min(f.content.len());
        let end = start.saturating_add(size as usize).min(f.content.len());
        reply.data(&f.content[start..end]);
    }

    fn write(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        data: &[u8],
        _write_flags: u32,
        _flags: i32,
        _lock_owner: Option<u64>,
        reply: ReplyWrite,
    ) {
        let mut files = self.files();
        let Some(f) = files.get(ino) else {
            return reply.error(libc::ENOENT);
        };
        f.attempts.push(String::from_utf8_lossy(data).into_owned());
        if let Some(hook) = &f.during_write {
            hook();
        }
        if let Some(errno) = f.fail {
            return reply.error(errno);
        }
        let at = offset.max(0) as usize;
        if f.content.len() < at + data.len() {
            f.content.resize(at + data.len(), 0);
        }
        f.content[at..at + data.len()].copy_from_slice(data);
        reply.written(data.len() as u32);
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
        let mut entries = vec![
            (ROOT, FileType::Directory, ".".to_string()),
            (ROOT, FileType::Directory, "..".to_string()),
        ];
        for (i, f) in self.files().0.iter().enumerate() {
            entries.push((i as u64 + 2, FileType::RegularFile, f.name.clone()));
        }
        for (i, (ino, kind, name)) in entries.into_iter().enumerate().skip(offset as usize) {
            if reply.add(ino, (i + 1) as i64, kind, name) {
                break;
            }
        }
        reply.ok();
    }
}

/// A mounted fault filesystem; unmounted when dropped.
pub struct FaultFs {
    files: Arc<Mutex<Files>>,
    mountpoint: PathBuf,
    _session: fuser::BackgroundSession,
    _dir: tempfile::TempDir,
}

impl FaultFs {
    /// Mounts a filesystem holding `files` (name, initial content) on a new temp dir.
    pub fn mount(files: &[(&str, &str)]) -> FaultFs {
        assert!(
            Path::new("/dev/fuse").exists(),
            "the sysfs fault tests need /dev/fuse (the fuse kernel module)"
        );
        let files = Arc::new(Mutex::new(Files(
            files
                .iter()
                .map(|(name, content)| File {
                    name: name.to_string(),
                    content: content.as_bytes().to_vec(),
                    ..File::default()
                })
                .collect(),
        )));
        let dir = tempfile::tempdir().expect("fault fs mountpoint");
        let mountpoint = dir.path().join("mnt");
        std::fs::create_dir(&mountpoint).expect("mountpoint");
        let session = fuser::spawn_mount2(
            FaultFilesystem(files.clone()),
            &mountpoint,
            &[MountOption::FSName("hostdevd-faultfs".into())],
        )
        .unwrap_or_else(|e| {
            panic!(
                "mounting the fault filesystem on {} failed: {e} (needs /dev/fuse, root, and fusermount3 from Debian's fuse3)",
                mountpoint.display()
            )
        });
        // The mount is live once a stat of a file reaches the filesystem.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let probe = files
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .0
            .first()
            .map(|f| mountpoint.join(&f.name));
        while let Some(p) = &probe {
            if p.exists() {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the fault filesystem at {} never answered",
                mountpoint.display()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        FaultFs {
            files,
            mountpoint,
            _session: session,
            _dir: dir,
        }
    }

    fn with<T>(&self, name: &str, f: impl FnOnce(&mut File) -> T) -> T {
        let mut files = self.files.lock().unwrap_or_else(|p| p.into_inner());
        let file = files
            .0
            .iter_mut()
            .find(|x| x.name == name)
            .unwrap_or_else(|| panic!("no file {name} in the fault filesystem"));
        f(file)
    }

    /// The path of a file inside the mount.
    pub fn path(&self, name: &str) -> PathBuf {
        self.mountpoint.join(name)
    }

    /// Makes every later write to `name` fail with `errno` (`None`: succeed).
    pub fn fail_writes(&self, name: &str, errno: Option<nix::errno::Errno>) {
        self.with(name, |f| f.fail = errno.map(|e| e as i32));
    }

    /// Runs `hook` inside every later write to `name`, before the write is answered:
    /// something that happens in the kernel while the agent's write is in progress.
    pub fn during_write(&self, name: &str, hook: impl Fn() + Send + 'static) {
        self.with(name, |f| f.during_write = Some(Box::new(hook)));
    }

    /// Runs `hook` inside every later read of `name`, before the read is answered (this
    /// filesystem answers nothing else meanwhile, as a device's lock in the kernel).
    pub fn during_read(&self, name: &str, hook: impl Fn() + Send + 'static) {
        self.with(name, |f| f.during_read = Some(Box::new(hook)));
    }

    /// Every write attempted on `name` so far.
    pub fn attempts(&self, name: &str) -> Vec<String> {
        self.with(name, |f| f.attempts.clone())
    }

    /// What `name` holds now.
    pub fn content(&self, name: &str) -> String {
        self.with(name, |f| String::from_utf8_lossy(&f.content).into_owned())
    }

    /// Replaces `attr` (a file of a fake tree) with a symlink to `name` in this mount.
    pub fn plant(&self, attr: &Path, name: &str) {
        let _ = std::fs::remove_file(attr);
        std::os::unix::fs::symlink(self.path(name), attr)
            .unwrap_or_else(|e| panic!("symlink {} -> {name}: {e}", attr.display()));
    }
}
