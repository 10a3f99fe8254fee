//! Checkpoint stamps (execution ABI 3, optional): restore and snapshot graphs bind the
//! checkpoint epoch, maintenance graphs bind status records, and a row's position-metadata
//! stamp is 8 bytes. Cores without them load as before; every misuse is rejected with the field
//! it concerns.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use helios_contract::fixtures::{Fixture, FixtureSpec};
use helios_contract::model::{MaintenanceOp, RowRegionKind, STAMP_BYTES};
use helios_contract::record::{CompletionRecord, FLAG_CHECKPOINT_REJECTED, RECORD_MAGIC};
use helios_contract::{BoundContract, CoreError, Direction, InvalidReason, ValueKind, pb, validate};

fn stamped() -> Fixture {
    Fixture::build(&FixtureSpec::stamped())
}

fn rejected(f: &Fixture) -> (InvalidReason, String) {
    match validate(&f.manifest).expect_err("the core must be rejected") {
        CoreError::InvalidValue { field, reason } => (reason, field.to_string()),
        other => panic!("expected an invalid value, got {other}"),
    }
}

fn maintenance_index(m: &pb::RuntimeCore, op: pb::MaintenanceOp) -> usize {
    m.graphs.iter().position(|g| g.maintenance_op == op as i32).unwrap()
}

fn binding_index(g: &pb::Graph, value: pb::ValueKind) -> usize {
    g.bindings.iter().position(|b| b.value == value as i32).unwrap()
}

#[test]
fn stamped_core_binds_epochs_and_status_records() {
    let m = validate(&stamped().manifest).unwrap();
    let stamp = m.cache_scheme.row_layout.iter().find(|r| r.kind == RowRegionKind::PositionMetadata).unwrap();
    assert_eq!((stamp.offset, stamp.byte_size), (m.cache_scheme.continuation_row_bytes - 8, STAMP_BYTES));
    let bound = BoundContract::bind(&m);
    let header = u64::from(m.capacities.completion_record_header_words);
    for op in [MaintenanceOp::Restore, MaintenanceOp::Snapshot] {
        let g = bound.maintenance(op, 1).unwrap();
        let epoch = g.view(ValueKind::CheckpointEpoch).unwrap();
        assert_eq!((epoch.shape.clone(), epoch.direction), (vec![1], Direction::Input));
        assert!(g.view(ValueKind::ExpectedConsumed).is_some());
    }
    for op in [MaintenanceOp::Restore, MaintenanceOp::Snapshot, MaintenanceOp::Initialize] {
        let g = bound.maintenance(op, 1).unwrap();
        let records = g.view(ValueKind::CompletionRecords).unwrap();
        assert_eq!(records.shape, vec![1, header + 1], "{op:?}");
        assert_eq!(records.direction, Direction::Output);
    }
    assert!(bound.maintenance(MaintenanceOp::Initialize, 1).unwrap().view(ValueKind::CheckpointEpoch).is_none());
    // Without stamps the builder's graphs are exactly those of before (the checked-in ABI 3
    // core is compared byte for byte elsewhere): nothing of this kind.
    let plain = validate(&Fixture::build(&FixtureSpec::speculative()).manifest).unwrap();
    assert!(!plain.cache_scheme.has_row_region(RowRegionKind::PositionMetadata));
    let bound = BoundContract::bind(&plain);
    for op in [MaintenanceOp::Restore, MaintenanceOp::Snapshot, MaintenanceOp::Initialize] {
        let g = bound.maintenance(op, 1).unwrap();
        assert!(g.view(ValueKind::CheckpointEpoch).is_none() && g.view(ValueKind::CompletionRecords).is_none());
    }
}

#[test]
fn older_abis_cannot_bind_stamps() {
    for abi in [1, 2] {
        let f = Fixture::build(&FixtureSpec { abi, checkpoint_stamps: true, ..FixtureSpec::default() });
        let (reason, field) = rejected(&f);
        assert_eq!(reason, InvalidReason::NeedsAbi { abi: 3, found: abi }, "{field}");
        assert!(field.ends_with(".value"), "{field}");
    }
    // Status records alone are ABI 3 too.
    let mut f = Fixture::build(&FixtureSpec { abi: 2, checkpoint_stamps: true, ..FixtureSpec::default() });
    let epoch = pb::ValueKind::CheckpointEpoch as i32;
    for g in &mut f.manifest.graphs {
        g.bindings.retain(|b| b.value != epoch);
    }
    let (reason, field) = rejected(&f);
    assert_eq!(reason, InvalidReason::NeedsAbi { abi: 3, found: 2 });
    let i = maintenance_index(&f.manifest, pb::MaintenanceOp::Snapshot);
    let b = binding_index(&f.manifest.graphs[i], pb::ValueKind::CompletionRecords);
    assert_eq!(field, format!("core.graphs[{i}].bindings[{b}].value"));
}

#[test]
fn the_epoch_is_bound_by_restore_and_snapshot_only() {
    let mut f = stamped();
    let m = &mut f.manifest;
    let snapshot = maintenance_index(m, pb::MaintenanceOp::Snapshot);
    let initialize = maintenance_index(m, pb::MaintenanceOp::Initialize);
    let epoch = m.graphs[snapshot].bindings[binding_index(&m.graphs[snapshot], pb::ValueKind::CheckpointEpoch)].clone();
    m.graphs[initialize].bindings.push(epoch.clone());
    let (reason, field) = rejected(&f);
    assert_eq!(reason, InvalidReason::NotBindable("checkpoint_epoch"));
    let last = f.manifest.graphs[initialize].bindings.len() - 1;
    assert_eq!(field, format!("core.graphs[{initialize}].bindings[{last}].value"));

    let mut f = stamped();
    let decode = f.manifest.graphs.iter().position(|g| g.kind == pb::GraphKind::Decode as i32).unwrap();
    f.manifest.graphs[decode].bindings.push(epoch);
    assert_eq!(rejected(&f).0, InvalidReason::NotBindable("checkpoint_epoch"));
}

#[test]
fn a_checked_op_reports_and_has_a_stamp_to_check() {
    // Records removed from the snapshot graph: a rejection could pass unseen.
    let mut f = stamped();
    let i = maintenance_index(&f.manifest, pb::MaintenanceOp::Snapshot);
    let g = &mut f.manifest.graphs[i];
    let b = binding_index(g, pb::ValueKind::CompletionRecords);
    g.bindings.remove(b);
    let (reason, field) = rejected(&f);
    assert_eq!(reason, InvalidReason::MissingBinding("completion_records"));
    assert_eq!(field, format!("core.graphs[{i}].bindings"));

    // No stamp region in the rows: nothing to check.
    let mut f = stamped();
    let kind = pb::RowRegionKind::PositionMetadata as i32;
    f.manifest.cache_scheme.as_mut().unwrap().row_layout.retain(|r| r.kind != kind);
    let (reason, field) = rejected(&f);
    assert_eq!(reason, InvalidReason::MissingRowRegion("position metadata"));
    assert!(field.ends_with(".bindings"), "{field}");

    // The epoch is optional: restore and snapshot without it still load (unchecked, as before).
    let mut f = stamped();
    let epoch = pb::ValueKind::CheckpointEpoch as i32;
    for g in &mut f.manifest.graphs {
        g.bindings.retain(|b| b.value != epoch);
    }
    let m = validate(&f.manifest).unwrap();
    assert!(m.graphs.iter().all(|g| g.binding(ValueKind::CheckpointEpoch).is_none()));
}

#[test]
fn a_stamp_region_is_eight_bytes_and_one_per_row() {
    let stamp_index = |f: &Fixture| {
        let kind = pb::RowRegionKind::PositionMetadata as i32;
        f.manifest.cache_scheme.as_ref().unwrap().row_layout.iter().position(|r| r.kind == kind).unwrap()
    };
    let mut f = stamped();
    let i = stamp_index(&f);
    let scheme = f.manifest.cache_scheme.as_mut().unwrap();
    scheme.row_layout[i].byte_size = 4;
    scheme.row_layout[i].offset += 4;
    let (reason, field) = rejected(&f);
    assert_eq!(reason, InvalidReason::StampSize(4));
    assert_eq!(field, format!("core.cache_scheme.row_layout[{i}].byte_size"));

    let mut f = stamped();
    let i = stamp_index(&f);
    let scheme = f.manifest.cache_scheme.as_mut().unwrap();
    let mut second = scheme.row_layout[i].clone();
    second.name = "stamp2".into();
    second.offset -= 8;
    scheme.row_layout.push(second);
    let (reason, field) = rejected(&f);
    assert_eq!(reason, InvalidReason::DuplicateRowRegion("position metadata"));
    assert!(field.ends_with(".kind"), "{field}");
}

#[test]
fn status_records_parse_in_the_record_layout() {
    // What a rejected snapshot of row 2 into row 9 reports: nothing written, the live row's stamp.
    let record = CompletionRecord {
        slot: 9,
        flags: FLAG_CHECKPOINT_REJECTED,
        consumed_low: 70,
        counter_low: 0xdead,
        tokens: vec![],
    };
    let words = record.encode(8, 1);
    assert_eq!(&words[..6], &[RECORD_MAGIC, 9, FLAG_CHECKPOINT_REJECTED, 0, 70, 0xdead]);
    assert_eq!(CompletionRecord::parse(&words, 8, 1, 64), Ok(record));
}
