//! OpenAI Chat Completions, Completions and Models.

use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use helios_frontend::OutputDelta;
use helios_worker::{ChatPrompt, GenerationInput, PromptInput};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value as Json};

use crate::AppState;
use crate::error::{ApiCode, ApiError, Flavor};
use crate::extract::ApiJson;
use crate::generate::{Api, ChoiceEnd, Generation, RequestLog, Tally, handle, start, unix_now};
use crate::params::{self, RawSampling, StopSpec};
use crate::sse::{self, Frames, Protocol};
use helios_worker::ErrorCode;

#[derive(Debug, Deserialize)]
pub(crate) struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Sampling fields shared by Chat Completions and Completions.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct SamplingFields {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<f64>,
    pub min_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
}

impl SamplingFields {
    fn raw(&self, max_tokens: Option<i64>) -> RawSampling {
        RawSampling {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            max_tokens,
        }
    }
}

/// `POST /v1/chat/completions` body (unknown fields are ignored, as OpenAI clients add them freely).
#[derive(Debug, Deserialize)]
pub(crate) struct ChatRequest {
    pub model: String,
    pub messages: Vec<Json>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<i64>,
    pub stop: Option<StopSpec>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    pub seed: Option<i64>,
    pub tools: Option<Vec<Json>>,
    pub tool_choice: Option<Json>,
    pub response_format: Option<Json>,
    #[serde(default)]
    pub ignore_eos: bool,
    #[serde(default)]
    pub logprobs: bool,
    pub chat_template_kwargs: Option<Map<String, Json>>,
    #[serde(default)]
    pub continue_final_message: bool,
    #[serde(flatten)]
    pub unsupported: params::Unsupported,
}

/// Checks that `model` is one of the served names (`--served-model-name`, aliases included);
/// returns the name responses report (the first).
pub(crate) fn check_model(state: &AppState, model: &str, flavor: Flavor) -> Result<String, ApiError> {
    if state.models.iter().any(|m| m == model) {
        Ok(state.models[0].clone())
    } else {
        Err(ApiError::model_not_found(model).flavor(flavor))
    }
}

impl ChatRequest {
    fn into_input(self, request_id: String) -> Result<(GenerationInput, bool, bool), ApiError> {
        if self.logprobs {
            return Err(ApiError::invalid(
                ApiCode::UnsupportedParameter,
                Some("logprobs"),
                "logprobs are not supported",
            ));
        }
        self.unsupported.check()?;
        if self.stream_options.is_some() && !self.stream {
            return Err(ApiError::invalid(
                ErrorCode::InvalidParameter,
                Some("stream_options"),
                "stream_options is only allowed when stream is true",
            ));
        }
        let (max_tokens, param) = match (self.max_completion_tokens, self.max_tokens) {
            (Some(n), _) => (Some(n), "max_completion_tokens"),
            (None, n) => (n, "max_tokens"),
        };
        let sampling = self.sampling.raw(max_tokens).validate(param)?;
        let tools = params::tools(self.tools)?;
        let tool_choice = params::tool_choice(self.tool_choice.as_ref(), !tools.is_empty())?;
        let include_usage = self.stream_options.is_some_and(|o| o.include_usage);
        let input = GenerationInput {
            request_id,
            prompt: PromptInput::Chat(ChatPrompt {
                messages: params::normalize_messages(self.messages)?,
                tools,
                tool_choice,
                continue_final_message: self.continue_final_message,
                template_kwargs: params::template_kwargs(self.chat_template_kwargs),
            }),
            sampling,
            seed: params::seed(self.seed),
            n: params::choices(self.n)?,
            stop: self.stop.map(StopSpec::into_vec).unwrap_or_default(),
            answer: params::answer_format(self.response_format.as_ref())?,
            ignore_eos: self.ignore_eos,
        };
        Ok((input, self.stream, include_usage))
    }
}

fn call_id(request_id: &str, choice: u32, index: usize) -> String {
    format!("call_{}_{choice}_{index}", crate::generate::id_suffix(request_id))
}

/// `POST /v1/chat/completions`. A body the extractor rejects is answered here too, so every
/// request gets its id, its log line and its count in `/metrics`.
pub(crate) async fn chat(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<ApiJson<ChatRequest>, ApiError>,
) -> Response {
    handle(state, &headers, body, Api::Chat, ("chatcmpl-", Flavor::OpenAi), chat_inner).await
}

async fn chat_inner(
    state: AppState,
    req: ChatRequest,
    request_id: String,
    log: RequestLog,
) -> Result<Response, ApiError> {
    let model = check_model(&state, &req.model, Flavor::OpenAi)?;
    let (input, streaming, include_usage) = req.into_input(request_id)?;
    log.set_stream(streaming);
    let g = start(&state.engine, input, Flavor::OpenAi, &log).await?;
    if streaming {
        let n = g.choices.len() as u32;
        let head = ChunkHead::new(&g, model, "chat.completion.chunk", include_usage);
        return Ok(sse::respond(g, ChatStream { head, n }));
    }
    let id = g.request_id.clone();
    let (ends, usage) = g.collect().await?;
    let choices: Vec<ChatChoice<'_>> = ends
        .iter()
        .map(|(index, end)| ChatChoice {
            index: *index,
            message: chat_message(&id, *index, end),
            finish_reason: end.finish_reason(),
            logprobs: Null,
        })
        .collect();
    let body = Completion {
        id: &id,
        object: "chat.completion",
        created: unix_now(),
        model: &model,
        choices: &choices,
        usage: Some(Usage::from(&usage)),
    };
    Ok(axum::Json(body).into_response())
}

fn chat_message<'a>(request_id: &str, choice: u32, end: &'a ChoiceEnd) -> ChatMessage<'a> {
    let p = &end.parsed;
    let tool_calls: Vec<ToolCall<'a>> = p
        .tool_calls
        .iter()
        .enumerate()
        .map(|(i, c)| ToolCall {
            id: call_id(request_id, choice, i),
            kind: "function",
            function: FunctionCall { name: &c.name, arguments: &c.arguments },
        })
        .collect();
    ChatMessage {
        role: "assistant",
        content: (!p.content.is_empty() || tool_calls.is_empty()).then_some(p.content.as_str()),
        reasoning_content: p.reasoning.as_deref(),
        tool_calls,
    }
}

/// What every chunk of a Chat Completions or Completions stream repeats, and their shared
/// ending.
struct ChunkHead {
    id: String,
    model: String,
    created: u64,
    object: &'static str,
    include_usage: bool,
}

impl ChunkHead {
    fn new(g: &Generation, model: String, object: &'static str, include_usage: bool) -> Self {
        ChunkHead { id: g.request_id.clone(), model, created: unix_now(), object, include_usage }
    }

    /// A chunk with one choice.
    fn send(&self, out: &mut Frames, choice: impl Serialize) {
        out.data(&self.chunk(std::slice::from_ref(&choice), None));
    }

    fn chunk<'a, C>(&'a self, choices: &'a [C], usage: Option<Usage>) -> Completion<'a, C> {
        Completion { id: &self.id, object: self.object, created: self.created, model: &self.model, choices, usage }
    }

    /// The end of a stream: a usage chunk without choices when `include_usage` asked for
    /// one, then `[DONE]`.
    fn close(&self, usage: &Tally, out: &mut Frames) {
        if self.include_usage {
            out.data(&self.chunk::<()>(&[], Some(Usage::from(usage))));
        }
        out.done_marker();
    }
}

/// Chat Completions streaming: a role chunk per choice, a chunk per delta, a finish chunk
/// per choice, then the shared ending ([`ChunkHead::close`]).
struct ChatStream {
    head: ChunkHead,
    n: u32,
}

impl Protocol for ChatStream {
    fn open(&mut self, out: &mut Frames) {
        for index in 0..self.n {
            let delta = ChatDelta::Role { role: "assistant", content: "" };
            self.head.send(out, ChunkChoice { index, delta, finish_reason: None, logprobs: Null });
        }
    }

    fn delta(&mut self, index: u32, delta: OutputDelta, out: &mut Frames) {
        let call_id = |k| call_id(&self.head.id, index, k);
        let delta = match &delta {
            OutputDelta::Content(t) => ChatDelta::Content { content: t },
            OutputDelta::Reasoning(t) => ChatDelta::Reasoning { reasoning_content: t },
            OutputDelta::ToolCallStart { index: k, name } => ChatDelta::ToolCalls {
                tool_calls: [ToolCallDelta::Start {
                    index: *k,
                    id: call_id(*k),
                    kind: "function",
                    function: FunctionCall { name, arguments: "" },
                }],
            },
            OutputDelta::ToolCallArguments { index: k, delta } => ChatDelta::ToolCalls {
                tool_calls: [ToolCallDelta::Arguments { index: *k, function: ArgumentsDelta { arguments: delta } }],
            },
            OutputDelta::ToolCallEnd { .. } => return,
        };
        self.head.send(out, ChunkChoice { index, delta, finish_reason: None, logprobs: Null });
    }

    fn done(&mut self, index: u32, end: ChoiceEnd, out: &mut Frames) {
        let finish_reason = Some(end.finish_reason());
        self.head.send(out, ChunkChoice { index, delta: ChatDelta::Empty {}, finish_reason, logprobs: Null });
    }

    fn failed(&mut self, error: ApiError, out: &mut Frames) {
        out.data(&error.body());
    }

    fn close(&mut self, usage: &Tally, out: &mut Frames) {
        self.head.close(usage, out);
    }
}

/// `POST /v1/completions` body.
#[derive(Debug, Deserialize)]
pub(crate) struct CompletionRequest {
    pub model: String,
    pub prompt: Json,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<i64>,
    pub stop: Option<StopSpec>,
    pub max_tokens: Option<i64>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    pub seed: Option<i64>,
    pub response_format: Option<Json>,
    #[serde(default)]
    pub ignore_eos: bool,
    #[serde(default)]
    pub echo: bool,
    pub suffix: Option<String>,
    pub logprobs: Option<Json>,
    #[serde(flatten)]
    pub unsupported: params::Unsupported,
}

fn completion_prompt(v: Json) -> Result<PromptInput, ApiError> {
    let bad = || {
        ApiError::invalid(
            ApiCode::InvalidPrompt,
            Some("prompt"),
            "prompt must be a string, a token list, or a list of one of them",
        )
    };
    let tokens =
        |a: &[Json]| -> Option<Vec<u32>> { a.iter().map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok())).collect() };
    match v {
        Json::String(s) => Ok(PromptInput::Text(s)),
        Json::Array(a) if a.iter().all(Json::is_number) && !a.is_empty() => {
            tokens(&a).map(PromptInput::Tokens).ok_or_else(bad)
        }
        Json::Array(mut a) if a.len() == 1 => completion_prompt(a.remove(0)),
        _ => Err(bad()),
    }
}

/// `POST /v1/completions` (body rejections answered here, as for chat).
pub(crate) async fn completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<ApiJson<CompletionRequest>, ApiError>,
) -> Response {
    handle(state, &headers, body, Api::Completions, ("cmpl-", Flavor::OpenAi), completions_inner).await
}

async fn completions_inner(
    state: AppState,
    req: CompletionRequest,
    request_id: String,
    log: RequestLog,
) -> Result<Response, ApiError> {
    let model = check_model(&state, &req.model, Flavor::OpenAi)?;
    if req.echo || req.suffix.is_some() || req.logprobs.as_ref().is_some_and(|l| !l.is_null()) {
        return Err(ApiError::invalid(
            ApiCode::UnsupportedParameter,
            None,
            "echo, suffix and logprobs are not supported",
        ));
    }
    req.unsupported.check()?;
    let sampling = req.sampling.raw(req.max_tokens).validate("max_tokens")?;
    let include_usage = req.stream_options.as_ref().is_some_and(|o| o.include_usage);
    let input = GenerationInput {
        request_id,
        prompt: completion_prompt(req.prompt)?,
        sampling,
        seed: params::seed(req.seed),
        n: params::choices(req.n)?,
        stop: req.stop.map(StopSpec::into_vec).unwrap_or_default(),
        answer: params::answer_format(req.response_format.as_ref())?,
        ignore_eos: req.ignore_eos,
    };
    log.set_stream(req.stream);
    let g = start(&state.engine, input, Flavor::OpenAi, &log).await?;
    if req.stream {
        let head = ChunkHead::new(&g, model, "text_completion", include_usage);
        return Ok(sse::respond(g, CompletionStream { head }));
    }
    let id = g.request_id.clone();
    let (ends, usage) = g.collect().await?;
    let choices: Vec<TextChoice<'_>> = ends
        .iter()
        .map(|(index, end)| TextChoice {
            index: *index,
            text: &end.parsed.content,
            finish_reason: Some(end.finish_reason()),
            logprobs: Null,
        })
        .collect();
    let body = Completion {
        id: &id,
        object: "text_completion",
        created: unix_now(),
        model: &model,
        choices: &choices,
        usage: Some(Usage::from(&usage)),
    };
    Ok(axum::Json(body).into_response())
}

/// Completions streaming: a chunk per piece of text, a finish chunk per choice, then the
/// shared ending ([`ChunkHead::close`]).
struct CompletionStream {
    head: ChunkHead,
}

impl Protocol for CompletionStream {
    fn delta(&mut self, index: u32, delta: OutputDelta, out: &mut Frames) {
        if let OutputDelta::Content(text) = &delta {
            self.head.send(out, TextChoice { index, text, finish_reason: None, logprobs: Null });
        }
    }

    fn done(&mut self, index: u32, end: ChoiceEnd, out: &mut Frames) {
        let finish_reason = Some(end.finish_reason());
        self.head.send(out, TextChoice { index, text: "", finish_reason, logprobs: Null });
    }

    fn failed(&mut self, error: ApiError, out: &mut Frames) {
        out.data(&error.body());
    }

    fn close(&mut self, usage: &Tally, out: &mut Frames) {
        self.head.close(usage, out);
    }
}

/// The served model's object, under its first name.
fn model_object(state: &AppState) -> ModelObject<'_> {
    let f = state.engine.frontend();
    // Every cap a request meets is stated: the context, the output cap (requests asking more
    // are clamped to it) and the output limit of a request that does not say.
    ModelObject {
        id: &state.models[0],
        object: "model",
        created: state.started,
        owned_by: "flare",
        max_model_len: f.context_limit,
        max_output_tokens: f.max_output_tokens,
        default_max_tokens: f.sampling.max_output_tokens.min(f.max_output_tokens),
    }
}

pub(crate) async fn models(State(state): State<AppState>) -> Response {
    axum::Json(ModelList { object: "list", data: [model_object(&state)] }).into_response()
}

/// `GET /v1/models/{id}`: the model object for any served name (an alias gives the same
/// object, under the first name); 404 `model_not_found` otherwise.
pub(crate) async fn model(
    State(state): State<AppState>,
    id: Result<Path<String>, axum::extract::rejection::PathRejection>,
) -> Response {
    // A name that is not valid UTF-8 once percent-decoded names no served model.
    let id = id.map_or_else(|_| String::from("(invalid name)"), |Path(id)| id);
    match check_model(&state, &id, Flavor::OpenAi) {
        Ok(_) => axum::Json(model_object(&state)).into_response(),
        Err(e) => e.into_response(),
    }
}

// The wire types. Field order is the order sent.

/// A Chat Completions or Completions body: a whole answer, or one stream chunk (`object`
/// tells which).
#[derive(Debug, Serialize)]
struct Completion<'a, C> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: &'a [C],
    /// Always in a whole answer; in a stream only in the last chunk, when asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Usage>,
}

#[derive(Debug, Serialize)]
struct Usage {
    prompt_tokens: u32,
    completion_tokens: u32,
    total_tokens: u32,
    prompt_tokens_details: PromptTokensDetails,
}

#[derive(Debug, Serialize)]
struct PromptTokensDetails {
    cached_tokens: u32,
}

impl From<&Tally> for Usage {
    fn from(t: &Tally) -> Self {
        Usage {
            prompt_tokens: t.prompt,
            completion_tokens: t.completion,
            total_tokens: t.prompt + t.completion,
            prompt_tokens_details: PromptTokensDetails { cached_tokens: t.cached },
        }
    }
}

/// JSON `null`, for `logprobs`: always sent, always empty (requests for them are refused).
#[derive(Debug, Serialize)]
struct Null;

/// One choice of a whole chat completion.
#[derive(Debug, Serialize)]
struct ChatChoice<'a> {
    index: u32,
    message: ChatMessage<'a>,
    finish_reason: &'static str,
    logprobs: Null,
}

#[derive(Debug, Serialize)]
struct ChatMessage<'a> {
    role: &'static str,
    /// `null` when the answer is tool calls alone.
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<&'a str>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<ToolCall<'a>>,
}

#[derive(Debug, Serialize)]
struct ToolCall<'a> {
    id: String,
    #[serde(rename = "type")]
    kind: &'static str,
    function: FunctionCall<'a>,
}

/// A call's name and its arguments as the JSON text the model wrote.
#[derive(Debug, Serialize)]
struct FunctionCall<'a> {
    name: &'a str,
    arguments: &'a str,
}

/// One choice of a chat stream chunk; `finish_reason` is `null` until the choice's last.
#[derive(Debug, Serialize)]
struct ChunkChoice<'a> {
    index: u32,
    delta: ChatDelta<'a>,
    finish_reason: Option<&'static str>,
    logprobs: Null,
}

/// What a chat chunk adds to its choice.
#[derive(Debug, Serialize)]
#[serde(untagged)]
enum ChatDelta<'a> {
    /// A choice's first chunk.
    Role {
        role: &'static str,
        content: &'static str,
    },
    Content {
        content: &'a str,
    },
    Reasoning {
        reasoning_content: &'a str,
    },
    ToolCalls {
        tool_calls: [ToolCallDelta<'a>; 1],
    },
    /// The finish chunk's.
    Empty {},
}

/// A streamed tool call: its start (id, type, name, empty arguments), then pieces of its
/// arguments, both keyed by the call's `index`.
#[derive(Debug, Serialize)]
#[serde(untagged)]
enum ToolCallDelta<'a> {
    Start {
        index: usize,
        id: String,
        #[serde(rename = "type")]
        kind: &'static str,
        function: FunctionCall<'a>,
    },
    Arguments {
        index: usize,
        function: ArgumentsDelta<'a>,
    },
}

#[derive(Debug, Serialize)]
struct ArgumentsDelta<'a> {
    arguments: &'a str,
}

/// One choice of a Completions body or chunk; `finish_reason` is `null` until the choice's
/// last chunk.
#[derive(Debug, Serialize)]
struct TextChoice<'a> {
    index: u32,
    text: &'a str,
    finish_reason: Option<&'static str>,
    logprobs: Null,
}

#[derive(Debug, Serialize)]
struct ModelObject<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    owned_by: &'static str,
    max_model_len: u32,
    max_output_tokens: u32,
    default_max_tokens: u32,
}

#[derive(Debug, Serialize)]
struct ModelList<'a> {
    object: &'static str,
    data: [ModelObject<'a>; 1],
}

#[cfg(test)]
mod tests {
    use serde_json::{json, to_value};

    use super::*;

    fn head(include_usage: bool) -> ChunkHead {
        ChunkHead {
            id: "chatcmpl-1".into(),
            model: "m".into(),
            created: 7,
            object: "chat.completion.chunk",
            include_usage,
        }
    }

    #[test]
    fn chat_chunks_with_and_without_usage() {
        let h = head(true);
        let choice =
            ChunkChoice { index: 1, delta: ChatDelta::Content { content: "hi" }, finish_reason: None, logprobs: Null };
        assert_eq!(
            to_value(h.chunk(std::slice::from_ref(&choice), None)).expect("json"),
            json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
                "choices": [{"index": 1, "delta": {"content": "hi"}, "finish_reason": null, "logprobs": null}]})
        );
        let usage = Tally { prompt: 5, completion: 3, cached: 2 };
        assert_eq!(
            to_value(h.chunk::<()>(&[], Some(Usage::from(&usage)))).expect("json"),
            json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m", "choices": [],
                "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                    "prompt_tokens_details": {"cached_tokens": 2}}})
        );
    }

    #[test]
    fn a_stream_ends_with_usage_only_when_asked() {
        let usage = Tally { prompt: 1, completion: 1, cached: 0 };
        for (include_usage, events) in [(true, 2), (false, 1)] {
            let mut out = Frames::default();
            head(include_usage).close(&usage, &mut out);
            assert_eq!(out.count(), events);
        }
    }

    #[test]
    fn chat_deltas() {
        let d = |delta: ChatDelta<'_>| to_value(delta).expect("json");
        assert_eq!(d(ChatDelta::Role { role: "assistant", content: "" }), json!({"role": "assistant", "content": ""}));
        assert_eq!(d(ChatDelta::Reasoning { reasoning_content: "r" }), json!({"reasoning_content": "r"}));
        assert_eq!(d(ChatDelta::Empty {}), json!({}));
        let start = ToolCallDelta::Start {
            index: 0,
            id: "call_x_0_0".into(),
            kind: "function",
            function: FunctionCall { name: "f", arguments: "" },
        };
        assert_eq!(
            d(ChatDelta::ToolCalls { tool_calls: [start] }),
            json!({"tool_calls": [{"index": 0, "id": "call_x_0_0", "type": "function",
                "function": {"name": "f", "arguments": ""}}]})
        );
        let args = ToolCallDelta::Arguments { index: 1, function: ArgumentsDelta { arguments: "{\"a\"" } };
        assert_eq!(
            d(ChatDelta::ToolCalls { tool_calls: [args] }),
            json!({"tool_calls": [{"index": 1, "function": {"arguments": "{\"a\""}}]})
        );
    }

    #[test]
    fn a_message_of_tool_calls_alone_has_null_content() {
        let calls = vec![ToolCall {
            id: "call_x_0_0".into(),
            kind: "function",
            function: FunctionCall { name: "f", arguments: "{}" },
        }];
        let m = ChatMessage { role: "assistant", content: None, reasoning_content: None, tool_calls: calls };
        assert_eq!(
            to_value(m).expect("json"),
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_x_0_0", "type": "function",
                "function": {"name": "f", "arguments": "{}"}}]})
        );
        let m = ChatMessage { role: "assistant", content: Some("a"), reasoning_content: Some("r"), tool_calls: vec![] };
        assert_eq!(to_value(m).expect("json"), json!({"role": "assistant", "content": "a", "reasoning_content": "r"}));
    }
}
