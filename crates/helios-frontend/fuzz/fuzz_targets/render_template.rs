#![no_main]
//! Template renderer inputs: arbitrary template source and conversation JSON never panic;
//! marks keep their invariants.

use helios_frontend::{ChatTemplate, RenderInput, TemplateConfig};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else { return };
    let (src, conv) = s.split_once('\0').unwrap_or((s, "[]"));
    let Ok(t) = ChatTemplate::new(&TemplateConfig { chat_template: src.to_string(), special_tokens: vec![] }) else { return };
    let messages = match serde_json::from_str::<serde_json::Value>(conv) {
        Ok(serde_json::Value::Array(a)) => a,
        _ => return,
    };
    for (gen_prompt, cont) in [(true, false), (false, true)] {
        let input = RenderInput { messages: messages.clone(), add_generation_prompt: gen_prompt, continue_final_message: cont, now_unix: Some(0), ..Default::default() };
        if let Ok(r) = t.render(&input) {
            assert!(r.message_ends.windows(2).all(|w| w[0] < w[1]));
            assert!(r.message_ends.iter().all(|&e| e > 0 && e < r.text.len() && r.text.is_char_boundary(e)));
        }
    }
});
