//! The one map from every error the API can return to a gRPC status with google.rpc
//! details (ErrorInfo always, PreconditionFailure or BadRequest where they apply).

use std::collections::HashMap;

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::api::per_uid::Caller;
use crate::domains::DomainsError;
use crate::ledger::LedgerError;
use crate::pci::{IdError, PciAddress};
use crate::vfio::{Holder, VfioError};
use crate::writer::WriteError;

/// The ErrorInfo domain of every error this API returns.
pub const ERROR_DOMAIN: &str = "hostdev.v1";

/// Everything an RPC can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("invalid {field}: {source}")]
    BadId {
        field: &'static str,
        #[source]
        source: IdError,
    },
    #[error("invalid {field}: {reason}")]
    BadField { field: &'static str, reason: String },
    #[error(transparent)]
    Write(#[from] WriteError),
    #[error("{0}")]
    PermissionDenied(String),
    /// A request message that protobuf cannot decode.
    #[error("malformed request message: {0}")]
    Malformed(#[source] prost::DecodeError),
    #[error("watch cannot resume from generation {from}: this agent can replay from {oldest} up to its host generation {current}; list devices again and watch from the listed host generation")]
    TooOld {
        from: u64,
        oldest: u64,
        current: u64,
    },
    /// A Reconcile snapshot past the host generation: not read from this agent.
    #[error("snapshot generation {snapshot} is past this agent's host generation {current}, so it was not read from this agent (another host's agent, or a state dir restored since); list devices again and audit against the listed host generation; nothing was changed")]
    SnapshotAhead { snapshot: u64, current: u64 },
    /// The agent is stopping: an open Watch stream ends with this, and a new one is
    /// refused.
    #[error("the agent is shutting down; {advice}")]
    ShuttingDown { advice: &'static str },
    /// A watcher fell behind (its queue full, or the live channel lagged past it) and its
    /// stream was ended.
    #[error("watcher fell behind by {behind} and was cut off{}", if *in_snapshot { " before its snapshot's end; start again with a snapshot" } else { "; resume with Watch from the last generation received" })]
    WatchCutOff {
        /// How far: "12 events", "more than 1024 changes waiting".
        behind: String,
        /// Cut off before its snapshot's end: it holds part of a snapshot only, and must
        /// start again with one rather than resume.
        in_snapshot: bool,
    },
    /// Every Watch stream slot is taken, or every one the caller may hold.
    #[error("too many watch streams: {limit} are open{}; close one, or share one stream between the consumers of a client", match .caller { Some(c) => format!(" for {}, the limit ([api] max_watch_streams_per_uid)", c.name()), None => ", the limit ([api] max_watch_streams)".to_string() })]
    TooManyWatchers {
        limit: usize,
        /// The caller whose own cap was reached; `None`: the cap over all streams.
        caller: Option<Caller>,
    },
    /// A call while its caller has `[api] max_calls_per_uid` open (see `api::gate`).
    #[error("too many calls at once: {} {limit} open already (running, answered and not yet read, or Watch streams), the limit ([api] max_calls_per_uid); read the answers asked for, or close streams not in use; nothing was changed", .caller.has())]
    TooManyCalls { limit: usize, caller: Caller },
    /// A call of a kind whose calls are heavy (a Reconcile's message, a listing's answer)
    /// while its caller has as many of them open as it may: refused before its message
    /// is read (see `api::gate`).
    #[error("too many {rpc} calls at once: {} {limit} open already (running, or answered and not yet read), the most one caller may; read the answers asked for, or try again once one has been answered; nothing was changed", .caller.has())]
    TooManyAtOnce {
        rpc: &'static str,
        limit: usize,
        caller: Caller,
    },
    /// A new connection whose peer uid holds `[api] max_connections_per_uid` already: its
    /// calls are answered with this, and it is closed.
    #[error("hostdevd refused this connection: {} {limit} connections to its socket open already, the limit ([api] max_connections_per_uid); close the ones not in use (a client that opens a connection per call and keeps it?)", match .uid { Some(u) => format!("uid {u} holds"), None => "peers without credentials hold".to_string() })]
    TooManyConnections { limit: usize, uid: Option<u32> },
    #[error("{0}")]
    NotFound(String),
    /// libvirt did not answer the fresh domain list a free needs.
    #[error("cannot prove {what} unused: {source}")]
    LibvirtUnreachable {
        /// The device's address, or "the orphans" for an acting reconcile.
        what: String,
        #[source]
        source: Box<DomainsError>,
    },
    /// The order of the free checks stayed taken past the libvirt timeout: by a listing
    /// of the domains, another free's checks, or an acting audit while its frees (drivers
    /// given back included) are carried out.
    #[error("cannot check {what} now: a listing of the domains, another free's check or an acting audit's frees held the order of the checks for more than {ms} ms; nothing was changed, try again")]
    FreeCheckBusy { what: String, ms: u128 },
    /// A process holds the device's VFIO group, or its VFIO device node, open.
    #[error("{address} is in use: its {} is held open by {}; nothing was changed", crate::vfio::describe_node(node), holder.describe())]
    VfioHeld {
        address: PciAddress,
        /// The group node or device node held open.
        node: std::path::PathBuf,
        holder: Box<Holder>,
    },
    /// The proc tree could not be scanned for VFIO holders.
    #[error("cannot prove {what} unused: {source}")]
    HoldersUnknown {
        what: String,
        #[source]
        source: Box<VfioError>,
    },
    /// A Claim with `vfio` whose claim was committed but whose binding failed: the claim
    /// stands, so the answer must not read as one that changed nothing.
    #[error("claimed {address} (generation {generation}), but binding it to vfio-pci failed: {source}; the claim stands: release it with generation {generation}, or send the same request again to retry the binding")]
    ClaimedNotBound {
        address: PciAddress,
        /// The claim's generation now.
        generation: u64,
        #[source]
        source: Box<ApiError>,
    },
    /// A PrepareVfio that recorded its binding (a new generation) and then failed in a
    /// sysfs step: the claim stands at that generation, which the caller must learn.
    #[error("binding {address} to vfio-pci failed after the binding was recorded: {source}; the claim stands at generation {generation}: send PrepareVfio again with it, or the same request with its request id, to finish the binding, or release with it")]
    BindingNotDone {
        address: PciAddress,
        /// The claim's generation now.
        generation: u64,
        #[source]
        source: Box<ApiError>,
    },
}

/// The reasons of the refusals the service decides itself, before the writer.
const LIBVIRT_UNREACHABLE: &str = "LIBVIRT_UNREACHABLE";
const FREE_CHECK_BUSY: &str = "FREE_CHECK_BUSY";
const VFIO_GROUP_IN_USE: &str = "VFIO_GROUP_IN_USE";
const VFIO_HOLDERS_UNKNOWN: &str = "VFIO_HOLDERS_UNKNOWN";
const SNAPSHOT_AHEAD: &str = "SNAPSHOT_AHEAD";
const TOO_MANY_AT_ONCE: &str = "TOO_MANY_AT_ONCE";
const TOO_MANY_CALLS: &str = "TOO_MANY_CALLS";

impl ApiError {
    pub fn bad_id(field: &'static str) -> impl FnOnce(IdError) -> ApiError {
        move |source| ApiError::BadId { field, source }
    }

    /// The reason of a refusal the service's own checks decided (the fresh libvirt
    /// listing, the VFIO holder scan, a snapshot from the future), for the rejections
    /// metric; the writer counts the ledger's refusals itself.
    pub fn check_reason(&self) -> Option<&'static str> {
        match self {
            ApiError::LibvirtUnreachable { .. } => Some(LIBVIRT_UNREACHABLE),
            ApiError::FreeCheckBusy { .. } => Some(FREE_CHECK_BUSY),
            ApiError::VfioHeld { .. } => Some(VFIO_GROUP_IN_USE),
            ApiError::HoldersUnknown { .. } => Some(VFIO_HOLDERS_UNKNOWN),
            ApiError::SnapshotAhead { .. } => Some(SNAPSHOT_AHEAD),
            ApiError::TooManyAtOnce { .. } => Some(TOO_MANY_AT_ONCE),
            ApiError::TooManyCalls { .. } => Some(TOO_MANY_CALLS),
            _ => None,
        }
    }
}

fn ledger_code(e: &LedgerError) -> Code {
    use LedgerError::*;
    match e {
        StaleGeneration { .. } => Code::Aborted,
        UnknownDevice { .. } => Code::NotFound,
        AlreadyClaimed { .. }
        | NotClaimed { .. }
        | WrongOwner { .. }
        | Attached { .. }
        | Blocked { .. }
        | InUseByDomain { .. }
        | Unmanaged { .. }
        | Lost { .. }
        | NotPhysicalFunction { .. }
        | VfClaimed { .. }
        | VfCountInUse { .. }
        | VfInUseByDomain { .. }
        | GroupMemberInUse { .. }
        | BindingMemberInUse { .. }
        | VfGroupClaimed { .. }
        | NoIommuGroup { .. } => Code::FailedPrecondition,
        NoMatch { .. } => Code::ResourceExhausted,
        RequestIdReused { .. } => Code::InvalidArgument,
        // Retryable: refused for the seconds a VF count change takes.
        VfCountChanging { .. } => Code::Unavailable,
    }
}

fn ledger_metadata(e: &LedgerError) -> HashMap<String, String> {
    let mut m = HashMap::new();
    if let Some(a) = e.address() {
        m.insert("address".into(), a.to_string());
    }
    if let Some(g) = e.current_generation() {
        m.insert("current_generation".into(), g.to_string());
    }
    if let Some(o) = e.current_owner() {
        m.insert("owner_consumer_id".into(), o.consumer.to_string());
        m.insert("owner_label".into(), o.label.to_string());
    }
    let domain_meta = |m: &mut HashMap<String, String>, domain: &crate::ledger::DomainRef| {
        m.insert("domain_name".into(), domain.name.clone());
        m.insert("domain_uuid".into(), domain.uuid.to_string());
        m.insert("domain_running".into(), domain.running.to_string());
    };
    match e {
        LedgerError::Attached { domain, .. } | LedgerError::InUseByDomain { domain, .. } => {
            domain_meta(&mut m, domain);
        }
        LedgerError::VfCountInUse { device, domain, .. }
        | LedgerError::VfInUseByDomain {
            vf: device, domain, ..
        } => {
            m.insert("device_in_use".into(), device.to_string());
            domain_meta(&mut m, domain);
        }
        LedgerError::GroupMemberInUse {
            member,
            used,
            domain,
            ..
        }
        | LedgerError::BindingMemberInUse {
            member,
            used,
            domain,
            ..
        } => {
            m.insert("group_member".into(), member.to_string());
            m.insert("device_in_use".into(), used.to_string());
            domain_meta(&mut m, domain);
        }
        LedgerError::VfGroupClaimed { vf, claimed, .. } => {
            m.insert("group_vf".into(), vf.to_string());
            m.insert("blocked_by".into(), claimed.to_string());
        }
        LedgerError::Blocked { by, relation, .. } => {
            m.insert("blocked_by".into(), by.to_string());
            m.insert("relation".into(), format!("{relation:?}"));
        }
        LedgerError::StaleGeneration { presented, .. } => {
            m.insert("presented_generation".into(), presented.to_string());
        }
        LedgerError::VfClaimed { vf, .. } => {
            m.insert("claimed_vf".into(), vf.to_string());
        }
        LedgerError::VfCountChanging { pf, .. } => {
            m.insert("changing_pf".into(), pf.to_string());
        }
        _ => {}
    }
    m
}

/// A status about one request id (`reason`, with the consumer and the request id in its
/// ErrorInfo, and the PF it names where there is one).
fn about_a_request(
    code: Code,
    reason: &str,
    msg: String,
    consumer: &crate::pci::ConsumerId,
    request_id: &crate::pci::RequestId,
    pf: Option<(&str, &PciAddress)>,
) -> Status {
    let mut meta = HashMap::from([
        ("consumer_id".to_string(), consumer.to_string()),
        ("request_id".to_string(), request_id.to_string()),
    ]);
    if let Some((key, pf)) = pf {
        meta.insert(key.to_string(), pf.to_string());
    }
    let d = ErrorDetails::with_error_info(reason, ERROR_DOMAIN, meta);
    Status::with_error_details(code, msg, d)
}

/// The HTTP/2 answer that carries `status` alone (gRPC's "trailers-only" form), for a call
/// refused before any service runs. A status whose headers cannot be written (never, for
/// this API's) goes as its bare code.
pub fn trailers_only<B: Default>(status: &Status) -> http::Response<B> {
    let mut answer = http::Response::new(B::default());
    answer.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    if status.add_header(answer.headers_mut()).is_err() {
        answer
            .headers_mut()
            .insert("grpc-status", http::HeaderValue::from(status.code() as i32));
    }
    answer
}

/// RESOURCE_EXHAUSTED for a caller over one of its limits: ErrorInfo `reason` with
/// `facts`, and the caller's `uid` or `peer` where it has one.
fn over_a_limit<const N: usize>(
    reason: &str,
    msg: String,
    facts: [(&str, String); N],
    caller: Option<Caller>,
) -> Status {
    let mut meta: HashMap<String, String> =
        facts.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    if let Some((key, value)) = caller.as_ref().and_then(Caller::metadata) {
        meta.insert(key.to_string(), value);
    }
    let d = ErrorDetails::with_error_info(reason, ERROR_DOMAIN, meta);
    Status::with_error_details(Code::ResourceExhausted, msg, d)
}

impl From<ApiError> for Status {
    fn from(e: ApiError) -> Status {
        to_status(&e)
    }
}

/// Maps an API error to its status. Exhaustive: a new error variant cannot be added
/// without choosing its code here.
pub fn to_status(e: &ApiError) -> Status {
    let msg = e.to_string();
    match e {
        ApiError::BadId { field, .. } | ApiError::BadField { field, .. } => {
            let mut d =
                ErrorDetails::with_error_info("INVALID_ARGUMENT", ERROR_DOMAIN, HashMap::new());
            d.add_bad_request_violation(*field, msg.clone());
            Status::with_error_details(Code::InvalidArgument, msg, d)
        }
        ApiError::Write(WriteError::Ledger(le)) => {
            let code = ledger_code(le);
            let mut d =
                ErrorDetails::with_error_info(le.reason(), ERROR_DOMAIN, ledger_metadata(le));
            if code == Code::FailedPrecondition || code == Code::Aborted {
                d.add_precondition_failure_violation(
                    le.reason(),
                    le.address().map(|a| a.to_string()).unwrap_or_default(),
                    msg.clone(),
                );
            }
            Status::with_error_details(code, msg, d)
        }
        ApiError::Write(WriteError::Store(se)) => {
            let reason = if se.is_disk_full() {
                "STORE_FULL"
            } else if se.is_read_only() {
                "STORE_READ_ONLY"
            } else {
                "STORE_ERROR"
            };
            let d = ErrorDetails::with_error_info(reason, ERROR_DOMAIN, HashMap::new());
            Status::with_error_details(Code::Unavailable, msg, d)
        }
        ApiError::Write(WriteError::Hardware(he)) => {
            use crate::hardware::HardwareError as H;
            let mut meta = HashMap::from([("step".to_string(), he.step().to_string())]);
            if let Some(errno) = he.errno() {
                meta.insert("errno".into(), errno);
            }
            let (code, reason) = match he {
                H::Disabled => (Code::Unimplemented, "HARDWARE_DISABLED"),
                H::NotPhysicalFunction { .. } | H::TooManyVfs { .. } | H::NoIommuGroup { .. } => {
                    (Code::FailedPrecondition, "HARDWARE_PRECONDITION")
                }
                H::DriverMissing { .. } => (Code::FailedPrecondition, "DRIVER_NOT_LOADED"),
                H::Timeout { .. } | H::ReadTimeout { .. } => {
                    (Code::DeadlineExceeded, "HARDWARE_STEP_TIMEOUT")
                }
                H::Write { .. }
                | H::Read { .. }
                | H::Driver { .. }
                | H::VfCount { .. }
                | H::Abandoned { .. } => (Code::Internal, "HARDWARE_STEP_FAILED"),
            };
            let mut d = ErrorDetails::with_error_info(reason, ERROR_DOMAIN, meta);
            if code == Code::FailedPrecondition {
                d.add_precondition_failure_violation(reason, he.step(), msg.clone());
            }
            Status::with_error_details(code, msg, d)
        }
        ApiError::Write(WriteError::RequestClosed {
            consumer,
            request_id,
        }) => about_a_request(
            Code::Aborted,
            "REQUEST_CLOSED",
            msg,
            consumer,
            request_id,
            None,
        ),
        ApiError::Write(WriteError::RequestInProgress {
            consumer,
            request_id,
            pf,
        }) => about_a_request(
            Code::Unavailable,
            "REQUEST_IN_PROGRESS",
            msg,
            consumer,
            request_id,
            Some(("changing_pf", pf)),
        ),
        ApiError::Write(WriteError::VfCountNotRecorded {
            consumer,
            request_id,
            pf,
        }) => about_a_request(
            Code::FailedPrecondition,
            "VF_COUNT_NOT_RECORDED",
            msg,
            consumer,
            request_id,
            Some(("address", pf)),
        ),
        ApiError::Write(WriteError::ChangedWhileChecked {
            address,
            generation,
        }) => {
            let meta = HashMap::from([
                ("address".to_string(), address.to_string()),
                ("current_generation".to_string(), generation.to_string()),
            ]);
            let d = ErrorDetails::with_error_info("CHANGED_WHILE_CHECKED", ERROR_DOMAIN, meta);
            Status::with_error_details(Code::Aborted, msg, d)
        }
        ApiError::Write(WriteError::OutcomeUnknown(_)) => {
            let d = ErrorDetails::with_error_info(
                "STORE_OUTCOME_UNKNOWN",
                ERROR_DOMAIN,
                HashMap::new(),
            );
            Status::with_error_details(Code::Unavailable, msg, d)
        }
        ApiError::Write(WriteError::StoreFailed(_)) => {
            let d = ErrorDetails::with_error_info("STORE_FAILED", ERROR_DOMAIN, HashMap::new());
            Status::with_error_details(Code::Unavailable, msg, d)
        }
        ApiError::Write(WriteError::ShuttingDown) => {
            let d = ErrorDetails::with_error_info("SHUTTING_DOWN", ERROR_DOMAIN, HashMap::new());
            Status::with_error_details(Code::Unavailable, msg, d)
        }
        ApiError::Write(WriteError::ScanNotStored(_)) => {
            let d = ErrorDetails::with_error_info("SCAN_NOT_STORED", ERROR_DOMAIN, HashMap::new());
            Status::with_error_details(Code::Unavailable, msg, d)
        }
        // The service asks again with a fresh listing: only a caller of the writer that
        // does not would see it.
        ApiError::Write(WriteError::ListingNeeded { address }) => {
            let d = ErrorDetails::with_error_info(
                "LISTING_NEEDED",
                ERROR_DOMAIN,
                HashMap::from([("address".to_string(), address.to_string())]),
            );
            Status::with_error_details(Code::Unavailable, msg, d)
        }
        ApiError::Malformed(_) => {
            let d =
                ErrorDetails::with_error_info("MALFORMED_MESSAGE", ERROR_DOMAIN, HashMap::new());
            Status::with_error_details(Code::InvalidArgument, msg, d)
        }
        ApiError::PermissionDenied(_) => {
            let d =
                ErrorDetails::with_error_info("PERMISSION_DENIED", ERROR_DOMAIN, HashMap::new());
            Status::with_error_details(Code::PermissionDenied, msg, d)
        }
        ApiError::TooOld { oldest, .. } => {
            let meta = HashMap::from([("oldest_generation".to_string(), oldest.to_string())]);
            let d = ErrorDetails::with_error_info("WATCH_TOO_OLD", ERROR_DOMAIN, meta);
            Status::with_error_details(Code::OutOfRange, msg, d)
        }
        ApiError::SnapshotAhead { snapshot, current } => {
            let meta = HashMap::from([
                ("snapshot_generation".to_string(), snapshot.to_string()),
                ("current_generation".to_string(), current.to_string()),
            ]);
            let d = ErrorDetails::with_error_info(SNAPSHOT_AHEAD, ERROR_DOMAIN, meta);
            Status::with_error_details(Code::OutOfRange, msg, d)
        }
        ApiError::ShuttingDown { .. } => {
            let d = ErrorDetails::with_error_info("SHUTTING_DOWN", ERROR_DOMAIN, HashMap::new());
            Status::with_error_details(Code::Unavailable, msg, d)
        }
        ApiError::WatchCutOff { in_snapshot, .. } => {
            let meta = HashMap::from([
                ("in_snapshot".to_string(), in_snapshot.to_string()),
                // What the client does next: a watcher holding part of a snapshot starts
                // again with one; any other resumes from the last generation it received.
                (
                    "recovery".to_string(),
                    if *in_snapshot {
                        "watch_snapshot"
                    } else {
                        "resume_from_last_generation"
                    }
                    .to_string(),
                ),
            ]);
            let d = ErrorDetails::with_error_info("WATCH_CUT_OFF", ERROR_DOMAIN, meta);
            Status::with_error_details(Code::ResourceExhausted, msg, d)
        }
        ApiError::TooManyWatchers { limit, caller } => {
            // With a caller, its own cap was reached; without, the cap over all.
            let setting = match caller {
                Some(_) => "max_watch_streams_per_uid",
                None => "max_watch_streams",
            };
            over_a_limit(
                "TOO_MANY_WATCHERS",
                msg,
                [(setting, limit.to_string())],
                *caller,
            )
        }
        ApiError::TooManyCalls { limit, caller } => over_a_limit(
            TOO_MANY_CALLS,
            msg,
            [("max_calls_per_uid", limit.to_string())],
            Some(*caller),
        ),
        ApiError::TooManyAtOnce { rpc, limit, caller } => over_a_limit(
            TOO_MANY_AT_ONCE,
            msg,
            [("rpc", rpc.to_string()), ("at_once", limit.to_string())],
            Some(*caller),
        ),
        ApiError::TooManyConnections { limit, uid } => over_a_limit(
            "TOO_MANY_CONNECTIONS",
            msg,
            [("max_connections_per_uid", limit.to_string())],
            Some(Caller::Uid(*uid)),
        ),
        ApiError::NotFound(_) => {
            let d = ErrorDetails::with_error_info("NOT_FOUND", ERROR_DOMAIN, HashMap::new());
            Status::with_error_details(Code::NotFound, msg, d)
        }
        ApiError::LibvirtUnreachable { what, .. } => {
            let meta = HashMap::from([("checking".to_string(), what.clone())]);
            let d = ErrorDetails::with_error_info(LIBVIRT_UNREACHABLE, ERROR_DOMAIN, meta);
            Status::with_error_details(Code::Unavailable, msg, d)
        }
        ApiError::FreeCheckBusy { what, ms } => {
            let meta = HashMap::from([
                ("checking".to_string(), what.clone()),
                ("waited_ms".to_string(), ms.to_string()),
            ]);
            let d = ErrorDetails::with_error_info(FREE_CHECK_BUSY, ERROR_DOMAIN, meta);
            Status::with_error_details(Code::Unavailable, msg, d)
        }
        ApiError::VfioHeld {
            address,
            node,
            holder,
        } => {
            let mut meta = HashMap::from([
                ("address".to_string(), address.to_string()),
                // Named for the group node it always held before device nodes counted.
                ("vfio_group".to_string(), node.display().to_string()),
                ("holder_pid".to_string(), holder.pid.to_string()),
                ("holder_command".to_string(), holder.command.clone()),
            ]);
            if let Some(n) = &holder.domain_name {
                meta.insert("domain_name".into(), n.clone());
            }
            if let Some(u) = &holder.domain_uuid {
                meta.insert("domain_uuid".into(), u.to_string());
            }
            let mut d = ErrorDetails::with_error_info(VFIO_GROUP_IN_USE, ERROR_DOMAIN, meta);
            d.add_precondition_failure_violation(
                VFIO_GROUP_IN_USE,
                address.to_string(),
                msg.clone(),
            );
            Status::with_error_details(Code::FailedPrecondition, msg, d)
        }
        ApiError::HoldersUnknown { what, .. } => {
            let meta = HashMap::from([("checking".to_string(), what.clone())]);
            let d = ErrorDetails::with_error_info(VFIO_HOLDERS_UNKNOWN, ERROR_DOMAIN, meta);
            Status::with_error_details(Code::Unavailable, msg, d)
        }
        ApiError::ClaimedNotBound {
            address,
            generation,
            source,
        }
        | ApiError::BindingNotDone {
            address,
            generation,
            source,
        } => {
            // The binding's own reason and facts, and that the claim stands. ABORTED and
            // UNAVAILABLE promise that nothing changed, which is not so here (a client
            // told UNAVAILABLE may try another host and leave the claim behind); a
            // commit of unknown outcome says so itself.
            let inner = to_status(source);
            let details = inner.get_error_details();
            let (reason, mut meta) = details
                .error_info()
                .map(|i| (i.reason.clone(), i.metadata.clone()))
                .unwrap_or_default();
            meta.insert("claim_stands".into(), "true".into());
            meta.insert("claimed_address".into(), address.to_string());
            meta.insert("claim_generation".into(), generation.to_string());
            let code = match inner.code() {
                Code::Aborted => Code::FailedPrecondition,
                Code::Unavailable if reason != "STORE_OUTCOME_UNKNOWN" => Code::FailedPrecondition,
                c => c,
            };
            let mut d = ErrorDetails::with_error_info(reason, ERROR_DOMAIN, meta);
            if let Some(pf) = details.precondition_failure() {
                for v in &pf.violations {
                    d.add_precondition_failure_violation(
                        v.r#type.clone(),
                        v.subject.clone(),
                        v.description.clone(),
                    );
                }
            }
            Status::with_error_details(code, msg, d)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::writer::WriteError;

    /// The answers about one request id: each its code, its reason, the consumer and the
    /// request id, and the PF where the answer names one.
    #[test]
    fn answers_about_a_request_id_name_it() {
        let consumer = crate::pci::ConsumerId(uuid::Uuid::from_u128(3));
        let request_id: crate::pci::RequestId = "vfs".parse().expect("id");
        let pf: PciAddress = "0000:3b:00.0".parse().expect("address");
        for (e, code, reason, pf_key) in [
            (
                WriteError::RequestClosed {
                    consumer,
                    request_id: request_id.clone(),
                },
                Code::Aborted,
                "REQUEST_CLOSED",
                None,
            ),
            (
                WriteError::RequestInProgress {
                    consumer,
                    request_id: request_id.clone(),
                    pf,
                },
                Code::Unavailable,
                "REQUEST_IN_PROGRESS",
                Some("changing_pf"),
            ),
            (
                WriteError::VfCountNotRecorded {
                    consumer,
                    request_id: request_id.clone(),
                    pf,
                },
                Code::FailedPrecondition,
                "VF_COUNT_NOT_RECORDED",
                Some("address"),
            ),
        ] {
            let status = to_status(&ApiError::Write(e));
            assert_eq!(status.code(), code, "{status:?}");
            let details = status.get_error_details();
            let info = details.error_info().expect("error info");
            assert_eq!(info.reason, reason);
            assert_eq!(info.metadata["consumer_id"], consumer.to_string());
            assert_eq!(info.metadata["request_id"], "vfs");
            if let Some(key) = pf_key {
                assert_eq!(info.metadata[key], "0000:3b:00.0");
            }
        }
    }

    /// A Claim with vfio whose claim was made and whose binding then failed: whatever
    /// the binding's refusal, the code never promises that nothing changed (ABORTED,
    /// UNAVAILABLE), and the claim's facts are in the details.
    #[test]
    fn a_claim_made_but_not_bound_never_says_nothing_changed() {
        let address: PciAddress = "0000:3b:02.1".parse().expect("address");
        let not_bound = |source: ApiError| ApiError::ClaimedNotBound {
            address,
            generation: 7,
            source: Box::new(source),
        };
        for (source, reason) in [
            (ApiError::Write(WriteError::ShuttingDown), "SHUTTING_DOWN"),
            (
                ApiError::Write(WriteError::Ledger(LedgerError::StaleGeneration {
                    address,
                    presented: crate::pci::Generation(6),
                    current: crate::pci::Generation(7),
                    owner: None,
                })),
                "STALE_GENERATION",
            ),
        ] {
            let inner = to_status(&source).code();
            assert!(
                matches!(inner, Code::Unavailable | Code::Aborted),
                "{inner:?}"
            );
            let status = to_status(&not_bound(source));
            assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
            let info = status.get_error_details();
            let info = info.error_info().expect("error info");
            assert_eq!(info.reason, reason);
            assert_eq!(info.metadata["claim_stands"], "true");
            assert_eq!(info.metadata["claim_generation"], "7");
        }
    }
}
