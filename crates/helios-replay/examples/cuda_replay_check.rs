//! Device qualification of the native loader: the fixture core with real PTX kernels that
//! implement its recorded parameter layouts is loaded, every graph is rebuilt and replayed,
//! and the whole arena after each replay is compared bitwise with a CPU emulation of the
//! same nodes. Run once at the recorded base and once relocated; prints JSON (and writes it
//! to `$OUT/cuda_replay_check.json` when `OUT` is set).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::time::Instant;

use helios_contract::fixtures::{Fixture, FixtureSpec};
use helios_contract::model::{Graph, Manifest, NodeOp, ValueKind};
use helios_contract::{RuntimeCore, core::sha256_hex, pb};
use helios_replay::cuda::{DeviceCore, LoadOptions};
use serde_json::json;

const EMBED_PTX: &str = r#"
.version 7.8
.target sm_80
.address_size 64
.visible .entry triton_embed_rmsnorm_0(
    .param .u64 p_in, .param .u64 p_emb, .param .u64 p_norm, .param .u64 p_out,
    .param .u32 p_n, .param .u64 p_s0, .param .u64 p_s1)
.reqntid 128, 1, 1
{
    .reg .pred %p<2>;
    .reg .b32 %r<12>;
    .reg .b64 %rd<12>;
    ld.param.u64 %rd1, [p_in];
    ld.param.u64 %rd2, [p_emb];
    ld.param.u64 %rd3, [p_norm];
    ld.param.u64 %rd4, [p_out];
    ld.param.u32 %r1, [p_n];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %tid.x;
    setp.ge.u32 %p1, %r2, %r1;
    @%p1 bra DONE;
    mul.wide.u32 %rd5, %r2, 4;
    add.s64 %rd6, %rd1, %rd5;
    ld.global.u32 %r4, [%rd6];
    mul.wide.u32 %rd7, %r3, 4;
    add.s64 %rd8, %rd2, %rd7;
    ld.global.u32 %r5, [%rd8];
    ld.global.u32 %r6, [%rd3];
    mul.lo.u32 %r7, %r4, 31;
    add.u32 %r7, %r7, %r5;
    add.u32 %r7, %r7, %r6;
    shl.b32 %r8, %r2, 7;
    add.u32 %r8, %r8, %r3;
    and.b32 %r8, %r8, 1023;
    mul.wide.u32 %rd9, %r8, 4;
    add.s64 %rd10, %rd4, %rd9;
    red.global.add.u32 [%rd10], %r7;
DONE:
    ret;
}
"#;

fn sample_ptx(record_words: u64) -> String {
    format!(
        r#"
.version 7.8
.target sm_80
.address_size 64
.visible .entry triton_sample_tokens_0(.param .u64 p_s, .param .u64 p_rec, .param .u32 p_v)
{{
    .reg .pred %p<3>;
    .reg .b32 %r<12>;
    .reg .b64 %rd<8>;
    ld.param.u64 %rd1, [p_s];
    ld.param.u64 %rd2, [p_rec];
    ld.param.u32 %r1, [p_v];
    mov.u32 %r2, %tid.x;
    setp.ne.u32 %p1, %r2, 0;
    @%p1 bra DONE;
    mov.u32 %r3, %ctaid.x;
    shl.b32 %r4, %r3, 6;
    mov.u32 %r5, 0;
    mov.u32 %r6, 0;
LOOP:
    add.u32 %r7, %r4, %r6;
    mul.wide.u32 %rd3, %r7, 4;
    add.s64 %rd4, %rd1, %rd3;
    ld.global.u32 %r8, [%rd4];
    add.u32 %r5, %r5, %r8;
    add.u32 %r6, %r6, 1;
    setp.lt.u32 %p2, %r6, 64;
    @%p2 bra LOOP;
    rem.u32 %r9, %r5, %r1;
    mul.lo.u32 %r10, %r3, {record_words};
    mul.wide.u32 %rd5, %r10, 4;
    add.s64 %rd6, %rd2, %rd5;
    st.global.u32 [%rd6], %r9;
    st.global.u32 [%rd6+4], %r5;
DONE:
    ret;
}}
"#
    )
}

/// The fixture core with PTX kernels in place of its placeholder images.
fn device_fixture(dir: &std::path::Path) -> RuntimeCore {
    let mut f = Fixture::build(&FixtureSpec::default());
    let record_words = {
        let m = helios_contract::validate(&f.manifest).expect("valid fixture");
        let b = m
            .graphs
            .iter()
            .flat_map(|g| &g.bindings)
            .find(|b| b.value == ValueKind::CompletionRecords)
            .expect("records");
        b.shape[1]
    };
    let images = [EMBED_PTX.as_bytes().to_vec(), sample_ptx(record_words).into_bytes()];
    for (k, image) in f.manifest.kernels.iter_mut().zip(images.iter()) {
        let old = k.file.clone();
        k.file = old.replace(".cubin", ".ptx");
        k.sha256 = sha256_hex(image);
        k.format = pb::ImageFormat::Ptx as i32;
        if let Some(entry) = f.files.iter_mut().find(|(p, _)| *p == old) {
            *entry = (k.file.clone(), image.clone());
        }
    }
    f.write_to(dir).expect("writes");
    RuntimeCore::open(dir).expect("the device fixture is a valid core")
}

fn word(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}
fn u32_at(a: &[u8], at: u64) -> u32 {
    let at = at as usize;
    u32::from_le_bytes(a[at..at + 4].try_into().unwrap())
}
fn put_u32(a: &mut [u8], at: u64, v: u32) {
    let at = at as usize;
    a[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

/// CPU emulation of one graph over an arena image whose base is `base`.
fn emulate(m: &Manifest, g: &Graph, arena: &mut [u8], base: u64, vocab: u32) {
    let addr = |buffer: helios_contract::BufferId, off: u64| m.buffer(buffer).unwrap().offset + off;
    let mut done = vec![false; g.nodes.len()];
    while done.iter().any(|d| !d) {
        for i in 0..g.nodes.len() {
            if done[i] || g.edges.iter().any(|&(from, to)| to == i && !done[from]) {
                continue;
            }
            match &g.nodes[i].op {
                NodeOp::Kernel(k) => {
                    // Pointer words as the device sees them: relocated to `base`.
                    let image = m.kernels.iter().find(|x| x.id == k.kernel).unwrap();
                    let mut p = k.param_bytes.clone();
                    for r in &k.relocations {
                        let at = (image.params[r.param_index as usize].offset + r.byte_offset) as usize;
                        p[at..at + 8].copy_from_slice(&(base + addr(r.buffer, r.buffer_offset)).to_le_bytes());
                    }
                    if image.function_name == "triton_embed_rmsnorm_0" {
                        let (inp, emb, norm, out) =
                            (word(&p, 0) - base, word(&p, 8) - base, word(&p, 16) - base, word(&p, 24) - base);
                        let n = u32::from_le_bytes(p[32..36].try_into().unwrap());
                        let norm0 = u32_at(arena, norm);
                        for t in 0..k.grid.x.min(n) {
                            let x = u32_at(arena, inp + 4 * u64::from(t));
                            for j in 0..k.block.x {
                                let v = x
                                    .wrapping_mul(31)
                                    .wrapping_add(u32_at(arena, emb + 4 * u64::from(j)))
                                    .wrapping_add(norm0);
                                let idx = u64::from((t * 128 + j) & 1023);
                                let cur = u32_at(arena, out + 4 * idx);
                                put_u32(arena, out + 4 * idx, cur.wrapping_add(v));
                            }
                        }
                    } else {
                        let (s, rec) = (word(&p, 0) - base, word(&p, 8) - base);
                        let v = u32::from_le_bytes(p[16..20].try_into().unwrap());
                        assert_eq!(v, vocab);
                        let rw = m
                            .graphs
                            .iter()
                            .flat_map(|g| &g.bindings)
                            .find(|b| b.value == ValueKind::CompletionRecords)
                            .unwrap()
                            .shape[1];
                        for r in 0..u64::from(k.grid.x) {
                            let sum =
                                (0..64).fold(0u32, |acc, q| acc.wrapping_add(u32_at(arena, s + 4 * (r * 64 + q))));
                            put_u32(arena, rec + 4 * r * rw, sum % v);
                            put_u32(arena, rec + 4 * r * rw + 4, sum);
                        }
                    }
                }
                NodeOp::Memset { dst, value, element_size, width, height, pitch } => {
                    let start = addr(dst.buffer, dst.offset);
                    for row in 0..*height {
                        for e in 0..*width {
                            let at = (start + row * pitch + e * u64::from(*element_size)) as usize;
                            let bytes = value.to_le_bytes();
                            arena[at..at + *element_size as usize].copy_from_slice(&bytes[..*element_size as usize]);
                        }
                    }
                }
                NodeOp::Memcpy { src, dst, byte_count } => {
                    let (s, d, n) = (
                        addr(src.buffer, src.offset) as usize,
                        addr(dst.buffer, dst.offset) as usize,
                        *byte_count as usize,
                    );
                    let tmp = arena[s..s + n].to_vec();
                    arena[d..d + n].copy_from_slice(&tmp);
                }
                NodeOp::Empty | NodeOp::EventRecord { .. } | NodeOp::EventWait { .. } => {}
            }
            done[i] = true;
        }
    }
}

fn run(core: &RuntimeCore, force_relocation: bool) -> serde_json::Value {
    let t0 = Instant::now();
    let dev = match DeviceCore::load(core, &LoadOptions { device_ordinal: 0, force_relocation }) {
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
        emulate(&m, g, &mut want, base, m.capacities.vocab_size);
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
        "load_seconds": load_s, "upload_seconds": r.upload_seconds, "build_seconds": r.build_seconds,
        "all_graphs_bitwise_equal": all_equal, "per_graph": results})
}

fn main() {
    let dir = tempfile::tempdir().expect("tempdir");
    let core = device_fixture(dir.path());
    let report = json!({"check": "cuda_replay_check", "fixed_base": run(&core, false), "relocated": run(&core, true)});
    let text = serde_json::to_string_pretty(&report).expect("json");
    println!("{text}");
    if let Ok(out) = std::env::var("OUT") {
        std::fs::write(std::path::Path::new(&out).join("cuda_replay_check.json"), &text).expect("writes report");
    }
    let ok = report["fixed_base"]["all_graphs_bitwise_equal"] == true
        && report["relocated"]["all_graphs_bitwise_equal"] == true;
    std::process::exit(if ok { 0 } else { 1 });
}
