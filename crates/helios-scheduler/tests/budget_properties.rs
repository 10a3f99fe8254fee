//! Properties of the per-request snapshot budget and endpoint selection.

use helios_scheduler::{select_message_endpoints, snapshot_budget};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]
    #[test]
    fn budget_is_capped_and_nonzero_for_a_nonempty_pool(rows in 0u32..1000, concurrency in 1u32..64) {
        let budget = snapshot_budget(rows, concurrency);
        prop_assert!(budget <= 8);
        prop_assert_eq!(budget == 0, rows == 0);
        if rows > 0 {
            prop_assert_eq!(budget, (rows / concurrency).clamp(1, 8));
        }
    }

    #[test]
    fn selected_endpoints_are_sorted_unique_inside_and_within_budget(
        mut endpoints in prop::collection::vec(1u32..2000, 0..40),
        reused in 0u32..500,
        prompt in 500u32..2000,
        count in 0u32..8,
    ) {
        endpoints.sort_unstable();
        endpoints.dedup();
        let chosen = select_message_endpoints(&endpoints, reused, prompt, count);
        prop_assert!(chosen.len() <= count as usize);
        prop_assert!(chosen.windows(2).all(|w| w[0] < w[1]));
        prop_assert!(chosen.iter().all(|e| *e > reused && *e < prompt && endpoints.contains(e)));
        let eligible = endpoints.iter().filter(|&&e| e > reused && e < prompt).count();
        if eligible <= count as usize {
            prop_assert_eq!(chosen.len(), eligible);
        }
    }
}
