//! Output parsing: reasoning and tool calls, selected independently by enum, streamed.
//!
//! Whole-output parsing is the streaming parser fed everything at once, so streamed
//! deltas always concatenate to the whole result.

use helios_contract::{ReasoningParser, ToolParser};
use serde_json::Value as Json;

use crate::error::OutputError;

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";
const FN_OPEN: &str = "<function=";
const FN_CLOSE: &str = "</function>";
const PARAM_OPEN: &str = "<parameter=";
const PARAM_CLOSE: &str = "</parameter>";

/// One streamed piece of parsed output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OutputDelta {
    Content(String),
    Reasoning(String),
    /// A tool call's name is known.
    ToolCallStart {
        index: usize,
        name: String,
    },
    /// More of a tool call's JSON arguments text.
    ToolCallArguments {
        index: usize,
        delta: String,
    },
    /// The call is complete and valid.
    ToolCallEnd {
        index: usize,
    },
}

/// A completed tool call; `arguments` is JSON text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

/// Accumulated parse result.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParsedOutput {
    pub content: String,
    pub reasoning: Option<String>,
    pub tool_calls: Vec<ToolCall>,
}

/// How a request constrains tool use; checked after generation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    Auto,
    None,
    Required,
    Named(String),
}

impl ToolChoice {
    /// Tools the prompt offers: a named choice filters the declared definitions to that
    /// tool (no extra instruction or constraint); `None` offers none.
    pub fn offered_tools(&self, declared: &[Json]) -> Vec<Json> {
        let name_of = |t: &Json| t.get("function").unwrap_or(t).get("name").and_then(Json::as_str).map(str::to_string);
        match self {
            ToolChoice::None => Vec::new(),
            ToolChoice::Named(n) => declared.iter().filter(|t| name_of(t).as_deref() == Some(n)).cloned().collect(),
            ToolChoice::Auto | ToolChoice::Required => declared.to_vec(),
        }
    }

    /// The system-prompt instruction `tool_choice=required` adds; `None` otherwise.
    pub fn instruction(&self) -> Option<&'static str> {
        matches!(self, ToolChoice::Required).then_some("You must call at least one of the provided tools.")
    }
}

impl ParsedOutput {
    /// Validates the completed calls against the request's tool choice and the declared
    /// tool names.
    pub fn check_tool_choice(&self, choice: &ToolChoice, declared: &[String]) -> Result<(), OutputError> {
        for (index, c) in self.tool_calls.iter().enumerate() {
            let allowed = match choice {
                ToolChoice::Named(n) => &c.name == n,
                ToolChoice::None => false,
                _ => declared.contains(&c.name),
            };
            if !allowed {
                return Err(OutputError::UndeclaredTool { index, name: c.name.clone() });
            }
        }
        if matches!(choice, ToolChoice::Required | ToolChoice::Named(_)) && self.tool_calls.is_empty() {
            return Err(OutputError::NoRequiredToolCall);
        }
        Ok(())
    }
}

/// Length of the longest suffix of `buf` that is a proper prefix of `tag`.
fn partial_suffix(buf: &str, tag: &str) -> usize {
    (1..tag.len().min(buf.len() + 1))
        .rev()
        .find(|&n| buf.is_char_boundary(buf.len() - n) && buf.ends_with(&tag[..n]))
        .unwrap_or(0)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ReasonState {
    /// Output start: waiting to see whether it opens with `<think>`.
    Start,
    Reasoning,
    Content,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum XmlState {
    ExpectFunction,
    InFunction { first: bool },
    InParam { name: String, first: bool },
    AfterFunction,
}

#[derive(Clone, Debug)]
struct CallState {
    buf: String,
    /// Bytes of `buf` already processed (XML) / arguments bytes streamed (JSON).
    cursor: usize,
    name_sent: bool,
    args: String,
    xml: XmlState,
}

impl CallState {
    fn new() -> Self {
        CallState {
            buf: String::new(),
            cursor: 0,
            name_sent: false,
            args: String::new(),
            xml: XmlState::ExpectFunction,
        }
    }
}

/// Streaming output parser.
#[derive(Debug)]
pub struct OutputParser {
    tool: ToolParser,
    tools: Vec<Json>,
    rstate: ReasonState,
    rbuf: String,
    tbuf: String,
    call: Option<CallState>,
    out: ParsedOutput,
    failed: Option<OutputError>,
}

impl OutputParser {
    /// `tools` are the request's declared tools (used to type XML parameter values).
    /// `starts_in_reasoning`: the prompt already opened a reasoning block.
    pub fn new(reasoning: ReasoningParser, tool: ToolParser, tools: &[Json], starts_in_reasoning: bool) -> Self {
        let rstate = match reasoning {
            ReasoningParser::None => ReasonState::Content,
            ReasoningParser::ThinkTags if starts_in_reasoning => ReasonState::Reasoning,
            ReasoningParser::ThinkTags => ReasonState::Start,
        };
        let out =
            ParsedOutput { reasoning: (rstate == ReasonState::Reasoning).then(String::new), ..Default::default() };
        OutputParser {
            tool,
            tools: tools.to_vec(),
            rstate,
            rbuf: String::new(),
            tbuf: String::new(),
            call: None,
            out,
            failed: None,
        }
    }

    /// Like [`new`](Self::new), deciding `starts_in_reasoning` from the rendered prompt:
    /// true when its last `<think>` is not followed by `</think>`.
    pub fn for_prompt(reasoning: ReasoningParser, tool: ToolParser, tools: &[Json], prompt: &str) -> Self {
        let open = match (prompt.rfind(THINK_OPEN), prompt.rfind(THINK_CLOSE)) {
            (Some(o), Some(c)) => o > c,
            (Some(_), None) => true,
            _ => false,
        };
        Self::new(reasoning, tool, tools, open)
    }

    /// Parses a complete output.
    pub fn parse(
        reasoning: ReasoningParser,
        tool: ToolParser,
        tools: &[Json],
        starts_in_reasoning: bool,
        text: &str,
    ) -> Result<ParsedOutput, OutputError> {
        let mut p = Self::new(reasoning, tool, tools, starts_in_reasoning);
        p.push(text)?;
        p.finish()?;
        Ok(p.out)
    }

    /// Everything parsed so far.
    pub fn output(&self) -> &ParsedOutput {
        &self.out
    }

    /// Feeds decoded text. After an error the parser stays failed and repeats it.
    pub fn push(&mut self, text: &str) -> Result<Vec<OutputDelta>, OutputError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let mut deltas = Vec::new();
        let r = self.push_inner(text, &mut deltas);
        self.record(r, deltas)
    }

    /// Ends the output: flushes held text and reports unterminated constructs.
    pub fn finish(&mut self) -> Result<Vec<OutputDelta>, OutputError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let mut deltas = Vec::new();
        let r = self.finish_inner(&mut deltas);
        self.record(r, deltas)
    }

    fn record(
        &mut self,
        r: Result<(), OutputError>,
        deltas: Vec<OutputDelta>,
    ) -> Result<Vec<OutputDelta>, OutputError> {
        match r {
            Ok(()) => Ok(deltas),
            Err(e) => {
                self.failed = Some(e.clone());
                Err(e)
            }
        }
    }

    fn emit_reasoning(&mut self, s: &str, d: &mut Vec<OutputDelta>) {
        if !s.is_empty() {
            self.out.reasoning.get_or_insert_with(String::new).push_str(s);
            d.push(OutputDelta::Reasoning(s.to_string()));
        }
    }

    fn emit_content(&mut self, s: &str, d: &mut Vec<OutputDelta>) {
        if !s.is_empty() {
            self.out.content.push_str(s);
            d.push(OutputDelta::Content(s.to_string()));
        }
    }

    fn push_inner(&mut self, text: &str, d: &mut Vec<OutputDelta>) -> Result<(), OutputError> {
        self.rbuf.push_str(text);
        loop {
            match self.rstate {
                ReasonState::Start => {
                    if self.rbuf.starts_with(THINK_OPEN) {
                        self.rbuf.drain(..THINK_OPEN.len());
                        self.out.reasoning.get_or_insert_with(String::new);
                        self.rstate = ReasonState::Reasoning;
                    } else if THINK_OPEN.starts_with(self.rbuf.as_str()) {
                        return Ok(());
                    } else {
                        self.rstate = ReasonState::Content;
                    }
                }
                ReasonState::Reasoning => {
                    if let Some(p) = self.rbuf.find(THINK_CLOSE) {
                        let before = self.rbuf[..p].to_string();
                        self.emit_reasoning(&before, d);
                        self.rbuf.drain(..p + THINK_CLOSE.len());
                        self.rstate = ReasonState::Content;
                    } else {
                        let keep = partial_suffix(&self.rbuf, THINK_CLOSE);
                        let cut = self.rbuf.len() - keep;
                        let s = self.rbuf[..cut].to_string();
                        self.emit_reasoning(&s, d);
                        self.rbuf.drain(..cut);
                        return Ok(());
                    }
                }
                ReasonState::Content => {
                    let s = std::mem::take(&mut self.rbuf);
                    return self.push_content(&s, d);
                }
            }
        }
    }

    fn finish_inner(&mut self, d: &mut Vec<OutputDelta>) -> Result<(), OutputError> {
        match self.rstate {
            ReasonState::Start => {
                self.rstate = ReasonState::Content;
                let s = std::mem::take(&mut self.rbuf);
                self.push_content(&s, d)?;
            }
            ReasonState::Reasoning => {
                // Output ended inside reasoning: report what was reasoned, no answer.
                let s = std::mem::take(&mut self.rbuf);
                self.emit_reasoning(&s, d);
                return Ok(());
            }
            ReasonState::Content => {}
        }
        if self.call.is_some() {
            return Err(OutputError::UnterminatedToolCall { index: self.out.tool_calls.len() });
        }
        let s = std::mem::take(&mut self.tbuf);
        self.emit_content(&s, d);
        Ok(())
    }

    fn push_content(&mut self, text: &str, d: &mut Vec<OutputDelta>) -> Result<(), OutputError> {
        if self.tool == ToolParser::None {
            self.emit_content(text, d);
            return Ok(());
        }
        self.tbuf.push_str(text);
        loop {
            if self.call.is_none() {
                if let Some(p) = self.tbuf.find(CALL_OPEN) {
                    let before = self.tbuf[..p].to_string();
                    self.emit_content(&before, d);
                    self.tbuf.drain(..p + CALL_OPEN.len());
                    self.call = Some(CallState::new());
                } else {
                    let keep = partial_suffix(&self.tbuf, CALL_OPEN);
                    let cut = self.tbuf.len() - keep;
                    let s = self.tbuf[..cut].to_string();
                    self.emit_content(&s, d);
                    self.tbuf.drain(..cut);
                    return Ok(());
                }
            }
            let index = self.out.tool_calls.len();
            let mut call = self.call.take().unwrap_or_else(CallState::new);
            let rest = std::mem::take(&mut self.tbuf);
            call.buf.push_str(&rest);
            let close = match self.tool {
                ToolParser::Qwen3CoderXml => call.buf.find(CALL_CLOSE),
                _ => json_close_at(&call.buf),
            };
            if let Some(p) = close {
                self.tbuf = call.buf[p + CALL_CLOSE.len()..].to_string();
                call.buf.truncate(p);
                let tc = match self.tool {
                    ToolParser::Qwen3CoderXml => self.xml_step(index, &mut call, true, d)?,
                    _ => self.json_close(index, &mut call, d)?,
                };
                d.push(OutputDelta::ToolCallEnd { index });
                self.out.tool_calls.push(tc);
            } else {
                let safe = call.buf.len() - partial_suffix(&call.buf, CALL_CLOSE);
                match self.tool {
                    ToolParser::Qwen3CoderXml => {
                        let full = std::mem::take(&mut call.buf);
                        call.buf = full[..safe].to_string();
                        self.xml_step(index, &mut call, false, d)?;
                        call.buf = full;
                    }
                    _ => json_stream(index, &mut call, safe, d),
                }
                self.call = Some(call);
                return Ok(());
            }
        }
    }

    fn json_close(
        &self,
        index: usize,
        call: &mut CallState,
        d: &mut Vec<OutputDelta>,
    ) -> Result<ToolCall, OutputError> {
        #[derive(serde::Deserialize)]
        struct Call<'a> {
            name: Option<Json>,
            #[serde(borrow, alias = "parameters")]
            arguments: Option<&'a serde_json::value::RawValue>,
        }
        let body = call.buf.trim();
        let parsed: Call<'_> =
            serde_json::from_str(body).map_err(|e| OutputError::InvalidToolJson { index, detail: e.to_string() })?;
        let name = match parsed.name {
            Some(Json::String(s)) => s,
            _ => return Err(OutputError::MissingToolName { index }),
        };
        let args = parsed.arguments.map(|r| r.get().to_string()).unwrap_or_else(|| "{}".into());
        if !call.name_sent {
            d.push(OutputDelta::ToolCallStart { index, name: name.clone() });
        }
        if !args.starts_with(&call.args) {
            return Err(OutputError::MalformedToolCall { index, detail: "streamed arguments diverged".into() });
        }
        let rest = &args[call.args.len()..];
        if !rest.is_empty() {
            d.push(OutputDelta::ToolCallArguments { index, delta: rest.to_string() });
        }
        Ok(ToolCall { name, arguments: args })
    }

    fn param_type(&self, func: &str, param: &str) -> Option<String> {
        self.tools.iter().find_map(|t| {
            let f = t.get("function").unwrap_or(t);
            if f.get("name").and_then(Json::as_str) != Some(func) {
                return None;
            }
            f.get("parameters")?.get("properties")?.get(param)?.get("type")?.as_str().map(str::to_string)
        })
    }

    /// Advances the XML state machine over `call.buf[call.cursor..]`.
    fn xml_step(
        &self,
        index: usize,
        call: &mut CallState,
        closing: bool,
        d: &mut Vec<OutputDelta>,
    ) -> Result<ToolCall, OutputError> {
        let malformed = |detail: &str| OutputError::MalformedToolCall { index, detail: detail.to_string() };
        loop {
            let rest = &call.buf[call.cursor..];
            let trimmed = rest.trim_start();
            let ws = rest.len() - trimmed.len();
            match call.xml.clone() {
                XmlState::ExpectFunction => {
                    if let Some(after) = trimmed.strip_prefix(FN_OPEN) {
                        let Some(gt) = after.find('>') else {
                            if closing {
                                return Err(malformed("unterminated <function="));
                            }
                            break;
                        };
                        let name = after[..gt].trim().to_string();
                        if name.is_empty() {
                            return Err(OutputError::MissingToolName { index });
                        }
                        call.cursor += ws + FN_OPEN.len() + gt + 1;
                        d.push(OutputDelta::ToolCallStart { index, name: name.clone() });
                        d.push(OutputDelta::ToolCallArguments { index, delta: "{".into() });
                        call.args = format!("{name}\u{0}{{");
                        call.name_sent = true;
                        call.xml = XmlState::InFunction { first: true };
                    } else if FN_OPEN.starts_with(trimmed) && !closing {
                        break;
                    } else {
                        return Err(malformed("expected <function=name>"));
                    }
                }
                XmlState::InFunction { first } => {
                    if let Some(after) = trimmed.strip_prefix(PARAM_OPEN) {
                        let Some(gt) = after.find('>') else {
                            if closing {
                                return Err(malformed("unterminated <parameter="));
                            }
                            break;
                        };
                        let name = after[..gt].trim().to_string();
                        call.cursor += ws + PARAM_OPEN.len() + gt + 1;
                        call.xml = XmlState::InParam { name, first };
                    } else if trimmed.starts_with(FN_CLOSE) {
                        call.cursor += ws + FN_CLOSE.len();
                        d.push(OutputDelta::ToolCallArguments { index, delta: "}".into() });
                        call.args.push('}');
                        call.xml = XmlState::AfterFunction;
                    } else if !closing && (PARAM_OPEN.starts_with(trimmed) || FN_CLOSE.starts_with(trimmed)) {
                        break;
                    } else if closing && trimmed.is_empty() {
                        // Lenient: a missing </function> before </tool_call>.
                        d.push(OutputDelta::ToolCallArguments { index, delta: "}".into() });
                        call.args.push('}');
                        call.xml = XmlState::AfterFunction;
                    } else {
                        return Err(malformed("expected <parameter=name> or </function>"));
                    }
                }
                XmlState::InParam { name, first } => {
                    let end = rest
                        .find(PARAM_CLOSE)
                        .map(|p| (p, PARAM_CLOSE.len()))
                        .or_else(|| rest.find(FN_CLOSE).map(|p| (p, 0)).or(closing.then_some((rest.len(), 0))));
                    let Some((p, skip)) = end else { break };
                    let raw = &rest[..p];
                    let raw = raw.strip_prefix('\n').unwrap_or(raw);
                    let raw = raw.strip_suffix('\n').unwrap_or(raw);
                    let func = call.args.split('\u{0}').next().unwrap_or_default().to_string();
                    let value = match self.param_type(&func, &name).as_deref() {
                        None | Some("string") => Json::String(raw.to_string()),
                        Some(_) => {
                            serde_json::from_str::<Json>(raw.trim()).unwrap_or_else(|_| Json::String(raw.to_string()))
                        }
                    };
                    let key = serde_json::to_string(&name).unwrap_or_default();
                    let val = serde_json::to_string(&value).unwrap_or_default();
                    let piece = format!("{}{key}:{val}", if first { "" } else { "," });
                    call.args.push_str(&piece);
                    d.push(OutputDelta::ToolCallArguments { index, delta: piece });
                    call.cursor += p + skip;
                    call.xml = XmlState::InFunction { first: false };
                }
                XmlState::AfterFunction => {
                    if closing {
                        if !trimmed.is_empty() {
                            return Err(malformed("text after </function>"));
                        }
                    } else if !trimmed.is_empty() {
                        return Err(malformed("text after </function>"));
                    }
                    break;
                }
            }
        }
        if closing && call.xml != XmlState::AfterFunction {
            return Err(malformed("incomplete function"));
        }
        let (name, args) = call.args.split_once('\u{0}').unwrap_or(("", ""));
        Ok(ToolCall { name: name.to_string(), arguments: args.to_string() })
    }
}

/// Where a JSON call's closing tag is: the first `</tool_call>` before which the body is not an
/// unfinished JSON value. The tag's text may appear inside a string of the arguments (a tool
/// that writes markup), where it closes nothing.
fn json_close_at(buf: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(i) = buf[from..].find(CALL_CLOSE) {
        let p = from + i;
        let body = buf[..p].trim();
        if body.is_empty() {
            return Some(p); // an empty call closes here (and fails as such)
        }
        match serde_json::from_str::<serde::de::IgnoredAny>(body) {
            Err(e) if e.is_eof() => from = p + CALL_CLOSE.len(),
            _ => return Some(p),
        }
    }
    None
}

/// Streams Hermes JSON arguments once `{"name": "...", "arguments": ` has been seen.
fn json_stream(index: usize, call: &mut CallState, safe: usize, d: &mut Vec<OutputDelta>) {
    let body = &call.buf[..safe];
    let Some((name, args_start)) = hermes_head(body) else { return };
    if !call.name_sent {
        call.name_sent = true;
        d.push(OutputDelta::ToolCallStart { index, name });
    }
    let args = &body[args_start..];
    // Hold back trailing whitespace and one closing brace (the outer object's).
    let t = args.trim_end();
    let t = t.strip_suffix('}').map(str::trim_end).unwrap_or(t);
    let end = t.len();
    if end > call.args.len() && t.starts_with(&call.args) {
        let delta = t[call.args.len()..].to_string();
        call.args.push_str(&delta);
        d.push(OutputDelta::ToolCallArguments { index, delta });
    }
}

/// Parses `{ "name": <string>, "arguments": ` and returns the name and the byte offset
/// where the arguments value starts.
fn hermes_head(body: &str) -> Option<(String, usize)> {
    let b = body.as_bytes();
    let mut i = 0;
    let ws = |i: &mut usize| {
        while *i < b.len() && b[*i].is_ascii_whitespace() {
            *i += 1;
        }
    };
    let string = |i: &mut usize| -> Option<String> {
        if b.get(*i) != Some(&b'"') {
            return None;
        }
        let mut j = *i + 1;
        while j < b.len() {
            match b[j] {
                b'\\' => j += 2,
                b'"' => {
                    let s: String = serde_json::from_str(body.get(*i..=j)?).ok()?;
                    *i = j + 1;
                    return Some(s);
                }
                _ => j += 1,
            }
        }
        None
    };
    ws(&mut i);
    (b.get(i) == Some(&b'{')).then_some(())?;
    i += 1;
    ws(&mut i);
    (string(&mut i)? == "name").then_some(())?;
    ws(&mut i);
    (b.get(i) == Some(&b':')).then_some(())?;
    i += 1;
    ws(&mut i);
    let name = string(&mut i)?;
    ws(&mut i);
    (b.get(i) == Some(&b',')).then_some(())?;
    i += 1;
    ws(&mut i);
    let key = string(&mut i)?;
    (key == "arguments" || key == "parameters").then_some(())?;
    ws(&mut i);
    (b.get(i) == Some(&b':')).then_some(())?;
    i += 1;
    ws(&mut i);
    (i < b.len()).then_some((name, i))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn collect(deltas: &[OutputDelta]) -> ParsedOutput {
        let mut out = ParsedOutput::default();
        let mut args: Vec<(String, String)> = Vec::new();
        for d in deltas {
            match d {
                OutputDelta::Content(s) => out.content.push_str(s),
                OutputDelta::Reasoning(s) => out.reasoning.get_or_insert_with(String::new).push_str(s),
                OutputDelta::ToolCallStart { name, .. } => args.push((name.clone(), String::new())),
                OutputDelta::ToolCallArguments { index, delta } => args[*index].1.push_str(delta),
                OutputDelta::ToolCallEnd { .. } => {}
            }
        }
        out.tool_calls = args.into_iter().map(|(name, arguments)| ToolCall { name, arguments }).collect();
        out
    }

    fn stream(
        r: ReasoningParser,
        t: ToolParser,
        tools: &[Json],
        text: &str,
        step: usize,
    ) -> Result<ParsedOutput, OutputError> {
        let mut p = OutputParser::new(r, t, tools, false);
        let mut deltas = Vec::new();
        let chars: Vec<char> = text.chars().collect();
        for chunk in chars.chunks(step.max(1)) {
            deltas.extend(p.push(&chunk.iter().collect::<String>())?);
        }
        deltas.extend(p.finish()?);
        let mut c = collect(&deltas);
        if p.output().reasoning.is_some() && c.reasoning.is_none() {
            c.reasoning = Some(String::new());
        }
        assert_eq!(&c, p.output());
        Ok(c)
    }

    const HERMES: &str = "<think>Let me check 🌦.</think>\n\nSure.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\", \"days\": [1, 2]}}\n</tool_call>\n<tool_call>\n{\"name\": \"time\", \"arguments\": {}}\n</tool_call>";

    #[test]
    fn hermes_streaming_matches_whole() {
        let whole = OutputParser::parse(ReasoningParser::ThinkTags, ToolParser::HermesJson, &[], false, HERMES)
            .expect("parses");
        assert_eq!(whole.reasoning.as_deref(), Some("Let me check 🌦."));
        assert_eq!(whole.content, "\n\nSure.\n");
        assert_eq!(whole.tool_calls.len(), 2);
        assert_eq!(whole.tool_calls[0].arguments, "{\"city\": \"Zürich\", \"days\": [1, 2]}");
        assert_eq!(whole.tool_calls[1], ToolCall { name: "time".into(), arguments: "{}".into() });
        for step in 1..8 {
            assert_eq!(
                stream(ReasoningParser::ThinkTags, ToolParser::HermesJson, &[], HERMES, step).expect("parses"),
                whole
            );
        }
    }

    #[test]
    fn qwen3_coder_xml() {
        let tools = vec![
            json!({"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"n":{"type":"integer"},"s":{"type":"string"}}}}}),
        ];
        let text = "ok<tool_call>\n<function=f>\n<parameter=n>\n42\n</parameter>\n<parameter=s>\nline1\nline2\n</parameter>\n</function>\n</tool_call>";
        let whole =
            OutputParser::parse(ReasoningParser::None, ToolParser::Qwen3CoderXml, &tools, false, text).expect("parses");
        assert_eq!(whole.content, "ok");
        assert_eq!(
            whole.tool_calls,
            vec![ToolCall { name: "f".into(), arguments: "{\"n\":42,\"s\":\"line1\\nline2\"}".into() }]
        );
        for step in 1..6 {
            assert_eq!(
                stream(ReasoningParser::None, ToolParser::Qwen3CoderXml, &tools, text, step).expect("parses"),
                whole
            );
        }
    }

    #[test]
    fn malformed_is_typed() {
        let r = OutputParser::parse(
            ReasoningParser::None,
            ToolParser::HermesJson,
            &[],
            false,
            "<tool_call>{\"name\": 1}</tool_call>",
        );
        assert_eq!(r, Err(OutputError::MissingToolName { index: 0 }));
        let r = OutputParser::parse(
            ReasoningParser::None,
            ToolParser::HermesJson,
            &[],
            false,
            "<tool_call>{oops</tool_call>",
        );
        assert!(matches!(r, Err(OutputError::InvalidToolJson { index: 0, .. })));
        let r = OutputParser::parse(ReasoningParser::None, ToolParser::HermesJson, &[], false, "<tool_call>{\"name\":");
        assert_eq!(r, Err(OutputError::UnterminatedToolCall { index: 0 }));
        let r = OutputParser::parse(
            ReasoningParser::None,
            ToolParser::Qwen3CoderXml,
            &[],
            false,
            "<tool_call>junk</tool_call>",
        );
        assert!(matches!(r, Err(OutputError::MalformedToolCall { .. })));
    }

    #[test]
    fn a_closing_tag_inside_a_json_string_closes_nothing() {
        let text = "<tool_call>\n{\"name\": \"write\", \"arguments\": {\"text\": \"a </tool_call> b\"}}\n</tool_call>";
        let mut whole = OutputParser::new(ReasoningParser::None, ToolParser::HermesJson, &[], false);
        let mut d = whole.push(text).expect("parses");
        d.extend(whole.finish().expect("finishes"));
        let out = whole.output();
        assert_eq!(out.tool_calls.len(), 1, "{d:?}");
        assert_eq!(out.tool_calls[0].arguments, "{\"text\": \"a </tool_call> b\"}");
        // Split anywhere, the same.
        for cut in 1..text.len() {
            if !text.is_char_boundary(cut) {
                continue;
            }
            let mut p = OutputParser::new(ReasoningParser::None, ToolParser::HermesJson, &[], false);
            p.push(&text[..cut]).expect("parses");
            p.push(&text[cut..]).expect("parses");
            p.finish().expect("finishes");
            assert_eq!(p.output().tool_calls, out.tool_calls, "cut {cut}");
        }
    }

    #[test]
    fn reasoning_open_from_prompt_and_tool_choice() {
        let p = OutputParser::for_prompt(
            ReasoningParser::ThinkTags,
            ToolParser::None,
            &[],
            "<|im_start|>assistant\n<think>\n",
        );
        let mut p = p;
        let mut d = p.push("hmm</think>answer").expect("ok");
        d.extend(p.finish().expect("ok"));
        assert_eq!(d, vec![OutputDelta::Reasoning("hmm".into()), OutputDelta::Content("answer".into())]);
        let out = p.output().clone();
        assert_eq!(out.check_tool_choice(&ToolChoice::Required, &[]), Err(OutputError::NoRequiredToolCall));
        assert_eq!(out.check_tool_choice(&ToolChoice::Auto, &[]), Ok(()));
    }

    proptest::proptest! {
        #[test]
        fn never_panics(s in "(<tool_call>|</tool_call>|<think>|</think>|<function=f>|<parameter=x>|</parameter>|</function>|[{}\":, a-z0-9\\n]){0,30}", step in 1usize..5) {
            for t in [ToolParser::None, ToolParser::HermesJson, ToolParser::Qwen3CoderXml] {
                let whole = OutputParser::parse(ReasoningParser::ThinkTags, t, &[], false, &s);
                let streamed = stream(ReasoningParser::ThinkTags, t, &[], &s, step);
                if let (Ok(a), Ok(b)) = (&whole, &streamed) { proptest::prop_assert_eq!(a, b); }
            }
        }
    }
}
