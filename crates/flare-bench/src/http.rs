//! Plain-HTTP/1.1 client plumbing: one TCP connection per request, so every stream's timing and
//! backpressure are its own, and dropping a stream really closes its socket.

use crate::error::BenchError;
use crate::sse::{SseParser, StreamItem, classify, error_summary, truncate};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::client::conn::http1;
use hyper::header::{CONTENT_TYPE, HOST};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use std::collections::HashSet;
use std::time::{Duration, Instant};
use tokio::net::TcpSocket;
use tokio::task::JoinHandle;

/// Responses read whole are capped at this many bytes.
const MAX_BODY: usize = 16 << 20;

/// Where requests go: `http://host[:port][/prefix]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    host: String,
    port: u16,
    prefix: String,
}

impl Target {
    /// Parses a plain-HTTP URL. A path (for example `/api`) is prepended to every endpoint
    /// path; a trailing `/v1` is dropped because endpoint paths already start with `/v1`.
    pub fn parse(url: &str) -> Result<Self, BenchError> {
        let bad = |reason: &str| BenchError::Url { url: url.to_string(), reason: reason.to_string() };
        let rest = url.strip_prefix("http://").ok_or_else(|| {
            if url.starts_with("https://") {
                bad("https is not supported (local http only)")
            } else {
                bad("expected http://")
            }
        })?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        if authority.is_empty() || authority.contains('@') {
            return Err(bad("missing or unsupported host"));
        }
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let end = v6.find(']').ok_or_else(|| bad("unterminated IPv6 address"))?;
            let port = v6[end + 1..].strip_prefix(':');
            (v6[..end].to_string(), port)
        } else {
            match authority.rsplit_once(':') {
                Some((h, p)) => (h.to_string(), Some(p)),
                None => (authority.to_string(), None),
            }
        };
        let port = match port {
            Some(p) => p.parse::<u16>().map_err(|_| bad("invalid port"))?,
            None => 80,
        };
        if host.is_empty() {
            return Err(bad("empty host"));
        }
        let mut prefix = path.trim_end_matches('/').to_string();
        if prefix.ends_with("/v1") {
            prefix.truncate(prefix.len() - 3);
        }
        if prefix.contains(['?', '#']) {
            return Err(bad("query strings and fragments are not supported"));
        }
        Ok(Self { host, port, prefix })
    }

    /// `host:port` for connecting (IPv6 hosts bracketed).
    pub fn addr(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// The full request path for an endpoint path such as `/v1/models`.
    pub fn path(&self, endpoint: &str) -> String {
        format!("{}{}", self.prefix, endpoint)
    }
}

/// Socket options for a connection.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ConnOptions {
    /// `SO_RCVBUF`, so a slow reader's kernel buffer fills quickly.
    pub recv_buffer: Option<u32>,
    /// Read from the socket in pieces of exactly this many bytes.
    pub read_exact: Option<usize>,
}

pub(crate) struct Conn {
    send: http1::SendRequest<Full<Bytes>>,
    task: JoinHandle<()>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        // Closing the socket is the point when a stream is abandoned.
        self.task.abort();
    }
}

pub(crate) async fn connect(target: &Target, opts: ConnOptions) -> Result<Conn, BenchError> {
    let addr_str = target.addr();
    let err = |source| BenchError::Connect { addr: addr_str.clone(), source };
    let addr = tokio::net::lookup_host(&addr_str)
        .await
        .map_err(err)?
        .next()
        .ok_or_else(|| err(std::io::Error::new(std::io::ErrorKind::NotFound, "no address")))?;
    let socket = if addr.is_ipv6() { TcpSocket::new_v6() } else { TcpSocket::new_v4() }.map_err(err)?;
    if let Some(size) = opts.recv_buffer {
        socket.set_recv_buffer_size(size).map_err(err)?;
    }
    let stream = socket.connect(addr).await.map_err(err)?;
    stream.set_nodelay(true).map_err(err)?;
    let mut builder = http1::Builder::new();
    if let Some(sz) = opts.read_exact {
        builder.read_buf_exact_size(Some(sz));
    }
    let (send, conn) = builder.handshake(TokioIo::new(stream)).await?;
    let task = tokio::spawn(async move {
        // Errors surface through the request/response side.
        let _ = conn.await;
    });
    Ok(Conn { send, task })
}

fn build(
    target: &Target,
    method: &str,
    endpoint: &str,
    content_type: Option<&str>,
    body: Bytes,
) -> Result<hyper::Request<Full<Bytes>>, BenchError> {
    let mut req = hyper::Request::builder()
        .method(method)
        .uri(target.path(endpoint))
        .header(HOST, target.addr())
        .header("accept", "application/json, text/event-stream");
    if let Some(ct) = content_type {
        req = req.header(CONTENT_TYPE, ct);
    }
    Ok(req.body(Full::new(body))?)
}

/// A response read to the end.
#[derive(Debug, Clone)]
pub(crate) struct Response {
    pub status: u16,
    pub body: Bytes,
}

impl Response {
    pub(crate) fn json(&self) -> Result<Value, BenchError> {
        serde_json::from_slice(&self.body).map_err(|e| {
            BenchError::Protocol(format!(
                "HTTP {} body is not JSON ({e}): {:?}",
                self.status,
                truncate(&String::from_utf8_lossy(&self.body), 300)
            ))
        })
    }

    pub(crate) fn text(&self) -> String {
        truncate(&String::from_utf8_lossy(&self.body), 500).to_string()
    }
}

/// Sends one request and reads the whole response body, within `timeout`.
pub(crate) async fn request(
    target: &Target,
    method: &str,
    endpoint: &str,
    content_type: Option<&str>,
    body: Bytes,
    timeout: Duration,
) -> Result<Response, BenchError> {
    let fut = async {
        let mut conn = connect(target, ConnOptions::default()).await?;
        let resp = conn.send.send_request(build(target, method, endpoint, content_type, body)?).await?;
        let (parts, body) = resp.into_parts();
        let body = Limited::new(body, MAX_BODY)
            .collect()
            .await
            .map_err(|e| BenchError::Protocol(format!("reading {endpoint} body: {e}")))?
            .to_bytes();
        Ok(Response { status: parts.status.as_u16(), body })
    };
    tokio::time::timeout(timeout, fut).await.map_err(|_| BenchError::Timeout(format!("{method} {endpoint}")))?
}

pub(crate) async fn get(target: &Target, endpoint: &str, timeout: Duration) -> Result<Response, BenchError> {
    request(target, "GET", endpoint, None, Bytes::new(), timeout).await
}

pub(crate) async fn post_json(
    target: &Target,
    endpoint: &str,
    body: &Value,
    timeout: Duration,
) -> Result<Response, BenchError> {
    request(target, "POST", endpoint, Some("application/json"), Bytes::from(serde_json::to_vec(body)?), timeout).await
}

/// The first model id from `GET /v1/models`.
pub(crate) async fn first_model(target: &Target) -> Result<String, BenchError> {
    Ok(first_model_info(target).await?.0)
}

/// The first listed model's id and, when the server states it (vLLM and Flare do), its
/// `max_model_len`.
pub(crate) async fn first_model_info(target: &Target) -> Result<(String, Option<u32>), BenchError> {
    let resp = get(target, "/v1/models", Duration::from_secs(30)).await?;
    if resp.status != 200 {
        return Err(BenchError::Status { what: "GET /v1/models".into(), status: resp.status, body: resp.text() });
    }
    let v = resp.json()?;
    let first = v.get("data").and_then(Value::as_array).and_then(|d| d.first());
    let id = first.and_then(|m| m.get("id")).and_then(Value::as_str).map(str::to_string).ok_or_else(|| {
        BenchError::Protocol(format!("GET /v1/models lists no model id: {}", truncate(&v.to_string(), 300)))
    })?;
    let max_len = first.and_then(|m| m.get("max_model_len")).and_then(Value::as_u64).map(|n| n as u32);
    Ok((id, max_len))
}

/// How a streaming client consumes the body.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum ReadPolicy {
    /// Read as fast as frames arrive.
    Normal,
    /// Sleep this long before every body read.
    Slow(Duration),
    /// Close the connection after this many content chunks.
    DisconnectAfter(usize),
}

/// How a stream ended.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum StreamEnd {
    /// `data: [DONE]` seen, then the body ended, with no error event.
    Done,
    /// The client closed the connection on purpose.
    Disconnected,
    /// A non-200 status; `typed` when the body is an OpenAI error object.
    HttpStatus { status: u16, typed: bool, body: String },
    /// An error event inside the stream (and no success marker after it).
    StreamError(String),
    /// The connection failed (connect, reset, truncated chunked body...).
    Transport(String),
    /// The server broke the protocol (non-JSON data, success marker after an error, non-SSE 200).
    Protocol(String),
    /// The body ended cleanly without `[DONE]` or an error event.
    Eof,
    /// The whole exchange exceeded its time limit.
    Timeout,
}

/// Everything observed about one streaming chat completion.
#[derive(Debug, Clone)]
pub(crate) struct StreamOutcome {
    pub end: StreamEnd,
    pub request_id: Option<String>,
    /// Request sent → first content chunk.
    pub ttft: Option<Duration>,
    /// Gaps between consecutive content chunks.
    pub itl: Vec<Duration>,
    /// Request sent → stream end.
    pub total: Duration,
    /// Content chunks seen (delta content, reasoning or tool-call pieces).
    pub content_chunks: usize,
    pub text: String,
    /// The final `usage` object, when the server sent one.
    pub usage: Option<Value>,
    /// Finish reasons seen, by choice index (more than one per index is a duplicate).
    pub finish_reasons: Vec<(u64, String)>,
    pub done_markers: usize,
    /// Distinct chunk `id`s (one expected).
    pub chunk_ids: HashSet<String>,
}

impl StreamOutcome {
    fn new() -> Self {
        Self {
            end: StreamEnd::Eof,
            request_id: None,
            ttft: None,
            itl: Vec::new(),
            total: Duration::ZERO,
            content_chunks: 0,
            text: String::new(),
            usage: None,
            finish_reasons: Vec::new(),
            done_markers: 0,
            chunk_ids: HashSet::new(),
        }
    }

    pub(crate) fn usage_u64(&self, path: &[&str]) -> Option<u64> {
        let mut v = self.usage.as_ref()?;
        for key in path {
            v = v.get(key)?;
        }
        v.as_u64()
    }

    /// Output tokens: `usage.completion_tokens` when present, else content chunks.
    pub(crate) fn output_tokens(&self) -> u64 {
        self.usage_u64(&["completion_tokens"]).unwrap_or(self.content_chunks as u64)
    }

    pub(crate) fn cached_tokens(&self) -> Option<u64> {
        self.usage_u64(&["prompt_tokens_details", "cached_tokens"])
    }

    /// Whether this stream delivered a completion more than once (two `[DONE]`s, or two finish
    /// reasons for one choice).
    pub(crate) fn duplicated(&self) -> bool {
        let mut seen = HashSet::new();
        self.done_markers > 1 || self.finish_reasons.iter().any(|(i, _)| !seen.insert(*i))
    }
}

/// Whether an error body is the OpenAI error object `{"error": {"message", "type", "param",
/// "code"}}` with non-empty `type` and `code`. Returns the reason when it is not.
pub(crate) fn check_error_envelope(body: &[u8]) -> Result<(), String> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| format!("body is not JSON ({e}): {:?}", truncate(&String::from_utf8_lossy(body), 200)))?;
    let err = v.get("error").and_then(Value::as_object).ok_or_else(|| format!("no \"error\" object in {v}"))?;
    for key in ["message", "type", "param", "code"] {
        if !err.contains_key(key) {
            return Err(format!("error object lacks {key:?}: {v}"));
        }
    }
    if !err.get("message").is_some_and(Value::is_string) {
        return Err(format!("error.message is not a string: {v}"));
    }
    for key in ["type", "code"] {
        let non_empty = match err.get(key) {
            Some(Value::String(s)) => !s.is_empty(),
            Some(Value::Number(_)) => true,
            _ => false,
        };
        if !non_empty {
            return Err(format!("error.{key} is empty or not a string: {v}"));
        }
    }
    Ok(())
}

/// Sends a streaming chat completion and consumes its SSE body according to `policy`.
/// Never fails: every way a stream can end is a [`StreamEnd`].
pub(crate) async fn stream_chat(
    target: &Target,
    body: &Value,
    policy: ReadPolicy,
    opts: ConnOptions,
    timeout: Duration,
) -> StreamOutcome {
    let mut out = StreamOutcome::new();
    let t0 = Instant::now();
    let result = tokio::time::timeout(timeout, stream_inner(target, body, policy, opts, &mut out)).await;
    out.total = t0.elapsed();
    out.end = match result {
        Ok(end) => end,
        Err(_) => StreamEnd::Timeout,
    };
    out
}

async fn stream_inner(
    target: &Target,
    body: &Value,
    policy: ReadPolicy,
    opts: ConnOptions,
    out: &mut StreamOutcome,
) -> StreamEnd {
    let payload = match serde_json::to_vec(body) {
        Ok(p) => Bytes::from(p),
        Err(e) => return StreamEnd::Protocol(format!("cannot serialise request: {e}")),
    };
    let mut conn = match connect(target, opts).await {
        Ok(c) => c,
        Err(e) => return StreamEnd::Transport(e.to_string()),
    };
    let req = match build(target, "POST", "/v1/chat/completions", Some("application/json"), payload) {
        Ok(r) => r,
        Err(e) => return StreamEnd::Protocol(e.to_string()),
    };
    let sent = Instant::now();
    let resp = match conn.send.send_request(req).await {
        Ok(r) => r,
        Err(e) => return StreamEnd::Transport(format!("sending request: {e}")),
    };
    let (parts, mut body) = resp.into_parts();
    out.request_id = parts.headers.get("x-request-id").and_then(|v| v.to_str().ok()).map(str::to_string);
    let status = parts.status.as_u16();
    if status != 200 {
        let bytes = match Limited::new(body, MAX_BODY).collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => return StreamEnd::Transport(format!("reading HTTP {status} body: {e}")),
        };
        return StreamEnd::HttpStatus {
            status,
            typed: check_error_envelope(&bytes).is_ok(),
            body: truncate(&String::from_utf8_lossy(&bytes), 300).to_string(),
        };
    }
    let ct = parts.headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or_default();
    if !ct.starts_with("text/event-stream") {
        return StreamEnd::Protocol(format!("200 with content-type {ct:?}, expected text/event-stream"));
    }
    let mut parser = SseParser::new();
    let mut last_chunk: Option<Instant> = None;
    let mut error: Option<String> = None;
    loop {
        if let ReadPolicy::Slow(delay) = policy {
            tokio::time::sleep(delay).await;
        }
        let frame = match body.frame().await {
            None => break,
            Some(Err(e)) => return StreamEnd::Transport(format!("reading stream: {e}")),
            Some(Ok(f)) => f,
        };
        let Ok(data) = frame.into_data() else { continue };
        let now = Instant::now();
        for ev in parser.feed(&data) {
            match classify(&ev) {
                Err(e) => return StreamEnd::Protocol(e),
                Ok(StreamItem::Done) => {
                    if let Some(err) = &error {
                        return StreamEnd::Protocol(format!("[DONE] after error event ({err})"));
                    }
                    out.done_markers += 1;
                }
                Ok(StreamItem::Error(v)) => {
                    if out.done_markers > 0 {
                        return StreamEnd::Protocol(format!("error event after [DONE]: {}", error_summary(&v)));
                    }
                    error.get_or_insert_with(|| error_summary(&v));
                }
                Ok(StreamItem::Data(v)) => {
                    if out.done_markers > 0 {
                        return StreamEnd::Protocol("data after [DONE]".into());
                    }
                    if record_chunk(&v, out) {
                        match last_chunk {
                            None => out.ttft = Some(now - sent),
                            Some(prev) => out.itl.push(now - prev),
                        }
                        last_chunk = Some(now);
                        out.content_chunks += 1;
                        if let ReadPolicy::DisconnectAfter(n) = policy
                            && out.content_chunks >= n
                        {
                            drop(body);
                            drop(conn);
                            return StreamEnd::Disconnected;
                        }
                    }
                }
            }
        }
    }
    if parser.finish() {
        return StreamEnd::Protocol("stream ended inside an unterminated event".into());
    }
    match (error, out.done_markers) {
        (Some(e), _) => StreamEnd::StreamError(e),
        (None, 0) => StreamEnd::Eof,
        (None, _) => StreamEnd::Done,
    }
}

/// Records one chat chunk; returns whether it carried generated content.
fn record_chunk(v: &Value, out: &mut StreamOutcome) -> bool {
    if let Some(id) = v.get("id").and_then(Value::as_str) {
        out.chunk_ids.insert(id.to_string());
    }
    if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
        out.usage = Some(u.clone());
    }
    let mut content = false;
    for choice in v.get("choices").and_then(Value::as_array).into_iter().flatten() {
        let index = choice.get("index").and_then(Value::as_u64).unwrap_or(0);
        if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
            out.finish_reasons.push((index, reason.to_string()));
        }
        let Some(delta) = choice.get("delta") else { continue };
        for key in ["content", "reasoning_content", "reasoning"] {
            if let Some(s) = delta.get(key).and_then(Value::as_str)
                && !s.is_empty()
            {
                if key == "content" {
                    out.text.push_str(s);
                }
                content = true;
            }
        }
        if delta.get("tool_calls").and_then(Value::as_array).is_some_and(|a| !a.is_empty()) {
            content = true;
        }
    }
    content
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn target_parsing() {
        let t = Target::parse("http://127.0.0.1:8000").expect("valid");
        assert_eq!(t.addr(), "127.0.0.1:8000");
        assert_eq!(t.path("/v1/models"), "/v1/models");
        let t = Target::parse("http://localhost:9/api/v1/").expect("valid");
        assert_eq!(t.path("/v1/models"), "/api/v1/models");
        let t = Target::parse("http://[::1]:81").expect("valid");
        assert_eq!(t.addr(), "[::1]:81");
        assert_eq!(Target::parse("http://example").expect("valid").addr(), "example:80");
        for bad in ["https://x", "ftp://x", "http://", "http://h:99999", "http://h:1/a?b", "http://u@h"] {
            assert!(Target::parse(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn error_envelope_rules() {
        let ok = br#"{"error":{"message":"m","type":"invalid_request_error","param":null,"code":"bad"}}"#;
        assert_eq!(check_error_envelope(ok), Ok(()));
        let missing_param = br#"{"error":{"message":"m","type":"t","code":"c"}}"#;
        assert!(check_error_envelope(missing_param).is_err());
        let empty_code = br#"{"error":{"message":"m","type":"t","param":null,"code":""}}"#;
        assert!(check_error_envelope(empty_code).is_err());
        let null_type = br#"{"error":{"message":"m","type":null,"param":null,"code":"c"}}"#;
        assert!(check_error_envelope(null_type).is_err());
        assert!(check_error_envelope(b"oops").is_err());
        assert!(check_error_envelope(br#"{"detail":"x"}"#).is_err());
    }

    #[test]
    fn chunks_are_recorded() {
        let mut out = StreamOutcome::new();
        assert!(!record_chunk(&json!({"id":"c1","choices":[{"index":0,"delta":{"role":"assistant"}}]}), &mut out));
        assert!(record_chunk(&json!({"id":"c1","choices":[{"index":0,"delta":{"content":"hi"}}]}), &mut out));
        assert!(record_chunk(
            &json!({"id":"c1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0}]}, "finish_reason": "tool_calls"}]}),
            &mut out
        ));
        assert!(!record_chunk(
            &json!({"id":"c1","choices":[],"usage":{"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":3}}}),
            &mut out
        ));
        assert_eq!(out.text, "hi");
        assert_eq!(out.output_tokens(), 5);
        assert_eq!(out.cached_tokens(), Some(3));
        assert_eq!(out.chunk_ids.len(), 1);
        assert!(!out.duplicated());
        out.finish_reasons.push((0, "stop".into()));
        assert!(out.duplicated());
        let mut two_done = StreamOutcome::new();
        two_done.done_markers = 2;
        assert!(two_done.duplicated());
        // Without usage the content chunks count.
        let mut no_usage = StreamOutcome::new();
        no_usage.content_chunks = 7;
        assert_eq!(no_usage.output_tokens(), 7);
    }

    fn sse_response(events: &[&str], done: bool) -> Vec<Vec<u8>> {
        let mut pieces = vec![
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-request-id: rid-1\r\nconnection: close\r\n\r\n"
                .to_vec(),
        ];
        for e in events {
            pieces.push(format!("data: {e}\n\n").into_bytes());
        }
        if done {
            pieces.push(b"data: [DONE]\n\n".to_vec());
        }
        pieces
    }

    async fn run(pieces: Vec<Vec<u8>>, policy: ReadPolicy) -> (StreamOutcome, bool) {
        let (addr, closed) = crate::fake::one_shot(pieces, Duration::from_millis(5)).await;
        let target = Target::parse(&format!("http://{addr}")).expect("url");
        let out =
            stream_chat(&target, &json!({"stream": true}), policy, ConnOptions::default(), Duration::from_secs(10))
                .await;
        (out, closed.await.unwrap_or(false))
    }

    const C1: &str = r#"{"id":"x","choices":[{"index":0,"delta":{"content":"a"}}]}"#;
    const C2: &str = r#"{"id":"x","choices":[{"index":0,"delta":{"content":"b"},"finish_reason":"stop"}]}"#;
    const USAGE: &str = r#"{"id":"x","choices":[],"usage":{"prompt_tokens":4,"completion_tokens":2}}"#;

    #[tokio::test]
    async fn stream_chat_reads_a_complete_stream() {
        let (out, _) = run(sse_response(&[C1, C2, USAGE], true), ReadPolicy::Normal).await;
        assert_eq!(out.end, StreamEnd::Done);
        assert_eq!(out.request_id.as_deref(), Some("rid-1"));
        assert_eq!(out.text, "ab");
        assert_eq!(out.content_chunks, 2);
        assert_eq!(out.itl.len(), 1);
        assert!(out.ttft.is_some_and(|t| t <= out.total));
        assert_eq!(out.output_tokens(), 2);
        assert!(!out.duplicated());
    }

    #[tokio::test]
    async fn stream_chat_slow_reader_still_completes() {
        let (out, _) = run(sse_response(&[C1, C2], true), ReadPolicy::Slow(Duration::from_millis(10))).await;
        assert_eq!(out.end, StreamEnd::Done);
        assert_eq!(out.output_tokens(), 2, "no usage: chunks are counted");
    }

    #[tokio::test]
    async fn stream_chat_classifies_failures() {
        let (out, _) = run(sse_response(&[C1], false), ReadPolicy::Normal).await;
        assert_eq!(out.end, StreamEnd::Eof);

        let err = r#"{"error":{"message":"worker died","type":"server_error","param":null,"code":"execution_failed"}}"#;
        let (out, _) = run(sse_response(&[C1, err], false), ReadPolicy::Normal).await;
        assert_eq!(out.end, StreamEnd::StreamError("execution_failed: worker died".into()));

        let (out, _) = run(sse_response(&[C1, err], true), ReadPolicy::Normal).await;
        assert!(matches!(out.end, StreamEnd::Protocol(ref e) if e.contains("[DONE] after error")), "{:?}", out.end);

        let (out, _) = run(sse_response(&[C1, "not json"], true), ReadPolicy::Normal).await;
        assert!(matches!(out.end, StreamEnd::Protocol(_)));

        let body = r#"{"error":{"message":"busy","type":"server_error","param":null,"code":"overloaded"}}"#;
        let typed = format!(
            "HTTP/1.1 503 Busy\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        let (out, _) = run(vec![typed.into_bytes()], ReadPolicy::Normal).await;
        assert!(matches!(out.end, StreamEnd::HttpStatus { status: 503, typed: true, .. }), "{:?}", out.end);

        let untyped = b"HTTP/1.1 500 Oops\r\ncontent-length: 4\r\n\r\noops";
        let (out, _) = run(vec![untyped.to_vec()], ReadPolicy::Normal).await;
        assert!(matches!(out.end, StreamEnd::HttpStatus { status: 500, typed: false, .. }));

        let not_sse = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
        let (out, _) = run(vec![not_sse.to_vec()], ReadPolicy::Normal).await;
        assert!(matches!(out.end, StreamEnd::Protocol(_)));

        let truncated =
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 1000\r\n\r\ndata: [DONE]\n\n";
        let (out, _) = run(vec![truncated.to_vec()], ReadPolicy::Normal).await;
        assert!(matches!(out.end, StreamEnd::Transport(_)), "{:?}", out.end);

        let unreachable = Target::parse("http://127.0.0.1:1").expect("url");
        let out =
            stream_chat(&unreachable, &json!({}), ReadPolicy::Normal, ConnOptions::default(), Duration::from_secs(5))
                .await;
        assert!(matches!(out.end, StreamEnd::Transport(_)));
    }

    #[tokio::test]
    async fn stream_chat_disconnect_really_closes_the_socket() {
        let many: Vec<&str> = std::iter::repeat_n(C1, 40).collect();
        let (out, closed) = run(sse_response(&many, true), ReadPolicy::DisconnectAfter(2)).await;
        assert_eq!(out.end, StreamEnd::Disconnected);
        assert_eq!(out.content_chunks, 2);
        assert!(closed, "the server never saw the client close its connection");
    }

    #[tokio::test]
    async fn stream_chat_times_out() {
        let (addr, _closed) =
            crate::fake::one_shot(sse_response(&[C1, C1, C1], true), Duration::from_millis(400)).await;
        let target = Target::parse(&format!("http://{addr}")).expect("url");
        let out =
            stream_chat(&target, &json!({}), ReadPolicy::Normal, ConnOptions::default(), Duration::from_millis(300))
                .await;
        assert_eq!(out.end, StreamEnd::Timeout);
    }
}
