//! `flare`: the Flare serving executable.
//!
//! - `flare check CORE` validates a runtime core without a GPU and prints its summary.
//! - `flare run [CORE]` serves a core over HTTP; `flare run --model CHECKPOINT` prepares the
//!   checkpoint's core first (Ignition in a child process, cached). Without a core on a machine
//!   with a GPU it prepares and serves the default model; without a GPU (or with `--sim`) it
//!   serves through the simulated executor, so the whole server runs on a machine without a GPU.
//!   Startup validates the core and starts the workers before binding the socket: a failed
//!   startup exposes no endpoint.
//! - `flare bench` / `flare load` drive any OpenAI-compatible endpoint.

mod prepare;
mod serve;
mod sim;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use helios_contract::{CoreError, OpenOptions, RuntimeCore, Summary};

#[derive(Debug, Parser)]
#[command(name = "flare", version, about = "Local LLM inference server for agent workloads")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Validate a runtime core (no GPU needed) and print its summary.
    Check {
        /// Directory of a runtime core exported by `python -m ignition prepare`.
        core: PathBuf,
        /// Skip hashing payload files (kernel images and frontend assets are always hashed).
        #[arg(long)]
        no_verify_payloads: bool,
    },
    /// Serve a runtime core over HTTP (OpenAI and Anthropic APIs).
    Run(Box<serve::RunArgs>),
    /// Benchmark an OpenAI-compatible endpoint (TTFT, ITL, throughput).
    Bench(flare_bench::BenchArgs),
    /// Load-test an OpenAI-compatible endpoint and check it drains cleanly.
    Load(flare_bench::LoadArgs),
}

/// Why the command failed; each maps to an exit code.
#[derive(Debug, thiserror::Error)]
enum CliError {
    #[error("invalid runtime core: {0}")]
    InvalidCore(#[from] CoreError),
    #[error("{0}")]
    NotServable(&'static str),
    #[error("startup failed: {0}")]
    Startup(String),
    #[error("{0}")]
    Bench(String),
}

impl CliError {
    fn exit_code(&self) -> u8 {
        match self {
            CliError::InvalidCore(_) => 2,
            CliError::NotServable(_) => 3,
            CliError::Startup(_) => 4,
            CliError::Bench(_) => 5,
        }
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, CliError> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| CliError::Startup(e.to_string()))
}

fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Check { core, no_verify_payloads } => {
            let options = OpenOptions { verify_payload_digests: !no_verify_payloads };
            let core = RuntimeCore::open_with(&core, options)?;
            // A closed pipe (`flare check CORE | head`) is not an error worth a panic.
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{} is a valid runtime core", core.root().display());
            let _ = writeln!(out, "{}", Summary(core.manifest()));
            Ok(())
        }
        Command::Run(args) => serve::run(*args),
        Command::Bench(args) => runtime()?.block_on(async {
            let report = flare_bench::run_bench(&args).await.map_err(|e| CliError::Bench(e.to_string()))?;
            if args.json {
                println!("{}", report.to_json().map_err(|e| CliError::Bench(e.to_string()))?);
            } else {
                println!("{report}");
            }
            Ok(())
        }),
        Command::Load(args) => runtime()?.block_on(async {
            let report = flare_bench::run_load(&args).await.map_err(|e| CliError::Bench(e.to_string()))?;
            println!("{report}");
            report.check().map_err(|v| CliError::Bench(format!("load check failed:\n  {}", v.join("\n  "))))
        }),
    }
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("flare: error: {err}");
            ExitCode::from(err.exit_code())
        }
    }
}
