//! The daemon's configuration file (TOML): every key, its default, and the managed-device
//! selection that turns an inventory into ledger facts.
//!
//! Unknown keys are rejected, so a typo in a selection cannot silently widen or narrow
//! what the agent manages.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::Deserialize;

use crate::ledger::DeviceFacts;
use crate::pci::{DeviceId, PciAddress, PhysNet, VendorId};
use crate::sysfs::PciDevice;

/// The default config file path.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/hostdevd/config.toml";

/// Why the configuration could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid config file {path}: {source}")]
    Parse {
        path: PathBuf,
        #[source]
        source: Box<toml::de::Error>,
    },
    #[error("invalid config: {0}")]
    Invalid(String),
}

fn d_sysfs() -> PathBuf {
    PathBuf::from(crate::sysfs::DEFAULT_SYSFS_ROOT)
}
fn d_dev() -> PathBuf {
    PathBuf::from(crate::sysfs::DEFAULT_DEV_ROOT)
}
fn d_proc() -> PathBuf {
    PathBuf::from("/proc")
}
fn d_state() -> PathBuf {
    PathBuf::from("/var/lib/hostdevd")
}
fn d_socket() -> PathBuf {
    PathBuf::from("/run/hostdevd/hostdevd.sock")
}
fn d_mode() -> String {
    "0660".into()
}
fn d_writers() -> Vec<u32> {
    vec![0]
}
fn d_watch() -> usize {
    65_536
}
fn d_request_log() -> usize {
    crate::store::DEFAULT_REQUEST_LOG_ENTRIES
}
fn d_request_log_memory() -> usize {
    crate::ledger::DEFAULT_REQUEST_LOG_LIMIT
}
fn d_watch_bytes() -> usize {
    // The ring is the largest thing the agent keeps that load grows: at 4 MiB the
    // benchmark's 4096-device agent peaked at 32.0-32.2 MiB resident under load (the goal
    // is 32), at 1 MiB 28.7-28.9. A watcher further behind relists, which costs it a
    // snapshot, not a change.
    2 << 20
}
/// The most Watch streams a configuration may allow.
pub const MAX_WATCH_STREAMS: usize = 1 << 20;
/// The most `[api] max_connections_per_uid` (and `[api.tcp] max_connections_per_peer`)
/// may be set to (the kernel's own limit on open files, `fs.nr_open`, defaults to
/// 1,048,576).
pub const MAX_CONNECTIONS_PER_UID: usize = 1 << 20;
/// The most `[api] max_streams_per_connection` may be set to.
pub const MAX_STREAMS_PER_CONNECTION: usize = 1 << 20;
/// The most `[api] max_calls_per_uid` may be set to.
pub const MAX_CALLS_PER_UID: usize = 1 << 24;

fn d_max_watchers() -> usize {
    1024
}
fn d_max_watchers_per_uid() -> usize {
    256
}
fn d_max_connections_per_uid() -> usize {
    512
}
fn d_handshake_timeout_ms() -> u64 {
    10_000
}
/// The longest `[api.tcp] handshake_timeout_ms` may be (ten minutes).
pub const MAX_HANDSHAKE_TIMEOUT_MS: u64 = 600_000;
fn d_max_streams_per_connection() -> usize {
    1024
}
fn d_max_calls_per_uid() -> usize {
    4096
}
fn d_keepalive_interval_ms() -> u64 {
    60_000
}
fn d_keepalive_timeout_ms() -> u64 {
    20_000
}
fn d_watch_client_events() -> usize {
    1024
}
fn d_watch_client_bytes() -> usize {
    256 << 10
}
fn d_log() -> String {
    "info".into()
}
fn d_true() -> bool {
    true
}
fn d_libvirt_uri() -> String {
    "qemu:///system".into()
}
fn d_poll() -> u64 {
    2000
}
fn d_libvirt_timeout() -> u64 {
    5000
}
fn d_step_timeout() -> u64 {
    10_000
}
fn d_vf_count_timeout() -> u64 {
    180_000
}
fn d_rcvbuf() -> usize {
    4 << 20
}

/// The whole configuration. Field docs are the reference; `packaging/config.toml` repeats
/// them as comments.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Root of the sysfs tree to read. Default "/sys".
    #[serde(default = "d_sysfs")]
    pub sysfs_root: PathBuf,
    /// Root under which VFIO group nodes live (`<dev_root>/vfio/N`), and the iommufd
    /// interface's device nodes (`<dev_root>/vfio/devices/vfioX`). Default "/dev".
    #[serde(default = "d_dev")]
    pub dev_root: PathBuf,
    /// Root of the proc tree scanned for holders of VFIO nodes. Default "/proc".
    #[serde(default = "d_proc")]
    pub proc_root: PathBuf,
    /// Directory of the ledger database and its lock. Default "/var/lib/hostdevd".
    #[serde(default = "d_state")]
    pub state_dir: PathBuf,
    #[serde(default)]
    pub api: ApiConfig,
    #[serde(default)]
    pub log: LogConfig,
    #[serde(default)]
    pub metrics: MetricsConfig,
    #[serde(default)]
    pub libvirt: LibvirtConfig,
    #[serde(default)]
    pub hotplug: HotplugConfig,
    #[serde(default)]
    pub hardware: HardwareConfig,
    /// The managed-device selection. Empty: every SR-IOV VF is managed.
    #[serde(default)]
    pub devices: Vec<DeviceSpec>,
}

/// The gRPC listener and who may change state through it.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ApiConfig {
    /// Unix socket path. Default "/run/hostdevd/hostdevd.sock".
    #[serde(default = "d_socket")]
    pub socket: PathBuf,
    /// Socket file mode, octal. Default "0660".
    #[serde(default = "d_mode")]
    pub socket_mode: String,
    /// Group that owns the socket (readers connect through it). Default: unchanged.
    #[serde(default)]
    pub socket_group: Option<String>,
    /// uids allowed to claim, release, transfer and act in a reconcile. Default `[0]`.
    #[serde(default = "d_writers")]
    pub writer_uids: Vec<u32>,
    /// gids (the peer's primary gid) allowed to mutate. Default `[]`.
    #[serde(default)]
    pub writer_gids: Vec<u32>,
    /// Watch events kept for resuming watchers. Default 65536.
    #[serde(default = "d_watch")]
    pub watch_buffer: usize,
    /// Memory those events may take, in bytes (device views, approximately); the oldest
    /// go first past either limit. Default 2097152.
    #[serde(default = "d_watch_bytes")]
    pub watch_buffer_bytes: usize,
    /// Request-log entries kept on disk (per consumer and request id, the first answer
    /// a retry gets); the oldest tenth is pruned past it. Each also takes 8 bytes of
    /// memory in the store's index (800 KB at the default). Default 100000.
    #[serde(default = "d_request_log")]
    pub request_log_entries: usize,
    /// The newest of them also kept in memory; a retry of an older one is looked up on
    /// disk. At most what a prune leaves on disk, `request_log_entries` less a tenth.
    /// Default 1024.
    #[serde(default = "d_request_log_memory")]
    pub request_log_in_memory: usize,
    /// Watch streams open at once; one more gets RESOURCE_EXHAUSTED. Default 1024.
    #[serde(default = "d_max_watchers")]
    pub max_watch_streams: usize,
    /// Watch streams one Unix-socket peer uid, or one TCP peer address, may hold open at
    /// once, so that a reader that leaks streams (a monitoring tool) cannot take every
    /// slot from the compute manager. Streams of a Unix-socket peer without credentials
    /// count only against `max_watch_streams`. Default 256.
    #[serde(default = "d_max_watchers_per_uid")]
    pub max_watch_streams_per_uid: usize,
    /// Connections one peer uid may hold open on the Unix socket at once; one more is
    /// served nothing: its calls are answered RESOURCE_EXHAUSTED (TOO_MANY_CONNECTIONS,
    /// naming this setting) and it is closed (and logged, and counted in
    /// `hostdevd_connections_refused_total`). Each connection holds a file descriptor,
    /// so a client that leaks them (a channel per call, never closed) would otherwise
    /// take every descriptor the agent may open, and with them its reads of sysfs and
    /// /proc. One connection carries any number of calls and Watch streams. Default 512.
    #[serde(default = "d_max_connections_per_uid")]
    pub max_connections_per_uid: usize,
    /// Calls (Watch streams included) one connection may have open at once, announced to
    /// the client as HTTP/2's SETTINGS_MAX_CONCURRENT_STREAMS: a client waits before it
    /// opens one more, so that a connection cannot start calls without bound (the HTTP/2
    /// server under tonic sets no limit of its own). Both listeners. Default 1024.
    #[serde(default = "d_max_streams_per_connection")]
    pub max_streams_per_connection: usize,
    /// Calls one caller may have open at once over all its connections (a Unix-socket
    /// peer uid, or a TCP peer address): running, answered and
    /// not yet read by the client, and Watch streams, health checks and reflection
    /// included. One more is refused at once,
    /// RESOURCE_EXHAUSTED (TOO_MANY_CALLS, naming this setting). Without it a caller's
    /// bound was `max_connections_per_uid` × `max_streams_per_connection` (half a million
    /// calls by default, a few KiB each while open). Default 4096.
    #[serde(default = "d_max_calls_per_uid")]
    pub max_calls_per_uid: usize,
    /// How long a connection may stay silent before the agent sends it an HTTP/2 PING,
    /// in ms (both listeners). Default 60000.
    #[serde(default = "d_keepalive_interval_ms")]
    pub keepalive_interval_ms: u64,
    /// How long that ping may go unanswered before the connection is closed, with its
    /// calls and Watch streams, in ms: a controller whose host died, or a client stopped
    /// mid-call, holds its connection and streams no longer than interval + timeout.
    /// Default 20000.
    #[serde(default = "d_keepalive_timeout_ms")]
    pub keepalive_timeout_ms: u64,
    /// Events that may wait for one watcher before it is cut off. Default 1024.
    #[serde(default = "d_watch_client_events")]
    pub watch_client_events: usize,
    /// Encoded bytes that may wait for one watcher before it is cut off. Default 262144.
    #[serde(default = "d_watch_client_bytes")]
    pub watch_client_bytes: usize,
    /// An optional TCP listener, mutual TLS only. Default: none (Unix socket only).
    #[serde(default)]
    pub tcp: Option<TcpConfig>,
}

/// The optional TCP listener. The address and the three TLS files are required: there is
/// no TCP without mutual TLS. Clients must present a certificate signed by `client_ca`;
/// such clients may mutate (the certificate is their credential, as the uid is on the
/// Unix socket).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TcpConfig {
    /// Address and port to listen on, e.g. `127.0.0.1:7443` or `[::]:7443`.
    pub listen: std::net::SocketAddr,
    /// PEM server certificate (chain).
    pub cert: PathBuf,
    /// PEM private key of the server certificate.
    pub key: PathBuf,
    /// PEM CA certificate(s) that client certificates must chain to.
    pub client_ca: PathBuf,
    /// Connections one peer address may hold open, counted from the accept (before the
    /// TLS handshake); one more is closed at once. The TCP listener's counterpart of
    /// `[api] max_connections_per_uid`: a client that leaks connections, or never
    /// finishes its handshake, cannot take every descriptor the agent has.
    #[serde(default = "d_max_connections_per_uid")]
    pub max_connections_per_peer: usize,
    /// How long a connection may take to finish its TLS handshake before it is closed
    /// (its place given back), from the accept.
    #[serde(default = "d_handshake_timeout_ms")]
    pub handshake_timeout_ms: u64,
}

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig {
            socket: d_socket(),
            socket_mode: d_mode(),
            socket_group: None,
            writer_uids: d_writers(),
            writer_gids: Vec::new(),
            watch_buffer: d_watch(),
            watch_buffer_bytes: d_watch_bytes(),
            request_log_entries: d_request_log(),
            request_log_in_memory: d_request_log_memory(),
            max_watch_streams: d_max_watchers(),
            max_watch_streams_per_uid: d_max_watchers_per_uid(),
            max_connections_per_uid: d_max_connections_per_uid(),
            max_streams_per_connection: d_max_streams_per_connection(),
            max_calls_per_uid: d_max_calls_per_uid(),
            keepalive_interval_ms: d_keepalive_interval_ms(),
            keepalive_timeout_ms: d_keepalive_timeout_ms(),
            watch_client_events: d_watch_client_events(),
            watch_client_bytes: d_watch_client_bytes(),
            tcp: None,
        }
    }
}

/// The Prometheus metrics listener.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// Address to serve `GET /metrics` on, e.g. "127.0.0.1:9464". Default: off.
    pub listen: Option<std::net::SocketAddr>,
    /// Allow a non-loopback `listen` address. Default false.
    #[serde(default)]
    pub allow_remote: bool,
}

/// Checks `log.filter`: each comma-separated directive a level, or TARGET=LEVEL (with
/// span and field filters as `RUST_LOG` takes them). A bare word that is not a level
/// would be read as a target to log everything of, and everything else not at all: a
/// typo of a level ("infoo") would silence the agent, errors included.
fn check_log_filter(filter: &str) -> Result<(), ConfigError> {
    const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];
    let bad = |why: String| {
        ConfigError::Invalid(format!(
            "log.filter = {:?}: {why}",
            crate::pci::shown(filter)
        ))
    };
    for directive in filter.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        if !directive.contains('=') && !LEVELS.contains(&directive.to_ascii_lowercase().as_str()) {
            return Err(bad(format!(
                "{:?} is not a level (off, error, warn, info, debug, trace) nor TARGET=LEVEL",
                crate::pci::shown(directive)
            )));
        }
    }
    tracing_subscriber::EnvFilter::builder()
        .parse(filter)
        .map(|_| ())
        .map_err(|e| bad(e.to_string()))
}

/// Logging.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LogConfig {
    /// A `RUST_LOG`-style filter, e.g. "info" or "hostdevd=debug". Default "info".
    #[serde(default = "d_log")]
    pub filter: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig { filter: d_log() }
    }
}

/// Where the domains come from. A device that a libvirt domain references is attached and
/// never freed; before any free the agent lists the domains afresh, and refuses the free
/// (UNAVAILABLE) while libvirt does not answer.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LibvirtConfig {
    /// Whether to ask libvirt at all. With false no domain is ever seen, so nothing is
    /// attached and frees are checked only by generation and VFIO holders (for hosts
    /// whose VMs libvirt does not run). Default true.
    #[serde(default = "d_true")]
    pub enabled: bool,
    /// The libvirt connection URI. Default "qemu:///system".
    #[serde(default = "d_libvirt_uri")]
    pub uri: String,
    /// How often the domain list is polled to keep views current, in milliseconds (a
    /// free always queries afresh regardless). Default 2000.
    #[serde(default = "d_poll")]
    pub poll_interval_ms: u64,
    /// Whether to subscribe to libvirt's domain events (lifecycle, live device attach and
    /// detach) and list the domains again at once on each, between polls. The poll goes
    /// on either way: it is what recovers from a missed event. Default true.
    #[serde(default = "d_true")]
    pub events: bool,
    /// How long a free waits for libvirt's answer before refusing, in milliseconds.
    /// Default 5000.
    #[serde(default = "d_libvirt_timeout")]
    pub timeout_ms: u64,
}

impl Default for LibvirtConfig {
    fn default() -> Self {
        LibvirtConfig {
            enabled: d_true(),
            uri: d_libvirt_uri(),
            poll_interval_ms: d_poll(),
            events: d_true(),
            timeout_ms: d_libvirt_timeout(),
        }
    }
}

/// Kernel uevents (netlink) for PCI hotplug: each event rescans only the devices it
/// names; lost events (socket overflow) trigger a full rescan.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct HotplugConfig {
    /// Whether to listen for uevents. With false the inventory changes only on start and
    /// on SIGHUP. Default true.
    #[serde(default = "d_true")]
    pub enabled: bool,
    /// The uevent socket's receive buffer in bytes (forced past net.core.rmem_max when
    /// the agent has CAP_NET_ADMIN). A burst larger than this overflows the socket, which
    /// costs a full rescan. Default 4194304.
    #[serde(default = "d_rcvbuf")]
    pub receive_buffer_bytes: usize,
}

impl Default for HotplugConfig {
    fn default() -> Self {
        HotplugConfig {
            enabled: d_true(),
            receive_buffer_bytes: d_rcvbuf(),
        }
    }
}

/// Acting on hardware through sysfs (vfio-pci binding, VF counts), only when a client
/// asks for it.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct HardwareConfig {
    /// How long one sysfs write (one step) may take before the action fails, naming
    /// the step, in milliseconds. At least 1. Default 10000.
    #[serde(default = "d_step_timeout")]
    pub step_timeout_ms: u64,
    /// How long one `sriov_numvfs` write may take, in milliseconds: the kernel creates
    /// or destroys every VF within it, which takes minutes on some NICs (about 22 s for
    /// 64 VFs on i40e, 65 s for 125 on mlx5). At least 1. Default 180000.
    #[serde(default = "d_vf_count_timeout")]
    pub vf_count_timeout_ms: u64,
}

impl Default for HardwareConfig {
    fn default() -> Self {
        HardwareConfig {
            step_timeout_ms: d_step_timeout(),
            vf_count_timeout_ms: d_vf_count_timeout(),
        }
    }
}

/// One entry of the managed-device selection (like Nova's device_spec and the SR-IOV
/// device plugin's selectors). Every set field must match; a device matching any entry is
/// managed and gets that entry's physical network tags.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DeviceSpec {
    /// 4 hex digits.
    pub vendor_id: Option<String>,
    pub device_id: Option<String>,
    /// An address pattern: each of domain, bus, device, function is hex or "*", e.g.
    /// "0000:3b:*.*"; the short form "3b:02.*" means domain 0000.
    pub address: Option<String>,
    /// The network interface name of the PF: matches its VFs (and the PF itself).
    pub pf_name: Option<String>,
    /// Bound kernel driver.
    pub driver: Option<String>,
    /// Only VFs (true) or only non-VFs (false).
    pub vf: Option<bool>,
    /// Physical network tags for matching devices.
    #[serde(default)]
    pub physnets: Vec<String>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            sysfs_root: d_sysfs(),
            dev_root: d_dev(),
            proc_root: d_proc(),
            state_dir: d_state(),
            api: ApiConfig::default(),
            log: LogConfig::default(),
            metrics: MetricsConfig::default(),
            libvirt: LibvirtConfig::default(),
            hotplug: HotplugConfig::default(),
            hardware: HardwareConfig::default(),
            devices: Vec::new(),
        }
    }
}

impl Config {
    /// Reads and validates a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let cfg = Self::parse(&text).map_err(|e| match e {
            ConfigError::Parse { source, .. } => ConfigError::Parse {
                path: path.to_path_buf(),
                source,
            },
            other => other,
        })?;
        Ok(cfg)
    }

    /// The sections of `new` that differ from this (running) config and that a reload
    /// does not apply: only `[[devices]]` is reloaded; these take effect at the next
    /// start. (The roots are left out: the command line may override them.)
    pub fn restart_only_changes(&self, new: &Config) -> Vec<&'static str> {
        [
            ("[api]", self.api != new.api),
            ("[log]", self.log != new.log),
            ("[metrics]", self.metrics != new.metrics),
            ("[libvirt]", self.libvirt != new.libvirt),
            ("[hotplug]", self.hotplug != new.hotplug),
            ("[hardware]", self.hardware != new.hardware),
        ]
        .into_iter()
        .filter(|(_, changed)| *changed)
        .map(|(section, _)| section)
        .collect()
    }

    /// Parses and validates config text.
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let cfg: Config = toml::from_str(text).map_err(|source| ConfigError::Parse {
            path: PathBuf::from("<text>"),
            source: Box::new(source),
        })?;
        cfg.selection()?;
        cfg.socket_mode()?;
        if let Some(addr) = cfg.metrics.listen {
            if !addr.ip().is_loopback() && !cfg.metrics.allow_remote {
                return Err(ConfigError::Invalid(format!(
                    "metrics.listen {addr} is not a loopback address; set metrics.allow_remote = true to expose metrics beyond this host"
                )));
            }
        }
        let api = &cfg.api;
        for (key, value, max) in [
            (
                "max_watch_streams",
                api.max_watch_streams,
                MAX_WATCH_STREAMS,
            ),
            (
                "max_watch_streams_per_uid",
                api.max_watch_streams_per_uid,
                MAX_WATCH_STREAMS,
            ),
            (
                "max_connections_per_uid",
                api.max_connections_per_uid,
                MAX_CONNECTIONS_PER_UID,
            ),
            (
                "max_streams_per_connection",
                api.max_streams_per_connection,
                MAX_STREAMS_PER_CONNECTION,
            ),
            (
                "max_calls_per_uid",
                api.max_calls_per_uid,
                MAX_CALLS_PER_UID,
            ),
            ("watch_buffer", api.watch_buffer, 1 << 24),
            ("request_log_entries", api.request_log_entries, 10_000_000),
            (
                "request_log_in_memory",
                api.request_log_in_memory,
                1_000_000,
            ),
            ("watch_buffer_bytes", api.watch_buffer_bytes, 1 << 30),
            ("watch_client_events", api.watch_client_events, 1 << 24),
            ("watch_client_bytes", api.watch_client_bytes, 1 << 30),
        ] {
            if value == 0 || value > max {
                return Err(ConfigError::Invalid(format!(
                    "api.{key} = {value} is out of range: it must be from 1 to {max}"
                )));
            }
        }
        if let Some(tcp) = &api.tcp {
            let n = tcp.max_connections_per_peer;
            if n == 0 || n > MAX_CONNECTIONS_PER_UID {
                return Err(ConfigError::Invalid(format!(
                    "api.tcp.max_connections_per_peer = {n} is out of range: it must be from 1 to {MAX_CONNECTIONS_PER_UID}"
                )));
            }
            let t = tcp.handshake_timeout_ms;
            if t == 0 || t > MAX_HANDSHAKE_TIMEOUT_MS {
                return Err(ConfigError::Invalid(format!(
                    "api.tcp.handshake_timeout_ms = {t} is out of range: it must be from 1 to {MAX_HANDSHAKE_TIMEOUT_MS}"
                )));
            }
        }
        // A retry is answered from memory first: an entry kept there but already pruned
        // from disk would be answered before a restart and claimed afresh after it. A
        // prune leaves the newest `request_log_entries` less a tenth on disk.
        let after_prune = api.request_log_entries - api.request_log_entries / 10;
        if api.request_log_in_memory > after_prune {
            return Err(ConfigError::Invalid(format!(
                "api.request_log_in_memory = {} is more than the {after_prune} entries a prune of api.request_log_entries = {} leaves on disk: the entries kept in memory must also be kept on disk",
                api.request_log_in_memory, api.request_log_entries
            )));
        }
        // Past i32::MAX the socket option would wrap to the kernel's smallest buffer (a
        // small value gets that smallest buffer too, as asked).
        let rcvbuf = cfg.hotplug.receive_buffer_bytes;
        if !(1..=1 << 30).contains(&rcvbuf) {
            return Err(ConfigError::Invalid(format!(
                "hotplug.receive_buffer_bytes = {rcvbuf} is out of range: it must be from 1 to {}",
                1 << 30
            )));
        }
        check_log_filter(&cfg.log.filter)?;
        if cfg.libvirt.poll_interval_ms == 0 || cfg.libvirt.timeout_ms == 0 {
            return Err(ConfigError::Invalid(
                "libvirt.poll_interval_ms and libvirt.timeout_ms must be at least 1".into(),
            ));
        }
        // A timeout of 0 fails every step while its write still goes on.
        for (key, value) in [
            ("step_timeout_ms", cfg.hardware.step_timeout_ms),
            ("vf_count_timeout_ms", cfg.hardware.vf_count_timeout_ms),
        ] {
            if value == 0 {
                return Err(ConfigError::Invalid(format!(
                    "hardware.{key} must be at least 1"
                )));
            }
        }
        // Below 100 ms a busy client could miss a ping's answer and lose its connection;
        // past a day, a dead peer would hold its connection for as long.
        for (key, value) in [
            ("keepalive_interval_ms", cfg.api.keepalive_interval_ms),
            ("keepalive_timeout_ms", cfg.api.keepalive_timeout_ms),
        ] {
            if !(100..=86_400_000).contains(&value) {
                return Err(ConfigError::Invalid(format!(
                    "api.{key} = {value} is out of range: it must be from 100 to 86400000 (a day)"
                )));
            }
        }
        Ok(cfg)
    }

    /// The socket mode as a number.
    pub fn socket_mode(&self) -> Result<u32, ConfigError> {
        let m = self.api.socket_mode.trim_start_matches("0o");
        u32::from_str_radix(m, 8)
            .ok()
            .filter(|m| *m <= 0o777)
            .ok_or_else(|| {
                ConfigError::Invalid(format!(
                    "api.socket_mode {:?} is not an octal file mode such as \"0660\"",
                    self.api.socket_mode
                ))
            })
    }

    /// The compiled managed-device selection.
    pub fn selection(&self) -> Result<Selection, ConfigError> {
        let specs = self
            .devices
            .iter()
            .enumerate()
            .map(|(i, d)| {
                CompiledSpec::compile(d)
                    .map_err(|e| ConfigError::Invalid(format!("devices[{i}]: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Selection { specs })
    }
}

/// One part of an address pattern.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    Any,
    Is(u32),
}

impl Part {
    fn matches(&self, v: u32) -> bool {
        match self {
            Part::Any => true,
            Part::Is(x) => *x == v,
        }
    }
}

/// A PCI address with wildcards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddressPattern {
    domain: Part,
    bus: Part,
    device: Part,
    function: Part,
}

impl FromStr for AddressPattern {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "address pattern {:?} is not dddd:bb:dd.f with hex or '*' parts",
                crate::pci::shown(s)
            )
        };
        if s.len() > 24 {
            return Err(bad());
        }
        let (head, func) = s.rsplit_once('.').ok_or_else(bad)?;
        let parts: Vec<&str> = head.split(':').collect();
        let (d, b, v) = match parts.as_slice() {
            [d, b, v] => (*d, *b, *v),
            [b, v] => ("0", *b, *v),
            _ => return Err(bad()),
        };
        let part = |t: &str, max: u32| -> Result<Part, String> {
            if t == "*" {
                return Ok(Part::Any);
            }
            if t.is_empty() || t.len() > 8 || !t.bytes().all(|c| c.is_ascii_hexdigit()) {
                return Err(bad());
            }
            let v = u32::from_str_radix(t, 16).map_err(|_| bad())?;
            if v > max {
                return Err(bad());
            }
            Ok(Part::Is(v))
        };
        Ok(AddressPattern {
            domain: part(d, u32::MAX)?,
            bus: part(b, 0xff)?,
            device: part(v, 0x1f)?,
            function: part(func, 7)?,
        })
    }
}

impl AddressPattern {
    pub fn matches(&self, a: PciAddress) -> bool {
        self.domain.matches(a.domain())
            && self.bus.matches(u32::from(a.bus()))
            && self.device.matches(u32::from(a.device()))
            && self.function.matches(u32::from(a.function()))
    }
}

#[derive(Debug, Clone)]
struct CompiledSpec {
    vendor_id: Option<VendorId>,
    device_id: Option<DeviceId>,
    address: Option<AddressPattern>,
    pf_name: Option<String>,
    driver: Option<String>,
    vf: Option<bool>,
    physnets: Vec<PhysNet>,
}

impl CompiledSpec {
    fn compile(d: &DeviceSpec) -> Result<Self, String> {
        Ok(CompiledSpec {
            vendor_id: d
                .vendor_id
                .as_deref()
                .map(VendorId::from_str)
                .transpose()
                .map_err(|e| e.to_string())?,
            device_id: d
                .device_id
                .as_deref()
                .map(DeviceId::from_str)
                .transpose()
                .map_err(|e| e.to_string())?,
            address: d
                .address
                .as_deref()
                .map(AddressPattern::from_str)
                .transpose()?,
            pf_name: d.pf_name.clone(),
            driver: d.driver.clone(),
            vf: d.vf,
            physnets: d
                .physnets
                .iter()
                .map(|p| PhysNet::from_str(p).map_err(|e| e.to_string()))
                .collect::<Result<_, _>>()?,
        })
    }

    fn matches(&self, dev: &PciDevice, pf_netdevs: &[String]) -> bool {
        let is_vf = dev.physfn.is_some();
        self.vendor_id.is_none_or(|v| dev.vendor_id == Some(v))
            && self.device_id.is_none_or(|d| dev.device_id == Some(d))
            && self.address.is_none_or(|p| p.matches(dev.address))
            && self
                .driver
                .as_ref()
                .is_none_or(|d| dev.driver.as_deref() == Some(d.as_str()))
            && self.vf.is_none_or(|want| want == is_vf)
            && self
                .pf_name
                .as_ref()
                .is_none_or(|n| pf_netdevs.contains(n) || dev.netdevs.contains(n))
    }
}

/// The compiled managed-device selection.
#[derive(Debug, Clone)]
pub struct Selection {
    specs: Vec<CompiledSpec>,
}

impl fmt::Display for Selection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.specs.is_empty() {
            f.write_str("every SR-IOV VF")
        } else {
            write!(f, "{} device spec(s)", self.specs.len())
        }
    }
}

impl Selection {
    /// Turns an inventory into ledger facts: which devices are managed, with which tags.
    pub fn facts(&self, devices: &[PciDevice]) -> Vec<DeviceFacts> {
        let by_addr: std::collections::BTreeMap<PciAddress, &PciDevice> =
            devices.iter().map(|d| (d.address, d)).collect();
        devices
            .iter()
            .map(|dev| {
                let pf_netdevs: &[String] = dev
                    .physfn
                    .and_then(|pf| by_addr.get(&pf))
                    .map(|pf| pf.netdevs.as_slice())
                    .unwrap_or(&[]);
                self.fact(dev, pf_netdevs)
            })
            .collect()
    }

    /// The ledger facts of one device; `pf_netdevs` are its PF's interfaces (for a VF),
    /// which PF-netdev specs match on.
    pub fn fact(&self, dev: &PciDevice, pf_netdevs: &[String]) -> DeviceFacts {
        let (managed, physnets) = if self.specs.is_empty() {
            (dev.physfn.is_some(), Vec::new())
        } else {
            let mut managed = false;
            let mut tags: Vec<PhysNet> = Vec::new();
            for s in self.specs.iter().filter(|s| s.matches(dev, pf_netdevs)) {
                managed = true;
                for t in &s.physnets {
                    if !tags.contains(t) {
                        tags.push(t.clone());
                    }
                }
            }
            (managed, tags)
        };
        // A device whose identity could not be read is never handed out.
        let readable = dev.vendor_id.is_some() && dev.device_id.is_some();
        DeviceFacts {
            address: dev.address,
            vendor_id: dev.vendor_id.unwrap_or(VendorId(0xffff)),
            device_id: dev.device_id.unwrap_or(DeviceId(0xffff)),
            driver: dev.driver.clone(),
            iommu_group: dev.iommu_group,
            numa_node: dev.numa_node,
            physfn: dev.physfn,
            is_pf: dev.sriov.is_some(),
            physnets,
            managed: managed && readable,
            // Stamped with the boot by the rescanner, which knows it.
            instance: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reload_names_the_changed_sections_it_does_not_apply() {
        let running =
            Config::parse("[[devices]]\npf_name = \"ens1f0\"\nvf = true").expect("running");
        let new = Config::parse(
            "[log]\nfilter = \"debug\"\n[hardware]\nstep_timeout_ms = 5\n[[devices]]\npf_name = \"ens2f0\"\nvf = true",
        )
        .expect("new");
        assert_eq!(
            running.restart_only_changes(&new),
            vec!["[log]", "[hardware]"]
        );
        let devices_only =
            Config::parse("[[devices]]\npf_name = \"ens2f0\"\nvf = true").expect("devices");
        assert!(running.restart_only_changes(&devices_only).is_empty());
    }

    #[test]
    fn defaults_and_unknown_keys() {
        let c = Config::parse("").expect("empty config");
        assert_eq!(c, Config::default());
        let err = Config::parse("sysfs_rot = \"/x\"").expect_err("typo");
        assert!(err.to_string().contains("sysfs_rot"), "{err}");
        let err = Config::parse("[[devices]]\nvendor = \"8086\"").expect_err("typo");
        assert!(err.to_string().contains("vendor"), "{err}");
    }

    #[test]
    fn bad_values_are_named() {
        for (text, needle) in [
            ("[[devices]]\nvendor_id = \"80866\"", "devices[0]"),
            ("[[devices]]\naddress = \"0000:3b:*\"", "address pattern"),
            ("[[devices]]\nphysnets = [\"\"]", "physical network"),
            ("[api]\nsocket_mode = \"999\"", "socket_mode"),
            ("[api.tcp]\nlisten = \"127.0.0.1:7443\"", "missing field"),
            ("[metrics]\nlisten = \"0.0.0.0:9464\"", "allow_remote"),
            (
                "[api]\nrequest_log_entries = 100\nrequest_log_in_memory = 101",
                "api.request_log_in_memory = 101 is more than the 90 entries a prune of api.request_log_entries = 100 leaves on disk",
            ),
            (
                "[api]\nrequest_log_entries = 100\nrequest_log_in_memory = 91",
                "the 90 entries",
            ),
            (
                "[api]\nmax_connections_per_uid = 0",
                "api.max_connections_per_uid = 0 is out of range",
            ),
            (
                "[api]\nmax_streams_per_connection = 2000000",
                "api.max_streams_per_connection = 2000000 is out of range",
            ),
            (
                "[api]\nmax_calls_per_uid = 0",
                "api.max_calls_per_uid = 0 is out of range",
            ),
            (
                "[api.tcp]\nlisten = \"127.0.0.1:7443\"\ncert = \"c\"\nkey = \"k\"\nclient_ca = \"ca\"\nmax_connections_per_peer = 0",
                "api.tcp.max_connections_per_peer = 0 is out of range",
            ),
            (
                "[api.tcp]\nlisten = \"127.0.0.1:7443\"\ncert = \"c\"\nkey = \"k\"\nclient_ca = \"ca\"\nhandshake_timeout_ms = 600001",
                "api.tcp.handshake_timeout_ms = 600001 is out of range",
            ),
            (
                "[api]\nkeepalive_interval_ms = 10",
                "api.keepalive_interval_ms = 10 is out of range",
            ),
            (
                "[api]\nkeepalive_timeout_ms = 86400001",
                "api.keepalive_timeout_ms = 86400001 is out of range",
            ),
            ("[log]\nfilter = \"infoo\"", "\"infoo\" is not a level"),
            ("[log]\nfilter = \"hostdevd=verbose\"", "log.filter"),
            ("[hotplug]\nreceive_buffer_bytes = 0", "hotplug.receive_buffer_bytes = 0"),
            (
                "[hotplug]\nreceive_buffer_bytes = 4294967296",
                "hotplug.receive_buffer_bytes = 4294967296",
            ),
            (
                "[hardware]\nstep_timeout_ms = 0",
                "hardware.step_timeout_ms",
            ),
            (
                "[hardware]\nvf_count_timeout_ms = 0",
                "hardware.vf_count_timeout_ms",
            ),
            (
                "[api.tcp]\nlisten = \"nowhere\"\ncert = \"c\"\nkey = \"k\"\nclient_ca = \"ca\"",
                "listen",
            ),
        ] {
            let err = Config::parse(text).expect_err(text);
            assert!(err.to_string().contains(needle), "{text}: {err}");
        }
    }

    #[test]
    fn hardware_timeouts() {
        let c = Config::parse("").expect("defaults");
        assert_eq!(
            (c.hardware.step_timeout_ms, c.hardware.vf_count_timeout_ms),
            (10_000, 180_000)
        );
        let c = Config::parse("[hardware]\nvf_count_timeout_ms = 600000").expect("set");
        assert_eq!(c.hardware.vf_count_timeout_ms, 600_000);
    }

    #[test]
    fn address_patterns() {
        let p: AddressPattern = "0000:3b:*.*".parse().expect("pattern");
        assert!(p.matches("0000:3b:02.1".parse().expect("a")));
        assert!(!p.matches("0000:3c:02.1".parse().expect("a")));
        let p: AddressPattern = "*:*:02.1".parse().expect("pattern");
        assert!(p.matches("0001:ff:02.1".parse().expect("a")));
        assert!("0000:3b:20.*".parse::<AddressPattern>().is_err());
        let huge = "0".repeat(1 << 20);
        let e = huge.parse::<AddressPattern>().expect_err("too long");
        assert!(
            e.len() < 200,
            "the error quotes a bounded excerpt: {} bytes",
            e.len()
        );
    }

    #[test]
    fn libvirt_section() {
        let c = Config::parse("").expect("defaults");
        assert!(c.libvirt.enabled);
        assert_eq!(c.libvirt.uri, "qemu:///system");
        assert_eq!(c.libvirt.poll_interval_ms, 2000);
        assert!(c.libvirt.events);
        let c = Config::parse(
            "[libvirt]\nuri = \"test:///default\"\nenabled = false\npoll_interval_ms = 50\nevents = false\n",
        )
        .expect("libvirt");
        assert_eq!(
            (c.libvirt.uri.as_str(), c.libvirt.enabled, c.libvirt.events),
            ("test:///default", false, false)
        );
        for (text, needle) in [
            ("[libvirt]\nurl = \"x\"", "unknown field"),
            ("[libvirt]\npoll_interval_ms = 0", "poll_interval_ms"),
        ] {
            let err = Config::parse(text).expect_err(text);
            assert!(err.to_string().contains(needle), "{text}: {err}");
        }
    }
}
