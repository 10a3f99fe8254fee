//! helios-replay: the [`Executor`] trait and a simulated executor with real byte storage.
//!
//! The simulated model's next token is a hash of the live row's recurrent state (every
//! consumed token and position), of every page slot the request's page table addresses for
//! its consumed positions, and of the request's seed and sampling counter. Any wrong page,
//! stale row, off-by-one endpoint or lost token changes the output.

use helios_contract::model::{CacheScheme, Capacities};
use helios_offload::{HostArena, HostExtent, StoreGeometry};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use helios_scheduler::{Completion, ConsumeRow, RequestId, SampleSpec, SampledToken, Step, StepOp};

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod graph;
pub mod memory;
pub mod speculative;

/// Request-level sampling controls, packed beside the step for the device sampler.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    /// 0 disables top-k.
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
        }
    }
}

/// Per-request sampling inputs for one sampled row.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RowSampling {
    pub params: SamplingParams,
    /// Allowed-token bitset, 32 ids per word (id `i` at bit `i % 32` of word `i / 32`);
    /// `None` leaves the vocabulary unconstrained.
    pub mask: Option<Arc<[u32]>>,
    /// A constrained verify row's masks for its proposal lanes: entry `j` is the grammar's mask
    /// after proposals `1..=j + 1`, what lane `j + 1` samples under (`mask` is lane 0's). One
    /// per proposal the row carries when `mask` is set; ignored without `mask`.
    pub proposal_masks: Vec<Arc<[u32]>>,
}

impl RowSampling {
    /// The mask lane `lane` of `request`'s verify row samples under (lane 0: `mask`; `None`:
    /// unconstrained); a constrained row without that lane's mask is refused.
    pub fn lane_mask(&self, request: RequestId, lane: usize) -> Result<Option<&Arc<[u32]>>, ExecutorError> {
        match (&self.mask, lane) {
            (None, _) => Ok(None),
            (Some(m), 0) => Ok(Some(m)),
            (Some(_), j) => self
                .proposal_masks
                .get(j - 1)
                .map(Some)
                .ok_or(ExecutorError::MissingLaneMask { request: request.0, lane: j as u32 }),
        }
    }
}

/// Host inputs packed beside a step: sampling controls for each request it samples.
/// Requests absent from the map sample with defaults and no mask.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepInputs {
    pub sampling: HashMap<RequestId, RowSampling>,
}

/// Runs planned steps. A CUDA executor implements the same contract.
pub trait Executor {
    /// Submits one step with its packed inputs; ops run in order.
    fn submit(&mut self, step: &Step, inputs: &StepInputs) -> Result<(), ExecutorError>;
    /// Completions of finished steps, in fence order (non-blocking).
    fn poll(&mut self) -> Result<Vec<Completion>, ExecutorError>;
    /// Waits for every submitted step; returns their completions in fence order.
    fn synchronize(&mut self) -> Result<Vec<Completion>, ExecutorError>;
    /// Waits until at least the oldest submitted step completed (when any is in flight);
    /// returns every completion ready, in fence order. Keeps later steps in flight.
    fn wait(&mut self) -> Result<Vec<Completion>, ExecutorError> {
        self.synchronize()
    }
    /// Whether decode rows may be device-fed ([`ConsumeRow::device_token`]): every decode
    /// graph reads the pending token from device state and every sampling op writes it.
    fn device_fed_decode(&self) -> bool {
        false
    }
    /// Device memory in use now minus at readiness, for executors that own a device: anything
    /// other than 0 means memory was allocated after readiness (by us or by another process on
    /// the device). `None` where there is no device.
    fn device_memory_growth_bytes(&mut self) -> Option<i64> {
        None
    }
    /// KV pages the executor's storage backs, when fewer than the core prepared (the load-time
    /// memory plan cut them to fit the device): the scheduler's page pool must not exceed it.
    /// `None`: every prepared page is backed.
    fn kv_pages(&self) -> Option<u32> {
        None
    }
    /// Attaches the host memory that [`StepOp::CopyOut`] and [`StepOp::CopyIn`] address, for
    /// extents laid out in `geometry` (pages and rows of these sizes). Called once, before
    /// readiness (executors that copy asynchronously page-lock it here); refuses a geometry it
    /// cannot copy. The default refuses: such an executor serves without a host tier.
    fn attach_host_arena(&mut self, arena: Arc<HostArena>, geometry: StoreGeometry) -> Result<(), ExecutorError> {
        let _ = (arena, geometry);
        Err(ExecutorError::NoHostTransfers)
    }
    /// Whether the device shares physical memory with the host (integrated and unified-memory
    /// systems): a host tier then spends the same DRAM as the device cache.
    fn unified_memory(&self) -> bool {
        false
    }
    /// Wall time of one step holding `op` over padding only (rows empty: nothing is consumed,
    /// sampled or stored), averaged over `reps` steps after a warm-up, everything in flight
    /// drained. Before readiness only (it replays graphs). `None`: this executor has no device
    /// time to measure (the simulated one), and callers keep their assumptions.
    fn measure_step(&mut self, op: &StepOp, reps: u32) -> Result<Option<std::time::Duration>, ExecutorError> {
        let _ = (op, reps);
        Ok(None)
    }
}

/// An executor lent for one run (a test driver over an executor its caller keeps).
impl<E: Executor + ?Sized> Executor for &mut E {
    fn submit(&mut self, step: &Step, inputs: &StepInputs) -> Result<(), ExecutorError> {
        (**self).submit(step, inputs)
    }
    fn poll(&mut self) -> Result<Vec<Completion>, ExecutorError> {
        (**self).poll()
    }
    fn synchronize(&mut self) -> Result<Vec<Completion>, ExecutorError> {
        (**self).synchronize()
    }
    fn wait(&mut self) -> Result<Vec<Completion>, ExecutorError> {
        (**self).wait()
    }
    fn device_fed_decode(&self) -> bool {
        (**self).device_fed_decode()
    }
    fn device_memory_growth_bytes(&mut self) -> Option<i64> {
        (**self).device_memory_growth_bytes()
    }
    fn kv_pages(&self) -> Option<u32> {
        (**self).kv_pages()
    }
    fn attach_host_arena(&mut self, arena: Arc<HostArena>, geometry: StoreGeometry) -> Result<(), ExecutorError> {
        (**self).attach_host_arena(arena, geometry)
    }
    fn unified_memory(&self) -> bool {
        (**self).unified_memory()
    }
    fn measure_step(&mut self, op: &StepOp, reps: u32) -> Result<Option<std::time::Duration>, ExecutorError> {
        (**self).measure_step(op, reps)
    }
}

/// Executor failures: metadata that does not match the storage it addresses.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ExecutorError {
    #[error("request {request}: a constrained verify row without the grammar mask of its lane {lane}")]
    MissingLaneMask { request: u64, lane: u32 },
    #[error("row {row} holds {actual} consumed tokens, step expects {expected}")]
    StaleRow { row: u32, actual: u64, expected: u64 },
    #[error("row {0} outside the pool or is the null row")]
    BadRow(u32),
    #[error("page {0} outside the pool")]
    BadPage(u32),
    #[error("position {position} beyond page table of {pages} pages")]
    PageTableShort { position: u32, pages: usize },
    #[error("grammar mask for request {0} allows no token")]
    EmptyMask(u64),
    #[error("step needs a graph the core lacks: {0}")]
    Capacity(#[from] helios_contract::CapacityError),
    #[error("step needs speculative program {0:?}, which this core lacks")]
    NoSpeculativeProgram(helios_contract::model::SpeculativeProgram),
    #[error("verify row of live row {0} samples nothing")]
    VerifyWithoutSample(u32),
    #[error("{rows} verify rows exceed the {} requests of program {program:?}", program.requests)]
    VerifyRows { program: helios_contract::model::SpeculativeProgram, rows: usize },
    #[error("verify row of live row {live_row} consumes {lanes} tokens; program {program:?} verifies 1 to depth + 1")]
    VerifyLanes { program: helios_contract::model::SpeculativeProgram, live_row: u32, lanes: usize },
    #[error("packing step inputs: {0}")]
    Pack(#[from] helios_contract::PackError),
    #[error("completion record of row {row}: {error}")]
    Record { row: usize, error: helios_contract::record::RecordError },
    #[error("completion record of row {0} holds no sampled token")]
    NotSampled(usize),
    /// A decode, prefill or resume record emits one token; a verify record at most one per
    /// lane its row used (accepted proposals + 1).
    #[error("completion record of row {row} holds {count} tokens; its row may emit at most {most}")]
    TooManyTokens { row: usize, count: usize, most: usize },
    #[error("row {0} decodes its pending token, but no sampling op wrote one since it was initialized")]
    NoPendingToken(u32),
    #[error("a device-fed decode row, but the core's graphs do not keep the pending token on the device")]
    DeviceFedUnsupported,
    #[error("no deferred read {0} is outstanding")]
    UnknownRead(u64),
    #[error("this executor has no host transfers (or no host arena is attached)")]
    NoHostTransfers,
    #[error("host extent {extent:?} does not hold the {expected} bytes of the storage it copies")]
    TransferSize { extent: HostExtent, expected: u64 },
    #[error(
        "host extents of {page_bytes}-byte pages and {row_bytes}-byte rows do not fit this executor's pages and rows"
    )]
    TransferGeometry { page_bytes: u64, row_bytes: u64 },
    #[error("the core cannot be driven: {0}")]
    Contract(#[from] graph::GraphExecutorError),
    /// A restore or snapshot the device refused: it wrote nothing. `expected` is the
    /// checkpoint's (consumed, epoch) the step carried, `found` the source row's stamp (a
    /// snapshot compares the consumed counts only: its source is a live row, whose epoch is
    /// the one its last initialize or restore left). Also reported when the device found the
    /// rows of the wrong kinds (a live row where a snapshot row belongs, or the reverse).
    #[error(
        "{op:?} of row {source_row} into row {destination_row} was rejected: the checkpoint is \
         (consumed, epoch) {expected:?}, the source row holds {found:?}"
    )]
    CheckpointRejected {
        op: helios_contract::model::MaintenanceOp,
        source_row: u32,
        destination_row: u32,
        expected: (u32, u32),
        found: (u32, u32),
    },
    #[error("status record of {op:?} names row {found}; the op wrote row {expected}")]
    CheckpointRecordRow { op: helios_contract::model::MaintenanceOp, expected: u32, found: u32 },
    #[error("a count of {0} tokens does not fit a row's stamp")]
    StampRange(u64),
    /// A CUDA failure: operation, driver code, name and description.
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Cuda(#[from] cuda::CudaError),
}

/// How the simulated model picks its next token.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SimModel {
    /// A hash of every consumed token, position, page slot and the row state: any wrong
    /// page, stale row or off-by-one changes the output (lifecycle tests).
    #[default]
    Hash,
    /// An induction (copy) model over the history read back from the pages: continue with
    /// what followed the most recent earlier occurrence of the longest matching suffix,
    /// occasionally a shorter match. Produces text-like, terminating output for the server.
    Induction,
}

/// Longest suffix match the induction model looks for.
const INDUCTION_MAX_MATCH: usize = 24;
/// Earlier occurrences of the last token the induction model considers (most recent first).
const INDUCTION_MAX_CANDIDATES: usize = 1024;
/// When no copy candidate is allowed, the induction model draws from this many lowest allowed ids.
const INDUCTION_FALLBACK_WINDOW: u64 = 64;

const TOKEN_BYTES: usize = 8;
const ROW_STATE_BYTES: u64 = 16;

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// CPU stand-in for the device: pages of `page_tokens × (token, position)` words and rows
/// of `[recurrent hash: u64, consumed: u32, epoch: u32, …]`. Completes each step on submission.
///
/// `(consumed, epoch)` is the row's stamp, kept by the rules a core's position-metadata region
/// follows: consuming sets the count, initialize zeroes both, a snapshot stamps its row with
/// the live row's count and the step's epoch, a restore copies the stamp with the row; host
/// transfers carry it with the row's bytes. A snapshot whose live row has not consumed the
/// step's count, or a restore whose snapshot row does not hold the step's (consumed, epoch),
/// fails with [`ExecutorError::CheckpointRejected`], as a checking device reports it.
#[derive(Debug)]
pub struct SimulatedExecutor {
    page_tokens: usize,
    vocab: u32,
    pages: Vec<Vec<u8>>,
    rows: Vec<Vec<u8>>,
    /// Rows `1..first_snapshot_row` are live rows, the rest (up to `rows.len()`) snapshot rows.
    first_snapshot_row: u32,
    completions: Vec<Completion>,
    /// Completions are reported only once this many later steps were submitted.
    completion_lag: usize,
    model: SimModel,
    /// Device request state: the token each row sampled last, cleared when the row is
    /// initialized or restored (outside every checkpoint).
    pending: Vec<Option<u32>>,
    device_fed: bool,
    /// Whether a token's state depends on the graph that consumed it ([`Self::with_graph_rounding`]).
    graph_rounding: bool,
    host: Option<Arc<HostArena>>,
    /// How long each submission takes ([`Self::with_step_time`]); zero by default.
    step_time: Duration,
}

/// The graph family a row is consumed through: on a device, decode (and speculative) programs
/// and prefill chunks compute the same function with different kernels, so they round
/// differently.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Graph {
    Decode,
    Prefill,
}

/// What a decode-consumed token mixes into the row state under [`SimulatedExecutor::with_graph_rounding`].
const DECODE_ROUNDING: u64 = 0x5eed_0fde_c0de;

impl SimulatedExecutor {
    /// Like [`Self::new`], but reports each completion `lag` submissions late, so the
    /// scheduler plans while earlier steps are still "in flight".
    pub fn with_completion_lag(scheme: &CacheScheme, capacities: &Capacities, lag: usize) -> Self {
        Self { completion_lag: lag, ..Self::new(scheme, capacities) }
    }

    /// Storage sized from the scheme and capacities.
    pub fn new(scheme: &CacheScheme, capacities: &Capacities) -> Self {
        let row_bytes = scheme.continuation_row_bytes.max(ROW_STATE_BYTES) as usize;
        let rows = scheme.total_rows(capacities.request_slots, capacities.snapshot_rows) as usize;
        Self {
            page_tokens: scheme.page_tokens as usize,
            vocab: capacities.vocab_size,
            pages: vec![vec![0; scheme.page_tokens as usize * TOKEN_BYTES]; capacities.max_kv_pages as usize],
            rows: vec![vec![0; row_bytes]; rows],
            first_snapshot_row: scheme.snapshot_row(capacities.request_slots, 0),
            completions: Vec::new(),
            completion_lag: 0,
            model: SimModel::Hash,
            pending: vec![None; rows],
            device_fed: false,
            graph_rounding: false,
            host: None,
            step_time: Duration::ZERO,
        }
    }

    /// Makes every submission take `step_time` (the model thread sleeps in `submit`), as a
    /// device step would: a server on this executor streams at a device's pace instead of
    /// finishing a long generation within milliseconds.
    pub fn with_step_time(mut self, step_time: Duration) -> Self {
        self.step_time = step_time;
        self
    }

    /// Accepts device-fed decode rows (reports [`Executor::device_fed_decode`]).
    pub fn with_device_fed_decode(mut self) -> Self {
        self.device_fed = true;
        self
    }

    /// Makes a token's state depend on whether a decode row or a prefill chunk consumed it,
    /// as a device's rounding does: a request matches its uninterrupted run only if every
    /// token it consumed went through the same graph family there (history recomputed by
    /// prefill where it was decoded does not).
    pub fn with_graph_rounding(mut self) -> Self {
        self.graph_rounding = true;
        self
    }

    /// Selects the simulated model.
    pub fn with_model(mut self, model: SimModel) -> Self {
        self.model = model;
        self
    }

    /// The row's recurrent hash and consumed count.
    fn row_state(&self, row: u32) -> Result<(u64, u64), ExecutorError> {
        let r = self.rows.get(row as usize).ok_or(ExecutorError::BadRow(row))?;
        let hash = u64::from_le_bytes(r[0..8].try_into().unwrap_or_default());
        Ok((hash, u64::from(self.stamp(row)?.0)))
    }

    /// The row's stamp: (consumed, epoch).
    fn stamp(&self, row: u32) -> Result<(u32, u32), ExecutorError> {
        let r = self.rows.get(row as usize).ok_or(ExecutorError::BadRow(row))?;
        let word = |at: usize| u32::from_le_bytes(r[at..at + 4].try_into().unwrap_or_default());
        Ok((word(8), word(12)))
    }

    fn set_stamp(&mut self, row: u32, (consumed, epoch): (u32, u32)) -> Result<(), ExecutorError> {
        let r = self.rows.get_mut(row as usize).filter(|_| row != 0).ok_or(ExecutorError::BadRow(row))?;
        r[8..12].copy_from_slice(&consumed.to_le_bytes());
        r[12..16].copy_from_slice(&epoch.to_le_bytes());
        Ok(())
    }

    /// Consuming sets the hash and the count; the epoch stays what initialize or restore left.
    fn set_row_state(&mut self, row: u32, hash: u64, consumed: u64) -> Result<(), ExecutorError> {
        let (_, epoch) = self.stamp(row)?;
        let consumed = u32::try_from(consumed).map_err(|_| ExecutorError::StampRange(consumed))?;
        self.set_stamp(row, (consumed, epoch))?;
        self.rows[row as usize][0..8].copy_from_slice(&hash.to_le_bytes());
        Ok(())
    }

    fn is_live_row(&self, row: u32) -> bool {
        (1..self.first_snapshot_row).contains(&row)
    }

    fn is_snapshot_row(&self, row: u32) -> bool {
        (self.first_snapshot_row as usize..self.rows.len()).contains(&(row as usize))
    }

    /// A snapshot (`live → snapshot row`) or restore (`snapshot → live row`), checked as a
    /// stamping device checks it before writing anything.
    fn checkpoint(
        &mut self,
        op: helios_contract::model::MaintenanceOp,
        source_row: u32,
        destination_row: u32,
        expected: (u32, u32),
    ) -> Result<(), ExecutorError> {
        use helios_contract::model::MaintenanceOp;
        let restore = op == MaintenanceOp::Restore;
        let (source_ok, destination_ok) = if restore {
            (self.is_snapshot_row(source_row), self.is_live_row(destination_row))
        } else {
            (self.is_live_row(source_row), self.is_snapshot_row(destination_row))
        };
        if !source_ok {
            return Err(ExecutorError::BadRow(source_row));
        }
        if !destination_ok {
            return Err(ExecutorError::BadRow(destination_row));
        }
        let found = self.stamp(source_row)?;
        // A snapshot's source is a live row: its epoch is the one its last restore left.
        let matches = if restore { found == expected } else { found.0 == expected.0 };
        if !matches {
            return Err(ExecutorError::CheckpointRejected { op, source_row, destination_row, expected, found });
        }
        self.copy_row(source_row, destination_row)?;
        if !restore {
            self.set_stamp(destination_row, (found.0, expected.1))?;
        }
        Ok(())
    }

    fn copy_row(&mut self, from: u32, to: u32) -> Result<(), ExecutorError> {
        if to == 0 || from as usize >= self.rows.len() || to as usize >= self.rows.len() {
            return Err(ExecutorError::BadRow(to));
        }
        let source = self.rows[from as usize].clone();
        self.rows[to as usize].copy_from_slice(&source);
        Ok(())
    }

    fn clear_pending(&mut self, row: u32) {
        if let Some(p) = self.pending.get_mut(row as usize) {
            *p = None;
        }
    }

    fn copy_page(&mut self, from: u32, to: u32) -> Result<(), ExecutorError> {
        let source = self.pages.get(from as usize).ok_or(ExecutorError::BadPage(from))?.clone();
        self.pages.get_mut(to as usize).ok_or(ExecutorError::BadPage(to))?.copy_from_slice(&source);
        Ok(())
    }

    /// Copies pages and rows into host extents (`out`) or back (`!out`). The simulated storage
    /// is smaller than a real core's pages and rows: it fills the start of each extent.
    fn transfer(
        &mut self,
        pages: &[(u32, HostExtent)],
        rows: &[(u32, HostExtent)],
        out: bool,
    ) -> Result<(), ExecutorError> {
        let arena = self.host.clone().ok_or(ExecutorError::NoHostTransfers)?;
        let copy = |storage: &mut [u8], extent: HostExtent| {
            if storage.len() as u64 > extent.len {
                return Err(ExecutorError::TransferSize { extent, expected: storage.len() as u64 });
            }
            let part = HostExtent { len: storage.len() as u64, ..extent };
            // SAFETY: the scheduler owns the extent and orders every access to it with the steps;
            // this executor runs steps one at a time on this thread.
            unsafe {
                if out {
                    arena.bytes_mut(part).copy_from_slice(storage);
                } else {
                    storage.copy_from_slice(arena.bytes(part));
                }
            }
            Ok(())
        };
        for &(page, extent) in pages {
            copy(self.pages.get_mut(page as usize).ok_or(ExecutorError::BadPage(page))?, extent)?;
        }
        for &(row, extent) in rows {
            if !out && row == 0 {
                return Err(ExecutorError::BadRow(row));
            }
            copy(self.rows.get_mut(row as usize).ok_or(ExecutorError::BadRow(row))?, extent)?;
        }
        Ok(())
    }

    fn slot_of(&mut self, page_table: &[u32], position: u32) -> Result<&mut [u8], ExecutorError> {
        let index = position as usize / self.page_tokens;
        let page = *page_table.get(index).ok_or(ExecutorError::PageTableShort { position, pages: page_table.len() })?;
        let offset = position as usize % self.page_tokens * TOKEN_BYTES;
        let bytes = self.pages.get_mut(page as usize).ok_or(ExecutorError::BadPage(page))?;
        Ok(&mut bytes[offset..offset + TOKEN_BYTES])
    }

    /// Hash of every page slot the request attends to.
    fn attention(&mut self, page_table: &[u32], consumed: u32) -> Result<u64, ExecutorError> {
        let mut h = 0u64;
        for position in 0..consumed {
            let slot = self.slot_of(page_table, position)?;
            h = splitmix(h ^ u64::from_le_bytes(slot.try_into().unwrap_or_default()));
        }
        Ok(h)
    }

    /// The tokens at positions `0..consumed`, read back from the pages.
    fn history(&mut self, page_table: &[u32], consumed: u32) -> Result<Vec<u32>, ExecutorError> {
        let mut out = Vec::with_capacity(consumed as usize);
        for position in 0..consumed {
            let slot = self.slot_of(page_table, position)?;
            let word = u64::from_le_bytes(slot.try_into().unwrap_or_default());
            out.push((word & 0xffff_ffff) as u32);
        }
        Ok(out)
    }

    fn sample(
        &mut self,
        row: u32,
        page_table: &[u32],
        sample: &SampleSpec,
        inputs: &StepInputs,
    ) -> Result<(), ExecutorError> {
        let (state, consumed) = self.row_state(row)?;
        let attention = self.attention(page_table, consumed as u32)?;
        let h = splitmix(state ^ splitmix(attention ^ splitmix(sample.seed ^ (u64::from(sample.counter) << 32))));
        let mask = inputs.sampling.get(&sample.request).and_then(|s| s.mask.as_deref());
        let allowed = |t: u32| mask.is_none_or(|m| m.get(t as usize / 32).is_some_and(|w| w >> (t % 32) & 1 == 1));
        let token = match self.model {
            SimModel::Hash => (h % u64::from(self.vocab)) as u32,
            SimModel::Induction => {
                let history = self.history(page_table, consumed as u32)?;
                let temperature = inputs.sampling.get(&sample.request).map_or(1.0, |s| s.params.temperature);
                induction_candidates(&history, h, temperature)
                    .into_iter()
                    .find(|&t| allowed(t) && t < self.vocab)
                    .unwrap_or(u32::MAX)
            }
        };
        let token = if token < self.vocab && allowed(token) {
            token
        } else {
            match mask {
                // Hash model: any allowed id. Induction model: one of the lowest allowed ids
                // (single bytes and punctuation), so constrained strings and numbers close.
                Some(m) => {
                    let window = if self.model == SimModel::Induction { INDUCTION_FALLBACK_WINDOW } else { u64::MAX };
                    nth_allowed(m, self.vocab, h, window).ok_or(ExecutorError::EmptyMask(sample.request.0))?
                }
                None => (h % u64::from(self.vocab)) as u32,
            }
        };
        if let Some(c) = self.completions.last_mut() {
            c.sampled.push(SampledToken { request: sample.request, token });
        }
        if let Some(p) = self.pending.get_mut(row as usize) {
            *p = Some(token);
        }
        Ok(())
    }

    /// A verify row, as a speculative program runs it: the pending token is consumed and
    /// sampled from; each proposal equal to the sample drawn before it is consumed and sampled
    /// from in turn (the sample counter advancing as ordinary decoding's would), so the
    /// emitted tokens are exactly those ordinary decoding draws. Positions of rejected
    /// proposals are written with a poison word, as a device writes every lane: the scheduler
    /// must never let anything read them.
    fn verify(&mut self, row: &ConsumeRow, inputs: &StepInputs) -> Result<(), ExecutorError> {
        let sample = row.sample.ok_or(ExecutorError::VerifyWithoutSample(row.live_row))?;
        let pending = usize::from(!row.device_token).min(row.tokens.len());
        let first = ConsumeRow { tokens: row.tokens[..pending].to_vec(), ..row.clone() };
        self.consume(&first, inputs, Graph::Decode)?;
        let proposals = &row.tokens[pending..];
        for (j, &proposal) in proposals.iter().enumerate() {
            let drawn = self.completions.last().and_then(|c| c.sampled.last()).map(|s| s.token);
            let position = row.start + 1 + j as u32;
            if drawn != Some(proposal) {
                for p in position..row.start + 1 + proposals.len() as u32 {
                    let poison = u64::MAX ^ u64::from(p);
                    self.slot_of(&row.page_table, p)?.copy_from_slice(&poison.to_le_bytes());
                }
                break;
            }
            let next = ConsumeRow {
                live_row: row.live_row,
                start: position,
                tokens: vec![proposal],
                device_token: false,
                page_table: row.page_table.clone(),
                sample: Some(SampleSpec { counter: sample.counter + 1 + j as u32, ..sample }),
            };
            // A constrained row's lane samples under the grammar's state after the proposals
            // before it, as the device's per-lane masks say.
            match inputs.sampling.get(&sample.request) {
                Some(s) if s.mask.is_some() => {
                    let lane = s.lane_mask(sample.request, j + 1)?.cloned();
                    let mut lane_inputs = inputs.clone();
                    if let Some(entry) = lane_inputs.sampling.get_mut(&sample.request) {
                        entry.mask = lane;
                    }
                    self.consume(&next, &lane_inputs, Graph::Decode)?;
                }
                _ => self.consume(&next, inputs, Graph::Decode)?,
            }
        }
        Ok(())
    }

    fn consume(&mut self, row: &ConsumeRow, inputs: &StepInputs, graph: Graph) -> Result<(), ExecutorError> {
        let (mut state, consumed) = self.row_state(row.live_row)?;
        if consumed != u64::from(row.start) {
            return Err(ExecutorError::StaleRow {
                row: row.live_row,
                actual: consumed,
                expected: u64::from(row.start),
            });
        }
        let device = if row.device_token {
            if !self.device_fed {
                return Err(ExecutorError::DeviceFedUnsupported);
            }
            let token = self.pending.get(row.live_row as usize).copied().flatten();
            Some(token.ok_or(ExecutorError::NoPendingToken(row.live_row))?)
        } else {
            None
        };
        let rounding = if self.graph_rounding && graph == Graph::Decode { DECODE_ROUNDING } else { 0 };
        for (i, &token) in device.iter().chain(&row.tokens).enumerate() {
            let position = row.start + i as u32;
            let word = u64::from(token) | (u64::from(position) << 32);
            self.slot_of(&row.page_table, position)?.copy_from_slice(&word.to_le_bytes());
            state = splitmix(state ^ word ^ rounding);
        }
        self.set_row_state(row.live_row, state, consumed + row.len() as u64)?;
        if let Some(sample) = &row.sample {
            self.sample(row.live_row, &row.page_table, sample, inputs)?;
        }
        Ok(())
    }
}

/// Followers of earlier occurrences of the history's suffix, best first: longest match,
/// then most recent. With probability `min(0.5, 0.1 · temperature²)` (drawn from `h`) the
/// runner-up goes first, so higher temperatures wander more.
fn induction_candidates(history: &[u32], h: u64, temperature: f32) -> Vec<u32> {
    let n = history.len();
    let Some(&last) = history.last() else { return Vec::new() };
    let mut scored: Vec<(usize, usize, u32)> = Vec::new();
    for j in (0..n - 1).rev() {
        if history[j] != last {
            continue;
        }
        let mut len = 1;
        while len < INDUCTION_MAX_MATCH && len <= j && history[j - len] == history[n - 1 - len] {
            len += 1;
        }
        scored.push((len, j, history[j + 1]));
        if scored.len() >= INDUCTION_MAX_CANDIDATES {
            break;
        }
    }
    scored.sort_by(|a, b| b.0.cmp(&a.0).then(b.1.cmp(&a.1)));
    let mut out: Vec<u32> = Vec::with_capacity(scored.len());
    for (_, _, t) in scored {
        if !out.contains(&t) {
            out.push(t);
        }
    }
    // Break runs: after three equal tokens, a fourth is not proposed.
    if n >= 3 && history[n - 3..].iter().all(|&t| t == last) {
        out.retain(|&t| t != last);
    }
    let swap = (0.1 * f64::from(temperature) * f64::from(temperature)).min(0.5);
    if out.len() > 1 && ((h >> 40) as f64 / (1u64 << 24) as f64) < swap {
        out.swap(0, 1);
    }
    out
}

/// The `(h mod min(allowed, window))`-th allowed id below `vocab`.
fn nth_allowed(mask: &[u32], vocab: u32, h: u64, window: u64) -> Option<u32> {
    let count = |w: u32, i: usize| {
        let base = i as u32 * 32;
        if base >= vocab {
            0
        } else if vocab - base >= 32 {
            w.count_ones()
        } else {
            (w & ((1u32 << (vocab - base)) - 1)).count_ones()
        }
    };
    let total: u64 = mask.iter().enumerate().map(|(i, &w)| u64::from(count(w, i))).sum();
    if total == 0 {
        return None;
    }
    let mut k = (h % total.min(window)) as u32;
    for (i, &w) in mask.iter().enumerate() {
        let c = count(w, i);
        if k < c {
            let mut bits = w;
            for _ in 0..k {
                bits &= bits - 1;
            }
            return Some(i as u32 * 32 + bits.trailing_zeros());
        }
        k -= c;
    }
    None
}

impl Executor for SimulatedExecutor {
    fn submit(&mut self, step: &Step, inputs: &StepInputs) -> Result<(), ExecutorError> {
        if !self.step_time.is_zero() {
            std::thread::sleep(self.step_time);
        }
        self.completions.push(Completion { fence: step.fence, sampled: Vec::new() });
        for op in &step.ops {
            match op {
                StepOp::Initialize { live_row, rows } => {
                    for r in *live_row..live_row + rows {
                        self.copy_row(0, r)?;
                        self.clear_pending(r);
                    }
                }
                StepOp::Restore { snapshot_row, live_row, tail, consumed, epoch } => {
                    let op = helios_contract::model::MaintenanceOp::Restore;
                    self.checkpoint(op, *snapshot_row, *live_row, (*consumed, *epoch))?;
                    self.clear_pending(*live_row);
                    if let Some(copy) = tail {
                        self.copy_page(copy.source, copy.destination)?;
                    }
                }
                StepOp::Snapshot { live_row, snapshot_row, tail, consumed, epoch } => {
                    let op = helios_contract::model::MaintenanceOp::Snapshot;
                    self.checkpoint(op, *live_row, *snapshot_row, (*consumed, *epoch))?;
                    if let Some(copy) = tail {
                        self.copy_page(copy.source, copy.destination)?;
                    }
                }
                StepOp::Decode { rows, .. } => {
                    for row in rows {
                        self.consume(row, inputs, Graph::Decode)?;
                    }
                }
                StepOp::Prefill { row, .. } => self.consume(row, inputs, Graph::Prefill)?,
                StepOp::Verify { program, rows } => {
                    let fits = rows.len() as u32 <= program.requests
                        && rows.iter().all(|r| r.proposals() as u32 <= program.depth);
                    if !fits {
                        return Err(ExecutorError::NoSpeculativeProgram(*program));
                    }
                    for row in rows {
                        self.verify(row, inputs)?;
                    }
                }
                StepOp::ResumeSampling { live_row, consumed, page_table, sample } => {
                    let (_, actual) = self.row_state(*live_row)?;
                    if actual != u64::from(*consumed) {
                        return Err(ExecutorError::StaleRow { row: *live_row, actual, expected: u64::from(*consumed) });
                    }
                    self.sample(*live_row, page_table, sample, inputs)?;
                }
                StepOp::AdmitHistogram { live_row, .. } => {
                    self.row_state(*live_row)?;
                }
                StepOp::CopyOut { pages, rows } => self.transfer(pages, rows, true)?,
                StepOp::CopyIn { pages, rows } => {
                    let pages: Vec<(u32, HostExtent)> = pages.iter().map(|&(e, p)| (p, e)).collect();
                    let rows: Vec<(u32, HostExtent)> = rows.iter().map(|&(e, r)| (r, e)).collect();
                    self.transfer(&pages, &rows, false)?;
                }
            }
        }
        Ok(())
    }

    fn poll(&mut self) -> Result<Vec<Completion>, ExecutorError> {
        let ready = self.completions.len().saturating_sub(self.completion_lag);
        Ok(self.completions.drain(..ready).collect())
    }

    fn synchronize(&mut self) -> Result<Vec<Completion>, ExecutorError> {
        Ok(std::mem::take(&mut self.completions))
    }

    fn wait(&mut self) -> Result<Vec<Completion>, ExecutorError> {
        let ready = self.completions.len().saturating_sub(self.completion_lag).max(1).min(self.completions.len());
        Ok(self.completions.drain(..ready).collect())
    }

    fn device_fed_decode(&self) -> bool {
        self.device_fed
    }

    fn attach_host_arena(&mut self, arena: Arc<HostArena>, geometry: StoreGeometry) -> Result<(), ExecutorError> {
        let page = self.pages.first().map_or(0, Vec::len) as u64;
        let row = self.rows.first().map_or(0, Vec::len) as u64;
        if geometry.bytes_per_page < page || geometry.continuation_row_bytes < row {
            return Err(ExecutorError::TransferGeometry {
                page_bytes: geometry.bytes_per_page,
                row_bytes: geometry.continuation_row_bytes,
            });
        }
        self.host = Some(arena);
        Ok(())
    }
}

/// The three reference geometries: 64-token attention pages, 256-token pages, and a hybrid
/// with recurrent rows, verification width 2 and 32-token pages (partial tails everywhere).
/// Test support (feature `testkit`).
#[cfg(any(test, feature = "testkit"))]
pub fn reference_schemes() -> Vec<CacheScheme> {
    use helios_contract::model::{PageRegion, RowRegion, RowRegionKind};

    let attention = |page_tokens: u32| CacheScheme {
        page_tokens,
        page_regions: vec![PageRegion { name: "kv".into(), bytes_per_page: u64::from(page_tokens) * 8 }],
        continuation_row_bytes: 16,
        row_layout: vec![RowRegion {
            name: "hidden".into(),
            kind: RowRegionKind::HiddenVector,
            offset: 0,
            byte_size: 16,
        }],
        null_row: 0,
        live_rows_per_slot: 1,
        verification_width: 1,
        padding_slot: -1,
    };
    let mut hybrid = attention(32);
    hybrid.continuation_row_bytes = 48;
    hybrid.row_layout = vec![
        RowRegion { name: "recurrent".into(), kind: RowRegionKind::RecurrentState, offset: 0, byte_size: 16 },
        RowRegion { name: "conv".into(), kind: RowRegionKind::ConvolutionHistory, offset: 16, byte_size: 16 },
        RowRegion { name: "tail".into(), kind: RowRegionKind::PartialPage, offset: 32, byte_size: 16 },
    ];
    hybrid.verification_width = 2;
    vec![attention(64), attention(256), hybrid]
}

/// `len` pseudo-random token ids below `vocab`, a function of `seed` (feature `testkit`).
#[cfg(any(test, feature = "testkit"))]
pub fn seeded_tokens(seed: u64, len: usize, vocab: u32) -> Vec<u32> {
    (0..len as u64).map(|i| (splitmix(seed ^ (i << 20)) % u64::from(vocab)) as u32).collect()
}

/// Capacities for tests: `pages` KV pages, `snapshots` snapshot rows (feature `testkit`).
#[cfg(any(test, feature = "testkit"))]
pub fn test_capacities(slots: u32, pages: u32, snapshots: u32) -> Capacities {
    Capacities {
        context_limit: 1024,
        decode_request_buckets: vec![1, 2, 4, 8],
        prefill_chunk_capacities: vec![16, 64, 128],
        image_patch_buckets: vec![],
        request_slots: slots,
        snapshot_rows: snapshots,
        max_kv_pages: pages,
        vocab_size: 97,
        completion_record_header_words: 0,
        speculative_programs: vec![],
    }
}

/// An executor that records what it runs (feature `testkit`): every submitted step, and how
/// many sampling steps were in flight at once, for tests that check planning through the
/// serving loop.
#[cfg(any(test, feature = "testkit"))]
#[derive(Debug)]
pub struct StepLog<E> {
    pub inner: E,
    /// Every step submitted, in order.
    pub steps: Vec<Step>,
    /// Submitted steps that sample, whose completions have not been returned yet.
    pub sampling_in_flight: usize,
    /// The most `sampling_in_flight` ever was.
    pub most_sampling_in_flight: usize,
}

#[cfg(any(test, feature = "testkit"))]
impl<E: Executor> StepLog<E> {
    pub fn new(inner: E) -> Self {
        StepLog { inner, steps: Vec::new(), sampling_in_flight: 0, most_sampling_in_flight: 0 }
    }

    fn landed(&mut self, done: Vec<Completion>) -> Vec<Completion> {
        self.sampling_in_flight -= done.iter().filter(|c| !c.sampled.is_empty()).count();
        done
    }
}

#[cfg(any(test, feature = "testkit"))]
impl<E: Executor> Executor for StepLog<E> {
    fn submit(&mut self, step: &Step, inputs: &StepInputs) -> Result<(), ExecutorError> {
        self.inner.submit(step, inputs)?;
        let samples = step.ops.iter().any(|op| {
            matches!(op, StepOp::Decode { .. } | StepOp::Verify { .. } | StepOp::ResumeSampling { .. })
                || matches!(op, StepOp::Prefill { row, .. } if row.sample.is_some())
        });
        self.sampling_in_flight += usize::from(samples);
        self.most_sampling_in_flight = self.most_sampling_in_flight.max(self.sampling_in_flight);
        self.steps.push(step.clone());
        Ok(())
    }
    fn poll(&mut self) -> Result<Vec<Completion>, ExecutorError> {
        let done = self.inner.poll()?;
        Ok(self.landed(done))
    }
    fn synchronize(&mut self) -> Result<Vec<Completion>, ExecutorError> {
        let done = self.inner.synchronize()?;
        Ok(self.landed(done))
    }
    fn wait(&mut self) -> Result<Vec<Completion>, ExecutorError> {
        let done = self.inner.wait()?;
        Ok(self.landed(done))
    }
    fn device_fed_decode(&self) -> bool {
        self.inner.device_fed_decode()
    }
    fn kv_pages(&self) -> Option<u32> {
        self.inner.kv_pages()
    }
    fn attach_host_arena(&mut self, arena: Arc<HostArena>, geometry: StoreGeometry) -> Result<(), ExecutorError> {
        self.inner.attach_host_arena(arena, geometry)
    }
    fn device_memory_growth_bytes(&mut self) -> Option<i64> {
        self.inner.device_memory_growth_bytes()
    }
    fn unified_memory(&self) -> bool {
        self.inner.unified_memory()
    }
    fn measure_step(&mut self, op: &StepOp, reps: u32) -> Result<Option<std::time::Duration>, ExecutorError> {
        self.inner.measure_step(op, reps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn induction_copies_the_longest_match() {
        // ... 7 8 9 | 1 7 8 5 | 7 8 -> longest match "7 8" twice; the most recent one is followed by 5.
        let history = [7, 8, 9, 1, 7, 8, 5, 7, 8];
        assert_eq!(induction_candidates(&history, u64::MAX, 1.0), vec![5, 9]);
        // A low draw at temperature 1 (p = 0.1) prefers the runner-up.
        assert_eq!(induction_candidates(&history, 0, 1.0), vec![9, 5]);
        assert_eq!(induction_candidates(&history, 1 << 63, 0.01), vec![5, 9]);
        // Unseen last token: no candidates.
        assert!(induction_candidates(&[1, 2, 3], 0, 1.0).is_empty());
        // Runs of three end.
        assert_eq!(induction_candidates(&[4, 4, 4, 4], u64::MAX, 1.0), Vec::<u32>::new());
    }

    /// A step time makes every submission last at least that long; none by default.
    #[test]
    fn a_step_time_paces_every_submission() {
        let scheme = reference_schemes().remove(0);
        let caps = test_capacities(2, 8, 2);
        let init =
            |fence| Step { fence: helios_cache::Fence(fence), ops: vec![StepOp::Initialize { live_row: 1, rows: 1 }] };
        let mut paced = SimulatedExecutor::new(&scheme, &caps).with_step_time(Duration::from_millis(20));
        let started = std::time::Instant::now();
        for fence in 1..=3 {
            paced.submit(&init(fence), &StepInputs::default()).expect("submit");
        }
        assert!(started.elapsed() >= Duration::from_millis(60), "{:?}", started.elapsed());
        assert_eq!(paced.synchronize().expect("synchronize").len(), 3);
        assert_eq!(SimulatedExecutor::new(&scheme, &caps).step_time, Duration::ZERO);
    }

    #[test]
    fn nth_allowed_walks_set_bits_below_vocab() {
        let mut mask = vec![0u32; 3];
        for id in [3u32, 40, 70, 95] {
            mask[id as usize / 32] |= 1 << (id % 32);
        }
        let picks: Vec<u32> = (0..4).map(|h| nth_allowed(&mask, 90, h, u64::MAX).expect("allowed")).collect();
        assert_eq!(picks, vec![3, 40, 70, 3]);
        let low: Vec<u32> = (0..3).map(|h| nth_allowed(&mask, 90, h, 2).expect("allowed")).collect();
        assert_eq!(low, vec![3, 40, 3]);
        assert_eq!(nth_allowed(&[0, 0], 64, 5, u64::MAX), None);
    }

    /// A constrained verify row samples each lane under its own mask: lane 0 under the row's,
    /// lane j under the grammar's state after j proposals; a missing lane mask is refused.
    #[test]
    fn a_constrained_verify_row_samples_each_lane_under_its_mask() {
        use helios_contract::model::SpeculativeProgram;
        let scheme = reference_schemes().remove(0);
        let caps = Capacities {
            speculative_programs: vec![SpeculativeProgram::rectangular(1, 3)],
            ..test_capacities(2, 8, 2)
        };
        let only = |id: u32| -> Arc<[u32]> {
            let mut m = vec![0u32; caps.vocab_size.div_ceil(32) as usize];
            m[id as usize / 32] |= 1 << (id % 32);
            m.into()
        };
        let request = RequestId(3);
        let row = |tokens: Vec<u32>| ConsumeRow {
            live_row: 1,
            start: 3,
            tokens,
            device_token: false,
            page_table: vec![0],
            sample: Some(SampleSpec { request, seed: 9, counter: 1 }),
        };
        let program = SpeculativeProgram::rectangular(1, 3);
        let run = |lane_masks: Vec<Arc<[u32]>>| {
            let mut executor = SimulatedExecutor::new(&scheme, &caps);
            let prefill = ConsumeRow { sample: None, ..row(vec![5, 6, 7]) };
            let prefill = ConsumeRow { start: 0, ..prefill };
            let setup =
                vec![StepOp::Initialize { live_row: 1, rows: 1 }, StepOp::Prefill { capacity: 16, row: prefill }];
            executor.submit(&Step { fence: helios_cache::Fence(1), ops: setup }, &StepInputs::default())?;
            let mut inputs = StepInputs::default();
            let sampling = RowSampling { mask: Some(only(11)), proposal_masks: lane_masks, ..RowSampling::default() };
            inputs.sampling.insert(request, sampling);
            // The proposals are what the masks force, so each lane's sample equals the next.
            let verify = StepOp::Verify { program, rows: vec![row(vec![8, 11, 12, 13])] };
            executor.submit(&Step { fence: helios_cache::Fence(2), ops: vec![verify] }, &inputs)?;
            Ok::<_, ExecutorError>(
                executor.synchronize()?.into_iter().flat_map(|c| c.sampled).map(|s| s.token).collect::<Vec<_>>(),
            )
        };
        assert_eq!(run(vec![only(12), only(13), only(14)]), Ok(vec![11, 12, 13, 14]));
        // Lane 2 may sample only 20: the round stops there, emitting it.
        assert_eq!(run(vec![only(12), only(20), only(14)]), Ok(vec![11, 12, 20]));
        assert_eq!(run(vec![only(12)]), Err(ExecutorError::MissingLaneMask { request: 3, lane: 2 }));
    }

    /// Snapshot and restore check the rows' stamps as a stamping device does, and the stamp
    /// travels with the row through the host tier.
    #[test]
    fn checkpoints_check_and_carry_stamps() {
        use helios_contract::model::MaintenanceOp;
        use helios_offload::{HostArena, UNIT_BYTES};
        let scheme = reference_schemes().remove(0);
        let caps = test_capacities(2, 8, 2);
        let mut executor = SimulatedExecutor::new(&scheme, &caps);
        let snap = scheme.snapshot_row(caps.request_slots, 0);
        let fence = |f| helios_cache::Fence(f);
        let prefill = ConsumeRow {
            live_row: 1,
            start: 0,
            tokens: vec![5, 6, 7],
            device_token: false,
            page_table: vec![0],
            sample: None,
        };
        let epoch = 0xfeed_beef;
        let snapshot =
            |consumed, epoch, row| StepOp::Snapshot { live_row: 1, snapshot_row: row, tail: None, consumed, epoch };
        let restore =
            |consumed, epoch| StepOp::Restore { snapshot_row: snap, live_row: 2, tail: None, consumed, epoch };
        let run = |e: &mut SimulatedExecutor, f, ops| e.submit(&Step { fence: fence(f), ops }, &StepInputs::default());
        run(
            &mut executor,
            1,
            vec![
                StepOp::Initialize { live_row: 1, rows: 1 },
                StepOp::Prefill { capacity: 16, row: prefill },
                snapshot(3, epoch, snap),
            ],
        )
        .expect("fills and snapshots");
        assert_eq!((executor.stamp(1), executor.stamp(snap)), (Ok((3, 0)), Ok((3, epoch))));

        // A wrong consumed count (snapshot), a wrong count and a wrong epoch (restore).
        let rejected = |op, source_row, destination_row, expected, found| {
            Err(ExecutorError::CheckpointRejected { op, source_row, destination_row, expected, found })
        };
        assert_eq!(
            run(&mut executor, 2, vec![snapshot(4, epoch, snap + 1)]),
            rejected(MaintenanceOp::Snapshot, 1, snap + 1, (4, epoch), (3, 0))
        );
        assert_eq!(executor.stamp(snap + 1), Ok((0, 0)), "nothing written");
        for (consumed, e) in [(2, epoch), (3, epoch + 1)] {
            assert_eq!(
                run(&mut executor, 3, vec![restore(consumed, e)]),
                rejected(MaintenanceOp::Restore, snap, 2, (consumed, e), (3, epoch))
            );
            assert_eq!(executor.stamp(2), Ok((0, 0)), "nothing written");
        }
        // Rows of the wrong kind.
        let backwards = StepOp::Snapshot { live_row: snap, snapshot_row: 1, tail: None, consumed: 3, epoch };
        assert_eq!(run(&mut executor, 4, vec![backwards]), Err(ExecutorError::BadRow(snap)));

        // Out to the host and back into the other snapshot row: the stamp came along.
        let arena = Arc::new(HostArena::new(4 * UNIT_BYTES).expect("host arena"));
        let geometry = StoreGeometry::from(&scheme);
        executor.attach_host_arena(arena, geometry).expect("attaches");
        let extent = HostExtent { offset: 0, len: UNIT_BYTES };
        run(&mut executor, 5, vec![StepOp::CopyOut { pages: vec![], rows: vec![(snap, extent)] }]).expect("runs");
        run(&mut executor, 6, vec![StepOp::CopyIn { pages: vec![], rows: vec![(extent, snap + 1)] }]).expect("runs");
        assert_eq!(executor.stamp(snap + 1), Ok((3, epoch)));
        let restore_copy = StepOp::Restore { snapshot_row: snap + 1, live_row: 2, tail: None, consumed: 3, epoch };
        run(&mut executor, 7, vec![restore_copy]).expect("runs");
        assert_eq!(executor.stamp(2), Ok((3, epoch)));
    }

    #[test]
    fn masked_sampling_obeys_the_mask() {
        let scheme = reference_schemes().remove(0);
        let caps = test_capacities(1, 4, 1);
        for model in [SimModel::Hash, SimModel::Induction] {
            let mut executor = SimulatedExecutor::new(&scheme, &caps).with_model(model);
            let request = RequestId(3);
            let mut mask = vec![0u32; 4];
            mask[1] |= 1 << 2; // only id 34
            let mut inputs = StepInputs::default();
            inputs.sampling.insert(request, RowSampling { mask: Some(mask.into()), ..Default::default() });
            let sample = Some(SampleSpec { request, seed: 9, counter: 0 });
            let row = ConsumeRow {
                live_row: 1,
                start: 0,
                tokens: vec![5, 6, 5],
                device_token: false,
                page_table: vec![0],
                sample,
            };
            let step = Step {
                fence: helios_cache::Fence(1),
                ops: vec![StepOp::Initialize { live_row: 1, rows: 1 }, StepOp::Prefill { capacity: 16, row }],
            };
            executor.submit(&step, &inputs).expect("submits");
            let done = executor.synchronize().expect("completes");
            assert_eq!(done[0].sampled, vec![SampledToken { request, token: 34 }]);
        }
    }
}
