//! `/health`, `/metrics`, `/tokenize`, `/detokenize`.

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use helios_worker::{ChatPrompt, Health, PromptInput};
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::params;
use helios_worker::ErrorCode;

pub(crate) async fn health(State(state): State<AppState>) -> Response {
    let health = state.engine.health();
    let body = match &health {
        Health::Ready => HealthBody { status: "ok", error: None },
        Health::Starting => HealthBody { status: "starting", error: None },
        Health::Draining => HealthBody { status: "draining", error: None },
        Health::Failed(why) => HealthBody { status: "failed", error: Some(why) },
    };
    let code = if matches!(health, Health::Ready) { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (code, axum::Json(body)).into_response()
}

/// `/health`'s body; `error` says why the engine failed.
#[derive(Debug, Serialize)]
struct HealthBody<'a> {
    status: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<&'a str>,
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
    let result: Result<Tokens, ApiError> = async {
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
        Ok(Tokens { count: tokens.len(), max_model_len: max, tokens })
    }
    .await;
    match result {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `/tokenize`'s answer.
#[derive(Debug, Serialize)]
struct Tokens {
    count: usize,
    max_model_len: u32,
    tokens: Vec<u32>,
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
        Ok(Ok(prompt)) => axum::Json(Detokenized { prompt }).into_response(),
        Ok(Err(e)) => ApiError::from_request(&e.into()).into_response(),
        Err(e) => ApiError::from_request(&e).into_response(),
    }
}

/// `/detokenize`'s answer.
#[derive(Debug, Serialize)]
struct Detokenized {
    prompt: String,
}

#[cfg(test)]
mod tests {
    use serde_json::{json, to_value};

    use super::*;

    #[test]
    fn health_names_the_failure_only_when_failed() {
        let starting = HealthBody { status: "starting", error: None };
        assert_eq!(to_value(starting).expect("json"), json!({"status": "starting"}));
        let failed = HealthBody { status: "failed", error: Some("core lost") };
        assert_eq!(to_value(failed).expect("json"), json!({"status": "failed", "error": "core lost"}));
    }
}
