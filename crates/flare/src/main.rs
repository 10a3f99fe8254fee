//! `flare`: the Flare serving executable.
//!
//! - `flare check CORE` validates a runtime core without a GPU and prints its summary.
//! - `flare run [CORE]` serves a core. Until the native worker and CUDA replay land, it
//!   validates the core and explains what serving still needs; it never binds a socket for a
//!   server that cannot answer.

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
    /// Serve a runtime core over HTTP.
    Run {
        /// Directory of a runtime core. Without one, explains how to get one.
        core: Option<PathBuf>,
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        #[arg(long, default_value_t = 8000)]
        port: u16,
    },
}

/// Why the command failed; each maps to an exit code.
#[derive(Debug, thiserror::Error)]
enum CliError {
    #[error("invalid runtime core: {0}")]
    InvalidCore(#[from] CoreError),
    #[error("{0}")]
    NotServable(&'static str),
}

impl CliError {
    fn exit_code(&self) -> u8 {
        match self {
            CliError::InvalidCore(_) => 2,
            CliError::NotServable(_) => 3,
        }
    }
}

const NO_CORE: &str = "flare run needs a runtime core: prepare one with \
`python -m ignition prepare --model DIR --out CORE` on a machine with an NVIDIA GPU, then run \
`flare run CORE`. `flare check CORE` validates a core without a GPU.";

const NO_EXECUTOR: &str = "the core is valid, but this build has no executor to serve it yet: \
native CUDA replay and the HTTP server are not part of this build. No socket was bound.";

fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Check { core, no_verify_payloads } => {
            let options = OpenOptions { verify_payload_digests: !no_verify_payloads };
            let core = RuntimeCore::open_with(&core, options)?;
            println!("{} is a valid runtime core", core.root().display());
            println!("{}", Summary(core.manifest()));
            Ok(())
        }
        Command::Run { core: None, .. } => Err(CliError::NotServable(NO_CORE)),
        Command::Run { core: Some(core), host, port } => {
            eprintln!("flare: validating {} before binding {host}:{port}", core.display());
            let core = RuntimeCore::open(&core)?;
            eprintln!(
                "flare: {} (ABI {}) validated",
                core.manifest().frontend.served_model_name,
                core.manifest().identity.abi_version
            );
            Err(CliError::NotServable(NO_EXECUTOR))
        }
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
