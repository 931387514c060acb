//! The `hostdevd` binary: parses the command line, sets up logging to stderr, and calls into the library.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};

use hostdevd::sysfs::{self, names::DEFAULT_PCI_IDS_PATHS, PciNames};

#[derive(Debug, Parser)]
#[command(name = "hostdevd", version, about = "Per-hypervisor authority on PCI device ownership")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// List the host's PCI devices as sysfs reports them, and exit.
    Scan(ScanArgs),
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

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
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
    let cli = Cli::parse();
    init_logging();
    let result = match &cli.command {
        Command::Scan(args) => run_scan(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("hostdevd: {e:#}");
            ExitCode::FAILURE
        }
    }
}
