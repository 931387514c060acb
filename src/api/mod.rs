//! The gRPC service `hostdev.v1.HostDev`: request validation, the caller check, and the
//! wiring of each RPC to the writer (mutations) or the published view (reads).

pub mod codec;
pub mod connections;
pub mod convert;
pub mod gate;
pub mod guard;
pub mod per_uid;
pub mod status;
pub mod watch_queue;
pub mod wire;

use std::collections::BTreeSet;
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::time::Instant;

use tokio::sync::broadcast;
use tokio_stream::Stream;
use tonic::transport::server::UdsConnectInfo;
use tonic::{Request, Response, Status};

use crate::ledger::{
    ClaimRequest, ClaimTarget, DeviceRecord, DeviceState, Outcome, ReleaseRequest, TransferRequest,
};
use crate::pci::{ConsumerId, Generation, PciAddress, RequestId};
use crate::rescan::Rescanner;
use crate::writer::{Event, OrphanFree, View, WriteError, Writer};
use convert::device_to_proto;
use guard::VfioCheck;
use per_uid::Caller;
use status::ApiError;
use watch_queue::Pending;
pub use watch_queue::QueueLimits;

/// Generated protobuf and gRPC code for `hostdev.v1`.
#[allow(clippy::all, missing_debug_implementations, missing_docs)]
pub mod proto {
    tonic::include_proto!("hostdev.v1");
    /// The encoded descriptor set, for server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/hostdev_descriptor.bin"));
}

/// The generated gRPC server of `hostdev.v1`: on the messages of [`proto`], except that
/// a Watch stream carries [`wire::WireEvent`]s (see `build.rs`).
#[allow(clippy::all, missing_debug_implementations, missing_docs)]
pub mod server {
    include!(concat!(env!("OUT_DIR"), "/server/hostdev.v1.rs"));
}

use server::host_dev_server::HostDev;

/// Who may change state: Unix-socket peers whose uid or primary gid is listed
/// (SO_PEERCRED), and TCP clients that passed mutual TLS.
#[derive(Debug, Clone, Default)]
pub struct Access {
    pub writer_uids: Vec<u32>,
    pub writer_gids: Vec<u32>,
}

impl Access {
    fn check<T>(&self, req: &Request<T>, what: &str) -> Result<(), ApiError> {
        let cred = req
            .extensions()
            .get::<UdsConnectInfo>()
            .and_then(|i| i.peer_cred);
        match cred {
            Some(c) if self.writer_uids.contains(&c.uid()) || self.writer_gids.contains(&c.gid()) => {
                Ok(())
            }
            Some(c) => Err(ApiError::PermissionDenied(format!(
                "{what} refused: uid {} gid {} may not change device ownership (allowed uids {:?}, gids {:?})",
                c.uid(),
                c.gid(),
                self.writer_uids,
                self.writer_gids
            ))),
            // Over TCP the handshake already required a certificate signed by the
            // configured CA; that certificate is the caller's credential.
            None if req.peer_certs().is_some_and(|c| !c.is_empty()) => Ok(()),
            None => Err(ApiError::PermissionDenied(format!(
                "{what} refused: the caller's credentials are unknown (a Unix-socket peer in writer_uids/writer_gids, or a TLS client certificate, is required)"
            ))),
        }
    }
}

/// Health of a dependency, as shown by GetStatus.
#[derive(Debug, Clone)]
pub struct HealthInfo {
    pub ok: bool,
    pub detail: String,
}

/// Facts the service reports but does not own.
#[derive(Debug)]
pub struct AgentInfo {
    pub started: Instant,
    pub boot_id: String,
    pub libvirt: RwLock<HealthInfo>,
    /// The subscription to libvirt's domain events (set by the poller).
    pub libvirt_events: RwLock<HealthInfo>,
    /// The uevent listener (shared with its task).
    pub hotplug: Arc<RwLock<HealthInfo>>,
    /// The configuration reloads since the start (set by the daemon's SIGHUP task).
    pub reloads: RwLock<Reloads>,
}

/// The configuration reloads since the agent started: how many began and ended, and how
/// the last to end did (`None` until one has).
#[derive(Debug, Clone, Default)]
pub struct Reloads {
    pub started: u64,
    pub finished: u64,
    pub last: Option<HealthInfo>,
}

/// The service implementation.
#[derive(Debug, Clone)]
pub struct HostDevService {
    writer: Writer,
    access: Access,
    /// Rescans the devices a hardware action changed, so the answer shows the result.
    rescanner: Arc<Rescanner>,
    info: Arc<AgentInfo>,
    /// The fresh libvirt and VFIO checks made before every free.
    guard: Arc<guard::FreeGuard>,
    /// Set to true when the server shuts down: open watch streams end, so a graceful
    /// shutdown does not wait forever for them.
    stopping: Arc<tokio::sync::watch::Sender<bool>>,
    watch: WatchLimits,
    /// The Unix socket's open connections by peer uid, and the limits on connections.
    connections: Arc<connections::Connections>,
    /// The recent changes as the watchers are sent them, each encoded once for all.
    wire: Arc<wire::RecentWire>,
}

/// The limits on Watch streams: how many may be open, and how much each may have
/// waiting for its client before it is cut off.
#[derive(Debug, Clone)]
pub struct WatchLimits {
    pub max_streams: usize,
    pub queue: QueueLimits,
    slots: Arc<tokio::sync::Semaphore>,
    /// Streams open by each caller with a name (a Unix-socket peer uid, a TCP peer's
    /// address), against the streams one may hold.
    by_caller: Arc<per_uid::PerUid<Caller>>,
}

impl WatchLimits {
    /// `max_streams` in all, as many for one caller.
    pub fn new(max_streams: usize, queue: QueueLimits) -> Self {
        let max_streams = max_streams.min(tokio::sync::Semaphore::MAX_PERMITS);
        WatchLimits {
            max_streams,
            queue,
            slots: Arc::new(tokio::sync::Semaphore::new(max_streams)),
            by_caller: per_uid::PerUid::new(max_streams),
        }
    }

    /// At most `n` streams for one Unix-socket peer uid, or one TCP peer address.
    pub fn per_caller(mut self, n: usize) -> Self {
        self.by_caller = per_uid::PerUid::new(n);
        self
    }

    /// The limits `[api]` sets.
    pub fn from_config(c: &crate::config::ApiConfig) -> Self {
        WatchLimits::new(
            c.max_watch_streams,
            QueueLimits {
                events: c.watch_client_events,
                bytes: c.watch_client_bytes,
            },
        )
        .per_caller(c.max_watch_streams_per_uid)
    }

    /// Takes a place for one more stream: one among all streams, and one among the
    /// caller's where it has a name (a uid, a TCP peer's address; not a Unix-socket peer
    /// without credentials).
    fn take(&self, caller: Caller) -> Result<watch_queue::Slot, ApiError> {
        let caller_slot = match caller {
            Caller::Uid(None) => None,
            named => Some(
                self.by_caller
                    .take(named)
                    .ok_or(ApiError::TooManyWatchers {
                        limit: self.by_caller.limit(),
                        caller: Some(named),
                    })?,
            ),
        };
        // Dropping `caller_slot` on this refusal gives the caller's place back.
        let all =
            self.slots
                .clone()
                .try_acquire_owned()
                .map_err(|_| ApiError::TooManyWatchers {
                    limit: self.max_streams,
                    caller: None,
                })?;
        Ok(Box::new((all, caller_slot)))
    }
}

impl Default for WatchLimits {
    fn default() -> Self {
        WatchLimits::from_config(&crate::config::ApiConfig::default())
    }
}

impl HostDevService {
    pub fn new(
        writer: Writer,
        access: Access,
        rescanner: Arc<Rescanner>,
        info: Arc<AgentInfo>,
        guard: Arc<guard::FreeGuard>,
    ) -> Self {
        let connections = connections::Connections::new(
            connections::ConnectionLimits::default(),
            writer.metrics().clone(),
        );
        HostDevService {
            writer,
            access,
            rescanner,
            info,
            guard,
            stopping: Arc::new(tokio::sync::watch::channel(false).0),
            watch: WatchLimits::default(),
            connections,
            wire: Arc::default(),
        }
    }

    /// Replaces the default Watch limits (`[api]` max_watch_streams, watch_client_*).
    pub fn with_watch_limits(mut self, watch: WatchLimits) -> Self {
        self.watch = watch;
        self
    }

    /// Replaces the default limits on connections (`[api] max_connections_per_uid`,
    /// `max_streams_per_connection`, `keepalive_*`).
    pub fn with_connection_limits(mut self, limits: connections::ConnectionLimits) -> Self {
        self.connections = connections::Connections::new(limits, self.writer.metrics().clone());
        self
    }

    /// What one connection may do, and how long it may stay silent.
    pub fn connection_limits(&self) -> &connections::ConnectionLimits {
        self.connections.limits()
    }

    /// The Unix socket's connections by peer uid, which the accept loop admits through.
    pub fn connections(&self) -> &Arc<connections::Connections> {
        &self.connections
    }

    /// Ends every open watch stream (with UNAVAILABLE, SHUTTING_DOWN) and refuses new ones.
    pub fn stop_streams(&self) {
        self.stopping.send_replace(true);
    }

    /// The record holding the claim that `consumer` made with `request_id` at `address`,
    /// if the claim still stands: the present device's, or a lost claim's (its device
    /// gone), whose generation its owner releases it with.
    fn claim_record<'v>(
        view: &'v View,
        address: PciAddress,
        consumer: ConsumerId,
        request_id: &RequestId,
    ) -> Option<&'v DeviceRecord> {
        view.ledger.records_at(address).find(|r| {
            r.claim
                .as_ref()
                .is_some_and(|c| c.owner.consumer == consumer && c.request_id == *request_id)
        })
    }

    /// The claim that `consumer` made with `request_id` on the present device at
    /// `address`, if it still stands: its generation now, and whether it has a recorded
    /// binding whose every member the inventory shows on vfio-pci.
    fn claim_now(
        &self,
        address: PciAddress,
        consumer: ConsumerId,
        request_id: &RequestId,
    ) -> Option<(Generation, bool)> {
        // The record and its members' drivers from one view.
        let view = self.writer.view();
        let rec = Self::claim_record(&view, address, consumer, request_id).filter(|r| r.present)?;
        let on_vfio = rec
            .claim
            .as_ref()
            .and_then(|c| c.vfio.as_ref())
            .is_some_and(|b| Self::on_vfio(&view, b));
        Some((rec.generation, on_vfio))
    }

    /// Whether the inventory in `view` shows every member of `binding` on vfio-pci.
    fn on_vfio(view: &View, binding: &crate::ledger::VfioBinding) -> bool {
        binding.members.iter().all(|m| {
            view.sysfs_device(&m.address)
                .is_some_and(|d| d.driver.as_deref() == Some(crate::hardware::VFIO_PCI_DRIVER))
        })
    }

    /// Whether the binding recorded on `consumer`'s claim in record `record` still stands
    /// with a member off vfio-pci (its first call stopped part way): a retry binds again.
    fn binding_unfinished(&self, record: crate::ledger::RecordId, consumer: ConsumerId) -> bool {
        let view = self.writer.view();
        let Some(rec) = view.ledger.record(record).filter(|r| r.present) else {
            return false;
        };
        let binding = rec
            .claim
            .as_ref()
            .filter(|c| c.owner.consumer == consumer)
            .and_then(|c| c.vfio.as_ref());
        binding.is_some_and(|b| !Self::on_vfio(&view, b))
    }

    /// The present device at an address as a message, from the latest view.
    fn present_device(&self, address: PciAddress) -> Option<proto::Device> {
        let view = self.writer.view();
        let found = view
            .device(address)
            .find(|v| v.record.present)
            .map(|v| device_to_proto(&v, view.sysfs_device(&address)));
        found
    }

    /// What would show the device in use: the inventory's group node, the nodes of its
    /// IOMMU group even when the inventory has not seen a vfio-pci bind yet (a node nobody
    /// holds costs nothing to check), and the members of that group, whose device nodes
    /// the group node would have covered. A device the inventory does not know has none.
    fn vfio_check(&self, address: PciAddress) -> VfioCheck {
        let view = self.writer.view();
        let Some(dev) = view.sysfs_device(&address) else {
            return VfioCheck::default();
        };
        let mut group_nodes: Vec<std::path::PathBuf> = dev.vfio_group.iter().cloned().collect();
        if let Some(g) = dev.iommu_group {
            let vfio = self.guard.dev_root.join("vfio");
            for n in [vfio.join(g.to_string()), vfio.join(format!("noiommu-{g}"))] {
                if !group_nodes.contains(&n) {
                    group_nodes.push(n);
                }
            }
        }
        VfioCheck {
            group_nodes,
            members: std::iter::once(address)
                .chain(dev.iommu_group_peers.iter().copied())
                .collect(),
        }
    }

    /// The answer when a fresh check failed: the ledger's own refusal where it would
    /// refuse anyway (it names what to do: detach, read the device again), else the
    /// check's failure. Either is counted in the rejections metric.
    fn refusal_first(
        &self,
        ledger: Option<crate::ledger::LedgerError>,
        check: ApiError,
    ) -> ApiError {
        match ledger {
            Some(le) => {
                self.writer.metrics().rejected(le.reason());
                ApiError::from(WriteError::from(le))
            }
            None => self.refused(check),
        }
    }

    /// Counts a refusal the service's own checks decided (the writer counts the
    /// ledger's), and passes it on.
    fn refused(&self, e: ApiError) -> ApiError {
        if let Some(reason) = e.check_reason() {
            self.writer.metrics().rejected(reason);
        }
        e
    }

    /// The fresh checks before freeing `devices` (one for a Release; a PF and its VFs
    /// before a VF count change, which destroys the VFs): libvirt's domains listed and
    /// applied (the ledger then refuses a device a domain uses itself), and no VFIO
    /// holder of any of them. `what` names them in errors.
    ///
    /// The order lock is let go once the fresh list is applied: the writer decides the
    /// free after that list, and any poll applied in between listed later, so it is only
    /// fresher. Holding the lock through the free's commit would serialize every release
    /// behind one fsync each.
    async fn unused(&self, devices: &[PciAddress], what: &str) -> Result<(), ApiError> {
        let order = self.guard.refresh(&self.writer, what).await?;
        drop(order);
        let checks = devices.iter().map(|a| self.vfio_check(*a)).collect();
        let held = self
            .guard
            .held(checks)
            .await
            .map_err(|source| ApiError::HoldersUnknown {
                what: what.to_string(),
                source: Box::new(source),
            })?;
        let first = devices
            .iter()
            .zip(held)
            .find_map(|(a, h)| h.map(|h| (*a, h)));
        if let Some((address, (node, holder))) = first {
            return Err(ApiError::VfioHeld {
                address,
                node,
                holder: Box::new(holder),
            });
        }
        Ok(())
    }

    /// Moves orphans whose VFIO group is held open to `protected`, and says why each
    /// protected device is kept.
    async fn protect_held(
        &self,
        report: &mut crate::ledger::AuditReport,
    ) -> Result<Vec<proto::Protection>, ApiError> {
        let mut protections: Vec<proto::Protection> = report
            .protected
            .iter()
            .map(|rec| proto::Protection {
                address: rec.address().to_string(),
                reason: match &rec.attached {
                    Some(d) => format!(
                        "attached to libvirt domain {} ({}, {})",
                        d.name,
                        d.uuid,
                        if d.running { "running" } else { "defined" }
                    ),
                    None => "attached".into(),
                },
                domain: rec.attached.as_ref().map(convert::domain_to_proto),
                holder_pid: 0,
                holder_command: String::new(),
            })
            .collect();
        let checks = report
            .orphans
            .iter()
            .map(|rec| self.vfio_check(rec.address()))
            .collect();
        let held = self.guard.held(checks).await.map_err(|source| {
            self.refused(ApiError::HoldersUnknown {
                what: "the orphans".into(),
                source: Box::new(source),
            })
        })?;
        let orphans = std::mem::take(&mut report.orphans);
        for (rec, holder) in orphans.into_iter().zip(held) {
            match holder {
                Some((node, h)) => {
                    protections.push(proto::Protection {
                        address: rec.address().to_string(),
                        reason: format!(
                            "its {} is held open by {}",
                            crate::vfio::describe_node(&node),
                            h.describe()
                        ),
                        domain: h.domain_uuid.map(|u| proto::Domain {
                            uuid: u.to_string(),
                            name: h.domain_name.clone().unwrap_or_default(),
                            running: true,
                        }),
                        holder_pid: h.pid,
                        holder_command: h.command,
                    });
                    report.protected.push(rec);
                }
                None => report.orphans.push(rec),
            }
        }
        Ok(protections)
    }

    fn event_to_proto(&self, e: &Event) -> proto::WatchEvent {
        match e {
            Event::Changed { generation, view } => proto::WatchEvent {
                kind: proto::WatchEventKind::Changed as i32,
                generation: generation.0,
                address: view.record.address().to_string(),
                device: Some(device_to_proto(
                    view,
                    self.writer.view().sysfs_device(&view.record.address()),
                )),
            },
            Event::Removed {
                generation,
                address,
                present,
            } => proto::WatchEvent {
                kind: proto::WatchEventKind::Removed as i32,
                generation: generation.0,
                address: address.to_string(),
                // Which record went: a lost claim and a present device may share the
                // address, and only one of them is removed.
                device: Some(proto::Device {
                    address: address.to_string(),
                    present: *present,
                    generation: generation.0,
                    ..Default::default()
                }),
            },
        }
    }
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<wire::WireEvent, Status>> + Send>>;

/// The rescans' turn, held across a hardware action ([`Rescanner::hold`]).
type Turn = tokio::sync::OwnedMutexGuard<()>;

#[tonic::async_trait]
impl HostDev for HostDevService {
    async fn list_devices(
        &self,
        _req: Request<proto::ListDevicesRequest>,
    ) -> Result<Response<proto::ListDevicesResponse>, Status> {
        let view = self.writer.view();
        Ok(Response::new(proto::ListDevicesResponse {
            host_generation: view.host_generation.0,
            devices: view
                .devices()
                .iter()
                .map(|v| device_to_proto(v, view.sysfs_device(&v.record.address())))
                .collect(),
            strays: view.strays().map(convert::stray_to_proto).collect(),
        }))
    }

    async fn get_device(
        &self,
        req: Request<proto::GetDeviceRequest>,
    ) -> Result<Response<proto::GetDeviceResponse>, Status> {
        let address = convert::address("address", &req.get_ref().address)?;
        let view = self.writer.view();
        let mut device = None;
        let mut lost = Vec::new();
        for v in view.device(address) {
            let d = device_to_proto(&v, view.sysfs_device(&address));
            if v.record.present {
                device = Some(d);
            } else {
                lost.push(d);
            }
        }
        if device.is_none() && lost.is_empty() {
            return Err(ApiError::Write(
                crate::ledger::LedgerError::UnknownDevice { address }.into(),
            )
            .into());
        }
        Ok(Response::new(proto::GetDeviceResponse {
            host_generation: view.host_generation.0,
            device,
            lost,
        }))
    }

    async fn claim(
        &self,
        req: Request<proto::ClaimRequest>,
    ) -> Result<Response<proto::ClaimResponse>, Status> {
        self.access.check(&req, "claim")?;
        let r = req.get_ref();
        let owner = convert::owner("owner", r.owner.as_ref())?;
        let request_id = convert::request_id(&r.request_id)?;
        let target = match &r.target {
            Some(proto::claim_request::Target::Address(a)) => ClaimTarget::Address {
                address: convert::address("address.address", &a.address)?,
                expected_generation: Generation(a.expected_generation),
            },
            Some(proto::claim_request::Target::Selector(s)) => {
                ClaimTarget::Selector(convert::selector(s)?)
            }
            None => {
                return Err(ApiError::BadField {
                    field: "target",
                    reason: "set either address or selector".into(),
                }
                .into())
            }
        };
        // Until libvirt has answered once, a device a domain uses without a claim (a
        // stray) would read as free: no device is handed out on that blind view. A retry
        // of a claim already decided is answered as the first time (I7).
        if let Some(lv) = &self.guard.libvirt {
            if !self.writer.domains_listed()
                && self
                    .writer
                    .lookup(owner.consumer, request_id.clone())
                    .await
                    .map_err(ApiError::from)?
                    .is_none()
            {
                let what = match &target {
                    ClaimTarget::Address { address, .. } => address.to_string(),
                    ClaimTarget::Selector(_) => "a device matching the selector".to_string(),
                };
                return Err(self
                    .refused(ApiError::LibvirtUnreachable {
                        what,
                        source: Box::new(crate::domains::DomainsError::NotYetListed {
                            uri: lv.uri().to_string(),
                        }),
                    })
                    .into());
            }
        }
        let consumer = owner.consumer;
        let applied = self
            .writer
            .claim(ClaimRequest {
                target,
                owner,
                request_id: request_id.clone(),
            })
            .await
            .map_err(ApiError::from)?;
        let mut generation = applied.outcome.generation();
        if r.vfio {
            let address = applied.outcome.address();
            let bound = async {
                let mut generation = generation;
                if applied.replayed {
                    // The first call's binding moved the claim's generation on, and may have
                    // stopped part way (the binding is recorded before the sysfs writes): a
                    // retry answers the claim's generation now, and binds again unless every
                    // member is on vfio-pci already. A claim released since is replayed as it
                    // was: there is nothing of it to bind.
                    if let Some((now, on_vfio)) = self.claim_now(address, consumer, &request_id) {
                        generation = now;
                        if !on_vfio {
                            generation =
                                self.bind_vfio(address, consumer, generation, None).await?.0;
                        }
                    }
                } else {
                    generation = self.bind_vfio(address, consumer, generation, None).await?.0;
                }
                Ok::<_, ApiError>(generation)
            };
            generation = match bound.await {
                Ok(g) => g,
                // The claim is committed: say so, with its generation now (a binding
                // recorded before a failed sysfs write moved it on). A device that vanished
                // under the binding leaves its claim lost, and standing: its owner releases
                // it with that generation.
                Err(source) => {
                    match Self::claim_record(&self.writer.view(), address, consumer, &request_id) {
                        Some(standing) => {
                            return Err(ApiError::ClaimedNotBound {
                                address,
                                generation: standing.generation.0,
                                source: Box::new(source),
                            }
                            .into())
                        }
                        None => return Err(source.into()),
                    }
                }
            };
        }
        Ok(Response::new(proto::ClaimResponse {
            device: self.present_device(applied.outcome.address()),
            generation: generation.0,
            replayed: applied.replayed,
        }))
    }

    async fn release(
        &self,
        req: Request<proto::ReleaseRequest>,
    ) -> Result<Response<proto::ReleaseResponse>, Status> {
        self.access.check(&req, "release")?;
        let r = req.get_ref();
        let owner = convert::owner("owner", r.owner.as_ref())?;
        let rel = ReleaseRequest {
            address: convert::address("address", &r.address)?,
            consumer: owner.consumer,
            request_id: convert::request_id(&r.request_id)?,
            generation: Generation(r.generation),
        };
        // Only a release that names a present device's claim as it is now, by its owner,
        // can free that device: it alone is checked first (libvirt listed afresh, no VFIO
        // holder). Any other the ledger answers without freeing anything: a retry of a
        // recorded request replays its first answer (I7; the writer looks in the request
        // log, on disk too), and the rest it refuses (a stale generation, another
        // owner), with their own status rather than a check's. A lost claim's device is
        // gone: the device at its address now is another one, and not this release's to
        // check.
        let checked = self.writer.view().ledger.records_at(rel.address).any(|r| {
            r.present
                && r.generation == rel.generation
                && r.claim
                    .as_ref()
                    .is_some_and(|c| c.owner.consumer == rel.consumer)
        });
        let bound_now = || -> BTreeSet<PciAddress> {
            self.writer
                .view()
                .ledger
                .records_at(rel.address)
                .flat_map(DeviceRecord::bound_members)
                .collect()
        };
        // Giving drivers back is a hardware action, in the rescans' turn, which a VF
        // count change may hold for minutes: taken before the checks, so that nothing
        // (a process opening the group) comes between them and the action. Turn, then
        // the checks' order lock, as everywhere.
        let bound_before = if checked {
            bound_now()
        } else {
            BTreeSet::new()
        };
        let turn = if bound_before.is_empty() {
            None
        } else {
            Some(self.rescanner.hold().await)
        };
        // Where the checks fail and the ledger, as it is now, refuses the release anyway (a
        // domain uses the device, or the fresh listing moved its generation on), that
        // refusal is the answer: it names what to do (detach from the domain, read the
        // device again), where a check's failure would only say to try again later.
        if checked {
            // Every member given its driver back leaves vfio-pci, and a PF that does turns
            // SR-IOV off: each is checked, and a PF's VFs, as for a VF count change.
            let mut devices = vec![rel.address];
            let view = self.writer.view();
            for &m in &bound_before {
                if m != rel.address {
                    devices.push(m);
                }
                if let Some(s) = view.sysfs_device(&m).and_then(|d| d.sriov.as_ref()) {
                    devices.extend(s.vfs.iter().copied());
                }
            }
            drop(view);
            if let Err(e) = self.unused(&devices, &rel.address.to_string()).await {
                let refused = self.writer.view().ledger.check_release(&rel).err();
                return Err(self.refusal_first(refused, e).into());
            }
        }
        let bound = bound_now();
        // Unchecked, it must not free: the writer refuses it should the device reach the
        // presented generation meanwhile (a detach applied, a rescan), since nothing
        // checked the device at that generation.
        let applied = self
            .giving_back(bound, turn, move |w| async move {
                if checked {
                    w.release(rel).await
                } else {
                    w.release_unchecked(rel).await
                }
            })
            .await
            .map_err(ApiError::from)?;
        Ok(Response::new(proto::ReleaseResponse {
            address: applied.outcome.address().to_string(),
            generation: applied.outcome.generation().0,
            replayed: applied.replayed,
        }))
    }

    async fn transfer(
        &self,
        req: Request<proto::TransferRequest>,
    ) -> Result<Response<proto::TransferResponse>, Status> {
        self.access.check(&req, "transfer")?;
        let r = req.get_ref();
        let t = TransferRequest {
            address: convert::address("address", &r.address)?,
            from: convert::consumer("from_consumer_id", &r.from_consumer_id)?,
            to: convert::owner("to", r.to.as_ref())?,
            request_id: convert::request_id(&r.request_id)?,
            generation: Generation(r.generation),
        };
        let applied = self.writer.transfer(t).await.map_err(ApiError::from)?;
        Ok(Response::new(proto::TransferResponse {
            device: self.present_device(applied.outcome.address()),
            generation: applied.outcome.generation().0,
            replayed: applied.replayed,
        }))
    }

    async fn reconcile(
        &self,
        req: Request<proto::ReconcileRequest>,
    ) -> Result<Response<proto::ReconcileResponse>, Status> {
        let r = req.get_ref();
        if r.act {
            self.access.check(&req, "reconcile with act=true")?;
        }
        if r.expected_consumer_ids.len() > 100_000 {
            return Err(ApiError::BadField {
                field: "expected_consumer_ids",
                reason: format!(
                    "{} ids is more than the limit of 100000",
                    r.expected_consumer_ids.len()
                ),
            }
            .into());
        }
        let expected: BTreeSet<_> = r
            .expected_consumer_ids
            .iter()
            .map(|c| convert::consumer("expected_consumer_ids", c))
            .collect::<Result<_, _>>()?;
        let request_id = if r.act {
            Some(convert::audit_request_id(&r.request_id)?)
        } else {
            None
        };
        // A snapshot is a host generation read from this agent, so never past its own:
        // one that is would make every claim look unchanged since, and every claim of an
        // unexpected consumer an orphan.
        let current = self.writer.view().host_generation.0;
        if r.snapshot_generation > current {
            return Err(self
                .refused(ApiError::SnapshotAhead {
                    snapshot: r.snapshot_generation,
                    current,
                })
                .into());
        }
        // An acting audit lists the domains afresh first and holds the order lock until
        // its frees are decided, so the ledger audits against every domain defined now
        // (the evacuated VM of the seed race included).
        let mut order = if r.act {
            Some(
                self.guard
                    .refresh(&self.writer, "the orphans")
                    .await
                    .map_err(|e| self.refused(e))?,
            )
        } else {
            None
        };
        let mut view = self.writer.view();
        let mut report = view
            .ledger
            .audit(&expected, Generation(r.snapshot_generation));
        // Orphans with a binding get their drivers back, a hardware action that needs
        // the rescans' turn. A rescan or another hardware action may have it for minutes
        // (a VF count change), and waiting for it here with the order lock held would
        // keep every Release waiting behind this audit until refused FREE_CHECK_BUSY.
        // So the turn is taken without waiting, or else the order lock is let go, the
        // turn waited for, and the checks made again from the start (turn, then order:
        // no one waits for the turn while holding the order lock).
        let mut turn = None;
        if order.is_some()
            && report
                .orphans
                .iter()
                .any(|o| o.bound_members().next().is_some())
        {
            turn = self.rescanner.try_hold();
            if turn.is_none() {
                drop(order.take());
                turn = Some(self.rescanner.hold().await);
                order = Some(
                    self.guard
                        .refresh(&self.writer, "the orphans")
                        .await
                        .map_err(|e| self.refused(e))?,
                );
                view = self.writer.view();
                report = view
                    .ledger
                    .audit(&expected, Generation(r.snapshot_generation));
            }
        }
        let _order = order;
        let protections = self.protect_held(&mut report).await?;
        let to_views = |recs: &[crate::ledger::DeviceRecord]| -> Vec<proto::Device> {
            recs.iter()
                .map(|rec| {
                    let v = crate::ledger::DeviceView {
                        state: view
                            .state(rec.id)
                            .cloned()
                            .unwrap_or_else(|| view.ledger.state_of(rec)),
                        record: rec.clone(),
                    };
                    device_to_proto(&v, view.sysfs_device(&rec.address()))
                })
                .collect()
        };
        let mut orphans: Vec<proto::Orphan> = to_views(&report.orphans)
            .into_iter()
            .map(|d| proto::Orphan {
                device: Some(d),
                freed_generation: 0,
                kept_because: String::new(),
                earlier_attempt: false,
            })
            .collect();
        if let Some(request_id) = request_id {
            let mut frees = Vec::with_capacity(report.orphans.len());
            for rec in &report.orphans {
                if let Some(c) = &rec.claim {
                    frees.push(OrphanFree {
                        address: rec.address(),
                        consumer: c.owner.consumer,
                        generation: rec.generation,
                        request_id: request_id
                            .per_device(rec.address())
                            .map_err(ApiError::bad_id("request_id"))?,
                    });
                }
            }
            // Orphans with a binding get their drivers back, as in a Release.
            let bound: BTreeSet<PciAddress> = report
                .orphans
                .iter()
                .flat_map(|rec| rec.bound_members())
                .collect();
            let freed = self
                .giving_back(bound, turn, move |w| async move {
                    w.free_orphans(request_id, frees).await
                })
                .await
                .map_err(ApiError::from)?;
            for (o, res) in orphans.iter_mut().zip(freed.results) {
                match res {
                    // A free logged under this orphan's id already, yet the device is an
                    // orphan now: the audit's id was used before, by an audit that freed
                    // the device's earlier claim (a retry of that audit finds the device
                    // free, not orphaned). That free is not this one.
                    Ok(a) if a.replayed => {
                        o.kept_because = format!(
                            "this audit's request id was used before, by an audit that freed the device's earlier claim (generation {}): an audit needs a new request id",
                            a.outcome.generation().0
                        )
                    }
                    Ok(a) => o.freed_generation = a.outcome.generation().0,
                    Err(e) => o.kept_because = e.to_string(),
                }
            }
            // A retry: what the earlier attempts freed is no orphan now, but the caller
            // may never have heard of it.
            let now = self.writer.view();
            for entry in freed.earlier {
                let Outcome::Released {
                    address,
                    record,
                    generation,
                } = entry.outcome
                else {
                    continue;
                };
                if report.orphans.iter().any(|r| r.address() == address) {
                    continue;
                }
                // A device gone from sysfs since, and so from the ledger, is named by
                // its address alone.
                let device = now
                    .device(address)
                    .find(|v| v.record.id == record)
                    .map(|v| device_to_proto(&v, now.sysfs_device(&address)))
                    .unwrap_or_else(|| proto::Device {
                        address: address.to_string(),
                        ..Default::default()
                    });
                orphans.push(proto::Orphan {
                    device: Some(device),
                    freed_generation: generation.0,
                    kept_because: String::new(),
                    earlier_attempt: true,
                });
            }
        }
        let host_generation = self.writer.view().host_generation.0;
        Ok(Response::new(proto::ReconcileResponse {
            host_generation,
            orphans,
            strays: report.strays.iter().map(convert::stray_to_proto).collect(),
            lost: to_views(&report.lost),
            changed: to_views(&report.changed),
            protected: to_views(&report.protected),
            acted: r.act,
            protections,
        }))
    }

    type WatchStream = WatchStream;

    async fn watch(
        &self,
        req: Request<proto::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let r = req.get_ref();
        let (from, backlog, mut rx, snapshot) = {
            let log = match self.writer.events().lock() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            let view = self.writer.view();
            let from = if r.snapshot {
                view.host_generation
            } else {
                Generation(r.from_generation)
            };
            // A generation from the future (another agent's, or before a restore) cannot
            // be resumed either: the client must list again.
            let resumed = (from <= view.host_generation)
                .then(|| log.resume(from))
                .flatten();
            let Some((backlog, rx)) = resumed else {
                return Err(ApiError::TooOld {
                    from: from.0,
                    oldest: log.oldest().0,
                    current: view.host_generation.0,
                }
                .into());
            };
            (from, backlog, rx, r.snapshot.then_some(view))
        };
        let already = *self.stopping.borrow();
        if already {
            return Err(ApiError::ShuttingDown {
                advice: "watch again once it is back",
            }
            .into());
        }
        let slot = self.watch.take(Caller::of(req.extensions()))?;
        let convert: watch_queue::Convert = {
            let this = self.clone();
            Box::new(move |e: &Event| this.wire.get_or_build(e, |e| this.event_to_proto(e)))
        };
        let (tx, out) = watch_queue::queue(self.watch.queue, convert, Some(slot));
        if snapshot.is_some() {
            tx.snapshot_asked();
        }
        let mut stopping = self.stopping.subscribe();
        let tx = Arc::new(tx);
        let stop_tx = tx.clone();
        let limits = self.watch.queue;
        let feed = async move {
            // A client cut off before it took its snapshot's end holds part of a snapshot
            // only: it must start again with one, not resume. The queue knows whether it
            // took it (the end may be queued and unread, and dropped by the cut-off).
            let behind = |behind: String| {
                move |in_snapshot: bool| {
                    Status::from(ApiError::WatchCutOff {
                        behind,
                        in_snapshot,
                    })
                }
            };
            // The snapshot and the backlog the client asked for go at its pace, built one
            // event at a time (a client that does not read holds at most its queue's
            // bytes of them). The changes that arrive meanwhile are kept, after them, and
            // a client with more than the event limit of them waiting is cut off, as it
            // would be once live: a client that stops reading in its snapshot is not kept
            // forever.
            let mut in_snapshot = snapshot.is_some();
            let snapshot_events = snapshot.into_iter().flat_map(|view| {
                let count = view.devices().len();
                let end = proto::WatchEvent {
                    kind: proto::WatchEventKind::SnapshotEnd as i32,
                    generation: view.host_generation.0,
                    address: String::new(),
                    device: None,
                };
                (0..count)
                    .map(move |k| {
                        let v = &view.devices()[k];
                        let device = device_to_proto(v, view.sysfs_device(&v.record.address()));
                        Pending::Ready(Box::new(proto::WatchEvent {
                            kind: proto::WatchEventKind::Snapshot as i32,
                            // The generation the snapshot was read at (the device's own
                            // is in `device`): resuming from it gives what came after.
                            generation: view.host_generation.0,
                            address: v.record.address().to_string(),
                            device: Some(device),
                        }))
                    })
                    .chain(std::iter::once(Pending::Ready(Box::new(end))))
            });
            // The backlog and the live channel were taken under one lock, so no event is
            // in both and none falls between; events at or below `from` are already
            // reflected in what the client holds.
            let mut asked = snapshot_events.chain(backlog.into_iter().map(Pending::Shared));
            let mut early = std::collections::VecDeque::new();
            while let Some(item) = asked
                .next()
                .or_else(|| early.pop_front().map(Pending::Shared))
            {
                let snapshot_end = matches!(&item, Pending::Ready(e)
                    if e.kind == proto::WatchEventKind::SnapshotEnd as i32);
                let mut slot = Some(item);
                while slot.is_some() {
                    tokio::select! {
                        sent = tx.send_from(&mut slot) => {
                            if sent.is_err() {
                                return;
                            }
                        }
                        next = rx.recv() => match next {
                            Ok(e) if e.generation() <= from => {}
                            Ok(e) => {
                                early.push_back(e);
                                if early.len() > limits.events {
                                    let waited = if in_snapshot { "snapshot" } else { "backlog" };
                                    tx.cut_off(behind(format!(
                                        "more than {} events while its {waited} waited",
                                        limits.events
                                    )));
                                    return;
                                }
                            }
                            Err(broadcast::error::RecvError::Lagged(n)) => {
                                tx.cut_off(behind(format!("{n} events")));
                                return;
                            }
                            Err(broadcast::error::RecvError::Closed) => return,
                        },
                    }
                }
                in_snapshot &= !snapshot_end;
            }
            loop {
                let next = tokio::select! {
                    next = rx.recv() => next,
                    // A client that left is noticed at once, not at the next change.
                    _ = tx.closed() => return,
                };
                match next {
                    Ok(e) if e.generation() <= from => continue,
                    Ok(e) => {
                        // A consumer whose queue is full is cut off at once, and what it
                        // had queued is dropped: the agent never waits on a slow client,
                        // and a silent one holds only the status that ends its stream.
                        match tx.try_send(Pending::Shared(e)) {
                            Ok(()) => {}
                            Err(watch_queue::Refused::Gone) => return,
                            Err(watch_queue::Refused::Full) => {
                                tx.cut_off(behind(format!(
                                    "more than {} changes waiting",
                                    limits.events
                                )));
                                return;
                            }
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        tx.cut_off(behind(format!("{n} events")));
                        return;
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                }
            }
        };
        let stopped = async move {
            loop {
                let now = *stopping.borrow_and_update();
                if now {
                    return;
                }
                if stopping.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        };
        tokio::spawn(async move {
            tokio::select! {
                _ = feed => {}
                _ = stopped => {
                    stop_tx.cut_off(|in_snapshot| {
                        ApiError::ShuttingDown {
                            advice: if in_snapshot {
                                "start Watch again with a snapshot: this one did not end"
                            } else {
                                "resume with Watch from the last generation received"
                            },
                        }
                        .into()
                    });
                }
            }
        });
        Ok(Response::new(Box::pin(out.into_stream())))
    }

    async fn get_request_outcome(
        &self,
        req: Request<proto::GetRequestOutcomeRequest>,
    ) -> Result<Response<proto::RequestOutcome>, Status> {
        let r = req.get_ref();
        let consumer = convert::consumer("consumer_id", &r.consumer_id)?;
        let request_id = convert::request_id(&r.request_id)?;
        // Once every command already queued (the vanished client's among them) is
        // decided and committed: its outcome. For a caller allowed to mutate, a request
        // without one is closed at that moment, so that a call the agent has not even
        // read yet cannot apply after this answer; a reader only looks.
        let entry = if self.access.check(&req, "close a request id").is_ok() {
            self.writer
                .settle(consumer, request_id.clone())
                .await
                .map_err(ApiError::from)?
                .ok_or_else(|| {
                    ApiError::NotFound(format!(
                        "no request {request_id} of consumer {consumer} is recorded: it was not applied (or was pruned), and now it never will be: this agent refuses that request id from now on, for as long as it runs (ABORTED, REQUEST_CLOSED; a copy of the call still in transit ends with the process); send the request again with a new request id, never this one"
                    ))
                })?
        } else {
            self.writer
                .lookup(consumer, request_id.clone())
                .await
                .map_err(ApiError::from)?
                .ok_or_else(|| {
                    ApiError::NotFound(format!(
                        "no request {request_id} of consumer {consumer} is recorded yet: it was not applied so far; a caller allowed to mutate gets a final answer (the request id is then closed)"
                    ))
                })?
        };
        // The log holds the generation the claim was made (or bound) at; a binding
        // recorded after it (a Claim with vfio, PrepareVfio) moved the claim on, and so did
        // its device vanishing (the claim lost). While the claim stands, its generation now
        // is the one its owner must present.
        let mut generation = entry.outcome.generation();
        let view = self.writer.view();
        let standing = match &entry.outcome {
            Outcome::Claimed { address, .. } => {
                Self::claim_record(&view, *address, consumer, &request_id)
            }
            Outcome::Bound { .. } => view.ledger.binding_standing(&entry.outcome, consumer),
            Outcome::Released { .. } | Outcome::Transferred { .. } | Outcome::VfCountSet { .. } => {
                None
            }
        };
        if let Some(standing) = standing {
            generation = standing.generation;
        }
        Ok(Response::new(proto::RequestOutcome {
            operation: entry.outcome.operation().into(),
            address: entry.outcome.address().to_string(),
            generation: generation.0,
            at_unix: entry.at,
        }))
    }

    async fn get_status(
        &self,
        _req: Request<proto::GetStatusRequest>,
    ) -> Result<Response<proto::AgentStatus>, Status> {
        let view = self.writer.view();
        let mut by_state: std::collections::HashMap<String, u32> = Default::default();
        let mut lost = 0;
        for st in view.states().values() {
            *by_state.entry(st.name().to_string()).or_default() += 1;
            if *st == DeviceState::Lost {
                lost += 1;
            }
        }
        let read = |slot: &RwLock<HealthInfo>| {
            let h = match slot.read() {
                Ok(g) => g.clone(),
                Err(p) => p.into_inner().clone(),
            };
            proto::Health {
                ok: h.ok,
                detail: h.detail,
            }
        };
        let reloads = match self.info.reloads.read() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        };
        let store = self.writer.store_health();
        let oldest = match self.writer.events().lock() {
            Ok(g) => g.oldest(),
            Err(p) => p.into_inner().oldest(),
        };
        Ok(Response::new(proto::AgentStatus {
            version: env!("CARGO_PKG_VERSION").into(),
            host_generation: view.host_generation.0,
            uptime_seconds: self.info.started.elapsed().as_secs(),
            store: Some(proto::Health {
                ok: store.is_none(),
                detail: store.unwrap_or_else(|| "last commit succeeded".into()),
            }),
            libvirt: Some(read(&self.info.libvirt)),
            boot_id: self.info.boot_id.clone(),
            devices_by_state: by_state,
            strays: u32::try_from(view.stray_count()).unwrap_or(u32::MAX),
            lost,
            watch_oldest_generation: oldest.0,
            hotplug: Some(read(&self.info.hotplug)),
            uevents: self.writer.metrics().uevent_counts().0,
            uevent_resyncs: self.writer.metrics().uevent_counts().1,
            libvirt_events: Some(read(&self.info.libvirt_events)),
            reloads_started: reloads.started,
            reloads_finished: reloads.finished,
            last_reload: reloads.last.map(|h| proto::Health {
                ok: h.ok,
                detail: h.detail,
            }),
        }))
    }

    async fn prepare_vfio(
        &self,
        req: Request<proto::PrepareVfioRequest>,
    ) -> Result<Response<proto::PrepareVfioResponse>, Status> {
        self.access.check(&req, "prepare-vfio")?;
        let r = req.get_ref();
        let owner = convert::owner("owner", r.owner.as_ref())?;
        let address = convert::address("address", &r.address)?;
        let request_id = if r.request_id.is_empty() {
            None
        } else {
            Some(convert::request_id(&r.request_id)?)
        };
        let (generation, members, replayed) = match self
            .bind_vfio(
                address,
                owner.consumer,
                Generation(r.generation),
                request_id,
            )
            .await
        {
            Ok(bound) => bound,
            // A sysfs step failed after the binding was recorded: the claim moved to a
            // new generation, and an answer without it would read as nothing changed.
            Err(e @ ApiError::Write(crate::writer::WriteError::Hardware(_))) => {
                let now = self
                    .writer
                    .view()
                    .device(address)
                    .find(|v| {
                        v.record.present
                            && v.record
                                .claim
                                .as_ref()
                                .is_some_and(|c| c.owner.consumer == owner.consumer)
                    })
                    .map(|v| v.record.generation.0);
                return Err(match now {
                    Some(generation) if generation != r.generation => ApiError::BindingNotDone {
                        address,
                        generation,
                        source: Box::new(e),
                    },
                    _ => e,
                }
                .into());
            }
            Err(e) => return Err(e.into()),
        };
        Ok(Response::new(proto::PrepareVfioResponse {
            device: self.present_device(address),
            generation: generation.0,
            members,
            replayed,
        }))
    }

    async fn set_vf_count(
        &self,
        req: Request<proto::SetVfCountRequest>,
    ) -> Result<Response<proto::SetVfCountResponse>, Status> {
        self.access.check(&req, "set-vf-count")?;
        let r = req.get_ref();
        let pf = convert::address("address", &r.address)?;
        let request = match (r.consumer_id.is_empty(), r.request_id.is_empty()) {
            (true, true) => None,
            (false, false) => Some((
                convert::consumer("consumer_id", &r.consumer_id)?,
                convert::request_id(&r.request_id)?,
            )),
            (true, false) => {
                return Err(ApiError::BadField {
                    field: "consumer_id",
                    reason: "a request id needs the caller's consumer id, which keys it".into(),
                }
                .into())
            }
            (false, true) => {
                return Err(ApiError::BadField {
                    field: "request_id",
                    reason: "a consumer id is used only with a request id".into(),
                }
                .into())
            }
        };
        // A retry of a change logged under its request id is answered as the first call,
        // before any check: the VFs may be claimed or in use by now, which is no reason
        // to refuse an answer about a change made before. The writer looks again when the
        // change begins, for a retry that arrives while the first call is recorded.
        if let Some((consumer, request_id)) = &request {
            let logged = self
                .writer
                .lookup(*consumer, request_id.clone())
                .await
                .map_err(ApiError::from)?;
            if let Some(entry) = logged {
                let first = crate::ledger::vf_count_replay(&entry, pf, r.vf_count)
                    .map_err(|e| ApiError::from(WriteError::Ledger(e)))?;
                self.writer
                    .metrics()
                    .applied(crate::metrics::Op::SetVfCount, true);
                return Ok(Response::new(proto::SetVfCountResponse {
                    device: self.present_device(pf),
                    generation: first.generation.0,
                    previous_vf_count: first.before,
                    replayed: true,
                }));
            }
        }
        let old_vfs: BTreeSet<PciAddress> = self
            .writer
            .view()
            .sysfs_device(&pf)
            .and_then(|d| d.sriov.as_ref())
            .map(|s| s.vfs.iter().copied().collect())
            .unwrap_or_default();
        // Writing the count destroys every VF, so the PF and its VFs are checked as for a
        // free first, every time: a fresh listing of the domains (the ledger refuses a
        // change while a domain uses one) and no VFIO holder. Never skipped on what the
        // published view says: a release queued before this call may free the claimed VF
        // that the view still shows, and the writer would then write the count unchecked.
        // Where the checks fail and the ledger refuses the change anyway (a stale
        // generation, a claimed VF), that refusal is the answer.
        let devices: Vec<PciAddress> = std::iter::once(pf).chain(old_vfs.iter().copied()).collect();
        // The write needs the rescans' turn, which another change may hold for minutes:
        // taken before the checks, so that nothing comes between them and the write.
        let turn = self.rescanner.hold().await;
        if let Err(e) = self.unused(&devices, &format!("{pf} and its VFs")).await {
            let refused = self
                .writer
                .view()
                .ledger
                .check_vf_change(pf, Generation(r.generation))
                .err()
                .filter(|e| !matches!(e, crate::ledger::LedgerError::VfCountInUse { .. }));
            return Err(self.refusal_first(refused, e).into());
        }
        let change = crate::writer::SetVfCount {
            pf,
            generation: Generation(r.generation),
            count: r.vf_count,
            autoprobe: r.drivers_autoprobe,
            request,
        };
        let result = self
            .after_hardware_in(
                Some(turn),
                move |w| async move { w.set_vf_count(change).await },
                // Written or not, show what the kernel has now: the PF and its VFs, before
                // and after (the rescan finds the new ones through the PF).
                move |result| {
                    if matches!(result, Err(crate::writer::WriteError::Ledger(_))) {
                        BTreeSet::new()
                    } else {
                        let mut changed = old_vfs;
                        changed.insert(pf);
                        changed
                    }
                },
            )
            .await;
        if matches!(result, Err(crate::writer::WriteError::Store(_))) {
            // The change's record was refused (a full disk): its PF and VFs stay held
            // back until a full scan applies, tried until the disk takes one.
            self.rescanner
                .owe_full_scan("a VF count change could not be recorded");
        }
        let done = result.map_err(ApiError::from)?;
        let device = self.present_device(pf);
        Ok(Response::new(proto::SetVfCountResponse {
            generation: device
                .as_ref()
                .map(|d| d.generation)
                .filter(|_| !done.replayed)
                .unwrap_or(done.generation.0),
            device,
            previous_vf_count: done.before,
            replayed: done.replayed,
        }))
    }
}

impl HostDevService {
    /// Binds a claimed device's group to vfio-pci, then rescans the members so the
    /// listing shows their drivers; answers the device's generation after that, the
    /// members, and whether the answer replays a logged request (`request_id`: logged
    /// with the binding; a retry whose claim has ended since answers the first call's
    /// generation and no members).
    async fn bind_vfio(
        &self,
        address: PciAddress,
        consumer: crate::pci::ConsumerId,
        generation: Generation,
        request_id: Option<RequestId>,
    ) -> Result<(Generation, Vec<proto::BoundMember>, bool), ApiError> {
        // The binding moves every member of the group to vfio-pci, and the ledger refuses
        // one a domain uses: on the domains listed afresh, as for a free, never on a view
        // that libvirt may not have filled yet (after a start while it was unreachable).
        // The rescans' turn first, so that nothing comes between the listing and the
        // binding's decision. A retry of a logged binding that moves nothing now (its
        // claim ended, or every member it recorded is on vfio-pci) is answered from the
        // log, libvirt answering or not, as every retry is; should the writer find that it
        // would move devices after all (a member left vfio-pci since the view was read),
        // it refuses without a listing, and the call is made again with one.
        let from_log = match &request_id {
            Some(id) => match self.writer.lookup(consumer, id.clone()).await? {
                Some(entry) => match entry.outcome {
                    crate::ledger::Outcome::Bound { record, .. } => {
                        !self.binding_unfinished(record, consumer)
                    }
                    _ => false,
                },
                None => false,
            },
            None => false,
        };
        let mut listed = !from_log;
        let result = loop {
            let turn = if listed {
                let turn = self.rescanner.hold().await;
                drop(
                    self.guard
                        .refresh(&self.writer, &format!("the IOMMU group of {address}"))
                        .await?,
                );
                Some(turn)
            } else {
                None
            };
            let request_id = request_id.clone();
            let result = self
                .after_hardware_in(
                    turn,
                    move |w| async move {
                        w.bind_vfio(crate::writer::BindVfio {
                            address,
                            consumer,
                            generation,
                            request_id,
                            listed,
                        })
                        .await
                    },
                    move |result| match result {
                        Ok(b) => b.members.iter().map(|m| m.address).collect(),
                        Err(_) => [address].into(),
                    },
                )
                .await;
            match result {
                Err(WriteError::ListingNeeded { .. }) if !listed => listed = true,
                result => break result,
            }
        };
        let bound = result.map_err(ApiError::from)?;
        let ended = bound.replayed && bound.members.is_empty();
        let now = self
            .writer
            .view()
            .device(address)
            .find(|v| v.record.present)
            .map(|v| v.record.generation)
            .filter(|_| !ended)
            .unwrap_or(bound.generation);
        Ok((
            now,
            bound
                .members
                .iter()
                .map(convert::bound_member_to_proto)
                .collect(),
            bound.replayed,
        ))
    }

    /// A free (made by `action` from the writer) that gives drivers back to `bound`: as a
    /// hardware action, with the members rescanned after, so the answer comes once sysfs
    /// shows them on their drivers. Without any, nothing in sysfs changes, and the free
    /// takes no hold on the rescans. `turn`: the rescans' turn, where the caller took it
    /// already (from [`Rescanner::hold`]).
    async fn giving_back<X, F, Fut>(
        &self,
        bound: BTreeSet<PciAddress>,
        turn: Option<Turn>,
        action: F,
    ) -> Result<X, WriteError>
    where
        X: Send + 'static,
        F: FnOnce(Writer) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<X, WriteError>> + Send + 'static,
    {
        if bound.is_empty() {
            drop(turn);
            action(self.writer.clone()).await
        } else {
            self.after_hardware_in(turn, action, |_| bound).await
        }
    }

    /// Runs a hardware action (made by `action` from the writer) with the other rescans
    /// held off, then rescans the devices `then` names from its result (a failed rescan
    /// is logged: the uevents that follow rescan them again). The hold is taken on the
    /// caller's task, so a caller that goes away while it waits for it sends nothing;
    /// the action and its rescan run on a task of their own, so a caller that goes away
    /// (it disconnects, or its deadline passes) once the action is sent does not end
    /// the hold while the writer still acts on the hardware. `held`: the rescans' turn,
    /// where the caller took it already (`None`: taken here).
    async fn after_hardware_in<X, F, Fut>(
        &self,
        held: Option<Turn>,
        action: F,
        then: impl FnOnce(&Result<X, WriteError>) -> BTreeSet<PciAddress> + Send + 'static,
    ) -> Result<X, WriteError>
    where
        X: Send + 'static,
        F: FnOnce(Writer) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<X, WriteError>> + Send + 'static,
    {
        let (rescanner, writer) = (self.rescanner.clone(), self.writer.clone());
        let held = match held {
            Some(h) => h,
            None => rescanner.hold().await,
        };
        tokio::spawn(async move {
            let (out, rescanned) = rescanner.around(held, action(writer), then).await;
            if let Err(e) = rescanned {
                tracing::warn!(error = %e, "rescan after a hardware action failed");
            }
            out
        })
        .await
        .unwrap_or_else(|e| {
            tracing::error!(error = %e, "a hardware action's task failed");
            Err(WriteError::ShuttingDown)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(all: usize, per_uid: usize) -> WatchLimits {
        WatchLimits::new(
            all,
            QueueLimits {
                events: 16,
                bytes: 1 << 16,
            },
        )
        .per_caller(per_uid)
    }

    /// One uid at its cap leaves the others their streams, and a TCP peer address has a
    /// cap of its own; the cap over all streams still holds across callers and for a
    /// peer without credentials; a refusal by the cap over all gives the caller's place
    /// back, and a closed stream gives both back.
    #[test]
    fn watch_streams_are_capped_per_caller_and_in_all() {
        let uid = |u: u32| Caller::Uid(Some(u));
        let l = limits(5, 2);
        let a1 = l.take(uid(0)).expect("root 1");
        let _a2 = l.take(uid(0)).expect("root 2");
        let e = l.take(uid(0)).map(|_| ()).expect_err("root's third");
        assert!(
            matches!(e, ApiError::TooManyWatchers { limit: 2, caller: Some(c) } if c == uid(0)),
            "{e:?}"
        );
        assert!(
            e.to_string()
                .contains("for uid 0, the limit ([api] max_watch_streams_per_uid)"),
            "{e}"
        );
        let peer = Caller::Peer([10, 0, 0, 7].into());
        let _p1 = l.take(peer).expect("a TCP peer");
        let _p2 = l.take(peer).expect("the TCP peer's second");
        let e = l.take(peer).map(|_| ()).expect_err("the TCP peer's third");
        assert!(e.to_string().contains("for TCP peer 10.0.0.7"), "{e}");
        let _t = l
            .take(Caller::Uid(None))
            .expect("no credentials: the cap over all only");
        let e = l.take(uid(1001)).map(|_| ()).expect_err("all five taken");
        assert!(
            matches!(
                e,
                ApiError::TooManyWatchers {
                    limit: 5,
                    caller: None
                }
            ),
            "{e:?}"
        );
        // The refusal left uid 1001 no place: once a stream closes, it has both.
        drop(a1);
        let _c1 = l.take(uid(1001)).expect("a slot given back");
        assert_eq!(
            l.by_caller.held_by(uid(1001)),
            1,
            "the refused try took nothing"
        );
        assert_eq!(l.by_caller.held_by(uid(0)), 1);
        assert_eq!(l.by_caller.held_by(peer), 2);
    }
}
