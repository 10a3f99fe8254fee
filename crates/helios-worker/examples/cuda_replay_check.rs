//! Device qualification of the native loader: the fixture core with real PTX kernels that
//! implement its recorded parameter layouts is loaded, every graph is rebuilt and replayed,
//! and the whole arena after each replay is compared bitwise with a CPU emulation of the
//! same nodes. Run once at the recorded base and once relocated; prints JSON (and writes it
//! to `$OUT/cuda_replay_check.json` when `OUT` is set).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::time::Instant;

use helios_contract::RuntimeCore;
use helios_contract::fixtures::FixtureSpec;
use helios_replay::cuda::{DeviceCore, LoadOptions, UploadPath};
use serde_json::json;

#[path = "../../helios-replay/tests/support/device_fixture.rs"]
mod device_fixture;

use device_fixture::{Emulator, PacedReads, device_fixture, emulate};
use helios_replay::graph::GraphExecutor;
use helios_scheduler::{RequestSpec, Scheduler};
use helios_worker::FinishCause;
use helios_worker::drive::LoopDriver;
use helios_worker::workload::{finish, test_config};

/// Drives a workload (shared prefixes, chunked prefill, decode batches, captures) through the
/// serving loop over a graph executor; returns every request's tokens and the steps run.
fn lifecycle<B: helios_replay::graph::GraphBackend>(
    core: &RuntimeCore,
    backend: B,
) -> (Vec<(Vec<u32>, FinishCause)>, u64, f64) {
    let m = core.manifest().clone();
    let executor = GraphExecutor::new(&m, backend).expect("drivable core");
    let config = test_config(4);
    let scheduler = Scheduler::new(m.cache_scheme.clone(), m.capacities.clone(), config).expect("scheduler");
    let vocab = m.capacities.vocab_size;
    let mut d = LoopDriver::new(scheduler, executor, vocab).expect("loop driver");
    for r in 0..12u32 {
        let shared = (r % 3) as usize * 40 + 30;
        let tokens: Vec<u32> =
            (0..shared as u32).map(|i| (i * 5 + 1) % vocab).chain((0..r + 3).map(|i| (i * 11 + r) % vocab)).collect();
        d.submit(RequestSpec::plain(tokens, 20 + r, u64::from(r))).expect("admits");
    }
    let t0 = Instant::now();
    d.drain().expect("executes");
    let secs = t0.elapsed().as_secs_f64();
    let out = d.take_ended().iter().map(|e| (e.output.clone(), finish(e).cause)).collect();
    let scheduler = d.scheduler_mut();
    scheduler.evict_cache();
    assert!(scheduler.all_storage_free());
    (out, scheduler.stats().steps, secs)
}

/// `CUDA_REPLAY_CHECK_UPLOAD=direct` selects the baseline upload path (tells an upload fault from others).
fn upload_path() -> UploadPath {
    match std::env::var("CUDA_REPLAY_CHECK_UPLOAD").as_deref() {
        Ok("direct") => UploadPath::Direct,
        _ => UploadPath::Staged,
    }
}

fn run(core: &RuntimeCore, force_relocation: bool) -> serde_json::Value {
    let t0 = Instant::now();
    let dev = match DeviceCore::load(
        core,
        &LoadOptions { force_relocation, upload: upload_path(), ..LoadOptions::default() },
    ) {
        Ok(d) => d,
        Err(e) => return json!({"force_relocation": force_relocation, "load_error": e.to_string()}),
    };
    let load_s = t0.elapsed().as_secs_f64();
    let m = dev.manifest().clone();
    let base = dev.base();
    let size = m.arena.byte_size as usize;
    let mut results = Vec::new();
    let mut all_equal = true;
    for (gi, g) in m.graphs.iter().enumerate() {
        // A fresh deterministic arena image per graph (payload buffers keep their bytes).
        let mut image: Vec<u8> = (0..size).map(|i| ((i * 131 + gi * 17 + 7) % 251) as u8).collect();
        for b in &m.buffers {
            if let Some(bytes) = core.payload(b.id) {
                image[b.offset as usize..b.offset as usize + bytes.len()].copy_from_slice(bytes);
            }
        }
        dev.write_arena(&image).expect("writes");
        dev.replay(g.id).expect("replays");
        let got = dev.read_arena().expect("reads");
        let mut want = image.clone();
        emulate(&m, g.id, &mut want, base);
        let differing = got.iter().zip(&want).filter(|(a, b)| a != b).count();
        let changed = image.iter().zip(&want).filter(|(a, b)| a != b).count();
        all_equal &= differing == 0;
        // Timing: back-to-back replays (the output is no longer checked).
        let reps = 2000;
        let t = Instant::now();
        let mut enqueue = 0.0;
        for _ in 0..reps {
            let e = Instant::now();
            dev.replay(g.id).expect("replays");
            enqueue += e.elapsed().as_secs_f64();
        }
        dev.synchronize().expect("syncs");
        let per = t.elapsed().as_secs_f64() / f64::from(reps);
        results.push(json!({"graph": g.name, "nodes": g.nodes.len(), "bytes_changed_by_graph": changed,
            "bytes_differing_from_cpu": differing, "replay_us": per * 1e6, "launch_enqueue_us": enqueue / f64::from(reps) * 1e6}));
    }
    let r = dev.report();
    json!({"force_relocation": force_relocation, "recorded_base": format!("{:#x}", r.recorded_base), "base": format!("{base:#x}"),
        "at_recorded_base": base == r.recorded_base, "relocated_words": r.relocated_words, "driver_version": r.driver_version,
        "arena_bytes": r.arena_bytes, "uploaded_bytes": r.uploaded_bytes, "kernels": r.kernels, "graphs": r.graphs, "nodes": r.nodes,
        "programmatic_edges": r.programmatic_edges, "load_seconds": load_s, "upload_seconds": r.upload_seconds, "build_seconds": r.build_seconds,
        "all_graphs_bitwise_equal": all_equal, "per_graph": results})
}

fn main() {
    let dir = tempfile::tempdir().expect("tempdir");
    let core = device_fixture(dir.path(), &FixtureSpec::default());
    let mut report =
        json!({"check": "cuda_replay_check", "fixed_base": run(&core, false), "relocated": run(&core, true)});
    // The scheduler's lifecycle through the graph executor: GPU replay vs the CPU emulation.
    // The fixture's tokens depend on the batch, so the comparison paces the device's records
    // reads like the emulation's (same schedule, step for step); the free-running device run
    // (its reads land when they land) is reported beside it, checked for completion only.
    let mut reference = Emulator::new(&core);
    reference.deferred = true;
    let (cpu, cpu_steps, _) = lifecycle(&core, reference);
    let options = LoadOptions { upload: upload_path(), ..LoadOptions::default() };
    // One device core at a time: each run loads its own (at the recorded base) and drops it.
    let paced = DeviceCore::load(&core, &options).map(|dev| lifecycle(&core, PacedReads::new(dev)));
    let free = DeviceCore::load(&core, &options).map(|dev| lifecycle(&core, dev));
    let lifecycle_report = match (paced, free) {
        (Ok((gpu, steps, secs)), Ok((free_out, free_steps, free_secs))) => {
            let lengths = |o: &[(Vec<u32>, FinishCause)]| o.iter().map(|(t, r)| (t.len(), *r)).collect::<Vec<_>>();
            json!({"requests": gpu.len(), "steps": steps, "cpu_steps": cpu_steps, "tokens": gpu.iter().map(|(o, _)| o.len()).sum::<usize>(),
                "identical_to_cpu_emulation": gpu == cpu && steps == cpu_steps, "seconds": secs, "us_per_step": secs / steps as f64 * 1e6,
                "free_running": {"steps": free_steps, "seconds": free_secs, "us_per_step": free_secs / free_steps as f64 * 1e6,
                    "every_request_completed_as_emulated": lengths(&free_out) == lengths(&cpu)}})
        }
        (Err(e), _) | (_, Err(e)) => json!({"load_error": e.to_string()}),
    };
    report["lifecycle"] = lifecycle_report;
    let text = serde_json::to_string_pretty(&report).expect("json");
    println!("{text}");
    if let Ok(out) = std::env::var("OUT") {
        std::fs::write(std::path::Path::new(&out).join("cuda_replay_check.json"), &text).expect("writes report");
    }
    let ok = report["fixed_base"]["all_graphs_bitwise_equal"] == true
        && report["relocated"]["all_graphs_bitwise_equal"] == true
        && report["lifecycle"]["identical_to_cpu_emulation"] == true;
    std::process::exit(if ok { 0 } else { 1 });
}
