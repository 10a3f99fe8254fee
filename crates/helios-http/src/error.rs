//! API errors: typed codes mapped to status codes and each protocol's error envelope.

use std::borrow::Cow;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use helios_worker::{ErrorClass, ErrorCode, RequestError};
use serde::Serialize;

/// Which envelope an error is rendered in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    OpenAi,
    Anthropic,
}

impl Flavor {
    /// The envelope of the API a path belongs to, for errors raised before any route runs
    /// (wrong method, rejected Host, unknown path): Anthropic under `/v1/messages`.
    pub fn for_path(path: &str) -> Flavor {
        if path == "/v1/messages" || path.starts_with("/v1/messages/") { Flavor::Anthropic } else { Flavor::OpenAi }
    }
}

macro_rules! api_codes {
    ($($variant:ident => $text:literal,)+) => {
        /// Every code an API error carries: the HTTP layer's own, and the worker's
        /// ([`ErrorCode`]) for failures it reports.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum ApiCode {
            $($variant,)+
            Request(ErrorCode),
        }

        impl ApiCode {
            /// The HTTP layer's own codes, in declaration order.
            pub const HTTP: &'static [ApiCode] = &[$(ApiCode::$variant,)+];

            /// The wire form (snake case).
            pub fn as_str(self) -> &'static str {
                match self {
                    $(ApiCode::$variant => $text,)+
                    ApiCode::Request(code) => code.as_str(),
                }
            }
        }
    };
}

api_codes! {
        BodyTimeout => "body_timeout",
        BodyTooLarge => "body_too_large",
        EmptyMessages => "empty_messages",
        HostNotAllowed => "host_not_allowed",
        InvalidApiKey => "invalid_api_key",
        InvalidBody => "invalid_body",
        InvalidContent => "invalid_content",
        InvalidField => "invalid_field",
        InvalidInput => "invalid_input",
        InvalidJson => "invalid_json",
        InvalidMessage => "invalid_message",
        InvalidPrompt => "invalid_prompt",
        InvalidResponseFormat => "invalid_response_format",
        InvalidRole => "invalid_role",
        InvalidToolChoice => "invalid_tool_choice",
        InvalidTools => "invalid_tools",
        MethodNotAllowed => "method_not_allowed",
        MissingApiKey => "missing_api_key",
        ModelNotFound => "model_not_found",
        NotFound => "not_found",
        TooManyConnections => "too_many_connections",
        UnsupportedContent => "unsupported_content",
        UnsupportedMediaType => "unsupported_media_type",
        UnsupportedParameter => "unsupported_parameter",
        UnsupportedTool => "unsupported_tool",
}

impl From<ErrorCode> for ApiCode {
    fn from(code: ErrorCode) -> Self {
        ApiCode::Request(code)
    }
}

/// An error response.
#[derive(Clone, Debug)]
pub struct ApiError {
    pub status: StatusCode,
    /// OpenAI `type` (`invalid_request_error`, …).
    pub kind: &'static str,
    pub code: ApiCode,
    pub message: String,
    pub param: Option<String>,
    pub flavor: Flavor,
    pub request_id: Option<String>,
}

impl ApiError {
    pub fn invalid(code: impl Into<ApiCode>, param: Option<&str>, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            code: code.into(),
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
            ..ApiError::invalid(ApiCode::ModelNotFound, Some("model"), format!("the model `{model}` does not exist"))
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
            code: e.code().into(),
            message: e.to_string(),
            param: e.param().map(str::to_owned),
            flavor: Flavor::OpenAi,
            request_id: None,
        }
    }

    fn anthropic_type(&self) -> &'static str {
        match self.status {
            StatusCode::BAD_REQUEST
            | StatusCode::UNSUPPORTED_MEDIA_TYPE
            | StatusCode::PAYLOAD_TOO_LARGE
            | StatusCode::METHOD_NOT_ALLOWED
            | StatusCode::REQUEST_TIMEOUT
            | StatusCode::MISDIRECTED_REQUEST => "invalid_request_error",
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::FORBIDDEN => "permission_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
            _ => "api_error",
        }
    }

    /// The body in this error's envelope.
    pub fn body(&self) -> ErrorBody<'_> {
        let code = self.code.as_str();
        match self.flavor {
            Flavor::OpenAi => ErrorBody::OpenAi {
                error: OpenAiError { message: &self.message, kind: self.kind, param: self.param.as_deref(), code },
            },
            Flavor::Anthropic => ErrorBody::Anthropic {
                kind: "error",
                error: AnthropicError { kind: self.anthropic_type(), message: &self.message, code },
            },
        }
    }
}

/// An error body: an answer's whole body, or a stream's error event.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum ErrorBody<'a> {
    /// `{"error": {...}}`.
    OpenAi { error: OpenAiError<'a> },
    /// `{"type": "error", "error": {...}}`.
    Anthropic {
        #[serde(rename = "type")]
        kind: &'static str,
        error: AnthropicError<'a>,
    },
}

/// OpenAI's error object; `param` is `null` when no parameter is to blame.
#[derive(Debug, Serialize)]
pub struct OpenAiError<'a> {
    pub message: &'a str,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub param: Option<&'a str>,
    pub code: &'static str,
}

/// Anthropic's error object; `type` follows the status, `code` (ours) names the failure.
#[derive(Debug, Serialize)]
pub struct AnthropicError<'a> {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub message: &'a str,
    pub code: &'static str,
}

impl From<RequestError> for ApiError {
    fn from(e: RequestError) -> Self {
        ApiError::from_request(&e)
    }
}

/// Every 503 tells clients when to retry (capacity frees up within moments, or the server is
/// going away and a restart takes about that long).
const RETRY_AFTER_SECS: &str = "1";

impl IntoResponse for ApiError {
    /// The envelope as JSON, with `x-request-id` when known, `Retry-After` on 503, and
    /// `Connection: close` on 408 (the rest of an unread body would otherwise be taken for
    /// the next request).
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        let headers = r.headers_mut();
        if let Some(id) = self.request_id.as_deref().and_then(|id| HeaderValue::from_str(id).ok()) {
            headers.insert("x-request-id", id);
        }
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            headers.insert(header::RETRY_AFTER, HeaderValue::from_static(RETRY_AFTER_SECS));
        }
        if self.status == StatusCode::REQUEST_TIMEOUT {
            headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        r
    }
}

/// `text` with control characters (line breaks included), Unicode line separators and
/// bidirectional overrides escaped (`\n`, `\u{202e}`), so client-derived text stays on one
/// log line and reads as what it is. Borrowed when there is nothing to escape.
pub fn escape_for_log(text: &str) -> Cow<'_, str> {
    fn needs(c: char) -> bool {
        c.is_control() || matches!(c, '\u{2028}' | '\u{2029}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
    }
    if !text.chars().any(needs) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if needs(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn http_codes_are_distinct_and_apart_from_the_workers() {
        let worker: std::collections::HashSet<&str> = ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
        let mut seen = std::collections::HashSet::new();
        for code in ApiCode::HTTP {
            let s = code.as_str();
            assert!(seen.insert(s) && !worker.contains(s), "{s} twice");
        }
        assert_eq!(ApiCode::from(ErrorCode::QueueFull).as_str(), "queue_full");
    }

    #[test]
    fn log_text_has_no_raw_control_characters() {
        assert!(matches!(escape_for_log("plain text, ünïcode"), Cow::Borrowed(_)));
        let forged = "a\nINFO fake line\r\t\u{1b}[31m\u{202e}x";
        let escaped = escape_for_log(forged);
        assert_eq!(escaped, "a\\nINFO fake line\\r\\t\\u{1b}[31m\\u{202e}x");
        assert!(!escaped.chars().any(char::is_control));
    }

    #[test]
    fn every_503_carries_retry_after_and_408_closes() {
        let r = ApiError::invalid(ErrorCode::QueueFull, None, "busy")
            .with_status(StatusCode::SERVICE_UNAVAILABLE)
            .into_response();
        assert_eq!(r.headers().get(header::RETRY_AFTER).map(HeaderValue::as_bytes), Some(&b"1"[..]));
        let r = ApiError::from_request(&helios_worker::RequestError::Unavailable(helios_worker::Unavailable::Draining))
            .into_response();
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(r.headers().contains_key(header::RETRY_AFTER));
        let r = ApiError::invalid(ApiCode::BodyTimeout, None, "slow")
            .with_status(StatusCode::REQUEST_TIMEOUT)
            .into_response();
        assert_eq!(r.headers().get(header::CONNECTION).map(HeaderValue::as_bytes), Some(&b"close"[..]));
        assert!(!r.headers().contains_key(header::RETRY_AFTER));
        let r = ApiError::invalid(ApiCode::InvalidJson, None, "bad").into_response();
        assert!(!r.headers().contains_key(header::RETRY_AFTER));
    }

    #[test]
    fn envelopes_keep_their_fields_and_nulls() {
        let e = ApiError::invalid(ApiCode::InvalidJson, None, "bad");
        assert_eq!(
            serde_json::to_value(e.body()).expect("json"),
            json!({"error": {"message": "bad", "type": "invalid_request_error", "param": null, "code": "invalid_json"}})
        );
        let e = ApiError::model_not_found("m").flavor(Flavor::Anthropic);
        assert_eq!(
            serde_json::to_value(e.body()).expect("json"),
            json!({"type": "error", "error": {"type": "not_found_error", "message": "the model `m` does not exist",
                "code": "model_not_found"}})
        );
        let e = ApiError::model_not_found("m");
        assert_eq!(serde_json::to_value(e.body()).expect("json")["error"]["param"], json!("model"));
    }
}
