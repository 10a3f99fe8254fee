//! Replays one graph of a runtime core natively, with no Python:
//! `core_replay CORE --graph NAME [--write BUFFER=FILE]... [--read BUFFER=FILE]... [--repeat N] [--relocate]`.
//! Writes raw bytes into named buffers, replays once, writes the named buffers' bytes to
//! files, then times N more replays. Prints a JSON report; exits 1 on any error.
#![allow(clippy::print_stdout)]

use std::process::ExitCode;
use std::time::Instant;

use helios_contract::RuntimeCore;
use helios_replay::cuda::{DeviceCore, LoadOptions};
use serde_json::json;

#[derive(Debug, Default)]
struct Args {
    core: String,
    graph: String,
    writes: Vec<(String, String)>,
    reads: Vec<(String, String)>,
    repeat: u32,
    relocate: bool,
}

fn parse() -> Result<Args, String> {
    let mut a = Args::default();
    let mut it = std::env::args().skip(1);
    let pair = |v: Option<String>, flag: &str| -> Result<(String, String), String> {
        let v = v.ok_or(format!("{flag} needs BUFFER=FILE"))?;
        let (b, f) = v.split_once('=').ok_or(format!("{flag} {v}: expected BUFFER=FILE"))?;
        Ok((b.to_owned(), f.to_owned()))
    };
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--graph" => a.graph = it.next().ok_or("--graph needs a name")?,
            "--write" => a.writes.push(pair(it.next(), "--write")?),
            "--read" => a.reads.push(pair(it.next(), "--read")?),
            "--repeat" => {
                a.repeat = it.next().and_then(|n| n.parse().ok()).ok_or("--repeat needs a number")?;
            }
            "--relocate" => a.relocate = true,
            _ if a.core.is_empty() && !arg.starts_with("--") => a.core = arg,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if a.core.is_empty() || a.graph.is_empty() {
        return Err("usage: core_replay CORE --graph NAME [--write B=F]... [--read B=F]... [--repeat N]".into());
    }
    Ok(a)
}

fn run(a: &Args) -> Result<serde_json::Value, String> {
    let t0 = Instant::now();
    let core = RuntimeCore::open(&a.core).map_err(|e| e.to_string())?;
    let dev = DeviceCore::load(&core, &LoadOptions { force_relocation: a.relocate, ..LoadOptions::default() })
        .map_err(|e| e.to_string())?;
    let load_s = t0.elapsed().as_secs_f64();
    let m = dev.manifest();
    let graph = m.graphs.iter().find(|g| g.name == a.graph).ok_or(format!("no graph named {}", a.graph))?.id;
    let buffer =
        |name: &str| m.buffers.iter().find(|b| b.name == name).map(|b| b.id).ok_or(format!("no buffer named {name}"));
    for (b, f) in &a.writes {
        let bytes = std::fs::read(f).map_err(|e| format!("{f}: {e}"))?;
        dev.write(buffer(b)?, 0, &bytes).map_err(|e| e.to_string())?;
    }
    dev.replay(graph).map_err(|e| e.to_string())?;
    dev.synchronize().map_err(|e| e.to_string())?;
    for (b, f) in &a.reads {
        let id = buffer(b)?;
        let size = m.buffer(id).map_or(0, |x| x.byte_size);
        let bytes = dev.read(id, 0, size).map_err(|e| e.to_string())?;
        std::fs::write(f, bytes).map_err(|e| format!("{f}: {e}"))?;
    }
    let t = Instant::now();
    for _ in 0..a.repeat {
        dev.replay(graph).map_err(|e| e.to_string())?;
    }
    dev.synchronize().map_err(|e| e.to_string())?;
    let per = if a.repeat > 0 { t.elapsed().as_secs_f64() / f64::from(a.repeat) * 1e6 } else { 0.0 };
    let r = dev.report();
    Ok(
        json!({"core": a.core, "graph": a.graph, "base": format!("{:#x}", r.base), "recorded_base": format!("{:#x}", r.recorded_base),
        "at_recorded_base": r.base == r.recorded_base, "relocated_words": r.relocated_words, "kernels": r.kernels,
        "graphs": r.graphs, "nodes": r.nodes, "programmatic_edges": r.programmatic_edges, "uploaded_bytes": r.uploaded_bytes, "load_seconds": load_s,
        "replays_timed": a.repeat, "replay_us": per}),
    )
}

fn main() -> ExitCode {
    match parse().and_then(|a| run(&a)) {
        Ok(report) => {
            println!("{report}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("core_replay: {e}");
            println!("{}", json!({"error": e}));
            ExitCode::FAILURE
        }
    }
}
