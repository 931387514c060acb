//! The `hostdevctl` binary: the operator's client of a running hostdevd (list, show,
//! claim, release, transfer, watch, reconcile, status, reload, outcome, prepare-vfio,
//! set-vfs) over its Unix socket.
//!
//! Exit status: 0 done, 1 refused by the agent (or failed there), 2 usage error,
//! 3 cannot connect to the agent, 4 the agent cannot act now (try again later).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use serde_json::{json, Value};
use tonic::{Code, Status};
use tonic_types::StatusExt;

use hostdevd::api::proto;
use hostdevd::api::status::ERROR_DOMAIN;
use hostdevd::client::{self, DEFAULT_SOCKET_PATH, SOCKET_ENV};
use hostdevd::pci::{ConsumerId, DeviceId, OwnerLabel, PciAddress, PhysNet, RequestId, VendorId};

#[derive(Debug, Parser)]
#[command(
    name = "hostdevctl",
    version,
    about = "Client of hostdevd, the per-hypervisor authority on PCI device ownership",
    after_help = "Exit status: 0 done, 1 refused by the agent, 2 usage error, 3 cannot connect, 4 the agent cannot act now (try again later)."
)]
struct Cli {
    /// The agent's Unix socket [default: $HOSTDEVD_SOCKET, else /run/hostdevd/hostdevd.sock].
    #[arg(long, global = true, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Print JSON instead of text (one object; one object per line for `watch`).
    #[arg(long, global = true)]
    json: bool,
    /// How long to wait for the agent's answer to each call, in seconds (a watch's
    /// stream excepted). A call past it fails, exit 4; a change's request id is printed
    /// to ask its outcome. The default outlasts the longest call at the agent's default
    /// timeouts: a VF count change, two `sriov_numvfs` writes of up to 180 s each
    /// (`[hardware] vf_count_timeout_ms`) and the checks before them, about 375 s.
    #[arg(long, global = true, value_name = "SECONDS", default_value_t = 420, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    deadline: u64,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// List every device (VFs under their PF) with state, owner and generation.
    List,
    /// Show one device, and any lost claims at its address.
    Show {
        /// PCI address, dddd:bb:dd.f (or bb:dd.f).
        address: PciAddress,
    },
    /// Claim a device by address, or any free matching one with --select.
    Claim(ClaimArgs),
    /// Release a claim (only its owner, only with the current generation).
    Release(ReleaseArgs),
    /// Move a claim from one consumer to another in one step.
    Transfer(TransferArgs),
    /// Print device changes as they happen, one line per event.
    Watch(WatchArgs),
    /// Run the agent's audit: report orphans, strays, lost and changed devices.
    Reconcile(ReconcileArgs),
    /// The agent's version, host generation, health and device counts.
    Status,
    /// Reload the agent's configuration (as SIGHUP does) and wait until it is done: exit
    /// 0 once it applied, 1 if the agent refused it (the reason is printed; the previous
    /// device selection stays). The systemd unit's ExecReload.
    Reload(ReloadArgs),
    /// Bind a claimed device and its IOMMU group to vfio-pci (release gives the
    /// original drivers back).
    PrepareVfio(PrepareVfioArgs),
    /// Set a PF's VF count (refused while any of its VFs is claimed).
    SetVfs(SetVfsArgs),
    /// The outcome of an earlier claim/release/transfer, by owner and request id. One
    /// that did not apply never will: asking closes its request id (for a writer).
    Outcome {
        /// The consumer that made the request.
        #[arg(long, value_name = "UUID")]
        owner: ConsumerId,
        #[arg(long, value_name = "ID")]
        request_id: RequestId,
    },
}

#[derive(Debug, Args)]
struct ClaimArgs {
    /// The device to claim (omit with --select).
    #[arg(required_unless_present = "select")]
    address: Option<PciAddress>,
    /// The consumer that will own the claim (an instance or migration UUID).
    #[arg(long, value_name = "UUID")]
    owner: ConsumerId,
    /// Free text for operators, e.g. the instance name.
    #[arg(long, value_name = "TEXT", default_value = "")]
    label: OwnerLabel,
    /// Unique per owner; a retry with the same id returns the first answer.
    /// [default: a fresh UUID, printed with the result]
    #[arg(long, value_name = "ID")]
    request_id: Option<RequestId>,
    /// The generation the device must still have. When omitted, hostdevctl reads the
    /// current one with GetDevice just before claiming: a convenience for operators,
    /// NOT for controllers, which must present the generation they based their decision on.
    #[arg(long, value_name = "G", conflicts_with = "select")]
    generation: Option<u64>,
    /// Let the agent pick any free managed device matching the filters below.
    #[arg(long, conflicts_with = "address")]
    select: bool,
    /// Selector: vendor id (4 hex digits).
    #[arg(long, value_name = "HEX", requires = "select")]
    vendor: Option<VendorId>,
    /// Selector: device id (4 hex digits).
    #[arg(long, value_name = "HEX", requires = "select")]
    device: Option<DeviceId>,
    /// Selector: only VFs of this PF.
    #[arg(long, value_name = "ADDR", requires = "select")]
    pf: Option<PciAddress>,
    /// Selector: physical network tag.
    #[arg(long, value_name = "NAME", requires = "select")]
    physnet: Option<PhysNet>,
    /// Selector: preferred NUMA node (a preference, not a filter).
    #[arg(long, value_name = "N", requires = "select")]
    numa: Option<u32>,
    /// Selector: bound kernel driver.
    #[arg(long, value_name = "NAME", requires = "select")]
    driver: Option<String>,
    /// Also bind the claimed device's IOMMU group to vfio-pci.
    #[arg(long)]
    vfio: bool,
}

#[derive(Debug, Args)]
struct PrepareVfioArgs {
    address: PciAddress,
    /// The consumer that holds the claim.
    #[arg(long, value_name = "UUID")]
    owner: ConsumerId,
    /// The device's current generation.
    #[arg(long, value_name = "G")]
    generation: u64,
    /// [default: a fresh UUID, printed with the result]
    #[arg(long, value_name = "ID")]
    request_id: Option<RequestId>,
}

#[derive(Debug, Args)]
struct ReloadArgs {
    /// The agent's process id (systemd's $MAINPID), checked against the process that
    /// listens on the socket before any signal is sent [default: that process].
    #[arg(long, value_name = "PID", value_parser = clap::value_parser!(i32).range(2..))]
    pid: Option<i32>,
    /// How long to wait for the reload to end.
    #[arg(long, value_name = "SECONDS", default_value_t = 90, value_parser = clap::value_parser!(u64).range(1..=3600))]
    timeout: u64,
}

#[derive(Debug, Args)]
struct SetVfsArgs {
    /// The physical function.
    pf: PciAddress,
    /// The new VF count (0 removes every VF).
    count: u32,
    /// The PF's generation. When omitted, hostdevctl reads the current one just before
    /// (an operator convenience; controllers pass the one they decided on).
    #[arg(long, value_name = "G")]
    generation: Option<u64>,
    /// Write sriov_drivers_autoprobe first (false: new VFs stay unbound).
    #[arg(long, value_name = "BOOL")]
    autoprobe: Option<bool>,
    /// The caller's own consumer id: with it the change is logged under a request id,
    /// and the same command sent again with that --request-id is answered as the first.
    #[arg(long, value_name = "UUID")]
    owner: Option<ConsumerId>,
    /// [default with --owner: a fresh UUID, printed with the result]
    #[arg(long, value_name = "ID", requires = "owner")]
    request_id: Option<RequestId>,
}

#[derive(Debug, Args)]
struct ReleaseArgs {
    address: PciAddress,
    /// The consumer that holds the claim.
    #[arg(long, value_name = "UUID")]
    owner: ConsumerId,
    /// The device's current generation (for a lost claim, the lost record's).
    #[arg(long, value_name = "G")]
    generation: u64,
    /// [default: a fresh UUID, printed with the result]
    #[arg(long, value_name = "ID")]
    request_id: Option<RequestId>,
}

#[derive(Debug, Args)]
struct TransferArgs {
    address: PciAddress,
    /// The consumer that holds the claim now.
    #[arg(long, value_name = "UUID")]
    from: ConsumerId,
    /// The new owner.
    #[arg(long, value_name = "UUID")]
    to: ConsumerId,
    /// The new owner's label.
    #[arg(long, value_name = "TEXT", default_value = "")]
    label: OwnerLabel,
    /// The device's current generation.
    #[arg(long, value_name = "G")]
    generation: u64,
    /// [default: a fresh UUID, printed with the result]
    #[arg(long, value_name = "ID")]
    request_id: Option<RequestId>,
}

#[derive(Debug, Args)]
struct WatchArgs {
    /// Deliver changes after this generation (resume). [default: the current host
    /// generation, i.e. only changes from now on]
    #[arg(long, value_name = "G", conflicts_with = "snapshot")]
    from: Option<u64>,
    /// Begin with one snapshot line per device, then changes.
    #[arg(long)]
    snapshot: bool,
    /// Exit after this many events (snapshot lines included).
    #[arg(long, value_name = "N")]
    count: Option<u64>,
    /// Keep watching across the agent's restarts and broken connections: connect again
    /// every second and resume after the last change received; where the agent cannot
    /// replay from there (it restarted, or this watcher fell too far behind), start again
    /// with a snapshot. Each is said on stderr. Ends only at --count, at an answer no
    /// retry mends (a refusal), or when stopped.
    #[arg(long)]
    follow: bool,
}

#[derive(Debug, Args)]
struct ReconcileArgs {
    /// The consumers believed to live on this host (repeatable, or comma-separated).
    #[arg(
        long,
        value_name = "UUID",
        num_args = 1..,
        value_delimiter = ',',
        required_unless_present = "expect_none"
    )]
    expected: Vec<ConsumerId>,
    /// No consumer is expected on this host (every claim is a candidate orphan).
    #[arg(long, conflicts_with = "expected")]
    expect_none: bool,
    /// The host generation read before building the expected list (from `list`).
    #[arg(long, value_name = "G")]
    snapshot_generation: u64,
    /// Free the orphans that are provably unused and unchanged since the snapshot.
    #[arg(long, conflicts_with = "dry_run")]
    act: bool,
    /// Only report (the default; accepted for explicitness).
    #[arg(long)]
    dry_run: bool,
    /// Identifies the audit run (with --act). [default: a fresh UUID]
    #[arg(long, value_name = "ID")]
    request_id: Option<RequestId>,
}

/// Why a command did not succeed, and so which exit status it gets.
#[derive(Debug)]
enum Failure {
    /// The agent answered with an error (exit 1).
    Refused(String),
    /// The agent answered that it cannot act now (UNAVAILABLE: libvirt silent, its disk
    /// full, stopping; DEADLINE_EXCEEDED): the same call may succeed later (exit 4).
    Unavailable(String),
    /// The command line made no sense (exit 2).
    Usage(String),
    /// No agent could be reached (exit 3).
    Connect(String),
    /// Writing the output failed; a closed pipe ends quietly (exit 0).
    Output(std::io::Error),
}

type Outcome = Result<(), Failure>;

struct Ctx {
    client: client::Client,
    /// How long each unary call may wait for its answer (`--deadline`).
    deadline: Duration,
    socket: PathBuf,
    json: bool,
    /// The process listening on the socket, as the kernel named it at connect.
    agent_pid: Option<i32>,
}

fn socket_path(cli: &Cli) -> PathBuf {
    if let Some(p) = &cli.socket {
        return p.clone();
    }
    match std::env::var_os(SOCKET_ENV) {
        Some(v) if !v.is_empty() => PathBuf::from(v),
        _ => PathBuf::from(DEFAULT_SOCKET_PATH),
    }
}

/// A unary call's request, which the agent must answer within `deadline` (sent as the
/// call's `grpc-timeout`; the client ends the call there too).
fn within<T>(deadline: Duration, message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(deadline);
    request
}

fn fresh_request_id() -> Result<RequestId, Failure> {
    uuid::Uuid::new_v4()
        .to_string()
        .parse()
        .map_err(|e| Failure::Usage(format!("cannot make a request id: {e}")))
}

fn mutating(op: &str) -> bool {
    matches!(
        op,
        "claim" | "release" | "transfer" | "reconcile --act" | "prepare-vfio" | "set-vfs"
    )
}

/// A short name for a status code (and, where one code has several causes, its
/// ErrorInfo reason), used where the server's message does not already say it.
fn code_label(code: Code, reason: Option<&str>) -> Option<&'static str> {
    match code {
        // ABORTED has more than one cause; a status without a known reason is left to
        // its message.
        Code::Aborted => match reason {
            Some("STALE_GENERATION") => Some("stale generation"),
            Some("REQUEST_CLOSED") => Some("request id closed"),
            _ => None,
        },
        Code::InvalidArgument => Some("invalid argument"),
        Code::PermissionDenied => Some("permission denied"),
        // Also a Watch cut off (WATCH_CUT_OFF), or the stream limit: their messages say so.
        Code::ResourceExhausted => (reason == Some("NO_MATCH")).then_some("no free device"),
        Code::OutOfRange => Some("cannot resume"),
        // The agent answered that it is stopping (a Watch ended by its shutdown, a call
        // that came too late): not a broken connection, and worth telling apart.
        Code::Unavailable if reason == Some("SHUTTING_DOWN") => Some("agent stopping"),
        // The device's PF is having its VF count written: the agent is fine.
        Code::Unavailable if reason == Some("VF_COUNT_CHANGING") => Some("device busy"),
        // A SetVfCount with that request id is still being written.
        Code::Unavailable if reason == Some("REQUEST_IN_PROGRESS") => Some("request in progress"),
        Code::Unavailable => Some("agent unavailable"),
        Code::DeadlineExceeded => Some("timed out"),
        Code::Unimplemented => Some("not supported by this agent"),
        Code::Internal | Code::Unknown | Code::DataLoss => Some("agent error"),
        Code::Cancelled => Some("cancelled"),
        Code::Unauthenticated => Some("unauthenticated"),
        // The agent's messages for these name the device and the state already.
        Code::NotFound | Code::FailedPrecondition | Code::AlreadyExists | Code::Ok => None,
    }
}

/// One line from a gRPC status: the operation, the meaning of the code, the server's
/// message, and any ErrorInfo facts the message does not mention.
fn describe(op: &str, socket: &std::path::Path, status: &Status) -> Failure {
    let info = status.get_details_error_info();
    let ours = info.as_ref().is_some_and(|i| i.domain == ERROR_DOMAIN);
    if !ours
        && matches!(
            status.code(),
            Code::Unavailable | Code::Unknown | Code::Cancelled
        )
    {
        // Transport failure: the connection broke, not an answer from the agent. An
        // UNAVAILABLE with our ErrorInfo is the agent's own answer (SHUTTING_DOWN: it is
        // stopping), a refused or ended call like any other. A connection the agent
        // closed as soon as it accepted it ends the call as CANCELLED.
        return Failure::Connect(format!(
            "{op} failed: lost the connection to hostdevd at {}: {} (if at once: a new connection whose uid holds [api] max_connections_per_uid already is closed unanswered while the agent answers many such, and logged)",
            socket.display(),
            status.message()
        ));
    }
    // A deadline this client's transport ended the call at is no refusal by the agent.
    let timed_out_here = !ours && status.code() == Code::DeadlineExceeded;
    let verb = if mutating(op) && !timed_out_here {
        "refused"
    } else {
        "failed"
    };
    let mut msg = status.message().trim().to_string();
    // The agent's own permission messages already start with "<op> refused: ".
    for prefix in [format!("{op} refused: "), format!("{verb}: ")] {
        if let Some(rest) = msg.strip_prefix(&prefix) {
            msg = rest.to_string();
        }
    }
    if msg.is_empty() {
        msg = format!("{:?}", status.code());
    }
    let mut line = format!("{op} {verb}: ");
    let reason = info.as_ref().filter(|_| ours).map(|i| i.reason.as_str());
    if let Some(label) = code_label(status.code(), reason) {
        if !msg.to_lowercase().starts_with(label) {
            line.push_str(label);
            line.push_str(": ");
        }
    }
    line.push_str(&msg);
    if reason == Some("TOO_MANY_CONNECTIONS") {
        // Not an answer to the call: the agent served nothing on this connection.
        return Failure::Connect(line);
    }
    // A call refused while the caller had too many of its kind open may run once one ends.
    let later = matches!(status.code(), Code::Unavailable | Code::DeadlineExceeded)
        || matches!(reason, Some("TOO_MANY_AT_ONCE" | "TOO_MANY_CALLS"));
    if let Some(info) = info.filter(|_| ours) {
        let facts = [
            ("current_generation", "current generation"),
            ("owner_consumer_id", "held by"),
            ("domain_name", "domain"),
            ("oldest_generation", "oldest replayable generation"),
        ];
        for (key, name) in facts {
            if let Some(v) = info.metadata.get(key).filter(|v| !v.is_empty()) {
                if !msg.contains(v.as_str()) {
                    line.push_str(&format!("; {name} {v}"));
                }
            }
        }
    }
    if later {
        Failure::Unavailable(line)
    } else {
        Failure::Refused(line)
    }
}

/// A failed claim, release, transfer or binding whose outcome the answer leaves open (the
/// connection broke, the agent could not commit or answer, or a claim stands though its
/// binding failed), with the request id to ask about, or to send again with.
/// Whether a failed call may have applied: its answer was lost on the way (the agent
/// stopped or the connection broke mid-call), or it failed in an unknown way.
fn answer_lost(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::Unavailable
            | Code::Unknown
            | Code::Internal
            | Code::DeadlineExceeded
            | Code::Cancelled
    )
}

fn open_outcome(
    op: &str,
    socket: &std::path::Path,
    status: &Status,
    owner: &ConsumerId,
    request_id: &RequestId,
) -> Failure {
    let stands = status
        .get_details_error_info()
        .is_some_and(|i| i.metadata.get("claim_stands").is_some_and(|v| v == "true"));
    let open = stands || answer_lost(status);
    // Two ways on, not two steps: asking the outcome of a request that did not apply
    // closes its id, and a resend with it is then refused.
    let hint = format!(
        " (request id {id}: either send the same {op} again with --request-id {id}, which applies it at most once, or ask `hostdevctl outcome --owner {owner} --request-id {id}` whether it applied, which closes the id if it did not, so that a resend with it is refused)",
        id = request_id.as_str()
    );
    let f = describe(op, socket, status);
    if open {
        with_hint(f, &hint)
    } else {
        f
    }
}

/// `f` with `hint` after its message (a refusal, an unavailable agent or a connection
/// that failed; any other failure as it is).
fn with_hint(f: Failure, hint: &str) -> Failure {
    match f {
        Failure::Refused(m) => Failure::Refused(m + hint),
        Failure::Unavailable(m) => Failure::Unavailable(m + hint),
        Failure::Connect(m) => Failure::Connect(m + hint),
        f => f,
    }
}

fn out(line: impl AsRef<str>) -> Outcome {
    let mut o = std::io::stdout().lock();
    writeln!(o, "{}", line.as_ref()).map_err(Failure::Output)
}

fn out_json(v: &Value) -> Outcome {
    out(v.to_string())
}

fn state_name(s: i32) -> &'static str {
    match proto::DeviceState::try_from(s) {
        Ok(proto::DeviceState::Free) => "free",
        Ok(proto::DeviceState::Claimed) => "claimed",
        Ok(proto::DeviceState::Attached) => "attached",
        Ok(proto::DeviceState::Lost) => "lost",
        Ok(proto::DeviceState::Unavailable) => "unavailable",
        Ok(proto::DeviceState::Unmanaged) => "unmanaged",
        Ok(proto::DeviceState::Unspecified) | Err(_) => "unspecified",
    }
}

fn kind_name(k: i32) -> &'static str {
    match proto::WatchEventKind::try_from(k) {
        Ok(proto::WatchEventKind::Changed) => "changed",
        Ok(proto::WatchEventKind::Removed) => "removed",
        Ok(proto::WatchEventKind::Snapshot) => "snapshot",
        Ok(proto::WatchEventKind::SnapshotEnd) => "snapshot-end",
        Ok(proto::WatchEventKind::Unspecified) | Err(_) => "unspecified",
    }
}

fn owner_json(o: &Option<proto::Owner>) -> Value {
    match o {
        Some(o) => json!({"consumer_id": o.consumer_id, "label": o.label}),
        None => Value::Null,
    }
}

fn domain_json(d: &Option<proto::Domain>) -> Value {
    match d {
        Some(d) => json!({"uuid": d.uuid, "name": d.name, "running": d.running}),
        None => Value::Null,
    }
}

fn nonempty(s: &str) -> Value {
    if s.is_empty() {
        Value::Null
    } else {
        Value::String(s.to_string())
    }
}

fn device_json(d: &proto::Device) -> Value {
    json!({
        "address": d.address,
        "generation": d.generation,
        "state": state_name(d.state),
        "present": d.present,
        "vendor_id": d.vendor_id,
        "device_id": d.device_id,
        "vendor_name": nonempty(&d.vendor_name),
        "device_name": nonempty(&d.device_name),
        "driver": nonempty(&d.driver),
        "iommu_group": d.iommu_group,
        "numa_node": d.numa_node,
        "physfn": nonempty(&d.physfn),
        "vf_index": d.vf_index,
        "sriov": d.sriov.as_ref().map(|s| json!({
            "total_vfs": s.total_vfs, "num_vfs": s.num_vfs, "vfs": s.vfs,
        })),
        "netdevs": d.netdevs,
        "physnets": d.physnets,
        "managed": d.managed,
        "owner": owner_json(&d.owner),
        "request_id": nonempty(&d.request_id),
        "claimed_at_unix": (d.claimed_at_unix != 0).then_some(d.claimed_at_unix),
        "attached_domain": domain_json(&d.attached_domain),
        "blocker": d.blocker.as_ref().map(|b| json!({
            "address": nonempty(&b.address), "relation": b.relation, "domain": domain_json(&b.domain),
        })),
        "vfio_group": nonempty(&d.vfio_group),
        "vfio_device": nonempty(&d.vfio_device),
        "vfio_binding": d.vfio_binding.iter().map(bound_json).collect::<Vec<_>>(),
    })
}

fn bound_json(m: &proto::BoundMember) -> Value {
    json!({"address": m.address, "original_driver": nonempty(&m.original_driver)})
}

fn bound_text(members: &[proto::BoundMember]) -> String {
    members
        .iter()
        .map(|m| {
            format!(
                "{} (was {})",
                m.address,
                if m.original_driver.is_empty() {
                    "unbound"
                } else {
                    &m.original_driver
                }
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn stray_json(s: &proto::Stray) -> Value {
    json!({
        "address": s.address,
        "domain": domain_json(&s.domain),
        "claimed_by": owner_json(&s.claimed_by),
        "known_device": s.known_device,
    })
}

fn owner_text(o: &Option<proto::Owner>) -> String {
    match o {
        Some(o) if o.label.is_empty() => o.consumer_id.clone(),
        Some(o) => format!("{} ({})", o.consumer_id, o.label),
        None => "-".into(),
    }
}

fn domain_text(d: &proto::Domain) -> String {
    format!(
        "{} ({}, uuid {})",
        d.name,
        if d.running { "running" } else { "defined" },
        d.uuid
    )
}

/// What else matters about a device's state, for the last column of `list`.
fn detail_text(d: &proto::Device) -> String {
    if let Some(dom) = &d.attached_domain {
        return format!("domain {}", domain_text(dom));
    }
    if let Some(b) = &d.blocker {
        return match &b.domain {
            // A VF of this PF that a domain uses.
            Some(dom) if !b.address.is_empty() => {
                format!("its VF {} used by domain {}", b.address, domain_text(dom))
            }
            Some(dom) => format!("used by domain {}", domain_text(dom)),
            None => format!("blocked by {} ({})", b.address, b.relation),
        };
    }
    if !d.present {
        return "gone from sysfs".into();
    }
    String::new()
}

fn opt_num(v: Option<u32>) -> String {
    v.map(|n| n.to_string()).unwrap_or_else(|| "-".into())
}

fn or_dash(s: &str) -> &str {
    if s.is_empty() {
        "-"
    } else {
        s
    }
}

/// Devices in tree order: each non-VF, then its VFs (by VF index) indented under it.
/// VFs whose PF is not listed stand alone.
fn tree_order(devices: &[proto::Device]) -> Vec<(usize, &proto::Device)> {
    let listed: std::collections::BTreeSet<&str> =
        devices.iter().map(|d| d.address.as_str()).collect();
    let mut children: BTreeMap<&str, Vec<&proto::Device>> = BTreeMap::new();
    let mut roots: Vec<&proto::Device> = Vec::new();
    for d in devices {
        if !d.physfn.is_empty() && listed.contains(d.physfn.as_str()) {
            children.entry(d.physfn.as_str()).or_default().push(d);
        } else {
            roots.push(d);
        }
    }
    // Address order is VF-index order (VF routing ids grow with the index), and it
    // also places lost VFs, which have no index any more, where they were.
    let key = |d: &proto::Device| {
        (
            d.address.parse::<PciAddress>().ok(),
            d.address.clone(),
            !d.present,
        )
    };
    roots.sort_by_key(|d| {
        (
            d.address.parse::<PciAddress>().ok(),
            d.address.clone(),
            !d.present,
        )
    });
    let mut rows = Vec::new();
    for r in roots {
        rows.push((0, r));
        // A lost and a present record may share an address: attach VFs once.
        if rows.iter().filter(|(_, d)| d.address == r.address).count() > 1 {
            continue;
        }
        if let Some(vfs) = children.get_mut(r.address.as_str()) {
            vfs.sort_by_key(|d| key(d));
            rows.extend(vfs.iter().map(|v| (1, *v)));
        }
    }
    rows
}

fn render_table(rows: &[Vec<String>]) -> Vec<String> {
    let cols = rows.iter().map(|r| r.len()).max().unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|c| {
            rows.iter()
                .map(|r| r.get(c).map_or(0, |s| s.chars().count()))
                .max()
                .unwrap_or(0)
        })
        .collect();
    rows.iter()
        .map(|r| {
            let mut line = String::new();
            for (c, cell) in r.iter().enumerate() {
                if c + 1 == r.len() {
                    line.push_str(cell);
                } else {
                    line.push_str(&format!("{cell:<w$}  ", w = widths[c]));
                }
            }
            line.trim_end().to_string()
        })
        .collect()
}

async fn cmd_list(ctx: &mut Ctx) -> Outcome {
    let r = ctx
        .client
        .list_devices(within(ctx.deadline, proto::ListDevicesRequest {}))
        .await
        .map_err(|s| describe("list", &ctx.socket, &s))?
        .into_inner();
    if ctx.json {
        return out_json(&json!({
            "host_generation": r.host_generation,
            "devices": r.devices.iter().map(device_json).collect::<Vec<_>>(),
            "strays": r.strays.iter().map(stray_json).collect::<Vec<_>>(),
        }));
    }
    out(format!(
        "host generation {} ({} devices)",
        r.host_generation,
        r.devices.len()
    ))?;
    let mut rows = vec![vec![
        "ADDRESS".to_string(),
        "STATE".into(),
        "GEN".into(),
        "NUMA".into(),
        "DRIVER".into(),
        "OWNER".into(),
        "DETAIL".into(),
    ]];
    for (depth, d) in tree_order(&r.devices) {
        rows.push(vec![
            format!("{}{}", "  ".repeat(depth), d.address),
            state_name(d.state).into(),
            d.generation.to_string(),
            opt_num(d.numa_node),
            or_dash(&d.driver).into(),
            owner_text(&d.owner),
            detail_text(d),
        ]);
    }
    for line in render_table(&rows) {
        out(line)?;
    }
    if !r.strays.is_empty() {
        out(format!(
            "{} strays (domains using devices they hold no claim on):",
            r.strays.len()
        ))?;
        for s in &r.strays {
            out(format!("  {}", stray_text(s)))?;
        }
    }
    Ok(())
}

fn stray_text(s: &proto::Stray) -> String {
    let mut t = format!(
        "{} used by domain {}",
        s.address,
        s.domain
            .as_ref()
            .map(domain_text)
            .unwrap_or_else(|| "?".into())
    );
    if s.claimed_by.is_some() {
        t.push_str(&format!(", claimed by {}", owner_text(&s.claimed_by)));
    }
    if !s.known_device {
        t.push_str(" (not a known device)");
    }
    t
}

fn device_lines(d: &proto::Device) -> Vec<String> {
    let mut kv: Vec<(&str, String)> = vec![
        ("address", d.address.clone()),
        ("state", state_name(d.state).into()),
        ("generation", d.generation.to_string()),
        (
            "present",
            if d.present {
                "yes"
            } else {
                "no (gone from sysfs)"
            }
            .into(),
        ),
        (
            "vendor",
            format!("{} {}", d.vendor_id, d.vendor_name)
                .trim_end()
                .into(),
        ),
        (
            "device",
            format!("{} {}", d.device_id, d.device_name)
                .trim_end()
                .into(),
        ),
        ("driver", or_dash(&d.driver).into()),
        ("iommu group", opt_num(d.iommu_group)),
        ("numa node", opt_num(d.numa_node)),
    ];
    if !d.physfn.is_empty() {
        let idx = d.vf_index.map(|i| format!(" (VF {i})")).unwrap_or_default();
        kv.push(("physfn", format!("{}{idx}", d.physfn)));
    }
    if let Some(s) = &d.sriov {
        kv.push((
            "sriov",
            format!("{} of {} VFs: {}", s.num_vfs, s.total_vfs, s.vfs.join(" "))
                .trim_end()
                .into(),
        ));
    }
    if !d.netdevs.is_empty() {
        kv.push(("netdevs", d.netdevs.join(" ")));
    }
    if !d.physnets.is_empty() {
        kv.push(("physnets", d.physnets.join(" ")));
    }
    kv.push(("managed", if d.managed { "yes" } else { "no" }.into()));
    kv.push(("owner", owner_text(&d.owner)));
    if !d.request_id.is_empty() {
        kv.push(("request id", d.request_id.clone()));
    }
    if d.claimed_at_unix != 0 {
        kv.push(("claimed at", format!("{} (unix time)", d.claimed_at_unix)));
    }
    if let Some(dom) = &d.attached_domain {
        kv.push(("attached to", format!("domain {}", domain_text(dom))));
    }
    if d.blocker.is_some() {
        kv.push(("unavailable", detail_text(d)));
    }
    if !d.vfio_group.is_empty() {
        kv.push(("vfio group", d.vfio_group.clone()));
    }
    if !d.vfio_device.is_empty() {
        kv.push(("vfio device", d.vfio_device.clone()));
    }
    if !d.vfio_binding.is_empty() {
        kv.push(("vfio bound", bound_text(&d.vfio_binding)));
    }
    kv.into_iter()
        .map(|(k, v)| format!("{k:<12} {v}"))
        .collect()
}

async fn cmd_show(ctx: &mut Ctx, address: PciAddress) -> Outcome {
    let r = ctx
        .client
        .get_device(within(
            ctx.deadline,
            proto::GetDeviceRequest {
                address: address.to_string(),
            },
        ))
        .await
        .map_err(|s| describe("show", &ctx.socket, &s))?
        .into_inner();
    if ctx.json {
        return out_json(&json!({
            "host_generation": r.host_generation,
            "device": r.device.as_ref().map(device_json),
            "lost": r.lost.iter().map(device_json).collect::<Vec<_>>(),
        }));
    }
    match &r.device {
        Some(d) => {
            for l in device_lines(d) {
                out(l)?;
            }
        }
        None => out(format!("{address}: no present device (only lost claims)"))?,
    }
    for d in &r.lost {
        out("")?;
        out("lost claim at this address:")?;
        for l in device_lines(d) {
            out(format!("  {l}"))?;
        }
    }
    out(format!("{:<12} {}", "host gen", r.host_generation))
}

async fn cmd_claim(ctx: &mut Ctx, a: ClaimArgs) -> Outcome {
    let request_id = match a.request_id {
        Some(r) => r,
        None => fresh_request_id()?,
    };
    let owner = proto::Owner {
        consumer_id: a.owner.to_string(),
        label: a.label.to_string(),
    };
    let target = if a.select {
        proto::claim_request::Target::Selector(proto::Selector {
            vendor_id: a.vendor.map(|v| v.to_string()).unwrap_or_default(),
            device_id: a.device.map(|v| v.to_string()).unwrap_or_default(),
            pf_address: a.pf.map(|v| v.to_string()).unwrap_or_default(),
            physnet: a.physnet.map(|v| v.to_string()).unwrap_or_default(),
            numa_node: a.numa,
            driver: a.driver.unwrap_or_default(),
        })
    } else {
        let Some(address) = a.address else {
            return Err(Failure::Usage("claim needs an ADDRESS or --select".into()));
        };
        let generation = match a.generation {
            Some(g) => g,
            None => current_generation(ctx, address, "claim").await?,
        };
        proto::claim_request::Target::Address(proto::ByAddress {
            address: address.to_string(),
            expected_generation: generation,
        })
    };
    let r = ctx
        .client
        .claim(within(
            ctx.deadline,
            proto::ClaimRequest {
                owner: Some(owner.clone()),
                request_id: request_id.to_string(),
                target: Some(target),
                vfio: a.vfio,
            },
        ))
        .await
        .map_err(|s| open_outcome("claim", &ctx.socket, &s, &a.owner, &request_id))?
        .into_inner();
    if ctx.json {
        return out_json(&json!({
            "device": r.device.as_ref().map(device_json),
            "generation": r.generation,
            "replayed": r.replayed,
            "request_id": request_id.as_str(),
        }));
    }
    let addr = r
        .device
        .as_ref()
        .map(|d| d.address.clone())
        .unwrap_or_else(|| "?".into());
    out(format!(
        "claimed {addr} for {} at generation {} (request id {}){}",
        owner_text(&Some(owner)),
        r.generation,
        request_id.as_str(),
        replay_note(r.replayed)
    ))
}

/// The present device's generation, read just now (for operators who omit it).
async fn current_generation(
    ctx: &mut Ctx,
    address: PciAddress,
    what: &str,
) -> Result<u64, Failure> {
    let r = ctx
        .client
        .get_device(within(
            ctx.deadline,
            proto::GetDeviceRequest {
                address: address.to_string(),
            },
        ))
        .await
        .map_err(|s| describe(what, &ctx.socket, &s))?
        .into_inner();
    let Some(d) = r.device else {
        return Err(Failure::Refused(format!(
            "{what} refused: {address} is not present (only lost claims remain there)"
        )));
    };
    eprintln!(
        "hostdevctl: {} {address} at its current generation {} (read just now; controllers must pass --generation)",
        if what == "claim" { "claiming" } else { "changing" },
        d.generation
    );
    Ok(d.generation)
}

async fn cmd_prepare_vfio(ctx: &mut Ctx, a: PrepareVfioArgs) -> Outcome {
    let request_id = match a.request_id {
        Some(r) => r,
        None => fresh_request_id()?,
    };
    let r = ctx
        .client
        .prepare_vfio(within(
            ctx.deadline,
            proto::PrepareVfioRequest {
                address: a.address.to_string(),
                owner: Some(proto::Owner {
                    consumer_id: a.owner.to_string(),
                    label: String::new(),
                }),
                generation: a.generation,
                request_id: request_id.to_string(),
            },
        ))
        .await
        .map_err(|s| open_outcome("prepare-vfio", &ctx.socket, &s, &a.owner, &request_id))?
        .into_inner();
    if ctx.json {
        return out_json(&json!({
            "device": r.device.as_ref().map(device_json),
            "generation": r.generation,
            "members": r.members.iter().map(bound_json).collect::<Vec<_>>(),
            "replayed": r.replayed,
            "request_id": request_id.as_str(),
        }));
    }
    if r.replayed && r.members.is_empty() {
        return out(format!(
            "the claim this request (request id {}) bound has ended since: nothing bound; the binding was recorded at generation {}",
            request_id.as_str(),
            r.generation
        ));
    }
    out(format!(
        "bound to vfio-pci: {}; {} is at generation {} (request id {}){}",
        bound_text(&r.members),
        a.address,
        r.generation,
        request_id.as_str(),
        replay_note(r.replayed)
    ))
}

async fn cmd_set_vfs(ctx: &mut Ctx, a: SetVfsArgs) -> Outcome {
    let generation = match a.generation {
        Some(g) => g,
        None => current_generation(ctx, a.pf, "set-vfs").await?,
    };
    let request_id = match (&a.owner, a.request_id) {
        (Some(_), Some(r)) => Some(r),
        (Some(_), None) => Some(fresh_request_id()?),
        (None, _) => None,
    };
    let r = ctx
        .client
        .set_vf_count(within(
            ctx.deadline,
            proto::SetVfCountRequest {
                address: a.pf.to_string(),
                vf_count: a.count,
                generation,
                drivers_autoprobe: a.autoprobe,
                consumer_id: a.owner.map(|o| o.to_string()).unwrap_or_default(),
                request_id: request_id
                    .as_ref()
                    .map(|r| r.to_string())
                    .unwrap_or_default(),
            },
        ))
        .await
        .map_err(|s| match (&a.owner, &request_id) {
            (Some(owner), Some(id)) => open_outcome("set-vfs", &ctx.socket, &s, owner, id),
            _ => describe("set-vfs", &ctx.socket, &s),
        })?
        .into_inner();
    if ctx.json {
        return out_json(&json!({
            "device": r.device.as_ref().map(device_json),
            "generation": r.generation,
            "previous_vf_count": r.previous_vf_count,
            "replayed": r.replayed,
            "request_id": request_id.as_ref().map(|r| r.as_str()),
        }));
    }
    let vfs = r
        .device
        .as_ref()
        .and_then(|d| d.sriov.as_ref())
        .map(|s| s.vfs.join(", "))
        .unwrap_or_default();
    out(format!(
        "{}: {} VFs (was {}), PF at generation {}{}{}{}",
        a.pf,
        a.count,
        r.previous_vf_count,
        r.generation,
        if vfs.is_empty() {
            String::new()
        } else {
            format!("; VFs {vfs}")
        },
        request_id
            .map(|id| format!(" (request id {})", id.as_str()))
            .unwrap_or_default(),
        replay_note(r.replayed)
    ))
}

/// The suffix for an answer the agent replayed from its request log.
fn replay_note(replayed: bool) -> &'static str {
    if replayed {
        "; replayed the earlier answer"
    } else {
        ""
    }
}

async fn cmd_release(ctx: &mut Ctx, a: ReleaseArgs) -> Outcome {
    let request_id = match a.request_id {
        Some(r) => r,
        None => fresh_request_id()?,
    };
    let r = ctx
        .client
        .release(within(
            ctx.deadline,
            proto::ReleaseRequest {
                address: a.address.to_string(),
                owner: Some(proto::Owner {
                    consumer_id: a.owner.to_string(),
                    label: String::new(),
                }),
                request_id: request_id.to_string(),
                generation: a.generation,
            },
        ))
        .await
        .map_err(|s| open_outcome("release", &ctx.socket, &s, &a.owner, &request_id))?
        .into_inner();
    if ctx.json {
        return out_json(&json!({
            "address": r.address,
            "generation": r.generation,
            "replayed": r.replayed,
            "request_id": request_id.as_str(),
        }));
    }
    out(format!(
        "released {} at generation {} (request id {}){}",
        r.address,
        r.generation,
        request_id.as_str(),
        replay_note(r.replayed)
    ))
}

async fn cmd_transfer(ctx: &mut Ctx, a: TransferArgs) -> Outcome {
    let request_id = match a.request_id {
        Some(r) => r,
        None => fresh_request_id()?,
    };
    let to = proto::Owner {
        consumer_id: a.to.to_string(),
        label: a.label.to_string(),
    };
    let r = ctx
        .client
        .transfer(within(
            ctx.deadline,
            proto::TransferRequest {
                address: a.address.to_string(),
                from_consumer_id: a.from.to_string(),
                to: Some(to.clone()),
                request_id: request_id.to_string(),
                generation: a.generation,
            },
        ))
        .await
        .map_err(|s| open_outcome("transfer", &ctx.socket, &s, &a.from, &request_id))?
        .into_inner();
    if ctx.json {
        return out_json(&json!({
            "device": r.device.as_ref().map(device_json),
            "generation": r.generation,
            "replayed": r.replayed,
            "request_id": request_id.as_str(),
        }));
    }
    out(format!(
        "transferred {} from {} to {} at generation {} (request id {}){}",
        a.address,
        a.from,
        owner_text(&Some(to)),
        r.generation,
        request_id.as_str(),
        replay_note(r.replayed)
    ))
}

fn event_text(e: &proto::WatchEvent) -> String {
    let mut t = format!("{} {}", e.generation, kind_name(e.kind));
    if !e.address.is_empty() {
        t.push(' ');
        t.push_str(&e.address);
    }
    if e.kind == proto::WatchEventKind::Removed as i32 {
        // Which record went: the present device, or a lost claim at the same address.
        if let Some(d) = &e.device {
            t.push_str(if d.present {
                " (the present device)"
            } else {
                " (a lost claim)"
            });
        }
        return t;
    }
    if let Some(d) = &e.device {
        t.push(' ');
        t.push_str(state_name(d.state));
        t.push_str(" owner=");
        t.push_str(&owner_text(&d.owner).replace(' ', ""));
        let detail = detail_text(d);
        if !detail.is_empty() {
            t.push(' ');
            t.push_str(&detail);
        }
    }
    t
}

async fn cmd_watch(ctx: &mut Ctx, a: WatchArgs) -> Outcome {
    let from = match (a.from, a.snapshot) {
        (Some(g), _) => g,
        (None, true) => 0,
        (None, false) => {
            ctx.client
                .get_status(within(ctx.deadline, proto::GetStatusRequest {}))
                .await
                .map_err(|s| describe("watch", &ctx.socket, &s))?
                .into_inner()
                .host_generation
        }
    };
    let mut at = WatchAt {
        from,
        snapshot: a.snapshot,
        seen: 0,
    };
    loop {
        let why = match watch_stream(ctx, &a, &mut at).await {
            Ok(()) => return Ok(()),
            Err(WatchEnd::Output(f)) => return Err(f),
            Err(WatchEnd::Ended) if !a.follow => {
                return Err(Failure::Refused(
                    "watch failed: the agent ended the stream (it may be shutting down); resume with --from the last generation".into(),
                ))
            }
            Err(WatchEnd::Status(s)) if !a.follow || !worth_following(&s) => {
                return Err(describe("watch", &ctx.socket, &s))
            }
            Err(WatchEnd::Ended) => "the agent ended the stream".to_string(),
            Err(WatchEnd::Status(s)) => {
                if s.code() == Code::OutOfRange {
                    at.from = 0;
                    at.snapshot = true;
                }
                s.message().trim().to_string()
            }
        };
        if at.snapshot {
            eprintln!("hostdevctl: watch interrupted ({why}); starting again with a snapshot");
        } else {
            eprintln!(
                "hostdevctl: watch interrupted ({why}); resuming after generation {}",
                at.from
            );
        }
        reconnect(ctx).await;
    }
}

/// Where a watch goes on from: the generation after which changes are wanted, and
/// whether a snapshot comes first (until its end has been received, a resumed watch
/// starts it again); the events printed so far, for --count.
struct WatchAt {
    from: u64,
    snapshot: bool,
    seen: u64,
}

/// Why one Watch stream ended, short of --count.
enum WatchEnd {
    /// The stream ended without a status.
    Ended,
    Status(Status),
    /// Printing failed.
    Output(Failure),
}

/// One Watch stream from `at`, printing its events and moving `at` on with them.
async fn watch_stream(ctx: &mut Ctx, a: &WatchArgs, at: &mut WatchAt) -> Result<(), WatchEnd> {
    let mut stream = ctx
        .client
        .watch(proto::WatchRequest {
            from_generation: at.from,
            snapshot: at.snapshot,
        })
        .await
        .map_err(WatchEnd::Status)?
        .into_inner();
    if !ctx.json && !at.snapshot {
        eprintln!("hostdevctl: watching changes after generation {}", at.from);
    }
    loop {
        if a.count.is_some_and(|n| at.seen >= n) {
            return Ok(());
        }
        let e = stream
            .message()
            .await
            .map_err(WatchEnd::Status)?
            .ok_or(WatchEnd::Ended)?;
        at.seen += 1;
        match proto::WatchEventKind::try_from(e.kind) {
            Ok(proto::WatchEventKind::Snapshot) => {}
            _ => {
                at.from = e.generation;
                at.snapshot = false;
            }
        }
        let printed = if ctx.json {
            out_json(&json!({
                "kind": kind_name(e.kind),
                "generation": e.generation,
                "address": nonempty(&e.address),
                "device": e.device.as_ref().map(device_json),
            }))
        } else {
            out(event_text(&e))
        };
        printed.map_err(WatchEnd::Output)?;
    }
}

/// Whether --follow goes on after a Watch stream ended with `s`: the connection broke,
/// the agent stopped, the watcher was cut off for falling behind, or it can no longer be
/// replayed to (then from a snapshot). A refusal ends it.
fn worth_following(s: &Status) -> bool {
    let ours = s
        .get_details_error_info()
        .filter(|i| i.domain == ERROR_DOMAIN)
        .map(|i| i.reason);
    matches!(
        (s.code(), ours.as_deref()),
        (Code::OutOfRange, _)
            | (Code::ResourceExhausted, Some("WATCH_CUT_OFF"))
            | (Code::Unavailable, Some("SHUTTING_DOWN"))
            | (Code::Unavailable | Code::Unknown | Code::Cancelled, None)
    )
}

/// Connects again, every second until the agent answers (said on stderr once).
async fn reconnect(ctx: &mut Ctx) {
    let mut said = false;
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        match client::connect(&ctx.socket).await {
            Ok(c) => {
                ctx.client = c;
                return;
            }
            Err(e) if !said => {
                eprintln!(
                    "hostdevctl: cannot connect to hostdevd at {} ({e}); trying again every second",
                    ctx.socket.display()
                );
                said = true;
            }
            Err(_) => {}
        }
    }
}

async fn cmd_reconcile(ctx: &mut Ctx, a: ReconcileArgs) -> Outcome {
    let request_id = match a.request_id {
        Some(r) => r,
        None => fresh_request_id()?,
    };
    let op = if a.act {
        "reconcile --act"
    } else {
        "reconcile"
    };
    let r = ctx
        .client
        .reconcile(within(ctx.deadline, proto::ReconcileRequest {
            expected_consumer_ids: a.expected.iter().map(|c| c.to_string()).collect(),
            snapshot_generation: a.snapshot_generation,
            act: a.act,
            request_id: request_id.to_string(),
        }))
        .await
        .map_err(|s| match describe(op, &ctx.socket, &s) {
            // An acting audit whose answer was lost may have freed some orphans: the same
            // request id again lists them (earlier_attempt) and frees nothing twice.
            f if !a.act || !answer_lost(&s) => f,
            f => with_hint(
                f,
                &format!(
                    " (request id {id}: send the same reconcile --act again with --request-id {id} to learn what it freed)",
                    id = request_id.as_str()
                ),
            ),
        })?
        .into_inner();
    if ctx.json {
        return out_json(&json!({
            "request_id": request_id.as_str(),
            "host_generation": r.host_generation,
            "acted": r.acted,
            "orphans": r.orphans.iter().map(|o| json!({
                "device": o.device.as_ref().map(device_json),
                "freed_generation": (o.freed_generation != 0).then_some(o.freed_generation),
                "kept_because": nonempty(&o.kept_because),
                "earlier_attempt": o.earlier_attempt,
            })).collect::<Vec<_>>(),
            "strays": r.strays.iter().map(stray_json).collect::<Vec<_>>(),
            "lost": r.lost.iter().map(device_json).collect::<Vec<_>>(),
            "changed": r.changed.iter().map(device_json).collect::<Vec<_>>(),
            "protected": r.protected.iter().map(device_json).collect::<Vec<_>>(),
            "protections": r.protections.iter().map(|p| json!({
                "address": p.address,
                "reason": p.reason,
                "domain": domain_json(&p.domain),
                "holder_pid": (p.holder_pid != 0).then_some(p.holder_pid),
                "holder_command": nonempty(&p.holder_command),
            })).collect::<Vec<_>>(),
        }));
    }
    out(format!(
        "reconcile {} against snapshot generation {}; host generation now {}; request id {}",
        if r.acted { "(acted)" } else { "(dry run)" },
        a.snapshot_generation,
        r.host_generation,
        request_id.as_str()
    ))?;
    let dev = |d: &Option<proto::Device>| -> String {
        match d {
            Some(d) => format!(
                "{} owner {} generation {}",
                d.address,
                owner_text(&d.owner),
                d.generation
            ),
            None => "?".into(),
        }
    };
    for o in &r.orphans {
        let what = if o.earlier_attempt {
            format!(
                "; freed at generation {} by an earlier attempt with this request id",
                o.freed_generation
            )
        } else if o.freed_generation != 0 {
            format!("; freed at generation {}", o.freed_generation)
        } else if !o.kept_because.is_empty() {
            format!("; kept: {}", o.kept_because)
        } else if r.acted {
            String::new()
        } else {
            "; would be freed with --act".into()
        };
        out(format!("orphan     {}{what}", dev(&o.device)))?;
    }
    for s in &r.strays {
        out(format!("stray      {}", stray_text(s)))?;
    }
    for (name, list) in [
        ("lost", &r.lost),
        ("changed", &r.changed),
        ("protected", &r.protected),
    ] {
        for d in list {
            // Why a protected device is kept (the domain, or the process holding its VFIO
            // group) says more than its state's detail.
            let why = (name == "protected")
                .then(|| r.protections.iter().find(|p| p.address == d.address))
                .flatten()
                .filter(|p| !p.reason.is_empty());
            let detail = detail_text(d);
            let detail = match why {
                Some(p) => format!("; kept because {}", p.reason),
                None if detail.is_empty() => String::new(),
                None => format!(" ({detail})"),
            };
            out(format!("{name:<10} {}{detail}", dev(&Some(d.clone()))))?;
        }
    }
    out(format!(
        "{} orphans, {} strays, {} lost, {} changed, {} protected",
        r.orphans.len(),
        r.strays.len(),
        r.lost.len(),
        r.changed.len(),
        r.protected.len()
    ))
}

fn health_text(h: &Option<proto::Health>) -> String {
    match h {
        Some(h) => format!("{} ({})", if h.ok { "ok" } else { "NOT OK" }, h.detail),
        None => "unknown".into(),
    }
}

/// Signals the agent to reload (SIGHUP), then asks its status until a reload that began
/// after the signal has ended, and says how it ended.
async fn cmd_reload(ctx: &mut Ctx, a: ReloadArgs) -> Outcome {
    let socket = ctx.socket.display().to_string();
    let pid = match (a.pid, ctx.agent_pid) {
        (Some(asked), Some(agent)) if asked != agent => {
            return Err(Failure::Refused(format!(
                "PID {asked} is not the agent listening on {socket} (that is PID {agent}): nothing was signalled"
            )))
        }
        (Some(pid), _) | (None, Some(pid)) => pid,
        (None, None) => {
            return Err(Failure::Usage(format!(
                "the kernel does not name the process listening on {socket} (an agent in another PID namespace): pass --pid"
            )))
        }
    };
    // A reload counted as begun now may have read the config before this call: the one
    // that answers is the next to begin, so the wait is for one more to end than had begun.
    let begun = agent_status(ctx, "reload").await?.reloads_started;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGHUP,
    )
    .map_err(|e| Failure::Refused(format!("cannot signal the agent (PID {pid}): {e}")))?;
    let deadline = std::time::Instant::now() + Duration::from_secs(a.timeout);
    let s = loop {
        let s = agent_status(ctx, "reload").await?;
        if s.reloads_finished > begun {
            break s;
        }
        if std::time::Instant::now() >= deadline {
            return Err(Failure::Unavailable(format!(
                "SIGHUP sent to the agent (PID {pid}), but no reload ended within {} s (an agent older than this hostdevctl does not count them); `hostdevctl status` shows the last one's outcome",
                a.timeout
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let Some(last) = s.last_reload else {
        return Err(Failure::Refused(
            "the agent counts a reload as ended but gives no outcome".into(),
        ));
    };
    if !last.ok {
        return Err(Failure::Refused(last.detail));
    }
    if ctx.json {
        return out_json(&json!({
            "reloaded": true,
            "detail": last.detail,
            "pid": pid,
            "reloads_finished": s.reloads_finished,
        }));
    }
    out(format!("{} (agent PID {pid})", last.detail))
}

/// The agent's status, for the command `op`.
async fn agent_status(ctx: &mut Ctx, op: &str) -> Result<proto::AgentStatus, Failure> {
    Ok(ctx
        .client
        .get_status(within(ctx.deadline, proto::GetStatusRequest {}))
        .await
        .map_err(|s| describe(op, &ctx.socket, &s))?
        .into_inner())
}

async fn cmd_status(ctx: &mut Ctx) -> Outcome {
    let s = agent_status(ctx, "status").await?;
    let counts: BTreeMap<&String, &u32> = s.devices_by_state.iter().collect();
    if ctx.json {
        let health = |h: &Option<proto::Health>| match h {
            Some(h) => json!({"ok": h.ok, "detail": h.detail}),
            None => Value::Null,
        };
        return out_json(&json!({
            "version": s.version,
            "host_generation": s.host_generation,
            "uptime_seconds": s.uptime_seconds,
            "store": health(&s.store),
            "libvirt": health(&s.libvirt),
            "libvirt_events": health(&s.libvirt_events),
            "hotplug": health(&s.hotplug),
            "uevents": s.uevents,
            "uevent_resyncs": s.uevent_resyncs,
            "boot_id": s.boot_id,
            "devices_by_state": counts,
            "strays": s.strays,
            "lost": s.lost,
            "watch_oldest_generation": s.watch_oldest_generation,
            "reloads": {
                "started": s.reloads_started,
                "finished": s.reloads_finished,
                "last": health(&s.last_reload),
            },
            "socket": ctx.socket.display().to_string(),
        }));
    }
    let by_state = counts
        .iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect::<Vec<_>>()
        .join(", ");
    let lines = [
        ("socket", ctx.socket.display().to_string()),
        ("version", s.version.clone()),
        ("host generation", s.host_generation.to_string()),
        ("uptime", format!("{}s", s.uptime_seconds)),
        ("boot id", or_dash(&s.boot_id).into()),
        ("store", health_text(&s.store)),
        ("libvirt", health_text(&s.libvirt)),
        ("libvirt events", health_text(&s.libvirt_events)),
        ("hotplug", health_text(&s.hotplug)),
        (
            "devices",
            if by_state.is_empty() {
                "none".into()
            } else {
                by_state
            },
        ),
        ("strays", s.strays.to_string()),
        ("lost", s.lost.to_string()),
        (
            "watch from",
            format!("generation {} or later", s.watch_oldest_generation),
        ),
        (
            "reloads",
            match &s.last_reload {
                Some(_) => format!(
                    "{} done, the last {}",
                    s.reloads_finished,
                    health_text(&s.last_reload)
                ),
                None if s.reloads_started > 0 => "the first under way".into(),
                None => "none since the start".into(),
            },
        ),
    ];
    for (k, v) in lines {
        out(format!("{k:<16} {v}"))?;
    }
    Ok(())
}

async fn cmd_outcome(ctx: &mut Ctx, owner: ConsumerId, request_id: RequestId) -> Outcome {
    let r = ctx
        .client
        .get_request_outcome(within(
            ctx.deadline,
            proto::GetRequestOutcomeRequest {
                consumer_id: owner.to_string(),
                request_id: request_id.to_string(),
            },
        ))
        .await
        .map_err(|s| describe("outcome", &ctx.socket, &s))?
        .into_inner();
    if ctx.json {
        return out_json(&json!({
            "operation": r.operation,
            "address": r.address,
            "generation": r.generation,
            "at_unix": r.at_unix,
        }));
    }
    out(format!(
        "{} {} at generation {} (unix time {})",
        r.operation, r.address, r.generation, r.at_unix
    ))
}

/// Whether a failed connect never reached an agent: no socket, nobody listening on it,
/// or no permission to it.
fn unreached(kind: std::io::ErrorKind) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        kind,
        NotFound | ConnectionRefused | PermissionDenied | NotADirectory | InvalidInput
    )
}

async fn run(cli: Cli) -> Outcome {
    let socket = socket_path(&cli);
    let (client, agent_pid) = client::connect_with_pid(&socket).await.map_err(|e| {
        let cause = std::error::Error::source(&e)
            .map(|c| c.to_string())
            .unwrap_or_else(|| e.to_string());
        let kind = e.kind();
        if unreached(kind) {
            Failure::Connect(format!(
                "cannot connect to hostdevd at {}: {cause} (is the daemon running? set --socket or ${SOCKET_ENV})",
                socket.display()
            ))
        } else if kind == std::io::ErrorKind::TimedOut {
            Failure::Connect(format!(
                "hostdevd at {} accepted the connection but did not answer: {cause} (is it stopped, or still starting? its log says)",
                socket.display()
            ))
        } else {
            Failure::Connect(format!(
                "hostdevd at {} closed the connection: {cause} (a new connection whose uid holds [api] max_connections_per_uid already is closed unanswered while the agent answers many such, and logged)",
                socket.display()
            ))
        }
    })?;
    let mut ctx = Ctx {
        client,
        deadline: Duration::from_secs(cli.deadline),
        socket,
        json: cli.json,
        agent_pid,
    };
    match cli.command {
        Command::List => cmd_list(&mut ctx).await,
        Command::Show { address } => cmd_show(&mut ctx, address).await,
        Command::Claim(a) => cmd_claim(&mut ctx, a).await,
        Command::Release(a) => cmd_release(&mut ctx, a).await,
        Command::Transfer(a) => cmd_transfer(&mut ctx, a).await,
        Command::Watch(a) => cmd_watch(&mut ctx, a).await,
        Command::Reconcile(a) => cmd_reconcile(&mut ctx, a).await,
        Command::Status => cmd_status(&mut ctx).await,
        Command::Reload(a) => cmd_reload(&mut ctx, a).await,
        Command::PrepareVfio(a) => cmd_prepare_vfio(&mut ctx, a).await,
        Command::SetVfs(a) => cmd_set_vfs(&mut ctx, a).await,
        Command::Outcome { owner, request_id } => cmd_outcome(&mut ctx, owner, request_id).await,
    }
}

fn main() -> ExitCode {
    // clap exits with status 2 on a usage error, 0 for --help/--version.
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("hostdevctl: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match rt.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Output(e)) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(Failure::Output(e)) => {
            eprintln!("hostdevctl: cannot write the output: {e}");
            ExitCode::from(1)
        }
        Err(Failure::Refused(m)) => {
            eprintln!("hostdevctl: {m}");
            ExitCode::from(1)
        }
        Err(Failure::Usage(m)) => {
            eprintln!("hostdevctl: {m}");
            ExitCode::from(2)
        }
        Err(Failure::Connect(m)) => {
            eprintln!("hostdevctl: {m}");
            ExitCode::from(3)
        }
        Err(Failure::Unavailable(m)) => {
            eprintln!("hostdevctl: {m}");
            ExitCode::from(4)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `watch --follow` goes on where a later stream may be served, and stops at a
    /// refusal, which no retry mends.
    #[test]
    fn a_followed_watch_goes_on_only_where_a_retry_can_be_served() {
        let agent = |code, reason| ours(code, reason, "the agent's words");
        let goes_on = [
            agent(Code::OutOfRange, "GENERATION_TOO_OLD"),
            agent(Code::ResourceExhausted, "WATCH_CUT_OFF"),
            agent(Code::Unavailable, "SHUTTING_DOWN"),
            Status::unavailable("transport error: connection reset"),
            Status::unknown("h2 protocol error"),
            Status::cancelled("the connection closed"),
        ];
        for s in &goes_on {
            assert!(worth_following(s), "{s:?}");
        }
        let ends = [
            agent(Code::ResourceExhausted, "TOO_MANY_WATCHERS"),
            agent(Code::ResourceExhausted, "TOO_MANY_CALLS"),
            agent(Code::PermissionDenied, "PERMISSION_DENIED"),
            agent(Code::Unavailable, "STORE_UNAVAILABLE"),
            Status::invalid_argument("bad request"),
        ];
        for s in &ends {
            assert!(!worth_following(s), "{s:?}");
        }
    }

    #[test]
    fn a_removal_says_which_record_went() {
        let removed = |present| proto::WatchEvent {
            kind: proto::WatchEventKind::Removed as i32,
            generation: 7,
            address: "0000:3b:02.0".into(),
            device: Some(proto::Device {
                address: "0000:3b:02.0".into(),
                present,
                generation: 7,
                ..Default::default()
            }),
        };
        assert_eq!(
            event_text(&removed(false)),
            "7 removed 0000:3b:02.0 (a lost claim)"
        );
        assert_eq!(
            event_text(&removed(true)),
            "7 removed 0000:3b:02.0 (the present device)"
        );
    }

    #[test]
    fn resource_exhausted_reads_no_free_device_only_for_no_match() {
        assert_eq!(
            code_label(Code::ResourceExhausted, Some("NO_MATCH")),
            Some("no free device")
        );
        // The stream limit and a Watch cut-off say what they are in their messages.
        assert_eq!(
            code_label(Code::ResourceExhausted, Some("TOO_MANY_WATCHERS")),
            None
        );
        assert_eq!(
            code_label(Code::ResourceExhausted, Some("WATCH_CUT_OFF")),
            None
        );
        assert_eq!(code_label(Code::ResourceExhausted, None), None);
    }

    #[test]
    fn a_device_whose_pf_changes_is_busy_not_the_agent() {
        assert_eq!(
            code_label(Code::Unavailable, Some("VF_COUNT_CHANGING")),
            Some("device busy")
        );
        assert_eq!(
            code_label(Code::Unavailable, Some("STORE_UNAVAILABLE")),
            Some("agent unavailable")
        );
    }

    #[test]
    fn aborted_is_labelled_by_its_reason() {
        assert_eq!(
            code_label(Code::Aborted, Some("STALE_GENERATION")),
            Some("stale generation")
        );
        // A request id that GetRequestOutcome closed is no stale generation.
        assert_eq!(
            code_label(Code::Aborted, Some("REQUEST_CLOSED")),
            Some("request id closed")
        );
        assert_eq!(code_label(Code::Aborted, None), None);
        let socket = std::path::Path::new("hostdevd.sock");
        let closed = ours(
            Code::Aborted,
            "REQUEST_CLOSED",
            "request r1 of consumer c was closed: GetRequestOutcome answered that it was not applied",
        );
        match describe("claim", socket, &closed) {
            Failure::Refused(m) => assert!(
                m.starts_with("claim refused: request id closed: request r1"),
                "{m}"
            ),
            other => panic!("{other:?}"),
        }
    }

    fn ours(code: Code, reason: &str, message: &str) -> Status {
        let details = tonic_types::ErrorDetails::with_error_info(
            reason,
            ERROR_DOMAIN,
            std::collections::HashMap::new(),
        );
        Status::with_error_details(code, message, details)
    }

    #[test]
    fn an_agent_shutting_down_reads_as_stopping_not_as_a_lost_connection() {
        let socket = std::path::Path::new("hostdevd.sock");
        let stopping = ours(
            Code::Unavailable,
            "SHUTTING_DOWN",
            "the agent is shutting down; resume with Watch from the last generation received",
        );
        match describe("watch", socket, &stopping) {
            // Exit 4, as for any call the agent cannot serve now: worth trying again.
            Failure::Unavailable(m) => assert_eq!(
                m,
                "watch failed: agent stopping: the agent is shutting down; resume with Watch from the last generation received"
            ),
            other => panic!("{other:?}"),
        }
        let silent = ours(
            Code::Unavailable,
            "LIBVIRT_UNREACHABLE",
            "libvirt at qemu:///system unreachable",
        );
        assert!(
            matches!(describe("release", socket, &silent), Failure::Unavailable(m) if m.starts_with("release refused: agent unavailable")),
        );
        let stale = ours(Code::Aborted, "STALE_GENERATION", "stale");
        assert!(matches!(
            describe("release", socket, &stale),
            Failure::Refused(_)
        ));
        // Without our ErrorInfo, UNAVAILABLE is the transport's: the connection broke.
        let broken = Status::unavailable("connection reset");
        assert!(
            matches!(describe("watch", socket, &broken), Failure::Connect(m) if m.contains("lost the connection")),
        );
    }
}
