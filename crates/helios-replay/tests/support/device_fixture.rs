//! The fixture core made executable: PTX kernels implementing its two recorded parameter
//! layouts, and a CPU emulation of the same graphs over a host arena. Shared by the CPU
//! executor test and the device qualification example.
//!
//! Speculative graphs are emulated only: after their nodes run, [`emulate`] rewrites their
//! records with a toy verifier ([`toy_next`]), and the PTX sampler writes records of the
//! first graph's width, which is not theirs.
//!
//! Checkpoint stamps (`FixtureSpec::checkpoint_stamps`) are emulated only too: the stamped
//! maintenance graphs copy nothing themselves, [`emulate`] performs their checked copy and
//! writes their status record, and keeps each live row's consumed count in its stamp as the
//! consuming graphs of a stamped core do (prefill: start + query length; decode: one more;
//! verify: start + emitted tokens).
#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::expect_used)]

use helios_contract::fixtures::{Fixture, FixtureSpec};
use helios_contract::model::{
    BufferId, BufferRole, Graph, GraphId, GraphKind, MaintenanceOp, Manifest, NodeOp, Payload, RowRegionKind, ValueKind,
};
use helios_contract::record::{FLAG_CHECKPOINT_REJECTED, FLAG_EOS, FLAG_SAMPLED, RECORD_MAGIC};
use helios_contract::{RuntimeCore, core::sha256_hex, pb};
use helios_replay::ExecutorError;
use helios_replay::graph::GraphBackend;

/// `out[(t*128 + j) % 1024] += in[t]*31 + emb[j] + norm[0]` for block t < n, thread j (atomic).
pub const EMBED_PTX: &str = r#"
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

/// Block r, thread 0: `sum = Σ scratch[r*64 .. r*64+64]`; writes a completion record
/// (helios_contract::record) with one token `sum % vocab`, the magic word last.
pub fn sample_ptx(record_words: u64, header_words: u64) -> String {
    let token_offset = header_words * 4;
    format!(
        r#"
.version 7.8
.target sm_80
.address_size 64
.visible .entry triton_sample_tokens_0(.param .u64 p_s, .param .u64 p_rec, .param .u32 p_v)
{{
    .reg .pred %p<3>;
    .reg .b32 %r<16>;
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
    mov.u32 %r11, {flags};
    mov.u32 %r12, 1;
    mov.u32 %r13, {magic};
    st.global.u32 [%rd6+4], %r3;
    st.global.u32 [%rd6+8], %r11;
    st.global.u32 [%rd6+12], %r12;
    st.global.u32 [%rd6+{token_offset}], %r9;
    membar.gl;
    st.global.u32 [%rd6], %r13;
DONE:
    ret;
}}
"#,
        flags = FLAG_SAMPLED,
        magic = RECORD_MAGIC,
    )
}

pub fn record_words(m: &Manifest) -> u64 {
    m.graphs
        .iter()
        .flat_map(|g| &g.bindings)
        .find(|b| b.value == helios_contract::model::ValueKind::CompletionRecords)
        .expect("records")
        .shape[1]
}

/// Record words of one graph's records (speculative graphs have `header + W`).
fn graph_record_words(m: &Manifest, g: &Graph) -> u64 {
    g.binding(ValueKind::CompletionRecords).map_or_else(|| record_words(m), |b| b.shape[1])
}

/// The emulated speculative target: the token sampled after consuming `token` at `position`.
/// Tests craft accepted proposals with it.
pub fn toy_next(token: u32, position: u32, vocab: u32) -> u32 {
    token.wrapping_mul(7).wrapping_add(position).wrapping_add(3) % vocab
}

/// A speculative graph's verification (spec 21), with [`toy_next`] as the sampler: per request
/// `i` with `q = QUERY_LENGTHS[i] > 0` lanes, `y_j = toy_next(token_j, position_j)` (a negative
/// lane-0 token reads the slot's pending token), accepted `a` = the longest prefix of proposals
/// equal to the samples before them (stopping after an EOS), record = `y_0 ..= y_a`, pending
/// token = `y_a`.
fn emulate_verify(m: &Manifest, g: &Graph, arena: &mut [u8]) {
    let at = |v: ValueKind| g.binding(v).map(|b| m.buffer(b.view.buffer).unwrap().offset + b.view.offset);
    let (tokens, positions, query, slots) = (
        at(ValueKind::TokenIds).unwrap(),
        at(ValueKind::Positions).unwrap(),
        at(ValueKind::QueryLengths).unwrap(),
        at(ValueKind::RequestSlots).unwrap(),
    );
    let (records, counters, pending) =
        (at(ValueKind::CompletionRecords).unwrap(), at(ValueKind::RngCounter), at(ValueKind::PendingTokens));
    let (vocab, header) = (m.capacities.vocab_size, u64::from(m.capacities.completion_record_header_words));
    let eos = &m.frontend.eos_token_ids;
    let rw = graph_record_words(m, g);
    let w = u64::from(g.capacity.proposal_depth) + 1;
    for i in 0..u64::from(g.capacity.request_count) {
        let q = u32_at(arena, query + 4 * i) as i32;
        if q <= 0 {
            continue;
        }
        let slot = u32_at(arena, slots + 4 * i);
        let lane = |arena: &[u8], j: u64| {
            let t = u32_at(arena, tokens + 4 * (i * w + j)) as i32;
            let t =
                if t < 0 { u32_at(arena, pending.expect("device-fed lane") + 4 * u64::from(slot)) } else { t as u32 };
            (t, u32_at(arena, positions + 4 * (i * w + j)))
        };
        let mut emitted = Vec::new();
        for j in 0..q as u64 {
            let (t, p) = lane(arena, j);
            let y = toy_next(t, p, vocab);
            emitted.push(y);
            let next = (j + 1 < q as u64).then(|| lane(arena, j + 1).0);
            if next != Some(y) || eos.contains(&y) {
                break;
            }
        }
        let last = *emitted.last().unwrap();
        let start = lane(arena, 0).1;
        let at = records + 4 * i * rw;
        put_u32(arena, at + 4, slot);
        put_u32(arena, at + 8, FLAG_SAMPLED | if eos.contains(&last) { FLAG_EOS } else { 0 });
        put_u32(arena, at + 12, emitted.len() as u32);
        put_u32(arena, at + 16, start + emitted.len() as u32);
        put_u32(arena, at + 20, counters.map_or(0, |c| u32_at(arena, c + 8 * i)));
        for (k, &y) in emitted.iter().enumerate() {
            put_u32(arena, at + 4 * (header + k as u64), y);
        }
        put_u32(arena, at, RECORD_MAGIC);
        if let Some(pending) = pending {
            put_u32(arena, pending + 4 * u64::from(slot), last);
        }
        // The row holds the pending token and the accepted proposals.
        if let Some(at) = stamp_at(m, slot) {
            put_u32(arena, at, start + emitted.len() as u32);
        }
    }
}

/// Arena offset of row `row`'s stamp, for a core with checkpoint stamps and a row that exists.
pub fn stamp_at(m: &Manifest, row: u32) -> Option<u64> {
    let scheme = &m.cache_scheme;
    let region = scheme.row_layout.iter().find(|r| r.kind == RowRegionKind::PositionMetadata)?;
    let rows = m.buffers.iter().find(|b| b.role == BufferRole::ContinuationRows)?;
    let total = scheme.total_rows(m.capacities.request_slots, m.capacities.snapshot_rows);
    (row < total).then(|| rows.offset + u64::from(row) * scheme.continuation_row_bytes + region.offset)
}

/// Row `row`'s stamp, (consumed, epoch); a row that does not exist reads (0, 0).
pub fn stamp_of(m: &Manifest, arena: &[u8], row: u32) -> (u32, u32) {
    stamp_at(m, row).map_or((0, 0), |at| (u32_at(arena, at), u32_at(arena, at + 4)))
}

/// A stamped core's consuming graph: each live row it consumed into records its new count
/// (prefill: start + query length; decode, which binds no positions here: one more).
fn emulate_consumed(m: &Manifest, g: &Graph, arena: &mut [u8]) {
    let at = |v: ValueKind| g.binding(v).map(|b| m.buffer(b.view.buffer).unwrap().offset + b.view.offset);
    let Some(slots) = at(ValueKind::RequestSlots) else { return };
    for i in 0..u64::from(g.capacity.request_count) {
        let slot = u32_at(arena, slots + 4 * i);
        let Some(stamp) = stamp_at(m, slot).filter(|_| slot != 0) else { continue };
        let consumed = match (g.kind, at(ValueKind::QueryLengths), at(ValueKind::Positions)) {
            (GraphKind::Prefill, Some(query), Some(positions)) => {
                let q = u32_at(arena, query + 4 * i);
                if q == 0 {
                    continue;
                }
                u32_at(arena, positions) + q
            }
            (GraphKind::Decode, _, _) => u32_at(arena, stamp) + 1,
            _ => continue,
        };
        put_u32(arena, stamp, consumed);
    }
}

/// A stamped core's maintenance op (initialize, restore, snapshot), checked before any write
/// as the contract specifies, with its status record: destination row, rejected flag, the
/// source row's stamp as found.
fn emulate_maintenance(m: &Manifest, g: &Graph, arena: &mut [u8]) {
    let at = |v: ValueKind| g.binding(v).map(|b| m.buffer(b.view.buffer).unwrap().offset + b.view.offset);
    let value = |arena: &[u8], v: ValueKind| at(v).map(|a| u32_at(arena, a));
    let Some(records) = at(ValueKind::CompletionRecords) else { return };
    let scheme = &m.cache_scheme;
    let first_snapshot = scheme.snapshot_row(m.capacities.request_slots, 0);
    let total = scheme.total_rows(m.capacities.request_slots, m.capacities.snapshot_rows);
    let live = |r: u32| (1..first_snapshot).contains(&r);
    let snapshot = |r: u32| (first_snapshot..total).contains(&r);
    let rows = m.buffers.iter().find(|b| b.role == BufferRole::ContinuationRows).unwrap();
    let row_bytes = scheme.continuation_row_bytes as usize;
    let row_at = |r: u32| rows.offset as usize + r as usize * row_bytes;
    let dst = value(arena, ValueKind::DestinationRows).unwrap_or(u32::MAX);
    let (rejected, found) = match g.maintenance_op {
        Some(MaintenanceOp::Initialize) => {
            if live(dst) {
                arena[row_at(dst)..row_at(dst) + row_bytes].fill(0);
            }
            (!live(dst), stamp_of(m, arena, dst))
        }
        Some(op @ (MaintenanceOp::Restore | MaintenanceOp::Snapshot)) => {
            let src = value(arena, ValueKind::SourceRows).unwrap_or(u32::MAX);
            let expected = value(arena, ValueKind::ExpectedConsumed).unwrap_or(u32::MAX) as i32;
            let epoch = value(arena, ValueKind::CheckpointEpoch).unwrap_or(0);
            let found = stamp_of(m, arena, src);
            let restore = op == MaintenanceOp::Restore;
            let rows_ok = if restore { snapshot(src) && live(dst) } else { live(src) && snapshot(dst) };
            let stamp_ok =
                expected < 0 || if restore { found == (expected as u32, epoch) } else { found.0 == expected as u32 };
            let ok = rows_ok && stamp_ok;
            if ok {
                let bytes = arena[row_at(src)..row_at(src) + row_bytes].to_vec();
                arena[row_at(dst)..row_at(dst) + row_bytes].copy_from_slice(&bytes);
                if let (false, Some(stamp)) = (restore, stamp_at(m, dst)) {
                    put_u32(arena, stamp + 4, epoch);
                }
            }
            (!ok, found)
        }
        _ => return,
    };
    put_u32(arena, records + 4, dst);
    put_u32(arena, records + 8, if rejected { FLAG_CHECKPOINT_REJECTED } else { 0 });
    put_u32(arena, records + 12, 0);
    put_u32(arena, records + 16, found.0);
    put_u32(arena, records + 20, found.1);
    put_u32(arena, records, RECORD_MAGIC);
}

/// The fixture core (`spec`) with PTX kernels, written to `dir` and opened.
pub fn device_fixture(dir: &std::path::Path, spec: &FixtureSpec) -> RuntimeCore {
    device_fixture_with(dir, spec, |_| {})
}

/// [`device_fixture`] with `edit` applied to the fixture before it is written.
pub fn device_fixture_with(dir: &std::path::Path, spec: &FixtureSpec, edit: impl FnOnce(&mut Fixture)) -> RuntimeCore {
    let mut f = Fixture::build(spec);
    edit(&mut f);
    let (rw, header) = {
        let m = helios_contract::validate(&f.manifest).expect("valid fixture");
        (record_words(&m), u64::from(m.capacities.completion_record_header_words))
    };
    let images = [EMBED_PTX.as_bytes().to_vec(), sample_ptx(rw, header).into_bytes()];
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

/// CPU emulation of one graph over an arena image whose device base is `base`.
pub fn emulate(m: &Manifest, graph: GraphId, arena: &mut [u8], base: u64) {
    let g = m.graphs.iter().find(|g| g.id == graph).expect("graph");
    let vocab = m.capacities.vocab_size;
    let header = u64::from(m.capacities.completion_record_header_words);
    let rw = graph_record_words(m, g);
    let addr = |buffer: BufferId, off: u64| m.buffer(buffer).unwrap().offset + off;
    // Every edge orders fully, programmatic ones too: always correct, the device only overlaps.
    let mut done = vec![false; g.nodes.len()];
    while done.iter().any(|d| !d) {
        for i in 0..g.nodes.len() {
            if done[i] || g.edges.iter().any(|e| e.to == i && !done[e.from]) {
                continue;
            }
            match &g.nodes[i].op {
                NodeOp::Kernel(k) => {
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
                        for r in 0..u64::from(k.grid.x) {
                            let sum =
                                (0..64).fold(0u32, |acc, q| acc.wrapping_add(u32_at(arena, s + 4 * (r * 64 + q))));
                            let at = rec + 4 * r * rw;
                            put_u32(arena, at + 4, r as u32);
                            put_u32(arena, at + 8, FLAG_SAMPLED);
                            put_u32(arena, at + 12, 1);
                            put_u32(arena, at + 4 * header, sum % v);
                            put_u32(arena, at, RECORD_MAGIC);
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
    let stamped = stamp_at(m, 0).is_some();
    match g.kind {
        GraphKind::Speculative => emulate_verify(m, g, arena),
        GraphKind::StateMaintenance if g.binding(ValueKind::CompletionRecords).is_some() => {
            emulate_maintenance(m, g, arena)
        }
        GraphKind::Prefill | GraphKind::Decode if stamped => emulate_consumed(m, g, arena),
        _ => {}
    }
}

/// A host-memory [`GraphBackend`] that runs graphs through [`emulate`].
#[derive(Debug)]
pub struct Emulator {
    pub manifest: Manifest,
    pub arena: Vec<u8>,
    pub replays: usize,
    /// Defer records reads like a device: each is "in flight" for its first non-waiting take.
    pub deferred: bool,
    /// With `deferred`: every read has landed by its first take, as on a device that runs
    /// ahead of the host (the schedule then differs from `deferred` alone).
    pub reads_land_at_once: bool,
    reads: std::collections::HashMap<u64, (Vec<u8>, bool)>,
    next_read: u64,
    host: Option<std::sync::Arc<helios_offload::HostArena>>,
    /// Host transfers issued (after the executor coalesced them).
    pub host_copies: usize,
}

impl Emulator {
    /// The arena as the loader leaves it: payloads uploaded, zero-fill zeroed, the rest zero too.
    pub fn new(core: &RuntimeCore) -> Self {
        let m = core.manifest().clone();
        let mut arena = vec![0u8; m.arena.byte_size as usize];
        for b in &m.buffers {
            if let (Payload::Safetensors { .. }, Some(bytes)) = (&b.payload, core.payload(b.id)) {
                arena[b.offset as usize..b.offset as usize + bytes.len()].copy_from_slice(bytes);
            }
        }
        Emulator {
            manifest: m,
            arena,
            replays: 0,
            deferred: false,
            reads_land_at_once: false,
            reads: Default::default(),
            host: None,
            host_copies: 0,
            next_read: 0,
        }
    }

    fn at(&self, buffer: BufferId, offset: u64, len: u64) -> Result<std::ops::Range<usize>, ExecutorError> {
        let b = self.manifest.buffer(buffer).ok_or(ExecutorError::BadPage(buffer.0))?;
        if offset + len > b.byte_size {
            return Err(ExecutorError::BadPage(buffer.0));
        }
        let start = (b.offset + offset) as usize;
        Ok(start..start + len as usize)
    }
}

/// When a [`Hooked`] backend's hook runs: before a replay (to tamper with its inputs) or after it
/// (with what it wrote).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Moment {
    Before,
    After,
}

/// The emulator with a hook around every replay: a device that corrupts state or writes what it
/// should not. Reads are immediate (the hook sees every replay's results before they are read).
pub struct Hooked<F> {
    pub emulator: Emulator,
    pub hook: F,
}

impl<F: FnMut(&mut Emulator, GraphId, Moment)> GraphBackend for Hooked<F> {
    fn write(&mut self, buffer: BufferId, offset: u64, bytes: &[u8]) -> Result<(), ExecutorError> {
        self.emulator.write(buffer, offset, bytes)
    }
    fn read(&mut self, buffer: BufferId, offset: u64, len: u64) -> Result<Vec<u8>, ExecutorError> {
        self.emulator.read(buffer, offset, len)
    }
    fn copy(&mut self, src: (BufferId, u64), dst: (BufferId, u64), len: u64) -> Result<(), ExecutorError> {
        self.emulator.copy(src, dst, len)
    }
    fn replay(&mut self, graph: GraphId) -> Result<(), ExecutorError> {
        (self.hook)(&mut self.emulator, graph, Moment::Before);
        self.emulator.replay(graph)?;
        (self.hook)(&mut self.emulator, graph, Moment::After);
        Ok(())
    }
}

impl GraphBackend for Emulator {
    fn write(&mut self, buffer: BufferId, offset: u64, bytes: &[u8]) -> Result<(), ExecutorError> {
        let r = self.at(buffer, offset, bytes.len() as u64)?;
        self.arena[r].copy_from_slice(bytes);
        Ok(())
    }
    fn read(&mut self, buffer: BufferId, offset: u64, len: u64) -> Result<Vec<u8>, ExecutorError> {
        let r = self.at(buffer, offset, len)?;
        Ok(self.arena[r].to_vec())
    }
    fn copy(&mut self, src: (BufferId, u64), dst: (BufferId, u64), len: u64) -> Result<(), ExecutorError> {
        let s = self.at(src.0, src.1, len)?;
        let d = self.at(dst.0, dst.1, len)?;
        let tmp = self.arena[s].to_vec();
        self.arena[d].copy_from_slice(&tmp);
        Ok(())
    }
    fn read_later(
        &mut self,
        buffer: BufferId,
        offset: u64,
        len: u64,
    ) -> Result<Option<helios_replay::graph::ReadTicket>, ExecutorError> {
        if !self.deferred {
            return Ok(None);
        }
        // Emulated replays run at once, so the bytes are final now.
        let bytes = self.read(buffer, offset, len)?;
        let id = self.next_read;
        self.next_read += 1;
        self.reads.insert(id, (bytes, false));
        Ok(Some(helios_replay::graph::ReadTicket(id)))
    }
    fn take_read(
        &mut self,
        ticket: helios_replay::graph::ReadTicket,
        wait: bool,
    ) -> Result<Option<Vec<u8>>, ExecutorError> {
        let entry = self.reads.get_mut(&ticket.0).ok_or(ExecutorError::UnknownRead(ticket.0))?;
        if !wait && !entry.1 && !self.reads_land_at_once {
            entry.1 = true;
            return Ok(None);
        }
        Ok(self.reads.remove(&ticket.0).map(|(bytes, _)| bytes))
    }
    fn attach_host_arena(&mut self, arena: std::sync::Arc<helios_offload::HostArena>) -> Result<(), ExecutorError> {
        self.host = Some(arena);
        Ok(())
    }
    fn copy_to_host(&mut self, src: (BufferId, u64), dst: helios_offload::HostExtent) -> Result<(), ExecutorError> {
        let r = self.at(src.0, src.1, dst.len)?;
        self.host_copies += 1;
        let host = self.host.as_ref().ok_or(ExecutorError::NoHostTransfers)?;
        // SAFETY: single-threaded emulation; the scheduler owns the extent.
        unsafe { host.bytes_mut(dst) }.copy_from_slice(&self.arena[r]);
        Ok(())
    }
    fn copy_from_host(&mut self, src: helios_offload::HostExtent, dst: (BufferId, u64)) -> Result<(), ExecutorError> {
        let r = self.at(dst.0, dst.1, src.len)?;
        self.host_copies += 1;
        let host = self.host.as_ref().ok_or(ExecutorError::NoHostTransfers)?;
        // SAFETY: as above.
        self.arena[r].copy_from_slice(unsafe { host.bytes(src) });
        Ok(())
    }
    fn replay(&mut self, graph: GraphId) -> Result<(), ExecutorError> {
        let base = self.manifest.arena.base_address;
        let m = self.manifest.clone();
        emulate(&m, graph, &mut self.arena, base);
        self.replays += 1;
        Ok(())
    }
}

/// A backend whose deferred reads land on a fixed schedule, whatever the device's timing: a
/// ticket is in flight for its first non-waiting take and waited for on the next (the
/// [`Emulator`]'s `deferred` pacing). The scheduler then plans exactly the steps it plans over
/// `Emulator { deferred: true, .. }`, so graphs whose tokens depend on the batch (this fixture's
/// do) can be compared step for step between a device and the emulation.
#[derive(Debug)]
pub struct PacedReads<B> {
    pub inner: B,
    polled: std::collections::HashSet<u64>,
}

impl<B> PacedReads<B> {
    pub fn new(inner: B) -> Self {
        PacedReads { inner, polled: Default::default() }
    }
}

impl<B: GraphBackend> GraphBackend for PacedReads<B> {
    fn write(&mut self, buffer: BufferId, offset: u64, bytes: &[u8]) -> Result<(), ExecutorError> {
        self.inner.write(buffer, offset, bytes)
    }
    fn read(&mut self, buffer: BufferId, offset: u64, len: u64) -> Result<Vec<u8>, ExecutorError> {
        self.inner.read(buffer, offset, len)
    }
    fn copy(&mut self, src: (BufferId, u64), dst: (BufferId, u64), len: u64) -> Result<(), ExecutorError> {
        self.inner.copy(src, dst, len)
    }
    fn replay(&mut self, graph: GraphId) -> Result<(), ExecutorError> {
        self.inner.replay(graph)
    }
    fn read_later(
        &mut self,
        buffer: BufferId,
        offset: u64,
        len: u64,
    ) -> Result<Option<helios_replay::graph::ReadTicket>, ExecutorError> {
        self.inner.read_later(buffer, offset, len)
    }
    fn take_read(
        &mut self,
        ticket: helios_replay::graph::ReadTicket,
        wait: bool,
    ) -> Result<Option<Vec<u8>>, ExecutorError> {
        if !wait && self.polled.insert(ticket.0) {
            return Ok(None);
        }
        self.polled.remove(&ticket.0);
        self.inner.take_read(ticket, true)
    }
}
