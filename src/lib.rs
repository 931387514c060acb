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
//! - [`store`]: the durable ledger in SQLite (WAL, fsync per commit).
//! - [`memory`]: the allocator set up for a small resident set (arenas, trims).
//! - [`writer`]: the single writer thread: decides commands in batches against the
//!   ledger, commits each batch once (group commit), publishes views and watch events.
//! - [`api`]: the gRPC service `hostdev.v1.HostDev`, the caller check, the error map,
//!   the per-watcher queues that bound what a slow client may cost, the accept loop
//!   that bounds the connections one uid may hold, and the places every call takes per
//!   caller (a uid, a TCP peer), the heavy calls' turns among them, before its message
//!   is read.
//! - [`client`]: connecting a `HostDev` client to the agent's Unix socket, each request
//!   sent whole on one HTTP/2 connection of its own (`client/direct.rs`).
//! - [`tcp`]: the optional TCP listener, mutual TLS only, its connections bounded per
//!   peer address and its handshakes in time.
//! - [`metrics`]: Prometheus counters and gauges on an optional HTTP listener.
//! - [`config`]: the TOML configuration and the managed-device selection.
//! - [`domains`]: libvirt: the domains on this host and the PCI addresses they
//!   reference (domain XML), polled to keep views current, queried afresh before a free.
//! - [`vfio`]: who holds a VFIO group or device node open (a scan of the proc tree).
//! - [`hotplug`]: kernel uevents (netlink) for PCI devices; [`rescan`] applies a full
//!   scan or only the devices an event names.
//! - [`hardware`]: sysfs writes: binding to vfio-pci and back, setting VF counts.
//! - [`simhost`]: a simulated host (fake sysfs tree) for the demo, tests and benchmarks.
//! - [`demo`]: the simulated hypervisor that `hostdevd demo` serves.
//! - [`daemon`]: startup order, serving on the Unix socket, signals, readiness, demo.
//!
//! The core ([`ledger`]) never touches the filesystem or the network; every edge module
//! takes its root path, socket or connection as an argument.

pub mod api;
pub mod client;
pub mod config;
pub mod daemon;
pub mod demo;
pub mod domains;
pub mod hardware;
pub mod hotplug;
pub mod ledger;
pub mod memory;
pub mod metrics;
pub mod pci;
pub mod rescan;
pub mod simhost;
pub mod store;
pub mod sysfs;
pub mod tcp;
pub mod vfio;
pub mod writer;
