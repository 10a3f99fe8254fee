//! Compatibility of checked-in runtime cores.
//!
//! `fixtures/cores/abi1`, `abi2` and `abi3` were exported when their ABI was current and are
//! frozen: they must keep loading with every later engine, unchanged. `fixtures/cores/abi4` is
//! the current ABI (with speculative programs and programmatic edges); the test checks the
//! builder still produces it byte for byte, so a format change is always a visible diff.
//! Regenerate the current one with `FLARE_REGENERATE_FIXTURES=1 cargo test -p flare-tests`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use flare_tests::fixture_path;
use helios_contract::fixtures::{Fixture, FixtureSpec};
use helios_contract::{BoundContract, CURRENT_ABI, Dependency, GraphKind, MANIFEST_FILE, RuntimeCore, ValueKind};

#[test]
fn previous_abi_core_still_loads() {
    let core = RuntimeCore::open(fixture_path("cores/abi1")).expect("ABI 1 core loads");
    let m = core.manifest();
    assert_eq!(m.identity.abi_version, 1);
    // Fields added in ABI 2 resolve to the behavior ABI 1 cores had.
    assert_eq!(m.cache_scheme.verification_width, 1);
    assert_eq!(m.cache_scheme.padding_slot, -1);
    for g in &m.graphs {
        assert_eq!(g.completion_token_capacity, 8, "{}", g.name);
        assert_eq!(g.continuation_rows_per_request, 1, "{}", g.name);
    }
    // And it binds like any current core.
    let bound = BoundContract::bind(m);
    let decode = bound.decode(2).unwrap();
    let records = decode.view(ValueKind::CompletionRecords).unwrap();
    assert_eq!(records.shape, vec![2, 16]);
}

#[test]
fn abi2_core_still_loads() {
    let core = RuntimeCore::open(fixture_path("cores/abi2")).expect("ABI 2 core loads");
    let m = core.manifest();
    assert_eq!(m.identity.abi_version, 2);
    // Speculative programs arrived with ABI 3: an ABI 2 core has none.
    assert!(m.capacities.speculative_programs.is_empty());
    assert!(m.graphs_of(GraphKind::Speculative).is_empty());
    let bound = BoundContract::bind(m);
    assert_eq!(bound.decode(2).unwrap().view(ValueKind::CompletionRecords).unwrap().shape, vec![2, 16]);
}

#[test]
fn abi3_core_still_loads() {
    let core = RuntimeCore::open(fixture_path("cores/abi3")).expect("ABI 3 core loads");
    let m = core.manifest();
    assert_eq!(m.identity.abi_version, 3);
    assert!(!m.capacities.speculative_programs.is_empty());
    // Programmatic edges arrived with ABI 4: every edge of an ABI 3 core is a full dependency.
    assert!(m.graphs.iter().all(|g| g.edges.iter().all(|e| e.dependency == Dependency::Full)));
    let bound = BoundContract::bind(m);
    assert_eq!(bound.decode(2).unwrap().view(ValueKind::CompletionRecords).unwrap().shape, vec![2, 16]);
}

#[test]
fn current_abi_core_matches_builder() {
    let dir = fixture_path("cores/abi4");
    let fixture = Fixture::build(&FixtureSpec::speculative());
    if std::env::var_os("FLARE_REGENERATE_FIXTURES").is_some() {
        fixture.write_to(&dir).unwrap();
    }
    let core = RuntimeCore::open(&dir).expect("ABI 4 core loads");
    assert_eq!(core.manifest().identity.abi_version, CURRENT_ABI);
    assert!(!core.manifest().graphs_of(GraphKind::Prefill).is_empty());
    assert!(!core.manifest().capacities.speculative_programs.is_empty());
    assert!(core.manifest().graphs.iter().any(|g| g.programmatic_edges().count() > 0));
    let on_disk = std::fs::read(dir.join(MANIFEST_FILE)).unwrap();
    assert_eq!(on_disk, prost::Message::encode_to_vec(&fixture.manifest), "manifest drifted: regenerate deliberately");
    for (path, bytes) in &fixture.files {
        assert_eq!(&std::fs::read(dir.join(path)).unwrap(), bytes, "{path} drifted");
    }
}
