//! Speculative programs (execution ABI 3): graphs of kind `GRAPH_KIND_SPECULATIVE` load, derive
//! `Capacities.speculative_programs` and bind; older ABIs and every broken program invariant are
//! rejected with the field they concern.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use helios_contract::fixtures::{Fixture, FixtureSpec};
use helios_contract::{
    BoundContract, CapacityError, CoreError, GraphKind, InvalidReason, RuntimeCore, SpeculativeProgram, Summary,
    ValueKind, pb, validate,
};

fn speculative_fixture() -> Fixture {
    Fixture::build(&FixtureSpec::speculative())
}

/// Index of the first speculative graph captured for (requests, depth).
fn program_index(m: &pb::RuntimeCore, requests: u32, depth: u32) -> usize {
    m.graphs
        .iter()
        .position(|g| {
            let c = g.capacity.unwrap();
            g.kind == pb::GraphKind::Speculative as i32 && c.request_count == requests && c.proposal_depth == depth
        })
        .unwrap()
}

fn binding_index(g: &pb::Graph, value: pb::ValueKind) -> usize {
    g.bindings.iter().position(|b| b.value == value as i32).unwrap()
}

fn rejected(f: &Fixture) -> (InvalidReason, String) {
    match validate(&f.manifest).expect_err("the core must be rejected") {
        CoreError::InvalidValue { field, reason } => (reason, field.to_string()),
        other => panic!("expected an invalid value, got {other}"),
    }
}

#[test]
fn abi3_core_derives_its_speculative_programs() {
    let f = speculative_fixture();
    let dir = tempfile::tempdir().unwrap();
    f.write_to(dir.path()).unwrap();
    let core = RuntimeCore::open(dir.path()).unwrap();
    let m = core.manifest();
    assert_eq!(m.identity.abi_version, helios_contract::CURRENT_ABI);
    let rect = SpeculativeProgram::rectangular;
    assert_eq!(m.capacities.speculative_programs, vec![rect(1, 3), rect(2, 3), rect(4, 1)]);
    // The ABI that introduced them derives the same programs.
    let abi3 = validate(&Fixture::build(&FixtureSpec { abi: 3, ..FixtureSpec::speculative() }).manifest).unwrap();
    assert_eq!(abi3.capacities.speculative_programs, m.capacities.speculative_programs);
    assert_eq!(m.graphs_of(GraphKind::Speculative).len(), 3);
    // What the scheduler asks of the derived list.
    assert_eq!(m.capacities.speculative_program_for(2, 2), Some(rect(2, 3)));
    assert_eq!(m.capacities.speculative_program_for(3, 1), Some(rect(4, 1)));
    assert_eq!(m.capacities.max_speculative_depth(3), 1);
    // Encode → decode → validate is the identity here too.
    let bytes = prost::Message::encode_to_vec(&f.manifest);
    let again = validate(&<pb::RuntimeCore as prost::Message>::decode(bytes.as_slice()).unwrap()).unwrap();
    assert_eq!(&again, m);

    let summary = Summary(m).to_string();
    assert!(summary.contains("speculative        B=1 D=3, B=2 D=3, B=4 D=1"), "{summary}");
    assert!(summary.contains("B=2 D=3 P=8"), "{summary}");
}

#[test]
fn programs_ascend_whatever_the_graph_order() {
    let spec = FixtureSpec { speculative_programs: vec![(4, 1), (2, 3), (2, 1)], ..FixtureSpec::default() };
    let m = validate(&Fixture::build(&spec).manifest).unwrap();
    let programs: Vec<(u32, u32)> = m.capacities.speculative_programs.iter().map(|p| (p.requests, p.depth)).collect();
    assert_eq!(programs, vec![(2, 1), (2, 3), (4, 1)]);
}

#[test]
fn speculative_graph_binds_lanes_and_is_looked_up_exactly() {
    let mut f = speculative_fixture();
    f.add_pending_tokens();
    let m = validate(&f.manifest).unwrap();
    let header = u64::from(m.capacities.completion_record_header_words);
    let bound = BoundContract::bind(&m);
    let g = bound.speculative(SpeculativeProgram::rectangular(2, 3)).unwrap();
    assert_eq!((g.kind, g.capacity.request_count, g.capacity.token_capacity), (GraphKind::Speculative, 2, 8));
    assert_eq!((g.lanes_per_request(), g.completion_token_capacity), (4, 4));
    let shape = |v: ValueKind| g.view(v).unwrap().shape.clone();
    assert_eq!(shape(ValueKind::TokenIds), vec![8]);
    assert_eq!(shape(ValueKind::Positions), vec![8]);
    assert_eq!(shape(ValueKind::QueryLengths), vec![2]);
    assert_eq!(shape(ValueKind::RngCounter), vec![2]);
    // One mask per lane.
    assert_eq!(shape(ValueKind::GrammarMask), vec![8, u64::from(m.capacities.vocab_size).div_ceil(32)]);
    assert_eq!(shape(ValueKind::CompletionRecords), vec![2, header + 4]);
    // Device-fed rows read the pending token; the program stores the last token it emits.
    assert!(g.reads_pending_token() && g.writes_pending_token());
    assert_eq!(bound.decode(1).unwrap().lanes_per_request(), 1);

    // No larger program stands in: its lanes would not match the packing.
    assert_eq!(
        bound.speculative(SpeculativeProgram::rectangular(2, 2)).unwrap_err(),
        CapacityError::MissingProgram { requests: 2, depth: 2 }
    );
    assert_eq!(
        bound.speculative(SpeculativeProgram::rectangular(3, 3)).unwrap_err(),
        CapacityError::MissingProgram { requests: 3, depth: 3 }
    );
}

#[test]
fn older_abis_reject_speculative_graphs() {
    for abi in [1, 2] {
        let spec = FixtureSpec { abi, speculative_programs: vec![(1, 3)], ..FixtureSpec::default() };
        let f = Fixture::build(&spec);
        let g = program_index(&f.manifest, 1, 3);
        let (reason, field) = rejected(&f);
        assert_eq!(reason, InvalidReason::NeedsAbi { abi: 3, found: abi }, "ABI {abi}");
        assert_eq!(field, format!("core.graphs[{g}].kind"));
    }
    // Without them, ABI 2 keeps loading, with no programs.
    let m = validate(&Fixture::build(&FixtureSpec::abi2()).manifest).unwrap();
    assert_eq!(m.identity.abi_version, 2);
    assert!(m.capacities.speculative_programs.is_empty());
}

#[test]
fn depth_must_be_positive() {
    let mut f = speculative_fixture();
    let g = program_index(&f.manifest, 2, 3);
    f.manifest.graphs[g].capacity.as_mut().unwrap().proposal_depth = 0;
    let (reason, field) = rejected(&f);
    assert_eq!(reason, InvalidReason::MustBePositive);
    assert_eq!(field, format!("core.graphs[{g}].capacity.proposal_depth"));
}

#[test]
fn lanes_must_be_requests_times_width() {
    // P != B * W.
    let mut f = speculative_fixture();
    let g = program_index(&f.manifest, 2, 3);
    f.manifest.graphs[g].capacity.as_mut().unwrap().token_capacity = 7;
    let (reason, field) = rejected(&f);
    assert_eq!(reason, InvalidReason::ProgramShape { expected: 8, found: 7 });
    assert_eq!(field, format!("core.graphs[{g}].capacity.token_capacity"));

    // W != D + 1: lanes of a depth-3 program declared as depth 2.
    let mut f = speculative_fixture();
    let g = program_index(&f.manifest, 2, 3);
    f.manifest.graphs[g].capacity.as_mut().unwrap().proposal_depth = 2;
    let (reason, field) = rejected(&f);
    assert_eq!(reason, InvalidReason::ProgramShape { expected: 6, found: 8 });
    assert_eq!(field, format!("core.graphs[{g}].capacity.token_capacity"));
}

#[test]
fn records_hold_one_token_per_lane() {
    let mut f = speculative_fixture();
    let g = program_index(&f.manifest, 1, 3);
    f.manifest.graphs[g].completion_token_capacity = 8;
    let (reason, field) = rejected(&f);
    assert_eq!(reason, InvalidReason::ProgramShape { expected: 4, found: 8 });
    assert_eq!(field, format!("core.graphs[{g}].completion_token_capacity"));
    // Zero resolves to the default of 8 in every ABI: not this program's width either.
    f.manifest.graphs[g].completion_token_capacity = 0;
    let (reason, _) = rejected(&f);
    assert_eq!(reason, InvalidReason::ProgramShape { expected: 4, found: 8 });
}

#[test]
fn programs_are_unique() {
    let mut f = speculative_fixture();
    let g = program_index(&f.manifest, 2, 3);
    let mut twin = f.manifest.graphs[g].clone();
    twin.id = f.manifest.graphs.iter().map(|g| g.id).max().unwrap() + 1;
    twin.name = "speculative_twin".into();
    f.manifest.graphs.push(twin);
    let last = f.manifest.graphs.len() - 1;
    let (reason, field) = rejected(&f);
    assert_eq!(reason, InvalidReason::DuplicateProgram { requests: 2, depth: 3 });
    assert_eq!(field, format!("core.graphs[{last}].capacity"));
}

#[test]
fn speculative_bindings_follow_the_lane_layout() {
    // A per-request grammar mask is the wrong shape here.
    let mut f = speculative_fixture();
    let g = program_index(&f.manifest, 2, 3);
    let i = binding_index(&f.manifest.graphs[g], pb::ValueKind::GrammarMask);
    f.manifest.graphs[g].bindings[i].shape[0] = 2;
    let err = validate(&f.manifest).unwrap_err();
    assert!(matches!(err, CoreError::ViewSize { .. }), "{err}");
    assert_eq!(err.field().unwrap().to_string(), format!("core.graphs[{g}].bindings[{i}].shape"));

    // Token ids per lane, not per request.
    let mut f = speculative_fixture();
    let i = binding_index(&f.manifest.graphs[g], pb::ValueKind::TokenIds);
    f.manifest.graphs[g].bindings[i].shape = vec![2];
    assert!(validate(&f.manifest).is_err());

    // Query lengths are required.
    let mut f = speculative_fixture();
    f.manifest.graphs[g].bindings.retain(|b| b.value != pb::ValueKind::QueryLengths as i32);
    let (reason, field) = rejected(&f);
    assert_eq!(reason, InvalidReason::MissingBinding("query_lengths"));
    assert_eq!(field, format!("core.graphs[{g}].bindings"));

    // Pending tokens: read and written, never one without the other.
    let mut f = speculative_fixture();
    f.add_pending_tokens();
    let i = binding_index(&f.manifest.graphs[g], pb::ValueKind::PendingTokens);
    f.manifest.graphs[g].bindings[i].direction = pb::Direction::StateWrite as i32;
    let (reason, field) = rejected(&f);
    assert_eq!(reason, InvalidReason::WrongDirection);
    assert_eq!(field, format!("core.graphs[{g}].bindings[{i}].direction"));
}
