//! `flare run` (embedded simulated core) over real sockets: readiness, generation, usage and
//! cached tokens, typed errors, streamed failures, cancellation, signal shutdown, and clients
//! that try to stall, starve or pin the server (slow heads and bodies, idle connections, a
//! connection flood, stuck clients at shutdown, foreign `Host` names).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

struct Server {
    child: Child,
    port: u16,
    /// Every stderr line so far.
    log: Arc<Mutex<Vec<String>>>,
}

impl Server {
    fn start(extra: &[&str]) -> Server {
        Server::start_logging("json", extra)
    }

    fn start_logging(format: &str, extra: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_flare"))
            .args(["run", "--port", "0", "--log-format", format])
            .args(extra)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let log = Arc::new(Mutex::new(Vec::new()));
        let lines = log.clone();
        std::thread::spawn(move || {
            let mut sent = false;
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if !sent && let Some(rest) = line.split("listening on http://127.0.0.1:").nth(1) {
                    let port: String = rest.chars().take_while(char::is_ascii_digit).collect();
                    tx.send(port.parse::<u16>().unwrap()).unwrap();
                    sent = true;
                }
                lines.lock().unwrap().push(line);
            }
        });
        let port = rx.recv_timeout(Duration::from_secs(60)).expect("server became ready");
        Server { child, port, log }
    }

    /// Waits (bounded) for a log line containing `needle`.
    fn wait_for_log(&self, needle: &str, limit: Duration) -> Option<String> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(l) = self.log.lock().unwrap().iter().find(|l| l.contains(needle)) {
                return Some(l.clone());
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn connect(&self) -> TcpStream {
        let s = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s
    }

    fn request(&self, method: &str, path: &str, content_type: Option<&str>, body: &str) -> (u16, String, String) {
        self.request_as("localhost", method, path, content_type, body)
    }

    fn request_as(
        &self,
        host: &str,
        method: &str,
        path: &str,
        content_type: Option<&str>,
        body: &str,
    ) -> (u16, String, String) {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let ct = content_type.map(|c| format!("content-type: {c}\r\n")).unwrap_or_default();
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nhost: {host}\r\n{ct}content-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).unwrap();
        let raw = String::from_utf8_lossy(&raw).into_owned();
        let (head, body) = raw.split_once("\r\n\r\n").unwrap();
        let status = head.split(' ').nth(1).unwrap().parse().unwrap();
        let body = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
            dechunk(body)
        } else {
            body.to_owned()
        };
        (status, head.to_owned(), body)
    }

    fn post(&self, path: &str, body: &Value) -> (u16, String, String) {
        self.request("POST", path, Some("application/json"), &body.to_string())
    }

    fn metric(&self, name: &str) -> f64 {
        let (_, _, text) = self.request("GET", "/metrics", None, "");
        text.lines()
            .filter(|l| l.starts_with(name) && !l.starts_with('#'))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn dechunk(body: &str) -> String {
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&tail[..n]);
        rest = &tail[n + 2..];
    }
    out
}

fn sse_data(body: &str) -> Vec<String> {
    body.lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_owned).collect()
}

fn chat(messages: Value, extra: Value) -> Value {
    let mut body = json!({"model": "flare-sim", "messages": messages, "max_tokens": 24, "temperature": 0.5, "seed": 7});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn request_id(head: &str) -> String {
    head.lines().find_map(|l| l.strip_prefix("x-request-id: ")).expect("x-request-id header").trim().to_owned()
}

#[test]
fn serves_chat_completions_with_usage_and_cached_tokens() {
    let server = Server::start(&[]);
    let (status, _, body) = server.request("GET", "/health", None, "");
    assert_eq!((status, body.as_str()), (200, r#"{"status":"ok"}"#));
    let (_, _, models) = server.request("GET", "/v1/models", None, "");
    assert_eq!(serde_json::from_str::<Value>(&models).unwrap()["data"][0]["id"], "flare-sim");

    let conversation = json!([
        {"role": "system", "content": "You are a helpful agent with a long system prompt. ".repeat(20)},
        {"role": "user", "content": "Summarize the repository layout."},
    ]);
    let (status, head, body) = server.post("/v1/chat/completions", &chat(conversation.clone(), json!({})));
    assert_eq!(status, 200, "{body}");
    assert!(request_id(&head).starts_with("chatcmpl-"));
    let first: Value = serde_json::from_str(&body).unwrap();
    let usage = &first["usage"];
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 200);
    assert_eq!(
        usage["total_tokens"],
        usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap()
    );
    assert_eq!(first["choices"][0]["message"]["role"], "assistant");

    // Same seed, same request: same output; the repeat restores the prompt from the cache.
    let (_, _, body) = server.post("/v1/chat/completions", &chat(conversation.clone(), json!({})));
    let again: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(again["choices"][0]["message"], first["choices"][0]["message"]);
    assert!(again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0, "{again}");

    // Streaming: role chunk, content, finish chunk, usage chunk, [DONE]; concatenation matches.
    let (status, head, body) = server.post(
        "/v1/chat/completions",
        &chat(conversation, json!({"stream": true, "stream_options": {"include_usage": true}})),
    );
    assert_eq!(status, 200);
    assert!(head.contains("text/event-stream"));
    let events = sse_data(&body);
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, first["choices"][0]["message"]["content"].as_str().unwrap());
    let usage_chunk = chunks.last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(usage_chunk["usage"]["completion_tokens"], usage["completion_tokens"]);

    // n = 3 choices, each with its own index.
    let (_, _, body) =
        server.post("/v1/chat/completions", &chat(json!([{"role": "user", "content": "hi"}]), json!({"n": 3})));
    let v: Value = serde_json::from_str(&body).unwrap();
    let idx: Vec<u64> = v["choices"].as_array().unwrap().iter().map(|c| c["index"].as_u64().unwrap()).collect();
    assert_eq!(idx, vec![0, 1, 2]);
}

#[test]
fn typed_errors_before_headers_and_in_streams() {
    let server = Server::start(&[]);
    let user = json!([{"role": "user", "content": "hello"}]);
    let cases: Vec<(Value, u16, &str)> = vec![
        (chat(user.clone(), json!({"temperature": 0})), 400, "invalid_parameter"),
        (chat(user.clone(), json!({"max_tokens": 0})), 400, "invalid_max_tokens"),
        (chat(user.clone(), json!({"top_p": 2})), 400, "invalid_parameter"),
        (chat(user.clone(), json!({"n": 0})), 400, "invalid_choice_count"),
        (chat(user.clone(), json!({"model": "nope"})), 404, "model_not_found"),
        (chat(json!([{"role": "user", "content": "word ".repeat(9000)}]), json!({})), 400, "context_length_exceeded"),
        (chat(user.clone(), json!({"tool_choice": "required"})), 400, "invalid_tool_choice"),
        (chat(user.clone(), json!({"response_format": {"type": "xml"}})), 400, "invalid_response_format"),
    ];
    for (body, status, code) in cases {
        let (got, head, text) = server.post("/v1/chat/completions", &body);
        assert_eq!(got, status, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["code"], code, "{text}");
        assert_eq!(v["error"]["type"], if status == 404 { "not_found_error" } else { "invalid_request_error" });
        assert!(request_id(&head).starts_with("chatcmpl-"));
    }
    let (status, _, _) = server.request("POST", "/v1/chat/completions", Some("text/plain"), "{}");
    assert_eq!(status, 415);
    let (status, _, text) = server.request("POST", "/v1/chat/completions", Some("application/json"), "{bad");
    assert_eq!(
        (status, serde_json::from_str::<Value>(&text).unwrap()["error"]["code"].as_str()),
        (400, Some("invalid_json"))
    );
    let (status, _, text) = server.post("/v1/messages", &json!({"model": "flare-sim", "messages": []}));
    assert_eq!(status, 400);
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!((v["type"].as_str(), v["error"]["type"].as_str()), (Some("error"), Some("invalid_request_error")));

    // tool_choice=required with a model that answers in text: the failure arrives after the
    // SSE headers as an error event, with no [DONE]. (Cut short by max_tokens it would be a
    // `length` finish instead.)
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]);
    // The copy model repeats the earlier plain-text answer and ends (EOS) without a call.
    let history = json!([{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Hi there."},
        {"role": "user", "content": "hello"}]);
    let extra =
        json!({"stream": true, "tools": tools, "tool_choice": "required", "max_tokens": 32, "temperature": 0.01});
    let (status, _, body) = server.post("/v1/chat/completions", &chat(history, extra));
    assert_eq!(status, 200);
    let events = sse_data(&body);
    assert!(!events.iter().any(|e| e == "[DONE]"), "{body}");
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "required_tool_call_missing", "{body}");
}

#[test]
fn disconnect_cancels_and_shutdown_drains() {
    let server = Server::start(&["--shutdown-grace-secs", "5"]);
    let body = chat(
        json!([{"role": "user", "content": "tell a long story"}]),
        json!({"stream": true, "max_tokens": 8000, "ignore_eos": true}),
    );
    for _ in 0..4 {
        let mut s = TcpStream::connect(("127.0.0.1", server.port)).unwrap();
        let b = body.to_string();
        write!(s, "POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{b}", b.len()).unwrap();
        let mut buf = [0u8; 512];
        let n = s.read(&mut buf).unwrap();
        assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
        drop(s);
    }
    // A disconnect is only seen at the next failed write, and a request that outlives its client
    // runs to `length`; on a loaded 2-core CI box that can take well over 20 s. A request whose
    // client left while it was still being prepared never reaches the scheduler, so wait until
    // nothing is queued or running, pages are back, and every admitted request has retired.
    let deadline = Instant::now() + Duration::from_secs(120);
    let idle = || {
        ["flare_running_requests", "flare_pages_used", "flare_queue_depth"].iter().all(|m| server.metric(m) == 0.0)
            && server.metric("flare_requests_admitted_total") == server.metric("flare_requests_finished_total")
    };
    while !idle() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(server.metric("flare_running_requests"), 0.0);
    assert_eq!(server.metric("flare_pages_used"), 0.0);
    // Each ran for up to 8,000 tokens; the disconnects cut them short.
    let admitted = server.metric("flare_requests_admitted_total");
    let cancelled = server.metric("flare_requests_finished_total{reason=\"cancelled\"}");
    let length = server.metric("flare_requests_finished_total{reason=\"length\"}");
    assert!(
        (1.0..=4.0).contains(&admitted) && cancelled >= 1.0 && cancelled + length == admitted,
        "admitted {admitted}, cancelled {cancelled}, length {length}"
    );
    assert_eq!(admitted, server.metric("flare_requests_finished_total"));

    // SIGTERM: drain and exit cleanly.
    let mut server = server;
    let pid = server.child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            assert!(status.success(), "{status}");
            break;
        }
        assert!(Instant::now() < deadline, "server did not exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Reads until the server closes the connection (EOF or reset) or `limit` passes; returns what
/// came and when the close came, from `since` (None: still open at `limit`).
fn read_until_closed(s: &mut TcpStream, since: Instant, limit: Duration) -> (String, Option<Duration>) {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    loop {
        match s.read(&mut buf) {
            Ok(0) => return (String::from_utf8_lossy(&got).into_owned(), Some(since.elapsed())),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(_) => return (String::from_utf8_lossy(&got).into_owned(), Some(since.elapsed())),
        }
        if since.elapsed() >= limit {
            return (String::from_utf8_lossy(&got).into_owned(), None);
        }
    }
}

/// Reads until `needle` has arrived (bounded).
fn read_until(s: &mut TcpStream, needle: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    s.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
    while !String::from_utf8_lossy(&got).contains(needle) {
        assert!(Instant::now() < deadline, "no {needle:?} in {:?}", String::from_utf8_lossy(&got));
        match s.read(&mut buf) {
            Ok(0) => panic!("closed before {needle:?}: {:?}", String::from_utf8_lossy(&got)),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(_) => {}
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

const PARTIAL_BODY: &str = "POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"model\"";

#[test]
fn slow_heads_slow_bodies_and_idle_connections_are_closed_in_time() {
    let server = Server::start(&[
        "--header-read-timeout-secs",
        "1",
        "--body-read-timeout-secs",
        "2",
        "--idle-timeout-secs",
        "3",
    ]);
    let started = Instant::now();
    let mut head = server.connect();
    head.write_all(b"GET /health HTTP/1.1\r\nhost: localhost\r\nx-slow: 1\r\n").unwrap();
    let mut body = server.connect();
    body.write_all(PARTIAL_BODY.as_bytes()).unwrap();
    let mut idle = server.connect();
    idle.write_all(b"GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n").unwrap();
    read_until(&mut idle, r#"{"status":"ok"}"#);
    let answered = Instant::now();

    // The partial head: closed, unanswered, at the header timeout.
    let (got, closed) = read_until_closed(&mut head, started, Duration::from_secs(10));
    let closed = closed.expect("partial head closed");
    assert!(
        got.is_empty() && closed >= Duration::from_millis(900) && closed < Duration::from_secs(5),
        "{got} {closed:?}"
    );
    // The stalled body: 408 in the route's envelope at the body timeout, then closed.
    let (got, closed) = read_until_closed(&mut body, started, Duration::from_secs(10));
    let closed = closed.expect("stalled body closed");
    assert!(got.starts_with("HTTP/1.1 408"), "{got}");
    assert!(got.contains(r#""code":"body_timeout""#) && got.contains(r#""type":"invalid_request_error""#), "{got}");
    assert!(closed >= Duration::from_millis(1900) && closed < Duration::from_secs(6), "{closed:?}");
    // The idle keep-alive connection outlives the header timeout and closes at the idle one.
    let (got, closed) = read_until_closed(&mut idle, answered, Duration::from_secs(10));
    let closed = closed.expect("idle connection closed");
    assert!(got.is_empty() && closed >= Duration::from_millis(2900) && closed < Duration::from_secs(7), "{closed:?}");
    assert!(server.wait_for_log("sent no complete request head in time", Duration::from_secs(3)).is_some());
    assert!(server.wait_for_log("whose body did not arrive in time", Duration::from_secs(3)).is_some());
    assert_eq!(server.request("GET", "/health", None, "").0, 200);
}

#[test]
fn the_connection_cap_evicts_idle_refuses_when_busy_and_logs() {
    let server = Server::start(&["--max-connections", "4"]);
    // A flood of connections that send nothing: /health still answers, replacing the oldest.
    let silent: Vec<TcpStream> = (0..4).map(|_| server.connect()).collect();
    std::thread::sleep(Duration::from_millis(200));
    let (status, _, body) = server.request("GET", "/health", None, "");
    assert_eq!((status, body.as_str()), (200, r#"{"status":"ok"}"#));
    assert!(
        server.wait_for_log("connection cap reached: closed 1 waiting connection", Duration::from_secs(5)).is_some()
    );
    drop(silent);

    // Every connection serving a request (bodies still arriving): the next one is refused.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut busy: Vec<TcpStream> = Vec::new();
    let refused = loop {
        assert!(Instant::now() < deadline, "the cap was never reached");
        let mut s = server.connect();
        s.write_all(PARTIAL_BODY.as_bytes()).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        // The silent connections above may take a moment to be seen closed.
        let (got, closed) = read_until_closed(&mut s, Instant::now(), Duration::from_millis(200));
        match closed {
            None => busy.push(s),
            Some(_) => break got,
        }
    };
    assert_eq!(busy.len(), 4);
    assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
    assert!(refused.contains("retry-after: 1") && refused.contains(r#""code":"too_many_connections""#), "{refused}");
    let line = server.wait_for_log("connection cap reached: refused", Duration::from_secs(5)).expect("refusal logged");
    assert!(line.contains(r#""max_connections":4"#), "{line}");
    // Clients gone: served again.
    drop(busy);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut s = server.connect();
        s.write_all(b"GET /health HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n").unwrap();
        let (got, _) = read_until_closed(&mut s, Instant::now(), Duration::from_secs(5));
        if got.starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(Instant::now() < deadline, "not served again: {got}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn sigterm_with_stuck_clients_exits_within_the_grace() {
    let mut server = Server::start(&["--shutdown-grace-secs", "2"]);
    // A request whose body never completes, a head that never completes, and a stream whose
    // client stops reading.
    let mut body = server.connect();
    body.write_all(PARTIAL_BODY.as_bytes()).unwrap();
    let mut head = server.connect();
    head.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: loc").unwrap();
    let request = chat(
        json!([{"role": "user", "content": "tell a long story"}]),
        json!({"stream": true, "max_tokens": 8000, "ignore_eos": true}),
    )
    .to_string();
    let mut stream = server.connect();
    write!(
        stream,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{request}",
        request.len()
    )
    .unwrap();
    read_until(&mut stream, "data: ");

    let started = Instant::now();
    let pid = server.child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let status = loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            break status;
        }
        assert!(started.elapsed() < Duration::from_secs(8), "still running {:?} after SIGTERM", started.elapsed());
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = started.elapsed();
    assert!(status.success(), "{status}");
    eprintln!("exited {took:?} after SIGTERM");
    // Grace 2 s, connections dropped a second later.
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert!(server.wait_for_log("shutdown: complete", Duration::from_secs(2)).is_some());
    // The listener is gone and every connection was closed.
    assert!(TcpStream::connect(("127.0.0.1", server.port)).is_err());
    for s in [&mut body, &mut head] {
        assert!(read_until_closed(s, Instant::now(), Duration::from_secs(2)).1.is_some());
    }
    drop(stream);
}

#[test]
fn errors_carry_envelopes_retry_after_and_the_host_guard() {
    let server = Server::start_logging("text", &["--queue-limit", "0", "--allowed-hosts", "my.box, other.box"]);
    // 405: the envelope of the route's API, and Allow.
    let (status, head, body) = server.request("GET", "/v1/chat/completions", None, "");
    assert_eq!(status, 405);
    assert!(head.to_ascii_lowercase().contains("allow: post"), "{head}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (v["error"]["code"].as_str(), v["error"]["type"].as_str()),
        (Some("method_not_allowed"), Some("invalid_request_error"))
    );
    let (status, _, body) = server.request("GET", "/v1/messages", None, "");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (status, v["type"].as_str(), v["error"]["type"].as_str()),
        (405, Some("error"), Some("invalid_request_error"))
    );

    // Host: loopback names and the allowed list only.
    for host in ["localhost:8000", "127.0.0.1", "[::1]:9", "my.box", "OTHER.box:80"] {
        assert_eq!(server.request_as(host, "GET", "/health", None, "").0, 200, "{host}");
    }
    for host in ["evil.example", "evil.example:8000", "localhost.evil.example", "10.1.2.3"] {
        let (status, _, body) = server.request_as(host, "GET", "/health", None, "");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!((status, v["error"]["code"].as_str()), (403, Some("host_not_allowed")), "{host}");
    }
    let (status, _, _) = server.request("GET", "http://evil.example/health", None, "");
    assert_eq!(status, 403, "an absolute-form target names the host too");
    let (status, _, body) = server.request_as("evil.example", "POST", "/v1/messages", Some("application/json"), "{}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!((status, v["error"]["type"].as_str()), (403, Some("permission_error")));

    // 503 (the queue takes nothing here) tells the client when to retry.
    let (status, head, body) =
        server.post("/v1/chat/completions", &chat(json!([{"role": "user", "content": "hi"}]), json!({})));
    assert_eq!(status, 503, "{body}");
    assert!(head.to_ascii_lowercase().contains("retry-after: 1"), "{head}");

    // Client text reaches the text log escaped: no forged line.
    let forged = chat(
        json!([{"role": "user", "content": "hi"}]),
        json!({"response_format": {"type": "regex", "regex": "(unclosed\nFORGED fake log line"}}),
    );
    let (status, _, body) = server.post("/v1/chat/completions", &forged);
    assert_eq!(status, 400, "{body}");
    let line = server.wait_for_log("FORGED", Duration::from_secs(5)).expect("the failure is logged");
    assert!(line.contains(r"\nFORGED"), "{line}");
    assert!(!server.log.lock().unwrap().iter().any(|l| l.starts_with("FORGED")));
}

/// Median-free worst case of `n` `/health` round trips, each on a new connection.
fn worst_health(server: &Server, n: usize) -> Duration {
    (0..n)
        .map(|_| {
            let t0 = Instant::now();
            let (status, _, _) = server.request("GET", "/health", None, "");
            assert_eq!(status, 200);
            t0.elapsed()
        })
        .max()
        .unwrap_or_default()
}

#[test]
fn thousands_of_long_stop_strings_leave_health_answering() {
    let server = Server::start(&[]);
    // Two clients with 10,000 stop strings of 1 KB each: refused as a client error, cheaply.
    let stops: Vec<String> = (0..10_000).map(|i| format!("{i:05}{}", "s".repeat(1019))).collect();
    let body = chat(json!([{"role": "user", "content": "hi"}]), json!({"stop": stops, "stream": true}));
    let server = Arc::new(server);
    let senders: Vec<_> = (0..2)
        .map(|_| {
            let (server, body) = (server.clone(), body.clone());
            std::thread::spawn(move || server.post("/v1/chat/completions", &body))
        })
        .collect();
    let worst = worst_health(&server, 20);
    for s in senders {
        let (status, _, body) = s.join().unwrap();
        assert_eq!(status, 400, "{body}");
        let err: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(err["error"]["param"], "stop", "{body}");
    }
    assert!(worst < Duration::from_millis(100), "/health took {worst:?}");
    // At the limits (128 strings of 1 KB) a streaming request runs, and /health stays fast.
    let stops: Vec<String> = (0..128).map(|i| format!("{i:03}{}", "q".repeat(1021))).collect();
    let body = chat(
        json!([{"role": "user", "content": "tell me a long story"}]),
        json!({"stop": stops, "stream": true, "max_tokens": 400, "ignore_eos": true}),
    );
    let streamer = {
        let (server, body) = (server.clone(), body.clone());
        std::thread::spawn(move || server.post("/v1/chat/completions", &body))
    };
    let worst = worst_health(&server, 20);
    let (status, _, text) = streamer.join().unwrap();
    assert_eq!(status, 200);
    assert!(text.contains("[DONE]"), "{text}");
    assert!(worst < Duration::from_millis(100), "/health took {worst:?} beside a 128-stop stream");
}

#[test]
fn abandoned_long_conversations_do_not_delay_a_small_request() {
    let server = Server::start(&[]);
    let small = || {
        let t0 = Instant::now();
        let body = chat(json!([{"role": "user", "content": "hi"}]), json!({"max_tokens": 1}));
        let (status, _, text) = server.post("/v1/chat/completions", &body);
        assert_eq!(status, 200, "{text}");
        t0.elapsed()
    };
    let warm = small();
    // Six clients (three per preparation thread) send 8,001-message conversations just
    // short of the byte bound (about 0.3 s of preparation each) and leave while they are
    // prepared or queued: their work stops, so the small request waits for none of it.
    let messages: Vec<Value> = (0..8_001)
        .map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": "hi ".repeat(16)}))
        .collect();
    let body = chat(json!(messages), json!({"max_tokens": 4})).to_string();
    let clients: Vec<TcpStream> = (0..6)
        .map(|_| {
            let mut s = server.connect();
            write!(
                s,
                "POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n\
                 content-length: {}\r\n\r\n{body}",
                body.len()
            )
            .unwrap();
            s
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    drop(clients);
    std::thread::sleep(Duration::from_millis(50));
    let after = small();
    assert!(after < Duration::from_millis(100), "small request took {after:?} after abandonment (warm {warm:?})");
}
