//! API errors: typed codes mapped to status codes and each protocol's error envelope.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use helios_worker::{ErrorClass, RequestError};
use serde_json::json;

/// Which envelope an error is rendered in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    OpenAi,
    Anthropic,
}

/// An error response.
#[derive(Clone, Debug)]
pub struct ApiError {
    pub status: StatusCode,
    /// OpenAI `type` (`invalid_request_error`, …).
    pub kind: &'static str,
    pub code: &'static str,
    pub message: String,
    pub param: Option<String>,
    pub flavor: Flavor,
    pub request_id: Option<String>,
}

impl ApiError {
    pub fn invalid(code: &'static str, param: Option<&str>, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            code,
            message: message.into(),
            param: param.map(str::to_owned),
            flavor: Flavor::OpenAi,
            request_id: None,
        }
    }

    pub fn with_status(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }

    pub fn model_not_found(model: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "not_found_error",
            ..ApiError::invalid("model_not_found", Some("model"), format!("the model `{model}` does not exist"))
        }
    }

    pub fn flavor(mut self, flavor: Flavor) -> Self {
        self.flavor = flavor;
        self
    }

    pub fn request_id(mut self, id: &str) -> Self {
        self.request_id = Some(id.to_owned());
        self
    }

    /// Maps a worker failure: validation 400, capacity or worker unavailable 503, execution 500.
    pub fn from_request(e: &RequestError) -> Self {
        let (status, kind) = match e.class() {
            ErrorClass::InvalidRequest => (StatusCode::BAD_REQUEST, "invalid_request_error"),
            ErrorClass::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "service_unavailable_error"),
            ErrorClass::Execution => (StatusCode::INTERNAL_SERVER_ERROR, "server_error"),
        };
        ApiError {
            status,
            kind,
            code: e.code(),
            message: e.to_string(),
            param: e.param().map(str::to_owned),
            flavor: Flavor::OpenAi,
            request_id: None,
        }
    }

    fn anthropic_type(&self) -> &'static str {
        match self.status {
            StatusCode::BAD_REQUEST | StatusCode::UNSUPPORTED_MEDIA_TYPE | StatusCode::PAYLOAD_TOO_LARGE => {
                "invalid_request_error"
            }
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
            _ => "api_error",
        }
    }

    /// The JSON body in this error's envelope.
    pub fn body(&self) -> serde_json::Value {
        match self.flavor {
            Flavor::OpenAi => json!({"error": {
                "message": self.message, "type": self.kind, "param": self.param, "code": self.code}}),
            Flavor::Anthropic => json!({"type": "error", "error": {
                "type": self.anthropic_type(), "message": self.message, "code": self.code}}),
        }
    }

    /// Logs the failure with its request id, stage and typed code.
    pub fn log(&self, stage: &str) {
        let id = self.request_id.as_deref().unwrap_or("-");
        if self.status.is_server_error() {
            tracing::warn!(
                request_id = id,
                stage,
                code = self.code,
                status = self.status.as_u16(),
                "request failed: {}",
                self.message
            );
        } else {
            tracing::info!(
                request_id = id,
                stage,
                code = self.code,
                status = self.status.as_u16(),
                "request rejected: {}",
                self.message
            );
        }
    }
}

impl From<RequestError> for ApiError {
    fn from(e: RequestError) -> Self {
        ApiError::from_request(&e)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(id) = self.request_id.as_deref().and_then(|id| HeaderValue::from_str(id).ok()) {
            r.headers_mut().insert("x-request-id", id);
        }
        r
    }
}
