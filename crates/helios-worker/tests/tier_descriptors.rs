//! No file descriptor outlives the disk tier: a workload over host and disk tiers (writes,
//! fetches, a failing read), then the scheduler dropped, leaves the process's descriptor table
//! as it found it. Alone in its test binary, so nothing else opens files meanwhile.
#![allow(clippy::unwrap_used)]

use helios_replay::{SimulatedExecutor, reference_schemes, test_capacities};
use helios_worker::workload::{Action, Tiers, run_workload_tiered};

fn open_descriptors() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

#[test]
fn the_disk_tier_leaves_no_descriptor_open() {
    let scheme = reference_schemes().remove(0);
    let min_pages = scheme.pages_for(1024) as u32 + 2;
    let caps = test_capacities(4, min_pages, 3);
    let mut actions = Vec::new();
    for seed in 0..5u64 {
        actions.push(Action::Start { messages: 2, message_len: 80, max_output: 6, seed });
        actions.push(Action::Run { turns: 30 });
    }
    for c in 0..5u8 {
        actions.push(Action::Append { conversation: c, len: 20, max_output: 4 });
        actions.push(Action::Run { turns: 30 });
    }
    let dir = tempfile::tempdir().unwrap();
    let before = open_descriptors();
    for flip_bits in [false, true] {
        let tiers = Tiers {
            host_bytes: Some(10 * helios_offload::UNIT_BYTES),
            disk: Some((dir.path().to_path_buf(), 1 << 30)),
            faults: helios_offload::IoFaults { flip_bits, ..Default::default() },
            ..Tiers::default()
        };
        let mut executor = SimulatedExecutor::new(&scheme, &caps);
        let report = run_workload_tiered(&mut executor, &scheme, &caps, 4, &[], &tiers, &actions).unwrap();
        let counts = (report.disk_writes, report.disk_fetches, report.disk_fetch_failures);
        if flip_bits {
            // The first run's files are found again; reading them fails on the corrupted medium.
            assert!(counts.2 > 0, "writes, fetches, failed fetches: {counts:?}");
        } else {
            assert!(counts.0 > 0 && counts.1 > 0, "writes, fetches, failed fetches: {counts:?}");
        }
    }
    assert_eq!(open_descriptors(), before, "descriptors left open by the disk tier");
}
