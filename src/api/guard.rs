//! The checks made right before any free (Release, acting Reconcile): libvirt's domains
//! listed afresh and applied to the ledger, so the writer decides with that view, and the
//! VFIO holders of the device's group scanned from the proc tree.
//!
//! Why fresh: the poller's view may be seconds old, and the seed race is exactly a VM
//! that appeared after someone's snapshot. Why under one lock: the poller takes the same
//! `order` lock across its list-and-apply, so an older poll result can never be applied
//! between the fresh list and the free that relies on it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::config::Config;
use crate::domains::{DomainsError, Libvirt};
use crate::vfio::{Holder, VfioError};
use crate::writer::Writer;

/// Up to this many group nodes are checked for existence on the calling task.
const INLINE_NODE_CHECKS: usize = 4;

/// What a free is checked against.
#[derive(Debug)]
pub struct FreeGuard {
    /// `None` when `[libvirt] enabled = false`: no domain is ever seen, and frees skip the
    /// domain check (GetStatus says so).
    pub libvirt: Option<Arc<Libvirt>>,
    /// How long a free waits for libvirt (and for the poller to finish a poll).
    pub timeout: Duration,
    pub proc_root: PathBuf,
    /// Where VFIO group nodes live (`<dev_root>/vfio/N`).
    pub dev_root: PathBuf,
    /// Serializes "list domains, apply" of the poller with "list, apply, free" here.
    pub order: Arc<tokio::sync::Mutex<()>>,
}

/// Held while a free is checked and carried out.
pub type OrderGuard = tokio::sync::OwnedMutexGuard<()>;

impl FreeGuard {
    pub fn from_config(cfg: &Config) -> FreeGuard {
        FreeGuard {
            libvirt: cfg
                .libvirt
                .enabled
                .then(|| Arc::new(Libvirt::new(cfg.libvirt.uri.clone()))),
            timeout: Duration::from_millis(cfg.libvirt.timeout_ms),
            proc_root: cfg.proc_root.clone(),
            dev_root: cfg.dev_root.clone(),
            order: Arc::new(tokio::sync::Mutex::new(())),
        }
    }

    /// Takes the order lock, lists the domains afresh and applies them to the ledger.
    /// With libvirt disabled only the lock is taken.
    pub async fn refresh(&self, writer: &Writer) -> Result<OrderGuard, DomainsError> {
        let uri = || {
            self.libvirt
                .as_ref()
                .map(|l| l.uri().to_string())
                .unwrap_or_default()
        };
        let guard = tokio::time::timeout(self.timeout, self.order.clone().lock_owned())
            .await
            .map_err(|_| DomainsError::Timeout {
                uri: uri(),
                ms: self.timeout.as_millis(),
            })?;
        if let Some(lv) = &self.libvirt {
            let list = lv.list_fresh(self.timeout).await?;
            writer
                .domains(list)
                .await
                .map_err(|e| DomainsError::Thread(format!("applying the domains failed: {e}")))?;
        }
        Ok(guard)
    }

    /// The holders of each group node (one proc scan, off the async threads).
    pub async fn holders(
        &self,
        nodes: Vec<PathBuf>,
    ) -> Result<std::collections::BTreeMap<PathBuf, Vec<Holder>>, VfioError> {
        if nodes.is_empty() {
            return Ok(Default::default());
        }
        // One device's nodes (a Release): a node that does not exist cannot be held open,
        // and asking costs a stat or three, less than the thread hand-off a blocking task
        // needs. Usually none exists and the proc tree is not read at all.
        if nodes.len() <= INLINE_NODE_CHECKS && !nodes.iter().any(|n| n.symlink_metadata().is_ok())
        {
            return Ok(Default::default());
        }
        let proc_root = self.proc_root.clone();
        tokio::task::spawn_blocking(move || {
            // A node that does not exist cannot be held open; without any, the proc tree
            // need not be read at all (a host without VFIO, the demo).
            let refs: Vec<&Path> = nodes
                .iter()
                .map(PathBuf::as_path)
                .filter(|n| n.symlink_metadata().is_ok())
                .collect();
            if refs.is_empty() {
                return Ok(Default::default());
            }
            crate::vfio::holders_of(&proc_root, &refs)
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
