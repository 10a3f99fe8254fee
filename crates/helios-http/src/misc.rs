//! `/health`, `/metrics`, `/tokenize`, `/detokenize`.

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use helios_worker::{ChatPrompt, Health, PromptInput};
use serde::Deserialize;
use serde_json::{Value as Json, json};

use crate::AppState;
use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::params;
use helios_worker::ErrorCode;

pub(crate) async fn health(State(state): State<AppState>) -> Response {
    match state.engine.health() {
        Health::Ready => (StatusCode::OK, axum::Json(json!({"status": "ok"}))).into_response(),
        Health::Starting => {
            (StatusCode::SERVICE_UNAVAILABLE, axum::Json(json!({"status": "starting"}))).into_response()
        }
        Health::Draining => {
            (StatusCode::SERVICE_UNAVAILABLE, axum::Json(json!({"status": "draining"}))).into_response()
        }
        Health::Failed(why) => {
            (StatusCode::SERVICE_UNAVAILABLE, axum::Json(json!({"status": "failed", "error": why}))).into_response()
        }
    }
}

pub(crate) async fn metrics(State(state): State<AppState>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], state.engine.metrics_text()).into_response()
}

#[derive(Debug, Deserialize)]
pub(crate) struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<Json>>,
    pub tools: Option<Vec<Json>>,
    #[serde(default)]
    pub add_special_tokens: bool,
    #[serde(default = "yes")]
    pub add_generation_prompt: bool,
}

fn yes() -> bool {
    true
}

pub(crate) async fn tokenize(State(state): State<AppState>, ApiJson(req, _): ApiJson<TokenizeRequest>) -> Response {
    let result: Result<Json, ApiError> = async {
        if let Some(m) = &req.model {
            crate::openai::check_model(&state, m, crate::error::Flavor::OpenAi)?;
        }
        let prompt = match (req.prompt, req.messages) {
            (Some(p), None) => PromptInput::Text(p),
            (None, Some(m)) => PromptInput::Chat(ChatPrompt {
                messages: params::normalize_messages(m)?,
                tools: params::tools(req.tools)?,
                tool_choice: helios_frontend::ToolChoice::Auto,
                continue_final_message: !req.add_generation_prompt,
                template_kwargs: Default::default(),
            }),
            _ => {
                return Err(ApiError::invalid(
                    ErrorCode::InvalidParameter,
                    None,
                    "send exactly one of `prompt` or `messages`",
                ));
            }
        };
        let add_special = req.add_special_tokens;
        let tokens =
            state.engine.run_prep(move |f, cancel| helios_worker::tokenize(f, prompt, add_special, cancel)).await??;
        let max = state.engine.frontend().context_limit;
        Ok(json!({"count": tokens.len(), "max_model_len": max, "tokens": tokens}))
    }
    .await;
    match result {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

#[derive(Debug, Deserialize)]
pub(crate) struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

pub(crate) async fn detokenize(State(state): State<AppState>, ApiJson(req, _): ApiJson<DetokenizeRequest>) -> Response {
    if let Some(m) = &req.model
        && let Err(e) = crate::openai::check_model(&state, m, crate::error::Flavor::OpenAi)
    {
        return e.into_response();
    }
    let vocab = state.engine.frontend().vocab_size;
    if let Some(&t) = req.tokens.iter().find(|&&t| t >= vocab) {
        return ApiError::invalid(
            ErrorCode::TokenOutOfVocabulary,
            Some("tokens"),
            format!("token {t} outside the vocabulary of {vocab}"),
        )
        .into_response();
    }
    let tokens = req.tokens;
    let r = state.engine.run_prep(move |f, _| f.tokenizer.decode(&tokens, false)).await;
    match r {
        Ok(Ok(prompt)) => axum::Json(json!({"prompt": prompt})).into_response(),
        Ok(Err(e)) => ApiError::from_request(&e.into()).into_response(),
        Err(e) => ApiError::from_request(&e).into_response(),
    }
}
