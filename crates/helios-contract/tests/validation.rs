//! Targeted validation: each violation is rejected with the variant and field it concerns.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use helios_contract::fixtures::{Fixture, FixtureSpec};
use helios_contract::{
    BoundContract, CapacityError, CoreError, Dependency, Edge, GraphKind, InvalidReason, MaintenanceOp, NodeOp,
    RuntimeCore, ValueKind, pb, validate,
};

fn fixture() -> Fixture {
    Fixture::build(&FixtureSpec::default())
}

fn open(f: &Fixture) -> Result<RuntimeCore, CoreError> {
    let dir = tempfile::tempdir().unwrap();
    f.write_to(dir.path()).unwrap();
    RuntimeCore::open(dir.path())
}

fn field_of(result: Result<helios_contract::Manifest, CoreError>) -> (CoreError, String) {
    let err = result.expect_err("mutation must be rejected");
    let field = err.field().map(|f| f.to_string()).unwrap_or_default();
    (err, field)
}

fn graph_index(m: &pb::RuntimeCore, kind: pb::GraphKind) -> usize {
    m.graphs.iter().position(|g| g.kind == kind as i32).unwrap()
}

fn kernel_node(m: &mut pb::RuntimeCore, graph: usize) -> &mut pb::KernelNode {
    match m.graphs[graph].nodes[0].op.as_mut().unwrap() {
        pb::node::Op::Kernel(k) => k,
        _ => panic!("fixture node 0 is a kernel"),
    }
}

#[test]
fn fixture_opens_and_round_trips() {
    let f = fixture();
    let core = open(&f).unwrap();
    let m = core.manifest();
    assert_eq!(m.identity.abi_version, helios_contract::CURRENT_ABI);
    assert_eq!(m.graphs_of(GraphKind::Decode).len(), 3);
    assert!(m.capacities.speculative_programs.is_empty());
    assert_eq!(m.cache_scheme.verification_width, 1);
    assert_eq!(m.cache_scheme.padding_slot, -1);
    // Encode → decode → validate is the identity on the validated manifest.
    let bytes = prost::Message::encode_to_vec(&f.manifest);
    let again = validate(&<pb::RuntimeCore as prost::Message>::decode(bytes.as_slice()).unwrap()).unwrap();
    assert_eq!(&again, m);
    // Weight payloads are served from the map, byte for byte.
    let embed = m.buffers.iter().find(|b| b.name == "model.embed_tokens.weight").unwrap();
    let payload = core.payload(embed.id).unwrap();
    assert_eq!(payload.len() as u64, embed.byte_size);
    assert_eq!(payload[7], 49);
    let kernel = core.kernel_image(m.kernels[0].id).unwrap();
    assert!(kernel.starts_with(b"FLARE-FIXTURE-CUBIN"));
}

#[test]
fn abi1_defaults_resolve() {
    let f = Fixture::build(&FixtureSpec::abi1());
    let core = open(&f).unwrap();
    let m = core.manifest();
    assert_eq!(m.identity.abi_version, 1);
    assert_eq!(m.cache_scheme.verification_width, 1);
    assert_eq!(m.cache_scheme.padding_slot, -1);
    assert!(m.graphs.iter().all(|g| g.completion_token_capacity == 8 && g.continuation_rows_per_request == 1));
}

#[test]
fn abi1_rejects_abi2_only_fields() {
    let mut f = Fixture::build(&FixtureSpec::abi1());
    let g = graph_index(&f.manifest, pb::GraphKind::Decode);
    kernel_node(&mut f.manifest, g)
        .launch_attributes
        .push(pb::LaunchAttribute { value: Some(pb::launch_attribute::Value::Priority(1)) });
    let (_, field) = field_of(validate(&f.manifest));
    assert!(field.ends_with("kernel.launch_attributes"), "{field}");
}

#[test]
fn unsupported_abi() {
    let mut f = fixture();
    f.manifest.identity.as_mut().unwrap().abi_version = 9;
    let (err, field) = field_of(validate(&f.manifest));
    assert!(matches!(err, CoreError::UnsupportedAbi { found: 9, .. }));
    assert_eq!(field, "core.identity.abi_version");
}

#[test]
fn missing_fields_and_unknown_enums() {
    let mut f = fixture();
    f.manifest.cache_scheme = None;
    let (err, field) = field_of(validate(&f.manifest));
    assert!(matches!(err, CoreError::MissingField { .. }));
    assert_eq!(field, "core.cache_scheme");

    let mut f = fixture();
    f.manifest.buffers[2].role = 77;
    let (err, field) = field_of(validate(&f.manifest));
    assert!(matches!(err, CoreError::UnknownEnum { value: 77, .. }));
    assert_eq!(field, "core.buffers[2].role");

    let mut f = fixture();
    f.manifest.frontend.as_mut().unwrap().tool_parser = 0;
    let (err, field) = field_of(validate(&f.manifest));
    assert!(matches!(err, CoreError::UnknownEnum { value: 0, .. }));
    assert_eq!(field, "core.frontend.tool_parser");
}

#[test]
fn relocation_outside_buffer() {
    let mut f = fixture();
    let g = graph_index(&f.manifest, pb::GraphKind::Prefill);
    let size = f.manifest.buffers.iter().find(|b| b.id == 2).unwrap().byte_size;
    kernel_node(&mut f.manifest, g).relocations[2].buffer_offset = size;
    let (err, field) = field_of(validate(&f.manifest));
    assert!(matches!(err, CoreError::OutOfRange { .. }), "{err}");
    assert_eq!(field, format!("core.graphs[{g}].nodes[0].kernel.relocations[2].buffer_offset"));
}

#[test]
fn relocation_word_must_match_recorded_address() {
    let mut f = fixture();
    let node = kernel_node(&mut f.manifest, 0);
    node.param_bytes[8] ^= 0x40;
    let (err, field) = field_of(validate(&f.manifest));
    assert!(matches!(err, CoreError::InvalidValue { reason: InvalidReason::BadRelocationWord { .. }, .. }), "{err}");
    assert_eq!(field, "core.graphs[0].nodes[0].kernel.relocations[1].buffer_offset");
}

#[test]
fn dangling_references() {
    let mut f = fixture();
    kernel_node(&mut f.manifest, 0).relocations[0].buffer_id = 999;
    let (err, field) = field_of(validate(&f.manifest));
    assert!(matches!(err, CoreError::DanglingReference { id: 999, .. }));
    assert_eq!(field, "core.graphs[0].nodes[0].kernel.relocations[0].buffer_id");

    let mut f = fixture();
    f.manifest.graphs[1].bindings[0].view.as_mut().unwrap().buffer_id = 4242;
    let (_, field) = field_of(validate(&f.manifest));
    assert_eq!(field, "core.graphs[1].bindings[0].view.buffer_id");

    let mut f = fixture();
    kernel_node(&mut f.manifest, 0).kernel_id = 5;
    let (_, field) = field_of(validate(&f.manifest));
    assert_eq!(field, "core.graphs[0].nodes[0].kernel.kernel_id");
}

#[test]
fn overlapping_buffers() {
    let mut f = fixture();
    let first_end = f.manifest.buffers[0].offset + f.manifest.buffers[0].byte_size;
    f.manifest.buffers[1].offset = (first_end - 1) / 256 * 256;
    let (err, field) = field_of(validate(&f.manifest));
    assert!(matches!(err, CoreError::OverlappingBuffers { first: 1, second: 2, .. }), "{err}");
    assert_eq!(field, "core.buffers[1].offset");
}

#[test]
fn graph_cycle() {
    let mut f = fixture();
    f.manifest.graphs[0].edges.push(pb::Edge { from: 15, to: 10, ..Default::default() });
    let (err, field) = field_of(validate(&f.manifest));
    assert!(matches!(err, CoreError::GraphCycle { .. }), "{err}");
    assert_eq!(field, "core.graphs[0].edges");
}

#[test]
fn binding_view_of_wrong_size() {
    let mut f = fixture();
    // The decode graph for bucket 2 binds request slots with shape [2]; make it [3].
    f.manifest.graphs[1].bindings[0].shape = vec![3];
    let (err, field) = field_of(validate(&f.manifest));
    assert!(matches!(err, CoreError::ViewSize { expected: 8, actual: 12, .. }), "{err}");
    assert_eq!(field, "core.graphs[1].bindings[0].shape");
}

#[test]
fn binding_must_not_leave_its_buffer() {
    let mut f = fixture();
    let staging = f.manifest.buffers.iter().find(|b| b.name == "staging_inputs").unwrap().byte_size;
    f.manifest.graphs[0].bindings[0].view.as_mut().unwrap().offset = staging - 2;
    let (err, field) = field_of(validate(&f.manifest));
    assert!(matches!(err, CoreError::OutOfRange { .. }), "{err}");
    assert_eq!(field, "core.graphs[0].bindings[0].view.offset");
}

#[test]
fn required_bindings() {
    let mut f = fixture();
    let g = graph_index(&f.manifest, pb::GraphKind::Prefill);
    f.manifest.graphs[g].bindings.retain(|b| b.value != pb::ValueKind::SlotMapping as i32);
    let (err, field) = field_of(validate(&f.manifest));
    assert!(
        matches!(err, CoreError::InvalidValue { reason: InvalidReason::MissingBinding("slot_mapping"), .. }),
        "{err}"
    );
    assert_eq!(field, format!("core.graphs[{g}].bindings"));
}

#[test]
fn capacities_must_ascend_and_have_graphs() {
    let mut f = fixture();
    f.manifest.capacities.as_mut().unwrap().decode_request_buckets = vec![1, 4, 2];
    let (err, field) = field_of(validate(&f.manifest));
    assert!(matches!(err, CoreError::NotAscending { index: 2, previous: 4, value: 2, .. }), "{err}");
    assert_eq!(field, "core.capacities.decode_request_buckets");

    let mut f = fixture();
    f.manifest.capacities.as_mut().unwrap().prefill_chunk_capacities = vec![64, 128, 256];
    let (err, field) = field_of(validate(&f.manifest));
    assert!(matches!(err, CoreError::DanglingReference { id: 256, .. }), "{err}");
    assert_eq!(field, "core.capacities.prefill_chunk_capacities[2]");
}

#[test]
fn sampling_defaults_inside_ranges() {
    let mut f = fixture();
    let s = f.manifest.frontend.as_mut().unwrap().sampling.as_mut().unwrap();
    s.top_p.as_mut().unwrap().default = 1.5;
    let (err, field) = field_of(validate(&f.manifest));
    assert!(matches!(err, CoreError::DefaultOutOfRange { .. }), "{err}");
    assert_eq!(field, "core.frontend.sampling.top_p.default");

    let mut f = fixture();
    let s = f.manifest.frontend.as_mut().unwrap().sampling.as_mut().unwrap();
    s.temperature = Some(pb::SamplingParameter { default: 0.0, range: None });
    let (_, field) = field_of(validate(&f.manifest));
    assert_eq!(field, "core.frontend.sampling.temperature");
}

#[test]
fn file_checks() {
    let mut f = fixture();
    f.file_mut("kernels/k2.cubin").unwrap()[3] ^= 1;
    let err = open(&f).unwrap_err();
    assert!(matches!(err, CoreError::DigestMismatch { .. }), "{err}");
    assert_eq!(err.field().unwrap().as_str(), "core.kernels[id=2].sha256");

    let mut f = fixture();
    f.file_mut("payloads/weights.safetensors").unwrap().truncate(100);
    let err = open(&f).unwrap_err();
    assert!(matches!(err, CoreError::FileSize { .. }), "{err}");
    assert_eq!(err.field().unwrap().as_str(), "core.payload_files[0].byte_size");

    let mut f = fixture();
    let last = f.file_mut("payloads/weights.safetensors").unwrap().last_mut().unwrap();
    *last ^= 0xff;
    let err = open(&f).unwrap_err();
    assert!(matches!(err, CoreError::DigestMismatch { .. }), "{err}");

    let mut f = fixture();
    f.file_mut("frontend/chat_template.jinja").unwrap().push(b' ');
    let err = open(&f).unwrap_err();
    assert_eq!(err.field().unwrap().as_str(), "core.frontend.chat_template.sha256");

    let mut f = fixture();
    f.manifest.buffers[0].payload = Some(pb::buffer::Payload::Safetensors(pb::SafetensorsPayload {
        file_index: 0,
        tensor: "model.norm.weight".into(),
    }));
    let err = open(&f).unwrap_err();
    assert!(matches!(err, CoreError::TensorMismatch { .. }), "{err}");
    assert_eq!(err.field().unwrap().as_str(), "core.buffers[id=1].safetensors.tensor");
}

#[test]
fn bound_contract_lookup_and_packing() {
    let core = open(&fixture()).unwrap();
    let bound = BoundContract::bind(core.manifest());
    assert_eq!(bound.decode(3).unwrap().capacity.request_count, 4);
    assert_eq!(bound.decode(1).unwrap().capacity.request_count, 1);
    assert_eq!(
        bound.decode(5).unwrap_err(),
        CapacityError::Exceeded { kind: GraphKind::Decode, requested: 5, largest: 4 }
    );
    assert_eq!(bound.prefill(65).unwrap().capacity.token_capacity, 128);
    assert!(bound.prefill(129).is_err());
    assert!(bound.maintenance(MaintenanceOp::Snapshot, 1).is_ok());
    assert_eq!(
        bound.maintenance(MaintenanceOp::Reset, 1).unwrap_err(),
        CapacityError::Missing { kind: GraphKind::StateMaintenance, op: Some(MaintenanceOp::Reset) }
    );

    let decode = bound.decode(4).unwrap();
    let slots = decode.view(ValueKind::RequestSlots).unwrap();
    let staging = core.manifest().buffer(slots.buffer).unwrap();
    let mut mirror = vec![0xAAu8; staging.byte_size as usize];
    slots.pack(&mut mirror, &[3i32, 1], -1).unwrap();
    assert_eq!(slots.read::<i32>(&mirror).unwrap(), vec![3, 1, -1, -1]);
    assert!(slots.pack(&mut mirror, &[0i32; 5], -1).is_err());
    assert!(slots.pack(&mut mirror, &[0.5f32], 0.0).is_err());
    let seeds = decode.view(ValueKind::RngSeed).unwrap();
    seeds.pack(&mut mirror, &[u64::MAX, 7], 0).unwrap();
    assert_eq!(seeds.read::<u64>(&mirror).unwrap(), vec![u64::MAX, 7, 0, 0]);
    // Views are disjoint: packing seeds did not disturb request slots.
    assert_eq!(slots.read::<i32>(&mirror).unwrap(), vec![3, 1, -1, -1]);
    assert_eq!(decode.inputs().count() + 1, decode.views().count());
}

#[test]
fn unrecorded_arena_pointer_is_rejected() {
    let mut f = fixture();
    let node = kernel_node(&mut f.manifest, 0);
    // Drop the record of parameter 3's pointer: the word still addresses the arena.
    node.relocations.retain(|r| r.param_index != 3);
    let (err, field) = field_of(validate(&f.manifest));
    assert!(
        matches!(
            err,
            CoreError::InvalidValue {
                reason: InvalidReason::UnrelocatedPointer { param_index: 3, byte_offset: 0, .. },
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(field, "core.graphs[0].nodes[0].kernel.param_bytes");
}

#[test]
fn pending_tokens_are_request_state_read_only_by_decode() {
    let mut f = fixture();
    f.add_pending_tokens();
    let m = validate(&f.manifest).unwrap();
    let bound = BoundContract::bind(&m);
    assert!(bound.decode(2).unwrap().reads_pending_token());
    assert!(bound.prefill(64).unwrap().writes_pending_token());
    assert!(!bound.prefill(64).unwrap().reads_pending_token());
    assert!(bound.resume_sampling(1).unwrap().writes_pending_token());
    // Never a staged input: the executor packs nothing for it.
    assert!(bound.decode(2).unwrap().inputs().all(|(v, _)| v != ValueKind::PendingTokens));
    let pending = |m: &pb::RuntimeCore, g: usize| {
        m.graphs[g].bindings.iter().position(|b| b.value == pb::ValueKind::PendingTokens as i32).unwrap()
    };
    let decode = graph_index(&f.manifest, pb::GraphKind::Decode);
    let prefill = graph_index(&f.manifest, pb::GraphKind::Prefill);
    let wrong_direction = |reason: &InvalidReason| matches!(reason, InvalidReason::WrongDirection);
    // Only decode may read it.
    let mut bad = f.clone();
    let i = pending(&bad.manifest, prefill);
    bad.manifest.graphs[prefill].bindings[i].direction = pb::Direction::StateReadWrite as i32;
    let (err, field) = field_of(validate(&bad.manifest));
    assert!(matches!(err, CoreError::InvalidValue { ref reason, .. } if wrong_direction(reason)), "{err}");
    assert_eq!(field, format!("core.graphs[{prefill}].bindings[{i}].direction"));
    // Not a staged input.
    let mut bad = f.clone();
    let i = pending(&bad.manifest, decode);
    bad.manifest.graphs[decode].bindings[i].direction = pb::Direction::Input as i32;
    let (err, _) = field_of(validate(&bad.manifest));
    assert!(matches!(err, CoreError::InvalidValue { ref reason, .. } if wrong_direction(reason)), "{err}");
    // One i32 entry per live row and the null row.
    let mut bad = f.clone();
    bad.manifest.graphs[decode].bindings[i].dtype = pb::Dtype::I64 as i32;
    let (err, _) = field_of(validate(&bad.manifest));
    assert!(matches!(err, CoreError::InvalidValue { reason: InvalidReason::WrongDType { .. }, .. }), "{err}");
    let mut bad = f.clone();
    bad.manifest.graphs[decode].bindings[i].shape = vec![2];
    assert!(validate(&bad.manifest).is_err());
    // Request state, not staging.
    let mut bad = f.clone();
    let staging = bad.manifest.buffers.iter().find(|b| b.name == "staging_inputs").unwrap().id;
    bad.manifest.graphs[decode].bindings[i].view = Some(pb::BufferRange { buffer_id: staging, offset: 0 });
    let (err, _) = field_of(validate(&bad.manifest));
    assert!(matches!(err, CoreError::InvalidValue { reason: InvalidReason::WrongRole { .. }, .. }), "{err}");
}

/// Index of graph `g`'s first edge from node id `from` to node id `to`.
fn edge_index(m: &pb::RuntimeCore, g: usize, from: u32, to: u32) -> usize {
    m.graphs[g].edges.iter().position(|e| e.from == from && e.to == to).unwrap()
}

#[test]
fn abi4_fixture_carries_programmatic_edges_between_kernels() {
    let f = fixture();
    let m = validate(&f.manifest).unwrap();
    assert_eq!(m.identity.abi_version, 4);
    let decode = m.graphs_of(GraphKind::Decode)[0];
    let programmatic: Vec<&Edge> = decode.programmatic_edges().collect();
    assert_eq!(programmatic.len(), 1);
    let e = programmatic[0];
    assert_eq!(e.dependency, Dependency::Programmatic);
    assert!(matches!(decode.nodes[e.from].op, NodeOp::Kernel(_)) && matches!(decode.nodes[e.to].op, NodeOp::Kernel(_)));
    // Every other edge stays a full dependency.
    assert_eq!(decode.edges.iter().filter(|e| e.dependency == Dependency::Full).count(), decode.edges.len() - 1);
    let summary = helios_contract::Summary(&m).to_string();
    assert!(summary.contains("1 programmatic edges"), "{summary}");
    // Older ABIs carry none.
    for spec in [FixtureSpec::abi1(), FixtureSpec::abi2(), FixtureSpec::abi3()] {
        let m = validate(&Fixture::build(&spec).manifest).unwrap();
        assert!(m.graphs.iter().all(|g| g.edges.iter().all(|e| e.dependency == Dependency::Full)), "{}", spec.abi);
    }
}

#[test]
fn launch_order_edges_load_in_abi4() {
    let mut f = fixture();
    let i = edge_index(&f.manifest, 0, 10, 12);
    f.manifest.graphs[0].edges[i].dependency = pb::EdgeDependency::LaunchOrder as i32;
    let m = validate(&f.manifest).unwrap();
    assert_eq!(m.graphs[0].edges[i].dependency, Dependency::LaunchOrder);
    assert_eq!(m.graphs[0].programmatic_edges().count(), 1);
}

#[test]
fn older_abis_reject_programmatic_edges() {
    for spec in [FixtureSpec::abi1(), FixtureSpec::abi2(), FixtureSpec::abi3()] {
        for dependency in [pb::EdgeDependency::Programmatic, pb::EdgeDependency::LaunchOrder] {
            let mut f = Fixture::build(&spec);
            // Between the decode graph's two kernels: valid in ABI 4.
            f.manifest.graphs[0].edges.push(pb::Edge { from: 10, to: 12, dependency: dependency as i32 });
            let i = f.manifest.graphs[0].edges.len() - 1;
            let (err, field) = field_of(validate(&f.manifest));
            assert!(
                matches!(
                    err,
                    CoreError::InvalidValue { reason: InvalidReason::NeedsAbi { abi: 4, found }, .. } if found == spec.abi
                ),
                "ABI {}: {err}",
                spec.abi
            );
            assert_eq!(field, format!("core.graphs[0].edges[{i}].dependency"));
        }
    }
}

#[test]
fn programmatic_edges_join_kernel_nodes_only() {
    let decode = graph_index(&fixture().manifest, pb::GraphKind::Decode);
    let maintenance = graph_index(&fixture().manifest, pb::GraphKind::StateMaintenance);
    // (graph, from, to, dependency, the non-kernel node, the end that names it): kernel →
    // memset, memset → kernel, and memcpy → kernel (a maintenance graph's row copy, node 13).
    let cases = [
        (decode, 10, 11, pb::EdgeDependency::Programmatic, 11, "to"),
        (decode, 11, 12, pb::EdgeDependency::LaunchOrder, 11, "from"),
        (maintenance, 13, 10, pb::EdgeDependency::Programmatic, 13, "from"),
    ];
    for (g, from, to, dependency, bad, end) in cases {
        let mut f = fixture();
        let edges = &mut f.manifest.graphs[g].edges;
        let i = match edges.iter().position(|e| e.from == from && e.to == to) {
            Some(i) => i,
            None => {
                edges.push(pb::Edge { from, to, ..Default::default() });
                edges.len() - 1
            }
        };
        edges[i].dependency = dependency as i32;
        let (err, field) = field_of(validate(&f.manifest));
        assert!(
            matches!(
                err,
                CoreError::InvalidValue { reason: InvalidReason::ProgrammaticEdgeNotBetweenKernels { node }, .. }
                    if node == bad
            ),
            "{from} -> {to}: {err}"
        );
        assert_eq!(field, format!("core.graphs[{g}].edges[{i}].{end}"));
    }
}

#[test]
fn unknown_edge_dependency_is_rejected() {
    for spec in [FixtureSpec::abi1(), FixtureSpec::default()] {
        let mut f = Fixture::build(&spec);
        f.manifest.graphs[0].edges[0].dependency = 7;
        let (err, field) = field_of(validate(&f.manifest));
        assert!(matches!(err, CoreError::UnknownEnum { value: 7, .. }), "ABI {}: {err}", spec.abi);
        assert_eq!(field, "core.graphs[0].edges[0].dependency");
    }
}

#[test]
fn a_cycle_through_a_programmatic_edge_is_rejected() {
    let mut f = fixture();
    f.manifest.graphs[0].edges.push(pb::Edge { from: 12, to: 10, dependency: pb::EdgeDependency::Programmatic as i32 });
    let (err, field) = field_of(validate(&f.manifest));
    assert!(matches!(err, CoreError::GraphCycle { .. }), "{err}");
    assert_eq!(field, "core.graphs[0].edges");
}
