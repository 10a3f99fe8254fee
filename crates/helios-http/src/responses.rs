//! OpenAI Responses (`POST /v1/responses`): text and function-call output items; streamed
//! as `response.*` events, failures as `response.failed`.

use std::convert::Infallible;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, StreamExt};
use helios_frontend::OutputDelta;
use helios_worker::{ChatPrompt, FinishCause, GenerationInput, PromptInput};
use serde::Deserialize;
use serde_json::{Value as Json, json};

use crate::AppState;
use crate::error::{ApiCode, ApiError, Flavor};
use crate::extract::ApiJson;
use crate::generate::{Api, ChoiceEnd, Piece, RequestLog, handle, logged, start, unix_now};
use crate::openai::check_model;
use crate::params::{self, RawSampling};
use crate::sse::merged;

#[derive(Debug, Deserialize)]
pub(crate) struct ResponsesRequest {
    pub model: String,
    pub input: Json,
    pub instructions: Option<String>,
    #[serde(default)]
    pub stream: bool,
    pub max_output_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub tools: Option<Vec<Json>>,
    pub tool_choice: Option<Json>,
    pub text: Option<Json>,
    pub previous_response_id: Option<String>,
}

fn bad(m: impl Into<String>) -> ApiError {
    ApiError::invalid(ApiCode::InvalidInput, Some("input"), m)
}

/// Response input items → template messages.
fn convert_input(instructions: Option<String>, input: Json) -> Result<Vec<Json>, ApiError> {
    let mut out = Vec::new();
    if let Some(i) = instructions {
        out.push(json!({"role": "system", "content": i}));
    }
    match input {
        Json::String(s) => out.push(json!({"role": "user", "content": s})),
        Json::Array(items) => {
            for (i, item) in items.into_iter().enumerate() {
                let kind = item.get("type").and_then(Json::as_str).unwrap_or("message");
                match kind {
                    "message" => {
                        let role = item.get("role").and_then(Json::as_str).unwrap_or("user");
                        let role = if role == "developer" { "system" } else { role };
                        let content = params::text_content(item.get("content").unwrap_or(&Json::Null), "input")?;
                        out.push(json!({"role": role, "content": content.unwrap_or_default()}));
                    }
                    "function_call" => {
                        let args = item.get("arguments").and_then(Json::as_str).unwrap_or("{}");
                        let args: Json = serde_json::from_str(args).unwrap_or(json!(args));
                        let call = json!({"id": item.get("call_id").cloned().unwrap_or(Json::Null), "type": "function",
                            "function": {"name": item.get("name").cloned().unwrap_or(Json::Null), "arguments": args}});
                        // Consecutive calls belong to one assistant turn.
                        match out.last_mut() {
                            Some(last) if last["role"] == "assistant" && last.get("tool_calls").is_some() => {
                                if let Some(calls) = last["tool_calls"].as_array_mut() {
                                    calls.push(call);
                                }
                            }
                            _ => out.push(json!({"role": "assistant", "content": "", "tool_calls": [call]})),
                        }
                    }
                    "function_call_output" => {
                        let output = match item.get("output") {
                            Some(Json::String(s)) => s.clone(),
                            Some(other) => other.to_string(),
                            None => String::new(),
                        };
                        out.push(json!({"role": "tool", "tool_call_id": item.get("call_id").cloned().unwrap_or(Json::Null), "content": output}));
                    }
                    other => return Err(bad(format!("input[{i}]: item type {other:?} is not supported"))),
                }
            }
        }
        _ => return Err(bad("input must be a string or a list of items")),
    }
    Ok(out)
}

/// Flat Responses tools → chat-completions tools.
fn convert_tools(tools: Option<Vec<Json>>) -> Result<Vec<Json>, ApiError> {
    let tools = tools.unwrap_or_default();
    let mut out = Vec::new();
    for (i, t) in tools.into_iter().enumerate() {
        if t.get("type").and_then(Json::as_str) != Some("function") {
            return Err(ApiError::invalid(
                ApiCode::UnsupportedTool,
                Some("tools"),
                format!("tools[{i}]: only function tools are supported"),
            ));
        }
        if t.get("function").is_some() {
            out.push(t);
        } else {
            out.push(json!({"type": "function", "function": {"name": t.get("name").cloned().unwrap_or(Json::Null),
                "description": t.get("description").cloned().unwrap_or(json!("")),
                "parameters": t.get("parameters").cloned().unwrap_or(json!({"type": "object"}))}}));
        }
    }
    params::tools(Some(out))
}

fn text_format(text: Option<&Json>) -> Result<Option<Json>, ApiError> {
    let Some(f) = text.and_then(|t| t.get("format")) else { return Ok(None) };
    // Responses puts `schema` beside `type`; chat nests it in `json_schema`.
    Ok(Some(match f.get("type").and_then(Json::as_str) {
        Some("json_schema") => {
            json!({"type": "json_schema", "json_schema": {"schema": f.get("schema").cloned().unwrap_or(Json::Null)}})
        }
        _ => f.clone(),
    }))
}

fn usage(end: &ChoiceEnd) -> Json {
    let i = &end.info;
    json!({"input_tokens": i.prompt_tokens, "input_tokens_details": {"cached_tokens": i.cached_tokens},
        "output_tokens": i.generated, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": i.prompt_tokens + i.generated})
}

fn output_items(id: &str, end: &ChoiceEnd) -> Vec<Json> {
    let mut items = Vec::new();
    if let Some(r) = end.parsed.reasoning.as_ref().filter(|r| !r.is_empty()) {
        items.push(json!({"type": "reasoning", "id": format!("rs_{id}"), "summary": [],
            "content": [{"type": "reasoning_text", "text": r}]}));
    }
    if !end.parsed.content.is_empty() || end.parsed.tool_calls.is_empty() {
        items.push(json!({"type": "message", "id": format!("msg_{id}"), "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": end.parsed.content, "annotations": []}]}));
    }
    for (k, c) in end.parsed.tool_calls.iter().enumerate() {
        items.push(json!({"type": "function_call", "id": format!("fc_{id}_{k}"), "call_id": format!("call_{id}_{k}"),
            "name": c.name, "arguments": c.arguments, "status": "completed"}));
    }
    items
}

fn response_object(id: &str, model: &str, created: u64, end: Option<&ChoiceEnd>) -> Json {
    let (status, incomplete, output, usage) = match end {
        None => ("in_progress", Json::Null, vec![], Json::Null),
        Some(e) => {
            let incomplete = matches!(e.info.cause, FinishCause::Length | FinishCause::PoolExhausted);
            (
                if incomplete { "incomplete" } else { "completed" },
                if incomplete { json!({"reason": "max_output_tokens"}) } else { Json::Null },
                output_items(short(id), e),
                usage(e),
            )
        }
    };
    json!({"id": id, "object": "response", "created_at": created, "status": status, "model": model,
        "output": output, "usage": usage, "incomplete_details": incomplete, "error": null})
}

fn short(id: &str) -> &str {
    crate::generate::id_suffix(id)
}

/// `POST /v1/responses` (body rejections answered here, as for chat).
pub(crate) async fn responses(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<ApiJson<ResponsesRequest>, ApiError>,
) -> Response {
    handle(state, &headers, body, Api::Responses, ("resp_", Flavor::OpenAi), responses_inner).await
}

async fn responses_inner(
    state: AppState,
    req: ResponsesRequest,
    request_id: String,
    log: RequestLog,
) -> Result<Response, ApiError> {
    let model = check_model(&state, &req.model, Flavor::OpenAi)?;
    if req.previous_response_id.is_some() {
        return Err(ApiError::invalid(
            ApiCode::UnsupportedParameter,
            Some("previous_response_id"),
            "responses are not stored; send the whole input",
        ));
    }
    let sampling = RawSampling {
        temperature: req.temperature,
        top_p: req.top_p,
        max_tokens: req.max_output_tokens,
        ..Default::default()
    }
    .validate("max_output_tokens")?;
    let tools = convert_tools(req.tools)?;
    let tool_choice = params::tool_choice(req.tool_choice.as_ref(), !tools.is_empty())?;
    let format = text_format(req.text.as_ref())?;
    let input = GenerationInput {
        request_id,
        prompt: PromptInput::Chat(ChatPrompt {
            messages: params::normalize_messages(convert_input(req.instructions, req.input)?)?,
            tools,
            tool_choice,
            continue_final_message: false,
            template_kwargs: Default::default(),
        }),
        sampling,
        seed: None,
        n: 1,
        stop: Vec::new(),
        answer: params::answer_format(format.as_ref())?,
        ignore_eos: false,
    };
    log.set_stream(req.stream);
    let g = start(&state.engine, input, Flavor::OpenAi, &log).await?;
    let (created, id) = (unix_now(), g.request_id.clone());
    if !req.stream {
        let Some(choice) = g.choices.into_iter().next() else {
            return Err(ApiError::from_request(&helios_worker::RequestError::ChannelClosed));
        };
        let end = choice.collect().await?;
        return Ok(axum::Json(response_object(&id, &model, created, Some(&end))).into_response());
    }
    struct St {
        seq: u64,
        text_open: bool,
        text: String,
        calls: Vec<(String, String)>,
        done: bool,
    }
    let ev = |st: &mut St, kind: &str, mut v: Json| {
        v["type"] = json!(kind);
        v["sequence_number"] = json!(st.seq);
        st.seq += 1;
        Event::default().event(kind).data(v.to_string())
    };
    let mut st = St { seq: 0, text_open: false, text: String::new(), calls: Vec::new(), done: false };
    let head = vec![
        ev(&mut st, "response.created", json!({"response": response_object(&id, &model, created, None)})),
        ev(&mut st, "response.in_progress", json!({"response": response_object(&id, &model, created, None)})),
    ];
    let pieces = merged(g.choices);
    let body = stream::unfold((pieces, st), move |(mut pieces, mut st)| {
        let (id, model) = (id.clone(), model.clone());
        async move {
            if st.done {
                return None;
            }
            let (_, ps) = pieces.next().await?;
            let sid = short(&id).to_owned();
            let msg_id = format!("msg_{sid}");
            let mut out = Vec::new();
            let close_text = |st: &mut St, out: &mut Vec<Event>| {
                if st.text_open {
                    st.text_open = false;
                    let text = st.text.clone();
                    out.push(ev(
                        st,
                        "response.output_text.done",
                        json!({"item_id": msg_id, "output_index": 0, "content_index": 0, "text": text}),
                    ));
                    out.push(ev(st, "response.output_item.done", json!({"output_index": 0, "item": {"type": "message", "id": msg_id,
                        "role": "assistant", "status": "completed", "content": [{"type": "output_text", "text": text, "annotations": []}]}})));
                }
            };
            for p in ps {
                match p {
                    Piece::Delta(OutputDelta::Content(t)) => {
                        if !st.text_open {
                            st.text_open = true;
                            out.push(ev(
                                &mut st,
                                "response.output_item.added",
                                json!({"output_index": 0, "item": {"type": "message",
                                "id": msg_id, "role": "assistant", "status": "in_progress", "content": []}}),
                            ));
                            out.push(ev(
                                &mut st,
                                "response.content_part.added",
                                json!({"item_id": msg_id, "output_index": 0,
                                "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}}),
                            ));
                        }
                        st.text.push_str(&t);
                        out.push(ev(
                            &mut st,
                            "response.output_text.delta",
                            json!({"item_id": msg_id, "output_index": 0, "content_index": 0, "delta": t}),
                        ));
                    }
                    Piece::Delta(OutputDelta::Reasoning(_)) => {}
                    Piece::Delta(OutputDelta::ToolCallStart { index, name }) => {
                        close_text(&mut st, &mut out);
                        st.calls.push((name.clone(), String::new()));
                        out.push(ev(&mut st, "response.output_item.added", json!({"output_index": index + 1, "item": {
                            "type": "function_call", "id": format!("fc_{sid}_{index}"), "call_id": format!("call_{sid}_{index}"),
                            "name": name, "arguments": "", "status": "in_progress"}})));
                    }
                    Piece::Delta(OutputDelta::ToolCallArguments { index, delta }) => {
                        if let Some(c) = st.calls.get_mut(index) {
                            c.1.push_str(&delta);
                        }
                        out.push(ev(
                            &mut st,
                            "response.function_call_arguments.delta",
                            json!({"item_id": format!("fc_{sid}_{index}"),
                            "output_index": index + 1, "delta": delta}),
                        ));
                    }
                    Piece::Delta(OutputDelta::ToolCallEnd { index }) => {
                        let (name, args) = st.calls.get(index).cloned().unwrap_or_default();
                        out.push(ev(
                            &mut st,
                            "response.function_call_arguments.done",
                            json!({"item_id": format!("fc_{sid}_{index}"),
                            "output_index": index + 1, "arguments": args}),
                        ));
                        out.push(ev(&mut st, "response.output_item.done", json!({"output_index": index + 1, "item": {
                            "type": "function_call", "id": format!("fc_{sid}_{index}"), "call_id": format!("call_{sid}_{index}"),
                            "name": name, "arguments": args, "status": "completed"}})));
                    }
                    Piece::Done(end) => {
                        close_text(&mut st, &mut out);
                        let obj = response_object(&id, &model, created, Some(&end));
                        let kind =
                            if obj["status"] == "incomplete" { "response.incomplete" } else { "response.completed" };
                        out.push(ev(&mut st, kind, json!({"response": obj})));
                        st.done = true;
                    }
                    Piece::Failed(e) => {
                        let mut obj = response_object(&id, &model, created, None);
                        obj["status"] = json!("failed");
                        obj["error"] = json!({"code": e.code.as_str(), "message": e.message});
                        out.push(ev(&mut st, "response.failed", json!({"response": obj})));
                        st.done = true;
                        break;
                    }
                }
            }
            Some((out, (pieces, st)))
        }
    });
    let events = logged(stream::iter(head).chain(body.flat_map(stream::iter)), g.log).map(Ok::<_, Infallible>);
    Ok(Sse::new(events).keep_alive(KeepAlive::default()).into_response())
}
