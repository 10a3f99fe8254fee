//! OpenAI Responses (`POST /v1/responses`): text and function-call output items; streamed
//! as `response.*` events, failures as `response.failed`.

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use helios_frontend::OutputDelta;
use helios_worker::{ChatPrompt, FinishCause, GenerationInput, PromptInput};
use serde::{Deserialize, Serialize};
use serde_json::{Value as Json, json};

use crate::AppState;
use crate::error::{ApiCode, ApiError, Flavor};
use crate::extract::ApiJson;
use crate::generate::{Api, ChoiceEnd, RequestLog, handle, start, unix_now};
use crate::openai::check_model;
use crate::params::{self, RawSampling};
use crate::sse::{self, Frames, Protocol};

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

/// Response input items → template messages. These are the template's input, free form (a
/// client's extra fields pass through), so they stay JSON values.
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

/// Flat Responses tools → chat-completions tools (JSON values: the client's schemas pass
/// through).
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

/// `text.format` as a chat `response_format` (a JSON value: it carries the client's schema).
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

fn short(id: &str) -> &str {
    crate::generate::id_suffix(id)
}

/// An output limit cut the answer short.
fn incomplete(end: &ChoiceEnd) -> bool {
    matches!(end.info.cause, FinishCause::Length | FinishCause::PoolExhausted)
}

fn output_items<'a>(id: &str, end: &'a ChoiceEnd) -> Vec<OutputItem<'a>> {
    let p = &end.parsed;
    let mut items = Vec::new();
    if let Some(r) = p.reasoning.as_deref().filter(|r| !r.is_empty()) {
        items.push(OutputItem::Reasoning {
            id: format!("rs_{id}"),
            summary: [],
            content: [ReasoningPart::ReasoningText { text: r }],
        });
    }
    // Whitespace between calls (or after reasoning) is no message, as in a stream.
    if !p.content.trim().is_empty() || p.tool_calls.is_empty() {
        items.push(message_item(format!("msg_{id}"), "completed", &p.content));
    }
    for (k, c) in p.tool_calls.iter().enumerate() {
        items.push(call_item(id, k, &c.name, &c.arguments, "completed"));
    }
    items
}

/// The assistant message item; in progress it has no content part yet.
fn message_item<'a>(id: String, status: &'static str, text: &'a str) -> OutputItem<'a> {
    let content = if status == "completed" { vec![ContentPart::output_text(text)] } else { Vec::new() };
    OutputItem::Message { id, role: "assistant", status, content }
}

fn call_item<'a>(id: &str, k: usize, name: &'a str, arguments: &'a str, status: &'static str) -> OutputItem<'a> {
    OutputItem::FunctionCall { id: format!("fc_{id}_{k}"), call_id: format!("call_{id}_{k}"), name, arguments, status }
}

/// The response object: in progress (`end` is `None`), or complete with its output and usage.
fn response_object<'a>(id: &'a str, model: &'a str, created: u64, end: Option<&'a ChoiceEnd>) -> ResponseObject<'a> {
    let output = end.map(|e| output_items(short(id), e));
    response_with(id, model, created, end, output)
}

/// [`response_object`] with the output items given (a stream's, in the order it sent them).
fn response_with<'a>(
    id: &'a str,
    model: &'a str,
    created: u64,
    end: Option<&ChoiceEnd>,
    output: Option<Vec<OutputItem<'a>>>,
) -> ResponseObject<'a> {
    let mut r = ResponseObject {
        id,
        object: "response",
        created_at: created,
        status: "in_progress",
        model,
        output: Vec::new(),
        usage: None,
        incomplete_details: None,
        error: None,
    };
    if let Some(e) = end {
        let i = &e.info;
        r.status = if incomplete(e) { "incomplete" } else { "completed" };
        r.incomplete_details = incomplete(e).then_some(IncompleteDetails { reason: "max_output_tokens" });
        r.output = output.unwrap_or_default();
        r.usage = Some(ResponseUsage {
            input_tokens: i.prompt_tokens,
            input_tokens_details: InputTokensDetails { cached_tokens: i.cached_tokens },
            output_tokens: i.generated,
            output_tokens_details: OutputTokensDetails { reasoning_tokens: 0 },
            total_tokens: i.prompt_tokens + i.generated,
        });
    }
    r
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
    if req.stream {
        let stream = ResponsesStream {
            id,
            model,
            created,
            seq: Sequence(0),
            items: Vec::new(),
            open: false,
            held: String::new(),
        };
        return Ok(sse::respond(g, stream));
    }
    let end = g.collect_one().await?;
    Ok(axum::Json(response_object(&id, &model, created, Some(&end))).into_response())
}

/// Responses streaming: `response.created` and `response.in_progress`; then the output items
/// in the order the model writes them, each added, streamed (reasoning text, message text,
/// call arguments) and done, numbered by `output_index` in that order; then
/// `response.completed` or `response.incomplete` whose `output` lists the same items in the
/// same order. Text that resumes after a call is a new message item. A failure is
/// `response.failed`.
#[derive(Debug)]
struct ResponsesStream {
    id: String,
    model: String,
    created: u64,
    seq: Sequence,
    /// Output items so far, in output order; the last one is still being written while
    /// `open`.
    items: Vec<Streamed>,
    open: bool,
    /// Whitespace-only text that would open a message item: sent with the text that follows
    /// it, dropped if a call, reasoning or the end comes first.
    held: String,
}

/// An output item of a stream and what it holds so far.
#[derive(Debug)]
enum Streamed {
    Reasoning { id: String, text: String },
    Message { id: String, text: String },
    Call { index: usize, name: String, arguments: String, ended: bool },
}

/// Numbers the events of a stream in order; a field apart, so events can borrow the rest of
/// the stream's state while one is sent.
#[derive(Debug)]
struct Sequence(u64);

impl Sequence {
    fn send(&mut self, out: &mut Frames, event: ResponseEvent<'_>) {
        let kind = event.name();
        out.event(kind, &Numbered { event, kind, sequence_number: self.0 });
        self.0 += 1;
    }
}

impl Streamed {
    /// The item as the final response lists it (`status` for messages and calls).
    fn item<'a>(&'a self, sid: &str, status: &'static str) -> OutputItem<'a> {
        match self {
            Streamed::Reasoning { id, text } => {
                OutputItem::Reasoning { id: id.clone(), summary: [], content: [ReasoningPart::ReasoningText { text }] }
            }
            Streamed::Message { id, text } => message_item(id.clone(), status, text),
            Streamed::Call { index, name, arguments, ended } => {
                call_item(sid, *index, name, arguments, if *ended { status } else { "incomplete" })
            }
        }
    }
}

impl ResponsesStream {
    /// An id for the next item of a kind: the first one's is the plain id (as in a response
    /// that is not streamed), later ones are numbered.
    fn next_id(&self, prefix: &str, reasoning: bool) -> String {
        let n = self
            .items
            .iter()
            .filter(|i| match i {
                Streamed::Reasoning { .. } => reasoning,
                Streamed::Message { .. } => !reasoning,
                Streamed::Call { .. } => false,
            })
            .count();
        let sid = short(&self.id);
        if n == 0 { format!("{prefix}_{sid}") } else { format!("{prefix}_{sid}_{n}") }
    }

    /// Ends the item being written: its text's done event, then the item's.
    fn close(&mut self, out: &mut Frames) {
        if !std::mem::take(&mut self.open) {
            return;
        }
        let output_index = self.items.len() - 1;
        let sid = short(&self.id).to_owned();
        let Some(last) = self.items.last() else { return };
        match last {
            Streamed::Reasoning { id, text } => {
                let done = ResponseEvent::ReasoningTextDone { item_id: id, output_index, content_index: 0, text };
                self.seq.send(out, done);
            }
            Streamed::Message { id, text } => {
                let done = ResponseEvent::OutputTextDone { item_id: id, output_index, content_index: 0, text };
                self.seq.send(out, done);
                let part = ContentPart::output_text(text);
                let done = ResponseEvent::ContentPartDone { item_id: id, output_index, content_index: 0, part };
                self.seq.send(out, done);
            }
            Streamed::Call { index, arguments, .. } => {
                let item_id = format!("fc_{sid}_{index}");
                let done = ResponseEvent::FunctionCallArgumentsDone { item_id: &item_id, output_index, arguments };
                self.seq.send(out, done);
            }
        }
        let item = last.item(&sid, "completed");
        self.seq.send(out, ResponseEvent::OutputItemDone { output_index, item });
    }

    /// Opens a reasoning or message item unless one of that kind is being written.
    fn open_text(&mut self, reasoning: bool, out: &mut Frames) {
        let open_kind = self.open.then(|| self.items.last()).flatten();
        let same = match open_kind {
            Some(Streamed::Reasoning { .. }) => reasoning,
            Some(Streamed::Message { .. }) => !reasoning,
            _ => false,
        };
        if same {
            return;
        }
        self.close(out);
        let output_index = self.items.len();
        let sid = short(&self.id).to_owned();
        if reasoning {
            let id = self.next_id("rs", true);
            self.items.push(Streamed::Reasoning { id, text: String::new() });
            let item = self.items[output_index].item(&sid, "in_progress");
            self.seq.send(out, ResponseEvent::OutputItemAdded { output_index, item });
        } else {
            let id = self.next_id("msg", false);
            let item = message_item(id.clone(), "in_progress", "");
            self.seq.send(out, ResponseEvent::OutputItemAdded { output_index, item });
            let part = ContentPart::output_text("");
            self.seq.send(out, ResponseEvent::ContentPartAdded { item_id: &id, output_index, content_index: 0, part });
            self.items.push(Streamed::Message { id, text: String::new() });
        }
        self.open = true;
    }

    /// The position of call `index`, if it was started.
    fn call_position(&self, index: usize) -> Option<usize> {
        self.items.iter().position(|i| matches!(i, Streamed::Call { index: k, .. } if *k == index))
    }
}

impl Protocol for ResponsesStream {
    fn open(&mut self, out: &mut Frames) {
        let response = response_object(&self.id, &self.model, self.created, None);
        self.seq.send(out, ResponseEvent::Created { response });
        let response = response_object(&self.id, &self.model, self.created, None);
        self.seq.send(out, ResponseEvent::InProgress { response });
    }

    fn delta(&mut self, _: u32, delta: OutputDelta, out: &mut Frames) {
        let sid = short(&self.id).to_owned();
        match delta {
            OutputDelta::Content(t) | OutputDelta::Reasoning(t) if t.is_empty() => {}
            OutputDelta::Content(t) => {
                let writing = self.open && matches!(self.items.last(), Some(Streamed::Message { .. }));
                if !writing && t.trim().is_empty() {
                    self.held.push_str(&t);
                    return;
                }
                let t = std::mem::take(&mut self.held) + &t;
                self.open_text(false, out);
                let output_index = self.items.len() - 1;
                if let Some(Streamed::Message { id, text }) = self.items.last_mut() {
                    text.push_str(&t);
                    let delta =
                        ResponseEvent::OutputTextDelta { item_id: id, output_index, content_index: 0, delta: &t };
                    self.seq.send(out, delta);
                }
            }
            OutputDelta::Reasoning(t) => {
                self.held.clear();
                self.open_text(true, out);
                let output_index = self.items.len() - 1;
                if let Some(Streamed::Reasoning { id, text }) = self.items.last_mut() {
                    text.push_str(&t);
                    let delta =
                        ResponseEvent::ReasoningTextDelta { item_id: id, output_index, content_index: 0, delta: &t };
                    self.seq.send(out, delta);
                }
            }
            OutputDelta::ToolCallStart { index, name } => {
                self.held.clear();
                self.close(out);
                let output_index = self.items.len();
                self.items.push(Streamed::Call { index, name, arguments: String::new(), ended: false });
                let item = self.items[output_index].item(&sid, "in_progress");
                let item = match item {
                    OutputItem::FunctionCall { status: _, id, call_id, name, arguments } => {
                        OutputItem::FunctionCall { id, call_id, name, arguments, status: "in_progress" }
                    }
                    other => other,
                };
                self.seq.send(out, ResponseEvent::OutputItemAdded { output_index, item });
                self.open = true;
            }
            OutputDelta::ToolCallArguments { index, delta } => {
                let Some(output_index) = self.call_position(index) else { return };
                if let Streamed::Call { arguments, .. } = &mut self.items[output_index] {
                    arguments.push_str(&delta);
                }
                let item_id = format!("fc_{sid}_{index}");
                let event =
                    ResponseEvent::FunctionCallArgumentsDelta { item_id: &item_id, output_index, delta: &delta };
                self.seq.send(out, event);
            }
            OutputDelta::ToolCallEnd { index } => {
                if let Some(p) = self.call_position(index)
                    && let Streamed::Call { ended, .. } = &mut self.items[p]
                {
                    *ended = true;
                }
                self.close(out);
            }
        }
    }

    fn done(&mut self, _: u32, end: ChoiceEnd, out: &mut Frames) {
        self.close(out);
        // As a response that is not streamed: a message item, empty if need be, unless the
        // model only called tools.
        if !self.items.iter().any(|i| !matches!(i, Streamed::Reasoning { .. })) {
            self.open_text(false, out);
            let held = std::mem::take(&mut self.held);
            if !held.is_empty() {
                self.delta(0, OutputDelta::Content(held), out);
            }
            self.close(out);
        }
        let sid = short(&self.id).to_owned();
        // Items are complete (as in a response that is not streamed), but a call cut short.
        let output = self.items.iter().map(|i| i.item(&sid, "completed")).collect();
        let response = response_with(&self.id, &self.model, self.created, Some(&end), Some(output));
        let event = if incomplete(&end) {
            ResponseEvent::Incomplete { response }
        } else {
            ResponseEvent::Completed { response }
        };
        self.seq.send(out, event);
    }

    fn failed(&mut self, error: ApiError, out: &mut Frames) {
        // What was streamed stays listed: the items, as far as they got (the one being written
        // is incomplete).
        let sid = short(&self.id).to_owned();
        let last = self.items.len().wrapping_sub(usize::from(self.open));
        let output = self
            .items
            .iter()
            .enumerate()
            .map(|(i, item)| item.item(&sid, if i == last { "incomplete" } else { "completed" }))
            .collect();
        let mut response = response_with(&self.id, &self.model, self.created, None, None);
        response.output = output;
        response.status = "failed";
        response.error = Some(ResponseError { code: error.code.as_str(), message: &error.message });
        self.seq.send(out, ResponseEvent::Failed { response });
    }
}

// The wire types. Field order is the order sent.

#[derive(Debug, Serialize)]
struct ResponseObject<'a> {
    id: &'a str,
    object: &'static str,
    created_at: u64,
    status: &'static str,
    model: &'a str,
    output: Vec<OutputItem<'a>>,
    /// `null` until the response is complete.
    usage: Option<ResponseUsage>,
    /// `null` unless an output limit cut the response short.
    incomplete_details: Option<IncompleteDetails>,
    /// `null` unless the response failed.
    error: Option<ResponseError<'a>>,
}

#[derive(Debug, Serialize)]
struct ResponseUsage {
    input_tokens: u32,
    input_tokens_details: InputTokensDetails,
    output_tokens: u32,
    output_tokens_details: OutputTokensDetails,
    total_tokens: u32,
}

#[derive(Debug, Serialize)]
struct InputTokensDetails {
    cached_tokens: u32,
}

#[derive(Debug, Serialize)]
struct OutputTokensDetails {
    reasoning_tokens: u32,
}

#[derive(Debug, Serialize)]
struct IncompleteDetails {
    reason: &'static str,
}

#[derive(Debug, Serialize)]
struct ResponseError<'a> {
    code: &'static str,
    message: &'a str,
}

#[derive(Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum OutputItem<'a> {
    Reasoning {
        id: String,
        /// Always empty: no summaries are made.
        summary: [(); 0],
        content: [ReasoningPart<'a>; 1],
    },
    Message {
        id: String,
        role: &'static str,
        status: &'static str,
        content: Vec<ContentPart<'a>>,
    },
    FunctionCall {
        id: String,
        call_id: String,
        name: &'a str,
        /// The JSON text the model wrote.
        arguments: &'a str,
        status: &'static str,
    },
}

#[derive(Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum ReasoningPart<'a> {
    ReasoningText { text: &'a str },
}

#[derive(Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum ContentPart<'a> {
    OutputText {
        text: &'a str,
        /// Always empty.
        annotations: [(); 0],
    },
}

impl<'a> ContentPart<'a> {
    fn output_text(text: &'a str) -> Self {
        ContentPart::OutputText { text, annotations: [] }
    }
}

/// A Responses stream event; its `type` is its SSE event name ([`ResponseEvent::name`]).
#[derive(Debug, Serialize)]
#[serde(untagged)]
enum ResponseEvent<'a> {
    Created { response: ResponseObject<'a> },
    InProgress { response: ResponseObject<'a> },
    Completed { response: ResponseObject<'a> },
    Incomplete { response: ResponseObject<'a> },
    Failed { response: ResponseObject<'a> },
    OutputItemAdded { output_index: usize, item: OutputItem<'a> },
    OutputItemDone { output_index: usize, item: OutputItem<'a> },
    ContentPartAdded { item_id: &'a str, output_index: usize, content_index: usize, part: ContentPart<'a> },
    ContentPartDone { item_id: &'a str, output_index: usize, content_index: usize, part: ContentPart<'a> },
    OutputTextDelta { item_id: &'a str, output_index: usize, content_index: usize, delta: &'a str },
    OutputTextDone { item_id: &'a str, output_index: usize, content_index: usize, text: &'a str },
    ReasoningTextDelta { item_id: &'a str, output_index: usize, content_index: usize, delta: &'a str },
    ReasoningTextDone { item_id: &'a str, output_index: usize, content_index: usize, text: &'a str },
    FunctionCallArgumentsDelta { item_id: &'a str, output_index: usize, delta: &'a str },
    FunctionCallArgumentsDone { item_id: &'a str, output_index: usize, arguments: &'a str },
}

impl ResponseEvent<'_> {
    fn name(&self) -> &'static str {
        match self {
            ResponseEvent::Created { .. } => "response.created",
            ResponseEvent::InProgress { .. } => "response.in_progress",
            ResponseEvent::Completed { .. } => "response.completed",
            ResponseEvent::Incomplete { .. } => "response.incomplete",
            ResponseEvent::Failed { .. } => "response.failed",
            ResponseEvent::OutputItemAdded { .. } => "response.output_item.added",
            ResponseEvent::OutputItemDone { .. } => "response.output_item.done",
            ResponseEvent::ContentPartAdded { .. } => "response.content_part.added",
            ResponseEvent::ContentPartDone { .. } => "response.content_part.done",
            ResponseEvent::OutputTextDelta { .. } => "response.output_text.delta",
            ResponseEvent::OutputTextDone { .. } => "response.output_text.done",
            ResponseEvent::ReasoningTextDelta { .. } => "response.reasoning_text.delta",
            ResponseEvent::ReasoningTextDone { .. } => "response.reasoning_text.done",
            ResponseEvent::FunctionCallArgumentsDelta { .. } => "response.function_call_arguments.delta",
            ResponseEvent::FunctionCallArgumentsDone { .. } => "response.function_call_arguments.done",
        }
    }
}

/// A stream event as sent: its fields, then `type` and `sequence_number` (the order clients
/// have always been sent).
#[derive(Debug, Serialize)]
struct Numbered<'a> {
    #[serde(flatten)]
    event: ResponseEvent<'a>,
    #[serde(rename = "type")]
    kind: &'static str,
    sequence_number: u64,
}

#[cfg(test)]
mod tests {
    use serde_json::to_value;

    use super::*;

    fn numbered(event: ResponseEvent<'_>, sequence_number: u64) -> Json {
        to_value(Numbered { kind: event.name(), event, sequence_number }).expect("json")
    }

    #[test]
    fn output_items() {
        let reasoning = OutputItem::Reasoning {
            id: "rs_x".into(),
            summary: [],
            content: [ReasoningPart::ReasoningText { text: "r" }],
        };
        assert_eq!(
            to_value(reasoning).expect("json"),
            json!({"type": "reasoning", "id": "rs_x", "summary": [],
                "content": [{"type": "reasoning_text", "text": "r"}]})
        );
        assert_eq!(
            to_value(message_item("msg_x".into(), "completed", "hi")).expect("json"),
            json!({"type": "message", "id": "msg_x", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": "hi", "annotations": []}]})
        );
        assert_eq!(
            to_value(message_item("msg_x".into(), "in_progress", "")).expect("json"),
            json!({"type": "message", "id": "msg_x", "role": "assistant", "status": "in_progress", "content": []})
        );
        assert_eq!(
            to_value(call_item("x", 1, "f", "{}", "completed")).expect("json"),
            json!({"type": "function_call", "id": "fc_x_1", "call_id": "call_x_1", "name": "f", "arguments": "{}",
                "status": "completed"})
        );
    }

    #[test]
    fn an_in_progress_response_has_nulls_and_events_end_with_type_and_number() {
        let response = response_object("resp_1", "m", 5, None);
        assert_eq!(
            numbered(ResponseEvent::Created { response }, 0),
            json!({"response": {"id": "resp_1", "object": "response", "created_at": 5, "status": "in_progress",
                "model": "m", "output": [], "usage": null, "incomplete_details": null, "error": null},
                "type": "response.created", "sequence_number": 0})
        );
        let delta = ResponseEvent::FunctionCallArgumentsDelta { item_id: "fc_x_0", output_index: 1, delta: "{" };
        assert_eq!(
            numbered(delta, 7),
            json!({"item_id": "fc_x_0", "output_index": 1, "delta": "{",
                "type": "response.function_call_arguments.delta", "sequence_number": 7})
        );
    }
}
