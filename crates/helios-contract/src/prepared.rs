//! The PreparedContract's semantics: for each value kind, the dtype, shape and direction its
//! byte view must have, and which values each graph kind must bind.
//!
//! Shapes are derived from the graph's captured capacity and the core's declared geometry only,
//! so shared packing code can write any model's inputs without knowing the model.
//!
//! Per-token values are `[token_capacity]`, per-request values `[request_count]`. For a
//! speculative graph the token capacity is its `P = B × W` lanes (request `i` owns lanes
//! `i*W .. i*W + W`), and its grammar mask is per lane, `[P, words]`.
//!
//! Checkpoint stamps (ABI 3, optional): restore and snapshot graphs may bind
//! `CheckpointEpoch` (i32 `[B]`, input) beside `ExpectedConsumed`, and any state-maintenance
//! graph may bind `CompletionRecords` (`[B, header + completion_token_capacity]`, output) for
//! its status records. A graph binding the epoch binds the records too, and the cache scheme
//! then has a `PositionMetadata` region (validation checks both).

use crate::model::{CacheScheme, Capacities, DType, Direction, Graph, GraphKind, MaintenanceOp, ValueKind};

/// What a value's view must look like in one graph.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpectedView {
    pub dtypes: &'static [DType],
    /// `None` for dimensions the contract leaves to the recipe (e.g. pixel channels).
    pub shape: Vec<Option<u64>>,
    pub direction: Direction,
}

impl ExpectedView {
    /// Whether `shape` matches, dimension by dimension.
    pub fn shape_matches(&self, shape: &[u64]) -> bool {
        shape.len() == self.shape.len()
            && self.shape.iter().zip(shape).all(|(want, got)| want.is_none_or(|w| w == *got))
    }

    /// Expected byte length when every dimension is fixed.
    pub fn fixed_byte_len(&self, dtype: DType) -> Option<u64> {
        self.shape.iter().try_fold(dtype.size(), |acc, d| d.map(|d| acc * d))
    }
}

const I32: &[DType] = &[DType::I32];
const I64: &[DType] = &[DType::I64];
const F32: &[DType] = &[DType::F32];
const U32: &[DType] = &[DType::U32];
const WORD64: &[DType] = &[DType::U64, DType::I64];
const POSITION: &[DType] = &[DType::I32, DType::I64];
const PIXELS: &[DType] = &[DType::BF16, DType::F16, DType::F32];

/// Expected view of `value` in `graph`.
pub fn expected_view(value: ValueKind, graph: &Graph, scheme: &CacheScheme, caps: &Capacities) -> ExpectedView {
    let b = u64::from(graph.capacity.request_count);
    let t = u64::from(graph.capacity.token_capacity);
    let per_request = |dtypes| ExpectedView { dtypes, shape: vec![Some(b)], direction: Direction::Input };
    let per_token = |dtypes| ExpectedView { dtypes, shape: vec![Some(t)], direction: Direction::Input };
    match value {
        ValueKind::TokenIds => per_token(I32),
        ValueKind::Positions => per_token(POSITION),
        ValueKind::SlotMapping => per_token(I64),
        ValueKind::PageTable => ExpectedView {
            dtypes: I32,
            shape: vec![Some(b), Some(caps.pages_per_request(scheme.page_tokens))],
            direction: Direction::Input,
        },
        ValueKind::RequestSlots
        | ValueKind::QueryLengths
        | ValueKind::ContextLengths
        | ValueKind::StateRowIndices
        | ValueKind::SourceRows
        | ValueKind::DestinationRows
        | ValueKind::ExpectedConsumed
        | ValueKind::CheckpointEpoch
        | ValueKind::TopK => per_request(I32),
        ValueKind::Temperature
        | ValueKind::TopP
        | ValueKind::MinP
        | ValueKind::RepetitionPenalty
        | ValueKind::PresencePenalty
        | ValueKind::FrequencyPenalty => per_request(F32),
        ValueKind::RngSeed | ValueKind::RngCounter => per_request(WORD64),
        ValueKind::SampleFlags => per_request(U32),
        // One mask per request; a speculative program samples at every lane, each lane with
        // the grammar state at its position.
        ValueKind::GrammarMask => ExpectedView {
            dtypes: U32,
            shape: vec![
                Some(if graph.kind == GraphKind::Speculative { t } else { b }),
                Some(u64::from(caps.vocab_size).div_ceil(32)),
            ],
            direction: Direction::Input,
        },
        ValueKind::CompletionRecords => ExpectedView {
            dtypes: U32,
            shape: vec![
                Some(b),
                Some(u64::from(caps.completion_record_header_words + graph.completion_token_capacity)),
            ],
            direction: Direction::Output,
        },
        ValueKind::PatchPixels => ExpectedView {
            dtypes: PIXELS,
            shape: vec![Some(u64::from(graph.capacity.patch_capacity)), None],
            direction: Direction::Input,
        },
        ValueKind::ImageFeatureOffsets => ExpectedView { dtypes: I32, shape: vec![None], direction: Direction::Input },
        // One entry per live row and the null row; the graph's direction says read or write.
        ValueKind::PendingTokens => ExpectedView {
            dtypes: I32,
            shape: vec![Some(u64::from(caps.request_slots) + 1)],
            direction: Direction::StateReadWrite,
        },
    }
}

/// Whether a graph of this kind (and maintenance op) may bind `value` at all. Most values may
/// be bound anywhere their view fits; the checkpoint epoch only by the graphs that check it
/// (restore and snapshot).
pub fn bindable(value: ValueKind, kind: GraphKind, op: Option<MaintenanceOp>) -> bool {
    match value {
        ValueKind::CheckpointEpoch => {
            kind == GraphKind::StateMaintenance && matches!(op, Some(MaintenanceOp::Restore | MaintenanceOp::Snapshot))
        }
        _ => true,
    }
}

/// Values every graph of this kind (and maintenance op) must bind.
pub fn required_values(kind: GraphKind, op: Option<MaintenanceOp>) -> &'static [ValueKind] {
    use ValueKind as V;
    match kind {
        GraphKind::Prefill => &[
            V::TokenIds,
            V::Positions,
            V::SlotMapping,
            V::PageTable,
            V::RequestSlots,
            V::QueryLengths,
            V::CompletionRecords,
        ],
        GraphKind::Decode => &[V::RequestSlots, V::PageTable, V::CompletionRecords],
        GraphKind::ResumeSampling => &[V::RequestSlots, V::StateRowIndices, V::CompletionRecords],
        GraphKind::StateMaintenance => match op {
            Some(MaintenanceOp::Restore | MaintenanceOp::Snapshot) => {
                &[V::SourceRows, V::DestinationRows, V::ExpectedConsumed]
            }
            Some(MaintenanceOp::Initialize | MaintenanceOp::Reset) => &[V::DestinationRows],
            Some(MaintenanceOp::AdmitHistogram) => &[V::RequestSlots, V::TokenIds],
            None => &[],
        },
        GraphKind::Vision => &[V::PatchPixels],
        GraphKind::TuningProducer => &[],
        GraphKind::Speculative => {
            &[V::TokenIds, V::Positions, V::QueryLengths, V::RequestSlots, V::PageTable, V::CompletionRecords]
        }
    }
}
