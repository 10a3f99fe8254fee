//! Freed heap memory goes back to the OS after a trim (its own test binary: resident size
//! is process-wide).
#![allow(clippy::unwrap_used, clippy::expect_used)]

fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

#[test]
fn trim_returns_freed_heap_pages() {
    let Some(before) = resident_bytes() else { return };
    // 64 MiB in small blocks, then all but the newest freed: the newest pins the heap top,
    // so glibc cannot give the memory back without a trim.
    let mut blocks: Vec<Box<[u8; 1024]>> = (0..65_536).map(|i| Box::new([i as u8; 1024])).collect();
    let last = blocks.pop().expect("a block");
    let peak = resident_bytes().expect("statm");
    drop(blocks);
    let freed = resident_bytes().expect("statm");
    helios_worker::release_free_memory();
    let trimmed = resident_bytes().expect("statm");
    assert_eq!(last[0], 255);
    assert!(peak > before + (48 << 20), "the blocks were resident: {before} -> {peak}");
    if cfg!(all(target_os = "linux", target_env = "gnu")) {
        assert!(
            trimmed + (32 << 20) < freed,
            "trim released the freed blocks: peak {peak}, after free {freed}, after trim {trimmed}"
        );
    }
}
