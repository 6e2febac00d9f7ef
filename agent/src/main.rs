//! `vramguard`: the node agent. `run` is the daemon (eBPF accounting of every GPU allocation
//! on the node, reclaim of dead processes' ledger slots, reconciliation of the ledgers with
//! the eBPF view, Prometheus metrics); `audit` asks a running agent for its live table of
//! processes and their states; `inspect` and `reclaim` work on a ledger file directly;
//! `webhook` is the admission webhook that turns `vramguard.io/gpu-memory` into DRA claims.

use std::path::PathBuf;

use agent::{inspect, run, serve::control};
use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "vramguard", version, about = "GPU-memory quota agent: eBPF accounting and audit")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the agent: probe libcuda, account GPU memory per cgroup and process, until SIGTERM.
    Run(Box<run::RunArgs>),
    /// Print the processes using GPU memory, as seen by the running agent.
    Audit {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// The running agent's control socket.
        #[arg(long, default_value = control::DEFAULT_SOCKET, value_name = "PATH")]
        socket: PathBuf,
    },
    /// Show what a ledger file holds (limits, slots, records) and check its invariants; exits
    /// non-zero if a check fails.
    Inspect {
        ledger: PathBuf,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Serve the mutating admission webhook that turns `vramguard.io/gpu-memory` limits into
    /// DRA claims (a Deployment of its own; no eBPF, no node access), until SIGTERM.
    Webhook(Box<agent::webhook::WebhookArgs>),
    /// Check the node's preconditions (kernel, containerd's NRI and CDI, NVML and the device
    /// files; with --kube, the API server): a line each, `ok`, `warn` or `fail`; exits
    /// non-zero if a check fails.
    Doctor(Box<agent::doctor::DoctorArgs>),
    /// Internal: the confined process the agent starts for each ledger it operates on.
    #[command(hide = true)]
    LedgerWorker,
    /// Free the slots of processes that are gone; a running process's slot is never freed.
    Reclaim {
        ledger: PathBuf,
        /// Only this slot (refused if its process still runs).
        #[arg(long)]
        slot: Option<u32>,
    },
}

/// The async runtime's threads (the tasks; none of them blocks).
const RUNTIME_THREADS: usize = 2;
/// The blocking pool's threads at most (the tasks' steps: scans, sweeps, passes, renders).
const BLOCKING_THREADS: usize = 16;
/// How long the runtime's shutdown waits for the blocking pool after the agent's stop.
const SHUTDOWN_WAIT: std::time::Duration = std::time::Duration::from_millis(500);
/// How long the agent waits for its probes to be detached before it exits.
const DETACH_WAIT: std::time::Duration = std::time::Duration::from_secs(20);

fn main() -> Result<()> {
    // Before anything else: a worker confines itself first and logs nothing.
    if std::env::args_os().nth(1).is_some_and(|arg| arg == "ledger-worker") {
        std::process::exit(agent::ledgers::worker::main());
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("VRAMGUARD_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match Cli::parse().command {
        // Two runtime threads for the tasks (the nodes' agents get a CPU or two); tenant-sized
        // and blocking work goes to the blocking pool, bounded so that many slow tenants queue
        // there rather than grow the agent's threads.
        Command::Run(args) => {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(RUNTIME_THREADS)
                .max_blocking_threads(BLOCKING_THREADS)
                .thread_name("vramguard")
                .enable_all()
                .build()?;
            let ran = runtime.block_on(run::run(*args));
            // A step stuck on the blocking pool (a task's, aborted at the stop) is not waited for.
            runtime.shutdown_timeout(SHUTDOWN_WAIT);
            // The probes are: the kernel waits for a grace period for each link, or perf event.
            if !agent::kernel::task::wait_detached(DETACH_WAIT) {
                tracing::warn!("the probes are not detached yet: they go with the agent's exit");
            }
            ran
        }
        Command::Webhook(args) => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(RUNTIME_THREADS)
            .thread_name("vramguard-webhook")
            .enable_all()
            .build()?
            .block_on(agent::webhook::run(*args)),
        Command::Audit { json, socket } => {
            let snapshot = control::fetch(&socket)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&snapshot)?);
            } else {
                print!("{}", snapshot.render_table());
            }
            Ok(())
        }
        Command::Doctor(args) => match agent::doctor::run(*args)? {
            true => Ok(()),
            false => std::process::exit(1),
        },
        Command::Inspect { ledger, json } => inspect::inspect(&ledger, json),
        Command::Reclaim { ledger, slot } => inspect::reclaim(&ledger, slot),
        Command::LedgerWorker => std::process::exit(agent::ledgers::worker::main()),
    }
}
