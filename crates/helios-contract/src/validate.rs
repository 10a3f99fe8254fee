//! Decoded protobuf → validated [`Manifest`]. Pure: touches no file and no device.
//!
//! Order: identity (selects the ABI reader), arena, buffers, payload files, kernels, cache
//! scheme, capacities, graphs (which need all of the above; the speculative programs of the
//! capacities are derived from them), frontend. The first violation is returned, naming its
//! field.

use std::collections::{BTreeMap, HashSet};

use crate::compat::AbiReader;
use crate::error::{CoreError, FieldPath, InvalidReason, RangeOwner, ReferenceKind};
use crate::model::*;
use crate::pb;
use crate::prepared::{bindable, expected_view, required_values};

type Result<T> = std::result::Result<T, CoreError>;

/// Upper bound on CUDA threads per block.
const MAX_THREADS_PER_BLOCK: u64 = 1024;
/// Dynamic shared memory a kernel may use without raising its function attribute.
const DEFAULT_DYNAMIC_SHARED_MEMORY: u32 = 48 * 1024;

/// Validates a decoded manifest.
pub fn validate(raw: &pb::RuntimeCore) -> Result<Manifest> {
    let root = FieldPath::root("core");
    let identity_raw = required(&raw.identity, &root.field("identity"))?;
    let identity = identity(identity_raw, &root.field("identity"))?;
    let abi = AbiReader::for_version(&root.field("identity").field("abi_version"), identity.abi_version)?;
    let arena = arena(required(&raw.arena, &root.field("arena"))?, &root.field("arena"))?;
    let payload_files = payload_files(&raw.payload_files, &root.field("payload_files"))?;
    let buffers = buffers(&raw.buffers, &arena, payload_files.len(), &root.field("buffers"))?;
    let kernels = kernels(&raw.kernels, &root.field("kernels"))?;
    let scheme_path = root.field("cache_scheme");
    let cache_scheme = cache_scheme(required(&raw.cache_scheme, &scheme_path)?, abi, &scheme_path)?;
    let caps_path = root.field("capacities");
    let mut capacities = capacities(required(&raw.capacities, &caps_path)?, &caps_path)?;
    check_cache_storage(&buffers, &cache_scheme, &capacities, &root.field("buffers"))?;
    let ctx = GraphContext {
        abi,
        arena: &arena,
        buffers: &buffers,
        kernels: &kernels,
        scheme: &cache_scheme,
        caps: &capacities,
    };
    let graphs = graphs(&raw.graphs, &ctx, &root.field("graphs"))?;
    capacities.speculative_programs = speculative_programs(&graphs);
    check_graph_catalog(&graphs, &capacities, &caps_path)?;
    let fe_path = root.field("frontend");
    let frontend = frontend(required(&raw.frontend, &fe_path)?, &capacities, &fe_path)?;
    Ok(Manifest { identity, arena, buffers, payload_files, kernels, graphs, cache_scheme, capacities, frontend })
}

fn required<'a, T>(value: &'a Option<T>, field: &FieldPath) -> Result<&'a T> {
    value.as_ref().ok_or_else(|| CoreError::MissingField { field: field.clone() })
}

fn invalid(field: &FieldPath, reason: InvalidReason) -> CoreError {
    CoreError::InvalidValue { field: field.clone(), reason }
}

fn positive_u32(v: u32, field: &FieldPath) -> Result<u32> {
    if v == 0 { Err(invalid(field, InvalidReason::MustBePositive)) } else { Ok(v) }
}

fn positive_u64(v: u64, field: &FieldPath) -> Result<u64> {
    if v == 0 { Err(invalid(field, InvalidReason::MustBePositive)) } else { Ok(v) }
}

fn non_empty(s: &str, field: &FieldPath) -> Result<String> {
    if s.is_empty() { Err(CoreError::MissingField { field: field.clone() }) } else { Ok(s.to_owned()) }
}

fn power_of_two(v: u64, field: &FieldPath) -> Result<u64> {
    if v.is_power_of_two() { Ok(v) } else { Err(invalid(field, InvalidReason::NotPowerOfTwo(v))) }
}

fn sha256_hex(s: &str, field: &FieldPath) -> Result<String> {
    let ok = s.len() == 64 && s.bytes().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c));
    if ok { Ok(s.to_owned()) } else { Err(invalid(field, InvalidReason::NotHexSha256)) }
}

/// A relative, '/'-separated path that cannot leave the core directory.
pub(crate) fn safe_path(s: &str, field: &FieldPath) -> Result<String> {
    let ok = !s.is_empty()
        && !s.starts_with('/')
        && !s.contains('\\')
        && s.split('/').all(|part| !part.is_empty() && part != ".." && part != ".");
    if ok { Ok(s.to_owned()) } else { Err(invalid(field, InvalidReason::UnsafePath)) }
}

/// `[start, start + len)` must lie within `limit`, without overflow.
fn in_range(field: &FieldPath, what: RangeOwner, start: u64, len: u64, limit: u64) -> Result<()> {
    match start.checked_add(len) {
        Some(end) if end <= limit => Ok(()),
        end => Err(CoreError::OutOfRange { field: field.clone(), what, start, end: end.unwrap_or(u64::MAX), limit }),
    }
}

fn enum_value<E: TryFrom<i32>>(raw: i32, field: &FieldPath) -> Result<E> {
    if raw == 0 {
        return Err(CoreError::UnknownEnum { field: field.clone(), value: raw });
    }
    E::try_from(raw).map_err(|_| CoreError::UnknownEnum { field: field.clone(), value: raw })
}

fn ascending(values: &[u32], field: &FieldPath, allow_empty: bool) -> Result<Vec<u32>> {
    if values.is_empty() && !allow_empty {
        return Err(invalid(field, InvalidReason::EmptyList));
    }
    for (i, pair) in values.windows(2).enumerate() {
        if pair[1] <= pair[0] {
            return Err(CoreError::NotAscending {
                field: field.clone(),
                index: i + 1,
                previous: u64::from(pair[0]),
                value: u64::from(pair[1]),
            });
        }
    }
    if let Some(0) = values.first() {
        return Err(invalid(&field.index(0), InvalidReason::MustBePositive));
    }
    Ok(values.to_vec())
}

fn identity(raw: &pb::Identity, path: &FieldPath) -> Result<Identity> {
    let device_path = path.field("device");
    let device = required(&raw.device, &device_path)?;
    Ok(Identity {
        abi_version: raw.abi_version,
        model_fingerprint: sha256_hex(&raw.model_fingerprint, &path.field("model_fingerprint"))?,
        device: PreparingDevice {
            name: non_empty(&device.name, &device_path.field("name"))?,
            compute_capability: (
                positive_u32(device.compute_capability_major, &device_path.field("compute_capability_major"))?,
                device.compute_capability_minor,
            ),
            sm_count: positive_u32(device.sm_count, &device_path.field("sm_count"))?,
            total_memory_bytes: device.total_memory_bytes,
        },
        cuda_driver_version: positive_u32(raw.cuda_driver_version, &path.field("cuda_driver_version"))?,
        cuda_toolkit_version: positive_u32(raw.cuda_toolkit_version, &path.field("cuda_toolkit_version"))?,
        producer: raw.producer.clone(),
    })
}

fn arena(raw: &pb::Arena, path: &FieldPath) -> Result<Arena> {
    let alignment = power_of_two(raw.alignment, &path.field("alignment"))?;
    let base_address = positive_u64(raw.base_address, &path.field("base_address"))?;
    if base_address % alignment != 0 {
        return Err(invalid(
            &path.field("base_address"),
            InvalidReason::Misaligned { offset: base_address, alignment },
        ));
    }
    let byte_size = positive_u64(raw.byte_size, &path.field("byte_size"))?;
    in_range(&path.field("byte_size"), RangeOwner::Arena, base_address, byte_size, u64::MAX)?;
    Ok(Arena { base_address, byte_size, alignment })
}

fn dtype(raw: i32, field: &FieldPath) -> Result<DType> {
    Ok(match enum_value::<pb::Dtype>(raw, field)? {
        pb::Dtype::Unspecified => return Err(CoreError::UnknownEnum { field: field.clone(), value: raw }),
        pb::Dtype::Bf16 => DType::BF16,
        pb::Dtype::F16 => DType::F16,
        pb::Dtype::F32 => DType::F32,
        pb::Dtype::F64 => DType::F64,
        pb::Dtype::I8 => DType::I8,
        pb::Dtype::U8 => DType::U8,
        pb::Dtype::I16 => DType::I16,
        pb::Dtype::I32 => DType::I32,
        pb::Dtype::I64 => DType::I64,
        pb::Dtype::U32 => DType::U32,
        pb::Dtype::U64 => DType::U64,
        pb::Dtype::Bool => DType::Bool,
        pb::Dtype::F8E4m3 => DType::F8E4M3,
        pb::Dtype::F8E5m2 => DType::F8E5M2,
        pb::Dtype::Bytes => DType::Bytes,
    })
}

fn buffer_role(raw: i32, field: &FieldPath) -> Result<BufferRole> {
    Ok(match enum_value::<pb::BufferRole>(raw, field)? {
        pb::BufferRole::Unspecified => return Err(CoreError::UnknownEnum { field: field.clone(), value: raw }),
        pb::BufferRole::Weights => BufferRole::Weights,
        pb::BufferRole::Constants => BufferRole::Constants,
        pb::BufferRole::GraphPool => BufferRole::GraphPool,
        pb::BufferRole::Scratch => BufferRole::Scratch,
        pb::BufferRole::KvPages => BufferRole::KvPages,
        pb::BufferRole::ContinuationRows => BufferRole::ContinuationRows,
        pb::BufferRole::StagingInputs => BufferRole::StagingInputs,
        pb::BufferRole::CompletionRecords => BufferRole::CompletionRecords,
        pb::BufferRole::EmbeddingTable => BufferRole::EmbeddingTable,
        pb::BufferRole::RequestState => BufferRole::RequestState,
    })
}

/// Element count × dtype size, or `None` on overflow.
fn shape_bytes(shape: &[u64], dtype: DType) -> Option<u64> {
    shape.iter().try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
}

fn payload_files(raw: &[pb::PayloadFile], path: &FieldPath) -> Result<Vec<PayloadFile>> {
    let mut seen = HashSet::new();
    raw.iter()
        .enumerate()
        .map(|(i, f)| {
            let p = path.index(i);
            let file_path = safe_path(&f.path, &p.field("path"))?;
            if !seen.insert(file_path.clone()) {
                return Err(invalid(&p.field("path"), InvalidReason::DuplicateName(file_path)));
            }
            Ok(PayloadFile {
                path: file_path,
                sha256: sha256_hex(&f.sha256, &p.field("sha256"))?,
                byte_size: f.byte_size,
            })
        })
        .collect()
}

fn buffers(raw: &[pb::Buffer], arena: &Arena, payload_count: usize, path: &FieldPath) -> Result<Vec<Buffer>> {
    let mut out: Vec<(usize, Buffer)> = Vec::with_capacity(raw.len());
    let mut ids = HashSet::new();
    for (i, b) in raw.iter().enumerate() {
        let p = path.index(i);
        if !ids.insert(b.id) {
            return Err(CoreError::DuplicateId { field: p.field("id"), id: b.id });
        }
        let role = buffer_role(b.role, &p.field("role"))?;
        let dtype = dtype(b.dtype, &p.field("dtype"))?;
        let alignment = power_of_two(b.alignment, &p.field("alignment"))?;
        if alignment > arena.alignment {
            return Err(invalid(
                &p.field("alignment"),
                InvalidReason::Misaligned { offset: arena.alignment, alignment },
            ));
        }
        if b.offset % alignment != 0 {
            return Err(invalid(&p.field("offset"), InvalidReason::Misaligned { offset: b.offset, alignment }));
        }
        let byte_size = positive_u64(b.byte_size, &p.field("byte_size"))?;
        in_range(&p.field("byte_size"), RangeOwner::Arena, b.offset, byte_size, arena.byte_size)?;
        if !b.shape.is_empty() {
            match shape_bytes(&b.shape, dtype) {
                Some(n) if n == byte_size => {}
                n => {
                    return Err(invalid(
                        &p.field("shape"),
                        InvalidReason::ShapeSize { shape_bytes: n.unwrap_or(u64::MAX), byte_size },
                    ));
                }
            }
        }
        let payload = match required(&b.payload, &p.field("payload"))? {
            pb::buffer::Payload::Safetensors(s) => {
                let sp = p.field("safetensors");
                let file_index = s.file_index as usize;
                if file_index >= payload_count {
                    return Err(CoreError::DanglingReference {
                        field: sp.field("file_index"),
                        kind: ReferenceKind::PayloadFile,
                        id: s.file_index,
                    });
                }
                Payload::Safetensors { file_index, tensor: non_empty(&s.tensor, &sp.field("tensor"))? }
            }
            pb::buffer::Payload::ZeroFill(_) => Payload::ZeroFill,
            pb::buffer::Payload::Uninitialized(_) => Payload::Uninitialized,
        };
        let buffer = Buffer {
            id: BufferId(b.id),
            name: non_empty(&b.name, &p.field("name"))?,
            role,
            offset: b.offset,
            byte_size,
            alignment,
            dtype,
            shape: b.shape.clone(),
            payload,
        };
        out.push((i, buffer));
    }
    // Overlap: after sorting by offset, each buffer must end before the next begins.
    out.sort_by_key(|(_, b)| b.offset);
    for pair in out.windows(2) {
        let ((_, a), (j, b)) = (&pair[0], &pair[1]);
        if a.end() > b.offset {
            return Err(CoreError::OverlappingBuffers {
                field: path.index(*j).field("offset"),
                first: a.id.0,
                second: b.id.0,
            });
        }
    }
    let mut buffers: Vec<Buffer> = out.into_iter().map(|(_, b)| b).collect();
    buffers.sort_by_key(|b| b.id);
    Ok(buffers)
}

fn kernels(raw: &[pb::KernelImage], path: &FieldPath) -> Result<Vec<KernelImage>> {
    let mut ids = HashSet::new();
    let mut out = Vec::with_capacity(raw.len());
    for (i, k) in raw.iter().enumerate() {
        let p = path.index(i);
        if !ids.insert(k.id) {
            return Err(CoreError::DuplicateId { field: p.field("id"), id: k.id });
        }
        let format = match enum_value::<pb::ImageFormat>(k.format, &p.field("format"))? {
            pb::ImageFormat::Cubin => ImageFormat::Cubin,
            pb::ImageFormat::Ptx => ImageFormat::Ptx,
            pb::ImageFormat::Fatbin => ImageFormat::Fatbin,
            pb::ImageFormat::Unspecified => {
                return Err(CoreError::UnknownEnum { field: p.field("format"), value: k.format });
            }
        };
        let mut params = Vec::with_capacity(k.params.len());
        let mut next_free = 0u32;
        for (j, slot) in k.params.iter().enumerate() {
            let sp = p.field("params").index(j);
            positive_u32(slot.size, &sp.field("size"))?;
            if slot.offset < next_free {
                return Err(invalid(&sp.field("offset"), InvalidReason::Overlap { other: j.saturating_sub(1) }));
            }
            next_free = slot.offset.checked_add(slot.size).ok_or_else(|| CoreError::OutOfRange {
                field: sp.field("size"),
                what: RangeOwner::ParamBytes,
                start: u64::from(slot.offset),
                end: u64::MAX,
                limit: u64::from(u32::MAX),
            })?;
            params.push(ParamSlot { offset: slot.offset, size: slot.size });
        }
        out.push(KernelImage {
            id: KernelId(k.id),
            file: safe_path(&k.file, &p.field("file"))?,
            sha256: sha256_hex(&k.sha256, &p.field("sha256"))?,
            format,
            function_name: non_empty(&k.function_name, &p.field("function_name"))?,
            params,
            max_dynamic_shared_memory: k.max_dynamic_shared_memory,
            required_threads_per_block: k.required_threads_per_block,
        });
    }
    out.sort_by_key(|k| k.id);
    Ok(out)
}

fn cache_scheme(raw: &pb::CacheScheme, abi: AbiReader, path: &FieldPath) -> Result<CacheScheme> {
    let page_tokens = positive_u32(raw.page_tokens, &path.field("page_tokens"))?;
    if raw.page_regions.is_empty() {
        return Err(invalid(&path.field("page_regions"), InvalidReason::EmptyList));
    }
    let mut names = HashSet::new();
    let mut page_regions = Vec::with_capacity(raw.page_regions.len());
    for (i, r) in raw.page_regions.iter().enumerate() {
        let p = path.field("page_regions").index(i);
        let name = non_empty(&r.name, &p.field("name"))?;
        if !names.insert(name.clone()) {
            return Err(invalid(&p.field("name"), InvalidReason::DuplicateName(name)));
        }
        page_regions
            .push(PageRegion { name, bytes_per_page: positive_u64(r.bytes_per_page, &p.field("bytes_per_page"))? });
    }
    let mut row_layout = Vec::with_capacity(raw.row_layout.len());
    for (i, r) in raw.row_layout.iter().enumerate() {
        let p = path.field("row_layout").index(i);
        let kind = match enum_value::<pb::RowRegionKind>(r.kind, &p.field("kind"))? {
            pb::RowRegionKind::RecurrentState => RowRegionKind::RecurrentState,
            pb::RowRegionKind::ConvolutionHistory => RowRegionKind::ConvolutionHistory,
            pb::RowRegionKind::PartialPage => RowRegionKind::PartialPage,
            pb::RowRegionKind::HiddenVector => RowRegionKind::HiddenVector,
            pb::RowRegionKind::PositionMetadata => RowRegionKind::PositionMetadata,
            pb::RowRegionKind::TokenHistory => RowRegionKind::TokenHistory,
            pb::RowRegionKind::Unspecified => {
                return Err(CoreError::UnknownEnum { field: p.field("kind"), value: r.kind });
            }
        };
        positive_u64(r.byte_size, &p.field("byte_size"))?;
        if kind == RowRegionKind::PositionMetadata {
            // The stamp's layout is fixed ([consumed: i32, epoch: i32]), and a row has one.
            if r.byte_size != STAMP_BYTES {
                return Err(invalid(&p.field("byte_size"), InvalidReason::StampSize(r.byte_size)));
            }
            if row_layout.iter().any(|(_, o): &(usize, RowRegion)| o.kind == kind) {
                return Err(invalid(&p.field("kind"), InvalidReason::DuplicateRowRegion("position metadata")));
            }
        }
        in_range(&p.field("byte_size"), RangeOwner::RowLayout, r.offset, r.byte_size, raw.continuation_row_bytes)?;
        row_layout.push((
            i,
            RowRegion { name: non_empty(&r.name, &p.field("name"))?, kind, offset: r.offset, byte_size: r.byte_size },
        ));
    }
    row_layout.sort_by_key(|(_, r)| r.offset);
    for pair in row_layout.windows(2) {
        let ((i, a), (j, b)) = (&pair[0], &pair[1]);
        if a.offset + a.byte_size > b.offset {
            return Err(invalid(
                &path.field("row_layout").index(*j).field("offset"),
                InvalidReason::Overlap { other: *i },
            ));
        }
    }
    if raw.null_row != 0 {
        return Err(invalid(&path.field("null_row"), InvalidReason::MustBeZero(u64::from(raw.null_row))));
    }
    Ok(CacheScheme {
        page_tokens,
        page_regions,
        continuation_row_bytes: raw.continuation_row_bytes,
        row_layout: row_layout.into_iter().map(|(_, r)| r).collect(),
        null_row: 0,
        live_rows_per_slot: positive_u32(raw.live_rows_per_slot, &path.field("live_rows_per_slot"))?,
        verification_width: abi.verification_width(&path.field("verification_width"), raw.verification_width)?,
        padding_slot: abi.padding_slot(&path.field("padding_slot"), raw.padding_slot)?,
    })
}

fn capacities(raw: &pb::Capacities, path: &FieldPath) -> Result<Capacities> {
    let decode = ascending(&raw.decode_request_buckets, &path.field("decode_request_buckets"), false)?;
    let request_slots = positive_u32(raw.request_slots, &path.field("request_slots"))?;
    if let Some(&largest) = decode.last()
        && largest > request_slots
    {
        return Err(CoreError::OutOfRange {
            field: path.field("decode_request_buckets").index(decode.len() - 1),
            what: RangeOwner::Limit("request_slots"),
            start: 0,
            end: u64::from(largest),
            limit: u64::from(request_slots),
        });
    }
    Ok(Capacities {
        context_limit: positive_u32(raw.context_limit, &path.field("context_limit"))?,
        decode_request_buckets: decode,
        prefill_chunk_capacities: ascending(
            &raw.prefill_chunk_capacities,
            &path.field("prefill_chunk_capacities"),
            false,
        )?,
        image_patch_buckets: ascending(&raw.image_patch_buckets, &path.field("image_patch_buckets"), true)?,
        request_slots,
        snapshot_rows: raw.snapshot_rows,
        max_kv_pages: positive_u32(raw.max_kv_pages, &path.field("max_kv_pages"))?,
        vocab_size: positive_u32(raw.vocab_size, &path.field("vocab_size"))?,
        completion_record_header_words: raw.completion_record_header_words,
        // Derived from the speculative graphs once they are validated.
        speculative_programs: Vec::new(),
    })
}

/// The KV page range and the continuation-row range must be exactly what the scheme describes.
fn check_cache_storage(buffers: &[Buffer], scheme: &CacheScheme, caps: &Capacities, path: &FieldPath) -> Result<()> {
    let expected_pages = u64::from(caps.max_kv_pages) * scheme.bytes_per_page();
    let rows = u64::from(scheme.total_rows(caps.request_slots, caps.snapshot_rows));
    let expected_rows = rows * scheme.continuation_row_bytes;
    for (role, expected) in [(BufferRole::KvPages, expected_pages), (BufferRole::ContinuationRows, expected_rows)] {
        let mut found = buffers.iter().filter(|b| b.role == role);
        match (found.next(), found.next()) {
            (None, _) if expected == 0 => {}
            (None, _) => return Err(CoreError::MissingField { field: path.field(role.name()) }),
            (Some(b), None) => {
                if b.byte_size != expected {
                    return Err(CoreError::ViewSize {
                        field: path.field(&b.name).field("byte_size"),
                        expected,
                        actual: b.byte_size,
                    });
                }
            }
            (Some(_), Some(second)) => {
                return Err(CoreError::DuplicateId { field: path.field(role.name()), id: second.id.0 });
            }
        }
    }
    Ok(())
}

struct GraphContext<'a> {
    abi: AbiReader,
    arena: &'a Arena,
    buffers: &'a [Buffer],
    kernels: &'a [KernelImage],
    scheme: &'a CacheScheme,
    caps: &'a Capacities,
}

impl GraphContext<'_> {
    fn buffer(&self, id: u32, field: &FieldPath) -> Result<&Buffer> {
        self.buffers
            .binary_search_by_key(&BufferId(id), |b| b.id)
            .map(|i| &self.buffers[i])
            .map_err(|_| CoreError::DanglingReference { field: field.clone(), kind: ReferenceKind::Buffer, id })
    }

    fn kernel(&self, id: u32, field: &FieldPath) -> Result<&KernelImage> {
        self.kernels
            .binary_search_by_key(&KernelId(id), |k| k.id)
            .map(|i| &self.kernels[i])
            .map_err(|_| CoreError::DanglingReference { field: field.clone(), kind: ReferenceKind::Kernel, id })
    }

    fn range(&self, raw: &Option<pb::BufferRange>, len: u64, path: &FieldPath) -> Result<BufferRange> {
        let r = required(raw, path)?;
        let buffer = self.buffer(r.buffer_id, &path.field("buffer_id"))?;
        in_range(&path.field("offset"), RangeOwner::Buffer(r.buffer_id), r.offset, len, buffer.byte_size)?;
        Ok(BufferRange { buffer: buffer.id, offset: r.offset })
    }
}

fn graph_kind(raw: i32, field: &FieldPath) -> Result<GraphKind> {
    Ok(match enum_value::<pb::GraphKind>(raw, field)? {
        pb::GraphKind::Prefill => GraphKind::Prefill,
        pb::GraphKind::Decode => GraphKind::Decode,
        pb::GraphKind::ResumeSampling => GraphKind::ResumeSampling,
        pb::GraphKind::StateMaintenance => GraphKind::StateMaintenance,
        pb::GraphKind::Vision => GraphKind::Vision,
        pb::GraphKind::TuningProducer => GraphKind::TuningProducer,
        pb::GraphKind::Speculative => GraphKind::Speculative,
        pb::GraphKind::Unspecified => return Err(CoreError::UnknownEnum { field: field.clone(), value: raw }),
    })
}

fn graphs(raw: &[pb::Graph], ctx: &GraphContext<'_>, path: &FieldPath) -> Result<Vec<Graph>> {
    let mut ids = HashSet::new();
    for (i, g) in raw.iter().enumerate() {
        positive_u32(g.id, &path.index(i).field("id"))?;
        if !ids.insert(g.id) {
            return Err(CoreError::DuplicateId { field: path.index(i).field("id"), id: g.id });
        }
    }
    let kinds: BTreeMap<u32, i32> = raw.iter().map(|g| (g.id, g.kind)).collect();
    let mut out =
        raw.iter().enumerate().map(|(i, g)| graph(g, ctx, &kinds, &path.index(i))).collect::<Result<Vec<_>>>()?;
    // The scheduler and executor address a speculative program by (requests, depth).
    let mut programs = HashSet::new();
    for (i, g) in out.iter().enumerate().filter(|(_, g)| g.kind == GraphKind::Speculative) {
        let (requests, depth) = (g.capacity.request_count, g.capacity.proposal_depth);
        if !programs.insert((requests, depth)) {
            return Err(invalid(&path.index(i).field("capacity"), InvalidReason::DuplicateProgram { requests, depth }));
        }
    }
    out.sort_by_key(|g| g.id);
    Ok(out)
}

/// The programs of validated speculative graphs, ascending by (requests, depth).
fn speculative_programs(graphs: &[Graph]) -> Vec<SpeculativeProgram> {
    let mut programs: Vec<SpeculativeProgram> = graphs
        .iter()
        .filter(|g| g.kind == GraphKind::Speculative)
        .map(|g| SpeculativeProgram::rectangular(g.capacity.request_count, g.capacity.proposal_depth))
        .collect();
    programs.sort_by_key(|p| (p.requests, p.depth));
    programs
}

fn graph(raw: &pb::Graph, ctx: &GraphContext<'_>, kinds: &BTreeMap<u32, i32>, path: &FieldPath) -> Result<Graph> {
    let kind = graph_kind(raw.kind, &path.field("kind"))?;
    if kind == GraphKind::Speculative && !ctx.abi.has_speculative_programs() {
        return Err(invalid(&path.field("kind"), InvalidReason::NeedsAbi { abi: 3, found: ctx.abi.version() }));
    }
    let maintenance_op = match (kind, raw.maintenance_op) {
        (GraphKind::StateMaintenance, op) => {
            Some(match enum_value::<pb::MaintenanceOp>(op, &path.field("maintenance_op"))? {
                pb::MaintenanceOp::Initialize => MaintenanceOp::Initialize,
                pb::MaintenanceOp::Restore => MaintenanceOp::Restore,
                pb::MaintenanceOp::Snapshot => MaintenanceOp::Snapshot,
                pb::MaintenanceOp::Reset => MaintenanceOp::Reset,
                pb::MaintenanceOp::AdmitHistogram => MaintenanceOp::AdmitHistogram,
                pb::MaintenanceOp::Unspecified => {
                    return Err(CoreError::UnknownEnum { field: path.field("maintenance_op"), value: op });
                }
            })
        }
        (_, 0) => None,
        (_, _) => return Err(invalid(&path.field("maintenance_op"), InvalidReason::MaintenanceOpMismatch)),
    };
    let cap_path = path.field("capacity");
    let cap = required(&raw.capacity, &cap_path)?;
    let capacity = GraphCapacity {
        request_count: cap.request_count,
        token_capacity: cap.token_capacity,
        proposal_depth: cap.proposal_depth,
        patch_capacity: cap.patch_capacity,
    };
    match kind {
        GraphKind::Prefill | GraphKind::Decode => {
            positive_u32(capacity.request_count, &cap_path.field("request_count"))?;
            positive_u32(capacity.token_capacity, &cap_path.field("token_capacity"))?;
        }
        GraphKind::ResumeSampling | GraphKind::StateMaintenance => {
            positive_u32(capacity.request_count, &cap_path.field("request_count"))?;
        }
        GraphKind::Vision => {
            positive_u32(capacity.patch_capacity, &cap_path.field("patch_capacity"))?;
        }
        GraphKind::TuningProducer => {}
        GraphKind::Speculative => {
            let b = positive_u32(capacity.request_count, &cap_path.field("request_count"))?;
            let d = positive_u32(capacity.proposal_depth, &cap_path.field("proposal_depth"))?;
            let lanes = u64::from(b) * (u64::from(d) + 1);
            if u64::from(capacity.token_capacity) != lanes {
                return Err(invalid(
                    &cap_path.field("token_capacity"),
                    InvalidReason::ProgramShape { expected: lanes, found: u64::from(capacity.token_capacity) },
                ));
            }
        }
    }
    if capacity.request_count > ctx.caps.request_slots {
        return Err(CoreError::OutOfRange {
            field: cap_path.field("request_count"),
            what: RangeOwner::Limit("request_slots"),
            start: 0,
            end: u64::from(capacity.request_count),
            limit: u64::from(ctx.caps.request_slots),
        });
    }

    // Nodes and edges.
    let mut node_index = BTreeMap::new();
    for (i, n) in raw.nodes.iter().enumerate() {
        if node_index.insert(n.id, i).is_some() {
            return Err(CoreError::DuplicateId { field: path.field("nodes").index(i).field("id"), id: n.id });
        }
    }
    let nodes = raw
        .nodes
        .iter()
        .enumerate()
        .map(|(i, n)| node(n, raw.event_count, ctx, &path.field("nodes").index(i)))
        .collect::<Result<Vec<_>>>()?;
    let mut edges = Vec::with_capacity(raw.edges.len());
    for (i, e) in raw.edges.iter().enumerate() {
        let p = path.field("edges").index(i);
        let lookup = |id: u32, name: &str| {
            node_index.get(&id).copied().ok_or_else(|| CoreError::DanglingReference {
                field: p.field(name),
                kind: ReferenceKind::Node,
                id,
            })
        };
        let (from, to) = (lookup(e.from, "from")?, lookup(e.to, "to")?);
        if from == to {
            return Err(invalid(&p, InvalidReason::SelfEdge));
        }
        let dependency = dependency(e.dependency, ctx.abi, &p.field("dependency"))?;
        if dependency.is_programmatic() {
            // The driver joins kernel nodes only; a kernel waits with griddepcontrol.wait.
            for (end, index) in [("from", from), ("to", to)] {
                if !matches!(nodes[index].op, NodeOp::Kernel(_)) {
                    let node = nodes[index].id;
                    return Err(invalid(&p.field(end), InvalidReason::ProgrammaticEdgeNotBetweenKernels { node }));
                }
            }
        }
        edges.push(Edge { from, to, dependency });
    }
    if let Some(node) = find_cycle(nodes.len(), &edges) {
        return Err(CoreError::GraphCycle { field: path.field("edges"), node: nodes[node].id });
    }

    let mut graph = Graph {
        id: GraphId(raw.id),
        name: non_empty(&raw.name, &path.field("name"))?,
        kind,
        capacity,
        maintenance_op,
        nodes,
        edges,
        bindings: Vec::new(),
        event_count: raw.event_count,
        completion_token_capacity: ctx.abi.completion_token_capacity(raw.completion_token_capacity),
        continuation_rows_per_request: ctx.abi.continuation_rows_per_request(raw.continuation_rows_per_request),
        embedding_table_buffers: Vec::new(),
        requires_producer: None,
    };
    // A speculative record holds up to one token per lane of a request.
    let width = u64::from(graph.capacity.proposal_depth) + 1;
    if kind == GraphKind::Speculative && u64::from(graph.completion_token_capacity) != width {
        return Err(invalid(
            &path.field("completion_token_capacity"),
            InvalidReason::ProgramShape { expected: width, found: u64::from(graph.completion_token_capacity) },
        ));
    }
    if graph.continuation_rows_per_request > ctx.scheme.rows_per_slot() {
        return Err(CoreError::OutOfRange {
            field: path.field("continuation_rows_per_request"),
            what: RangeOwner::Limit("rows per slot"),
            start: 0,
            end: u64::from(graph.continuation_rows_per_request),
            limit: u64::from(ctx.scheme.rows_per_slot()),
        });
    }
    for (i, &id) in raw.embedding_table_buffers.iter().enumerate() {
        let p = path.field("embedding_table_buffers").index(i);
        let b = ctx.buffer(id, &p)?;
        if b.role != BufferRole::EmbeddingTable {
            return Err(invalid(&p, InvalidReason::WrongRole { role: b.role.name() }));
        }
        graph.embedding_table_buffers.push(b.id);
    }
    if raw.requires_producer != 0 {
        let p = path.field("requires_producer");
        match kinds.get(&raw.requires_producer) {
            Some(&k) if k == pb::GraphKind::TuningProducer as i32 => {
                graph.requires_producer = Some(GraphId(raw.requires_producer))
            }
            Some(_) => return Err(invalid(&p, InvalidReason::WrongRole { role: "non-producer graph" })),
            None => {
                return Err(CoreError::DanglingReference {
                    field: p,
                    kind: ReferenceKind::Graph,
                    id: raw.requires_producer,
                });
            }
        }
    }
    graph.bindings = bindings(&raw.bindings, &graph, ctx, &path.field("bindings"))?;
    Ok(graph)
}

fn dim3(raw: &Option<pb::Dim3>, path: &FieldPath) -> Result<Dim3> {
    let d = required(raw, path)?;
    Ok(Dim3 {
        x: positive_u32(d.x, &path.field("x"))?,
        y: positive_u32(d.y, &path.field("y"))?,
        z: positive_u32(d.z, &path.field("z"))?,
    })
}

fn node(raw: &pb::Node, event_count: u32, ctx: &GraphContext<'_>, path: &FieldPath) -> Result<Node> {
    let op = match required(&raw.op, &path.field("op"))? {
        pb::node::Op::Kernel(k) => NodeOp::Kernel(kernel_node(k, ctx, &path.field("kernel"))?),
        pb::node::Op::Memcpy(m) => {
            let p = path.field("memcpy");
            let byte_count = positive_u64(m.byte_count, &p.field("byte_count"))?;
            NodeOp::Memcpy {
                src: ctx.range(&m.src, byte_count, &p.field("src"))?,
                dst: ctx.range(&m.dst, byte_count, &p.field("dst"))?,
                byte_count,
            }
        }
        pb::node::Op::Memset(m) => {
            let p = path.field("memset");
            if !matches!(m.element_size, 1 | 2 | 4) {
                return Err(invalid(&p.field("element_size"), InvalidReason::BadElementSize(m.element_size)));
            }
            let width = positive_u64(m.width, &p.field("width"))?;
            let height = positive_u64(m.height, &p.field("height"))?;
            let row_bytes = width.saturating_mul(u64::from(m.element_size));
            if height > 1 && m.pitch < row_bytes {
                return Err(invalid(&p.field("pitch"), InvalidReason::PitchTooSmall { pitch: m.pitch, row_bytes }));
            }
            let extent = m.pitch.saturating_mul(height - 1).saturating_add(row_bytes);
            NodeOp::Memset {
                dst: ctx.range(&m.dst, extent, &p.field("dst"))?,
                value: m.value,
                element_size: m.element_size,
                width,
                height,
                pitch: m.pitch,
            }
        }
        pb::node::Op::Empty(_) => NodeOp::Empty,
        pb::node::Op::EventRecord(e) => {
            NodeOp::EventRecord { event: event(e.event, event_count, &path.field("event_record"))? }
        }
        pb::node::Op::EventWait(e) => {
            NodeOp::EventWait { event: event(e.event, event_count, &path.field("event_wait"))? }
        }
    };
    Ok(Node { id: raw.id, op })
}

fn event(event: u32, count: u32, path: &FieldPath) -> Result<u32> {
    if event < count {
        Ok(event)
    } else {
        Err(CoreError::DanglingReference { field: path.field("event"), kind: ReferenceKind::Event, id: event })
    }
}

fn kernel_node(raw: &pb::KernelNode, ctx: &GraphContext<'_>, path: &FieldPath) -> Result<KernelNode> {
    let kernel = ctx.kernel(raw.kernel_id, &path.field("kernel_id"))?;
    let grid = dim3(&raw.grid, &path.field("grid"))?;
    let block = dim3(&raw.block, &path.field("block"))?;
    let threads = u64::from(block.x) * u64::from(block.y) * u64::from(block.z);
    if threads > MAX_THREADS_PER_BLOCK {
        return Err(CoreError::OutOfRange {
            field: path.field("block"),
            what: RangeOwner::Limit("threads per block"),
            start: 0,
            end: threads,
            limit: MAX_THREADS_PER_BLOCK,
        });
    }
    let smem_limit = kernel.max_dynamic_shared_memory.max(DEFAULT_DYNAMIC_SHARED_MEMORY);
    if raw.dynamic_shared_memory > smem_limit {
        return Err(CoreError::OutOfRange {
            field: path.field("dynamic_shared_memory"),
            what: RangeOwner::Limit("the kernel's dynamic shared memory"),
            start: 0,
            end: u64::from(raw.dynamic_shared_memory),
            limit: u64::from(smem_limit),
        });
    }
    let expected_len = kernel.param_buffer_size();
    if raw.param_bytes.len() as u64 != u64::from(expected_len) {
        return Err(invalid(
            &path.field("param_bytes"),
            InvalidReason::ParamBytesLength { expected: expected_len, actual: raw.param_bytes.len() as u64 },
        ));
    }
    let mut relocations = Vec::with_capacity(raw.relocations.len());
    let mut words = HashSet::new();
    for (i, r) in raw.relocations.iter().enumerate() {
        let p = path.field("relocations").index(i);
        let slot = kernel.params.get(r.param_index as usize).ok_or(CoreError::DanglingReference {
            field: p.field("param_index"),
            kind: ReferenceKind::Param,
            id: r.param_index,
        })?;
        in_range(
            &p.field("byte_offset"),
            RangeOwner::Param(r.param_index),
            u64::from(r.byte_offset),
            8,
            u64::from(slot.size),
        )?;
        let buffer = ctx.buffer(r.buffer_id, &p.field("buffer_id"))?;
        in_range(&p.field("buffer_offset"), RangeOwner::Buffer(r.buffer_id), r.buffer_offset, 1, buffer.byte_size)?;
        let at = (slot.offset + r.byte_offset) as usize;
        if !words.insert(at) {
            return Err(invalid(&p.field("byte_offset"), InvalidReason::Overlap { other: i }));
        }
        // The captured word must be the address the relocation claims: a mismatch means the
        // exporter resolved the pointer to the wrong buffer.
        let mut word = [0u8; 8];
        word.copy_from_slice(&raw.param_bytes[at..at + 8]);
        let word = u64::from_le_bytes(word);
        let expected = ctx.arena.base_address + buffer.offset + r.buffer_offset;
        if word != expected {
            return Err(invalid(&p.field("buffer_offset"), InvalidReason::BadRelocationWord { word, expected }));
        }
        relocations.push(Relocation {
            param_index: r.param_index,
            byte_offset: r.byte_offset,
            buffer: buffer.id,
            buffer_offset: r.buffer_offset,
        });
    }
    // Every other aligned word that points into the arena is a pointer the exporter failed to
    // record: after relocation it would still address the preparing process's memory.
    let arena_end = ctx.arena.base_address + ctx.arena.byte_size;
    for (i, slot) in kernel.params.iter().enumerate() {
        let mut at = slot.offset as usize;
        while at + 8 <= (slot.offset + slot.size) as usize {
            if !words.contains(&at) {
                let mut word = [0u8; 8];
                word.copy_from_slice(&raw.param_bytes[at..at + 8]);
                let word = u64::from_le_bytes(word);
                if (ctx.arena.base_address..arena_end).contains(&word) {
                    return Err(invalid(
                        &path.field("param_bytes"),
                        InvalidReason::UnrelocatedPointer {
                            param_index: i as u32,
                            byte_offset: at as u32 - slot.offset,
                            word,
                        },
                    ));
                }
            }
            at += 8;
        }
    }
    if !ctx.abi.has_launch_attributes() && !raw.launch_attributes.is_empty() {
        return Err(invalid(
            &path.field("launch_attributes"),
            InvalidReason::MustBeZero(raw.launch_attributes.len() as u64),
        ));
    }
    let launch_attributes = raw
        .launch_attributes
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let p = path.field("launch_attributes").index(i);
            Ok(match required(&a.value, &p.field("value"))? {
                pb::launch_attribute::Value::ClusterDim(d) => {
                    LaunchAttribute::ClusterDim(dim3(&Some(*d), &p.field("cluster_dim"))?)
                }
                pb::launch_attribute::Value::Priority(v) => LaunchAttribute::Priority(*v),
                pb::launch_attribute::Value::Cooperative(v) => LaunchAttribute::Cooperative(*v),
                pb::launch_attribute::Value::ClusterSchedulingPolicy(v) => LaunchAttribute::ClusterSchedulingPolicy(*v),
                pb::launch_attribute::Value::MemSyncDomain(v) => LaunchAttribute::MemSyncDomain(*v),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(KernelNode {
        kernel: kernel.id,
        grid,
        block,
        dynamic_shared_memory: raw.dynamic_shared_memory,
        param_bytes: raw.param_bytes.clone(),
        relocations,
        launch_attributes,
    })
}

/// An edge's dependency. Unspecified is a full dependency in every ABI; the programmatic kinds
/// arrived with ABI 4.
fn dependency(raw: i32, abi: AbiReader, field: &FieldPath) -> Result<Dependency> {
    let dependency = match pb::EdgeDependency::try_from(raw) {
        Ok(pb::EdgeDependency::Unspecified) => Dependency::Full,
        Ok(pb::EdgeDependency::Programmatic) => Dependency::Programmatic,
        Ok(pb::EdgeDependency::LaunchOrder) => Dependency::LaunchOrder,
        Err(_) => return Err(CoreError::UnknownEnum { field: field.clone(), value: raw }),
    };
    if dependency.is_programmatic() && !abi.has_programmatic_edges() {
        return Err(invalid(field, InvalidReason::NeedsAbi { abi: 4, found: abi.version() }));
    }
    Ok(dependency)
}

/// Kahn's algorithm over every edge, whatever its dependency; returns a node on a cycle when
/// one exists.
fn find_cycle(node_count: usize, edges: &[Edge]) -> Option<usize> {
    let mut indegree = vec![0usize; node_count];
    let mut out: Vec<Vec<usize>> = vec![Vec::new(); node_count];
    for &Edge { from, to, .. } in edges {
        indegree[to] += 1;
        out[from].push(to);
    }
    let mut ready: Vec<usize> = (0..node_count).filter(|&n| indegree[n] == 0).collect();
    let mut visited = 0;
    while let Some(n) = ready.pop() {
        visited += 1;
        for &m in &out[n] {
            indegree[m] -= 1;
            if indegree[m] == 0 {
                ready.push(m);
            }
        }
    }
    (visited < node_count).then(|| indegree.iter().position(|&d| d > 0)).flatten()
}

fn value_kind(raw: i32, field: &FieldPath) -> Result<ValueKind> {
    use pb::ValueKind as P;
    Ok(match enum_value::<P>(raw, field)? {
        P::TokenIds => ValueKind::TokenIds,
        P::Positions => ValueKind::Positions,
        P::SlotMapping => ValueKind::SlotMapping,
        P::PageTable => ValueKind::PageTable,
        P::RequestSlots => ValueKind::RequestSlots,
        P::QueryLengths => ValueKind::QueryLengths,
        P::ContextLengths => ValueKind::ContextLengths,
        P::StateRowIndices => ValueKind::StateRowIndices,
        P::Temperature => ValueKind::Temperature,
        P::TopK => ValueKind::TopK,
        P::TopP => ValueKind::TopP,
        P::MinP => ValueKind::MinP,
        P::RepetitionPenalty => ValueKind::RepetitionPenalty,
        P::PresencePenalty => ValueKind::PresencePenalty,
        P::FrequencyPenalty => ValueKind::FrequencyPenalty,
        P::RngSeed => ValueKind::RngSeed,
        P::RngCounter => ValueKind::RngCounter,
        P::SampleFlags => ValueKind::SampleFlags,
        P::GrammarMask => ValueKind::GrammarMask,
        P::SourceRows => ValueKind::SourceRows,
        P::DestinationRows => ValueKind::DestinationRows,
        P::ExpectedConsumed => ValueKind::ExpectedConsumed,
        P::CompletionRecords => ValueKind::CompletionRecords,
        P::PatchPixels => ValueKind::PatchPixels,
        P::ImageFeatureOffsets => ValueKind::ImageFeatureOffsets,
        P::PendingTokens => ValueKind::PendingTokens,
        P::CheckpointEpoch => ValueKind::CheckpointEpoch,
        P::Unspecified => return Err(CoreError::UnknownEnum { field: field.clone(), value: raw }),
    })
}

fn bindings(
    raw: &[pb::ValueBinding],
    graph: &Graph,
    ctx: &GraphContext<'_>,
    path: &FieldPath,
) -> Result<Vec<ValueBinding>> {
    let mut out: Vec<ValueBinding> = Vec::with_capacity(raw.len());
    for (i, b) in raw.iter().enumerate() {
        let p = path.index(i);
        let value = value_kind(b.value, &p.field("value"))?;
        if out.iter().any(|o| o.value == value) {
            return Err(invalid(&p.field("value"), InvalidReason::DuplicateBinding(value.name())));
        }
        if !bindable(value, graph.kind, graph.maintenance_op) {
            return Err(invalid(&p.field("value"), InvalidReason::NotBindable(value.name())));
        }
        // Checkpoint stamps arrived with ABI 3: an older core binding them is invalid.
        let stamps = value == ValueKind::CheckpointEpoch
            || (value == ValueKind::CompletionRecords && graph.kind == GraphKind::StateMaintenance);
        if stamps && !ctx.abi.has_checkpoint_stamps() {
            return Err(invalid(&p.field("value"), InvalidReason::NeedsAbi { abi: 3, found: ctx.abi.version() }));
        }
        let direction = match enum_value::<pb::Direction>(b.direction, &p.field("direction"))? {
            pb::Direction::Input => Direction::Input,
            pb::Direction::Output => Direction::Output,
            pb::Direction::StateRead => Direction::StateRead,
            pb::Direction::StateWrite => Direction::StateWrite,
            pb::Direction::StateReadWrite => Direction::StateReadWrite,
            pb::Direction::Unspecified => {
                return Err(CoreError::UnknownEnum { field: p.field("direction"), value: b.direction });
            }
        };
        let dtype = dtype(b.dtype, &p.field("dtype"))?;
        let expected = expected_view(value, graph, ctx.scheme, ctx.caps);
        let direction_ok = if expected.direction.is_state() {
            match graph.kind {
                // Decode may read request state (device-fed rows), write it, or both.
                GraphKind::Decode => direction.is_state(),
                // A speculative program reads device-fed rows' pending tokens and stores the
                // last token it emits: both, always.
                GraphKind::Speculative => direction == Direction::StateReadWrite,
                // Any other sampling graph may only write it.
                _ => direction.is_state() && !direction.reads_state(),
            }
        } else {
            direction == expected.direction
        };
        if !direction_ok {
            return Err(invalid(&p.field("direction"), InvalidReason::WrongDirection));
        }
        if !expected.dtypes.contains(&dtype) {
            return Err(invalid(
                &p.field("dtype"),
                InvalidReason::WrongDType { expected: expected.dtypes, found: dtype },
            ));
        }
        let actual_len = shape_bytes(&b.shape, dtype).unwrap_or(u64::MAX);
        if !expected.shape_matches(&b.shape) {
            return match expected.fixed_byte_len(dtype) {
                Some(want) if b.shape.len() == expected.shape.len() || want != actual_len => {
                    Err(CoreError::ViewSize { field: p.field("shape"), expected: want, actual: actual_len })
                }
                _ => Err(invalid(
                    &p.field("shape"),
                    InvalidReason::WrongShape {
                        expected: expected.shape.iter().map(|d| d.unwrap_or(0)).collect(),
                        found: b.shape.clone(),
                    },
                )),
            };
        }
        let view = ctx.range(&b.view, actual_len, &p.field("view"))?;
        let role = ctx.buffer(view.buffer.0, &p.field("view").field("buffer_id"))?.role;
        let allowed = match direction {
            Direction::Input => matches!(role, BufferRole::StagingInputs | BufferRole::RequestState),
            Direction::Output => role == BufferRole::CompletionRecords,
            Direction::StateRead | Direction::StateWrite | Direction::StateReadWrite => {
                role == BufferRole::RequestState
            }
        };
        if !allowed {
            return Err(invalid(&p.field("view").field("buffer_id"), InvalidReason::WrongRole { role: role.name() }));
        }
        out.push(ValueBinding { value, direction, view, dtype, shape: b.shape.clone() });
    }
    for &value in required_values(graph.kind, graph.maintenance_op) {
        if !out.iter().any(|b| b.value == value) {
            return Err(invalid(path, InvalidReason::MissingBinding(value.name())));
        }
    }
    // A checked op reports its outcome (a rejection must never pass unseen), and checks a
    // stamp the rows must hold.
    if out.iter().any(|b| b.value == ValueKind::CheckpointEpoch) {
        if !out.iter().any(|b| b.value == ValueKind::CompletionRecords) {
            return Err(invalid(path, InvalidReason::MissingBinding(ValueKind::CompletionRecords.name())));
        }
        if !ctx.scheme.has_row_region(RowRegionKind::PositionMetadata) {
            return Err(invalid(path, InvalidReason::MissingRowRegion("position metadata")));
        }
    }
    Ok(out)
}

/// Every declared capacity has its captured graph; a missing variant rejects the core.
fn check_graph_catalog(graphs: &[Graph], caps: &Capacities, path: &FieldPath) -> Result<()> {
    let has = |kind: GraphKind, pred: &dyn Fn(&GraphCapacity) -> bool| {
        graphs.iter().any(|g| g.kind == kind && pred(&g.capacity))
    };
    for (i, &b) in caps.decode_request_buckets.iter().enumerate() {
        if !has(GraphKind::Decode, &|c| c.request_count == b) {
            return Err(CoreError::DanglingReference {
                field: path.field("decode_request_buckets").index(i),
                kind: ReferenceKind::Graph,
                id: b,
            });
        }
    }
    for (i, &t) in caps.prefill_chunk_capacities.iter().enumerate() {
        if !has(GraphKind::Prefill, &|c| c.token_capacity == t) {
            return Err(CoreError::DanglingReference {
                field: path.field("prefill_chunk_capacities").index(i),
                kind: ReferenceKind::Graph,
                id: t,
            });
        }
    }
    for (i, &p) in caps.image_patch_buckets.iter().enumerate() {
        if !has(GraphKind::Vision, &|c| c.patch_capacity == p) {
            return Err(CoreError::DanglingReference {
                field: path.field("image_patch_buckets").index(i),
                kind: ReferenceKind::Graph,
                id: p,
            });
        }
    }
    Ok(())
}

fn sampling_parameter(raw: &Option<pb::SamplingParameter>, path: &FieldPath) -> Result<SamplingParameter> {
    let p = required(raw, path)?;
    if !p.default.is_finite() {
        return Err(invalid(&path.field("default"), InvalidReason::NonFinite));
    }
    let range = match &p.range {
        None => None,
        Some(r) => {
            if !r.min.is_finite() || !r.max.is_finite() {
                return Err(invalid(&path.field("range"), InvalidReason::NonFinite));
            }
            if r.min > r.max {
                return Err(invalid(&path.field("range"), InvalidReason::EmptyRange));
            }
            if p.default < r.min || p.default > r.max {
                return Err(CoreError::DefaultOutOfRange {
                    field: path.field("default"),
                    value: p.default,
                    min: r.min,
                    max: r.max,
                });
            }
            Some((r.min, r.max))
        }
    };
    Ok(SamplingParameter { default: p.default, range })
}

fn frontend(raw: &pb::Frontend, caps: &Capacities, path: &FieldPath) -> Result<Frontend> {
    let asset = |a: &Option<pb::AssetFile>, p: &FieldPath| -> Result<AssetFile> {
        let a = required(a, p)?;
        Ok(AssetFile {
            path: safe_path(&a.path, &p.field("path"))?,
            sha256: sha256_hex(&a.sha256, &p.field("sha256"))?,
        })
    };
    if raw.eos_token_ids.is_empty() {
        return Err(invalid(&path.field("eos_token_ids"), InvalidReason::EmptyList));
    }
    for (i, &id) in raw.eos_token_ids.iter().enumerate() {
        in_range(
            &path.field("eos_token_ids").index(i),
            RangeOwner::Limit("the vocabulary"),
            u64::from(id),
            1,
            u64::from(caps.vocab_size),
        )?;
    }
    let sp = path.field("sampling");
    let s = required(&raw.sampling, &sp)?;
    let sampling = SamplingDefaults {
        temperature: sampling_parameter(&s.temperature, &sp.field("temperature"))?,
        top_k: sampling_parameter(&s.top_k, &sp.field("top_k"))?,
        top_p: sampling_parameter(&s.top_p, &sp.field("top_p"))?,
        min_p: sampling_parameter(&s.min_p, &sp.field("min_p"))?,
        repetition_penalty: sampling_parameter(&s.repetition_penalty, &sp.field("repetition_penalty"))?,
        presence_penalty: sampling_parameter(&s.presence_penalty, &sp.field("presence_penalty"))?,
        frequency_penalty: sampling_parameter(&s.frequency_penalty, &sp.field("frequency_penalty"))?,
        max_output_tokens: positive_u32(s.max_output_tokens, &sp.field("max_output_tokens"))?,
    };
    // Temperature must stay positive across its whole range: greedy decoding is not served.
    let t = sampling.temperature;
    if t.default <= 0.0 || t.range.is_some_and(|(lo, _)| lo <= 0.0) {
        return Err(invalid(&sp.field("temperature"), InvalidReason::MustBePositive));
    }
    let reasoning_parser =
        match enum_value::<pb::ReasoningParser>(raw.reasoning_parser, &path.field("reasoning_parser"))? {
            pb::ReasoningParser::None => ReasoningParser::None,
            pb::ReasoningParser::ThinkTags => ReasoningParser::ThinkTags,
            pb::ReasoningParser::Unspecified => {
                return Err(CoreError::UnknownEnum {
                    field: path.field("reasoning_parser"),
                    value: raw.reasoning_parser,
                });
            }
        };
    let tool_parser = match enum_value::<pb::ToolParser>(raw.tool_parser, &path.field("tool_parser"))? {
        pb::ToolParser::None => ToolParser::None,
        pb::ToolParser::HermesJson => ToolParser::HermesJson,
        pb::ToolParser::Qwen3CoderXml => ToolParser::Qwen3CoderXml,
        pb::ToolParser::Unspecified => {
            return Err(CoreError::UnknownEnum { field: path.field("tool_parser"), value: raw.tool_parser });
        }
    };
    Ok(Frontend {
        tokenizer: asset(&raw.tokenizer, &path.field("tokenizer"))?,
        chat_template: asset(&raw.chat_template, &path.field("chat_template"))?,
        eos_token_ids: raw.eos_token_ids.clone(),
        sampling,
        reasoning_parser,
        tool_parser,
        served_model_name: non_empty(&raw.served_model_name, &path.field("served_model_name"))?,
    })
}
