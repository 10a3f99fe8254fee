//! Preparation time (render with checkpoint marks + tokenize) against the message count,
//! 100 to 100,000 tiny messages, with the growth factor per 10x (linear work gives ~10).
//! `cargo bench -p helios-frontend --bench prep_scaling` (release).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use helios_frontend::{ChatTemplate, Prompt, RenderInput, TemplateConfig, Tokenizer};
use serde_json::json;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/frontend/smollm2")
}

fn main() {
    let tok = Tokenizer::from_file(fixtures().join("tokenizer.json")).expect("tokenizer");
    let config = std::fs::read_to_string(fixtures().join("tokenizer_config.json")).expect("config");
    let tmpl = ChatTemplate::new(&TemplateConfig::from_tokenizer_config(&config).expect("parses")).expect("compiles");
    println!("prepare (render + marks + tokenize), SmolLM2 template, cold mark memo; median of runs");
    println!("{:>9} {:>10} {:>9} {:>7} {:>12} {:>8}", "messages", "bytes", "tokens", "marks", "time", "x per 10x");
    let mut last: Option<Duration> = None;
    for n in [100usize, 1_000, 10_000, 100_000] {
        let messages = (0..n)
            .map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": format!("m{i}")}))
            .collect();
        let input = RenderInput { messages, add_generation_prompt: true, ..Default::default() };
        let runs = if n >= 100_000 { 3 } else { 7 };
        let mut times = Vec::with_capacity(runs);
        let mut shape = (0, 0, 0);
        for _ in 0..runs {
            tmpl.clear_mark_cache();
            tok.clear_encode_cache();
            let t0 = Instant::now();
            let p = Prompt::prepare(&tmpl, &tok, &input).expect("prepares");
            times.push(t0.elapsed());
            shape = (p.text.len(), p.ids.len(), p.message_ends.len());
        }
        times.sort_unstable();
        let t = times[times.len() / 2];
        let growth = last.map_or_else(|| "-".to_string(), |l| format!("{:.1}", t.as_secs_f64() / l.as_secs_f64()));
        println!("{n:>9} {:>10} {:>9} {:>7} {:>12?} {growth:>8}", shape.0, shape.1, shape.2, t);
        last = Some(t);
    }
}
