//! A JSON body extractor whose rejections are typed API errors in the route's envelope.

use axum::extract::{FromRequest, Request};
use axum::http::{StatusCode, header};
use bytes::Bytes;
use serde::de::DeserializeOwned;

use crate::error::{ApiCode, ApiError, Flavor};

/// Which error envelope the route uses.
pub(crate) trait Envelope {
    const FLAVOR: Flavor;
}

#[derive(Debug)]
pub(crate) struct OpenAiEnvelope;
impl Envelope for OpenAiEnvelope {
    const FLAVOR: Flavor = Flavor::OpenAi;
}

#[derive(Debug)]
pub(crate) struct AnthropicEnvelope;
impl Envelope for AnthropicEnvelope {
    const FLAVOR: Flavor = Flavor::Anthropic;
}

/// `application/json` body deserialized into `T`.
#[derive(Debug)]
pub(crate) struct ApiJson<T, F = OpenAiEnvelope>(pub T, pub std::marker::PhantomData<F>);

impl<S, T, F> FromRequest<S> for ApiJson<T, F>
where
    S: Send + Sync,
    T: DeserializeOwned + Send + 'static,
    F: Envelope,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let json_type = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .map(|m| {
                let m = m.trim().to_ascii_lowercase();
                m == "application/json" || (m.starts_with("application/") && m.ends_with("+json"))
            });
        if json_type != Some(true) {
            return Err(ApiError::invalid(
                ApiCode::UnsupportedMediaType,
                None,
                "expected Content-Type: application/json",
            )
            .with_status(StatusCode::UNSUPPORTED_MEDIA_TYPE)
            .flavor(F::FLAVOR));
        }
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            if crate::serve::is_body_timeout(&e) {
                return ApiError::invalid(ApiCode::BodyTimeout, None, "the request body did not arrive in time")
                    .with_status(StatusCode::REQUEST_TIMEOUT)
                    .flavor(F::FLAVOR);
            }
            let status = e.status();
            let code =
                if status == StatusCode::PAYLOAD_TOO_LARGE { ApiCode::BodyTooLarge } else { ApiCode::InvalidBody };
            ApiError::invalid(code, None, e.body_text()).with_status(status).flavor(F::FLAVOR)
        })?;
        // Parsing costs about a millisecond per hundred KB: large bodies parse on a blocking
        // thread, so a few of them cannot occupy every async worker (and stall `/health`).
        let parsed = if bytes.len() < BLOCKING_PARSE_BYTES {
            serde_json::from_slice::<T>(&bytes)
        } else {
            tokio::task::spawn_blocking(move || serde_json::from_slice::<T>(&bytes)).await.map_err(|_| {
                ApiError::invalid(ApiCode::InvalidBody, None, "request body parsing was interrupted").flavor(F::FLAVOR)
            })?
        };
        let value = parsed.map_err(|e| {
            let code = if e.is_syntax() || e.is_eof() { ApiCode::InvalidJson } else { ApiCode::InvalidField };
            ApiError::invalid(code, None, format!("invalid request body: {e}")).flavor(F::FLAVOR)
        })?;
        Ok(ApiJson(value, std::marker::PhantomData))
    }
}

/// Bodies at least this large are parsed off the async worker threads.
const BLOCKING_PARSE_BYTES: usize = 64 << 10;
