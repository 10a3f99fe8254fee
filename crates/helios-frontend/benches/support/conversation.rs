//! The 200-message agent conversation shared by `benches/frontend.rs` and
//! `examples/frontend_vs_transformers.rs`; scripts/frontend/bench_reference.py builds
//! the same one in Python.

use serde_json::{Value, json};

pub(crate) const PARA: &str = "The agent inspects the repository, reads configuration files, runs the test-suite and reports findings — including Unicode like naïve café, 東京, and emoji 🚀✅. ";

/// Messages and tools, same construction as bench_reference.py.
pub(crate) fn conversation() -> (Vec<Value>, Vec<Value>) {
    let tools = vec![json!({"type": "function", "function": {"name": "run", "description": "Run a shell command.",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}})];
    let mut msgs = vec![json!({"role": "system", "content": "You are a coding agent."})];
    let mut i = 0;
    while msgs.len() < 200 {
        msgs.push(json!({"role": "user", "content": format!("Step {i}: {}", PARA.repeat(4))}));
        msgs.push(json!({"role": "assistant", "content": PARA.repeat(3), "tool_calls": [
            {"type": "function", "function": {"name": "run", "arguments": {"cmd": format!("cargo test --step {i}")}}}]}));
        msgs.push(json!({"role": "tool", "content": PARA.repeat(5)}));
        msgs.push(json!({"role": "assistant", "content": format!("Done with step {i}. {}", PARA)}));
        i += 1;
    }
    msgs.truncate(200);
    (msgs, tools)
}
