//! Who holds a device's VFIO nodes open: a scan of a proc tree's file descriptors for
//! links to a group node (`<dev_root>/vfio/N`), a per-device node of the iommufd
//! interface (`<dev_root>/vfio/devices/vfioX`), or the node of a device made on it (a
//! mediated device's, a vhost-vdpa node), naming each holder and, for QEMU, its domain.
//!
//! Why: a VFIO group can be opened by one process at a time, so an open group node means
//! the device is in use whatever any database says (I3). Since Linux 6.6 a device bound
//! to vfio-pci can also be opened through its own node, with no group node open at all
//! (QEMU with `iommufd`; libvirt opens the node and passes it on): an open device node
//! means the same. The scan only reads links and small files under the proc root; it
//! never opens a node itself, because holding it open for even a moment would make a
//! starting QEMU fail with EBUSY.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use crate::pci::PciAddress;
use crate::sysfs::{device_dir, vfio_device_nodes, vfio_device_nodes_dir, SysfsError};

/// Why the holders of a device's VFIO nodes could not be determined.
#[derive(Debug, thiserror::Error)]
pub enum VfioError {
    /// Without the process list nothing proves a group unused, so this is an error and
    /// never an empty answer.
    #[error("cannot list processes under {path}: {source}")]
    ProcRoot {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A live process's open files could not be read (another user's process, read
    /// without CAP_SYS_PTRACE, or a proc mounted with `hidepid`): it may hold the node,
    /// so this is an error too, never a skipped process.
    #[error("cannot read the open files of pid {pid} ({path}): {source}; the agent needs CAP_SYS_PTRACE (and a proc without hidepid) to see every process's VFIO nodes")]
    Process {
        pid: u32,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A device's `vfio-dev` directory exists but could not be listed, so its device
    /// node is unknown: an error too, never an empty answer.
    #[error("cannot list the VFIO device nodes of {address}: {}", source.full_message())]
    DeviceNodes {
        address: PciAddress,
        #[source]
        source: SysfsError,
    },
    /// The mediated or vDPA devices made on a function could not be listed, so a node
    /// that shows it in use may be unknown: an error too, never an empty answer.
    #[error("cannot list the mediated and vDPA devices made on {what}: {}", source.full_message())]
    MadeOn {
        what: String,
        #[source]
        source: SysfsError,
    },
}

/// The nodes of the devices made on each function at `addresses` now (see
/// [`crate::sysfs::MadeOn`]), in the order asked (none for a function with none): each
/// mediated device's VFIO group node (`<dev_root>/vfio/N`) and device nodes
/// (`<dev_root>/vfio/devices/vfioX`), and each vhost-vdpa node
/// (`<dev_root>/vhost-vdpa-N`). A process holding any of them uses the function as
/// surely as one holding the function's own group. Sysfs is not read at all where
/// nothing can be made on a function ([`made_on_possible`]).
pub fn made_on_nodes(
    sysfs_root: &Path,
    dev_root: &Path,
    addresses: &[PciAddress],
) -> Result<Vec<Vec<PathBuf>>, VfioError> {
    let mut per_function = vec![Vec::new(); addresses.len()];
    if addresses.is_empty() || !made_on_possible(sysfs_root) {
        return Ok(per_function);
    }
    let listed = |source| VfioError::MadeOn {
        what: match addresses {
            [one] => one.to_string(),
            many => format!("{} functions", many.len()),
        },
        source,
    };
    let made = crate::sysfs::made_on(sysfs_root, addresses).map_err(listed)?;
    for (address, nodes) in addresses.iter().zip(per_function.iter_mut()) {
        let Some(made) = made.get(address) else {
            continue;
        };
        for (dir, group) in &made.mdevs {
            nodes.extend(group.map(|g| dev_root.join("vfio").join(g.to_string())));
            nodes.extend(
                vfio_device_nodes(dir, dev_root).map_err(|source| VfioError::MadeOn {
                    what: address.to_string(),
                    source,
                })?,
            );
        }
        nodes.extend(made.vhost_vdpa.iter().map(|n| dev_root.join(n)));
    }
    Ok(per_function)
}

pub use crate::sysfs::made_on_possible;

/// The iommufd interface's nodes of the devices at `addresses`, as sysfs lists them now:
/// `<dev_root>/vfio/devices/vfioX` for each `vfioX` under a device's `vfio-dev`
/// directory (present while it is bound to vfio-pci; the node exists where the kernel
/// has the device interface, Linux 6.6 and later). A device without that directory, or
/// gone from sysfs, has none; and without `<dev_root>/vfio/devices` no device has one
/// (the kernel lacks the interface, or no device is bound to vfio-pci), so sysfs is not
/// read at all.
pub fn device_nodes(
    sysfs_root: &Path,
    dev_root: &Path,
    addresses: &[PciAddress],
) -> Result<Vec<PathBuf>, VfioError> {
    if !device_nodes_possible(dev_root) {
        return Ok(Vec::new());
    }
    let mut nodes = Vec::new();
    for &address in addresses {
        nodes.extend(
            vfio_device_nodes(&device_dir(sysfs_root, address), dev_root)
                .map_err(|source| VfioError::DeviceNodes { address, source })?,
        );
    }
    Ok(nodes)
}

/// Whether any device node can exist under `dev_root`: false only when
/// `<dev_root>/vfio/devices` does not exist. Any other failure to stat it proves nothing,
/// so it counts as possible.
pub fn device_nodes_possible(dev_root: &Path) -> bool {
    match vfio_device_nodes_dir(dev_root).symlink_metadata() {
        Err(e) => e.kind() != std::io::ErrorKind::NotFound,
        Ok(_) => true,
    }
}

/// "VFIO group /dev/vfio/12", "VFIO device node /dev/vfio/devices/vfio3" or
/// "vhost-vdpa node /dev/vhost-vdpa-0": for messages.
pub fn describe_node(node: &Path) -> String {
    if node == Path::new(VFIO_DEVICE_FD) {
        return format!(
            "VFIO group (possibly: a process holds a VFIO device descriptor, {VFIO_DEVICE_FD}, and no VFIO node that would say which device)"
        );
    }
    let is_device = node
        .parent()
        .and_then(Path::file_name)
        .is_some_and(|d| d == "devices");
    let is_vdpa = node
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with("vhost-vdpa-"));
    let kind = if is_vdpa {
        "vhost-vdpa node"
    } else if is_device {
        "VFIO device node"
    } else {
        "VFIO group"
    };
    format!("{kind} {}", node.display())
}

/// A process holding a VFIO group or device node open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub pid: u32,
    /// The kernel's short command name (`<pid>/comm`); empty if it could not be read.
    pub command: String,
    /// The command line, one entry per argument; empty if it could not be read.
    pub cmdline: Vec<String>,
    /// The domain QEMU was started for, from `-uuid` and `-name` when present.
    pub domain_uuid: Option<uuid::Uuid>,
    pub domain_name: Option<String>,
}

impl Holder {
    /// "pid 4242 (qemu-system-x86, domain instance-0000002a)": for messages.
    pub fn describe(&self) -> String {
        let mut s = format!("pid {}", self.pid);
        let mut parts = Vec::new();
        if !self.command.is_empty() {
            parts.push(self.command.clone());
        }
        match (&self.domain_name, &self.domain_uuid) {
            (Some(n), Some(u)) => parts.push(format!("domain {n} {u}")),
            (Some(n), None) => parts.push(format!("domain {n}")),
            (None, Some(u)) => parts.push(format!("domain {u}")),
            (None, None) => {}
        }
        if !parts.is_empty() {
            s.push_str(&format!(" ({})", parts.join(", ")));
        }
        s
    }
}

/// Every process's open nodes that show a device in use, in one pass over the proc tree:
/// VFIO group and device nodes (anything under `<dev_root>/vfio/`) and vhost-vdpa nodes
/// (`<dev_root>/vhost-vdpa-N`), with their holders, keyed by the node as the kernel
/// reports it: resolved, so look a node up as configured and as resolved (see
/// [`HolderMap::of`]). Shared by every check that waits for the same pass, whatever
/// nodes each asks about.
pub fn holders_under(proc_root: &Path, dev_root: &Path) -> Result<HolderMap, VfioError> {
    let mut roots = vec![dev_root.to_path_buf()];
    roots.extend(
        std::fs::canonicalize(dev_root)
            .ok()
            .filter(|r| r != dev_root),
    );
    let vfio: Vec<PathBuf> = roots.iter().map(|r| r.join("vfio")).collect();
    let by_node = scan_fds(proc_root, |target, keys| {
        let vdpa = target
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("vhost-vdpa-"))
            && target
                .parent()
                .is_some_and(|p| roots.iter().any(|r| r == p));
        if vdpa || vfio.iter().any(|v| target.starts_with(v)) || target == Path::new(VFIO_DEVICE_FD)
        {
            keys.push(target.to_path_buf());
        }
    })?;
    // A VFIO device descriptor keeps its group open after the group's own descriptor is
    // closed, and names no node: a process holding one and no VFIO node at all (it
    // closed the group, or was handed the device's descriptor alone) uses a device
    // nothing here can name.
    // The container (`vfio/vfio`, which every legacy VFIO user keeps open for its DMA
    // mappings) names no device either.
    let containers: Vec<PathBuf> = vfio.iter().map(|v| v.join("vfio")).collect();
    // Nor does a vhost-vdpa node: only a VFIO group or device node says which device.
    let nodes: BTreeSet<u32> = by_node
        .iter()
        .filter(|(k, _)| vfio.iter().any(|v| k.starts_with(v)) && !containers.contains(k))
        .flat_map(|(_, hs)| hs.iter().map(|h| h.pid))
        .collect();
    let unexplained = by_node
        .get(Path::new(VFIO_DEVICE_FD))
        .into_iter()
        .flatten()
        .filter(|h| !nodes.contains(&h.pid))
        .cloned()
        .collect();
    Ok(HolderMap {
        by_node,
        unexplained,
    })
}

/// What `/proc/PID/fd/N` reads for a VFIO device's descriptor (`VFIO_GROUP_GET_DEVICE_FD`).
pub const VFIO_DEVICE_FD: &str = "anon_inode:[vfio-device]";

/// The holders of the nodes [`holders_under`] looks for, from one pass.
#[derive(Debug, Clone, Default)]
pub struct HolderMap {
    by_node: BTreeMap<PathBuf, Vec<Holder>>,
    unexplained: Vec<Holder>,
}

impl HolderMap {
    /// The holders of `node` as the kernel names it (resolved: a dev root behind a
    /// symlink reads as its target); empty when none held it during the pass. Reads
    /// nothing from the file system, so it may run on an async thread.
    pub fn of(&self, node: &Path) -> &[Holder] {
        self.by_node.get(node).map_or(&[], Vec::as_slice)
    }

    /// The processes holding a VFIO device descriptor ([`VFIO_DEVICE_FD`]) and no VFIO
    /// node: which device each uses cannot be told, so each may use any device bound to
    /// vfio-pci.
    pub fn unexplained(&self) -> &[Holder] {
        &self.unexplained
    }
}

/// One pass over the processes under `proc_root`: for each file descriptor's target,
/// `keys` adds the keys it counts under; each key gets every process that has a
/// descriptor counted under it (once, sorted by pid).
fn scan_fds(
    proc_root: &Path,
    mut keys: impl FnMut(&Path, &mut Vec<PathBuf>),
) -> Result<BTreeMap<PathBuf, Vec<Holder>>, VfioError> {
    let mut out: BTreeMap<PathBuf, Vec<Holder>> = BTreeMap::new();
    let entries = std::fs::read_dir(proc_root).map_err(|source| VfioError::ProcRoot {
        path: proc_root.to_path_buf(),
        source,
    })?;
    for entry in entries {
        // A listing cut short would leave every process after the cut unchecked.
        let entry = entry.map_err(|source| VfioError::ProcRoot {
            path: proc_root.to_path_buf(),
            source,
        })?;
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let dir = entry.path();
        let mut held: Vec<PathBuf> = Vec::new();
        let listed = match fds_held(pid, &dir.join("fd"), &mut keys, &mut held)? {
            Some(listed) => listed,
            None => continue,
        };
        // A process whose first thread exited (pthread_exit) while others go on lists no
        // descriptor of its own: the table the others share is under each of theirs.
        // (A kernel thread lists none either, and has no other thread.)
        if listed == 0 {
            let unreadable =
                |path: PathBuf, source: std::io::Error| VfioError::Process { pid, path, source };
            let task_dir = dir.join("task");
            let tasks = match std::fs::read_dir(&task_dir) {
                Ok(tasks) => Some(tasks),
                Err(e) if gone(&e) => None,
                Err(e) => return Err(unreadable(task_dir, e)),
            };
            let own = pid.to_string();
            for task in tasks.into_iter().flatten() {
                let task = match task {
                    Ok(task) => task,
                    Err(e) if gone(&e) => break,
                    Err(e) => return Err(unreadable(task_dir, e)),
                };
                if task.file_name().to_str() == Some(own.as_str()) {
                    continue;
                }
                let fd_dir = task.path().join("fd");
                if fds_held(pid, &fd_dir, &mut keys, &mut held)?.is_some_and(|n| n > 0) {
                    break;
                }
            }
        }
        if held.is_empty() {
            continue;
        }
        let holder = describe_process(pid, &dir);
        for node in held {
            out.entry(node).or_default().push(holder.clone());
        }
    }
    for list in out.values_mut() {
        list.sort_by_key(|h| h.pid);
    }
    Ok(out)
}

/// Adds to `held` the keys of every descriptor in `fd_dir` (a process's or a thread's
/// `fd`) that `keys` counts: how many descriptors it listed, or `None` when the process
/// or thread is gone.
fn fds_held(
    pid: u32,
    fd_dir: &Path,
    keys: &mut impl FnMut(&Path, &mut Vec<PathBuf>),
    held: &mut Vec<PathBuf>,
) -> Result<Option<usize>, VfioError> {
    // A process may exit at any moment, and a file descriptor be closed: what is gone
    // holds nothing. Anything else unreadable may hide a holder.
    let unreadable =
        |path: PathBuf, source: std::io::Error| VfioError::Process { pid, path, source };
    let fds = match std::fs::read_dir(fd_dir) {
        Ok(fds) => fds,
        Err(e) if gone(&e) => return Ok(None),
        Err(e) => return Err(unreadable(fd_dir.to_path_buf(), e)),
    };
    // Each descriptor's link is read relative to the directory held open: one lookup
    // of its name, not a walk through the proc root and the process's directory.
    let at = match std::fs::File::open(fd_dir) {
        Ok(at) => at,
        Err(e) if gone(&e) => return Ok(None),
        Err(e) => return Err(unreadable(fd_dir.to_path_buf(), e)),
    };
    let mut found = Vec::new();
    let mut listed = 0;
    for fd in fds {
        let fd = match fd {
            Ok(fd) => fd,
            Err(e) if gone(&e) => break,
            Err(e) => return Err(unreadable(fd_dir.to_path_buf(), e)),
        };
        listed += 1;
        let target = match nix::fcntl::readlinkat(&at, fd.file_name().as_os_str()) {
            Ok(t) => PathBuf::from(t),
            Err(e) => {
                let e = std::io::Error::from(e);
                if gone(&e) {
                    continue;
                }
                return Err(unreadable(fd.path(), e));
            }
        };
        keys(&target, &mut found);
        for key in found.drain(..) {
            if !held.contains(&key) {
                held.push(key);
            }
        }
    }
    Ok(Some(listed))
}

/// Whether a proc read failed because what it read is gone (the process exited, the
/// descriptor was closed).
fn gone(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::NotFound || e.raw_os_error() == Some(nix::libc::ESRCH)
}

/// The most of a process's `comm` or `cmdline` read for its description: a command line
/// can be megabytes long, and the description only names the process.
const DESCRIBE_MAX: u64 = 64 * 1024;

/// At most [`DESCRIBE_MAX`] bytes of a file.
fn read_start(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut out = Vec::new();
    std::fs::File::open(path)?
        .take(DESCRIBE_MAX)
        .read_to_end(&mut out)?;
    Ok(out)
}

fn describe_process(pid: u32, dir: &Path) -> Holder {
    let command = read_start(&dir.join("comm"))
        .map(|b| String::from_utf8_lossy(&b).trim_end().to_string())
        .unwrap_or_default();
    let cmdline: Vec<String> = read_start(&dir.join("cmdline"))
        .map(|b| {
            b.split(|c| *c == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect()
        })
        .unwrap_or_default();
    let (domain_uuid, domain_name) = qemu_domain(&cmdline);
    Holder {
        pid,
        command,
        cmdline,
        domain_uuid,
        domain_name,
    }
}

/// QEMU's `-uuid U` and `-name N` (libvirt writes `-name guest=N,debug-threads=on`,
/// with `,,` escaping a comma in the name).
pub fn qemu_domain(cmdline: &[String]) -> (Option<uuid::Uuid>, Option<String>) {
    let mut uuid = None;
    let mut name = None;
    let mut args = cmdline.iter();
    while let Some(a) = args.next() {
        match a.as_str() {
            "-uuid" => uuid = args.next().and_then(|u| u.parse().ok()),
            "-name" => name = args.next().and_then(|n| qemu_name(n)),
            _ => {}
        }
    }
    (uuid, name)
}

fn qemu_name(opt: &str) -> Option<String> {
    // Split on single commas; ",," is a literal comma.
    let mut parts = Vec::new();
    let mut cur = String::new();
    let mut chars = opt.chars().peekable();
    while let Some(c) = chars.next() {
        if c == ',' {
            if chars.peek() == Some(&',') {
                chars.next();
                cur.push(',');
            } else {
                parts.push(std::mem::take(&mut cur));
            }
        } else {
            cur.push(c);
        }
    }
    parts.push(cur);
    let first = parts.first()?;
    let found = parts
        .iter()
        .find_map(|p| p.strip_prefix("guest=").map(str::to_string))
        .or_else(|| (!first.contains('=')).then(|| first.clone()))?;
    (!found.is_empty()).then_some(found)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn args(s: &[&str]) -> Vec<String> {
        s.iter().map(|a| a.to_string()).collect()
    }

    #[test]
    fn qemu_names_and_uuids() {
        let u = "5f0c2d4e-8a52-4c1b-9d6e-0a1b2c3d4e5f";
        let (uuid, name) = qemu_domain(&args(&[
            "/usr/bin/qemu-system-x86_64",
            "-name",
            "guest=instance-0000002a,debug-threads=on",
            "-uuid",
            u,
        ]));
        assert_eq!(uuid.map(|u| u.to_string()).as_deref(), Some(u));
        assert_eq!(name.as_deref(), Some("instance-0000002a"));
        assert_eq!(
            qemu_domain(&args(&["qemu", "-name", "a,,b,process=x"])).1,
            Some("a,b".into())
        );
        assert_eq!(qemu_domain(&args(&["qemu", "-name"])), (None, None));
        assert_eq!(qemu_domain(&args(&["qemu", "-uuid", "nope"])), (None, None));
        assert_eq!(qemu_domain(&args(&["qemu", "-name", "process=x"])).1, None);
    }

    #[test]
    fn finds_holders_and_tolerates_junk() {
        let t = tempfile::tempdir().expect("tmp");
        let proc_root = t.path().join("proc");
        let node = t.path().join("dev/vfio/7");
        let other = t.path().join("dev/vfio/8");
        std::fs::create_dir_all(node.parent().expect("parent")).expect("mkdir");
        std::fs::write(&node, "").expect("node");
        std::fs::write(&other, "").expect("node");
        let proc_dir = |pid: &str| {
            let d = proc_root.join(pid);
            std::fs::create_dir_all(d.join("fd")).expect("mkdir");
            d
        };
        let q = proc_dir("4242");
        std::fs::write(q.join("comm"), "qemu-system-x86\n").expect("comm");
        std::fs::write(
            q.join("cmdline"),
            b"qemu-system-x86_64\0-name\0guest=vm1,debug-threads=on\0-uuid\x005f0c2d4e-8a52-4c1b-9d6e-0a1b2c3d4e5f\0",
        )
        .expect("cmdline");
        // An unrelated open file.
        symlink(t.path().join("log"), q.join("fd/0")).expect("link");
        symlink(&node, q.join("fd/23")).expect("link");
        symlink(&node, q.join("fd/24")).expect("link");
        // A process without comm/cmdline (it exited mid-scan) holding the other node.
        let z = proc_dir("17");
        symlink(&other, z.join("fd/3")).expect("link");
        // A process whose fd directory is gone, a non-pid entry, a dangling link.
        std::fs::create_dir_all(proc_root.join("99")).expect("mkdir");
        std::fs::create_dir_all(proc_root.join("self/fd")).expect("mkdir");
        symlink(&node, proc_root.join("self/fd/1")).expect("link");
        let d = proc_dir("5");
        symlink("/nonexistent/x", d.join("fd/1")).expect("link");

        let dev = t.path().join("dev");
        // Also a vhost-vdpa node, and open files that are no device's: a terminal, a node
        // outside the dev root.
        let vdpa = dev.join("vhost-vdpa-2");
        std::fs::write(&vdpa, "").expect("node");
        let v = proc_dir("777");
        symlink(&vdpa, v.join("fd/5")).expect("link");
        symlink(dev.join("tty"), v.join("fd/0")).expect("link");
        symlink("/elsewhere/vfio/7", v.join("fd/6")).expect("link");
        let all = holders_under(&proc_root, &dev).expect("scan");
        let h = all.of(&node);
        assert_eq!(h.len(), 1, "{h:?}");
        assert_eq!(h[0].pid, 4242);
        assert_eq!(h[0].command, "qemu-system-x86");
        assert_eq!(h[0].domain_name.as_deref(), Some("vm1"));
        assert_eq!(
            h[0].describe(),
            "pid 4242 (qemu-system-x86, domain vm1 5f0c2d4e-8a52-4c1b-9d6e-0a1b2c3d4e5f)"
        );
        let h = all.of(&other);
        assert_eq!(h.len(), 1);
        assert_eq!((h[0].pid, h[0].command.as_str()), (17, ""));
        assert_eq!(h[0].describe(), "pid 17");
        assert_eq!(
            all.of(&vdpa).iter().map(|h| h.pid).collect::<Vec<_>>(),
            [777]
        );
        assert!(all.of(&dev.join("vfio/9")).is_empty());
        assert!(
            all.of(&dev.join("tty")).is_empty(),
            "not a node that shows use"
        );
        assert!(all.of(Path::new("/elsewhere/vfio/7")).is_empty());
        let err = holders_under(&t.path().join("no-proc"), &dev).expect_err("missing root");
        assert!(err.to_string().contains("no-proc"), "{err}");
    }

    /// A process whose first thread exited while another holds the node: its own `fd`
    /// lists nothing, the other thread's lists the node, and the process is its holder.
    /// A kernel thread (no descriptors, no other thread) holds nothing. Before, only
    /// `<pid>/fd` was read, and such a holder was missed.
    #[test]
    fn a_holder_whose_first_thread_exited_is_found_through_its_threads() {
        let t = tempfile::tempdir().expect("tmp");
        let proc_root = t.path().join("proc");
        let dev = t.path().join("dev");
        let node = dev.join("vfio/7");
        std::fs::create_dir_all(node.parent().expect("parent")).expect("mkdir");
        std::fs::write(&node, "").expect("node");
        for dir in [
            "500/fd",
            "500/task/500/fd",
            "500/task/501/fd",
            "600/fd",
            "600/task/600/fd",
        ] {
            std::fs::create_dir_all(proc_root.join(dir)).expect("mkdir");
        }
        std::fs::write(proc_root.join("500/comm"), "dpdk-app\n").expect("comm");
        symlink(&node, proc_root.join("500/task/501/fd/9")).expect("link");
        let all = holders_under(&proc_root, &dev).expect("scan");
        let h = all.of(&node);
        assert_eq!(
            h.iter()
                .map(|h| (h.pid, h.command.as_str()))
                .collect::<Vec<_>>(),
            [(500, "dpdk-app")]
        );
    }

    /// A holder's description reads the start of a huge command line, not all of it.
    #[test]
    fn a_huge_command_line_is_read_only_in_part() {
        let t = tempfile::tempdir().expect("tmp");
        let dir = t.path().join("600");
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join("comm"), "x".repeat(200_000)).expect("comm");
        std::fs::write(dir.join("cmdline"), b"qemu\0".repeat(100_000)).expect("cmdline");
        let h = describe_process(600, &dir);
        assert_eq!(h.command.len() as u64, DESCRIBE_MAX);
        // Arguments and the NULs between them.
        let read: usize = h.cmdline.iter().map(|a| a.len() + 1).sum::<usize>() - 1;
        assert!(read as u64 <= DESCRIBE_MAX && read > 60_000, "{read}");
    }

    /// A live process whose open files cannot be read may hold the node: the scan says
    /// it cannot tell, naming the process, rather than skip it. (As root, a mode cannot
    /// deny the read; an `fd` that is not a directory fails it the same way.)
    #[test]
    fn a_process_whose_open_files_cannot_be_read_is_an_error() {
        let t = tempfile::tempdir().expect("tmp");
        let proc_root = t.path().join("proc");
        let node = t.path().join("dev/vfio/7");
        std::fs::create_dir_all(node.parent().expect("parent")).expect("mkdir");
        std::fs::write(&node, "").expect("node");
        std::fs::create_dir_all(proc_root.join("300")).expect("mkdir");
        std::fs::write(proc_root.join("300/fd"), "").expect("not a directory");
        let err = holders_under(&proc_root, &t.path().join("dev")).expect_err("unreadable");
        assert!(
            matches!(&err, VfioError::Process { pid: 300, .. }),
            "{err:?}"
        );
        assert!(err.to_string().contains("CAP_SYS_PTRACE"), "{err}");
    }

    #[test]
    fn device_nodes_as_sysfs_lists_them() {
        let t = tempfile::tempdir().expect("tmp");
        let (sys, dev) = (t.path().join("sys"), t.path().join("dev"));
        let at = |a: &str| -> Vec<PciAddress> { vec![a.parse().expect("address")] };
        let devices = sys.join("bus/pci/devices");
        // Bound to vfio-pci: one node, among entries that are not nodes.
        let bound = devices.join("0000:3b:10.1/vfio-dev");
        for d in ["vfio3", "vfio", "vfiox", "power"] {
            std::fs::create_dir_all(bound.join(d)).expect("mkdir");
        }
        // A `vfio-dev` that cannot be listed.
        let odd = devices.join("0000:3b:10.4");
        std::fs::create_dir_all(&odd).expect("mkdir");
        std::fs::write(odd.join("vfio-dev"), "").expect("file");
        // No `<dev>/vfio/devices`: no device node can exist, and sysfs is not read.
        for a in ["0000:3b:10.1", "0000:3b:10.4"] {
            assert!(device_nodes(&sys, &dev, &at(a)).expect("none").is_empty());
        }
        std::fs::create_dir_all(dev.join("vfio/devices")).expect("mkdir");
        assert_eq!(
            device_nodes(&sys, &dev, &at("0000:3b:10.1")).expect("read"),
            vec![dev.join("vfio/devices/vfio3")]
        );
        // Not bound to vfio-pci, and gone from sysfs: none, and no error.
        std::fs::create_dir_all(devices.join("0000:3b:10.2")).expect("mkdir");
        for a in ["0000:3b:10.2", "0000:3b:10.3"] {
            assert!(device_nodes(&sys, &dev, &at(a)).expect("read").is_empty());
        }
        // A `vfio-dev` that cannot be listed: an error naming it, never "none", also
        // when another device's nodes were found.
        let both: Vec<PciAddress> = ["0000:3b:10.1", "0000:3b:10.4"]
            .iter()
            .map(|a| a.parse().expect("address"))
            .collect();
        for addresses in [at("0000:3b:10.4"), both] {
            let err = device_nodes(&sys, &dev, &addresses).expect_err("not a dir");
            assert!(err.to_string().contains("0000:3b:10.4/vfio-dev"), "{err}");
        }
    }

    #[test]
    fn nodes_are_described_by_kind() {
        let dev = Path::new("fake/dev");
        assert_eq!(
            describe_node(&dev.join("vfio/12")),
            "VFIO group fake/dev/vfio/12"
        );
        assert_eq!(
            describe_node(&vfio_device_nodes_dir(dev).join("vfio3")),
            "VFIO device node fake/dev/vfio/devices/vfio3"
        );
    }
}
