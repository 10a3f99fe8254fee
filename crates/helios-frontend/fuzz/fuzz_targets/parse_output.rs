#![no_main]
//! Output parsers: whole and streamed (split at a fuzzed point) never panic and agree.

use helios_contract::{ReasoningParser, ToolParser};
use helios_frontend::OutputParser;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&sel, rest)) = data.split_first() else { return };
    let Ok(text) = std::str::from_utf8(rest) else { return };
    let reasoning = if sel & 1 == 0 { ReasoningParser::None } else { ReasoningParser::ThinkTags };
    let tool = match (sel >> 1) % 3 {
        0 => ToolParser::None,
        1 => ToolParser::HermesJson,
        _ => ToolParser::Qwen3CoderXml,
    };
    let whole = OutputParser::parse(reasoning, tool, &[], sel & 8 != 0, text);
    let mut split = (sel as usize * 7) % (text.len() + 1);
    while !text.is_char_boundary(split) {
        split -= 1;
    }
    let mut p = OutputParser::new(reasoning, tool, &[], sel & 8 != 0);
    let streamed = p.push(&text[..split]).and_then(|_| p.push(&text[split..])).and_then(|_| p.finish()).map(|_| p.output().clone());
    if let (Ok(a), Ok(b)) = (whole, streamed) {
        assert_eq!(a, b);
    }
});
