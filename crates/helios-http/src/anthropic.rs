//! Anthropic Messages (`POST /v1/messages`), with its event stream and error envelope.

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use helios_frontend::{OutputDelta, ToolChoice};
use helios_worker::{ChatPrompt, FinishCause, GenerationInput, PromptInput};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value as Json, json};

use crate::AppState;
use crate::error::{ApiCode, ApiError, Flavor};
use crate::extract::{AnthropicEnvelope, ApiJson};
use crate::generate::{Api, ChoiceEnd, RequestLog, handle, start};
use crate::openai::check_model;
use crate::params::{self, RawSampling};
use crate::sse::{self, Frames, Protocol};

#[derive(Debug, Deserialize)]
pub(crate) struct MessagesRequest {
    pub model: String,
    pub messages: Vec<Json>,
    pub max_tokens: i64,
    pub system: Option<Json>,
    #[serde(default)]
    pub stream: bool,
    pub stop_sequences: Option<Vec<String>>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<f64>,
    pub tools: Option<Vec<Json>>,
    pub tool_choice: Option<Json>,
    pub thinking: Option<Json>,
}

fn bad(code: ApiCode, m: impl Into<String>) -> ApiError {
    ApiError::invalid(code, Some("messages"), m).flavor(Flavor::Anthropic)
}

/// Anthropic blocks → OpenAI-shaped template messages. These are the template's input, free
/// form (a client's extra fields pass through), so they stay JSON values.
fn convert_messages(system: Option<Json>, messages: Vec<Json>) -> Result<Vec<Json>, ApiError> {
    let mut out = Vec::new();
    if let Some(s) = system {
        let text = params::text_content(&s, "system").map_err(|e| e.flavor(Flavor::Anthropic))?;
        out.push(json!({"role": "system", "content": text.unwrap_or_default()}));
    }
    for (i, m) in messages.into_iter().enumerate() {
        let role = m.get("role").and_then(Json::as_str).unwrap_or_default().to_owned();
        if role != "user" && role != "assistant" {
            return Err(bad(ApiCode::InvalidRole, format!("messages[{i}].role must be user or assistant")));
        }
        let blocks = match m.get("content") {
            Some(Json::String(s)) => vec![json!({"type": "text", "text": s})],
            Some(Json::Array(b)) => b.clone(),
            _ => return Err(bad(ApiCode::InvalidContent, format!("messages[{i}].content must be a string or blocks"))),
        };
        let mut text = String::new();
        let mut reasoning: Option<String> = None;
        let mut calls = Vec::new();
        for b in blocks {
            match b.get("type").and_then(Json::as_str) {
                Some("text") => text.push_str(b.get("text").and_then(Json::as_str).unwrap_or_default()),
                Some("thinking") => reasoning
                    .get_or_insert_default()
                    .push_str(b.get("thinking").and_then(Json::as_str).unwrap_or_default()),
                Some("tool_use") if role == "assistant" => calls.push(json!({
                    "id": b.get("id").cloned().unwrap_or(Json::Null), "type": "function",
                    "function": {"name": b.get("name").cloned().unwrap_or(Json::Null),
                        "arguments": b.get("input").cloned().unwrap_or(json!({}))}})),
                Some("tool_result") if role == "user" => {
                    if !text.is_empty() {
                        out.push(json!({"role": "user", "content": std::mem::take(&mut text)}));
                    }
                    let content = b.get("content").cloned().unwrap_or(Json::String(String::new()));
                    let content =
                        params::text_content(&content, "messages").map_err(|e| e.flavor(Flavor::Anthropic))?;
                    out.push(
                        json!({"role": "tool", "tool_call_id": b.get("tool_use_id").cloned().unwrap_or(Json::Null),
                        "content": content.unwrap_or_default()}),
                    );
                }
                Some(other) => {
                    return Err(bad(
                        ApiCode::UnsupportedContent,
                        format!("content block type {other:?} is not supported here"),
                    ));
                }
                None => return Err(bad(ApiCode::InvalidContent, "content block lacks `type`")),
            }
        }
        if role == "assistant" {
            let mut msg = json!({"role": "assistant", "content": text});
            if let Some(r) = reasoning {
                msg["reasoning_content"] = json!(r);
            }
            if !calls.is_empty() {
                msg["tool_calls"] = Json::Array(calls);
            }
            out.push(msg);
        } else if !text.is_empty() {
            out.push(json!({"role": "user", "content": text}));
        }
    }
    if out.iter().all(|m| m["role"] == "system") {
        return Err(bad(ApiCode::EmptyMessages, "`messages` must not be empty"));
    }
    Ok(out)
}

/// Anthropic tools → the template's OpenAI-shaped tools (the client's schema passed through).
fn convert_tools(tools: Option<Vec<Json>>) -> Result<Vec<Json>, ApiError> {
    let tools = tools.unwrap_or_default();
    tools
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            let name = t.get("name").and_then(Json::as_str).filter(|n| !n.is_empty()).ok_or_else(|| {
                ApiError::invalid(ApiCode::InvalidTools, Some("tools"), format!("tools[{i}] lacks name"))
                    .flavor(Flavor::Anthropic)
            })?;
            Ok(json!({"type": "function", "function": {"name": name,
                "description": t.get("description").cloned().unwrap_or(json!("")),
                "parameters": t.get("input_schema").cloned().unwrap_or(json!({"type": "object"}))}}))
        })
        .collect()
}

fn convert_tool_choice(v: Option<&Json>, has_tools: bool) -> Result<ToolChoice, ApiError> {
    let choice = match v.and_then(|c| c.get("type")).and_then(Json::as_str) {
        None if has_tools => ToolChoice::Auto,
        None => ToolChoice::None,
        Some("auto") => ToolChoice::Auto,
        Some("none") => ToolChoice::None,
        Some("any") => ToolChoice::Required,
        Some("tool") => match v.and_then(|c| c.get("name")).and_then(Json::as_str) {
            Some(n) => ToolChoice::Named(n.to_owned()),
            None => {
                return Err(ApiError::invalid(
                    ApiCode::InvalidToolChoice,
                    Some("tool_choice"),
                    "tool_choice.name is required",
                )
                .flavor(Flavor::Anthropic));
            }
        },
        Some(other) => {
            return Err(ApiError::invalid(
                ApiCode::InvalidToolChoice,
                Some("tool_choice"),
                format!("unknown tool_choice type {other:?}"),
            )
            .flavor(Flavor::Anthropic));
        }
    };
    if !has_tools && !matches!(choice, ToolChoice::None) {
        return Err(ApiError::invalid(ApiCode::InvalidToolChoice, Some("tool_choice"), "tool_choice requires `tools`")
            .flavor(Flavor::Anthropic));
    }
    Ok(choice)
}

/// The chat prompt of a Messages request (shared by `/v1/messages` and `count_tokens`).
fn chat_prompt(
    system: Option<Json>,
    messages: Vec<Json>,
    tools: Option<Vec<Json>>,
    tool_choice: Option<Json>,
    thinking: Option<Json>,
) -> Result<ChatPrompt, ApiError> {
    let tools = convert_tools(tools)?;
    let tool_choice = convert_tool_choice(tool_choice.as_ref(), !tools.is_empty())?;
    let mut kwargs = serde_json::Map::new();
    if let Some(t) = &thinking {
        kwargs.insert("enable_thinking".into(), Json::Bool(t.get("type").and_then(Json::as_str) == Some("enabled")));
    }
    Ok(ChatPrompt {
        messages: convert_messages(system, messages)?,
        tools,
        tool_choice,
        continue_final_message: false,
        template_kwargs: kwargs,
    })
}

/// `POST /v1/messages/count_tokens` body: a Messages request without the generation fields
/// (which are ignored when sent).
#[derive(Debug, Deserialize)]
pub(crate) struct CountTokensRequest {
    pub model: String,
    pub messages: Vec<Json>,
    pub system: Option<Json>,
    pub tools: Option<Vec<Json>>,
    pub tool_choice: Option<Json>,
    pub thinking: Option<Json>,
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens": N}`, the prompt tokens a
/// `/v1/messages` request with this body reports in `usage.input_tokens` (same conversion,
/// template and tokenizer, on a preparation worker).
pub(crate) async fn count_tokens(
    State(state): State<AppState>,
    body: Result<ApiJson<CountTokensRequest, AnthropicEnvelope>, ApiError>,
) -> Response {
    let result: Result<TokenCount, ApiError> = async {
        let ApiJson(req, _) = body?;
        check_model(&state, &req.model, Flavor::Anthropic)?;
        // The worker renders it as generation would (offered tools, `tool_choice` instruction).
        let chat = chat_prompt(req.system, req.messages, req.tools, req.tool_choice, req.thinking)?;
        let prompt = PromptInput::Chat(chat);
        let tokens =
            state.engine.run_prep(move |f, cancel| helios_worker::tokenize(f, prompt, false, cancel)).await??;
        Ok(TokenCount { input_tokens: tokens.len() })
    }
    .await;
    match result {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.flavor(Flavor::Anthropic).into_response(),
    }
}

/// Anthropic `stop_reason` and `stop_sequence` (the string that matched).
fn stop_reason(end: &ChoiceEnd) -> (&'static str, Option<&str>) {
    match end.info.cause {
        FinishCause::Length | FinishCause::PoolExhausted => ("max_tokens", None),
        FinishCause::Stop => ("stop_sequence", end.stop_sequence.as_deref()),
        _ if !end.parsed.tool_calls.is_empty() => ("tool_use", None),
        _ => ("end_turn", None),
    }
}

fn tool_use_id(request_id: &str, i: usize) -> String {
    format!("toolu_{}_{i}", crate::generate::id_suffix(request_id))
}

/// `POST /v1/messages` (body rejections answered here, in the Anthropic envelope).
pub(crate) async fn messages(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<ApiJson<MessagesRequest, AnthropicEnvelope>, ApiError>,
) -> Response {
    handle(state, &headers, body, Api::Messages, ("msg_", Flavor::Anthropic), messages_inner).await
}

async fn messages_inner(
    state: AppState,
    req: MessagesRequest,
    request_id: String,
    log: RequestLog,
) -> Result<Response, ApiError> {
    let model = check_model(&state, &req.model, Flavor::Anthropic)?;
    let sampling = RawSampling {
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        max_tokens: Some(req.max_tokens),
        ..Default::default()
    }
    .validate("max_tokens")
    .map_err(|e| e.flavor(Flavor::Anthropic))?;
    let input = GenerationInput {
        request_id,
        prompt: PromptInput::Chat(chat_prompt(req.system, req.messages, req.tools, req.tool_choice, req.thinking)?),
        sampling,
        seed: None,
        n: 1,
        stop: req.stop_sequences.unwrap_or_default(),
        answer: helios_frontend::AnswerFormat::Text,
        ignore_eos: false,
    };
    log.set_stream(req.stream);
    let g = start(&state.engine, input, Flavor::Anthropic, &log).await?;
    if req.stream {
        let stream = MessagesStream {
            id: g.request_id.clone(),
            model,
            prompt_tokens: g.prompt_tokens,
            open: Open::None,
            block: 0,
        };
        return Ok(sse::respond(g, stream));
    }
    let id = g.request_id.clone();
    let end = g.collect_one().await?;
    let p = &end.parsed;
    let mut content = Vec::new();
    if let Some(r) = p.reasoning.as_deref().filter(|r| !r.is_empty()) {
        content.push(ContentBlock::Thinking { thinking: r, signature: Some("") });
    }
    if !p.content.is_empty() || p.tool_calls.is_empty() {
        content.push(ContentBlock::Text { text: &p.content });
    }
    for (i, c) in p.tool_calls.iter().enumerate() {
        let input = serde_json::from_str(&c.arguments).unwrap_or_else(|_| Json::Object(Map::new()));
        content.push(ContentBlock::ToolUse { id: tool_use_id(&id, i), name: &c.name, input });
    }
    let (reason, stop_sequence) = stop_reason(&end);
    let body = Message {
        id: &id,
        kind: "message",
        role: "assistant",
        model: &model,
        content,
        stop_reason: Some(reason),
        stop_sequence,
        usage: MessageUsage {
            input_tokens: end.info.prompt_tokens,
            output_tokens: end.info.generated,
            cache_read_input_tokens: Some(end.info.cached_tokens),
            cache_creation_input_tokens: Some(0),
        },
    };
    Ok(axum::Json(body).into_response())
}

/// Which content block of a Messages stream is open.
#[derive(PartialEq, Clone, Copy, Debug)]
enum Open {
    None,
    Thinking,
    Text,
    Tool(usize),
}

/// Messages streaming: `message_start`; each run of reasoning, text or one tool call as a
/// content block (start, deltas, stop); then `message_delta` and `message_stop`. A failure
/// is an `error` event in the Anthropic envelope.
#[derive(Debug)]
struct MessagesStream {
    id: String,
    model: String,
    prompt_tokens: u32,
    open: Open,
    /// The index of the open block, or of the next one.
    block: usize,
}

impl MessagesStream {
    fn send(out: &mut Frames, event: StreamEvent<'_>) {
        let kind = event.name();
        out.event(kind, &Typed { kind, event });
    }

    /// Makes `want` the open block: the open one stops, `start` starts.
    fn switch(&mut self, out: &mut Frames, want: Open, start: ContentBlock<'_>) {
        if self.open == want {
            return;
        }
        if self.open != Open::None {
            Self::send(out, StreamEvent::ContentBlockStop { index: self.block });
            self.block += 1;
        }
        Self::send(out, StreamEvent::ContentBlockStart { index: self.block, content_block: start });
        self.open = want;
    }
}

impl Protocol for MessagesStream {
    fn open(&mut self, out: &mut Frames) {
        let message = Message {
            id: &self.id,
            kind: "message",
            role: "assistant",
            model: &self.model,
            content: Vec::new(),
            stop_reason: None,
            stop_sequence: None,
            usage: MessageUsage {
                input_tokens: self.prompt_tokens,
                output_tokens: 0,
                cache_read_input_tokens: None,
                cache_creation_input_tokens: None,
            },
        };
        Self::send(out, StreamEvent::MessageStart { message });
    }

    fn delta(&mut self, _: u32, delta: OutputDelta, out: &mut Frames) {
        let delta = match &delta {
            OutputDelta::Reasoning(t) => {
                self.switch(out, Open::Thinking, ContentBlock::Thinking { thinking: "", signature: None });
                BlockDelta::Thinking { thinking: t }
            }
            OutputDelta::Content(t) => {
                self.switch(out, Open::Text, ContentBlock::Text { text: "" });
                BlockDelta::Text { text: t }
            }
            OutputDelta::ToolCallStart { index, name } => {
                let id = tool_use_id(&self.id, *index);
                let input = Json::Object(Map::new());
                self.switch(out, Open::Tool(*index), ContentBlock::ToolUse { id, name, input });
                return;
            }
            OutputDelta::ToolCallArguments { index, delta } if self.open == Open::Tool(*index) => {
                BlockDelta::InputJson { partial_json: delta }
            }
            OutputDelta::ToolCallArguments { .. } | OutputDelta::ToolCallEnd { .. } => return,
        };
        Self::send(out, StreamEvent::ContentBlockDelta { index: self.block, delta });
    }

    fn done(&mut self, _: u32, end: ChoiceEnd, out: &mut Frames) {
        // A message has at least one block.
        if self.open == Open::None {
            self.switch(out, Open::Text, ContentBlock::Text { text: "" });
        }
        Self::send(out, StreamEvent::ContentBlockStop { index: self.block });
        let (stop_reason, stop_sequence) = stop_reason(&end);
        Self::send(
            out,
            StreamEvent::MessageDelta {
                delta: MessageDelta { stop_reason, stop_sequence },
                usage: DeltaUsage { output_tokens: end.info.generated },
            },
        );
        Self::send(out, StreamEvent::MessageStop {});
    }

    fn failed(&mut self, error: ApiError, out: &mut Frames) {
        out.event("error", &error.flavor(Flavor::Anthropic).body());
    }
}

// The wire types. Field order is the order sent.

/// A message: the whole answer, or (empty, without stop reason or cache counts) the
/// stream's `message_start`.
#[derive(Debug, Serialize)]
struct Message<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    role: &'static str,
    model: &'a str,
    content: Vec<ContentBlock<'a>>,
    stop_reason: Option<&'static str>,
    stop_sequence: Option<&'a str>,
    usage: MessageUsage,
}

#[derive(Debug, Serialize)]
struct MessageUsage {
    input_tokens: u32,
    output_tokens: u32,
    /// In whole answers only.
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_read_input_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_creation_input_tokens: Option<u32>,
}

#[derive(Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum ContentBlock<'a> {
    Thinking {
        thinking: &'a str,
        /// Whole answers carry an empty one (nothing is signed); stream block starts none.
        #[serde(skip_serializing_if = "Option::is_none")]
        signature: Option<&'static str>,
    },
    Text {
        text: &'a str,
    },
    ToolUse {
        id: String,
        name: &'a str,
        /// Free-form: the call's arguments as parsed JSON (`{}` at a stream block's start).
        input: Json,
    },
}

#[derive(Debug, Serialize)]
#[serde(tag = "type")]
enum BlockDelta<'a> {
    #[serde(rename = "thinking_delta")]
    Thinking { thinking: &'a str },
    #[serde(rename = "text_delta")]
    Text { text: &'a str },
    #[serde(rename = "input_json_delta")]
    InputJson { partial_json: &'a str },
}

/// A Messages stream event; its `type` is its SSE event name ([`StreamEvent::name`]).
#[derive(Debug, Serialize)]
#[serde(untagged)]
enum StreamEvent<'a> {
    MessageStart { message: Message<'a> },
    ContentBlockStart { index: usize, content_block: ContentBlock<'a> },
    ContentBlockDelta { index: usize, delta: BlockDelta<'a> },
    ContentBlockStop { index: usize },
    MessageDelta { delta: MessageDelta<'a>, usage: DeltaUsage },
    MessageStop {},
}

impl StreamEvent<'_> {
    fn name(&self) -> &'static str {
        match self {
            StreamEvent::MessageStart { .. } => "message_start",
            StreamEvent::ContentBlockStart { .. } => "content_block_start",
            StreamEvent::ContentBlockDelta { .. } => "content_block_delta",
            StreamEvent::ContentBlockStop { .. } => "content_block_stop",
            StreamEvent::MessageDelta { .. } => "message_delta",
            StreamEvent::MessageStop {} => "message_stop",
        }
    }
}

/// A stream event as sent: `type` first, then the event's fields.
#[derive(Debug, Serialize)]
struct Typed<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    #[serde(flatten)]
    event: StreamEvent<'a>,
}

/// `stop_sequence` is `null` unless a stop sequence ended the message.
#[derive(Debug, Serialize)]
struct MessageDelta<'a> {
    stop_reason: &'static str,
    stop_sequence: Option<&'a str>,
}

#[derive(Debug, Serialize)]
struct DeltaUsage {
    output_tokens: u32,
}

/// The `count_tokens` answer.
#[derive(Debug, Serialize)]
struct TokenCount {
    input_tokens: usize,
}

#[cfg(test)]
mod tests {
    use serde_json::to_value;

    use super::*;

    fn typed(event: StreamEvent<'_>) -> Json {
        to_value(Typed { kind: event.name(), event }).expect("json")
    }

    #[test]
    fn message_delta_carries_the_stop_sequence_or_null() {
        let delta = |stop_reason, stop_sequence| StreamEvent::MessageDelta {
            delta: MessageDelta { stop_reason, stop_sequence },
            usage: DeltaUsage { output_tokens: 9 },
        };
        assert_eq!(
            typed(delta("stop_sequence", Some("##"))),
            json!({"type": "message_delta", "delta": {"stop_reason": "stop_sequence", "stop_sequence": "##"},
                "usage": {"output_tokens": 9}})
        );
        assert_eq!(
            typed(delta("end_turn", None)),
            json!({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": null},
                "usage": {"output_tokens": 9}})
        );
        assert_eq!(typed(StreamEvent::MessageStop {}), json!({"type": "message_stop"}));
    }

    #[test]
    fn message_start_has_nulls_and_no_cache_counts() {
        let message = Message {
            id: "msg_1",
            kind: "message",
            role: "assistant",
            model: "m",
            content: Vec::new(),
            stop_reason: None,
            stop_sequence: None,
            usage: MessageUsage {
                input_tokens: 4,
                output_tokens: 0,
                cache_read_input_tokens: None,
                cache_creation_input_tokens: None,
            },
        };
        assert_eq!(
            typed(StreamEvent::MessageStart { message }),
            json!({"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant",
                "model": "m", "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": 4, "output_tokens": 0}}})
        );
    }

    #[test]
    fn content_blocks_and_their_deltas() {
        let thinking = ContentBlock::Thinking { thinking: "", signature: None };
        assert_eq!(
            typed(StreamEvent::ContentBlockStart { index: 0, content_block: thinking }),
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": ""}})
        );
        let whole = ContentBlock::Thinking { thinking: "t", signature: Some("") };
        assert_eq!(to_value(whole).expect("json"), json!({"type": "thinking", "thinking": "t", "signature": ""}));
        let tool = ContentBlock::ToolUse { id: "toolu_x_0".into(), name: "f", input: Json::Object(Map::new()) };
        assert_eq!(
            typed(StreamEvent::ContentBlockStart { index: 2, content_block: tool }),
            json!({"type": "content_block_start", "index": 2,
                "content_block": {"type": "tool_use", "id": "toolu_x_0", "name": "f", "input": {}}})
        );
        let delta = BlockDelta::InputJson { partial_json: "{\"a" };
        assert_eq!(
            typed(StreamEvent::ContentBlockDelta { index: 2, delta }),
            json!({"type": "content_block_delta", "index": 2,
                "delta": {"type": "input_json_delta", "partial_json": "{\"a"}})
        );
        assert_eq!(
            typed(StreamEvent::ContentBlockStop { index: 2 }),
            json!({"type": "content_block_stop", "index": 2})
        );
    }
}
