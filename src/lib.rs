//! hostdevd: the per-hypervisor authority on PCI device ownership.
//!
//! hostdevd finds every PCI device on its host (SR-IOV physical and virtual functions above
//! all) by reading sysfs, keeps a durable ledger of who owns each one, and serves that
//! ledger over gRPC. Every claim and release carries a generation token, so a controller
//! acting on a stale view can never free a device that a running VM uses.
//!
//! # Layout
//!
//! - [`pci`]: validated identifiers (PCI address, ids, generation, owner and request ids).
//! - [`sysfs`]: the read-only inventory of a sysfs root (pure, synchronous).
//! - [`ledger`]: the ownership state machine (pure, synchronous, no I/O).
//! - [`store`]: the durable ledger in SQLite (WAL, fsync per commit, group commit).
//!
//! The core ([`ledger`]) never touches the filesystem or the network; every edge module
//! takes its root path, socket or connection as an argument.

pub mod ledger;
pub mod pci;
pub mod store;
pub mod sysfs;
