//! Prompt bytes, token ids and decodes must equal Transformers' (see
//! scripts/frontend/reference.py, which writes the fixture).

use std::collections::HashMap;
use std::path::PathBuf;

use helios_frontend::{ChatTemplate, Prompt, RenderInput, TemplateConfig, Tokenizer};
use serde_json::Value;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/frontend")
}

fn template(name: &str) -> ChatTemplate {
    let dir = fixtures();
    let cfg = match name {
        "smollm2" => TemplateConfig::from_tokenizer_config(
            &std::fs::read_to_string(dir.join("smollm2/tokenizer_config.json")).expect("config"),
        )
        .expect("parses"),
        _ => TemplateConfig {
            chat_template: std::fs::read_to_string(dir.join(name).join("chat_template.jinja")).expect("template"),
            special_tokens: vec![],
        },
    };
    ChatTemplate::new(&cfg).expect("compiles")
}

#[test]
fn matches_transformers() {
    let data: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("differential.json")).expect("fixture"))
            .expect("json");
    let cases = data["cases"].as_array().expect("cases");
    assert!(cases.len() >= 50);
    let mut toks: HashMap<String, Tokenizer> = HashMap::new();
    let mut tmpls: HashMap<String, ChatTemplate> = HashMap::new();
    let mut checked_marks = 0;
    for case in cases {
        let name = case["name"].as_str().expect("name");
        let tk = case["tokenizer"].as_str().expect("tokenizer").to_string();
        let tm = case["template"].as_str().expect("template").to_string();
        let tok = toks
            .entry(tk.clone())
            .or_insert_with(|| Tokenizer::from_file(fixtures().join(&tk).join("tokenizer.json")).expect("tokenizer"));
        let tmpl = tmpls.entry(tm.clone()).or_insert_with(|| template(&tm));
        let inp = &case["input"];
        let input = RenderInput {
            messages: inp["messages"].as_array().expect("messages").clone(),
            tools: inp["tools"].as_array().cloned(),
            add_generation_prompt: inp["add_generation_prompt"].as_bool().unwrap_or(false),
            continue_final_message: inp["continue_final_message"].as_bool().unwrap_or(false),
            extra: inp["extra"].as_object().cloned().unwrap_or_default(),
            now_unix: None,
        };
        let p = Prompt::prepare(tmpl, tok, &input).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(p.text, case["text"].as_str().expect("text"), "{name}: prompt bytes");
        let ids: Vec<u32> =
            case["ids"].as_array().expect("ids").iter().map(|v| v.as_u64().expect("id") as u32).collect();
        assert_eq!(p.ids, ids, "{name}: token ids");
        assert_eq!(
            tok.decode(&ids, false).expect("decode"),
            case["decoded"].as_str().expect("decoded"),
            "{name}: decode"
        );
        assert_eq!(
            tok.decode(&ids, true).expect("decode"),
            case["decoded_skip_special"].as_str().expect("decoded"),
            "{name}: decode skip special"
        );
        // Every checkpoint is an exact token cut at a message end.
        for &k in &p.checkpoints {
            assert!(k > 0 && k < p.ids.len());
            let bytes: Vec<u8> = p.ids[..k].iter().flat_map(|&i| tok.token_bytes(i).expect("id").to_vec()).collect();
            assert!(p.message_ends.contains(&bytes.len()), "{name}: checkpoint {k}");
            assert_eq!(&p.text.as_bytes()[..bytes.len()], &bytes[..], "{name}: checkpoint {k} prefix");
            checked_marks += 1;
        }
        let msgs = input.messages.len();
        assert!(!p.checkpoints.is_empty() || msgs <= 1, "{name}: no checkpoints for {msgs} messages");
    }
    assert!(checked_marks > 100);
}
