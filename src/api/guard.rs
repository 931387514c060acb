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
//! evacuation's burst of releases costs two listings, not one each in a queue.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::api::status::ApiError;
use crate::config::Config;
use crate::domains::{DomainsError, Libvirt};
use crate::vfio::{Holder, VfioError};
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
    pub fn from_config(cfg: &Config) -> FreeGuard {
        FreeGuard {
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
    /// is): its device nodes listed from sysfs and one proc scan for all of them, off the
    /// async threads.
    pub async fn held(&self, devices: Vec<VfioCheck>) -> Result<Vec<Option<Held>>, VfioError> {
        if devices.is_empty() {
            return Ok(Vec::new());
        }
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
        let (proc_root, sysfs_root, dev_root) = (
            self.proc_root.clone(),
            self.sysfs_root.clone(),
            self.dev_root.clone(),
        );
        tokio::task::spawn_blocking(move || {
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
            // need not be read at all (a host without VFIO, the demo).
            let refs: Vec<&Path> = per_device
                .iter()
                .flatten()
                .map(PathBuf::as_path)
                .filter(|n| n.symlink_metadata().is_ok())
                .collect();
            let held = if refs.is_empty() {
                Default::default()
            } else {
                crate::vfio::holders_of(&proc_root, &refs)?
            };
            Ok(per_device
                .into_iter()
                .map(|nodes| {
                    nodes.into_iter().find_map(|n| {
                        let h = held.get(&n).and_then(|h| h.first()).cloned();
                        h.map(|h| (n, h))
                    })
                })
                .collect())
        })
        .await
        .unwrap_or_else(|e| {
            Err(VfioError::ProcRoot {
                path: self.proc_root.clone(),
                source: std::io::Error::other(e.to_string()),
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{FreeGuard, Listings};
    use crate::api::status::ApiError;

    /// A free that cannot take the order within the libvirt timeout (an acting audit
    /// holds it) is refused naming that wait, not an unreachable libvirt; once the lock
    /// is free it is taken.
    #[tokio::test]
    async fn a_free_kept_waiting_for_the_order_is_refused_as_busy() {
        let mut g = FreeGuard::from_config(&crate::config::Config::default());
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
}
