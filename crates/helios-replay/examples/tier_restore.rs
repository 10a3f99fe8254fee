//! The checkpoint tiers on a real core, measured against their baselines in the same run:
//!
//! - restore from host memory and from disk against recomputing the same prefix (prefill);
//! - demotion (GPU → host) and disk write rates;
//! - the disk tier's read rate against a raw io_uring read of a file of the same size;
//! - decode step times of running requests before and while a restore runs (interference).
//!
//! `tier_restore CORE [--tokens 4096,32768] [--disk-dir DIR] [--decoders 4]` prints JSON;
//! `tier_restore --sim …` runs the same flow over the simulated executor (a dry run of the
//! harness on a machine without a GPU; its times mean nothing).
//! Steps run one at a time (submit, then synchronize), so each step's wall time is its device
//! time plus the host's planning: decode step times are the inter-token latency of a batch.
//! (A measurement harness, not a serving loop: the serving loop pipelines steps, which would
//! hide the per-step times measured here.)
#![allow(clippy::print_stdout)]

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use helios_contract::RuntimeCore;
use helios_contract::model::{CacheScheme, Capacities};
use helios_offload::{DiskIdentity, DiskIo, DiskTier, HostArena, StoreGeometry};
use helios_replay::cuda::{DeviceCore, LoadOptions};
use helios_replay::graph::GraphExecutor;
use helios_replay::{Executor, StepInputs};
use helios_scheduler::{RequestSpec, Scheduler, SchedulerConfig, StepOp};
use serde_json::json;

fn spec(tokens: Vec<u32>, max_output: u32, seed: u64) -> RequestSpec {
    RequestSpec::plain(tokens, max_output, seed)
}

fn prompt(len: usize, salt: u64, vocab: u32) -> Vec<u32> {
    (0..len as u64).map(|i| ((i * 2_654_435_761 + salt * 97) % u64::from(vocab.max(2) - 1)) as u32 + 1).collect()
}

/// One step, synchronously: (whether one ran, its wall time, whether it copied in/out).
fn step<E: Executor + ?Sized>(s: &mut Scheduler, e: &mut E) -> Result<Option<(Duration, bool, bool)>, String> {
    let Some(st) = s.schedule() else {
        if s.disk_busy() {
            s.wait_disk(Duration::from_millis(50));
            return Ok(Some((Duration::ZERO, false, false)));
        }
        return Ok(None);
    };
    let copy_in = st.ops.iter().any(|op| matches!(op, StepOp::CopyIn { .. }));
    let copy_out = st.ops.iter().any(|op| matches!(op, StepOp::CopyOut { .. }));
    let t = Instant::now();
    e.submit(&st, &StepInputs::default()).map_err(|x| x.to_string())?;
    let done = e.synchronize().map_err(|x| x.to_string())?;
    let took = t.elapsed();
    for c in &done {
        s.complete(c);
    }
    Ok(Some((took, copy_in, copy_out)))
}

/// Steps until idle; returns the total wall time.
fn drain<E: Executor + ?Sized>(s: &mut Scheduler, e: &mut E) -> Result<Duration, String> {
    let t = Instant::now();
    while !s.is_idle() {
        if step(s, e)?.is_none() {
            break;
        }
    }
    Ok(t.elapsed())
}

fn percentile(mut v: Vec<f64>, p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Reads `path` (`bytes` long) with io_uring, O_DIRECT, 1 MiB blocks, 32 in flight: GB/s.
fn raw_read(path: &std::path::Path, bytes: u64) -> Result<f64, String> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    const BLOCK: u64 = 1 << 20;
    let file =
        std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path).map_err(|e| e.to_string())?;
    let buf = HostArena::new(32 * BLOCK).map_err(|e| e.to_string())?;
    let mut ring = io_uring::IoUring::new(64).map_err(|e| e.to_string())?;
    let blocks = bytes.div_ceil(BLOCK);
    let t = Instant::now();
    let (mut next, mut done) = (0u64, 0u64);
    while done < blocks {
        while next < blocks && next - done < 32 {
            // SAFETY: slot `next % 32` of the buffer is not in flight (at most 32 are).
            let p = unsafe { buf.as_ptr().add(((next % 32) * BLOCK) as usize) };
            let e = io_uring::opcode::Read::new(io_uring::types::Fd(file.as_raw_fd()), p, BLOCK as u32)
                .offset(next * BLOCK)
                .build()
                .user_data(next);
            // SAFETY: the buffer outlives the ring's use of it.
            unsafe { ring.submission().push(&e) }.map_err(|e| e.to_string())?;
            next += 1;
        }
        ring.submit_and_wait(1).map_err(|e| e.to_string())?;
        for c in ring.completion() {
            if c.result() < 0 {
                return Err(std::io::Error::from_raw_os_error(-c.result()).to_string());
            }
            done += 1;
        }
    }
    Ok(bytes as f64 / t.elapsed().as_secs_f64() / 1e9)
}

/// The executor and its storage geometry: a core on the device, or the simulated executor.
fn executor(core: Option<&RuntimeCore>) -> Result<(Box<dyn Executor>, CacheScheme, Capacities), String> {
    match core {
        Some(core) => {
            let dev = DeviceCore::load(core, &LoadOptions::default()).map_err(|e| e.to_string())?;
            let m = dev.manifest().clone();
            let e = GraphExecutor::new(&m, dev).map_err(|x| x.to_string())?;
            Ok((Box::new(e), m.cache_scheme.clone(), m.capacities.clone()))
        }
        None => {
            let scheme = helios_replay::reference_schemes().remove(0);
            let caps = Capacities {
                context_limit: 40_000,
                max_kv_pages: 4096,
                request_slots: 8,
                snapshot_rows: 16,
                ..helios_replay::test_capacities(8, 4096, 16)
            };
            Ok((Box::new(helios_replay::SimulatedExecutor::new(&scheme, &caps)), scheme, caps))
        }
    }
}

fn measure(
    core: Option<&RuntimeCore>,
    tokens: usize,
    disk_dir: Option<&std::path::Path>,
    decoders: usize,
) -> Result<serde_json::Value, String> {
    let (mut boxed, scheme, caps) = executor(core)?;
    let e: &mut dyn Executor = boxed.as_mut();
    let tokens = tokens.min(caps.context_limit as usize - 2);
    let vocab = caps.vocab_size;
    let geometry = StoreGeometry::from(&scheme);
    let image_bytes = scheme.pages_for(tokens as u64) * geometry.bytes_per_page + geometry.continuation_row_bytes;
    // What an image takes in extents and file blocks (whole 4 KiB units each).
    let span = |len: u64| len.div_ceil(helios_offload::UNIT_BYTES).max(1) * helios_offload::UNIT_BYTES;
    let image_span =
        scheme.pages_for(tokens as u64) * span(geometry.bytes_per_page) + span(geometry.continuation_row_bytes);
    let host_bytes = 3 * image_span + (64 << 20);
    let arena = Arc::new(HostArena::new(host_bytes).map_err(|x| x.to_string())?);
    e.attach_host_arena(arena.clone(), geometry).map_err(|x| x.to_string())?;
    let slots = caps.request_slots.max(1);
    let config = SchedulerConfig {
        max_concurrency: slots,
        queue_limit: 64,
        identity: helios_cache::PrefixIdentity { model: 1, token_layout: 1 },
        device_fed_decode: false,
        speculative_depth: 0,
    };
    let mut s =
        Scheduler::new(scheme.clone(), caps.clone(), config).map_err(|x| x.to_string())?.with_host_tier(host_bytes);
    let mut disk_info = None;
    if let Some(dir) = disk_dir {
        let dir = dir.join(format!("tier_restore_{tokens}"));
        let _ = std::fs::remove_dir_all(&dir);
        let identity = DiskIdentity { fingerprint: [0x42; 32], geometry };
        let (tier, _) = DiskTier::open(&dir, identity, 8 * image_span + (64 << 20)).map_err(|x| x.to_string())?;
        let io = DiskIo::start(arena.clone()).map_err(|x| x.to_string())?;
        disk_info = Some((dir, io.backend()));
        s = s.with_disk_tier(tier, io, identity);
    }
    let long = prompt(tokens, 1, vocab);
    // Recompute: the prompt on an empty cache (prefill and one sample).
    s.submit(spec(long.clone(), 1, 1)).map_err(|x| format!("{x:?}"))?;
    let recompute = drain(&mut s, e)?;
    let first = s.take_finished().pop().ok_or("no result")?;
    // Demote it (GPU → host): the step that copies it out.
    s.evict_cache();
    let (demote, _, _) = step(&mut s, e)?.ok_or("no copy-out step")?;
    // Host restore: the same prompt again, a full hit restored from host memory.
    s.submit(spec(long.clone(), 1, 1)).map_err(|x| format!("{x:?}"))?;
    let host_total = drain(&mut s, e)?;
    let again = s.take_finished().pop().ok_or("no result")?;
    let restored = s.take_restored();
    let copied = restored.iter().map(|r| r.copied_tokens).sum::<u64>();
    let mut out = json!({
        "tokens": tokens, "image_bytes": image_bytes,
        "recompute_ms": recompute.as_secs_f64() * 1e3,
        "demote_step_ms": demote.as_secs_f64() * 1e3,
        "demote_gb_per_s": image_bytes as f64 / demote.as_secs_f64() / 1e9,
        "host_restore_ttft_ms": host_total.as_secs_f64() * 1e3,
        "host_restore_gb_per_s": image_bytes as f64 / host_total.as_secs_f64() / 1e9,
        "host_restore_vs_recompute": recompute.as_secs_f64() / host_total.as_secs_f64(),
        "host_restored_tokens": copied, "cached_tokens": again.cached_tokens,
        "same_token": first.output == again.output,
    });
    if let Some((dir, backend)) = disk_info {
        // Write it to disk, drop the GPU and host copies, and restore from disk.
        s.evict_cache();
        step(&mut s, e)?;
        let t = Instant::now();
        let left = s.flush_disk(Duration::from_secs(300));
        let write = t.elapsed();
        s.clear_host_tier();
        s.submit(spec(long.clone(), 1, 1)).map_err(|x| format!("{x:?}"))?;
        let disk_total = drain(&mut s, e)?;
        let third = s.take_finished().pop().ok_or("no result")?;
        let fetch = s.take_disk_fetches().into_iter().map(|d| d.as_secs_f64()).sum::<f64>();
        let file = std::fs::read_dir(&dir)
            .map_err(|x| x.to_string())?
            .filter_map(Result::ok)
            .map(|f| f.path())
            .max_by_key(|p| std::fs::metadata(p).map_or(0, |m| m.len()))
            .ok_or("no disk file")?;
        let file_bytes = std::fs::metadata(&file).map_err(|x| x.to_string())?.len();
        let raw = raw_read(&file, file_bytes)?;
        let tier_read = file_bytes as f64 / fetch.max(1e-9) / 1e9;
        out["disk"] = json!({
            "io": backend, "unwritten": left, "file_bytes": file_bytes,
            "write_ms": write.as_secs_f64() * 1e3, "write_gb_per_s": file_bytes as f64 / write.as_secs_f64() / 1e9,
            "fetch_ms": fetch * 1e3, "fetch_gb_per_s": tier_read,
            "raw_io_uring_gb_per_s": raw, "fetch_vs_raw": tier_read / raw,
            "disk_restore_ttft_ms": disk_total.as_secs_f64() * 1e3,
            "disk_restore_vs_recompute": recompute.as_secs_f64() / disk_total.as_secs_f64(),
            "cached_tokens": third.cached_tokens, "same_token": third.output == first.output,
        });
    }
    // Interference: decoders running while the long prefix is demoted, then restored. One
    // slot stays free for the restoring request.
    let decoders = decoders.min(caps.request_slots.saturating_sub(1) as usize);
    if decoders > 0 {
        for d in 0..decoders {
            s.submit(spec(prompt(64, 100 + d as u64, vocab), 4096, d as u64)).map_err(|x| format!("{x:?}"))?;
        }
        let mut before = Vec::new();
        while before.len() < 64 {
            let Some((t, _, _)) = step(&mut s, e)? else { break };
            before.push(t.as_secs_f64() * 1e3);
        }
        // The host copy goes first, so the long prefix is copied out again while they decode.
        s.clear_host_tier();
        s.evict_cache();
        let (during_demote, _, out_step) = step(&mut s, e)?.ok_or("no step")?;
        s.submit(spec(long.clone(), 1, 7)).map_err(|x| format!("{x:?}"))?;
        let mut during = Vec::new();
        let mut restore_steps = 0;
        for _ in 0..400 {
            let Some((t, copy_in, _)) = step(&mut s, e)? else { break };
            if copy_in {
                restore_steps += 1;
                during.push(t.as_secs_f64() * 1e3);
            } else if restore_steps > 0 && !s.take_restored().is_empty() {
                break;
            }
        }
        out["interference"] = json!({
            "decoders": decoders,
            "step_ms_p50_before": percentile(before.clone(), 0.5), "step_ms_p99_before": percentile(before, 0.99),
            "demotion_step_ms": during_demote.as_secs_f64() * 1e3, "demotion_in_step": out_step,
            "restore_steps": restore_steps,
            "step_ms_p50_during_restore": percentile(during.clone(), 0.5),
            "step_ms_p99_during_restore": percentile(during, 0.99),
        });
    }
    Ok(out)
}

fn main() -> ExitCode {
    let mut core = None;
    let mut sim = false;
    let mut tokens = vec![4096usize, 32768];
    let mut disk = None;
    let mut decoders = 4usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--tokens" => tokens = args.next().unwrap_or_default().split(',').filter_map(|t| t.parse().ok()).collect(),
            "--disk-dir" => disk = args.next().map(std::path::PathBuf::from),
            "--decoders" => decoders = args.next().and_then(|n| n.parse().ok()).unwrap_or(4),
            "--sim" => sim = true,
            _ => core = Some(a),
        }
    }
    let core = match (core, sim) {
        (_, true) => None,
        (Some(core), false) => match RuntimeCore::open(&core) {
            Ok(c) => Some(c),
            Err(e) => {
                eprintln!("{e}");
                return ExitCode::FAILURE;
            }
        },
        (None, false) => {
            eprintln!("usage: tier_restore CORE|--sim [--tokens 4096,32768] [--disk-dir DIR] [--decoders N]");
            return ExitCode::from(2);
        }
    };
    let mut results = Vec::new();
    for n in tokens {
        match measure(core.as_ref(), n, disk.as_deref(), decoders) {
            Ok(r) => results.push(r),
            Err(e) => results.push(json!({"tokens": n, "error": e})),
        }
    }
    println!("{}", serde_json::to_string_pretty(&json!({ "tiers": results })).unwrap_or_default());
    ExitCode::SUCCESS
}
