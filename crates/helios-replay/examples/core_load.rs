//! Load bench: `core_load CORE [--rounds N]`. Opens the core once (digests checked once), then
//! loads it onto the GPU `N` times for each upload path, alternating (a warm-up load first, so
//! both paths read a warm page cache), and prints a JSON report: per-path upload seconds and
//! GiB/s (median), the staged path's speed-up over the direct baseline measured in the same run,
//! and a check that both paths leave identical arena bytes. Exits 1 on any error.
#![allow(clippy::print_stdout)]

use std::process::ExitCode;

use helios_contract::RuntimeCore;
use helios_contract::model::Payload;
use helios_replay::cuda::{DeviceCore, LoadOptions, UploadPath};
use serde_json::json;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Bytes of every payload-carrying buffer, read back from the device (what the upload wrote).
fn payload_bytes(dev: &DeviceCore) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    for b in &dev.manifest().buffers {
        if matches!(b.payload, Payload::Safetensors { .. } | Payload::ZeroFill) {
            out.extend(dev.read(b.id, 0, b.byte_size).map_err(|e| e.to_string())?);
        }
    }
    Ok(out)
}

fn run(path: &str, rounds: usize) -> Result<serde_json::Value, String> {
    let core = RuntimeCore::open(path).map_err(|e| e.to_string())?;
    let load = |upload| DeviceCore::load(&core, &LoadOptions { upload, ..LoadOptions::default() });
    let warm = load(UploadPath::Direct).map_err(|e| e.to_string())?;
    let uploaded = warm.report().uploaded_bytes;
    let direct_image = payload_bytes(&warm)?;
    drop(warm);
    let (mut direct, mut staged) = (Vec::new(), Vec::new());
    let mut identical = true;
    for round in 0..rounds {
        for upload in [UploadPath::Direct, UploadPath::Staged] {
            let dev = load(upload).map_err(|e| e.to_string())?;
            let s = dev.report().upload_seconds;
            if upload == UploadPath::Direct {
                direct.push(s)
            } else {
                staged.push(s)
            }
            if round == 0 && upload == UploadPath::Staged {
                identical = payload_bytes(&dev)? == direct_image;
            }
        }
    }
    let gib = uploaded as f64 / (1u64 << 30) as f64;
    let (d, s) = (median(direct.clone()), median(staged.clone()));
    Ok(json!({
        "core": path,
        "uploaded_bytes": uploaded,
        "rounds": rounds,
        "direct_upload_s": direct,
        "staged_upload_s": staged,
        "direct_median_s": d,
        "staged_median_s": s,
        "direct_gib_per_s": gib / d.max(1e-9),
        "staged_gib_per_s": gib / s.max(1e-9),
        "staged_speedup_over_direct": d / s.max(1e-9),
        "arena_payloads_identical": identical,
    }))
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let (mut core, mut rounds) = (None, 5usize);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--rounds" => match args.next().and_then(|n| n.parse().ok()) {
                Some(n) if n > 0 => rounds = n,
                _ => {
                    eprintln!("--rounds needs a positive number");
                    return ExitCode::FAILURE;
                }
            },
            _ if core.is_none() && !a.starts_with("--") => core = Some(a),
            other => {
                eprintln!("unknown argument {other}; usage: core_load CORE [--rounds N]");
                return ExitCode::FAILURE;
            }
        }
    }
    let Some(core) = core else {
        eprintln!("usage: core_load CORE [--rounds N]");
        return ExitCode::FAILURE;
    };
    match run(&core, rounds) {
        Ok(report) => {
            println!("{report:#}");
            if report["arena_payloads_identical"] == true { ExitCode::SUCCESS } else { ExitCode::FAILURE }
        }
        Err(e) => {
            eprintln!("core_load: {e}");
            ExitCode::FAILURE
        }
    }
}
