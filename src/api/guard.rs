//! The checks made right before any free (Release, acting Reconcile): libvirt's domains
//! listed afresh and applied to the ledger, so the writer decides with that view, and the
//! VFIO holders of the device's group and device nodes (and those of mediated and vDPA
//! devices made on it) scanned from the proc tree.
//!
//! Why fresh: the poller's view may be seconds old, and the seed race is exactly a VM
//! that appeared after someone's snapshot. Why under one lock: the poller takes the same
//! `order` lock across its list-and-apply, so an older poll result can never be applied
//! between the fresh list and the free that relies on it.
//!
//! Why shared: a free needs a listing that began after it arrived, not one of its own.
//! Frees that arrive while a listing is under way all wait for the next one, so an
//! evacuation's burst of releases costs two listings, not one each in a queue. The passes
//! over the proc tree are shared the same way.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::api::status::ApiError;
use crate::config::Config;
use crate::domains::{DomainsError, Libvirt};
use crate::metrics::Metrics;
use crate::vfio::{Holder, HolderMap, VfioError};
use crate::writer::Writer;

/// Up to this many group nodes are checked for existence on the calling task.
const INLINE_NODE_CHECKS: usize = 4;

/// The VFIO nodes that would show one device in use: its IOMMU group's nodes, named
/// without any I/O, and the members of that group (the device first), whose device
/// nodes sysfs lists when the check runs, as it lists the nodes of mediated and vDPA
/// devices made on the device itself.
#[derive(Debug, Clone, Default)]
pub struct VfioCheck {
    pub group_nodes: Vec<PathBuf>,
    pub members: Vec<crate::pci::PciAddress>,
}

/// A node found held open, with its first holder.
pub type Held = (PathBuf, Holder);

/// What a free is checked against.
#[derive(Debug)]
pub struct FreeGuard {
    /// `None` when `[libvirt] enabled = false`: no domain is ever seen, and frees skip the
    /// domain check (GetStatus says so).
    pub libvirt: Option<Arc<Libvirt>>,
    /// How long a free waits for libvirt (and for the poller to finish a poll).
    pub timeout: Duration,
    pub proc_root: PathBuf,
    /// Where VFIO group nodes live (`<dev_root>/vfio/N`), and device nodes
    /// (`<dev_root>/vfio/devices/vfioX`).
    pub dev_root: PathBuf,
    /// Where sysfs lists a device's VFIO device nodes
    /// (`<sysfs_root>/bus/pci/devices/<address>/vfio-dev`).
    pub sysfs_root: PathBuf,
    /// Serializes "list domains, apply" of the poller with "list, apply, free" here. No
    /// one waits for the rescanner's turn while holding it: an acting audit that gives
    /// drivers back takes the turn first, or only tries to take it under this lock.
    pub order: Arc<tokio::sync::Mutex<()>>,
    /// The fresh listings begun and applied here, so that frees share them.
    lists: Listings,
    /// The passes over the proc tree, shared the same way.
    scans: Arc<Scans>,
    /// Where the passes are counted.
    metrics: Arc<Metrics>,
}

/// Numbers the fresh listings, so that a caller can tell whether one that began after it
/// arrived has been applied. Changed only under the order lock.
#[derive(Debug, Default)]
struct Listings {
    /// How many listings have begun.
    begun: AtomicU64,
    /// The number of the last listing applied to the ledger (0: none yet).
    applied: AtomicU64,
}

impl Listings {
    /// Taken when a caller arrives, before it waits for the order lock.
    fn arrive(&self) -> u64 {
        self.begun.load(Ordering::SeqCst)
    }

    /// Under the order lock: whether a listing that began after the caller arrived
    /// (numbered above `arrived`) is applied. Listings are applied in the order they
    /// begin, so a later one is fresher still.
    fn served(&self, arrived: u64) -> bool {
        self.applied.load(Ordering::SeqCst) > arrived
    }

    /// Under the order lock: the number of a listing about to begin.
    fn begin(&self) -> u64 {
        self.begun.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// Under the order lock: listing `n` is applied.
    fn applied(&self, n: u64) {
        self.applied.store(n, Ordering::SeqCst);
    }
}

/// Held while a free is checked and carried out.
pub type OrderGuard = tokio::sync::OwnedMutexGuard<()>;

impl FreeGuard {
    pub fn from_config(cfg: &Config, metrics: Arc<Metrics>) -> FreeGuard {
        FreeGuard {
            metrics,
            libvirt: cfg.libvirt.enabled.then(|| {
                Arc::new(Libvirt::new(
                    cfg.libvirt.uri.clone(),
                    cfg.sysfs_root.clone(),
                ))
            }),
            timeout: Duration::from_millis(cfg.libvirt.timeout_ms),
            proc_root: cfg.proc_root.clone(),
            dev_root: cfg.dev_root.clone(),
            sysfs_root: cfg.sysfs_root.clone(),
            order: Arc::new(tokio::sync::Mutex::new(())),
            lists: Listings::default(),
            scans: Arc::default(),
        }
    }

    /// Takes the order lock and makes sure that a listing of the domains that began after
    /// this call is applied to the ledger: one made for an earlier caller while this one
    /// waited, or else its own. With libvirt disabled only the lock is taken.
    /// `what` names the devices checked, in errors.
    pub async fn refresh(&self, writer: &Writer, what: &str) -> Result<OrderGuard, ApiError> {
        let arrived = self.lists.arrive();
        let guard = self.take_order(what).await?;
        if let Some(lv) = &self.libvirt {
            if !self.lists.served(arrived) {
                let unreachable = |source| ApiError::LibvirtUnreachable {
                    what: what.to_string(),
                    source: Box::new(source),
                };
                let n = self.lists.begin();
                let list = lv.list_fresh(self.timeout).await.map_err(unreachable)?;
                writer.domains(list).await.map_err(|e| {
                    unreachable(DomainsError::Thread(format!(
                        "applying the domains failed: {e}"
                    )))
                })?;
                self.lists.applied(n);
            }
        }
        Ok(guard)
    }

    /// Takes the order lock, waiting at most the libvirt timeout: past it, whoever holds
    /// the lock (a listing libvirt is slow to answer, or the frees it checks) is named as
    /// the cause, not libvirt.
    async fn take_order(&self, what: &str) -> Result<OrderGuard, ApiError> {
        tokio::time::timeout(self.timeout, self.order.clone().lock_owned())
            .await
            .map_err(|_| ApiError::FreeCheckBusy {
                what: what.to_string(),
                ms: self.timeout.as_millis(),
            })
    }

    /// For each device, in order, the first of its nodes found held open (`None`: none
    /// is): its device nodes and those of devices made on it listed from sysfs, off the
    /// async threads, and then a pass over the proc tree that began after this call
    /// arrived, shared with every other check waiting for one (see `Scans`).
    pub async fn held(&self, devices: Vec<VfioCheck>) -> Result<Vec<Option<Held>>, VfioError> {
        if devices.is_empty() {
            return Ok(Vec::new());
        }
        let arrived = self.scans.arrive();
        // One device (a Release): a node that does not exist cannot be held open, and
        // asking costs a stat or five, less than the thread hand-off a blocking task
        // needs. Usually none exists, sysfs is not listed and the proc tree not read.
        if let [one] = devices.as_slice() {
            if one.group_nodes.len() <= INLINE_NODE_CHECKS
                && !one.group_nodes.iter().any(|n| n.symlink_metadata().is_ok())
                && !crate::vfio::device_nodes_possible(&self.dev_root)
                && !crate::vfio::made_on_possible(&self.sysfs_root)
            {
                return Ok(vec![None]);
            }
        }
        let (sysfs_root, dev_root) = (self.sysfs_root.clone(), self.dev_root.clone());
        let (per_device, any) = tokio::task::spawn_blocking(move || {
            // Devices made on each function itself (not on its group's peers: each mdev
            // has a group of its own, and a vDPA device none at all), listed once for all.
            let functions: Vec<_> = devices
                .iter()
                .filter_map(|d| d.members.first().copied())
                .collect();
            let mut made_on =
                crate::vfio::made_on_nodes(&sysfs_root, &dev_root, &functions)?.into_iter();
            let mut per_device = Vec::with_capacity(devices.len());
            for d in devices {
                let mut nodes = d.group_nodes;
                nodes.extend(crate::vfio::device_nodes(
                    &sysfs_root,
                    &dev_root,
                    &d.members,
                )?);
                if !d.members.is_empty() {
                    nodes.extend(made_on.next().unwrap_or_default());
                }
                per_device.push(nodes);
            }
            // A node that does not exist cannot be held open; without any, the proc tree
            // need not be read at all (a host without VFIO, the demo). Each that exists
            // is looked up as configured and as resolved (the kernel names an open file
            // by its resolved path), resolved here, off the async threads.
            let existing: Vec<Vec<(PathBuf, Option<PathBuf>)>> = per_device
                .into_iter()
                .map(|nodes| {
                    nodes
                        .into_iter()
                        .filter(|n| n.symlink_metadata().is_ok())
                        .map(|n| {
                            let resolved = std::fs::canonicalize(&n).ok().filter(|r| *r != n);
                            (n, resolved)
                        })
                        .collect()
                })
                .collect();
            let any = existing.iter().any(|nodes| !nodes.is_empty());
            Ok::<_, VfioError>((existing, any))
        })
        .await
        .unwrap_or_else(|e| Err(self.scan_failed(e)))?;
        if !any {
            return Ok(vec![None; per_device.len()]);
        }
        let holders = self.scan_after(arrived).await?;
        let vfio_root = self.dev_root.join("vfio");
        Ok(per_device
            .into_iter()
            .map(|nodes| {
                let any_node = nodes.iter().any(|(n, _)| n.starts_with(&vfio_root));
                let named = nodes.into_iter().find_map(|(n, resolved)| {
                    let by_name = holders.of(&n).first();
                    let h = by_name.or_else(|| holders.of(resolved.as_deref()?).first());
                    h.cloned().map(|h| (n, h))
                });
                // A device with a VFIO node (its group's, or its own) may be the one a
                // process holds through a device descriptor alone, which names none.
                named.or_else(|| {
                    let h = holders.unexplained().first().filter(|_| any_node)?;
                    Some((PathBuf::from(crate::vfio::VFIO_DEVICE_FD), h.clone()))
                })
            })
            .collect())
    }

    /// The holders found by a pass over the proc tree that began after `arrived` (see
    /// [`Scans::arrive`]): one that ran while this call waited for the pass before it, or
    /// else its own. One pass runs at a time, whoever asks (a burst of releases, audits
    /// of any reader), and a failed pass serves no one but its caller.
    async fn scan_after(&self, arrived: u64) -> Result<Arc<HolderMap>, VfioError> {
        let queued = Queued::join(&self.scans.queued);
        let mut last = self.scans.last.clone().lock_owned().await;
        drop(queued);
        if let Some((n, holders)) = &*last {
            if *n > arrived {
                let holders = holders.clone();
                if !self.scans.keep() {
                    *last = None;
                }
                return Ok(holders);
            }
        }
        let n = self.scans.begun.fetch_add(1, Ordering::SeqCst) + 1;
        let (proc_root, dev_root) = (self.proc_root.clone(), self.dev_root.clone());
        let (scans, metrics) = (self.scans.clone(), self.metrics.clone());
        // The pass holds the lock until it ends and leaves its answer for those waiting,
        // even if this caller goes away meanwhile (a client that disconnects): a caller
        // that came and went must not leave a pass running beside the next one.
        let pass = tokio::spawn(async move {
            let holders = tokio::task::spawn_blocking(move || {
                crate::vfio::holders_under(&proc_root, &dev_root)
            })
            .await
            .map_err(|e| e.to_string())?
            .map(Arc::new);
            if let Ok(holders) = &holders {
                *last = scans.keep().then(|| (n, holders.clone()));
                metrics.holder_scan();
            }
            Ok::<_, String>(holders)
        });
        match pass.await {
            Ok(Ok(holders)) => holders,
            Ok(Err(e)) => Err(self.scan_failed(e)),
            Err(e) => Err(self.scan_failed(e.to_string())),
        }
    }

    /// A task that ended without an answer (it panicked): nothing is known.
    fn scan_failed(&self, e: impl ToString) -> VfioError {
        VfioError::ProcRoot {
            path: self.proc_root.clone(),
            source: std::io::Error::other(e.to_string()),
        }
    }
}

/// The passes over the proc tree for VFIO holders, numbered so that a check can tell
/// whether one that began after it arrived is done. Why shared: a pass reads every
/// process's open files, and an evacuation's burst of releases, or audits sent by any
/// reader, would otherwise each make one, all at once on the blocking threads. Checks
/// that arrive while a pass runs all wait for the next one, so a burst costs two passes
/// and no more than one runs at a time.
#[derive(Debug, Default)]
struct Scans {
    /// How many passes have begun (changed only under `last`'s lock).
    begun: AtomicU64,
    /// The last pass that succeeded, with its number, while checks wait that it may
    /// serve; locked while a pass runs.
    last: Arc<tokio::sync::Mutex<Option<Pass>>>,
    /// How many checks wait for `last`'s lock.
    queued: AtomicUsize,
}

/// A pass's number and its answer.
type Pass = (u64, Arc<HolderMap>);

/// One check counted in [`Scans::queued`] until it has the lock, or gives up waiting
/// (its caller went away).
struct Queued<'a>(&'a AtomicUsize);

impl<'a> Queued<'a> {
    fn join(count: &'a AtomicUsize) -> Queued<'a> {
        count.fetch_add(1, Ordering::SeqCst);
        Queued(count)
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Scans {
    /// Taken when a check arrives, before it waits for a pass.
    fn arrive(&self) -> u64 {
        self.begun.load(Ordering::SeqCst)
    }

    /// Whether a pass's answer is to be kept: only while checks wait that it may serve,
    /// since it names every process holding a node, with its command line.
    fn keep(&self) -> bool {
        self.queued.load(Ordering::SeqCst) > 0
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use std::sync::atomic::Ordering;

    use super::{FreeGuard, Listings, VfioCheck};
    use crate::api::status::ApiError;

    /// A free that cannot take the order within the libvirt timeout (an acting audit
    /// holds it) is refused naming that wait, not an unreachable libvirt; once the lock
    /// is free it is taken.
    #[tokio::test]
    async fn a_free_kept_waiting_for_the_order_is_refused_as_busy() {
        let mut g = FreeGuard::from_config(
            &crate::config::Config::default(),
            crate::metrics::Metrics::new(),
        );
        g.timeout = Duration::from_millis(50);
        let held = g.order.clone().lock_owned().await;
        let e = g.take_order("0000:3b:02.0").await.expect_err("held");
        assert!(
            matches!(&e, ApiError::FreeCheckBusy { what, ms: 50 } if what == "0000:3b:02.0"),
            "{e}"
        );
        let status = crate::api::status::to_status(&e);
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert!(status.message().contains("50 ms"), "{}", status.message());
        drop(held);
        g.take_order("0000:3b:02.0").await.expect("free");
    }

    #[test]
    fn callers_that_arrive_during_a_listing_share_the_next_one() {
        let l = Listings::default();
        // A arrives and lists (1). B and C arrive while listing 1 is under way.
        let a = l.arrive();
        assert!(!l.served(a));
        let one = l.begin();
        let (b, c) = (l.arrive(), l.arrive());
        l.applied(one);
        assert!(l.served(a), "A is served by its own listing");
        // Listing 1 began before B arrived: B lists again (2), and that serves C too.
        assert!(
            !l.served(b),
            "a listing begun before B arrived never serves B"
        );
        let two = l.begin();
        l.applied(two);
        assert!(l.served(b));
        assert!(l.served(c), "C shares B's listing");
        // D arrives after both: nothing applied began after it.
        let d = l.arrive();
        assert!(!l.served(d));
    }

    #[test]
    fn a_failed_listing_serves_nobody() {
        let l = Listings::default();
        let a = l.arrive();
        let _failed = l.begin();
        let b = l.arrive();
        // Listing 1 failed: never applied. A tries again (2), which serves B as well.
        assert!(!l.served(a));
        assert!(!l.served(b));
        let two = l.begin();
        l.applied(two);
        assert!(l.served(a) && l.served(b));
    }

    /// A guard over a proc tree and a dev root of its own (in the fake trees' scratch
    /// space), with one VFIO group node.
    struct Fixture {
        dir: tempfile::TempDir,
        proc_root: std::path::PathBuf,
        node: std::path::PathBuf,
        metrics: std::sync::Arc<crate::metrics::Metrics>,
        guard: std::sync::Arc<FreeGuard>,
    }

    impl Fixture {
        fn new() -> Fixture {
            let dir = tempfile::tempdir_in(crate::simhost::scratch_base()).expect("tmp");
            let (proc_root, dev_root) = (dir.path().join("proc"), dir.path().join("dev"));
            std::fs::create_dir_all(&proc_root).expect("proc");
            std::fs::create_dir_all(dev_root.join("vfio")).expect("dev");
            let node = dev_root.join("vfio/7");
            std::fs::write(&node, "").expect("node");
            let metrics = crate::metrics::Metrics::new();
            let cfg = crate::config::Config {
                proc_root: proc_root.clone(),
                dev_root,
                ..Default::default()
            };
            let guard = std::sync::Arc::new(FreeGuard::from_config(&cfg, metrics.clone()));
            Fixture {
                dir,
                proc_root,
                node,
                metrics,
                guard,
            }
        }

        /// The check of a device whose group node is the fixture's.
        fn check(&self) -> VfioCheck {
            VfioCheck {
                group_nodes: vec![self.node.clone()],
                members: Vec::new(),
            }
        }
    }

    /// Checks that arrive while a pass over the proc tree runs all wait for the next pass
    /// and share it (one pass for all of them, each answered from it); a check arriving
    /// after that pass makes its own, and a process gone by then no longer holds the node.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn checks_that_arrive_during_a_pass_share_the_next_one() {
        let f = Fixture::new();
        let qemu = f.proc_root.join("4242");
        std::fs::create_dir_all(qemu.join("fd")).expect("proc");
        std::fs::write(qemu.join("comm"), "qemu-system-x86\n").expect("comm");
        std::os::unix::fs::symlink(&f.node, qemu.join("fd/30")).expect("fd");
        let (g, metrics, node) = (f.guard.clone(), f.metrics.clone(), f.node.clone());
        let check = || f.check();

        // A pass is under way (its lock held): three checks arrive and wait.
        let running = g.scans.last.lock().await;
        let waiting: Vec<_> = (0..3)
            .map(|_| {
                let (g, c) = (g.clone(), check());
                tokio::spawn(async move { g.held(vec![c]).await })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(metrics.holder_scans(), 0);
        drop(running);
        for w in waiting {
            let held = w.await.expect("task").expect("check");
            let (n, h) = held[0].clone().expect("held");
            assert_eq!((n, h.pid), (node.clone(), 4242));
        }
        assert_eq!(metrics.holder_scans(), 1, "one pass served all three");
        assert!(
            g.scans.last.lock().await.is_none(),
            "a pass's answer is let go once no check waits for it"
        );

        // Later, after the process is gone: a pass of its own, which sees that.
        std::fs::remove_dir_all(&qemu).expect("exit");
        assert_eq!(g.held(vec![check()]).await.expect("check"), vec![None]);
        assert_eq!(metrics.holder_scans(), 2);
    }

    /// A check whose caller goes away while its pass runs (a client that disconnects)
    /// leaves the pass running to its end, still holding the lock and counted, so the
    /// next check waits for it instead of starting a second pass beside it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pass_whose_caller_went_away_still_runs_alone_to_its_end() {
        let f = Fixture::new();
        // Enough processes that a pass takes a while (tens of milliseconds at least).
        let other = f.dir.path().join("log");
        for pid in 1000..4000 {
            let fd = f.proc_root.join(format!("{pid}/fd"));
            std::fs::create_dir_all(&fd).expect("proc");
            for n in 0..8 {
                std::os::unix::fs::symlink(&other, fd.join(n.to_string())).expect("fd");
            }
        }
        let (g, metrics) = (f.guard.clone(), f.metrics.clone());
        let check = || f.check();
        let first = {
            let (g, c) = (g.clone(), check());
            tokio::spawn(async move { g.held(vec![c]).await })
        };
        while g.scans.begun.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
        first.abort();
        assert!(first.await.is_err(), "the caller went away");
        assert!(
            g.scans.last.try_lock().is_err(),
            "the abandoned pass still runs, holding the lock"
        );
        assert_eq!(g.held(vec![check()]).await.expect("check"), vec![None]);
        assert_eq!(
            metrics.holder_scans(),
            2,
            "the abandoned pass ran to its end, then the next check's own"
        );
    }

    /// A dev root behind a symlink: the kernel names an open node by its resolved path,
    /// and the check still finds its holder; a process holding only other nodes (a
    /// terminal, another VFIO group) holds nothing of the device's.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_holder_is_found_through_a_dev_root_behind_a_symlink() {
        let dir = tempfile::tempdir_in(crate::simhost::scratch_base()).expect("tmp");
        let real = dir.path().join("realdev");
        std::fs::create_dir_all(real.join("vfio")).expect("dev");
        std::fs::write(real.join("vfio/7"), "").expect("node");
        std::fs::write(real.join("vfio/8"), "").expect("node");
        std::fs::write(real.join("tty"), "").expect("tty");
        let dev_root = dir.path().join("dev");
        std::os::unix::fs::symlink(&real, &dev_root).expect("dev link");
        let proc_root = dir.path().join("proc");
        for (pid, node) in [(4242, real.join("vfio/7")), (4343, real.join("vfio/8"))] {
            let fd = proc_root.join(format!("{pid}/fd"));
            std::fs::create_dir_all(&fd).expect("proc");
            std::os::unix::fs::symlink(real.join("tty"), fd.join("0")).expect("fd");
            std::os::unix::fs::symlink(&node, fd.join("30")).expect("fd");
        }
        let cfg = crate::config::Config {
            proc_root,
            dev_root: dev_root.clone(),
            ..Default::default()
        };
        let g = FreeGuard::from_config(&cfg, crate::metrics::Metrics::new());
        let node = dev_root.join("vfio/7");
        let check = VfioCheck {
            group_nodes: vec![node.clone()],
            members: Vec::new(),
        };
        let held = g.held(vec![check]).await.expect("check");
        let (n, h) = held[0].clone().expect("held through the link");
        assert_eq!((n, h.pid), (node, 4242));
    }
}
