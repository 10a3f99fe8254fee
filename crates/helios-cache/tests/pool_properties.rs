//! Random retain/release/signal sequences keep the fenced-pool invariants.
#![allow(clippy::unwrap_used)]

use helios_cache::{Fence, FencedPool};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]
    #[test]
    fn entries_are_reused_only_after_references_and_fences_end(ops in prop::collection::vec((0u8..4, 0u32..8), 1..200)) {
        let mut pool = FencedPool::new(8);
        let mut held: Vec<(u32, u64)> = Vec::new();
        let mut fence = 0u64;
        let mut completed = 0u64;
        // last fence per entry across all holders
        let mut last_use = [0u64; 8];
        for (op, arg) in ops {
            match op {
                0 => if let Some(i) = pool.allocate() {
                    prop_assert!(last_use[i as usize] <= completed, "reused before its fence");
                    prop_assert!(!held.iter().any(|&(h, _)| h == i), "reused while referenced");
                    held.push((i, fence));
                },
                1 => if let Some(&(i, _)) = held.get(arg as usize % held.len().max(1)) {
                    pool.retain(i);
                    held.push((i, fence));
                },
                2 => if !held.is_empty() {
                    let (i, _) = held.swap_remove(arg as usize % held.len());
                    fence += 1;
                    last_use[i as usize] = last_use[i as usize].max(fence);
                    pool.release(i, Fence(fence));
                },
                _ => {
                    completed = (completed + u64::from(arg)).min(fence);
                    pool.signal(Fence(completed));
                }
            }
            pool.check_invariants();
        }
    }
}
