//! Planning cost per decode step, and prefix lookup for a 128K-token conversation.
#![allow(clippy::unwrap_used, missing_docs)]

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use helios_cache::{Fence, FencedPool, PrefixCache, PrefixIdentity, PromptDigests, Publication};
use helios_contract::model::{CacheScheme, Capacities};
use helios_scheduler::{Completion, RequestSpec, SampledToken, Scheduler, SchedulerConfig, Step, StepOp};

#[path = "../tests/support/mod.rs"]
mod support;

fn scheme() -> CacheScheme {
    support::paged_scheme(64)
}

fn capacities(slots: u32) -> Capacities {
    Capacities {
        context_limit: 1 << 20,
        decode_request_buckets: vec![1, 2, 4, 8, 16, 32, 64, 128, 256],
        prefill_chunk_capacities: vec![64, 256],
        image_patch_buckets: vec![],
        request_slots: slots,
        snapshot_rows: 0,
        max_kv_pages: slots * 40 + 64,
        vocab_size: 1000,
        completion_record_header_words: 0,
        speculative_programs: vec![],
    }
}

fn request(seed: u64) -> RequestSpec {
    RequestSpec {
        tokens: (0..64).map(|i| (i as u32 * 13 + seed as u32) % 999 + 1).collect(),
        images: vec![],
        message_endpoints: vec![],
        max_output_tokens: 2000,
        eos_tokens: vec![],
        seed,
        needs_host_feedback: false,
    }
}

/// Completes a step with a fixed token for every sampled row (no executor cost).
fn complete(scheduler: &mut Scheduler, step: &Step) {
    let mut sampled = Vec::new();
    for op in &step.ops {
        match op {
            StepOp::Decode { rows, .. } => sampled
                .extend(rows.iter().filter_map(|r| r.sample).map(|s| SampledToken { request: s.request, token: 7 })),
            StepOp::Prefill { row, .. } => {
                sampled.extend(row.sample.map(|s| SampledToken { request: s.request, token: 7 }))
            }
            StepOp::ResumeSampling { sample, .. } => sampled.push(SampledToken { request: sample.request, token: 7 }),
            _ => {}
        }
    }
    scheduler.complete(&Completion { fence: step.fence, sampled });
}

fn decode_step(c: &mut Criterion) {
    let mut group = c.benchmark_group("decode_step");
    for active in [1u32, 16, 64, 256] {
        let config = SchedulerConfig {
            max_concurrency: active,
            queue_limit: 1024,
            identity: PrefixIdentity { model: 1, token_layout: 1 },
            device_fed_decode: false,
            speculative_depth: 0,
        };
        let mut scheduler = Scheduler::new(scheme(), capacities(active), config).unwrap();
        let mut next_seed = 0;
        for _ in 0..active {
            scheduler.submit(request(next_seed)).unwrap();
            next_seed += 1;
        }
        for _ in 0..active * 2 {
            if let Some(step) = scheduler.schedule() {
                complete(&mut scheduler, &step);
            }
        }
        group.bench_function(BenchmarkId::from_parameter(active), |b| {
            b.iter(|| {
                loop {
                    for _ in scheduler.take_finished() {
                        scheduler.submit(request(next_seed)).unwrap();
                        next_seed += 1;
                    }
                    if let Some(step) = scheduler.schedule() {
                        complete(&mut scheduler, black_box(&step));
                        break;
                    }
                }
            })
        });
    }
    group.finish();
}

fn prefix_lookup(c: &mut Criterion) {
    let identity = PrefixIdentity { model: 1, token_layout: 1 };
    let tokens: Vec<u32> = (0..131_072u32).map(|i| i.wrapping_mul(2_654_435_761) % 150_000).collect();
    let mut pages = FencedPool::new(2100);
    let mut snapshots = FencedPool::new(64);
    let mut cache = PrefixCache::new(64);
    let digests = PromptDigests::new(identity, &tokens, &[]);
    let mut parent = None;
    let mut previous = 0usize;
    // A checkpoint every 4,100 tokens (unaligned, so each has a tail page).
    for end in (4100..131_072).step_by(4100) {
        let segment: Vec<u32> = (previous / 64..end / 64).map(|_| pages.allocate().unwrap()).collect();
        let publication = Publication {
            key: digests.key_at(&tokens, &[], end),
            parent,
            segment,
            tail_page: pages.allocate(),
            snapshot: snapshots.allocate().unwrap(),
            fence: Fence(0),
        };
        if let helios_cache::PublishOutcome::Published(id) = cache.publish(publication, &mut pages, &mut snapshots) {
            parent = Some(id);
        }
        previous = end;
    }
    let mut query = tokens.clone();
    query.extend([1, 2, 3]);
    c.bench_function("prefix_lookup_128k_with_digest", |b| {
        b.iter(|| {
            let digests = PromptDigests::new(identity, black_box(&query), &[]);
            black_box(cache.lookup(&digests, &query, &[], query.len()))
        })
    });
    let digests = PromptDigests::new(identity, &query, &[]);
    c.bench_function("prefix_lookup_128k_digest_cached", |b| {
        b.iter(|| black_box(cache.lookup(black_box(&digests), &query, &[], query.len())))
    });
}

criterion_group!(benches, decode_step, prefix_lookup);
criterion_main!(benches);
