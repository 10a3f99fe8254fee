//! The lifecycle scenarios on a real core: an agent-like workload (conversations with message
//! endpoints, appended turns, branches from endpoints, a cancel, page pressure with preemption)
//! runs through the serving loop over `GraphExecutor<DeviceCore>`, then every request is run
//! again alone on the same device (one slot, nothing cached) and the tokens are compared.
//!
//! `core_workload CORE [--pages N] [--max-output N] [--relocate] [--host-mib N [--disk-dir DIR]]`:
//! `--pages` caps the scheduler's page pool below the core's (pressure: checkpoint eviction);
//! `--max-output` gives every request that output budget (long outputs in a small pool run short
//! of pages mid-decode: preemption and readmission); `--host-mib` adds a host
//! tier of that size (evicted checkpoints restored from host memory, through the device's
//! copies), `--disk-dir` a disk tier below it. Prints JSON; exits 1 on an error.
//!
//! Identical tokens are expected where the plan is deterministic; a prefix hit or a different
//! chunking recomputes nothing bitwise-shared, so a near-tie may legitimately sample otherwise:
//! the report lists where each differing request first diverged.
#![allow(clippy::print_stdout)]

use std::process::ExitCode;
use std::time::Instant;

use helios_contract::RuntimeCore;
use helios_replay::cuda::{DeviceCore, LoadOptions};
use helios_replay::graph::GraphExecutor;
use helios_worker::FinishCause;
use helios_worker::workload::{Tiers, device_scenario, finish, run_alone_on, run_workload_tiered, with_max_output};
use serde_json::json;

fn run(
    core: &str,
    pages: Option<u32>,
    max_output: Option<u16>,
    relocate: bool,
    tiers: &Tiers,
) -> Result<serde_json::Value, String> {
    let core = RuntimeCore::open(core).map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    let dev = DeviceCore::load(&core, &LoadOptions { force_relocation: relocate, ..LoadOptions::default() })
        .map_err(|e| e.to_string())?;
    let load_s = t0.elapsed().as_secs_f64();
    let m = dev.manifest().clone();
    let mut caps = m.capacities.clone();
    if let Some(p) = pages {
        caps.max_kv_pages = p.min(caps.max_kv_pages);
    }
    let scheme = m.cache_scheme.clone();
    let eos = m.frontend.eos_token_ids.clone();
    let mut executor = GraphExecutor::new(&m, dev).map_err(|e| e.to_string())?;
    let slots = caps.request_slots.max(1);
    let t1 = Instant::now();
    let actions = max_output.map_or_else(device_scenario, |n| with_max_output(&device_scenario(), n));
    let report =
        run_workload_tiered(&mut executor, &scheme, &caps, slots, &eos, tiers, &actions).map_err(|e| e.to_string())?;
    let workload_s = t1.elapsed().as_secs_f64();
    let mut identical = 0usize;
    let mut compared = 0usize;
    let mut differing = Vec::new();
    let mut unexplained = 0usize;
    let (mut preempted, mut restored_whole) = (0usize, 0usize);
    for (spec, done) in &report.finished {
        let alone = run_alone_on(&mut executor, &scheme, &caps, spec).map_err(|e| e.to_string())?;
        let info = finish(done);
        preempted += usize::from(info.preemptions > 0);
        restored_whole += usize::from(info.preemptions > 0 && info.recomputed_tokens == 0);
        let partial = matches!(info.cause, FinishCause::Cancelled | FinishCause::PoolExhausted);
        let same = if partial { alone.starts_with(&done.output) } else { alone == done.output };
        compared += 1;
        if same {
            identical += 1;
        } else {
            let at =
                done.output.iter().zip(&alone).position(|(a, b)| a != b).unwrap_or(done.output.len().min(alone.len()));
            // A prefix hit or history recomputed after a preemption ran through other graphs
            // than the solo run (prefill where it decoded), which round differently.
            unexplained += usize::from(info.cached_tokens == 0 && info.recomputed_tokens == 0);
            differing.push(json!({"prompt_tokens": spec.tokens.len(), "cached_tokens": info.cached_tokens,
                                  "preemptions": info.preemptions, "recomputed_tokens": info.recomputed_tokens,
                                  "reason": info.cause.as_str(), "first_difference": at,
                                  "tokens": done.output.len(), "alone_tokens": alone.len()}));
        }
    }
    Ok(json!({
        "load_s": load_s, "workload_s": workload_s, "requests": report.finished.len(), "turns": report.turns,
        "preemptions": report.preemptions, "captures": report.captures, "evictions": report.evictions,
        "prefix_hit_tokens": report.finished.iter().map(|(_, d)| u64::from(finish(d).cached_tokens)).sum::<u64>(),
        "cancelled": report.finished.iter().filter(|(_, d)| finish(d).cause == FinishCause::Cancelled).count(),
        "compared": compared, "identical_to_solo_run": identical, "differing": differing,
        "differing_without_prefix_hit_or_recompute": unexplained,
        "preempted_requests": preempted, "restored_whole_after_preemption": restored_whole,
        "pages": caps.max_kv_pages, "max_output": max_output, "relocated": relocate,
        "host_tier_bytes": tiers.host_bytes, "demotions": report.demotions, "host_restores": report.host_restores,
        "disk_writes": report.disk_writes, "disk_fetches": report.disk_fetches,
    }))
}

fn main() -> ExitCode {
    let mut core = None;
    let mut pages = None;
    let mut max_output = None;
    let mut relocate = false;
    let mut tiers = Tiers::default();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--pages" => match args.next().and_then(|n| n.parse().ok()) {
                Some(n) => pages = Some(n),
                None => {
                    eprintln!("--pages needs a number");
                    return ExitCode::FAILURE;
                }
            },
            "--max-output" => match args.next().and_then(|n| n.parse().ok()) {
                Some(n) => max_output = Some(n),
                None => {
                    eprintln!("--max-output needs a number of tokens (at most 65535)");
                    return ExitCode::FAILURE;
                }
            },
            "--relocate" => relocate = true,
            "--host-mib" => tiers.host_bytes = args.next().and_then(|n| n.parse::<u64>().ok()).map(|n| n << 20),
            "--disk-dir" => tiers.disk = args.next().map(|d| (std::path::PathBuf::from(d), 64 << 30)),
            _ if core.is_none() && !a.starts_with("--") => core = Some(a),
            other => {
                eprintln!(
                    "unknown argument {other}; usage: core_workload CORE [--pages N] [--max-output N] [--relocate] [--host-mib N [--disk-dir DIR]]"
                );
                return ExitCode::FAILURE;
            }
        }
    }
    let Some(core) = core else {
        eprintln!(
            "usage: core_workload CORE [--pages N] [--max-output N] [--relocate] [--host-mib N [--disk-dir DIR]]"
        );
        return ExitCode::FAILURE;
    };
    if tiers.disk.is_some() && tiers.host_bytes.is_none() {
        eprintln!("--disk-dir needs --host-mib: the disk tier stages through host memory");
        return ExitCode::FAILURE;
    }
    match run(&core, pages, max_output, relocate, &tiers) {
        Ok(report) => {
            println!("{report}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("core_workload: {e}");
            ExitCode::FAILURE
        }
    }
}
