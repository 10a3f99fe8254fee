//! `BoundContract`: every graph's value sources resolved to byte views, and the shared packing
//! code that writes request metadata into them.
//!
//! Binding happens once at load; the serving loop then looks graphs up by capacity and writes
//! values into host mirrors of the staging buffers, which the executor uploads. Nothing here
//! knows which model produced the core.

use std::collections::BTreeMap;

use crate::model::{
    BufferId, BufferRole, DType, Direction, Graph, GraphCapacity, GraphId, GraphKind, MaintenanceOp, Manifest,
    SpeculativeProgram, ValueKind,
};

const VALUE_KINDS: usize = ValueKind::CheckpointEpoch as usize + 1;

/// A resolved view: `byte_len` bytes at `arena_offset`, inside buffer `buffer` at `buffer_offset`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ByteView {
    pub value: ValueKind,
    pub buffer: BufferId,
    pub role: BufferRole,
    pub buffer_offset: u64,
    /// Offset from the arena base (add the loaded base to get a device address).
    pub arena_offset: u64,
    pub byte_len: u64,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub direction: Direction,
}

impl ByteView {
    /// Elements the view holds.
    pub fn capacity(&self) -> u64 {
        self.shape.iter().product()
    }

    pub fn device_address(&self, arena_base: u64) -> u64 {
        arena_base + self.arena_offset
    }

    /// Writes `values` at the start of the view inside `buffer_bytes` (the host mirror of the
    /// whole buffer) and fills the rest of the view with `pad`, so no stale value from an
    /// earlier submission survives in a padded lane.
    pub fn pack<T: Element>(&self, buffer_bytes: &mut [u8], values: &[T], pad: T) -> Result<(), PackError> {
        // Seeds and counters may be declared i64 or u64; the bits are the same.
        let same_word = T::DTYPE.size() == 8 && matches!(self.dtype, DType::I64 | DType::U64);
        if self.dtype != T::DTYPE && !(same_word && matches!(T::DTYPE, DType::I64 | DType::U64)) {
            return Err(PackError::DType { expected: self.dtype, found: T::DTYPE });
        }
        let capacity = self.capacity();
        if values.len() as u64 > capacity {
            return Err(PackError::TooManyValues { capacity, found: values.len() as u64 });
        }
        let start = self.buffer_offset as usize;
        let end = start + self.byte_len as usize;
        let mirror_len = buffer_bytes.len() as u64;
        let dst = buffer_bytes
            .get_mut(start..end)
            .ok_or(PackError::MirrorTooSmall { needed: end as u64, found: mirror_len })?;
        let size = T::DTYPE.size() as usize;
        for (i, chunk) in dst.chunks_exact_mut(size).enumerate() {
            let v = values.get(i).copied().unwrap_or(pad);
            v.write_le(chunk);
        }
        Ok(())
    }

    /// Reads the whole view from `buffer_bytes`.
    pub fn read<T: Element>(&self, buffer_bytes: &[u8]) -> Result<Vec<T>, PackError> {
        if T::DTYPE.size() != self.dtype.size() {
            return Err(PackError::DType { expected: self.dtype, found: T::DTYPE });
        }
        let start = self.buffer_offset as usize;
        let end = start + self.byte_len as usize;
        let src = buffer_bytes
            .get(start..end)
            .ok_or(PackError::MirrorTooSmall { needed: end as u64, found: buffer_bytes.len() as u64 })?;
        Ok(src.chunks_exact(T::DTYPE.size() as usize).map(T::read_le).collect())
    }
}

/// Scalar element types packing supports.
pub trait Element: Copy {
    const DTYPE: DType;
    fn write_le(self, dst: &mut [u8]);
    fn read_le(src: &[u8]) -> Self;
}

macro_rules! element {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            fn write_le(self, dst: &mut [u8]) {
                dst.copy_from_slice(&self.to_le_bytes());
            }
            fn read_le(src: &[u8]) -> Self {
                let mut b = [0u8; std::mem::size_of::<$t>()];
                b.copy_from_slice(src);
                <$t>::from_le_bytes(b)
            }
        }
    };
}
element!(i32, DType::I32);
element!(u32, DType::U32);
element!(i64, DType::I64);
element!(u64, DType::U64);
element!(f32, DType::F32);

/// Why packing into a view failed; each is a caller bug or an input outside the contract.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PackError {
    #[error("view holds {expected:?}, value is {found:?}")]
    DType { expected: DType, found: DType },
    #[error("{found} values exceed the view's capacity of {capacity}")]
    TooManyValues { capacity: u64, found: u64 },
    #[error("host mirror is {found} bytes, the view needs {needed}")]
    MirrorTooSmall { needed: u64, found: u64 },
}

/// A request for a graph the core does not carry.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CapacityError {
    #[error("{kind:?} of {requested} exceeds the largest captured capacity {largest}")]
    Exceeded { kind: GraphKind, requested: u32, largest: u32 },
    #[error("the core has no {kind:?} graph{}", op.map(|o| format!(" for {o:?}")).unwrap_or_default())]
    Missing { kind: GraphKind, op: Option<MaintenanceOp> },
    /// Speculative programs are looked up exactly: a larger one would verify other lanes.
    #[error("the core has no speculative program for {requests} requests at depth {depth}")]
    MissingProgram { requests: u32, depth: u32 },
}

/// One graph with its value views resolved.
#[derive(Clone, Debug)]
pub struct BoundGraph {
    pub id: GraphId,
    pub kind: GraphKind,
    pub maintenance_op: Option<MaintenanceOp>,
    pub capacity: GraphCapacity,
    pub completion_token_capacity: u32,
    views: [Option<ByteView>; VALUE_KINDS],
}

impl BoundGraph {
    pub fn view(&self, value: ValueKind) -> Option<&ByteView> {
        self.views[value as usize].as_ref()
    }

    /// Views the host packs before each submission.
    pub fn inputs(&self) -> impl Iterator<Item = (ValueKind, &ByteView)> {
        self.views().filter(|(_, v)| v.direction == Direction::Input)
    }

    /// Whether a negative token id packed for a lane makes the graph read that lane's input
    /// token from its row's pending token on the device (device-fed generation): such a step
    /// does not wait for the completion that sampled the token. Decode and speculative graphs
    /// only (for a speculative graph, lane 0 of a request).
    pub fn reads_pending_token(&self) -> bool {
        matches!(self.kind, GraphKind::Decode | GraphKind::Speculative)
            && self.view(ValueKind::PendingTokens).is_some_and(|v| v.direction.reads_state())
    }

    /// Lanes per request W: `proposal_depth + 1` for a speculative graph (request `i` owns
    /// lanes `i*W .. i*W + W` of its per-token values), 1 for any other graph.
    pub fn lanes_per_request(&self) -> u32 {
        if self.kind == GraphKind::Speculative { self.capacity.proposal_depth + 1 } else { 1 }
    }

    /// Whether the graph stores every token it samples as its row's pending token.
    pub fn writes_pending_token(&self) -> bool {
        self.view(ValueKind::PendingTokens).is_some_and(|v| v.direction.writes_state())
    }

    pub fn views(&self) -> impl Iterator<Item = (ValueKind, &ByteView)> {
        self.views.iter().flatten().map(|v| (v.value, v))
    }
}

/// Every graph of a core, bound, with lookups by captured capacity.
#[derive(Clone, Debug)]
pub struct BoundContract {
    arena_base: u64,
    graphs: Vec<BoundGraph>,
    decode_by_requests: BTreeMap<u32, usize>,
    prefill_by_tokens: BTreeMap<u32, usize>,
    resume_by_requests: BTreeMap<u32, usize>,
    maintenance: BTreeMap<(MaintenanceOp, u32), usize>,
    vision_by_patches: BTreeMap<u32, usize>,
    /// (requests, depth) → graph; validation made the pairs unique.
    speculative_by_program: BTreeMap<(u32, u32), usize>,
}

impl BoundContract {
    /// Binds a validated manifest. Infallible: validation already proved every view fits.
    pub fn bind(manifest: &Manifest) -> Self {
        let graphs: Vec<BoundGraph> = manifest.graphs.iter().map(|g| bind_graph(manifest, g)).collect();
        let mut contract = BoundContract {
            arena_base: manifest.arena.base_address,
            decode_by_requests: BTreeMap::new(),
            prefill_by_tokens: BTreeMap::new(),
            resume_by_requests: BTreeMap::new(),
            maintenance: BTreeMap::new(),
            vision_by_patches: BTreeMap::new(),
            speculative_by_program: BTreeMap::new(),
            graphs,
        };
        for (i, g) in contract.graphs.iter().enumerate() {
            let c = g.capacity;
            match (g.kind, g.maintenance_op) {
                (GraphKind::Decode, _) => {
                    contract.decode_by_requests.entry(c.request_count).or_insert(i);
                }
                (GraphKind::Prefill, _) => {
                    contract.prefill_by_tokens.entry(c.token_capacity).or_insert(i);
                }
                (GraphKind::ResumeSampling, _) => {
                    contract.resume_by_requests.entry(c.request_count).or_insert(i);
                }
                (GraphKind::StateMaintenance, Some(op)) => {
                    contract.maintenance.entry((op, c.request_count)).or_insert(i);
                }
                (GraphKind::Vision, _) => {
                    contract.vision_by_patches.entry(c.patch_capacity).or_insert(i);
                }
                (GraphKind::Speculative, _) => {
                    contract.speculative_by_program.entry((c.request_count, c.proposal_depth)).or_insert(i);
                }
                _ => {}
            }
        }
        contract
    }

    /// Base address the views were resolved against.
    pub fn arena_base(&self) -> u64 {
        self.arena_base
    }

    pub fn graphs(&self) -> &[BoundGraph] {
        &self.graphs
    }

    /// The smallest captured decode graph holding `requests` rows.
    pub fn decode(&self, requests: u32) -> Result<&BoundGraph, CapacityError> {
        smallest_at_least(&self.graphs, &self.decode_by_requests, requests, GraphKind::Decode)
    }

    /// The smallest captured prefill graph holding `tokens` tokens.
    pub fn prefill(&self, tokens: u32) -> Result<&BoundGraph, CapacityError> {
        smallest_at_least(&self.graphs, &self.prefill_by_tokens, tokens, GraphKind::Prefill)
    }

    pub fn resume_sampling(&self, requests: u32) -> Result<&BoundGraph, CapacityError> {
        smallest_at_least(&self.graphs, &self.resume_by_requests, requests, GraphKind::ResumeSampling)
    }

    pub fn vision(&self, patches: u32) -> Result<&BoundGraph, CapacityError> {
        smallest_at_least(&self.graphs, &self.vision_by_patches, patches, GraphKind::Vision)
    }

    /// The speculative graph of `program`: the one captured for exactly `program.requests`
    /// requests at `program.depth` proposals (its `width` and `rows` follow from those, so they
    /// are not compared). The scheduler picks programs from `Capacities::speculative_programs`,
    /// which validation derived from these very graphs, so a miss is a caller bug.
    pub fn speculative(&self, program: SpeculativeProgram) -> Result<&BoundGraph, CapacityError> {
        match self.speculative_by_program.get(&(program.requests, program.depth)) {
            Some(&i) => Ok(&self.graphs[i]),
            None => Err(CapacityError::MissingProgram { requests: program.requests, depth: program.depth }),
        }
    }

    /// The smallest maintenance graph for `op` holding `requests` rows.
    pub fn maintenance(&self, op: MaintenanceOp, requests: u32) -> Result<&BoundGraph, CapacityError> {
        let mut candidates = self.maintenance.range((op, requests)..=(op, u32::MAX));
        match candidates.next() {
            Some((_, &i)) => Ok(&self.graphs[i]),
            None => match self.maintenance.range((op, 0)..=(op, u32::MAX)).next_back() {
                Some(((_, largest), _)) => Err(CapacityError::Exceeded {
                    kind: GraphKind::StateMaintenance,
                    requested: requests,
                    largest: *largest,
                }),
                None => Err(CapacityError::Missing { kind: GraphKind::StateMaintenance, op: Some(op) }),
            },
        }
    }
}

fn smallest_at_least<'a>(
    graphs: &'a [BoundGraph],
    index: &BTreeMap<u32, usize>,
    wanted: u32,
    kind: GraphKind,
) -> Result<&'a BoundGraph, CapacityError> {
    match index.range(wanted..).next() {
        Some((_, &i)) => Ok(&graphs[i]),
        None => match index.keys().next_back() {
            Some(&largest) => Err(CapacityError::Exceeded { kind, requested: wanted, largest }),
            None => Err(CapacityError::Missing { kind, op: None }),
        },
    }
}

fn bind_graph(manifest: &Manifest, g: &Graph) -> BoundGraph {
    let mut views: [Option<ByteView>; VALUE_KINDS] = std::array::from_fn(|_| None);
    for b in &g.bindings {
        let Some(buffer) = manifest.buffer(b.view.buffer) else { continue };
        views[b.value as usize] = Some(ByteView {
            value: b.value,
            buffer: buffer.id,
            role: buffer.role,
            buffer_offset: b.view.offset,
            arena_offset: buffer.offset + b.view.offset,
            byte_len: b.byte_len(),
            dtype: b.dtype,
            shape: b.shape.clone(),
            direction: b.direction,
        });
    }
    BoundGraph {
        id: g.id,
        kind: g.kind,
        maintenance_op: g.maintenance_op,
        capacity: g.capacity,
        completion_token_capacity: g.completion_token_capacity,
        views,
    }
}
