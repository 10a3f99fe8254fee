//! Anthropic Messages (`POST /v1/messages`), with its event stream and error envelope.

use std::convert::Infallible;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, StreamExt};
use helios_frontend::{OutputDelta, ToolChoice};
use helios_worker::{ChatPrompt, FinishCause, GenerationInput, PromptInput};
use serde::Deserialize;
use serde_json::{Value as Json, json};

use crate::AppState;
use crate::error::{ApiCode, ApiError, Flavor};
use crate::extract::{AnthropicEnvelope, ApiJson};
use crate::generate::{Api, ChoiceEnd, Piece, RequestLog, handle, logged, start};
use crate::openai::check_model;
use crate::params::{self, RawSampling};
use crate::sse::merged;

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

/// Anthropic blocks → OpenAI-shaped template messages.
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
        kwargs.insert("enable_thinking".into(), json!(t.get("type").and_then(Json::as_str) == Some("enabled")));
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
    let result: Result<Json, ApiError> = async {
        let ApiJson(req, _) = body?;
        check_model(&state, &req.model, Flavor::Anthropic)?;
        // The worker renders it as generation would (offered tools, `tool_choice` instruction).
        let chat = chat_prompt(req.system, req.messages, req.tools, req.tool_choice, req.thinking)?;
        let prompt = PromptInput::Chat(chat);
        let tokens =
            state.engine.run_prep(move |f, cancel| helios_worker::tokenize(f, prompt, false, cancel)).await??;
        Ok(json!({"input_tokens": tokens.len()}))
    }
    .await;
    match result {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.flavor(Flavor::Anthropic).into_response(),
    }
}

/// Anthropic `stop_reason` and `stop_sequence` (the string that matched).
fn stop_reason(end: &ChoiceEnd) -> (&'static str, Option<String>) {
    match end.info.cause {
        FinishCause::Length | FinishCause::PoolExhausted => ("max_tokens", None),
        FinishCause::Stop => ("stop_sequence", end.stop_sequence.clone()),
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
    if !req.stream {
        let Some(choice) = g.choices.into_iter().next() else {
            return Err(ApiError::from_request(&helios_worker::RequestError::ChannelClosed).flavor(Flavor::Anthropic));
        };
        let end = choice.collect().await?;
        let mut content = Vec::new();
        if let Some(r) = end.parsed.reasoning.as_ref().filter(|r| !r.is_empty()) {
            content.push(json!({"type": "thinking", "thinking": r, "signature": ""}));
        }
        if !end.parsed.content.is_empty() || end.parsed.tool_calls.is_empty() {
            content.push(json!({"type": "text", "text": end.parsed.content}));
        }
        for (i, c) in end.parsed.tool_calls.iter().enumerate() {
            let input: Json = serde_json::from_str(&c.arguments).unwrap_or(json!({}));
            content
                .push(json!({"type": "tool_use", "id": tool_use_id(&g.request_id, i), "name": c.name, "input": input}));
        }
        let (reason, seq) = stop_reason(&end);
        let body = json!({"id": g.request_id, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": seq,
            "usage": {"input_tokens": end.info.prompt_tokens, "output_tokens": end.info.generated,
                "cache_read_input_tokens": end.info.cached_tokens, "cache_creation_input_tokens": 0}});
        return Ok(axum::Json(body).into_response());
    }
    let ev = |name: &str, v: Json| Event::default().event(name).data(v.to_string());
    let start_event = ev(
        "message_start",
        json!({"type": "message_start", "message": {"id": g.request_id, "type": "message",
        "role": "assistant", "model": model, "content": [], "stop_reason": null, "stop_sequence": null,
        "usage": {"input_tokens": g.prompt_tokens, "output_tokens": 0}}}),
    );
    /// Which content block is open.
    #[derive(PartialEq, Clone, Copy)]
    enum Open {
        None,
        Thinking,
        Text,
        Tool(usize),
    }
    struct St {
        open: Open,
        block: usize,
        done: bool,
    }
    let request_id = g.request_id.clone();
    let pieces = merged(g.choices);
    let body = stream::unfold((pieces, St { open: Open::None, block: 0, done: false }), move |(mut pieces, mut st)| {
        let request_id = request_id.clone();
        async move {
            if st.done {
                return None;
            }
            let (_, ps) = pieces.next().await?;
            let mut out = Vec::new();
            let switch = |st: &mut St, out: &mut Vec<Event>, want: Open, start: Json| {
                if st.open == want {
                    return;
                }
                if st.open != Open::None {
                    out.push(ev("content_block_stop", json!({"type": "content_block_stop", "index": st.block})));
                    st.block += 1;
                }
                out.push(ev(
                    "content_block_start",
                    json!({"type": "content_block_start", "index": st.block, "content_block": start}),
                ));
                st.open = want;
            };
            for p in ps {
                match p {
                    Piece::Delta(OutputDelta::Reasoning(t)) => {
                        switch(&mut st, &mut out, Open::Thinking, json!({"type": "thinking", "thinking": ""}));
                        out.push(ev(
                            "content_block_delta",
                            json!({"type": "content_block_delta", "index": st.block,
                            "delta": {"type": "thinking_delta", "thinking": t}}),
                        ));
                    }
                    Piece::Delta(OutputDelta::Content(t)) => {
                        switch(&mut st, &mut out, Open::Text, json!({"type": "text", "text": ""}));
                        out.push(ev(
                            "content_block_delta",
                            json!({"type": "content_block_delta", "index": st.block,
                            "delta": {"type": "text_delta", "text": t}}),
                        ));
                    }
                    Piece::Delta(OutputDelta::ToolCallStart { index, name }) => {
                        switch(
                            &mut st,
                            &mut out,
                            Open::Tool(index),
                            json!({"type": "tool_use",
                            "id": tool_use_id(&request_id, index), "name": name, "input": {}}),
                        );
                    }
                    Piece::Delta(OutputDelta::ToolCallArguments { index, delta }) => {
                        if st.open == Open::Tool(index) {
                            out.push(ev(
                                "content_block_delta",
                                json!({"type": "content_block_delta", "index": st.block,
                                "delta": {"type": "input_json_delta", "partial_json": delta}}),
                            ));
                        }
                    }
                    Piece::Delta(OutputDelta::ToolCallEnd { .. }) => {}
                    Piece::Done(end) => {
                        if st.open == Open::None {
                            switch(&mut st, &mut out, Open::Text, json!({"type": "text", "text": ""}));
                        }
                        out.push(ev("content_block_stop", json!({"type": "content_block_stop", "index": st.block})));
                        let (reason, seq) = stop_reason(&end);
                        out.push(ev(
                            "message_delta",
                            json!({"type": "message_delta",
                            "delta": {"stop_reason": reason, "stop_sequence": seq},
                            "usage": {"output_tokens": end.info.generated}}),
                        ));
                        out.push(ev("message_stop", json!({"type": "message_stop"})));
                        st.done = true;
                    }
                    Piece::Failed(e) => {
                        out.push(ev("error", e.flavor(Flavor::Anthropic).body()));
                        st.done = true;
                        break;
                    }
                }
            }
            Some((out, (pieces, st)))
        }
    });
    let events = logged(stream::iter([start_event]).chain(body.flat_map(stream::iter)), g.log).map(Ok::<_, Infallible>);
    Ok(Sse::new(events).keep_alive(KeepAlive::default()).into_response())
}
