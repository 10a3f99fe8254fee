//! Render + tokenize of the 200-message, ~32K-token agent conversation in Rust vs
//! Transformers in Python, measured in one run; plus `Prompt::prepare` (checkpoint marks)
//! and grammar mask time per token over the DeepSeek (128K) vocabulary.
//!
//! `cargo run --release -p helios-frontend --example frontend_vs_transformers`
//!
//! Python: `$PYTHON` (else `python3`) runs scripts/frontend/bench_reference.py --json;
//! when it cannot import transformers the ratio is skipped.
//!
//! cold: every cache we own is cleared before each iteration (our segment cache and the
//!       HF BPE word cache inside our tokenizer), so each iteration is a first-request cost.
//!       The chat template is compiled once (model load), as Transformers caches its
//!       compiled Jinja template. Python cold clears its HF BPE word cache likewise.
//! warm: identical repeated requests, all caches kept (ours: segment cache; Python: the HF
//!       tokenizer's internal BPE word cache).
//! All figures are medians.

#[path = "../benches/support/conversation.rs"]
mod support;

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use helios_contract::{ReasoningParser, ToolParser};
use helios_frontend::{
    AnswerFormat, ChatTemplate, GrammarEnv, OutputProtocol, Prompt, RenderInput, TemplateConfig, Tokenizer,
};
use serde_json::{Value, json};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/frontend")
}

fn median(mut v: Vec<Duration>) -> f64 {
    v.sort_unstable();
    v[v.len() / 2].as_secs_f64() * 1e3
}

fn time_n(n: usize, mut f: impl FnMut()) -> f64 {
    median(
        (0..n)
            .map(|_| {
                let t0 = Instant::now();
                f();
                t0.elapsed()
            })
            .collect(),
    )
}

/// 64-bit FNV-1a over ids as little-endian u32 (same as bench_reference.py).
fn fnv1a(ids: &[u32]) -> u64 {
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    for b in ids.iter().flat_map(|i| i.to_le_bytes()) {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01B3);
    }
    h
}

fn python_reference(runs: usize) -> Result<Value, String> {
    let py = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/frontend/bench_reference.py");
    let probe = Command::new(&py).args(["-c", "import transformers"]).output().map_err(|e| format!("{py}: {e}"))?;
    if !probe.status.success() {
        return Err(format!("{py} cannot import transformers (set PYTHON to a venv with scripts/ci-requirements.txt)"));
    }
    let out = Command::new(&py)
        .arg(&script)
        .arg("--json")
        .arg(format!("--runs={runs}"))
        .output()
        .map_err(|e| format!("{py}: {e}"))?;
    if !out.status.success() {
        return Err(format!("bench_reference.py failed: {}", String::from_utf8_lossy(&out.stderr)));
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().rev().find(|l| l.starts_with('{')).ok_or("no JSON line from bench_reference.py")?;
    serde_json::from_str(line).map_err(|e| e.to_string())
}

fn main() {
    let runs: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(20);
    let mut tok1 = Tokenizer::from_file(fixtures().join("smollm2/tokenizer.json")).expect("tokenizer");
    tok1.set_encode_threads(1);
    let tok = Arc::new(Tokenizer::from_file(fixtures().join("smollm2/tokenizer.json")).expect("tokenizer"));
    let tmpl = ChatTemplate::new(&TemplateConfig {
        chat_template: std::fs::read_to_string(fixtures().join("qwen_style/chat_template.jinja")).expect("template"),
        special_tokens: vec![],
    })
    .expect("compiles");
    let (messages, tools) = support::conversation();
    let input = RenderInput { messages, tools: Some(tools), add_generation_prompt: true, ..Default::default() };
    let text = tmpl.render_text(&input).expect("renders");
    let ids = tok.encode(&text, false).expect("encodes").ids;
    let plain = tok.inner().encode_fast(text.as_str(), false).expect("encodes").get_ids().to_vec();
    assert_eq!(ids, plain, "segmented encode must equal HF encode_fast");
    println!("agent conversation: 200 messages, {} bytes, {} tokens", text.len(), ids.len());

    let once = || {
        let t = tmpl.render_text(&input).expect("renders");
        tok.encode(&t, false).expect("encodes").ids.len()
    };
    for _ in 0..3 {
        once();
    }
    let cold = time_n(runs, || {
        tok.clear_encode_cache();
        once();
    });
    let warm = time_n(runs, || {
        once();
    });
    let cold_1t = time_n(runs, || {
        tok1.clear_encode_cache();
        let t = tmpl.render_text(&input).expect("renders");
        tok1.encode(&t, false).expect("encodes");
    });
    let tok_cold_1t = time_n(runs, || {
        tok1.clear_encode_cache();
        tok1.encode(&text, false).expect("encodes");
    });
    let render = time_n(runs, || {
        tmpl.render_text(&input).expect("renders");
    });
    let tok_cold = time_n(runs, || {
        tok.clear_encode_cache();
        tok.encode(&text, false).expect("encodes");
    });
    let prepare_cold = time_n(runs.min(10), || {
        tok.clear_encode_cache();
        tmpl.clear_mark_cache();
        Prompt::prepare(&tmpl, &tok, &input).expect("prepares");
    });
    let prepare_warm = time_n(runs.min(10), || {
        Prompt::prepare(&tmpl, &tok, &input).expect("prepares");
    });
    let marks = time_n(runs.min(10), || {
        tmpl.clear_mark_cache();
        tmpl.render(&input).expect("renders");
    });
    let marks_warm = time_n(runs.min(10), || {
        tmpl.render(&input).expect("renders");
    });
    let p = Prompt::prepare(&tmpl, &tok, &input).expect("prepares");
    println!("rust render only:                    {render:8.3} ms");
    println!("rust tokenize only, cold:            {tok_cold:8.3} ms");
    println!("rust tokenize only, cold, 1 thread:  {tok_cold_1t:8.3} ms");
    println!("rust render+tokenize cold:           {cold:8.3} ms  (all caches cleared each iteration)");
    println!("rust render+tokenize cold, 1 thread: {cold_1t:8.3} ms");
    println!("rust render+tokenize warm:           {warm:8.3} ms  (segment + BPE caches warm)");
    println!(
        "rust render with marks cold / warm:  {marks:8.3} / {marks_warm:.3} ms  ({} marks; warm = prefix outcomes memoized)",
        p.message_ends.len()
    );
    println!(
        "rust Prompt::prepare cold / warm:    {prepare_cold:8.3} / {prepare_warm:.3} ms  ({} checkpoints)",
        p.checkpoints.len()
    );

    match python_reference(runs) {
        Ok(py) => {
            let pc = py["cold_ms"].as_f64().unwrap_or(f64::NAN);
            let pw = py["warm_ms"].as_f64().unwrap_or(f64::NAN);
            let same = py["tokens"].as_u64() == Some(ids.len() as u64) && py["ids_fnv"].as_u64() == Some(fnv1a(&ids));
            println!("python transformers cold:            {pc:8.3} ms  (HF BPE word cache cleared each iteration)");
            println!("python transformers warm:            {pw:8.3} ms  (HF BPE word cache warm)");
            println!("identical token ids (count + FNV):   {same}");
            println!("ratio cold (python cold / rust cold): {:7.1}x", pc / cold);
            println!("ratio cold, rust on 1 thread:         {:7.1}x", pc / cold_1t);
            println!("ratio warm (python warm / rust warm): {:7.1}x", pw / warm);
            println!("ratio prepare (python cold / rust Prompt::prepare cold): {:.1}x", pc / prepare_cold);
        }
        Err(e) => println!("python reference skipped, no ratio: {e}"),
    }

    // Grammar mask time per token, JSON schema over the DeepSeek 128K vocabulary.
    let ds = Arc::new(Tokenizer::from_file(fixtures().join("deepseek/tokenizer.json")).expect("tokenizer"));
    let eos = ds.token_id("<｜end▁of▁sentence｜>").expect("eos");
    let env = GrammarEnv::new(ds.clone(), &[eos]).expect("env");
    let schema = json!({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}, "required": ["city"]}},
        "required": ["name", "age"], "additionalProperties": false});
    let answer = r#"{"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"], "address": {"city": "London", "zip": "W1"}}"#;
    let aids = ds.encode(answer, false).expect("encodes").ids;
    let proto = OutputProtocol {
        reasoning: ReasoningParser::ThinkTags,
        tools: ToolParser::HermesJson,
        calls: helios_frontend::Calls::Optional,
        starts_in_reasoning: false,
    };
    let fmt = AnswerFormat::JsonSchema(schema);
    let mut per_token = Vec::new();
    for _ in 0..20 {
        let mut m = env.matcher(&fmt, &proto).expect("matcher");
        for &id in &aids {
            let t0 = Instant::now();
            let mask = m.compute_mask().expect("mask");
            assert!(mask.is_allowed(id));
            m.consume_token(id).expect("consume");
            per_token.push(t0.elapsed());
        }
    }
    let n = per_token.len();
    let mean = per_token.iter().sum::<Duration>().as_secs_f64() * 1e6 / n as f64;
    println!(
        "grammar mask+consume per token (128K vocab JSON schema): mean {mean:.1} µs, median {:.1} µs over {n}",
        median(per_token) * 1e3
    );
}
