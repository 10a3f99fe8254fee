//! helios-http: OpenAI (`/v1/chat/completions`, `/v1/completions`, `/v1/responses`,
//! `/v1/models`, `/v1/models/{id}`) and Anthropic (`/v1/messages`,
//! `/v1/messages/count_tokens`) APIs over a [`helios_worker::Engine`], plus `/tokenize`,
//! `/detokenize`, `/health` and `/metrics`; optionally behind an API key and with CORS for
//! listed origins ([`HttpOptions`]).
//!
//! Status mapping: request validation 400 (missing or wrong API key 401, unknown model 404, wrong content type 415,
//! oversized body 413, body too slow 408, wrong method 405, rejected `Host` 403), capacity or
//! worker unavailable 503 (always with `Retry-After`), execution failure 500. Every error
//! answer carries the route's JSON error envelope.
//! Generation responses send headers only after scheduler admission and always carry
//! `x-request-id`; after SSE headers a failure ends the stream with the protocol's
//! error event and no success marker. Dropping a response (client disconnect) cancels
//! its requests.
//!
//! [`serve`] runs a router on a listener with per-connection timeouts, a connection cap and
//! a bounded shutdown ([`ConnectionLimits`]).

mod access;
mod anthropic;
mod error;
mod extract;
mod generate;
mod host;
mod misc;
mod openai;
mod params;
mod responses;
mod serve;
mod sse;

use std::sync::Arc;

pub use access::{ApiKey, CorsPolicy};
use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::http::{Method, StatusCode, Uri};
use axum::routing::{get, post};
pub use error::{AnthropicError, ApiCode, ApiError, ErrorBody, Flavor, OpenAiError, escape_for_log};
use helios_worker::Engine;
pub use host::HostPolicy;
pub use serve::{ConnectionLimits, ServeError, serve};

/// Shared handler state.
#[derive(Clone, Debug)]
pub struct AppState {
    pub engine: Arc<Engine>,
    /// Unix time the server started (model `created`).
    pub started: u64,
    /// Names accepted as `model`; the first is the one listed and reported.
    pub models: Arc<[String]>,
}

/// Router options.
#[derive(Clone, Debug)]
pub struct HttpOptions {
    /// Largest accepted request body.
    pub max_body_bytes: usize,
    /// Which `Host` values are served (see [`HostPolicy::for_bind`]).
    pub host_policy: HostPolicy,
    /// The key every route but `/health` and `/metrics` requires (`Authorization: Bearer` or
    /// `x-api-key`); `None`: open.
    pub api_key: Option<ApiKey>,
    /// Which origins get CORS headers.
    pub cors: CorsPolicy,
    /// Names accepted as `model` in requests; the first is what `/v1/models` lists and
    /// responses report. Empty: the engine's model name alone.
    pub served_model_names: Vec<String>,
}

impl Default for HttpOptions {
    /// 32 MiB bodies, any `Host`, no key, no CORS, the engine's model name.
    fn default() -> Self {
        HttpOptions {
            max_body_bytes: 32 << 20,
            host_policy: HostPolicy::Any,
            api_key: None,
            cors: CorsPolicy::Off,
            served_model_names: Vec::new(),
        }
    }
}

/// All routes over `engine`.
pub fn router(engine: Arc<Engine>, options: HttpOptions) -> Router {
    let mut models: Vec<String> = Vec::new();
    for name in &options.served_model_names {
        if !name.is_empty() && !models.contains(name) {
            models.push(name.clone());
        }
    }
    if models.is_empty() {
        models.push(engine.frontend().model_name.clone());
    }
    let state = AppState { engine, started: generate::unix_now(), models: models.into() };
    let router = Router::new()
        .route("/v1/chat/completions", post(openai::chat))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/responses", post(responses::responses))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/models", get(openai::models))
        // A wildcard: model names may contain `/` (`org/model`).
        .route("/v1/models/{*id}", get(openai::model))
        .route("/tokenize", post(misc::tokenize))
        .route("/detokenize", post(misc::detokenize))
        .route("/health", get(misc::health))
        .route("/metrics", get(misc::metrics))
        .fallback(|uri: Uri| async move {
            ApiError::invalid(ApiCode::NotFound, None, "no such route")
                .with_status(StatusCode::NOT_FOUND)
                .flavor(Flavor::for_path(uri.path()))
        })
        // After the routes: it applies to the routes present. axum adds `Allow`.
        .method_not_allowed_fallback(|method: Method, uri: Uri| async move {
            ApiError::invalid(ApiCode::MethodNotAllowed, None, format!("{method} is not allowed on this route"))
                .with_status(StatusCode::METHOD_NOT_ALLOWED)
                .flavor(Flavor::for_path(uri.path()))
        })
        .layer(DefaultBodyLimit::max(options.max_body_bytes))
        .with_state(state);
    // Outermost last: the Host guard, then CORS (a preflight needs no key, and a 401 carries
    // the CORS headers a page needs to read it), then the key.
    let router = match options.api_key {
        Some(key) => router.layer(axum::middleware::from_fn_with_state(key, access::require_key)),
        None => router,
    };
    let router = match options.cors {
        CorsPolicy::Off => router,
        policy => router.layer(axum::middleware::from_fn_with_state(Arc::new(policy), access::cors)),
    };
    match options.host_policy {
        HostPolicy::Any => router,
        policy => router.layer(axum::middleware::from_fn_with_state(Arc::new(policy), host::check_host)),
    }
}
