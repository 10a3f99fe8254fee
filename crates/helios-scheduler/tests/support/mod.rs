//! What the tests that drive the scheduler as their own executor share (and the planning
//! bench, by path): a one-region page scheme and the requests a planned step samples.
#![allow(dead_code)] // each test binary uses its own part

use helios_contract::model::{CacheScheme, PageRegion};
use helios_scheduler::{RequestId, Step, StepOp};

/// 16-token pages of one byte-sized region, one live row per slot, no verification columns.
pub(crate) fn scheme() -> CacheScheme {
    paged_scheme(16)
}

/// [`scheme`] with `page_tokens`-token pages (the planning bench uses 64).
pub(crate) fn paged_scheme(page_tokens: u32) -> CacheScheme {
    CacheScheme {
        page_tokens,
        page_regions: vec![PageRegion { name: "kv".into(), bytes_per_page: 1 }],
        continuation_row_bytes: 16,
        row_layout: vec![],
        null_row: 0,
        live_rows_per_slot: 1,
        verification_width: 1,
        padding_slot: -1,
    }
}

/// Requests the step samples, in op and row order (decode rows, the prefill chunk that ends a
/// prompt, resumed sampling; not speculative rounds).
pub(crate) fn sampled(step: &Step) -> Vec<RequestId> {
    let mut out = Vec::new();
    for op in &step.ops {
        match op {
            StepOp::Decode { rows, .. } => out.extend(rows.iter().filter_map(|r| r.sample.map(|s| s.request))),
            StepOp::Prefill { row, .. } => out.extend(row.sample.map(|s| s.request)),
            StepOp::ResumeSampling { sample, .. } => out.push(sample.request),
            _ => {}
        }
    }
    out
}
