//! The engine over the simulated executor: streaming, stop strings, grammars, cancellation,
//! hostile input (abandoned heavy preparations, shutdown, O(1) limits, heavy grammars), and a
//! failing executor surfacing as worker failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use helios_contract::fixtures::{Fixture, FixtureSpec};
use helios_contract::model::Manifest;
use helios_frontend::{AnswerFormat, SamplingRequest, ToolChoice};
use helios_replay::{Executor, ExecutorError, SimModel, SimulatedExecutor, StepInputs};
use helios_scheduler::{Completion, Step};
use helios_worker::{
    ChatPrompt, ChoiceEvent, Engine, EngineOptions, ErrorClass, FinishCause, Frontend, GREEDY_SEED, GenerationInput,
    Health, PromptInput, RequestError,
};
use serde_json::json;

fn manifest() -> Manifest {
    manifest_with(4096, 256)
}

fn manifest_with(context_limit: u32, max_kv_pages: u32) -> Manifest {
    let spec = FixtureSpec { vocab_size: 49152, max_kv_pages, context_limit, ..FixtureSpec::default() };
    let mut m = helios_contract::validate(&Fixture::build(&spec).manifest).expect("valid fixture");
    m.frontend.eos_token_ids = vec![2];
    m
}

fn frontend(m: &Manifest) -> Frontend {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/frontend");
    let tokenizer = helios_frontend::Tokenizer::from_file(dir.join("smollm2/tokenizer.json")).expect("tokenizer");
    let template = std::fs::read_to_string(dir.join("qwen_style/chat_template.jinja")).expect("template");
    Frontend::from_parts(m, tokenizer, &template).expect("frontend")
}

/// Completions one step late and device-fed decode: two decode steps in flight, as on the GPU.
fn sim_engine() -> Arc<Engine> {
    let m = manifest();
    let (scheme, caps) = (m.cache_scheme.clone(), m.capacities.clone());
    Engine::start(&m, frontend(&m), EngineOptions::default(), move || {
        Ok(SimulatedExecutor::with_completion_lag(&scheme, &caps, 1)
            .with_model(SimModel::Induction)
            .with_device_fed_decode())
    })
    .expect("starts")
}

fn input(text: &str, max: u32) -> GenerationInput {
    chat_input(vec![json!({"role": "user", "content": text})], max)
}

fn chat_input(messages: Vec<serde_json::Value>, max: u32) -> GenerationInput {
    GenerationInput {
        request_id: "t".into(),
        prompt: PromptInput::Chat(ChatPrompt {
            messages,
            tools: vec![],
            tool_choice: ToolChoice::None,
            continue_final_message: false,
            template_kwargs: Default::default(),
        }),
        sampling: SamplingRequest { max_output_tokens: Some(max), ..Default::default() },
        seed: Some(1),
        n: 1,
        stop: vec![],
        answer: AnswerFormat::Text,
        ignore_eos: true,
    }
}

async fn drain(
    engine: &Engine,
    mut req: GenerationInput,
) -> (Vec<u32>, Result<helios_worker::FinishInfo, RequestError>) {
    req.request_id = "drain".into();
    let mut p = engine.prepare(req).await.expect("prepares");
    let mut s = engine.generate(&mut p, 0).await.expect("admitted");
    let mut tokens = Vec::new();
    loop {
        match s.next().await.expect("terminal event") {
            ChoiceEvent::Tokens(t) => tokens.extend(t),
            ChoiceEvent::Finished(f) => return (tokens, Ok(f)),
            ChoiceEvent::Failed(e) => return (tokens, Err(e)),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_to_the_output_limit_and_accounts() {
    let engine = sim_engine();
    let (tokens, end) = drain(&engine, input("hello there", 40)).await;
    let end = end.expect("finishes");
    assert_eq!((end.cause, end.generated as usize, tokens.len()), (FinishCause::Length, 40, 40));
    // Same seed, same prompt: same tokens, and the prompt now comes from the cache.
    let (again, end) = drain(&engine, input("hello there", 40)).await;
    assert_eq!(again, tokens);
    assert!(end.expect("finishes").cached_tokens > 0);
    let m = engine.metrics_text();
    assert!(m.contains("flare_requests_admitted_total 2"), "{m}");
    assert!(m.contains("flare_requests_finished_total{reason=\"length\"} 2"), "{m}");
}

/// Without a seed, a greedy request (temperature 0) draws its ties with the fixed greedy seed,
/// so two runs agree token for token; a sampled one gets a fresh seed per request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_greedy_request_without_a_seed_answers_the_same_every_time() {
    let engine = sim_engine();
    let unseeded = |temperature: f64| {
        let mut i = input("hello there", 8);
        i.seed = None;
        i.sampling.temperature = Some(temperature);
        i
    };
    let greedy = engine.prepare(unseeded(0.0)).await.expect("prepares");
    assert_eq!((greedy.sampling.top_k, greedy.seed), (1, GREEDY_SEED));
    let a = engine.prepare(unseeded(0.7)).await.expect("prepares");
    let b = engine.prepare(unseeded(0.7)).await.expect("prepares");
    assert_ne!(a.seed, b.seed, "sampled requests without a seed draw fresh ones");
    let (first, _) = drain(&engine, unseeded(0.0)).await;
    let (second, _) = drain(&engine, unseeded(0.0)).await;
    assert_eq!(first, second);
}

/// A request under a grammar speculates within it: the grammar threads look ahead over the
/// copy proposals and compute each lane's mask, the round verifies only what the grammar
/// accepts, and the output is the one the same request has without speculation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_constrained_request_speculates_within_its_grammar() {
    let schema = json!({"type": "array", "minItems": 12, "maxItems": 12,
        "items": {"type": "string", "enum": ["alpha beta gamma delta"]}, "x-guidance": {"whitespace_flexible": false}});
    let run = |depth: u32| {
        let schema = schema.clone();
        async move {
            let spec =
                FixtureSpec { vocab_size: 49152, max_kv_pages: 256, context_limit: 4096, ..FixtureSpec::speculative() };
            let mut m = helios_contract::validate(&Fixture::build(&spec).manifest).expect("valid fixture");
            m.frontend.eos_token_ids = vec![2];
            let (scheme, caps) = (m.cache_scheme.clone(), m.capacities.clone());
            let options = EngineOptions { speculative_depth: depth, ..EngineOptions::default() };
            let engine = Engine::start(&m, frontend(&m), options, move || {
                Ok(SimulatedExecutor::with_completion_lag(&scheme, &caps, 1).with_model(SimModel::Induction))
            })
            .expect("starts");
            let mut req = input("List it twelve times", 200);
            req.ignore_eos = false;
            req.answer = AnswerFormat::JsonSchema(schema);
            let (tokens, end) = drain(&engine, req).await;
            assert_eq!(end.expect("finishes").cause, FinishCause::Eos);
            let metrics = engine.metrics_text();
            let rounds = metrics
                .lines()
                .find_map(|l| l.strip_prefix("flare_speculative_rounds_total "))
                .and_then(|v| v.trim().parse::<u64>().ok())
                .unwrap_or(0);
            (tokens, rounds)
        }
    };
    let (plain, no_rounds) = run(0).await;
    let (speculated, rounds) = run(3).await;
    assert_eq!(no_rounds, 0);
    assert!(rounds > 0, "the repeated items offer proposals the grammar accepts");
    assert_eq!(speculated, plain);
    let text = frontend(&manifest()).tokenizer.decode(&plain, true).expect("decodes");
    let v: serde_json::Value = serde_json::from_str(text.trim()).expect("grammar output is JSON");
    assert_eq!(v.as_array().map(Vec::len), Some(12), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grammar_masks_hold_and_a_dropped_stream_cancels() {
    let engine = sim_engine();
    let mut req = input("Reply like {\"a\": 3}", 64);
    req.ignore_eos = false;
    req.answer = AnswerFormat::JsonSchema(json!({"type": "object", "properties": {"a": {"type": "integer"}},
        "required": ["a"], "additionalProperties": false, "x-guidance": {"whitespace_flexible": false}}));
    let mut p = engine.prepare(req).await.expect("prepares");
    let mut decoder = p.decoder(engine.frontend());
    let mut s = engine.generate(&mut p, 0).await.expect("admitted");
    let mut text = String::new();
    let cause = loop {
        match s.next().await.expect("event") {
            ChoiceEvent::Tokens(t) => {
                for d in decoder.push(&t).expect("decodes").deltas {
                    if let helios_frontend::OutputDelta::Content(c) = d {
                        text.push_str(&c);
                    }
                }
            }
            ChoiceEvent::Finished(f) => break f.cause,
            ChoiceEvent::Failed(e) => panic!("{e}"),
        }
    };
    let (tail, _) = decoder.finish().expect("finishes");
    for d in tail {
        if let helios_frontend::OutputDelta::Content(c) = d {
            text.push_str(&c);
        }
    }
    if cause == FinishCause::Eos {
        let v: serde_json::Value = serde_json::from_str(text.trim()).expect("grammar output is JSON");
        assert!(v["a"].is_i64(), "{text}");
    }

    // Dropping a stream mid-generation cancels the request and frees its storage.
    let mut p = engine.prepare(input("a long story", 3000)).await.expect("prepares");
    let s = engine.generate(&mut p, 0).await.expect("admitted");
    drop(s);
    let cancelled = "flare_requests_finished_total{reason=\"cancelled\"} 1";
    for _ in 0..500 {
        if engine.metrics_text().contains(cancelled) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(engine.metrics_text().contains(cancelled));
    // Idle: nothing in flight any more, so no page is still retiring behind a fence.
    for _ in 0..500 {
        if engine.metrics().occupancy().pages_retiring == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let o = engine.metrics().occupancy();
    assert_eq!((o.running, o.waiting, o.pages_request, o.pages_retiring), (0, 0, 0, 0));
}

/// Fails the third step it is given.
struct FailingExecutor {
    inner: SimulatedExecutor,
    steps: u32,
}

impl Executor for FailingExecutor {
    fn submit(&mut self, step: &Step, inputs: &StepInputs) -> Result<(), ExecutorError> {
        self.steps += 1;
        if self.steps == 3 {
            return Err(ExecutorError::BadPage(9999));
        }
        self.inner.submit(step, inputs)
    }
    fn poll(&mut self) -> Result<Vec<Completion>, ExecutorError> {
        self.inner.poll()
    }
    fn synchronize(&mut self) -> Result<Vec<Completion>, ExecutorError> {
        self.inner.synchronize()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn executor_failure_fails_requests_and_health() {
    let m = manifest();
    let (scheme, caps) = (m.cache_scheme.clone(), m.capacities.clone());
    let engine = Engine::start(&m, frontend(&m), EngineOptions::default(), move || {
        Ok(FailingExecutor { inner: SimulatedExecutor::new(&scheme, &caps), steps: 0 })
    })
    .expect("starts");
    let (_, end) = drain(&engine, input("hello", 50)).await;
    let err = end.expect_err("execution fails");
    assert_eq!(err.class(), ErrorClass::Execution);
    assert!(matches!(engine.health(), Health::Failed(ref why) if why.contains("9999")));
    let again = engine.prepare(input("hello", 5)).await.expect_err("refused");
    assert_eq!((again.class(), again.code().as_str()), (ErrorClass::Unavailable, "worker_failed"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn startup_failure_is_reported() {
    let m = manifest();
    let e = Engine::start(&m, frontend(&m), EngineOptions::default(), || -> Result<SimulatedExecutor, _> {
        Err(ExecutorError::BadRow(1))
    })
    .expect_err("fails");
    assert!(e.to_string().contains("row 1"), "{e}");
}

/// An executor that "owns a device": its memory grew by `growth` after readiness, and it
/// backs `pages` KV pages when the load-time plan cut them.
struct DeviceLike {
    inner: SimulatedExecutor,
    growth: i64,
    pages: Option<u32>,
}

impl Executor for DeviceLike {
    fn submit(&mut self, step: &Step, inputs: &StepInputs) -> Result<(), ExecutorError> {
        self.inner.submit(step, inputs)
    }
    fn poll(&mut self) -> Result<Vec<Completion>, ExecutorError> {
        self.inner.poll()
    }
    fn synchronize(&mut self) -> Result<Vec<Completion>, ExecutorError> {
        self.inner.synchronize()
    }
    fn device_memory_growth_bytes(&mut self) -> Option<i64> {
        Some(self.growth)
    }
    fn kv_pages(&self) -> Option<u32> {
        self.pages
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_memory_growth_after_readiness_is_exposed() {
    let engine = sim_engine();
    drain(&engine, input("hello", 3)).await.1.expect("finishes");
    assert!(!engine.metrics_text().contains("flare_device_memory_growth_bytes"), "no device, no gauge");
    let m = manifest();
    let (scheme, caps) = (m.cache_scheme.clone(), m.capacities.clone());
    let engine = Engine::start(&m, frontend(&m), EngineOptions::default(), move || {
        Ok(DeviceLike { inner: SimulatedExecutor::new(&scheme, &caps), growth: 2 << 20, pages: None })
    })
    .expect("starts");
    drain(&engine, input("hello", 3)).await.1.expect("finishes");
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let text = engine.metrics_text();
        if text.contains("flare_device_memory_growth_bytes 2097152") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "gauge never appeared: {text}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_pool_is_what_the_executor_backed() {
    let m = manifest();
    let (scheme, caps) = (m.cache_scheme.clone(), m.capacities.clone());
    let engine = Engine::start(&m, frontend(&m), EngineOptions::default(), move || {
        Ok(DeviceLike { inner: SimulatedExecutor::new(&scheme, &caps), growth: 0, pages: Some(100) })
    })
    .expect("starts");
    drain(&engine, input("hello", 3)).await.1.expect("finishes");
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !engine.metrics_text().contains("flare_pages_total 100") {
        assert!(std::time::Instant::now() < deadline, "{}", engine.metrics_text());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

// --- Grammar work off the model thread -------------------------------------------------------

/// An engine on a core with room for 20 requests at once.
fn wide_engine(options: EngineOptions) -> Arc<Engine> {
    let spec = FixtureSpec {
        vocab_size: 49152,
        max_kv_pages: 512,
        context_limit: 4096,
        request_slots: 20,
        decode_buckets: vec![1, 2, 4, 8, 16, 20],
        ..FixtureSpec::default()
    };
    let mut m = helios_contract::validate(&Fixture::build(&spec).manifest).expect("valid fixture");
    m.frontend.eos_token_ids = vec![2];
    m.frontend.sampling.max_output_tokens = 4000;
    let (scheme, caps) = (m.cache_scheme.clone(), m.capacities.clone());
    Engine::start(&m, frontend(&m), options, move || {
        Ok(SimulatedExecutor::with_completion_lag(&scheme, &caps, 1)
            .with_model(SimModel::Induction)
            .with_device_fed_decode())
    })
    .expect("starts")
}

/// An object schema with `n` string properties, all required or all optional.
fn object_schema(n: usize, required: bool) -> serde_json::Value {
    let names: Vec<String> = (0..n).map(|i| format!("property_{i}")).collect();
    let props: serde_json::Map<String, serde_json::Value> =
        names.iter().map(|k| (k.clone(), json!({"type": "string"}))).collect();
    if required {
        json!({"type": "object", "properties": props, "required": names})
    } else {
        json!({"type": "object", "properties": props})
    }
}

/// Reads a stream to its end (or until `until` turns true after a token event); returns its
/// token count, the largest gap between token events after the first, and how it ended
/// (`None`: stopped early).
async fn timed(
    mut s: helios_worker::ChoiceStream,
    until: impl Fn() -> bool,
) -> (usize, Duration, Option<Result<helios_worker::FinishInfo, RequestError>>) {
    let (mut tokens, mut gap, mut last) = (0, Duration::ZERO, None::<std::time::Instant>);
    loop {
        match s.next().await.expect("terminal event") {
            ChoiceEvent::Tokens(t) => {
                let now = std::time::Instant::now();
                if let Some(l) = last {
                    gap = gap.max(now - l);
                }
                last = Some(now);
                tokens += t.len();
                if until() {
                    return (tokens, gap, None);
                }
            }
            ChoiceEvent::Finished(f) => return (tokens, gap, Some(Ok(f))),
            ChoiceEvent::Failed(e) => return (tokens, gap, Some(Err(e))),
        }
    }
}

/// The reproduced stall: one request with a 5,000-property schema and n = 16, while an
/// unrelated stream runs (back to back, from before the heavy request is prepared until its
/// last choice ended). Masks are computed on the grammar threads and matchers freed there, so
/// the unrelated stream's largest inter-token gap stays small; the heavy choices finish or
/// fail alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heavy_grammar_never_stalls_an_unrelated_stream() {
    use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
    let engine = wide_engine(EngineOptions { max_concurrency: 17, ..EngineOptions::default() });
    let heavy_done = Arc::new(AtomicBool::new(false));
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let plain = {
        let (engine, done) = (engine.clone(), heavy_done.clone());
        tokio::spawn(async move {
            let (mut streams, mut tokens, mut gap) = (0, 0, Duration::ZERO);
            let mut started = Some(started_tx);
            while !done.load(Relaxed) {
                let mut p = engine.prepare(input("a long story about everything", 3500)).await.expect("prepares");
                let mut s = engine.generate(&mut p, 0).await.expect("admitted");
                // Gaps count from the first token: the prefill of a fresh stream is not one.
                assert!(matches!(s.next().await, Some(ChoiceEvent::Tokens(_))));
                if let Some(tx) = started.take() {
                    let _ = tx.send(());
                }
                let done = done.clone();
                let (n, g, _) = timed(s, move || done.load(Relaxed)).await;
                (streams, tokens, gap) = (streams + 1, tokens + n + 1, gap.max(g));
            }
            (streams, tokens, gap)
        })
    };
    started_rx.await.expect("the unrelated stream started");
    let t0 = std::time::Instant::now();
    let mut req = input("Reply with the JSON object.", 48);
    req.n = 16;
    req.ignore_eos = false;
    req.answer = AnswerFormat::JsonSchema(object_schema(5000, true));
    let mut heavy = engine.prepare(req).await.expect("prepares");
    let prepared_in = t0.elapsed();
    let mut choices = Vec::new();
    for i in 0..16 {
        let s = engine.generate(&mut heavy, i).await.expect("admitted");
        choices.push(tokio::spawn(timed(s, || false)));
    }
    let mut heavy_tokens = 0;
    for c in choices {
        let (tokens, _, end) = c.await.expect("joins");
        heavy_tokens += tokens;
        match end.expect("ran to its end") {
            Ok(f) => assert!(matches!(f.cause, FinishCause::Eos | FinishCause::Length), "{f:?}"),
            Err(e) => assert!(
                [("grammar_too_complex", ErrorClass::InvalidRequest), ("grammar_too_slow", ErrorClass::Unavailable)]
                    .contains(&(e.code().as_str(), e.class())),
                "{e}"
            ),
        }
    }
    let heavy_in = t0.elapsed();
    heavy_done.store(true, Relaxed);
    let (streams, plain_tokens, gap) = plain.await.expect("joins");
    eprintln!(
        "heavy: prepared in {prepared_in:?}, done in {heavy_in:?} ({heavy_tokens} tokens); \
         unrelated: {plain_tokens} tokens in {streams} streams, largest gap {gap:?}"
    );
    assert!(heavy_tokens >= 16, "every heavy choice sampled");
    assert!(gap < Duration::from_millis(100), "the unrelated stream stalled for {gap:?}");
}

/// A schema that compiles but exceeds the parser's limits at its first token is the client's
/// fault: a 400-class `grammar_too_complex` before anything is admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_over_the_parser_limits_is_a_client_error() {
    let engine = sim_engine();
    let mut req = input("Reply with JSON.", 16);
    req.n = 4;
    req.answer = AnswerFormat::JsonSchema(object_schema(1000, false));
    let e = engine.prepare(req).await.expect_err("too complex");
    assert_eq!(
        (e.class(), e.code().as_str(), e.stage(), e.param()),
        (ErrorClass::InvalidRequest, "grammar_too_complex", helios_worker::Stage::Preparation, Some("response_format"))
    );
    assert!(e.to_string().contains("max is 2000"), "{e}");
    // A schema llguidance rejects outright stays `invalid_grammar`.
    let mut req = input("Reply with JSON.", 16);
    req.answer = AnswerFormat::JsonSchema(json!({"type": "object", "properties": 7}));
    let e = engine.prepare(req).await.expect_err("rejected");
    assert_eq!((e.class(), e.code().as_str()), (ErrorClass::InvalidRequest, "invalid_grammar"), "{e}");
    let m = engine.metrics_text();
    assert!(m.contains("flare_requests_admitted_total 0"), "{m}");
}

/// A grammar step that runs past the budget fails its request alone (typed, 400-class) while
/// an unrelated stream goes on to its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grammar_over_its_time_budget_fails_alone() {
    let options = EngineOptions { grammar_mask_budget: Duration::from_nanos(1), ..EngineOptions::default() };
    let engine = wide_engine(options);
    let mut p = engine.prepare(input("hello there", 200)).await.expect("prepares");
    let plain = engine.generate(&mut p, 0).await.expect("admitted");
    let plain = tokio::spawn(timed(plain, || false));
    let mut req = input("Reply with JSON.", 32);
    req.answer = AnswerFormat::JsonSchema(object_schema(20, true));
    let mut c = engine.prepare(req).await.expect("prepares");
    let s = engine.generate(&mut c, 0).await.expect("admitted");
    let (tokens, _, end) = timed(s, || false).await;
    let e = end.expect("ended").expect_err("over budget");
    assert_eq!((e.code().as_str(), e.class()), ("grammar_too_slow", ErrorClass::Unavailable), "{e}");
    assert!(matches!(e, RequestError::GrammarTooSlow { budget_ms: 0, .. }), "{e:?}");
    assert_eq!(tokens, 1, "the first sample used the mask computed in preparation");
    let (plain_tokens, _, end) = plain.await.expect("joins");
    assert_eq!((plain_tokens, end.expect("ended").expect("finishes").cause), (200, FinishCause::Length));
}

// Preparation under hostile input: abandoned heavy conversations stop, shutdown does not
// wait on them, and the O(1) limits refuse oversized input before any rendering; requests
// still queued at shutdown are refused as unavailable, not started.

/// A context large enough that 8,001 messages fit (message count and tokens), so the heavy
/// work (render, marks, tokenization) really runs; outputs long enough to hold a slot.
fn long_context_engine(options: EngineOptions) -> Arc<Engine> {
    let mut m = manifest_with(65_536, 1_100);
    m.frontend.sampling.max_output_tokens = 16_000;
    let (scheme, caps) = (m.cache_scheme.clone(), m.capacities.clone());
    Engine::start(&m, frontend(&m), options, move || {
        Ok(SimulatedExecutor::with_completion_lag(&scheme, &caps, 1).with_model(SimModel::Induction))
    })
    .expect("starts")
}

fn tiny_messages(n: usize) -> Vec<serde_json::Value> {
    (0..n).map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": "hi"})).collect()
}

/// Prepare, admit and wait for the first token of a one-message request.
async fn small_request_first_token(engine: &Engine) -> Duration {
    let t0 = Instant::now();
    let mut p = engine.prepare(chat_input(tiny_messages(1), 2)).await.expect("prepares");
    let mut s = engine.generate(&mut p, 0).await.expect("admitted");
    match s.next().await.expect("event") {
        ChoiceEvent::Tokens(_) | ChoiceEvent::Finished(_) => t0.elapsed(),
        ChoiceEvent::Failed(e) => panic!("{e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_heavy_preparations_do_not_delay_a_small_request() {
    let engine = long_context_engine(EngineOptions::default());
    let warm = small_request_first_token(&engine).await;
    // Two clients send 8,001-message conversations (as many as there are preparation
    // threads) and leave while they are being prepared.
    let heavy: Vec<_> = (0..2)
        .map(|_| {
            let engine = engine.clone();
            tokio::spawn(async move { engine.prepare(chat_input(tiny_messages(8_001), 4)).await.map(|_| ()) })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(100)).await;
    for h in &heavy {
        assert!(!h.is_finished(), "the heavy preparation should still be running");
        h.abort();
    }
    let small = small_request_first_token(&engine).await;
    assert!(small < Duration::from_millis(100), "small request took {small:?} after abandonment (warm: {warm:?})");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_does_not_wait_for_a_heavy_preparation() {
    let engine = long_context_engine(EngineOptions::default());
    let heavy = {
        let engine = engine.clone();
        tokio::spawn(async move { engine.prepare(chat_input(tiny_messages(8_001), 4)).await.map(|_| ()) })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let t0 = Instant::now();
    engine.shutdown(Duration::from_millis(50)).await;
    assert!(t0.elapsed() < Duration::from_secs(3), "shutdown took {:?}", t0.elapsed());
    let err = heavy.await.expect("joins").expect_err("cancelled by shutdown");
    assert_eq!((err.class(), err.code().as_str()), (ErrorClass::Unavailable, "shutting_down"), "{err}");
}

fn refused_quickly(engine: &Engine, input: GenerationInput) -> RequestError {
    let t0 = Instant::now();
    let err = helios_worker::check_limits(engine.frontend(), &input).expect_err("refused");
    assert!(t0.elapsed() < Duration::from_millis(100), "{:?}", t0.elapsed());
    assert_eq!(err.class(), ErrorClass::InvalidRequest);
    err
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cheap_limits_refuse_before_any_rendering() {
    let engine = long_context_engine(EngineOptions::default());
    // More messages than the context has tokens.
    let err = refused_quickly(&engine, chat_input(tiny_messages(100_001), 4));
    assert_eq!((err.code().as_str(), err.param()), ("too_many_messages", Some("messages")));
    // 10,000 stop strings of 1 KB.
    let mut many = chat_input(tiny_messages(1), 4);
    many.stop = (0..10_000).map(|i| format!("{i:05}{}", "x".repeat(1019))).collect();
    let err = refused_quickly(&engine, many);
    assert_eq!((err.code().as_str(), err.param()), ("invalid_parameter", Some("stop")));
    let mut long = chat_input(tiny_messages(1), 4);
    long.stop = vec!["y".repeat(helios_frontend::MAX_STOP_BYTES + 1)];
    assert_eq!(refused_quickly(&engine, long).param(), Some("stop"));
    // Strings each within bounds, too many bytes in all.
    let mut total = chat_input(tiny_messages(1), 4);
    total.stop = (0..9).map(|i| format!("{i}{}", "t".repeat(helios_frontend::MAX_STOP_BYTES - 1))).collect();
    assert_eq!(refused_quickly(&engine, total).param(), Some("stop"));
    // A 30 MB completion prompt: refused by the tokenizer's byte bound, never encoded.
    let mut text = chat_input(vec![], 4);
    text.prompt = PromptInput::Text("z".repeat(30 << 20));
    assert_eq!(refused_quickly(&engine, text).code().as_str(), "context_length_exceeded");
    // A chat that renders past the byte bound stops rendering early, with the same code.
    let big = vec![json!({"role": "user", "content": "w ".repeat(4 << 20)})];
    let t0 = Instant::now();
    let err = engine.prepare(chat_input(big, 4)).await.expect_err("too long");
    assert_eq!(err.code().as_str(), "context_length_exceeded", "{err}");
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    // At the limits, a request is prepared.
    let mut ok = chat_input(tiny_messages(3), 4);
    ok.stop = (0..helios_frontend::MAX_STOPS).map(|i| format!("{i:03}{}", "s".repeat(60))).collect();
    assert!(ok.stop.iter().map(String::len).sum::<usize>() <= helios_frontend::MAX_STOP_TOTAL_BYTES);
    engine.prepare(ok).await.expect("prepares at the stop limits");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_requests_at_shutdown_are_unavailable_not_started() {
    let engine = long_context_engine(EngineOptions { max_concurrency: 1, ..EngineOptions::default() });
    let mut long = engine.prepare(chat_input(tiny_messages(1), 16_000)).await.expect("prepares");
    let mut running = engine.generate(&mut long, 0).await.expect("admitted");
    let queued = {
        let engine = engine.clone();
        tokio::spawn(async move {
            let mut p = engine.prepare(chat_input(tiny_messages(3), 4)).await.expect("prepares");
            engine.generate(&mut p, 0).await.map(|_| ())
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    if queued.is_finished() {
        panic!("the second request should wait for the only slot: {:?}", queued.await.expect("joins").err());
    }
    engine.shutdown(Duration::from_millis(50)).await;
    let err = queued.await.expect("joins").expect_err("refused");
    assert_eq!((err.class(), err.code().as_str()), (ErrorClass::Unavailable, "shutting_down"), "{err}");
    // The running one was admitted, so it ends in its stream (cancelled after the grace).
    while let Some(ChoiceEvent::Tokens(_)) = running.next().await {}
}

/// `/tokenize` goes through the same bounds and cancellation as generation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_is_bounded_and_cancellable() {
    let engine = sim_engine();
    let f = engine.frontend();
    let never = helios_frontend::Cancel::default();
    // Refused by its length before any tokenization (which would take seconds for 30 MiB): the
    // bound is loose so that a loaded CI machine does not fail it (119 ms seen with 100 ms).
    let huge = PromptInput::Text("z".repeat(30 << 20));
    let t0 = Instant::now();
    let err = helios_worker::tokenize(f, huge, false, &never).expect_err("too long");
    assert_eq!(err.code().as_str(), "context_length_exceeded");
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    let chat = |n: usize| {
        PromptInput::Chat(ChatPrompt {
            messages: tiny_messages(n),
            tools: vec![],
            tool_choice: ToolChoice::Auto,
            continue_final_message: false,
            template_kwargs: Default::default(),
        })
    };
    let err = helios_worker::tokenize(f, chat(5_000), false, &never).expect_err("too many messages");
    assert_eq!(err.code().as_str(), "too_many_messages");
    let cancelled = helios_frontend::Cancel::new();
    cancelled.cancel();
    assert!(helios_worker::tokenize(f, chat(3), false, &cancelled).is_err());
    let ids = helios_worker::tokenize(f, chat(3), false, &never).expect("tokenizes");
    let mut p = engine.prepare(chat_input(tiny_messages(3), 4)).await.expect("prepares");
    assert_eq!(ids, p.prompt_ids.to_vec(), "the same tokens generation would use");
    drop(engine.generate(&mut p, 0).await.expect("admitted"));
}

/// With a host tier, a conversation whose checkpoints the GPU cache evicted comes back with its
/// prompt cached: restored from host memory, with identical tokens, and the tier's families in
/// `/metrics`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicted_conversations_come_back_from_the_host_tier() {
    let m = manifest();
    let (scheme, caps) = (m.cache_scheme.clone(), m.capacities.clone());
    let options = EngineOptions { host_cache_bytes: Some(64 << 20), ..EngineOptions::default() };
    let engine = Engine::start(&m, frontend(&m), options, move || {
        Ok(SimulatedExecutor::with_completion_lag(&scheme, &caps, 1)
            .with_model(SimModel::Induction)
            .with_device_fed_decode())
    })
    .expect("starts");
    let conversation = |i: usize| input(&format!("conversation {i}: {}", "tool output line\n".repeat(60)), 8);
    let (first, _) = drain(&engine, conversation(0)).await;
    // More conversations than the GPU cache's snapshot rows hold.
    for i in 1..12 {
        drain(&engine, conversation(i)).await.1.expect("finishes");
    }
    let (again, end) = drain(&engine, conversation(0)).await;
    assert_eq!(again, first);
    assert!(end.expect("finishes").cached_tokens > 0);
    // The gauges are published when the model thread turns idle: wait for that.
    let deadline = Instant::now() + Duration::from_secs(5);
    let tier = loop {
        let tier = engine.metrics().host_tier().expect("a host tier");
        if tier.restores > 0 || Instant::now() > deadline {
            break tier;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    assert!(tier.tier.demotions > 0 && tier.restores > 0, "{tier:?}");
    let text = engine.metrics_text();
    assert!(text.contains("flare_cache_tier_restores_total{tier=\"host\"}"), "{text}");
    assert!(text.contains("flare_cache_tier_restore_seconds_count{tier=\"host\"} "), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_tier_the_executor_cannot_serve_fails_startup_when_asked_for() {
    struct NoTransfers(SimulatedExecutor);
    impl Executor for NoTransfers {
        fn submit(&mut self, step: &Step, inputs: &StepInputs) -> Result<(), ExecutorError> {
            self.0.submit(step, inputs)
        }
        fn poll(&mut self) -> Result<Vec<Completion>, ExecutorError> {
            self.0.poll()
        }
        fn synchronize(&mut self) -> Result<Vec<Completion>, ExecutorError> {
            self.0.synchronize()
        }
    }
    let m = manifest();
    let start = |bytes: Option<u64>| {
        let (scheme, caps) = (m.cache_scheme.clone(), m.capacities.clone());
        let options = EngineOptions { host_cache_bytes: bytes, ..EngineOptions::default() };
        Engine::start(&m, frontend(&m), options, move || Ok(NoTransfers(SimulatedExecutor::new(&scheme, &caps))))
    };
    let e = start(Some(1 << 20)).expect_err("asked for a host tier it cannot serve");
    assert!(e.to_string().contains("host transfers"), "{e}");
    // By default it serves without one.
    let engine = start(None).expect("starts");
    assert!(engine.metrics().host_tier().is_none());
}
