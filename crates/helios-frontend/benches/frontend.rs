//! Render + tokenize of a 200-message agent conversation, and grammar mask time per
//! token over the DeepSeek (128K) vocabulary. Python counterpart:
//! scripts/frontend/bench_reference.py (same conversation); the one-run Rust vs Transformers
//! comparison is `cargo run --release -p helios-frontend --example frontend_vs_transformers`.

#[path = "support/conversation.rs"]
mod support;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use helios_contract::{ReasoningParser, ToolParser};
use helios_frontend::{
    AnswerFormat, ChatTemplate, GrammarEnv, OutputProtocol, Prompt, RenderInput, TemplateConfig, Tokenizer,
};
use serde_json::json;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/frontend")
}

fn bench(c: &mut Criterion) {
    // ChatML template with a tokenizer that has its ChatML special tokens (SmolLM2).
    let tok = Arc::new(Tokenizer::from_file(fixtures().join("smollm2/tokenizer.json")).expect("tokenizer"));
    let ds = Arc::new(Tokenizer::from_file(fixtures().join("deepseek/tokenizer.json")).expect("tokenizer"));
    let tmpl = ChatTemplate::new(&TemplateConfig {
        chat_template: std::fs::read_to_string(fixtures().join("qwen_style/chat_template.jinja")).expect("template"),
        special_tokens: vec![],
    })
    .expect("compiles");
    let (messages, tools) = support::conversation();
    let input = RenderInput { messages, tools: Some(tools), add_generation_prompt: true, ..Default::default() };
    let text = tmpl.render_text(&input).expect("renders");
    let n = tok.encode(&text, false).expect("encodes").ids.len();
    println!("agent conversation: 200 messages, {} bytes, {n} tokens", text.len());
    let mut g = c.benchmark_group("frontend");
    g.bench_function("render_tokenize_200msg_cold", |b| {
        b.iter(|| {
            tok.clear_encode_cache();
            let t = tmpl.render_text(&input).expect("renders");
            tok.encode(&t, false).expect("encodes").ids.len()
        })
    });
    g.bench_function("render_tokenize_200msg_warm", |b| {
        b.iter(|| {
            let t = tmpl.render_text(&input).expect("renders");
            tok.encode(&t, false).expect("encodes").ids.len()
        })
    });
    g.bench_function("render_only_200msg", |b| b.iter(|| tmpl.render_text(&input).expect("renders").len()));
    g.bench_function("tokenize_only_200msg_cold", |b| {
        b.iter(|| {
            tok.clear_encode_cache();
            tok.encode(&text, false).expect("encodes").ids.len()
        })
    });
    g.bench_function("prepare_with_checkpoints_200msg_cold", |b| {
        b.iter(|| {
            tok.clear_encode_cache();
            tmpl.clear_mark_cache();
            Prompt::prepare(&tmpl, &tok, &input).expect("prepares").checkpoints.len()
        })
    });
    g.bench_function("prepare_with_checkpoints_200msg_warm", |b| {
        b.iter(|| Prompt::prepare(&tmpl, &tok, &input).expect("prepares").checkpoints.len())
    });

    let eos = ds.token_id("<｜end▁of▁sentence｜>").expect("eos");
    let env = GrammarEnv::new(ds.clone(), &[eos]).expect("env");
    let schema = json!({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}, "required": ["city"]}},
        "required": ["name", "age"], "additionalProperties": false});
    let answer = r#"{"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"], "address": {"city": "London", "zip": "W1"}}"#;
    let ids = ds.encode(answer, false).expect("encodes").ids;
    let proto = OutputProtocol {
        reasoning: ReasoningParser::ThinkTags,
        tools: ToolParser::HermesJson,
        calls: helios_frontend::Calls::Optional,
        starts_in_reasoning: false,
    };
    let fmt = AnswerFormat::JsonSchema(schema);
    g.bench_function("grammar_mask_consume_per_token_128k", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut done = 0u64;
            while done < iters {
                let mut m = env.matcher(&fmt, &proto).expect("matcher");
                for &id in &ids {
                    if done == iters {
                        break;
                    }
                    let t0 = Instant::now();
                    let mask = m.compute_mask().expect("mask");
                    assert!(mask.is_allowed(id));
                    m.consume_token(id).expect("consume");
                    total += t0.elapsed();
                    done += 1;
                }
            }
            total
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(3));
    targets = bench
}
criterion_main!(benches);
