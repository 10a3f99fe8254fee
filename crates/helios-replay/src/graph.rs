//! The executor over a core's prepared graphs, independent of where the graphs run.
//!
//! [`GraphExecutor`] turns each planned [`StepOp`] into one graph replay: it packs the
//! request metadata into the host mirror of the staging buffer through the
//! [`BoundContract`] views, uploads it, replays the captured graph, and copies the completion
//! records back behind it ([`helios_contract::record`]). A [`GraphBackend`] supplies storage
//! and replay: the CUDA [`crate::cuda::DeviceCore`], or a CPU emulation in tests.
//!
//! Steps stay in flight: `submit` only enqueues, and a step completes once every records copy
//! it enqueued has landed ([`Executor::poll`], [`Executor::wait`]). At most
//! [`MAX_STEPS_IN_FLIGHT`] steps are outstanding; a further `submit` first waits for the
//! oldest. With cores whose graphs keep the pending token on the device, decode rows may be
//! device-fed (a negative token id), so the scheduler can plan a step before the previous
//! step's samples arrive.
//!
//! Conventions this executor fixes (the contract leaves them to the executor):
//! - a KV page `p` is the byte range `p * bytes_per_page ..` of the core's `KvPages` buffer,
//!   regions in declaration order inside it; checkpoint tail copies copy whole pages;
//! - a row `r` is the byte range `r * continuation_row_bytes ..` of the `ContinuationRows`
//!   buffer; host transfers copy whole pages and whole rows, in step order with the replays;
//! - rows the scheduler did not fill are padded with `padding_slot` (slots, slot mappings)
//!   or `-1` (page tables, rows), zero for counts, and records are cleared before each replay,
//!   so a record the graph did not write is rejected rather than read stale;
//! - a [`StepOp::Verify`] replays the speculative graph captured for exactly its program's
//!   (requests, depth), packing per lane with stride `W = depth + 1`: request `i`'s tokens
//!   (`-1` first for a device-fed row, then its [`ConsumeRow`] tokens) at lanes `i*W + j` with
//!   positions `start + j`; unused lanes hold token `-1`, position 0. Each record's tokens,
//!   accepted proposals and then the token that ended the round, become that many
//!   [`SampledToken`]s in order;
//! - checkpoint stamps: a restore or snapshot graph that binds `CheckpointEpoch` gets the
//!   step's `(consumed, epoch)` in `ExpectedConsumed` and `CheckpointEpoch` (the epoch's bits
//!   as an i32); one that does not gets `ExpectedConsumed = -1` and checks nothing, as every
//!   core did before stamps. A maintenance graph that binds `CompletionRecords` (initialize,
//!   restore, snapshot) has its status record cleared before the replay and read back like
//!   sampling records: a rejected op fails its step with [`ExecutorError::CheckpointRejected`],
//!   a record not written with [`ExecutorError::Record`].

use helios_contract::model::{
    BufferId, BufferRole, GraphId, GraphKind, MaintenanceOp, Manifest, SpeculativeProgram, ValueKind,
};
use helios_contract::record::{CompletionRecord, FLAG_CHECKPOINT_REJECTED, FLAG_SAMPLED, RecordError};
use helios_contract::{BoundContract, BoundGraph, ByteView, Element};
use helios_offload::{HostArena, HostExtent, StoreGeometry};
use std::collections::VecDeque;
use std::sync::Arc;

use helios_cache::Fence;
use helios_scheduler::{Completion, ConsumeRow, RequestId, SampleSpec, SampledToken, Step, StepOp};

use crate::{Executor, ExecutorError, RowSampling, StepInputs};

/// Steps submitted and not yet completed, at most.
pub const MAX_STEPS_IN_FLIGHT: usize = 2;

/// A host copy of device bytes the backend enqueued ([`GraphBackend::read_later`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ReadTicket(pub u64);

/// Storage and graph replay for a [`GraphExecutor`].
pub trait GraphBackend {
    /// Writes `bytes` into `buffer` at `offset`.
    fn write(&mut self, buffer: BufferId, offset: u64, bytes: &[u8]) -> Result<(), ExecutorError>;
    /// Reads `len` bytes of `buffer` at `offset`, after everything enqueued finished.
    fn read(&mut self, buffer: BufferId, offset: u64, len: u64) -> Result<Vec<u8>, ExecutorError>;
    /// Copies between two buffer ranges, ordered after earlier replays.
    fn copy(&mut self, src: (BufferId, u64), dst: (BufferId, u64), len: u64) -> Result<(), ExecutorError>;
    /// Enqueues one replay.
    fn replay(&mut self, graph: GraphId) -> Result<(), ExecutorError>;
    /// Enqueues a host copy of `len` bytes of `buffer` at `offset`, ordered after everything
    /// enqueued before it. `None`: the backend cannot defer, so the executor reads at once.
    fn read_later(&mut self, buffer: BufferId, offset: u64, len: u64) -> Result<Option<ReadTicket>, ExecutorError> {
        let _ = (buffer, offset, len);
        Ok(None)
    }
    /// The bytes of a ticket once its copy landed (`None` while in flight; `wait` blocks until
    /// it has). Each ticket is taken once.
    fn take_read(&mut self, ticket: ReadTicket, wait: bool) -> Result<Option<Vec<u8>>, ExecutorError> {
        let _ = wait;
        Err(ExecutorError::UnknownRead(ticket.0))
    }
    /// See [`Executor::device_memory_growth_bytes`].
    fn device_memory_growth_bytes(&mut self) -> Option<i64> {
        None
    }
    /// See [`Executor::kv_pages`].
    fn kv_pages(&self) -> Option<u32> {
        None
    }
    /// See [`Executor::attach_host_arena`]. The default has no host transfers.
    fn attach_host_arena(&mut self, arena: Arc<HostArena>) -> Result<(), ExecutorError> {
        let _ = arena;
        Err(ExecutorError::NoHostTransfers)
    }
    /// See [`Executor::unified_memory`].
    fn unified_memory(&self) -> bool {
        false
    }
    /// Enqueues a copy of `dst.len` bytes of `src` into a host extent of the attached arena,
    /// ordered after everything enqueued before it and before everything after.
    fn copy_to_host(&mut self, src: (BufferId, u64), dst: HostExtent) -> Result<(), ExecutorError> {
        let _ = (src, dst);
        Err(ExecutorError::NoHostTransfers)
    }
    /// Called after a step's ops were enqueued: work enqueued later (the next step, and a read
    /// that marks this step's completion) must wait for every transfer the step started.
    fn end_step(&mut self) -> Result<(), ExecutorError> {
        Ok(())
    }
    /// Enqueues a copy of a host extent of the attached arena into `dst`, ordered likewise.
    fn copy_from_host(&mut self, src: HostExtent, dst: (BufferId, u64)) -> Result<(), ExecutorError> {
        let _ = (src, dst);
        Err(ExecutorError::NoHostTransfers)
    }
}

/// Records of one sampling replay: where their bytes are and whose samples they hold.
#[derive(Debug)]
struct RecordRead {
    bytes: Option<Vec<u8>>,
    ticket: Option<ReadTicket>,
    width: usize,
    token_capacity: u32,
    /// Per graph row, the request it samples for and the most tokens its record may emit.
    rows: Vec<Option<(RequestId, usize)>>,
    /// A maintenance replay's status record (then `rows` is empty): what the op was asked.
    status: Option<CheckpointOp>,
}

/// One maintenance op whose status record is read back.
#[derive(Clone, Copy, Debug)]
struct CheckpointOp {
    op: MaintenanceOp,
    /// The null row for initialize.
    source_row: u32,
    destination_row: u32,
    /// The checkpoint's (consumed, epoch) the step carried; (0, 0) for initialize.
    expected: (u32, u32),
}

#[derive(Debug)]
struct InFlight {
    fence: Fence,
    reads: Vec<RecordRead>,
}

/// Replays steps through a backend, keeping up to [`MAX_STEPS_IN_FLIGHT`] in flight.
#[derive(Debug)]
pub struct GraphExecutor<B> {
    backend: B,
    manifest: Manifest,
    bound: BoundContract,
    staging: BufferId,
    staging_mirror: Vec<u8>,
    kv: Option<BufferId>,
    rows_buffer: Option<BufferId>,
    in_flight: VecDeque<InFlight>,
    /// Completed steps not yet handed out, in fence order.
    ready: Vec<Completion>,
    device_fed: bool,
}

/// A manifest the executor cannot drive.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GraphExecutorError {
    #[error("the core has no staging-inputs buffer")]
    NoStaging,
    #[error("staging views live in {0} buffers; one staging buffer is supported")]
    SplitStaging(usize),
}

impl<B: GraphBackend> GraphExecutor<B> {
    pub fn new(manifest: &Manifest, backend: B) -> Result<Self, GraphExecutorError> {
        let bound = BoundContract::bind(manifest);
        let mut staging: Vec<BufferId> =
            bound.graphs().iter().flat_map(|g| g.inputs().map(|(_, v)| v.buffer).collect::<Vec<_>>()).collect();
        staging.sort_unstable_by_key(|b| b.0);
        staging.dedup();
        let id = match staging.as_slice() {
            [one] => *one,
            [] => {
                manifest
                    .buffers
                    .iter()
                    .find(|b| b.role == BufferRole::StagingInputs)
                    .ok_or(GraphExecutorError::NoStaging)?
                    .id
            }
            many => return Err(GraphExecutorError::SplitStaging(many.len())),
        };
        let size = manifest.buffer(id).map_or(0, |b| b.byte_size) as usize;
        let kv = manifest.buffers.iter().find(|b| b.role == BufferRole::KvPages).map(|b| b.id);
        let rows_buffer = manifest.buffers.iter().find(|b| b.role == BufferRole::ContinuationRows).map(|b| b.id);
        let of = |kinds: &'static [GraphKind]| bound.graphs().iter().filter(move |g| kinds.contains(&g.kind));
        // A device-fed row may land in a decode or a speculative step, and the step after it
        // reads what any sampling graph stored.
        use GraphKind as K;
        let device_fed = of(&[K::Decode, K::Prefill, K::ResumeSampling, K::Speculative])
            .all(|g| g.writes_pending_token())
            && of(&[K::Decode, K::Speculative]).all(|g| g.reads_pending_token());
        Ok(GraphExecutor {
            backend,
            manifest: manifest.clone(),
            device_fed,
            bound,
            staging: id,
            staging_mirror: vec![0; size],
            kv,
            rows_buffer,
            in_flight: VecDeque::new(),
            ready: Vec::new(),
        })
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The backend, writable (tests seed storage through it).
    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    fn pack<T: Element>(
        &mut self,
        g: &BoundGraph,
        value: ValueKind,
        values: &[T],
        pad: T,
    ) -> Result<(), ExecutorError> {
        match g.view(value) {
            Some(view) => Ok(view.pack(&mut self.staging_mirror, values, pad)?),
            None => Ok(()),
        }
    }

    fn upload(&mut self) -> Result<(), ExecutorError> {
        let mirror = std::mem::take(&mut self.staging_mirror);
        let r = self.backend.write(self.staging, 0, &mirror);
        self.staging_mirror = mirror;
        r
    }

    fn clear_records(&mut self, view: &ByteView) -> Result<(), ExecutorError> {
        self.backend.write(view.buffer, view.buffer_offset, &vec![0u8; view.byte_len as usize])
    }

    fn copy_page(&mut self, source: u32, destination: u32) -> Result<(), ExecutorError> {
        let kv = self.kv.ok_or(ExecutorError::BadPage(source))?;
        let bytes = self.manifest.cache_scheme.bytes_per_page();
        self.backend.copy((kv, u64::from(source) * bytes), (kv, u64::from(destination) * bytes), bytes)
    }

    /// Where page `p` and row `r` live, and their sizes, for host transfers.
    fn page_at(&self, page: u32) -> Result<((BufferId, u64), u64), ExecutorError> {
        let kv = self.kv.ok_or(ExecutorError::BadPage(page))?;
        let bytes = self.manifest.cache_scheme.bytes_per_page();
        Ok(((kv, u64::from(page) * bytes), bytes))
    }

    fn row_at(&self, row: u32) -> Result<((BufferId, u64), u64), ExecutorError> {
        let bytes = self.manifest.cache_scheme.continuation_row_bytes;
        match self.rows_buffer {
            Some(b) => Ok(((b, u64::from(row) * bytes), bytes)),
            // A scheme without row bytes has nothing to copy.
            None if bytes == 0 => Ok(((BufferId(u32::MAX), 0), 0)),
            None => Err(ExecutorError::BadRow(row)),
        }
    }

    /// Copies storage (pages, rows) to host extents (`out`) or from them, in op order.
    fn transfer(
        &mut self,
        pages: &[(u32, HostExtent)],
        rows: &[(u32, HostExtent)],
        out: bool,
    ) -> Result<(), ExecutorError> {
        let pages = pages.iter().map(|&(p, e)| (self.page_at(p), e));
        let rows = rows.iter().map(|&(r, e)| (self.row_at(r), e));
        let all: Vec<_> = pages.chain(rows).collect();
        // Copies contiguous on both sides (consecutive pages into consecutive extents, as
        // allocation mostly gives them) go as one: fewer driver calls for a long checkpoint.
        let mut runs: Vec<((BufferId, u64), HostExtent)> = Vec::with_capacity(all.len());
        for (at, extent) in all {
            let (at, bytes) = at?;
            if bytes != extent.len {
                return Err(ExecutorError::TransferSize { extent, expected: bytes });
            }
            if bytes == 0 {
                continue;
            }
            match runs.last_mut() {
                Some(((buffer, offset), run))
                    if *buffer == at.0 && *offset + run.len == at.1 && run.offset + run.len == extent.offset =>
                {
                    run.len += extent.len;
                }
                _ => runs.push((at, extent)),
            }
        }
        for (at, extent) in runs {
            if out {
                self.backend.copy_to_host(at, extent)?;
            } else {
                self.backend.copy_from_host(extent, at)?;
            }
        }
        Ok(())
    }

    /// Packs and replays one maintenance op. `source` is absent for initialize; `stamp` is the
    /// checkpoint's (consumed, epoch) for restore and snapshot.
    fn maintenance(
        &mut self,
        op: MaintenanceOp,
        source: Option<u32>,
        destination: u32,
        stamp: Option<(u32, u32)>,
        reads: &mut Vec<RecordRead>,
    ) -> Result<(), ExecutorError> {
        let g = self.bound.maintenance(op, 1)?.clone();
        self.pack(&g, ValueKind::DestinationRows, &[destination as i32], -1)?;
        self.pack(&g, ValueKind::SourceRows, &source.map(|s| vec![s as i32]).unwrap_or_default(), -1)?;
        // Only a graph that knows epochs checks stamps; any other gets -1 (unchecked), exactly
        // what it always got.
        let (expected, epoch) = match stamp {
            Some((consumed, epoch)) if g.view(ValueKind::CheckpointEpoch).is_some() => {
                let consumed = i32::try_from(consumed).map_err(|_| ExecutorError::StampRange(u64::from(consumed)))?;
                // The device compares the epoch's bits.
                (consumed, i32::from_le_bytes(epoch.to_le_bytes()))
            }
            _ => (-1, 0),
        };
        self.pack(&g, ValueKind::ExpectedConsumed, &[expected], -1)?;
        self.pack(&g, ValueKind::CheckpointEpoch, &[epoch], 0)?;
        let records = g.view(ValueKind::CompletionRecords).cloned();
        if let Some(view) = &records {
            self.clear_records(view)?;
        }
        self.upload()?;
        self.backend.replay(g.id)?;
        let Some(view) = records else { return Ok(()) };
        let status = CheckpointOp {
            op,
            source_row: source.unwrap_or(self.manifest.cache_scheme.null_row),
            destination_row: destination,
            expected: stamp.unwrap_or_default(),
        };
        self.read_records(&view, g.completion_token_capacity, Vec::new(), Some(status), reads)
    }

    /// Enqueues the copy of a replay's records behind it (or reads them at once when the
    /// backend cannot defer).
    fn read_records(
        &mut self,
        view: &ByteView,
        token_capacity: u32,
        rows: Vec<Option<(RequestId, usize)>>,
        status: Option<CheckpointOp>,
        reads: &mut Vec<RecordRead>,
    ) -> Result<(), ExecutorError> {
        let header = self.manifest.capacities.completion_record_header_words;
        let ticket = self.backend.read_later(view.buffer, view.buffer_offset, view.byte_len)?;
        let bytes = match ticket {
            Some(_) => None,
            None => Some(self.backend.read(view.buffer, view.buffer_offset, view.byte_len)?),
        };
        reads.push(RecordRead {
            bytes,
            ticket,
            width: (header + token_capacity) as usize,
            token_capacity,
            rows,
            status,
        });
        Ok(())
    }

    /// Counts `tokens` into the live row's penalty histogram, in chunks of the graph's token
    /// capacity (the graph adds; Initialize and Restore clear). A core without the graph has no
    /// histogram: nothing to do.
    fn admit_histogram(&mut self, live_row: u32, tokens: &[u32]) -> Result<(), ExecutorError> {
        let g = match self.bound.maintenance(MaintenanceOp::AdmitHistogram, 1) {
            Ok(g) => g.clone(),
            Err(helios_contract::CapacityError::Missing { .. }) => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        let capacity = g.view(ValueKind::TokenIds).map_or(0, |v| v.capacity() as usize);
        if capacity == 0 {
            return Ok(());
        }
        for chunk in tokens.chunks(capacity) {
            let ids: Vec<i32> = chunk.iter().map(|&t| t as i32).collect();
            self.pack(&g, ValueKind::RequestSlots, &[live_row as i32], -1)?;
            // -1 pads: no token.
            self.pack(&g, ValueKind::TokenIds, &ids, -1)?;
            self.upload()?;
            self.backend.replay(g.id)?;
        }
        Ok(())
    }

    /// Packs and replays one speculative round through its program's graph (see the module
    /// docs for the lane layout), then enqueues the copy of its records.
    fn verify(
        &mut self,
        program: SpeculativeProgram,
        rows: &[ConsumeRow],
        inputs: &StepInputs,
        reads: &mut Vec<RecordRead>,
    ) -> Result<(), ExecutorError> {
        let g = self.bound.speculative(program)?.clone();
        if rows.len() > g.capacity.request_count as usize {
            return Err(ExecutorError::VerifyRows { program, rows: rows.len() });
        }
        let width = g.lanes_per_request() as usize;
        let mut batch = Vec::with_capacity(rows.len());
        for row in rows {
            // Every row consumes its pending token and at most `depth` proposals.
            if row.is_empty() || row.len() > width {
                return Err(ExecutorError::VerifyLanes { program, live_row: row.live_row, lanes: row.len() });
            }
            let sample = row.sample.ok_or(ExecutorError::VerifyWithoutSample(row.live_row))?;
            batch.push((row, Some(sample)));
        }
        self.rows(&g, &batch, inputs, reads)
    }

    /// Packs and replays one batch of rows (decode, prefill, resume, or a speculative round
    /// with one `W`-lane stride per row), then enqueues the copy of its records.
    fn rows(
        &mut self,
        g: &BoundGraph,
        rows: &[(&ConsumeRow, Option<SampleSpec>)],
        inputs: &StepInputs,
        reads: &mut Vec<RecordRead>,
    ) -> Result<(), ExecutorError> {
        let scheme = &self.manifest.cache_scheme;
        let (pt, pad_slot) = (i64::from(scheme.page_tokens), scheme.padding_slot);
        let pages = self.manifest.capacities.pages_per_request(scheme.page_tokens) as usize;
        // Speculative: request i's tokens start at lane i*W; otherwise rows' tokens follow each
        // other (prefill: one row of many tokens; decode and resume: one token per row).
        let stride = (g.kind == GraphKind::Speculative).then(|| g.lanes_per_request() as usize);
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut slot_mapping = Vec::new();
        // Lanes that consume a token, per token value (speculative grammar masks are per lane).
        let mut lane_rows: Vec<Option<usize>> = Vec::new();
        let mut page_table = Vec::new();
        let mut slots = Vec::new();
        let mut query = Vec::new();
        let mut context = Vec::new();
        let mut sampling: Vec<RowSampling> = Vec::new();
        let mut seeds = Vec::new();
        let mut counters = Vec::new();
        let mut flags = Vec::new();
        let mut record_rows = Vec::with_capacity(rows.len());
        for (r, (row, sample)) in rows.iter().enumerate() {
            if row.device_token && !g.reads_pending_token() {
                return Err(ExecutorError::DeviceFedUnsupported);
            }
            if let Some(w) = stride {
                // The previous request's unused lanes: token -1, position 0, no KV write.
                tokens.resize(r * w, -1);
                positions.resize(r * w, 0);
                slot_mapping.resize(r * w, pad_slot);
                lane_rows.resize(r * w, None);
            }
            // A negative id: the graph reads the row's pending token on the device.
            let device = row.device_token.then_some(-1i32);
            let ids = device.into_iter().chain(row.tokens.iter().map(|&t| t as i32));
            for (i, t) in ids.enumerate() {
                let position = i64::from(row.start) + i as i64;
                let page = row
                    .page_table
                    .get((position / pt) as usize)
                    .ok_or(ExecutorError::PageTableShort { position: position as u32, pages: row.page_table.len() })?;
                tokens.push(t);
                positions.push(position as i32);
                slot_mapping.push(i64::from(*page) * pt + position % pt);
                lane_rows.push(Some(r));
            }
            let mut table: Vec<i32> = row.page_table.iter().map(|&p| p as i32).collect();
            table.resize(pages, -1);
            page_table.extend(table);
            slots.push(row.live_row as i32);
            query.push(row.len() as i32);
            context.push((row.start as usize + row.len()) as i32);
            let s = sample.and_then(|s| inputs.sampling.get(&s.request)).cloned().unwrap_or_default();
            sampling.push(s);
            seeds.push(sample.map_or(0, |s| s.seed));
            // Speculative: the counter of lane 0; lane j samples with counter + j.
            counters.push(sample.map_or(0, |s| u64::from(s.counter)));
            flags.push(u32::from(sample.is_some()));
            // A verify record emits its accepted proposals and one more token: at most one per
            // lane used. Every other record emits exactly one.
            let most = if stride.is_some() { row.len() } else { 1 };
            record_rows.push(sample.map(|s| (s.request, most)));
        }
        use ValueKind as V;
        // Unused speculative lanes are -1 (ignored); padded decode and prefill tokens stay 0.
        self.pack(g, V::TokenIds, &tokens, if stride.is_some() { -1 } else { 0 })?;
        self.pack(g, V::Positions, &positions, 0)?;
        self.pack(g, V::SlotMapping, &slot_mapping, pad_slot)?;
        self.pack(g, V::PageTable, &page_table, -1)?;
        self.pack(g, V::RequestSlots, &slots, pad_slot as i32)?;
        self.pack(g, V::StateRowIndices, &slots, -1)?;
        self.pack(g, V::QueryLengths, &query, 0)?;
        self.pack(g, V::ContextLengths, &context, 0)?;
        let f = |get: fn(&RowSampling) -> f32| sampling.iter().map(get).collect::<Vec<f32>>();
        self.pack(g, V::Temperature, &f(|s| s.params.temperature), 1.0)?;
        self.pack(g, V::TopP, &f(|s| s.params.top_p), 1.0)?;
        self.pack(g, V::MinP, &f(|s| s.params.min_p), 0.0)?;
        self.pack(g, V::RepetitionPenalty, &f(|s| s.params.repetition_penalty), 1.0)?;
        self.pack(g, V::PresencePenalty, &f(|s| s.params.presence_penalty), 0.0)?;
        self.pack(g, V::FrequencyPenalty, &f(|s| s.params.frequency_penalty), 0.0)?;
        let top_k: Vec<i32> = sampling.iter().map(|s| s.params.top_k as i32).collect();
        self.pack(g, V::TopK, &top_k, 0)?;
        self.pack(g, V::RngSeed, &seeds, 0u64)?;
        self.pack(g, V::RngCounter, &counters, 0u64)?;
        self.pack(g, V::SampleFlags, &flags, 0)?;
        if let Some(view) = g.view(V::GrammarMask) {
            let words = view.shape.get(1).copied().unwrap_or(0) as usize;
            // One mask per request, or per lane for a speculative graph: lane j of a constrained
            // row samples under the grammar's state after its first j proposals
            // (`RowSampling::proposal_masks`). Unused lanes and unconstrained rows allow all.
            let mut masks: Vec<Option<&Arc<[u32]>>> = Vec::new();
            match stride {
                Some(_) => {
                    for (k, r) in lane_rows.iter().enumerate() {
                        let Some(r) = *r else {
                            masks.push(None);
                            continue;
                        };
                        let lane = k - r * stride.unwrap_or(1);
                        let request = rows[r].1.map_or(RequestId(0), |s| s.request);
                        masks.push(sampling[r].lane_mask(request, lane)?);
                    }
                }
                None => masks.extend(sampling.iter().map(|s| s.mask.as_ref())),
            }
            let mut mask = Vec::with_capacity(words * masks.len());
            for m in masks {
                match m {
                    Some(m) => mask.extend((0..words).map(|i| m.get(i).copied().unwrap_or(0))),
                    None => mask.extend(std::iter::repeat_n(u32::MAX, words)),
                }
            }
            self.pack(g, V::GrammarMask, &mask, u32::MAX)?;
        }
        let records = g.view(V::CompletionRecords).cloned();
        if let Some(view) = &records {
            self.clear_records(view)?;
        }
        self.upload()?;
        self.backend.replay(g.id)?;
        let Some(view) = records else { return Ok(()) };
        self.read_records(&view, g.completion_token_capacity, record_rows, None, reads)
    }

    /// Record `i` of one replay's records.
    fn record(&self, read: &RecordRead, i: usize) -> Result<CompletionRecord, ExecutorError> {
        let bytes = read.bytes.as_deref().unwrap_or_default();
        let header = self.manifest.capacities.completion_record_header_words;
        let vocab = self.manifest.capacities.vocab_size;
        let width = read.width;
        let words: Vec<u32> = bytes
            .get(i * width * 4..(i + 1) * width * 4)
            .ok_or(ExecutorError::Record { row: i, error: RecordError::WrongLength { got: 0, expected: width } })?
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        CompletionRecord::parse(&words, header, read.token_capacity, vocab)
            .map_err(|error| ExecutorError::Record { row: i, error })
    }

    /// A maintenance op's status record: written, for the row the op wrote, and not rejected.
    fn check_status(&self, read: &RecordRead, status: CheckpointOp) -> Result<(), ExecutorError> {
        let record = self.record(read, 0)?;
        if record.slot != status.destination_row {
            return Err(ExecutorError::CheckpointRecordRow {
                op: status.op,
                expected: status.destination_row,
                found: record.slot,
            });
        }
        if record.flags & FLAG_CHECKPOINT_REJECTED != 0 {
            return Err(ExecutorError::CheckpointRejected {
                op: status.op,
                source_row: status.source_row,
                destination_row: status.destination_row,
                expected: status.expected,
                found: (record.consumed_low, record.counter_low),
            });
        }
        Ok(())
    }

    /// The sampled tokens of one replay's records (or its status record's verdict).
    fn parse(&self, read: &RecordRead, sampled: &mut Vec<SampledToken>) -> Result<(), ExecutorError> {
        if let Some(status) = read.status {
            return self.check_status(read, status);
        }
        for (i, row) in read.rows.iter().enumerate() {
            let Some((request, most)) = *row else { continue };
            let record = self.record(read, i)?;
            if record.flags & FLAG_SAMPLED == 0 || record.tokens.is_empty() {
                return Err(ExecutorError::NotSampled(i));
            }
            if record.tokens.len() > most {
                return Err(ExecutorError::TooManyTokens { row: i, count: record.tokens.len(), most });
            }
            // A verify record's tokens, in order: its accepted proposals, then the sample that
            // ended the round.
            sampled.extend(record.tokens.iter().map(|&token| SampledToken { request, token }));
        }
        Ok(())
    }

    /// Moves in-flight steps whose records all landed to `ready`, oldest first; `wait`: the
    /// oldest step is waited for.
    fn collect(&mut self, mut wait: bool) -> Result<(), ExecutorError> {
        while let Some(step) = self.in_flight.front_mut() {
            for read in &mut step.reads {
                if read.bytes.is_some() {
                    continue;
                }
                let Some(ticket) = read.ticket else { continue };
                read.bytes = self.backend.take_read(ticket, wait)?;
                if read.bytes.is_none() {
                    return Ok(());
                }
            }
            wait = false;
            let Some(step) = self.in_flight.pop_front() else { break };
            let mut sampled = Vec::new();
            for read in &step.reads {
                self.parse(read, &mut sampled)?;
            }
            self.ready.push(Completion { fence: step.fence, sampled });
        }
        Ok(())
    }
}

impl<B: GraphBackend> Executor for GraphExecutor<B> {
    fn submit(&mut self, step: &Step, inputs: &StepInputs) -> Result<(), ExecutorError> {
        while self.in_flight.len() >= MAX_STEPS_IN_FLIGHT {
            self.collect(true)?;
        }
        let mut reads = Vec::new();
        for op in &step.ops {
            match op {
                StepOp::Initialize { live_row, rows } => {
                    for r in *live_row..live_row + rows {
                        self.maintenance(MaintenanceOp::Initialize, None, r, None, &mut reads)?;
                    }
                }
                StepOp::Restore { snapshot_row, live_row, tail, consumed, epoch } => {
                    let stamp = Some((*consumed, *epoch));
                    self.maintenance(MaintenanceOp::Restore, Some(*snapshot_row), *live_row, stamp, &mut reads)?;
                    if let Some(c) = tail {
                        self.copy_page(c.source, c.destination)?;
                    }
                }
                StepOp::Snapshot { live_row, snapshot_row, tail, consumed, epoch } => {
                    let stamp = Some((*consumed, *epoch));
                    self.maintenance(MaintenanceOp::Snapshot, Some(*live_row), *snapshot_row, stamp, &mut reads)?;
                    if let Some(c) = tail {
                        self.copy_page(c.source, c.destination)?;
                    }
                }
                StepOp::AdmitHistogram { live_row, tokens } => self.admit_histogram(*live_row, tokens)?,
                StepOp::Decode { bucket, rows } => {
                    let g = self.bound.decode(*bucket)?.clone();
                    let batch: Vec<(&ConsumeRow, Option<SampleSpec>)> = rows.iter().map(|r| (r, r.sample)).collect();
                    self.rows(&g, &batch, inputs, &mut reads)?;
                }
                StepOp::Verify { program, rows } => self.verify(*program, rows, inputs, &mut reads)?,
                StepOp::Prefill { capacity, row } => {
                    let g = self.bound.prefill(*capacity)?.clone();
                    self.rows(&g, &[(row, row.sample)], inputs, &mut reads)?;
                }
                StepOp::CopyOut { pages, rows } => self.transfer(pages, rows, true)?,
                StepOp::CopyIn { pages, rows } => {
                    let pages: Vec<(u32, HostExtent)> = pages.iter().map(|&(e, p)| (p, e)).collect();
                    let rows: Vec<(u32, HostExtent)> = rows.iter().map(|&(e, r)| (r, e)).collect();
                    self.transfer(&pages, &rows, false)?;
                }
                StepOp::ResumeSampling { live_row, consumed, page_table, sample } => {
                    let g = self.bound.resume_sampling(1)?.clone();
                    let row = ConsumeRow {
                        live_row: *live_row,
                        start: *consumed,
                        tokens: Vec::new(),
                        device_token: false,
                        page_table: page_table.clone(),
                        sample: Some(*sample),
                    };
                    self.rows(&g, &[(&row, Some(*sample))], inputs, &mut reads)?;
                }
            }
        }
        self.backend.end_step()?;
        let transfers = step.ops.iter().any(|op| matches!(op, StepOp::CopyOut { .. } | StepOp::CopyIn { .. }));
        if transfers {
            // Host memory is read and written by these copies: the step completes only once a
            // read ordered after all of them landed (a step that samples nothing would otherwise
            // complete at once, and its host extents be reused while the copies still run).
            let ticket = self.backend.read_later(self.staging, 0, 4)?;
            let bytes = match ticket {
                Some(_) => None,
                None => Some(self.backend.read(self.staging, 0, 4)?),
            };
            reads.push(RecordRead { bytes, ticket, width: 0, token_capacity: 0, rows: vec![], status: None });
        }
        self.in_flight.push_back(InFlight { fence: step.fence, reads });
        Ok(())
    }

    fn poll(&mut self) -> Result<Vec<Completion>, ExecutorError> {
        self.collect(false)?;
        Ok(std::mem::take(&mut self.ready))
    }

    fn synchronize(&mut self) -> Result<Vec<Completion>, ExecutorError> {
        while !self.in_flight.is_empty() {
            self.collect(true)?;
        }
        Ok(std::mem::take(&mut self.ready))
    }

    fn wait(&mut self) -> Result<Vec<Completion>, ExecutorError> {
        self.collect(true)?;
        Ok(std::mem::take(&mut self.ready))
    }

    fn device_fed_decode(&self) -> bool {
        self.device_fed
    }

    fn device_memory_growth_bytes(&mut self) -> Option<i64> {
        self.backend.device_memory_growth_bytes()
    }

    fn kv_pages(&self) -> Option<u32> {
        self.backend.kv_pages()
    }

    fn attach_host_arena(&mut self, arena: Arc<HostArena>, geometry: StoreGeometry) -> Result<(), ExecutorError> {
        if geometry != StoreGeometry::from(&self.manifest.cache_scheme) {
            return Err(ExecutorError::TransferGeometry {
                page_bytes: geometry.bytes_per_page,
                row_bytes: geometry.continuation_row_bytes,
            });
        }
        self.backend.attach_host_arena(arena)
    }

    fn unified_memory(&self) -> bool {
        self.backend.unified_memory()
    }

    /// Replays `op`'s graph over padding only (its rows are ignored): every lane is a padded
    /// one, which writes nothing a request owns (the trash page, the null row's own bytes).
    fn measure_step(&mut self, op: &StepOp, reps: u32) -> Result<Option<std::time::Duration>, ExecutorError> {
        let padded = match op {
            StepOp::Decode { bucket, .. } => StepOp::Decode { bucket: *bucket, rows: Vec::new() },
            StepOp::Verify { program, .. } => StepOp::Verify { program: *program, rows: Vec::new() },
            _ => return Ok(None),
        };
        self.synchronize()?;
        let mut fence = 0u64;
        let mut run = |ex: &mut Self, n: u32| -> Result<(), ExecutorError> {
            for _ in 0..n {
                fence += 1;
                ex.submit(&Step { fence: Fence(u64::MAX - fence), ops: vec![padded.clone()] }, &StepInputs::default())?;
            }
            ex.synchronize().map(drop)
        };
        run(self, MEASURE_WARMUP)?;
        let start = std::time::Instant::now();
        run(self, reps.max(1))?;
        Ok(Some(start.elapsed() / reps.max(1)))
    }
}

/// Steps replayed before [`GraphExecutor::measure_step`] starts its clock (first-replay costs).
const MEASURE_WARMUP: u32 = 3;

/// Which graph a step op replays (reports, tests).
pub fn graph_for(bound: &BoundContract, op: &StepOp) -> Option<GraphId> {
    let g = match op {
        StepOp::Decode { bucket, .. } => bound.decode(*bucket).ok(),
        StepOp::Verify { program, .. } => bound.speculative(*program).ok(),
        StepOp::Prefill { capacity, .. } => bound.prefill(*capacity).ok(),
        StepOp::ResumeSampling { .. } => bound.resume_sampling(1).ok(),
        StepOp::Initialize { .. } => bound.maintenance(MaintenanceOp::Initialize, 1).ok(),
        StepOp::Restore { .. } => bound.maintenance(MaintenanceOp::Restore, 1).ok(),
        StepOp::Snapshot { .. } => bound.maintenance(MaintenanceOp::Snapshot, 1).ok(),
        StepOp::AdmitHistogram { .. } => bound.maintenance(MaintenanceOp::AdmitHistogram, 1).ok(),
        StepOp::CopyOut { .. } | StepOp::CopyIn { .. } => None,
    };
    g.map(|g| g.id)
}
