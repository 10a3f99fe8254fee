//! Checkpoint stamps: every `Snapshot` carries its checkpoint's token count and epoch (the low
//! 32 bits of its prefix digest), and every `Restore` of that checkpoint, from the GPU cache or
//! brought back from the host tier, carries the same pair. The test drives the scheduler as its
//! own executor (every sample is token 7); the simulated executor's lifecycle tests check the
//! pairs against the rows themselves.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashSet;

use helios_cache::{PrefixIdentity, PromptDigests};
use helios_contract::model::{CacheScheme, Capacities, PageRegion};
use helios_scheduler::{Completion, RequestSpec, SampledToken, Scheduler, SchedulerConfig, Step, StepOp, epoch_of};

mod support;
use support::scheme;

const IDENTITY: PrefixIdentity = PrefixIdentity { model: 3, token_layout: 5 };

fn scheduler() -> Scheduler {
    // Pages of 64 bytes: what the host tier's transfers size.
    let scheme = CacheScheme { page_regions: vec![PageRegion { name: "kv".into(), bytes_per_page: 64 }], ..scheme() };
    let caps = Capacities {
        context_limit: 512,
        decode_request_buckets: vec![1, 2],
        prefill_chunk_capacities: vec![16, 64],
        image_patch_buckets: vec![],
        request_slots: 2,
        snapshot_rows: 8,
        max_kv_pages: 64,
        vocab_size: 100,
        completion_record_header_words: 0,
        speculative_programs: vec![],
    };
    let config = SchedulerConfig {
        max_concurrency: 2,
        queue_limit: 16,
        identity: IDENTITY,
        device_fed_decode: false,
        speculative_depth: 0,
    };
    Scheduler::new(scheme, caps, config).unwrap().with_host_tier(16 << 20)
}

fn completion(step: &Step) -> Completion {
    let mut sampled = Vec::new();
    for op in &step.ops {
        let request = match op {
            StepOp::Decode { rows, .. } => {
                sampled.extend(
                    rows.iter().filter_map(|r| r.sample).map(|s| SampledToken { request: s.request, token: 7 }),
                );
                continue;
            }
            StepOp::Prefill { row, .. } => row.sample.map(|s| s.request),
            StepOp::ResumeSampling { sample, .. } => Some(sample.request),
            _ => None,
        };
        sampled.extend(request.map(|request| SampledToken { request, token: 7 }));
    }
    Completion { fence: step.fence, sampled }
}

/// Every (consumed, epoch) a Snapshot and a Restore carried, and how many restores were
/// preceded by a copy-in from the host.
#[derive(Default)]
struct Seen {
    snapshots: HashSet<(u32, u32)>,
    restores: Vec<(u32, u32)>,
    copy_ins: usize,
}

fn drain(s: &mut Scheduler, seen: &mut Seen) {
    for _ in 0..2000 {
        if s.is_idle() {
            return;
        }
        let Some(step) = s.schedule() else { continue };
        for op in &step.ops {
            match op {
                StepOp::Snapshot { consumed, epoch, .. } => {
                    seen.snapshots.insert((*consumed, *epoch));
                }
                StepOp::Restore { consumed, epoch, .. } => {
                    // A checkpoint is only ever restored with the stamp it was captured with.
                    assert!(seen.snapshots.contains(&(*consumed, *epoch)), "restore of an unknown stamp");
                    seen.restores.push((*consumed, *epoch));
                }
                StepOp::CopyIn { .. } => seen.copy_ins += 1,
                _ => {}
            }
        }
        s.check_invariants();
        s.complete(&completion(&step));
    }
    panic!("did not drain");
}

#[test]
fn restores_carry_the_stamp_their_checkpoint_was_captured_with() {
    let mut s = scheduler();
    let prompt: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 90 + 1).collect();
    let request = || RequestSpec::plain(prompt.clone(), 4, 1);
    let key = |len: usize| PromptDigests::key_of(IDENTITY, &prompt, &[], len);
    let mut seen = Seen::default();

    // Captured at the prompt's end and terminally; the epochs are the digests' low bits.
    s.submit(request()).unwrap();
    drain(&mut s, &mut seen);
    let at_prompt = (40, epoch_of(&key(40)));
    assert_eq!(at_prompt.1, key(40).digest.0 as u32);
    assert!(seen.snapshots.contains(&at_prompt), "{:?}", seen.snapshots);
    // The terminal capture holds the prompt and the three samples consumed after it.
    let mut history = prompt.clone();
    history.extend([7, 7, 7]);
    let terminal = PromptDigests::key_of(IDENTITY, &history, &[], 43);
    assert!(seen.snapshots.contains(&(43, epoch_of(&terminal))), "{:?}", seen.snapshots);

    // The same prompt again: restored from the GPU cache (a full-prompt hit, then sampling
    // resumes), with the prompt checkpoint's stamp.
    s.submit(request()).unwrap();
    drain(&mut s, &mut seen);
    assert_eq!(seen.restores, vec![at_prompt]);
    assert_eq!(seen.copy_ins, 0);

    // Evicted to the host tier (the next step copies the rows out, stamps and all) and asked
    // for again: copied back in, then restored with the very same stamp.
    s.evict_cache();
    assert_eq!(s.cached_checkpoints(), 0);
    s.submit(request()).unwrap();
    drain(&mut s, &mut seen);
    assert!(seen.copy_ins > 0, "the prompt came back from the host tier");
    assert_eq!(seen.restores, vec![at_prompt, at_prompt]);
}
