//! Reading and parsing single sysfs attribute files and links, each into a typed value or a [`SysfsError`].
//!
//! Every function here is total: a missing, unreadable, oversized, non-UTF-8 or malformed
//! attribute comes back as an error naming the path, never as a panic. The parsers are
//! split from the readers so they can be tested (and fuzzed) on bytes alone.

use std::collections::BTreeSet;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Mutex};
use std::time::Duration;

use crate::pci::PciAddress;

use super::{ClassCode, Revision, SysfsError};

/// The most bytes one attribute may hold. The kernel's sysfs `show` callbacks fill at
/// most one page, so anything longer is not a kernel attribute and is rejected instead
/// of being read into memory.
pub const MAX_ATTR_LEN: usize = 4096;

/// Reads one attribute file once, bounded by [`MAX_ATTR_LEN`], as raw bytes.
///
/// The file is opened with `O_NONBLOCK` so that a FIFO planted in a (fake) tree reads as
/// empty instead of hanging the scan; on real sysfs files the flag has no effect.
pub fn read_bytes(path: &Path) -> Result<Vec<u8>, SysfsError> {
    let io_err = |source| SysfsError::Read {
        path: path.to_path_buf(),
        source,
    };
    let file: File = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(io_err)?;
    let mut buf = Vec::with_capacity(64);
    // One byte past the limit tells "exactly at the limit" from "too long".
    file.take(MAX_ATTR_LEN as u64 + 1)
        .read_to_end(&mut buf)
        .map_err(io_err)?;
    if buf.len() > MAX_ATTR_LEN {
        return Err(SysfsError::TooLong {
            path: path.to_path_buf(),
            limit: MAX_ATTR_LEN,
        });
    }
    Ok(buf)
}

/// How long a scan waits for an attribute the kernel shows under the device's lock
/// (`sriov_numvfs`): a VF count change still running, one that outlived the agent's own
/// timeout or was started by another tool, holds that lock for as long as it takes
/// (tens of seconds on some NICs), and a rescan must not wait with it.
pub const LOCKED_READ_LIMIT: Duration = Duration::from_secs(1);

/// Runs `work` on a thread of its own (named `name`) and waits at most `limit` for it:
/// `Ok(None)` when it did not finish in time; that thread is then left to finish alone,
/// and nothing waits for it. `Err` only when no thread could be started.
pub(crate) fn on_thread<T: Send + 'static>(
    name: &str,
    limit: Duration,
    work: impl FnOnce() -> T + Send + 'static,
) -> io::Result<Option<T>> {
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let _ = tx.send(work());
        })?;
    Ok(rx.recv_timeout(limit).ok())
}

/// The paths whose read by [`read_text_within`] the kernel has not answered yet.
static UNANSWERED: Mutex<BTreeSet<PathBuf>> = Mutex::new(BTreeSet::new());

/// [`read_text`] on a thread of its own, waiting at most `limit`
/// ([`SysfsError::NoAnswer`] after it), for attributes the kernel shows under the
/// device's lock. While an earlier read of the same path still waits in the kernel, the
/// answer is [`SysfsError::NoAnswer`] at once: a device held for an hour, read again
/// every second, keeps one thread waiting, not thousands.
pub fn read_text_within(path: &Path, limit: Duration) -> Result<String, SysfsError> {
    within(path, limit, read_text)
}

/// [`read_optional_text`] as [`read_text_within`] reads.
pub fn read_optional_text_within(
    path: &Path,
    limit: Duration,
) -> Result<Option<String>, SysfsError> {
    within(path, limit, read_optional_text)
}

/// `read(path)` on a thread of its own, at most one waiting in the kernel per path.
fn within<T: Send + 'static>(
    path: &Path,
    limit: Duration,
    read: impl FnOnce(&Path) -> Result<T, SysfsError> + Send + 'static,
) -> Result<T, SysfsError> {
    let no_answer = |earlier| SysfsError::NoAnswer {
        path: path.to_path_buf(),
        after: limit,
        earlier,
    };
    let unanswered = || UNANSWERED.lock().unwrap_or_else(|p| p.into_inner());
    if !unanswered().insert(path.to_path_buf()) {
        return Err(no_answer(true));
    }
    let p = path.to_path_buf();
    let read = on_thread("hostdevd-sysfs-read", limit, move || {
        let read = read(&p);
        UNANSWERED
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&p);
        read
    });
    match read {
        Ok(Some(read)) => read,
        Ok(None) => Err(no_answer(false)),
        Err(source) => {
            unanswered().remove(path);
            Err(SysfsError::Read {
                path: path.to_path_buf(),
                source,
            })
        }
    }
}

/// Reads one attribute as text with the kernel's trailing newline removed.
pub fn read_text(path: &Path) -> Result<String, SysfsError> {
    let bytes = read_bytes(path)?;
    let text = String::from_utf8(bytes).map_err(|e| SysfsError::NotUtf8 {
        path: path.to_path_buf(),
        source: e.utf8_error(),
    })?;
    Ok(trim_value(&text).to_string())
}

/// Like [`read_text`], but an absent file is `Ok(None)`: for attributes the kernel only
/// creates on some devices or configurations (`sriov_totalvfs`, `numa_node`).
pub fn read_optional_text(path: &Path) -> Result<Option<String>, SysfsError> {
    match read_text(path) {
        Ok(v) => Ok(Some(v)),
        Err(SysfsError::Read { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// Strips the single trailing newline (and surrounding blanks) the kernel writes.
pub fn trim_value(s: &str) -> &str {
    s.trim_matches(['\n', ' ', '\t', '\r'])
}

pub(crate) use crate::pci::shown;

fn malformed(path: &Path, value: &str, expected: &'static str) -> SysfsError {
    SysfsError::Malformed {
        path: path.to_path_buf(),
        value: shown(value),
        expected,
    }
}

/// Parses `0x`-prefixed (or bare) hexadecimal of at most `max_digits` digits.
fn parse_hex(value: &str, max_digits: usize) -> Option<u32> {
    let v = value
        .strip_prefix("0x")
        .or_else(|| value.strip_prefix("0X"))
        .unwrap_or(value);
    if v.is_empty() || v.len() > max_digits || !v.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u32::from_str_radix(v, 16).ok()
}

/// Parses a 16-bit id attribute (`vendor`, `device`, `subsystem_*`: "0x8086").
pub fn parse_id16(path: &Path, value: &str) -> Result<u16, SysfsError> {
    parse_hex(value, 4)
        .and_then(|v| u16::try_from(v).ok())
        .ok_or_else(|| malformed(path, value, "a 16-bit hexadecimal id such as 0x8086"))
}

/// Parses the 24-bit `class` attribute ("0x020000": base class, subclass, prog-if).
pub fn parse_class(path: &Path, value: &str) -> Result<ClassCode, SysfsError> {
    parse_hex(value, 6)
        .map(ClassCode)
        .ok_or_else(|| malformed(path, value, "a 24-bit hexadecimal class such as 0x020000"))
}

/// Parses the 8-bit `revision` attribute ("0x01").
pub fn parse_revision(path: &Path, value: &str) -> Result<Revision, SysfsError> {
    parse_hex(value, 2)
        .and_then(|v| u8::try_from(v).ok())
        .map(Revision)
        .ok_or_else(|| malformed(path, value, "an 8-bit hexadecimal revision such as 0x01"))
}

/// Parses a small decimal count (`sriov_totalvfs`, `sriov_numvfs`, group numbers).
pub fn parse_u32(path: &Path, value: &str) -> Result<u32, SysfsError> {
    // Plain digits only: `u32::from_str` would also take a leading '+'.
    if value.is_empty() || value.len() > 10 || !value.bytes().all(|b| b.is_ascii_digit()) {
        return Err(malformed(path, value, "a decimal number"));
    }
    value
        .parse()
        .map_err(|_| malformed(path, value, "a decimal number"))
}

/// Parses `numa_node`: the kernel writes -1 when the device has no NUMA affinity.
pub fn parse_numa_node(path: &Path, value: &str) -> Result<Option<u32>, SysfsError> {
    if value == "-1" {
        return Ok(None);
    }
    parse_u32(path, value)
        .map(Some)
        .map_err(|_| malformed(path, value, "a NUMA node number or -1"))
}

/// Parses `driver_override`: the kernel writes "(null)" when no override is set.
pub fn parse_driver_override(value: &str) -> Option<String> {
    match value {
        "" | "(null)" => None,
        v => Some(v.to_string()),
    }
}

/// The last component of a link target, as text.
fn target_name(link: &Path, target: &Path) -> Result<String, SysfsError> {
    target
        .file_name()
        .and_then(|n| n.to_str())
        .map(str::to_string)
        .ok_or_else(|| SysfsError::BadLink {
            path: link.to_path_buf(),
            target: target.to_path_buf(),
            expected: "a UTF-8 final component",
        })
}

/// Reads a link and returns its target's final component, checking that the target
/// exists (a dangling link is an error). `Ok(None)` when the link itself is absent.
pub fn read_link_name(link: &Path) -> Result<Option<String>, SysfsError> {
    let target = match fs::read_link(link) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(SysfsError::ReadLink {
                path: link.to_path_buf(),
                source,
            })
        }
    };
    // `metadata` follows the link: NotFound here means it points nowhere.
    if let Err(source) = fs::metadata(link) {
        return Err(SysfsError::DanglingLink {
            path: link.to_path_buf(),
            target,
            source,
        });
    }
    target_name(link, &target).map(Some)
}

/// Reads a link whose target's final component is a PCI address (`physfn`, `virtfnN`,
/// group members). `Ok(None)` when the link is absent.
pub fn read_link_address(link: &Path) -> Result<Option<PciAddress>, SysfsError> {
    let Some(name) = read_link_name(link)? else {
        return Ok(None);
    };
    name.parse().map(Some).map_err(|_| SysfsError::BadLink {
        path: link.to_path_buf(),
        target: PathBuf::from(&name),
        expected: "a PCI address",
    })
}

/// Reads a link whose target's final component is a decimal number (`iommu_group`).
pub fn read_link_number(link: &Path) -> Result<Option<u32>, SysfsError> {
    let Some(name) = read_link_name(link)? else {
        return Ok(None);
    };
    if name.is_empty() || !name.bytes().all(|b| b.is_ascii_digit()) {
        return Err(SysfsError::BadLink {
            path: link.to_path_buf(),
            target: PathBuf::from(&name),
            expected: "a decimal group number",
        });
    }
    name.parse().map(Some).map_err(|_| SysfsError::BadLink {
        path: link.to_path_buf(),
        target: PathBuf::from(&name),
        expected: "a decimal group number",
    })
}

/// The VF index of a `virtfnN` entry name, or `None` for any other name.
pub fn virtfn_index(name: &str) -> Option<u32> {
    numbered("virtfn", name)
}

/// N of a name `<prefix>N` (decimal, at most 10 digits), or `None` for any other name.
pub(crate) fn numbered(prefix: &str, name: &str) -> Option<u32> {
    let digits = name.strip_prefix(prefix)?;
    if digits.is_empty() || digits.len() > 10 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The names of the iommufd interface's device nodes (`vfio0`, `vfio1`...) that the
/// kernel lists under a device's `vfio-dev` directory while it is bound to vfio-pci,
/// sorted; none when the directory does not exist (not bound, or the device is gone).
/// Entries of any other name are not device nodes and are left out.
pub fn vfio_device_names(device_dir: &Path) -> Result<Vec<String>, SysfsError> {
    let mut names = names_in(&device_dir.join("vfio-dev"))?;
    names.retain(|n| numbered("vfio", n).is_some());
    Ok(names)
}

/// The names of the entries of directory `dir` that are UTF-8 (no kernel name is
/// anything else), sorted; none when the directory does not exist. A listing that fails
/// part way is an error, never a shorter list.
pub(crate) fn names_in(dir: &Path) -> Result<Vec<String>, SysfsError> {
    let list_err = |source| SysfsError::ListDir {
        path: dir.to_path_buf(),
        source,
    };
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(list_err(e)),
    };
    let mut names = Vec::new();
    for entry in entries {
        if let Ok(name) = entry.map_err(list_err)?.file_name().into_string() {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A read the kernel does not answer (it holds the device while a VF count change
    /// still runs) is given up after the limit; while it still waits, another read of
    /// the same path is not started (no thread more) and gets the same answer; once it
    /// returns, the path is read again, and an answer in time is passed on.
    #[test]
    fn a_read_that_hangs_is_given_up_and_not_started_twice() {
        let path = Path::new("/nonexistent/0000:3b:00.0/sriov_numvfs");
        let limit = Duration::from_millis(100);
        let (release, held) = mpsc::channel::<()>();
        let (done_tx, done) = mpsc::channel::<()>();
        let err = within(path, limit, move |_| {
            let _ = held.recv();
            let _ = done_tx.send(());
            Ok("4".to_string())
        })
        .expect_err("no answer");
        assert!(
            matches!(&err, SysfsError::NoAnswer { after, earlier: false, .. } if *after == limit),
            "{err}"
        );
        let err = within(path, limit, |_| -> Result<String, SysfsError> {
            panic!("a second read started while the first waits")
        })
        .expect_err("still waiting");
        assert!(
            matches!(&err, SysfsError::NoAnswer { earlier: true, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("an earlier read"), "{err}");
        drop(release);
        done.recv().expect("the first read returned");
        // Its thread forgets the path just after it answers.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while UNANSWERED.lock().expect("set").contains(path) {
            assert!(std::time::Instant::now() < deadline, "never forgotten");
            std::thread::sleep(Duration::from_millis(1));
        }
        let v = within(path, limit, |_| Ok("4".to_string())).expect("answered");
        assert_eq!(v, "4");
    }
    use proptest::prelude::*;

    fn p() -> &'static Path {
        Path::new("/x/vendor")
    }

    #[test]
    fn ids_parse_kernel_forms() {
        assert_eq!(parse_id16(p(), "0x8086").expect("ok"), 0x8086);
        assert_eq!(parse_id16(p(), "10fb").expect("ok"), 0x10fb);
        assert_eq!(parse_id16(p(), "0X00Ab").expect("ok"), 0xab);
        for bad in ["", "0x", "zzzz", "0x18086", "-1", "0x 86", "８０８６"] {
            let e = parse_id16(p(), bad).expect_err(bad);
            assert!(e.to_string().contains("/x/vendor"), "{e}");
        }
    }

    #[test]
    fn class_and_revision() {
        assert_eq!(
            parse_class(p(), "0x020000").expect("ok"),
            ClassCode(0x020000)
        );
        assert_eq!(ClassCode(0x020000).to_string(), "020000");
        assert!(parse_class(p(), "0x1020000").is_err());
        assert_eq!(parse_revision(p(), "0x01").expect("ok"), Revision(1));
        assert_eq!(Revision(1).to_string(), "01");
        assert!(parse_revision(p(), "0x100").is_err());
    }

    #[test]
    fn numa_and_counts() {
        assert_eq!(parse_numa_node(p(), "-1").expect("ok"), None);
        assert_eq!(parse_numa_node(p(), "3").expect("ok"), Some(3));
        assert!(parse_numa_node(p(), "-2").is_err());
        assert!(parse_numa_node(p(), "").is_err());
        assert_eq!(parse_u32(p(), "64").expect("ok"), 64);
        assert!(parse_u32(p(), "+64").is_err());
        assert!(parse_u32(p(), "99999999999").is_err());
    }

    #[test]
    fn driver_override_null() {
        assert_eq!(parse_driver_override("(null)"), None);
        assert_eq!(parse_driver_override(""), None);
        assert_eq!(parse_driver_override("vfio-pci"), Some("vfio-pci".into()));
    }

    #[test]
    fn virtfn_names() {
        assert_eq!(virtfn_index("virtfn0"), Some(0));
        assert_eq!(virtfn_index("virtfn10"), Some(10));
        assert_eq!(virtfn_index("virtfn"), None);
        assert_eq!(virtfn_index("virtfn-1"), None);
        assert_eq!(virtfn_index("physfn"), None);
    }

    #[test]
    fn trim_and_shown() {
        assert_eq!(trim_value("0x8086\n"), "0x8086");
        assert!(shown(&"é".repeat(100)).len() <= 64 + "…".len());
    }

    #[test]
    fn read_text_bounds_and_utf8() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("vendor");
        fs::write(&f, b"0x8086\n").expect("write");
        assert_eq!(read_text(&f).expect("read"), "0x8086");
        fs::write(&f, vec![b'a'; MAX_ATTR_LEN + 1]).expect("write");
        assert!(matches!(read_text(&f), Err(SysfsError::TooLong { .. })));
        fs::write(&f, vec![b'a'; MAX_ATTR_LEN]).expect("write");
        assert!(read_text(&f).is_ok());
        fs::write(&f, b"\xff\xfe\n").expect("write");
        let e = read_text(&f).expect_err("not utf-8");
        assert!(matches!(e, SysfsError::NotUtf8 { .. }), "{e}");
        assert_eq!(
            read_optional_text(&dir.path().join("absent")).expect("absent is ok"),
            None
        );
        // A directory in place of a file fails on read (EISDIR), even for root.
        let d = dir.path().join("class");
        fs::create_dir(&d).expect("mkdir");
        assert!(matches!(read_text(&d), Err(SysfsError::Read { .. })));
    }

    #[test]
    fn links() {
        let dir = tempfile::tempdir().expect("tempdir");
        let target = dir.path().join("0000:00:02.0");
        fs::create_dir(&target).expect("mkdir");
        let link = dir.path().join("physfn");
        std::os::unix::fs::symlink("0000:00:02.0", &link).expect("symlink");
        assert_eq!(
            read_link_address(&link).expect("ok"),
            Some("0000:00:02.0".parse().expect("addr"))
        );
        let dangling = dir.path().join("virtfn0");
        std::os::unix::fs::symlink("0000:00:09.0", &dangling).expect("symlink");
        let e = read_link_address(&dangling).expect_err("dangling");
        assert!(matches!(e, SysfsError::DanglingLink { .. }), "{e}");
        assert_eq!(
            read_link_name(&dir.path().join("driver")).expect("ok"),
            None
        );
        let grp = dir.path().join("12");
        fs::create_dir(&grp).expect("mkdir");
        let g = dir.path().join("iommu_group");
        std::os::unix::fs::symlink("12", &g).expect("symlink");
        assert_eq!(read_link_number(&g).expect("ok"), Some(12));
        assert!(
            read_link_number(&link).is_err(),
            "an address is no group number"
        );
    }

    proptest! {
        #[test]
        fn parsing_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let text = String::from_utf8_lossy(&bytes);
            let v = trim_value(&text);
            let _ = parse_id16(p(), v);
            let _ = parse_class(p(), v);
            let _ = parse_revision(p(), v);
            let _ = parse_u32(p(), v);
            let _ = parse_numa_node(p(), v);
            let _ = parse_driver_override(v);
            let _ = virtfn_index(v);
            let _ = shown(v);
        }

        #[test]
        fn ids_round_trip(id: u16) {
            prop_assert_eq!(parse_id16(p(), &format!("0x{id:04x}")).expect("ok"), id);
        }
    }
}
