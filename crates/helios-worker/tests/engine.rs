//! The engine over the simulated executor: streaming, stop strings, grammars, cancellation,
//! and a failing executor surfacing as worker failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use helios_contract::fixtures::{Fixture, FixtureSpec};
use helios_contract::model::Manifest;
use helios_frontend::{AnswerFormat, SamplingRequest, ToolChoice};
use helios_replay::{Executor, ExecutorError, SimModel, SimulatedExecutor, StepInputs};
use helios_scheduler::{Completion, Step};
use helios_worker::{
    ChatPrompt, ChoiceEvent, Engine, EngineOptions, ErrorClass, FinishCause, Frontend, GenerationInput, Health,
    PromptInput, RequestError,
};
use serde_json::json;

fn manifest() -> Manifest {
    let spec = FixtureSpec { vocab_size: 49152, max_kv_pages: 256, context_limit: 4096, ..FixtureSpec::default() };
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
    GenerationInput {
        request_id: "t".into(),
        prompt: PromptInput::Chat(ChatPrompt {
            messages: vec![json!({"role": "user", "content": text})],
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
    assert_eq!((again.class(), again.code()), (ErrorClass::Unavailable, "worker_failed"));
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
