//! Access control: the API key (`--api-key`) and CORS (`--allowed-origins`).
//!
//! With a key, every route but `/health` and `/metrics` needs `Authorization: Bearer KEY` or
//! `x-api-key: KEY` (the Anthropic SDK's header); anything else is answered 401 in the route's
//! error envelope. `/health` and `/metrics` stay open, as in vLLM, so that probes and
//! Prometheus scrapers need no secret; `/tokenize` and `/detokenize` (which run work on the
//! preparation threads) are protected, unlike vLLM, which guards `/v1/*` only.
//!
//! CORS headers are sent only to listed origins (none by default): a preflight (`OPTIONS` with
//! `Access-Control-Request-Method`) from one is answered 204 before the key check (browsers
//! send no credentials on a preflight); other requests from one are served as usual, plus
//! `Access-Control-Allow-Origin`. Requests from other origins get no CORS headers, so a
//! browser does not let the calling page read the answer.

use std::sync::Arc;

use axum::extract::Request;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::{ApiCode, ApiError, Flavor, escape_for_log};

/// The key requests must present. Its `Debug` form does not show it.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(Arc<[u8]>);

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

impl ApiKey {
    /// A key: not empty, no surrounding whitespace (HTTP strips it from header values, so
    /// such a key could never match), no control characters.
    pub fn new(key: &str) -> Result<ApiKey, String> {
        if key.is_empty() {
            return Err("the API key must not be empty".into());
        }
        if key.trim() != key {
            return Err("the API key must not start or end with whitespace".into());
        }
        if key.chars().any(char::is_control) {
            return Err("the API key must not contain control characters".into());
        }
        Ok(ApiKey(key.as_bytes().into()))
    }

    /// Whether `given` is the key, in time that depends only on `given`'s length (never on
    /// how much of it matches, nor on the key's length).
    pub fn matches(&self, given: &[u8]) -> bool {
        let key = &self.0;
        let mut diff = key.len() ^ given.len();
        for (i, &b) in given.iter().enumerate() {
            // `key` is never empty (see `new`).
            diff |= usize::from(key[i % key.len()] ^ b);
            diff = std::hint::black_box(diff);
        }
        diff == 0
    }

    /// Whether the request's headers carry the key (any `Authorization: Bearer` or
    /// `x-api-key` value that matches), and whether they carried any credential at all.
    fn check(&self, headers: &HeaderMap) -> (bool, bool) {
        let mut presented = false;
        let mut ok = false;
        for v in headers.get_all(header::AUTHORIZATION) {
            presented = true;
            let v = v.as_bytes();
            // `Bearer` is case-insensitive (RFC 9110 auth schemes), then one or more spaces.
            if v.len() > 7 && v[..6].eq_ignore_ascii_case(b"bearer") && v[6] == b' ' {
                ok |= self.matches(v[7..].trim_ascii());
            }
        }
        for v in headers.get_all("x-api-key") {
            presented = true;
            ok |= self.matches(v.as_bytes().trim_ascii());
        }
        (ok, presented)
    }
}

/// Paths served without the key.
fn is_open(path: &str) -> bool {
    matches!(path, "/health" | "/metrics")
}

/// Middleware answering 401 to requests without the key (see the module docs).
pub(crate) async fn require_key(
    axum::extract::State(key): axum::extract::State<ApiKey>,
    req: Request,
    next: Next,
) -> Response {
    if is_open(req.uri().path()) {
        return next.run(req).await;
    }
    let (ok, presented) = key.check(req.headers());
    if ok {
        return next.run(req).await;
    }
    let flavor = Flavor::for_path(req.uri().path());
    let (code, message) = if presented {
        (ApiCode::InvalidApiKey, "invalid API key")
    } else {
        (
            ApiCode::MissingApiKey,
            "this server requires an API key: send `Authorization: Bearer KEY` or `x-api-key: KEY`",
        )
    };
    tracing::info!(
        path = %escape_for_log(req.uri().path()),
        reason = code.as_str(),
        "request rejected: no valid API key"
    );
    // OpenAI answers `invalid_request_error`/`invalid_api_key`; the Anthropic envelope says
    // `authentication_error` (see `ApiError::body`).
    let mut response =
        ApiError::invalid(code, None, message).with_status(StatusCode::UNAUTHORIZED).flavor(flavor).into_response();
    response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

/// Which origins get CORS headers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum CorsPolicy {
    /// None: no CORS headers, preflights are not answered (the default).
    #[default]
    Off,
    /// Every origin (`--allowed-origins '*'`): `Access-Control-Allow-Origin: *`.
    Any,
    /// These origins (`scheme://host[:port]`, compared ASCII case-insensitively): the
    /// request's `Origin` is echoed, with `Vary: Origin`.
    Origins(Vec<String>),
}

impl CorsPolicy {
    /// The policy for an `--allowed-origins` list: empty is [`CorsPolicy::Off`], `*` anywhere
    /// is [`CorsPolicy::Any`]; each other entry must be an origin, `scheme://host[:port]` (a
    /// trailing `/` is dropped) or `null`.
    pub fn from_list(origins: &[String]) -> Result<CorsPolicy, String> {
        let mut out = Vec::new();
        let mut any = false;
        for o in origins.iter().map(|o| o.trim()).filter(|o| !o.is_empty()) {
            if o == "*" {
                any = true;
                continue;
            }
            let o = o.strip_suffix('/').unwrap_or(o).to_ascii_lowercase();
            let valid = o == "null"
                || o.split_once("://").is_some_and(|(scheme, rest)| {
                    !scheme.is_empty()
                        && scheme.bytes().all(|b| b.is_ascii_alphanumeric() || b"+-.".contains(&b))
                        && !rest.is_empty()
                        && !rest.contains(['/', '?', '#', ' ', '*'])
                });
            if !valid {
                return Err(format!("`{o}` is not an origin (scheme://host[:port], without a path) nor `*`"));
            }
            if !out.contains(&o) {
                out.push(o);
            }
        }
        Ok(if any {
            CorsPolicy::Any
        } else if out.is_empty() {
            CorsPolicy::Off
        } else {
            CorsPolicy::Origins(out)
        })
    }

    /// The `Access-Control-Allow-Origin` value for a request from `origin`, if it is allowed.
    fn allow(&self, origin: &HeaderValue) -> Option<HeaderValue> {
        match self {
            CorsPolicy::Off => None,
            CorsPolicy::Any => Some(HeaderValue::from_static("*")),
            CorsPolicy::Origins(list) => {
                let o = origin.to_str().ok()?.trim().to_ascii_lowercase();
                list.contains(&o).then(|| origin.clone())
            }
        }
    }
}

/// Request headers a preflight is always told are allowed; the headers a preflight asks for
/// (`Access-Control-Request-Headers`, such as the SDKs' `x-stainless-*` and
/// `anthropic-version`) are allowed as well, as the origin is what the check is about.
const ALLOWED_HEADERS: &str = "authorization, x-api-key, content-type, x-request-id";
const ALLOWED_METHODS: &str = "GET, POST, OPTIONS";
/// Response headers the calling page may read.
const EXPOSED_HEADERS: &str = "x-request-id, retry-after";
/// Seconds a browser may cache a preflight answer.
const PREFLIGHT_MAX_AGE: &str = "600";

/// Middleware applying the CORS policy (see the module docs).
pub(crate) async fn cors(
    axum::extract::State(policy): axum::extract::State<Arc<CorsPolicy>>,
    req: Request,
    next: Next,
) -> Response {
    let allowed = req.headers().get(header::ORIGIN).and_then(|o| policy.allow(o));
    let vary = matches!(*policy, CorsPolicy::Origins(_));
    let preflight =
        req.method() == Method::OPTIONS && req.headers().contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    let mut response = match (&allowed, preflight) {
        (Some(_), true) => {
            let mut r = StatusCode::NO_CONTENT.into_response();
            let h = r.headers_mut();
            let requested = req
                .headers()
                .get_all(header::ACCESS_CONTROL_REQUEST_HEADERS)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .flat_map(|v| v.split(','))
                .map(|n| n.trim().to_ascii_lowercase())
                .filter(|n| !n.is_empty() && n.bytes().all(is_token_byte))
                .filter(|n| !ALLOWED_HEADERS.split(", ").any(|a| a == n))
                .fold(String::from(ALLOWED_HEADERS), |mut all, n| {
                    all.push_str(", ");
                    all.push_str(&n);
                    all
                });
            if let Ok(v) = HeaderValue::from_str(&requested) {
                h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, v);
            }
            h.insert(header::ACCESS_CONTROL_ALLOW_METHODS, HeaderValue::from_static(ALLOWED_METHODS));
            h.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static(PREFLIGHT_MAX_AGE));
            r
        }
        (Some(_), false) => {
            let mut r = next.run(req).await;
            r.headers_mut().insert(header::ACCESS_CONTROL_EXPOSE_HEADERS, HeaderValue::from_static(EXPOSED_HEADERS));
            r
        }
        (None, _) => next.run(req).await,
    };
    let h = response.headers_mut();
    if let Some(origin) = allowed {
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    }
    if vary {
        h.append(header::VARY, HeaderValue::from_static("origin"));
    }
    response
}

/// RFC 9110 `tchar`.
fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_matches_only_itself() {
        let key = ApiKey::new("sk-secret").expect("key");
        assert!(key.matches(b"sk-secret"));
        for wrong in [&b""[..], b"sk-secre", b"sk-secret2", b"sk-secreT", b"sk-secretsk-secret", b"x"] {
            assert!(!key.matches(wrong), "{}", String::from_utf8_lossy(wrong));
        }
        assert!(ApiKey::new("").is_err());
        assert!(ApiKey::new(" k").is_err());
        assert!(ApiKey::new("k\n").is_err());
        assert_eq!(format!("{key:?}"), "ApiKey(<redacted>)");
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut h = HeaderMap::new();
            for (k, v) in pairs {
                h.append(*k, HeaderValue::from_static(v));
            }
            h
        };
        assert_eq!(key.check(&headers(&[("authorization", "Bearer sk-secret")])), (true, true));
        assert_eq!(key.check(&headers(&[("authorization", "bearer  sk-secret")])), (true, true));
        assert_eq!(key.check(&headers(&[("x-api-key", "sk-secret")])), (true, true));
        assert_eq!(key.check(&headers(&[("authorization", "Basic sk-secret")])), (false, true));
        assert_eq!(key.check(&headers(&[("authorization", "Bearer nope")])), (false, true));
        assert_eq!(key.check(&headers(&[])), (false, false));
    }

    #[test]
    fn origins_are_parsed_and_matched_exactly() {
        let p = CorsPolicy::from_list(&["https://App.example.com/".into(), "http://localhost:3000".into()])
            .expect("policy");
        let allow =
            |o: &'static str| p.allow(&HeaderValue::from_static(o)).map(|v| v.to_str().unwrap_or("").to_owned());
        assert_eq!(allow("https://app.example.com").as_deref(), Some("https://app.example.com"));
        assert_eq!(allow("http://localhost:3000").as_deref(), Some("http://localhost:3000"));
        assert_eq!(allow("http://localhost:3001"), None);
        assert_eq!(allow("https://app.example.com.evil.com"), None);
        assert_eq!(CorsPolicy::from_list(&[]), Ok(CorsPolicy::Off));
        assert_eq!(CorsPolicy::from_list(&["https://a.com".into(), "*".into()]), Ok(CorsPolicy::Any));
        assert!(CorsPolicy::from_list(&["a.com".into(), "*".into()]).is_err());
        assert!(CorsPolicy::from_list(&["example.com".into()]).is_err());
        assert!(CorsPolicy::from_list(&["https://example.com/path".into()]).is_err());
    }
}
