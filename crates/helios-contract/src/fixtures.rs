//! Tiny hand-built runtime cores for tests (feature `fixtures`).
//!
//! A fixture is a wire manifest plus the files it names. Tests mutate either and write the
//! result to a directory. The cores are structurally complete (every graph kind the lifecycle
//! needs, relocated kernel parameters, memcpy/memset/event nodes, bindings for every required
//! value) but their kernel images are placeholders: they load everywhere except on a GPU.
//! Speculative graphs (execution ABI 3) are added for the programs a spec lists. From ABI 4 on,
//! every graph with two kernel nodes also joins them with a programmatic edge (beside the full
//! path through the memset between them, so replaying it changes no result); older ABIs carry
//! none.

use std::collections::HashMap;
use std::path::Path;

use crate::core::{MANIFEST_FILE, sha256_hex, to_safetensors_dtype};
use crate::model::{CURRENT_ABI, DType, STAMP_BYTES};
use crate::pb;
use prost::Message;

/// Geometry of a fixture core.
#[derive(Clone, Debug)]
pub struct FixtureSpec {
    pub abi: u32,
    pub page_tokens: u32,
    /// Bytes of a continuation row; 0 for attention-only schemes.
    pub continuation_row_bytes: u64,
    pub verification_width: u32,
    pub decode_buckets: Vec<u32>,
    pub prefill_capacities: Vec<u32>,
    pub request_slots: u32,
    pub snapshot_rows: u32,
    pub max_kv_pages: u32,
    pub context_limit: u32,
    pub vocab_size: u32,
    pub hidden: u64,
    /// Speculative programs to capture, as (requests B, depth D): one speculative graph each,
    /// after every other graph (so a spec without them builds exactly what it did before).
    /// Built whatever `abi` says, so tests can check that an older ABI rejects them.
    pub speculative_programs: Vec<(u32, u32)>,
    /// Checkpoint stamps (execution ABI 3, optional): rows of 64 bytes or more end in a
    /// position-metadata stamp, restore and snapshot graphs bind the checkpoint epoch, and the
    /// restore, snapshot and initialize graphs bind one status record each (token capacity 1)
    /// and copy nothing themselves (emulators perform the checked copy). Off: exactly the
    /// graphs the builder made before stamps. Built whatever `abi` says, like the programs.
    pub checkpoint_stamps: bool,
}

impl Default for FixtureSpec {
    fn default() -> Self {
        FixtureSpec {
            abi: CURRENT_ABI,
            page_tokens: 64,
            continuation_row_bytes: 512,
            verification_width: 1,
            decode_buckets: vec![1, 2, 4],
            prefill_capacities: vec![64, 128],
            request_slots: 4,
            snapshot_rows: 8,
            max_kv_pages: 32,
            context_limit: 1024,
            vocab_size: 64,
            hidden: 8,
            speculative_programs: vec![],
            checkpoint_stamps: false,
        }
    }
}

impl FixtureSpec {
    /// The first-release layout: fields added in ABI 2 are absent.
    pub fn abi1() -> Self {
        FixtureSpec { abi: 1, ..FixtureSpec::default() }
    }

    /// The ABI 2 layout: no speculative programs.
    pub fn abi2() -> Self {
        FixtureSpec { abi: 2, ..FixtureSpec::default() }
    }

    /// The ABI 3 layout: every edge a full dependency (speculative programs and checkpoint
    /// stamps only where a spec asks for them, as for any ABI).
    pub fn abi3() -> Self {
        FixtureSpec { abi: 3, ..FixtureSpec::default() }
    }

    /// The current ABI with speculative programs for 1 and 2 requests at depth 3 (W = 4) and
    /// for 4 requests at depth 1 (W = 2).
    pub fn speculative() -> Self {
        FixtureSpec { speculative_programs: vec![(1, 3), (2, 3), (4, 1)], ..FixtureSpec::default() }
    }

    /// The current ABI with checkpoint stamps (and the speculative programs of
    /// [`Self::speculative`]).
    pub fn stamped() -> Self {
        FixtureSpec { checkpoint_stamps: true, ..FixtureSpec::speculative() }
    }
}

/// A manifest and the files beside it.
#[derive(Clone, Debug)]
pub struct Fixture {
    pub manifest: pb::RuntimeCore,
    /// Core-relative path → contents.
    pub files: Vec<(String, Vec<u8>)>,
}

pub const ARENA_BASE: u64 = 0x7e00_0000_0000;
const ALIGN: u64 = 256;
const COMPLETION_HEADER_WORDS: u32 = 8;

pub const TOKENIZER_JSON: &str =
    r#"{"version":"1.0","model":{"type":"WordLevel","vocab":{"<unk>":0},"unk_token":"<unk>"}}"#;
pub const CHAT_TEMPLATE: &str = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";

struct Layout {
    next: u64,
    buffers: Vec<pb::Buffer>,
}

impl Layout {
    fn add(
        &mut self,
        name: &str,
        role: pb::BufferRole,
        dtype: pb::Dtype,
        shape: Vec<u64>,
        byte_size: u64,
        payload: pb::buffer::Payload,
    ) -> u32 {
        let id = self.buffers.len() as u32 + 1;
        let offset = self.next;
        self.next = (offset + byte_size).div_ceil(ALIGN) * ALIGN;
        self.buffers.push(pb::Buffer {
            id,
            name: name.to_owned(),
            role: role as i32,
            offset,
            byte_size,
            alignment: ALIGN,
            dtype: dtype as i32,
            shape,
            payload: Some(payload),
        });
        id
    }

    fn offset_of(&self, id: u32) -> u64 {
        self.buffers[id as usize - 1].offset
    }
}

/// Bump allocation of views inside one staging buffer.
struct Views {
    used: u64,
}

impl Views {
    fn take(&mut self, bytes: u64) -> u64 {
        let at = self.used;
        self.used = (at + bytes).div_ceil(16) * 16;
        at
    }
}

struct PlannedBinding {
    value: pb::ValueKind,
    direction: pb::Direction,
    dtype: pb::Dtype,
    shape: Vec<u64>,
    /// Staging inputs or completion records.
    in_completion: bool,
    offset: u64,
}

struct PlannedGraph {
    kind: pb::GraphKind,
    op: pb::MaintenanceOp,
    name: String,
    capacity: pb::GraphCapacity,
    bindings: Vec<PlannedBinding>,
    /// `Graph.completion_token_capacity` as written.
    completion_tokens: u32,
}

impl Fixture {
    /// Builds the fixture described by `spec`.
    pub fn build(spec: &FixtureSpec) -> Fixture {
        let abi2 = spec.abi >= 2;
        let abi4 = spec.abi >= 4;
        let completion_tokens: u32 = if abi2 { 8 } else { 0 };
        let record_words = u64::from(COMPLETION_HEADER_WORDS) + 8;
        let pages_per_request = u64::from(spec.context_limit).div_ceil(u64::from(spec.page_tokens));

        // Plan every graph's bindings first: staging and completion sizes follow from them.
        let mut staging = Views { used: 0 };
        let mut completion = Views { used: 0 };
        let mut graphs = Vec::new();
        let input = |v: &mut Views, value, dtype: pb::Dtype, shape: Vec<u64>| {
            let bytes = shape.iter().product::<u64>() * dtype_size(dtype);
            PlannedBinding {
                value,
                direction: pb::Direction::Input,
                dtype,
                shape,
                in_completion: false,
                offset: v.take(bytes),
            }
        };
        let record_of = |v: &mut Views, b: u64, words: u64| PlannedBinding {
            value: pb::ValueKind::CompletionRecords,
            direction: pb::Direction::Output,
            dtype: pb::Dtype::U32,
            shape: vec![b, words],
            in_completion: true,
            offset: v.take(b * words * 4),
        };
        let record = |v: &mut Views, b: u64| record_of(v, b, record_words);
        use pb::ValueKind as V;
        for &b in &spec.decode_buckets {
            let b64 = u64::from(b);
            let mut bindings = vec![
                input(&mut staging, V::RequestSlots, pb::Dtype::I32, vec![b64]),
                input(&mut staging, V::PageTable, pb::Dtype::I32, vec![b64, pages_per_request]),
                input(&mut staging, V::Temperature, pb::Dtype::F32, vec![b64]),
                input(&mut staging, V::TopK, pb::Dtype::I32, vec![b64]),
                input(&mut staging, V::RngSeed, pb::Dtype::U64, vec![b64]),
            ];
            bindings.push(record(&mut completion, b64));
            graphs.push(PlannedGraph {
                kind: pb::GraphKind::Decode,
                op: pb::MaintenanceOp::Unspecified,
                name: format!("decode_b{b}"),
                capacity: pb::GraphCapacity {
                    request_count: b,
                    token_capacity: b,
                    proposal_depth: 0,
                    patch_capacity: 0,
                },
                bindings,
                completion_tokens,
            });
        }
        for &t in &spec.prefill_capacities {
            let t64 = u64::from(t);
            let bindings = vec![
                input(&mut staging, V::TokenIds, pb::Dtype::I32, vec![t64]),
                input(&mut staging, V::Positions, pb::Dtype::I32, vec![t64]),
                input(&mut staging, V::SlotMapping, pb::Dtype::I64, vec![t64]),
                input(&mut staging, V::PageTable, pb::Dtype::I32, vec![1, pages_per_request]),
                input(&mut staging, V::RequestSlots, pb::Dtype::I32, vec![1]),
                input(&mut staging, V::QueryLengths, pb::Dtype::I32, vec![1]),
                record(&mut completion, 1),
            ];
            graphs.push(PlannedGraph {
                kind: pb::GraphKind::Prefill,
                op: pb::MaintenanceOp::Unspecified,
                name: format!("prefill_t{t}"),
                capacity: pb::GraphCapacity {
                    request_count: 1,
                    token_capacity: t,
                    proposal_depth: 0,
                    patch_capacity: 0,
                },
                bindings,
                completion_tokens,
            });
        }
        graphs.push(PlannedGraph {
            kind: pb::GraphKind::ResumeSampling,
            op: pb::MaintenanceOp::Unspecified,
            name: "resume_b1".into(),
            capacity: pb::GraphCapacity { request_count: 1, token_capacity: 1, proposal_depth: 0, patch_capacity: 0 },
            bindings: vec![
                input(&mut staging, V::RequestSlots, pb::Dtype::I32, vec![1]),
                input(&mut staging, V::StateRowIndices, pb::Dtype::I32, vec![1]),
                record(&mut completion, 1),
            ],
            completion_tokens,
        });
        for (op, name) in [
            (pb::MaintenanceOp::Snapshot, "snapshot"),
            (pb::MaintenanceOp::Restore, "restore"),
            (pb::MaintenanceOp::Initialize, "initialize"),
        ] {
            let mut bindings = vec![input(&mut staging, V::DestinationRows, pb::Dtype::I32, vec![1])];
            if op != pb::MaintenanceOp::Initialize {
                bindings.push(input(&mut staging, V::SourceRows, pb::Dtype::I32, vec![1]));
                bindings.push(input(&mut staging, V::ExpectedConsumed, pb::Dtype::I32, vec![1]));
                if spec.checkpoint_stamps {
                    bindings.push(input(&mut staging, V::CheckpointEpoch, pb::Dtype::I32, vec![1]));
                }
            }
            // A status record carries no tokens: one slot keeps it small.
            let completion_tokens = if spec.checkpoint_stamps {
                bindings.push(record_of(&mut completion, 1, u64::from(COMPLETION_HEADER_WORDS) + 1));
                1
            } else {
                completion_tokens
            };
            graphs.push(PlannedGraph {
                kind: pb::GraphKind::StateMaintenance,
                op,
                name: name.into(),
                capacity: pb::GraphCapacity {
                    request_count: 1,
                    token_capacity: 0,
                    proposal_depth: 0,
                    patch_capacity: 0,
                },
                bindings,
                completion_tokens,
            });
        }

        // Speculative programs: P = B * W lanes, W = D + 1 record token slots.
        let mask_words = u64::from(spec.vocab_size).div_ceil(32);
        for &(b, d) in &spec.speculative_programs {
            let (b64, w) = (u64::from(b), u64::from(d) + 1);
            let p = b64 * w;
            let bindings = vec![
                input(&mut staging, V::TokenIds, pb::Dtype::I32, vec![p]),
                input(&mut staging, V::Positions, pb::Dtype::I32, vec![p]),
                input(&mut staging, V::QueryLengths, pb::Dtype::I32, vec![b64]),
                input(&mut staging, V::RequestSlots, pb::Dtype::I32, vec![b64]),
                input(&mut staging, V::PageTable, pb::Dtype::I32, vec![b64, pages_per_request]),
                input(&mut staging, V::Temperature, pb::Dtype::F32, vec![b64]),
                input(&mut staging, V::TopK, pb::Dtype::I32, vec![b64]),
                input(&mut staging, V::RngSeed, pb::Dtype::U64, vec![b64]),
                input(&mut staging, V::RngCounter, pb::Dtype::U64, vec![b64]),
                input(&mut staging, V::GrammarMask, pb::Dtype::U32, vec![p, mask_words]),
                record_of(&mut completion, b64, u64::from(COMPLETION_HEADER_WORDS) + w),
            ];
            graphs.push(PlannedGraph {
                kind: pb::GraphKind::Speculative,
                op: pb::MaintenanceOp::Unspecified,
                name: format!("speculative_b{b}_d{d}"),
                capacity: pb::GraphCapacity {
                    request_count: b,
                    token_capacity: p as u32,
                    proposal_depth: d,
                    patch_capacity: 0,
                },
                bindings,
                completion_tokens: w as u32,
            });
        }

        // Payload: two small weight tensors in one safetensors file.
        let embed_shape = [u64::from(spec.vocab_size), spec.hidden];
        let embed: Vec<u8> = (0..embed_shape.iter().product::<u64>() * 2).map(|i| (i * 7 % 251) as u8).collect();
        let norm: Vec<u8> = (0..spec.hidden).flat_map(|i| (1.0f32 + i as f32 / 8.0).to_le_bytes()).collect();
        let tensors: HashMap<String, safetensors::tensor::TensorView<'_>> = [
            ("model.embed_tokens.weight".to_owned(), tensor_view(DType::BF16, &embed_shape, &embed)),
            ("model.norm.weight".to_owned(), tensor_view(DType::F32, &[spec.hidden], &norm)),
        ]
        .into_iter()
        .collect();
        let weights_file = safetensors::serialize(&tensors, None).unwrap_or_default();

        // Buffers, laid out in the arena in order.
        let mut layout = Layout { next: 0, buffers: Vec::new() };
        let embed_id = layout.add(
            "model.embed_tokens.weight",
            pb::BufferRole::Weights,
            pb::Dtype::Bf16,
            embed_shape.to_vec(),
            embed.len() as u64,
            pb::buffer::Payload::Safetensors(pb::SafetensorsPayload {
                file_index: 0,
                tensor: "model.embed_tokens.weight".into(),
            }),
        );
        let norm_id = layout.add(
            "model.norm.weight",
            pb::BufferRole::Weights,
            pb::Dtype::F32,
            vec![spec.hidden],
            norm.len() as u64,
            pb::buffer::Payload::Safetensors(pb::SafetensorsPayload {
                file_index: 0,
                tensor: "model.norm.weight".into(),
            }),
        );
        let bytes_per_page = u64::from(spec.page_tokens) * spec.hidden * 2 * 2;
        layout.add(
            "kv_pages",
            pb::BufferRole::KvPages,
            pb::Dtype::Bytes,
            vec![],
            u64::from(spec.max_kv_pages) * bytes_per_page,
            pb::buffer::Payload::Uninitialized(pb::Uninitialized {}),
        );
        let rows_per_slot = u64::from(if abi2 { spec.verification_width } else { 1 });
        let total_rows = 1 + u64::from(spec.request_slots) * rows_per_slot + u64::from(spec.snapshot_rows);
        let rows_id = (spec.continuation_row_bytes > 0).then(|| {
            layout.add(
                "continuation_rows",
                pb::BufferRole::ContinuationRows,
                pb::Dtype::Bytes,
                vec![],
                total_rows * spec.continuation_row_bytes,
                pb::buffer::Payload::ZeroFill(pb::ZeroFill {}),
            )
        });
        let staging_id = layout.add(
            "staging_inputs",
            pb::BufferRole::StagingInputs,
            pb::Dtype::Bytes,
            vec![],
            staging.used.max(16),
            pb::buffer::Payload::ZeroFill(pb::ZeroFill {}),
        );
        let completion_id = layout.add(
            "completion_records",
            pb::BufferRole::CompletionRecords,
            pb::Dtype::Bytes,
            vec![],
            completion.used.max(16),
            pb::buffer::Payload::ZeroFill(pb::ZeroFill {}),
        );
        let scratch_id = layout.add(
            "operator_scratch",
            pb::BufferRole::Scratch,
            pb::Dtype::Bytes,
            vec![],
            4096,
            pb::buffer::Payload::Uninitialized(pb::Uninitialized {}),
        );

        // Kernel images: placeholder bytes with a realistic parameter layout.
        let kernel_bytes =
            [b"FLARE-FIXTURE-CUBIN embed_rmsnorm\0".to_vec(), b"FLARE-FIXTURE-CUBIN sample_tokens\0".to_vec()];
        let kernels = vec![
            pb::KernelImage {
                id: 1,
                file: "kernels/k1.cubin".into(),
                sha256: sha256_hex(&kernel_bytes[0]),
                format: pb::ImageFormat::Cubin as i32,
                function_name: "triton_embed_rmsnorm_0".into(),
                // (tokens*, weights*, norm*, out*, n:i32), then Triton's two scratch pointers.
                params: vec![slot(0, 8), slot(8, 8), slot(16, 8), slot(24, 8), slot(32, 4), slot(40, 8), slot(48, 8)],
                max_dynamic_shared_memory: 0,
                required_threads_per_block: 128,
            },
            pb::KernelImage {
                id: 2,
                file: "kernels/k2.cubin".into(),
                sha256: sha256_hex(&kernel_bytes[1]),
                format: pb::ImageFormat::Cubin as i32,
                function_name: "triton_sample_tokens_0".into(),
                params: vec![slot(0, 8), slot(8, 8), slot(16, 4)],
                max_dynamic_shared_memory: 64 * 1024,
                required_threads_per_block: 0,
            },
        ];

        let arena_address = |id: u32, within: u64| ARENA_BASE + layout.offset_of(id) + within;
        let graphs = graphs
            .into_iter()
            .enumerate()
            .map(|(gi, g)| {
                let id = gi as u32 + 1;
                let bindings: Vec<pb::ValueBinding> = g
                    .bindings
                    .iter()
                    .map(|b| pb::ValueBinding {
                        value: b.value as i32,
                        direction: b.direction as i32,
                        view: Some(pb::BufferRange {
                            buffer_id: if b.in_completion { completion_id } else { staging_id },
                            offset: b.offset,
                        }),
                        dtype: b.dtype as i32,
                        shape: b.shape.clone(),
                    })
                    .collect();
                let first_input = g.bindings.iter().find(|b| !b.in_completion).map_or(0, |b| b.offset);
                let record_offset = g.bindings.iter().find(|b| b.in_completion).map(|b| b.offset);
                let tokens = u64::from(g.capacity.token_capacity.max(1));

                // Node 1: embed+norm kernel reading staging, weights; writing scratch.
                let mut p1 = vec![0u8; 56];
                let r1 = [(0, staging_id, first_input), (1, embed_id, 0), (2, norm_id, 0), (3, scratch_id, 0)];
                let mut relocations = Vec::new();
                for &(param, buffer, within) in &r1 {
                    let at = param as usize * 8;
                    p1[at..at + 8].copy_from_slice(&arena_address(buffer, within).to_le_bytes());
                    relocations.push(pb::Relocation {
                        param_index: param,
                        byte_offset: 0,
                        buffer_id: buffer,
                        buffer_offset: within,
                    });
                }
                p1[32..36].copy_from_slice(&(tokens as u32).to_le_bytes());
                let kernel1 = pb::KernelNode {
                    kernel_id: 1,
                    grid: Some(dim3(tokens as u32, 1, 1)),
                    block: Some(dim3(128, 1, 1)),
                    dynamic_shared_memory: 0,
                    param_bytes: p1,
                    relocations,
                    launch_attributes: if abi2 {
                        vec![pb::LaunchAttribute { value: Some(pb::launch_attribute::Value::Priority(0)) }]
                    } else {
                        vec![]
                    },
                };
                let mut nodes = vec![pb::Node { id: 10, op: Some(pb::node::Op::Kernel(kernel1)) }];
                let mut edges = Vec::new();
                // Node 2: clear part of scratch.
                nodes.push(pb::Node {
                    id: 11,
                    op: Some(pb::node::Op::Memset(pb::MemsetNode {
                        dst: Some(pb::BufferRange { buffer_id: scratch_id, offset: 1024 }),
                        value: 0,
                        element_size: 4,
                        width: 64,
                        height: 2,
                        pitch: 512,
                    })),
                });
                edges.push(pb::Edge { from: 10, to: 11, ..Default::default() });
                let mut last = 11;
                // A maintenance op writes its own status record (emulated), never a sample.
                let sampling_record = record_offset.filter(|_| g.kind != pb::GraphKind::StateMaintenance);
                if let Some(record_offset) = sampling_record {
                    // Node 3: sampling kernel writing the completion record.
                    let mut p2 = vec![0u8; 20];
                    p2[0..8].copy_from_slice(&arena_address(scratch_id, 0).to_le_bytes());
                    p2[8..16].copy_from_slice(&arena_address(completion_id, record_offset).to_le_bytes());
                    p2[16..20].copy_from_slice(&spec.vocab_size.to_le_bytes());
                    nodes.push(pb::Node {
                        id: 12,
                        op: Some(pb::node::Op::Kernel(pb::KernelNode {
                            kernel_id: 2,
                            grid: Some(dim3(g.capacity.request_count.max(1), 1, 1)),
                            block: Some(dim3(256, 1, 1)),
                            dynamic_shared_memory: 32 * 1024,
                            param_bytes: p2,
                            relocations: vec![
                                pb::Relocation {
                                    param_index: 0,
                                    byte_offset: 0,
                                    buffer_id: scratch_id,
                                    buffer_offset: 0,
                                },
                                pb::Relocation {
                                    param_index: 1,
                                    byte_offset: 0,
                                    buffer_id: completion_id,
                                    buffer_offset: record_offset,
                                },
                            ],
                            launch_attributes: vec![],
                        })),
                    });
                    edges.push(pb::Edge { from: 11, to: 12, ..Default::default() });
                    if abi4 {
                        // The sampler may launch as the embedding kernel's blocks trigger; the
                        // full path through the memset still orders it, so results stay exact
                        // on a device whose kernels never wait (the PTX of the device fixture).
                        edges.push(pb::Edge { from: 10, to: 12, dependency: pb::EdgeDependency::Programmatic as i32 });
                    }
                    last = 12;
                }
                // State maintenance copies a row; other graphs record and wait on an event.
                if g.kind == pb::GraphKind::StateMaintenance {
                    if let Some(rows) = rows_id.filter(|_| !spec.checkpoint_stamps) {
                        nodes.push(pb::Node {
                            id: 13,
                            op: Some(pb::node::Op::Memcpy(pb::MemcpyNode {
                                src: Some(pb::BufferRange { buffer_id: rows, offset: spec.continuation_row_bytes }),
                                dst: Some(pb::BufferRange { buffer_id: rows, offset: 2 * spec.continuation_row_bytes }),
                                byte_count: spec.continuation_row_bytes,
                            })),
                        });
                        edges.push(pb::Edge { from: last, to: 13, ..Default::default() });
                    }
                } else {
                    nodes.push(pb::Node {
                        id: 13,
                        op: Some(pb::node::Op::EventRecord(pb::EventRecordNode { event: 0 })),
                    });
                    nodes.push(pb::Node { id: 14, op: Some(pb::node::Op::EventWait(pb::EventWaitNode { event: 0 })) });
                    nodes.push(pb::Node { id: 15, op: Some(pb::node::Op::Empty(pb::EmptyNode {})) });
                    edges.push(pb::Edge { from: last, to: 13, ..Default::default() });
                    edges.push(pb::Edge { from: 13, to: 14, ..Default::default() });
                    edges.push(pb::Edge { from: 14, to: 15, ..Default::default() });
                }
                pb::Graph {
                    id,
                    name: g.name,
                    kind: g.kind as i32,
                    capacity: Some(g.capacity),
                    maintenance_op: g.op as i32,
                    nodes,
                    edges,
                    bindings,
                    event_count: 1,
                    completion_token_capacity: g.completion_tokens,
                    continuation_rows_per_request: if abi2 { 1 } else { 0 },
                    embedding_table_buffers: vec![],
                    requires_producer: 0,
                }
            })
            .collect();

        let arena_size = layout.next.div_ceil(1 << 16) << 16;
        let row_layout = if spec.continuation_row_bytes >= 64 {
            let half = spec.continuation_row_bytes / 2;
            vec![
                pb::RowRegion {
                    name: "recurrent".into(),
                    kind: pb::RowRegionKind::RecurrentState as i32,
                    offset: 0,
                    byte_size: half,
                },
                pb::RowRegion {
                    name: "hidden".into(),
                    kind: pb::RowRegionKind::HiddenVector as i32,
                    offset: half,
                    byte_size: spec.hidden * 2,
                },
            ]
        } else {
            vec![]
        };
        let mut row_layout = row_layout;
        if spec.checkpoint_stamps && !row_layout.is_empty() {
            // The stamp ends the row (the hidden vector ends well before it).
            row_layout.push(pb::RowRegion {
                name: "stamp".into(),
                kind: pb::RowRegionKind::PositionMetadata as i32,
                offset: spec.continuation_row_bytes - STAMP_BYTES,
                byte_size: STAMP_BYTES,
            });
        }
        let sampling = pb::SamplingDefaults {
            temperature: Some(param(0.7, Some((0.05, 2.0)))),
            top_k: Some(param(20.0, Some((0.0, 64.0)))),
            top_p: Some(param(0.95, Some((0.01, 1.0)))),
            min_p: Some(param(0.0, Some((0.0, 1.0)))),
            repetition_penalty: Some(param(1.0, Some((0.5, 2.0)))),
            presence_penalty: Some(param(0.0, Some((-2.0, 2.0)))),
            frequency_penalty: Some(param(0.0, None)),
            max_output_tokens: 256,
        };
        let files = vec![
            ("payloads/weights.safetensors".to_owned(), weights_file),
            (kernels[0].file.clone(), kernel_bytes[0].clone()),
            (kernels[1].file.clone(), kernel_bytes[1].clone()),
            ("frontend/tokenizer.json".to_owned(), TOKENIZER_JSON.as_bytes().to_vec()),
            ("frontend/chat_template.jinja".to_owned(), CHAT_TEMPLATE.as_bytes().to_vec()),
        ];
        let manifest = pb::RuntimeCore {
            identity: Some(pb::Identity {
                abi_version: spec.abi,
                model_fingerprint: sha256_hex(b"flare fixture model"),
                device: Some(pb::PreparingDevice {
                    name: "NVIDIA H200".into(),
                    compute_capability_major: 9,
                    compute_capability_minor: 0,
                    sm_count: 132,
                    total_memory_bytes: 150_000_000_000,
                }),
                cuda_driver_version: 13000,
                cuda_toolkit_version: 13000,
                producer: "helios-contract fixtures".into(),
            }),
            arena: Some(pb::Arena { base_address: ARENA_BASE, byte_size: arena_size, alignment: 1 << 16 }),
            buffers: layout.buffers,
            payload_files: vec![pb::PayloadFile {
                path: files[0].0.clone(),
                sha256: sha256_hex(&files[0].1),
                byte_size: files[0].1.len() as u64,
            }],
            kernels,
            graphs,
            cache_scheme: Some(pb::CacheScheme {
                page_tokens: spec.page_tokens,
                page_regions: vec![
                    pb::PageRegion { name: "k".into(), bytes_per_page: bytes_per_page / 2 },
                    pb::PageRegion { name: "v".into(), bytes_per_page: bytes_per_page / 2 },
                ],
                continuation_row_bytes: spec.continuation_row_bytes,
                row_layout,
                null_row: 0,
                live_rows_per_slot: 1,
                verification_width: if abi2 { spec.verification_width } else { 0 },
                padding_slot: if abi2 { -1 } else { 0 },
            }),
            capacities: Some(pb::Capacities {
                context_limit: spec.context_limit,
                decode_request_buckets: spec.decode_buckets.clone(),
                prefill_chunk_capacities: spec.prefill_capacities.clone(),
                image_patch_buckets: vec![],
                request_slots: spec.request_slots,
                snapshot_rows: spec.snapshot_rows,
                max_kv_pages: spec.max_kv_pages,
                vocab_size: spec.vocab_size,
                completion_record_header_words: COMPLETION_HEADER_WORDS,
            }),
            frontend: Some(pb::Frontend {
                tokenizer: Some(pb::AssetFile { path: files[3].0.clone(), sha256: sha256_hex(&files[3].1) }),
                chat_template: Some(pb::AssetFile { path: files[4].0.clone(), sha256: sha256_hex(&files[4].1) }),
                eos_token_ids: vec![0],
                sampling: Some(sampling),
                reasoning_parser: pb::ReasoningParser::None as i32,
                tool_parser: pb::ToolParser::HermesJson as i32,
                served_model_name: "flare-fixture".into(),
            }),
        };
        Fixture { manifest, files }
    }

    /// Writes the files and the manifest under `dir` (created if needed).
    pub fn write_to(&self, dir: &Path) -> std::io::Result<()> {
        for (path, bytes) in &self.files {
            let full = dir.join(path);
            if let Some(parent) = full.parent() {
                std::fs::create_dir_all(parent)?;
            }
            std::fs::write(full, bytes)?;
        }
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join(MANIFEST_FILE), self.manifest.encode_to_vec())
    }

    /// Adds device-side pending tokens: a zero-filled request-state buffer at the arena's end,
    /// read and written by every decode and speculative graph, written by prefill and resume
    /// sampling.
    /// Returns the buffer's id.
    pub fn add_pending_tokens(&mut self) -> u32 {
        let m = &mut self.manifest;
        let entries = u64::from(m.capacities.as_ref().map_or(0, |c| c.request_slots)) + 1;
        let size = entries * 4;
        let arena = m.arena.get_or_insert_with(Default::default);
        let offset = arena.byte_size.next_multiple_of(256);
        arena.byte_size = offset + size.next_multiple_of(256);
        let id = m.buffers.iter().map(|b| b.id).max().unwrap_or(0) + 1;
        m.buffers.push(pb::Buffer {
            id,
            name: "pending_tokens".into(),
            role: pb::BufferRole::RequestState as i32,
            offset,
            byte_size: size,
            alignment: 256,
            dtype: pb::Dtype::I32 as i32,
            shape: vec![entries],
            payload: Some(pb::buffer::Payload::ZeroFill(pb::ZeroFill {})),
        });
        for g in &mut m.graphs {
            let direction = match pb::GraphKind::try_from(g.kind) {
                Ok(pb::GraphKind::Decode | pb::GraphKind::Speculative) => pb::Direction::StateReadWrite,
                Ok(pb::GraphKind::Prefill | pb::GraphKind::ResumeSampling) => pb::Direction::StateWrite,
                _ => continue,
            };
            g.bindings.push(pb::ValueBinding {
                value: pb::ValueKind::PendingTokens as i32,
                direction: direction as i32,
                view: Some(pb::BufferRange { buffer_id: id, offset: 0 }),
                dtype: pb::Dtype::I32 as i32,
                shape: vec![entries],
            });
        }
        id
    }

    /// Contents of a fixture file by core-relative path.
    pub fn file_mut(&mut self, path: &str) -> Option<&mut Vec<u8>> {
        self.files.iter_mut().find(|(p, _)| p == path).map(|(_, b)| b)
    }
}

fn dtype_size(d: pb::Dtype) -> u64 {
    match d {
        pb::Dtype::I64 | pb::Dtype::U64 | pb::Dtype::F64 => 8,
        pb::Dtype::I32 | pb::Dtype::U32 | pb::Dtype::F32 => 4,
        pb::Dtype::Bf16 | pb::Dtype::F16 | pb::Dtype::I16 => 2,
        _ => 1,
    }
}

fn slot(offset: u32, size: u32) -> pb::ParamSlot {
    pb::ParamSlot { offset, size }
}

fn dim3(x: u32, y: u32, z: u32) -> pb::Dim3 {
    pb::Dim3 { x, y, z }
}

fn param(default: f64, range: Option<(f64, f64)>) -> pb::SamplingParameter {
    pb::SamplingParameter { default, range: range.map(|(min, max)| pb::Range { min, max }) }
}

fn tensor_view<'a>(dtype: DType, shape: &[u64], data: &'a [u8]) -> safetensors::tensor::TensorView<'a> {
    let shape: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
    match safetensors::tensor::TensorView::new(to_safetensors_dtype(dtype), shape, data) {
        Ok(view) => view,
        Err(e) => panic!("fixture tensor is inconsistent: {e}"),
    }
}
