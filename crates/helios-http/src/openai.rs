//! OpenAI Chat Completions, Completions and Models.

use std::convert::Infallible;

use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, BoxStream, StreamExt};
use helios_frontend::OutputDelta;
use helios_worker::{ChatPrompt, GenerationInput, PromptInput};
use serde::Deserialize;
use serde_json::{Map, Value as Json, json};

use crate::AppState;
use crate::error::{ApiCode, ApiError, Flavor};
use crate::extract::ApiJson;
use crate::generate::{Api, ChoiceEnd, ChoiceRun, Generation, Piece, RequestLog, handle, logged, start, unix_now};
use crate::params::{self, RawSampling, StopSpec};
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

fn usage(prompt: u32, completion: u32, cached: u32) -> Json {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached}})
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
    let generation = start(&state.engine, input, Flavor::OpenAi, &log).await?;
    if streaming {
        Ok(chat_stream(generation, model, include_usage).into_response())
    } else {
        chat_whole(generation, &model).await
    }
}

/// Runs every choice to its end; returns them in index order with the request's usage.
async fn collect_choices(g: Generation) -> Result<(Vec<(u32, ChoiceEnd)>, Json), ApiError> {
    let ends =
        futures_util::future::join_all(g.choices.into_iter().map(|c| async move { (c.index, c.collect().await) }))
            .await;
    let (mut out, mut completion, mut cached) = (Vec::with_capacity(ends.len()), 0, 0);
    for (index, end) in ends {
        let end = end?;
        completion += end.info.generated;
        cached = cached.max(end.info.cached_tokens);
        out.push((index, end));
    }
    Ok((out, usage(g.prompt_tokens, completion, cached)))
}

async fn chat_whole(g: Generation, model: &str) -> Result<Response, ApiError> {
    let id = g.request_id.clone();
    let (ends, usage) = collect_choices(g).await?;
    let choices: Vec<Json> = ends
        .iter()
        .map(|(index, end)| {
            json!({"index": index, "message": chat_message(&id, *index, end),
                "finish_reason": end.finish_reason(), "logprobs": null})
        })
        .collect();
    let body = json!({"id": id, "object": "chat.completion", "created": unix_now(), "model": model,
        "choices": choices, "usage": usage});
    Ok(axum::Json(body).into_response())
}

fn chat_message(request_id: &str, choice: u32, end: &ChoiceEnd) -> Json {
    let p = &end.parsed;
    let mut m = Map::new();
    m.insert("role".into(), json!("assistant"));
    m.insert(
        "content".into(),
        if p.content.is_empty() && !p.tool_calls.is_empty() { Json::Null } else { json!(p.content) },
    );
    if let Some(r) = &p.reasoning {
        m.insert("reasoning_content".into(), json!(r));
    }
    if !p.tool_calls.is_empty() {
        let calls: Vec<Json> = p
            .tool_calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                json!({"id": call_id(request_id, choice, i), "type": "function",
                "function": {"name": c.name, "arguments": c.arguments}})
            })
            .collect();
        m.insert("tool_calls".into(), Json::Array(calls));
    }
    Json::Object(m)
}

type Pieces = (u32, Vec<Piece>);

/// All choices' pieces, interleaved as they arrive. Dropping it cancels every choice.
pub(crate) fn merged(choices: Vec<ChoiceRun>) -> BoxStream<'static, Pieces> {
    let streams = choices.into_iter().map(|c| {
        stream::unfold(c, |mut c| async move {
            let pieces = c.next().await?;
            Some(((c.index, pieces), c))
        })
        .boxed()
    });
    stream::select_all(streams).boxed()
}

pub(crate) fn data(v: &Json) -> Event {
    Event::default().data(v.to_string())
}

/// SSE: role chunk, deltas, a finish chunk per choice, optional usage, `[DONE]`. A failure
/// ends the stream with an error event and no `[DONE]`.
fn chat_stream(g: Generation, model: String, include_usage: bool) -> impl IntoResponse {
    struct St {
        pieces: BoxStream<'static, Pieces>,
        id: String,
        model: String,
        created: u64,
        prompt: u32,
        completion: u32,
        cached: u32,
        include_usage: bool,
        calls: Vec<usize>,
        done: bool,
    }
    let n = g.choices.len();
    let st = St {
        id: g.request_id.clone(),
        model,
        created: unix_now(),
        prompt: g.prompt_tokens,
        completion: 0,
        cached: 0,
        include_usage,
        calls: vec![0; n],
        done: false,
        pieces: merged(g.choices),
    };
    let chunk = |st: &St, index: u32, delta: Json, finish: Option<&str>| {
        data(&json!({"id": st.id, "object": "chat.completion.chunk", "created": st.created, "model": st.model,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": null}]}))
    };
    let first: Vec<Event> =
        (0..n as u32).map(|i| chunk(&st, i, json!({"role": "assistant", "content": ""}), None)).collect();
    let body = stream::unfold(st, move |mut st| async move {
        if st.done {
            return None;
        }
        let Some((index, pieces)) = st.pieces.next().await else {
            st.done = true;
            let mut out = Vec::new();
            if st.include_usage {
                out.push(data(&json!({"id": st.id, "object": "chat.completion.chunk", "created": st.created,
                    "model": st.model, "choices": [], "usage": usage(st.prompt, st.completion, st.cached)})));
            }
            out.push(Event::default().data("[DONE]"));
            return Some((out, st));
        };
        let mut out = Vec::new();
        for p in pieces {
            match p {
                Piece::Delta(OutputDelta::Content(t)) => out.push(chunk(&st, index, json!({"content": t}), None)),
                Piece::Delta(OutputDelta::Reasoning(t)) => {
                    out.push(chunk(&st, index, json!({"reasoning_content": t}), None))
                }
                Piece::Delta(OutputDelta::ToolCallStart { index: k, name }) => {
                    st.calls[index as usize] = st.calls[index as usize].max(k + 1);
                    let id = call_id(&st.id, index, k);
                    out.push(chunk(
                        &st,
                        index,
                        json!({"tool_calls": [{"index": k, "id": id, "type": "function",
                        "function": {"name": name, "arguments": ""}}]}),
                        None,
                    ));
                }
                Piece::Delta(OutputDelta::ToolCallArguments { index: k, delta }) => out.push(chunk(
                    &st,
                    index,
                    json!({"tool_calls": [{"index": k, "function": {"arguments": delta}}]}),
                    None,
                )),
                Piece::Delta(OutputDelta::ToolCallEnd { .. }) => {}
                Piece::Done(end) => {
                    st.completion += end.info.generated;
                    st.cached = st.cached.max(end.info.cached_tokens);
                    out.push(chunk(&st, index, json!({}), Some(end.finish_reason())));
                }
                Piece::Failed(e) => {
                    // Error event, no [DONE]; dropping the state cancels the other choices.
                    out.push(data(&e.body()));
                    st.done = true;
                    return Some((out, st));
                }
            }
        }
        Some((out, st))
    });
    let events = logged(stream::iter(first).chain(body.flat_map(stream::iter)), g.log).map(Ok::<_, Infallible>);
    Sse::new(events).keep_alive(KeepAlive::default())
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
    if !req.stream {
        let id = g.request_id.clone();
        let (ends, usage) = collect_choices(g).await?;
        let choices: Vec<Json> = ends
            .iter()
            .map(|(index, end)| {
                json!({"index": index, "text": end.parsed.content, "finish_reason": end.finish_reason(), "logprobs": null})
            })
            .collect();
        let body = json!({"id": id, "object": "text_completion", "created": unix_now(), "model": model,
            "choices": choices, "usage": usage});
        return Ok(axum::Json(body).into_response());
    }
    let (id, created, prompt, log) = (g.request_id.clone(), unix_now(), g.prompt_tokens, g.log);
    let pieces = merged(g.choices);
    let body = stream::unfold((pieces, 0u32, 0u32, false), move |(mut pieces, mut completion, mut cached, done)| {
        let (id, model) = (id.clone(), model.clone());
        async move {
            if done {
                return None;
            }
            let chunk = |index: u32, text: &str, finish: Option<&str>| {
                data(&json!({"id": id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": index, "text": text, "finish_reason": finish, "logprobs": null}]}))
            };
            let Some((index, ps)) = pieces.next().await else {
                let mut out = Vec::new();
                if include_usage {
                    out.push(data(&json!({"id": id, "object": "text_completion", "created": created, "model": model,
                        "choices": [], "usage": usage(prompt, completion, cached)})));
                }
                out.push(Event::default().data("[DONE]"));
                return Some((out, (pieces, completion, cached, true)));
            };
            let mut out = Vec::new();
            for p in ps {
                match p {
                    Piece::Delta(OutputDelta::Content(t)) => out.push(chunk(index, &t, None)),
                    Piece::Delta(_) => {}
                    Piece::Done(end) => {
                        completion += end.info.generated;
                        cached = cached.max(end.info.cached_tokens);
                        out.push(chunk(index, "", Some(end.finish_reason())));
                    }
                    Piece::Failed(e) => {
                        out.push(data(&e.body()));
                        return Some((out, (pieces, completion, cached, true)));
                    }
                }
            }
            Some((out, (pieces, completion, cached, false)))
        }
    });
    let events = logged(body.flat_map(stream::iter), log).map(Ok::<_, Infallible>);
    Ok(Sse::new(events).keep_alive(KeepAlive::default()).into_response())
}

/// The served model's object, under its first name.
fn model_object(state: &AppState) -> Json {
    let f = state.engine.frontend();
    // Every cap a request meets is stated: the context, the output cap (requests asking more
    // are clamped to it) and the output limit of a request that does not say.
    json!({"id": state.models[0], "object": "model", "created": state.started,
        "owned_by": "flare", "max_model_len": f.context_limit, "max_output_tokens": f.max_output_tokens,
        "default_max_tokens": f.sampling.max_output_tokens.min(f.max_output_tokens)})
}

pub(crate) async fn models(State(state): State<AppState>) -> Response {
    axum::Json(json!({"object": "list", "data": [model_object(&state)]})).into_response()
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
