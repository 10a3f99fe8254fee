//! helios-replay: the [`Executor`] trait and a simulated executor with real byte storage.
//!
//! The simulated model's next token is a hash of the live row's recurrent state (every
//! consumed token and position), of every page slot the request's page table addresses for
//! its consumed positions, and of the request's seed and sampling counter. Any wrong page,
//! stale row, off-by-one endpoint or lost token changes the output.

use helios_contract::model::{CacheScheme, Capacities, PageRegion, RowRegion, RowRegionKind};
use helios_scheduler::{Completion, ConsumeRow, SampleSpec, SampledToken, Scheduler, Step, StepOp};

pub mod workload;

/// Runs planned steps. A CUDA executor implements the same contract.
pub trait Executor {
    /// Submits one step; ops run in order.
    fn submit(&mut self, step: &Step) -> Result<(), ExecutorError>;
    /// Completions of finished steps, in fence order (non-blocking).
    fn poll(&mut self) -> Vec<Completion>;
    /// Waits for every submitted step; returns their completions in fence order.
    fn synchronize(&mut self) -> Vec<Completion>;
}

/// Executor failures: metadata that does not match the storage it addresses.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ExecutorError {
    #[error("row {row} holds {actual} consumed tokens, step expects {expected}")]
    StaleRow { row: u32, actual: u64, expected: u64 },
    #[error("row {0} outside the pool or is the null row")]
    BadRow(u32),
    #[error("page {0} outside the pool")]
    BadPage(u32),
    #[error("position {position} beyond page table of {pages} pages")]
    PageTableShort { position: u32, pages: usize },
}

const TOKEN_BYTES: usize = 8;
const ROW_STATE_BYTES: u64 = 16;

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// CPU stand-in for the device: pages of `page_tokens × (token, position)` words and rows
/// of `[recurrent hash, consumed count, …]`. Completes each step on submission.
#[derive(Debug)]
pub struct SimulatedExecutor {
    page_tokens: usize,
    vocab: u32,
    pages: Vec<Vec<u8>>,
    rows: Vec<Vec<u8>>,
    completions: Vec<Completion>,
    /// Completions are reported only once this many later steps were submitted.
    completion_lag: usize,
}

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
            completions: Vec::new(),
            completion_lag: 0,
        }
    }

    fn row_state(&self, row: u32) -> Result<(u64, u64), ExecutorError> {
        let r = self.rows.get(row as usize).ok_or(ExecutorError::BadRow(row))?;
        let word = |i: usize| u64::from_le_bytes(r[i * 8..i * 8 + 8].try_into().unwrap_or_default());
        Ok((word(0), word(1)))
    }

    fn set_row_state(&mut self, row: u32, hash: u64, consumed: u64) -> Result<(), ExecutorError> {
        if row == 0 {
            return Err(ExecutorError::BadRow(row));
        }
        let r = self.rows.get_mut(row as usize).ok_or(ExecutorError::BadRow(row))?;
        r[0..8].copy_from_slice(&hash.to_le_bytes());
        r[8..16].copy_from_slice(&consumed.to_le_bytes());
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

    fn copy_page(&mut self, from: u32, to: u32) -> Result<(), ExecutorError> {
        let source = self.pages.get(from as usize).ok_or(ExecutorError::BadPage(from))?.clone();
        self.pages.get_mut(to as usize).ok_or(ExecutorError::BadPage(to))?.copy_from_slice(&source);
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

    fn sample(&mut self, row: u32, page_table: &[u32], sample: &SampleSpec) -> Result<(), ExecutorError> {
        let (state, consumed) = self.row_state(row)?;
        let attention = self.attention(page_table, consumed as u32)?;
        let h = splitmix(state ^ splitmix(attention ^ splitmix(sample.seed ^ (u64::from(sample.counter) << 32))));
        let token = (h % u64::from(self.vocab)) as u32;
        if let Some(c) = self.completions.last_mut() {
            c.sampled.push(SampledToken { request: sample.request, token });
        }
        Ok(())
    }

    fn consume(&mut self, row: &ConsumeRow) -> Result<(), ExecutorError> {
        let (mut state, consumed) = self.row_state(row.live_row)?;
        if consumed != u64::from(row.start) {
            return Err(ExecutorError::StaleRow {
                row: row.live_row,
                actual: consumed,
                expected: u64::from(row.start),
            });
        }
        for (i, &token) in row.tokens.iter().enumerate() {
            let position = row.start + i as u32;
            let word = u64::from(token) | (u64::from(position) << 32);
            self.slot_of(&row.page_table, position)?.copy_from_slice(&word.to_le_bytes());
            state = splitmix(state ^ word);
        }
        self.set_row_state(row.live_row, state, consumed + row.tokens.len() as u64)?;
        if let Some(sample) = &row.sample {
            self.sample(row.live_row, &row.page_table, sample)?;
        }
        Ok(())
    }
}

impl Executor for SimulatedExecutor {
    fn submit(&mut self, step: &Step) -> Result<(), ExecutorError> {
        self.completions.push(Completion { fence: step.fence, sampled: Vec::new() });
        for op in &step.ops {
            match op {
                StepOp::Initialize { live_row, rows } => {
                    for r in *live_row..live_row + rows {
                        self.copy_row(0, r)?;
                    }
                }
                StepOp::Restore { snapshot_row, live_row, tail } => {
                    self.copy_row(*snapshot_row, *live_row)?;
                    if let Some(copy) = tail {
                        self.copy_page(copy.source, copy.destination)?;
                    }
                }
                StepOp::Snapshot { live_row, snapshot_row, tail } => {
                    self.copy_row(*live_row, *snapshot_row)?;
                    if let Some(copy) = tail {
                        self.copy_page(copy.source, copy.destination)?;
                    }
                }
                StepOp::Decode { rows, .. } => {
                    for row in rows {
                        self.consume(row)?;
                    }
                }
                StepOp::Prefill { row, .. } => self.consume(row)?,
                StepOp::ResumeSampling { live_row, consumed, page_table, sample } => {
                    let (_, actual) = self.row_state(*live_row)?;
                    if actual != u64::from(*consumed) {
                        return Err(ExecutorError::StaleRow { row: *live_row, actual, expected: u64::from(*consumed) });
                    }
                    self.sample(*live_row, page_table, sample)?;
                }
            }
        }
        Ok(())
    }

    fn poll(&mut self) -> Vec<Completion> {
        let ready = self.completions.len().saturating_sub(self.completion_lag);
        self.completions.drain(..ready).collect()
    }

    fn synchronize(&mut self) -> Vec<Completion> {
        std::mem::take(&mut self.completions)
    }
}

/// One serving-loop turn: apply completions, plan, submit; with nothing to plan, wait for
/// the executor. Returns whether anything happened.
pub fn turn<E: Executor>(scheduler: &mut Scheduler, executor: &mut E) -> Result<bool, ExecutorError> {
    for completion in executor.poll() {
        scheduler.complete(&completion);
    }
    match scheduler.schedule() {
        Some(step) => {
            executor.submit(&step)?;
            for completion in executor.poll() {
                scheduler.complete(&completion);
            }
            Ok(true)
        }
        None => {
            let completions = executor.synchronize();
            for completion in &completions {
                scheduler.complete(completion);
            }
            Ok(!completions.is_empty())
        }
    }
}

/// The three reference geometries: 64-token attention pages, 256-token pages, and a hybrid
/// with recurrent rows, verification width 2 and 32-token pages (partial tails everywhere).
pub fn reference_schemes() -> Vec<CacheScheme> {
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

/// Capacities for tests: `pages` KV pages, `snapshots` snapshot rows.
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
    }
}
