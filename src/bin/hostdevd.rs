//! The `hostdevd` binary: parses the command line, sets up logging to stderr, and calls into the library.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};

use hostdevd::config::{Config, DEFAULT_CONFIG_PATH};
use hostdevd::sysfs::{self, names::DEFAULT_PCI_IDS_PATHS, PciNames};

#[derive(Debug, Parser)]
#[command(
    name = "hostdevd",
    version,
    about = "Per-hypervisor authority on PCI device ownership"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// List the host's PCI devices as sysfs reports them, and exit.
    Scan(ScanArgs),
    /// Run the agent: load the ledger, scan, serve the gRPC API on the Unix socket.
    Serve(ServeArgs),
    /// Run the agent on a simulated host (SR-IOV NICs with VFs) in a temporary directory,
    /// print how to talk to it, and remove everything on Ctrl-C.
    Demo(DemoArgs),
}

#[derive(Debug, Args)]
struct DemoArgs {
    /// Where to create the simulated host (a fresh subdirectory is made and removed).
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// VFs per PF.
    #[arg(long, default_value_t = 8)]
    vfs: u32,
}

fn run_demo(args: &DemoArgs) -> anyhow::Result<()> {
    let base = match &args.dir {
        Some(d) => d.clone(),
        None => std::env::temp_dir(),
    };
    let scratch = tempfile::Builder::new()
        .prefix("hostdevd-demo")
        .tempdir_in(&base)
        .with_context(|| format!("creating the demo directory in {}", base.display()))?;
    let demo = hostdevd::demo::build(scratch.path(), args.vfs.min(64));
    let sock = demo.socket.display().to_string();
    println!(
        "hostdevd demo: a simulated host with 2 SR-IOV NICs x {} VFs in {}",
        args.vfs.min(64),
        scratch.path().display()
    );
    println!();
    println!("In another terminal (cargo run --bin hostdevctl -- ... also works):");
    println!("  export HOSTDEVD_SOCKET={sock}");
    println!("  hostdevctl list");
    println!(
        "  hostdevctl claim --select --physnet physnet1 --numa 1 --owner {}",
        uuid::Uuid::new_v4()
    );
    println!("  hostdevctl watch");
    println!("  hostdevctl status");
    println!(
        "  hostdevd scan --sysfs-root {}",
        demo.config.sysfs_root.display()
    );
    println!();
    println!("Ctrl-C stops the agent and removes the simulated host.");
    let rt = hostdevd::daemon::runtime().context("starting the async runtime")?;
    let result = rt.block_on(hostdevd::daemon::run(demo.config.clone(), None));
    rt.shutdown_timeout(CLOSE_LIMIT);
    // Before the simulated host and its state directory are removed.
    let closed = result.map(|closing| closing.wait(CLOSE_LIMIT));
    drop(demo);
    drop(scratch);
    closed?;
    Ok(())
}

/// How long a clean stop waits for the writer thread to close the store.
const CLOSE_LIMIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Flags override the config file's keys of the same name.
#[derive(Debug, Args)]
struct ServeArgs {
    /// The TOML config file. When absent and not given, built-in defaults apply.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    #[arg(long, value_name = "DIR")]
    sysfs_root: Option<PathBuf>,
    #[arg(long, value_name = "DIR")]
    dev_root: Option<PathBuf>,
    #[arg(long, value_name = "DIR")]
    proc_root: Option<PathBuf>,
    #[arg(long, value_name = "DIR")]
    state_dir: Option<PathBuf>,
    /// Unix socket path.
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Socket mode, octal (e.g. 0660).
    #[arg(long, value_name = "MODE")]
    socket_mode: Option<String>,
    /// Group owning the socket.
    #[arg(long, value_name = "GROUP")]
    socket_group: Option<String>,
    /// A uid allowed to mutate (repeatable; replaces the config's list).
    #[arg(long = "writer-uid", value_name = "UID")]
    writer_uids: Vec<u32>,
    /// A gid allowed to mutate (repeatable; replaces the config's list).
    #[arg(long = "writer-gid", value_name = "GID")]
    writer_gids: Vec<u32>,
    /// The libvirt URI (`[libvirt] uri`), e.g. test:///default.
    #[arg(long, value_name = "URI")]
    libvirt_uri: Option<String>,
    /// Do not ask libvirt (`[libvirt] enabled = false`).
    #[arg(long, conflicts_with = "libvirt_uri")]
    no_libvirt: bool,
}

fn load_config(args: &ServeArgs) -> anyhow::Result<(Config, Option<PathBuf>)> {
    let path = match &args.config {
        Some(p) => Some(p.clone()),
        None => {
            let p = PathBuf::from(DEFAULT_CONFIG_PATH);
            p.exists().then_some(p)
        }
    };
    let mut cfg = match &path {
        Some(p) => Config::load(p)?,
        None => Config::default(),
    };
    if let Some(v) = &args.sysfs_root {
        cfg.sysfs_root = v.clone();
    }
    if let Some(v) = &args.dev_root {
        cfg.dev_root = v.clone();
    }
    if let Some(v) = &args.proc_root {
        cfg.proc_root = v.clone();
    }
    if let Some(v) = &args.state_dir {
        cfg.state_dir = v.clone();
    }
    if let Some(v) = &args.socket {
        cfg.api.socket = v.clone();
    }
    if let Some(v) = &args.socket_mode {
        cfg.api.socket_mode = v.clone();
    }
    if let Some(v) = &args.socket_group {
        cfg.api.socket_group = Some(v.clone());
    }
    if !args.writer_uids.is_empty() {
        cfg.api.writer_uids = args.writer_uids.clone();
    }
    if !args.writer_gids.is_empty() {
        cfg.api.writer_gids = args.writer_gids.clone();
    }
    if let Some(v) = &args.libvirt_uri {
        cfg.libvirt.uri = v.clone();
        cfg.libvirt.enabled = true;
    }
    if args.no_libvirt {
        cfg.libvirt.enabled = false;
    }
    cfg.socket_mode()?;
    Ok((cfg, path))
}

fn run_serve(args: &ServeArgs) -> anyhow::Result<()> {
    let (cfg, path) = load_config(args)?;
    init_logging(&cfg.log.filter);
    let rt = hostdevd::daemon::runtime().context("starting the async runtime")?;
    let result = rt.block_on(hostdevd::daemon::run(cfg, path));
    // Dropping the runtime drops every task's handle to the writer; its thread then
    // closes the store. Not a plain drop, on a failure too (a failed commit or start
    // must end the process, for systemd to start it again): that waits without end for
    // every blocking task, and one may be stuck in the kernel or in libvirt (a sysfs
    // read the kernel holds, a libvirtd that stopped answering).
    rt.shutdown_timeout(CLOSE_LIMIT);
    result?.wait(CLOSE_LIMIT);
    Ok(())
}

#[derive(Debug, Args)]
struct ScanArgs {
    /// Root of the sysfs tree to read.
    #[arg(long, value_name = "DIR", default_value = sysfs::DEFAULT_SYSFS_ROOT)]
    sysfs_root: PathBuf,
    /// Root of the device nodes (for `vfio/N`).
    #[arg(long, value_name = "DIR", default_value = sysfs::DEFAULT_DEV_ROOT)]
    dev_root: PathBuf,
    /// A `pci.ids` file to consider for names (repeatable); the newest of these and the
    /// built-in database wins. Defaults to the distribution's locations.
    #[arg(long = "pci-ids", value_name = "FILE")]
    pci_ids: Vec<PathBuf>,
    /// Print one JSON object `{"devices":[...]}` instead of a table.
    #[arg(long)]
    json: bool,
}

/// Logs to stderr, filtered by `RUST_LOG` or else `default` (the config's `log.filter`
/// for `serve`). Under systemd (JOURNAL_STREAM set) lines carry no colours and no
/// timestamps: journald adds its own, and escape codes would clutter `journalctl`.
fn init_logging(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .or_else(|_| tracing_subscriber::EnvFilter::try_new(default))
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if std::env::var_os("JOURNAL_STREAM").is_some() {
        builder.with_ansi(false).without_time().init();
    } else {
        builder.init();
    }
}

fn run_scan(args: &ScanArgs) -> anyhow::Result<()> {
    let names = if args.pci_ids.is_empty() {
        PciNames::from_search_paths(DEFAULT_PCI_IDS_PATHS)
    } else {
        PciNames::from_search_paths(&args.pci_ids)
    };
    let inventory = sysfs::scan(&args.sysfs_root, &args.dev_root, &names)
        .with_context(|| format!("scanning the sysfs root {}", args.sysfs_root.display()))?;
    let mut out = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer(&mut out, &inventory).context("writing the inventory as JSON")?;
        writeln!(out).context("writing to stdout")?;
    } else {
        out.write_all(sysfs::render::render_table(&inventory).as_bytes())
            .context("writing to stdout")?;
    }
    out.flush().context("writing to stdout")?;
    Ok(())
}

fn main() -> ExitCode {
    hostdevd::memory::configure_allocator();
    let cli = Cli::parse();
    match cli.command {
        Command::Scan(_) => init_logging("warn"),
        Command::Demo(_) => init_logging("info"),
        // `serve` reads its filter from the config first.
        Command::Serve(_) => {}
    }
    let result = match &cli.command {
        Command::Scan(args) => run_scan(args),
        Command::Serve(args) => run_serve(args),
        Command::Demo(args) => run_demo(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("hostdevd: {e:#}");
            if is_config_error(&e) {
                ExitCode::from(EXIT_CONFIG)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

/// The exit status of a start refused for its configuration (sysexits' EX_CONFIG): the
/// unit does not restart on it (`RestartPreventExitStatus`), since a restart would only
/// be refused again, and the unit shows as failed at once.
const EXIT_CONFIG: u8 = 78;

fn is_config_error(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<hostdevd::config::ConfigError>().is_some()
            || matches!(
                c.downcast_ref::<hostdevd::daemon::DaemonError>(),
                Some(hostdevd::daemon::DaemonError::Config(_))
            )
    })
}
