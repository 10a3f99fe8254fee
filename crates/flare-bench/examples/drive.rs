//! Runs the drivers without the `flare` binary:
//! `cargo run -p flare-bench --example drive -- bench --url http://127.0.0.1:8000` or `... -- load`.

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser, Debug)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Latency and throughput workloads.
    Bench(flare_bench::BenchArgs),
    /// Concurrent load test plus audit.
    Load(flare_bench::LoadArgs),
}

#[tokio::main]
async fn main() -> ExitCode {
    match Cli::parse().cmd {
        Cmd::Bench(args) => match flare_bench::run_bench(&args).await {
            Ok(r) if args.json => match r.to_json() {
                Ok(j) => {
                    println!("{j}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("{e}");
                    ExitCode::FAILURE
                }
            },
            Ok(r) => {
                print!("{r}");
                if r.failed_requests() == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE }
            }
            Err(e) => {
                eprintln!("bench: {e}");
                ExitCode::FAILURE
            }
        },
        Cmd::Load(args) => match flare_bench::run_load(&args).await {
            Ok(r) => {
                if args.json {
                    match r.to_json() {
                        Ok(j) => println!("{j}"),
                        Err(e) => eprintln!("{e}"),
                    }
                } else {
                    print!("{r}");
                }
                if r.check().is_ok() { ExitCode::SUCCESS } else { ExitCode::FAILURE }
            }
            Err(e) => {
                eprintln!("load: {e}");
                ExitCode::FAILURE
            }
        },
    }
}
