//! helios-http: OpenAI (`/v1/chat/completions`, `/v1/completions`, `/v1/responses`,
//! `/v1/models`) and Anthropic (`/v1/messages`) APIs over a [`helios_worker::Engine`],
//! plus `/tokenize`, `/detokenize`, `/health` and `/metrics`.
//!
//! Status mapping: request validation 400 (unknown model 404, wrong content type 415,
//! oversized body 413), capacity or worker unavailable 503, execution failure 500.
//! Generation responses send headers only after scheduler admission and always carry
//! `x-request-id`; after SSE headers a failure ends the stream with the protocol's
//! error event and no success marker. Dropping a response (client disconnect) cancels
//! its requests.

mod anthropic;
mod error;
mod extract;
mod generate;
mod misc;
mod openai;
mod params;
mod responses;

use std::sync::Arc;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
pub use error::{ApiError, Flavor};
use helios_worker::Engine;

/// Shared handler state.
#[derive(Clone, Debug)]
pub struct AppState {
    pub engine: Arc<Engine>,
    /// Unix time the server started (model `created`).
    pub started: u64,
}

/// Router options.
#[derive(Clone, Copy, Debug)]
pub struct HttpOptions {
    /// Largest accepted request body.
    pub max_body_bytes: usize,
}

impl Default for HttpOptions {
    fn default() -> Self {
        HttpOptions { max_body_bytes: 32 << 20 }
    }
}

/// All routes over `engine`.
pub fn router(engine: Arc<Engine>, options: HttpOptions) -> Router {
    let state = AppState { engine, started: generate::unix_now() };
    Router::new()
        .route("/v1/chat/completions", post(openai::chat))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/responses", post(responses::responses))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/models", get(openai::models))
        .route("/tokenize", post(misc::tokenize))
        .route("/detokenize", post(misc::detokenize))
        .route("/health", get(misc::health))
        .route("/metrics", get(misc::metrics))
        .fallback(|| async {
            ApiError::invalid("not_found", None, "no such route").with_status(axum::http::StatusCode::NOT_FOUND)
        })
        .layer(DefaultBodyLimit::max(options.max_body_bytes))
        .with_state(state)
}
