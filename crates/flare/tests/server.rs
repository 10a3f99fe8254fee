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
            // The developer's RUST_LOG would override the level these tests read lines at.
            .env_remove("RUST_LOG")
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
        let headers: Vec<(&str, &str)> = content_type.map(|c| ("content-type", c)).into_iter().collect();
        self.exchange(host, method, path, &headers, body)
    }

    /// One request on a fresh connection (`connection: close`); (status, head, body).
    fn exchange(
        &self,
        host: &str,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> (u16, String, String) {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let extra: String = headers.iter().map(|(k, v)| format!("{k}: {v}\r\n")).collect();
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nhost: {host}\r\n{extra}content-length: {}\r\nconnection: close\r\n\r\n{body}",
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
    // Temperature 0 is greedy decoding, as OpenAI-compatible servers treat it.
    assert_eq!(server.post("/v1/chat/completions", &chat(user.clone(), json!({"temperature": 0}))).0, 200);
    let cases: Vec<(Value, u16, &str)> = vec![
        (chat(user.clone(), json!({"temperature": -0.5})), 400, "invalid_parameter"),
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

    // A call to a tool the request does not offer: the failure arrives after the SSE headers as
    // an error event, with no [DONE].
    let (history, extra) = undeclared_call();
    let (status, _, body) = server.post("/v1/chat/completions", &chat(history, extra));
    assert_eq!(status, 200);
    let events = sse_data(&body);
    assert!(!events.iter().any(|e| e == "[DONE]"), "{body}");
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "undeclared_tool", "{body}");
}

/// A conversation in which the assistant called `get_stock`, which the next request does not
/// offer (it offers `get_weather`, `tool_choice` auto): the copy model calls `get_stock` again.
fn undeclared_call() -> (Value, Value) {
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]);
    let call = json!({"id": "call_0", "type": "function", "function": {"name": "get_stock", "arguments": "{}"}});
    let history = json!([
        {"role": "user", "content": "price?"},
        {"role": "assistant", "content": null, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": "12"},
        {"role": "assistant", "content": "It is 12."},
        {"role": "user", "content": "price?"}]);
    let extra = json!({"stream": true, "tools": tools, "tool_choice": "auto", "max_tokens": 64, "temperature": 0.01});
    (history, extra)
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
    // 2 ms steps: a 2,048-token stream lasts seconds, so the busy connections below are still
    // serving when the next one arrives (at CPU speed a release build finished them first).
    let server = Server::start(&["--max-connections", "4", "--sim-step-us", "2000"]);
    // A flood of connections that send nothing: /health still answers, replacing the oldest.
    let silent: Vec<TcpStream> = (0..4).map(|_| server.connect()).collect();
    std::thread::sleep(Duration::from_millis(200));
    let (status, _, body) = server.request("GET", "/health", None, "");
    assert_eq!((status, body.as_str()), (200, r#"{"status":"ok"}"#));
    assert!(
        server.wait_for_log("connection cap reached: closed 1 waiting connection", Duration::from_secs(5)).is_some()
    );
    drop(silent);

    // Every connection serving a request (long streams, their bodies in): the next one is
    // refused. (A request whose body is still arriving would be evicted instead.)
    let stream = chat(
        json!([{"role": "user", "content": "tell a long story"}]),
        json!({"stream": true, "max_tokens": 8000, "ignore_eos": true}),
    )
    .to_string();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut busy: Vec<TcpStream> = Vec::new();
    let refused = loop {
        assert!(Instant::now() < deadline, "the cap was never reached");
        let mut s = server.connect();
        // A refusal is written at accept, before any request: look for it before writing one
        // (writing into a refused, closed socket can reset it and lose the answer).
        let (got, closed) = read_until_closed(&mut s, Instant::now(), Duration::from_millis(150));
        if closed.is_some() || !got.is_empty() {
            break got;
        }
        write!(
            s,
            "POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n{stream}",
            stream.len()
        )
        .unwrap();
        // Let its body be read, so it counts as serving a request.
        std::thread::sleep(Duration::from_millis(100));
        busy.push(s);
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
    // At the limits (8 KB of stop strings, 1 KB each) a streaming request runs, and /health
    // stays fast.
    let stops: Vec<String> = (0..8).map(|i| format!("{i:03}{}", "q".repeat(1021))).collect();
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
    assert!(worst < Duration::from_millis(100), "/health took {worst:?} beside a stream at the stop limits");
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

#[test]
fn the_output_cap_is_stated_and_can_exceed_the_core_default() {
    let server = Server::start(&["--max-output-tokens", "6000"]);
    let (_, _, models) = server.request("GET", "/v1/models", None, "");
    let models: Value = serde_json::from_str(&models).unwrap();
    let m = &models["data"][0];
    // The embedded core's default output limit is 2,048: the cap is above it.
    assert_eq!((m["max_output_tokens"].as_u64(), m["default_max_tokens"].as_u64()), (Some(6000), Some(2048)), "{m}");
    let body = chat(json!([{"role": "user", "content": "count"}]), json!({"max_tokens": 5000, "ignore_eos": true}));
    let (status, _, text) = server.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 5000, "{}", v["usage"]);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    // Asking past the cap is clamped to it (as stated), not silently to the core default.
    let body = chat(json!([{"role": "user", "content": "count"}]), json!({"max_tokens": 7000, "ignore_eos": true}));
    let (_, _, text) = server.post("/v1/chat/completions", &body);
    assert_eq!(serde_json::from_str::<Value>(&text).unwrap()["usage"]["completion_tokens"], 6000);
    // A cap past the context is a startup error.
    let out = Command::new(env!("CARGO_BIN_EXE_flare"))
        .args(["run", "--port", "0", "--max-output-tokens", "100000"])
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("max_output_tokens"));
}

#[test]
fn unsupported_parameters_are_refused_not_ignored() {
    let server = Server::start(&[]);
    let base = json!([{"role": "user", "content": "hi"}]);
    for (extra, param) in
        [(json!({"logit_bias": {"42": 5}}), "logit_bias"), (json!({"top_logprobs": 3}), "top_logprobs")]
    {
        let (status, _, text) = server.post("/v1/chat/completions", &chat(base.clone(), extra));
        assert_eq!(status, 400, "{text}");
        let e: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            (e["error"]["code"].as_str(), e["error"]["param"].as_str()),
            (Some("unsupported_parameter"), Some(param))
        );
    }
    let (status, _, text) =
        server.post("/v1/completions", &json!({"model": "flare-sim", "prompt": "hi", "best_of": 3, "max_tokens": 4}));
    assert_eq!(status, 400, "{text}");
    // Their neutral values change nothing and pass.
    let neutral = json!({"logit_bias": {}, "top_logprobs": 0});
    assert_eq!(server.post("/v1/chat/completions", &chat(base, neutral)).0, 200);
    let (status, _, _) =
        server.post("/v1/completions", &json!({"model": "flare-sim", "prompt": "hi", "best_of": 1, "max_tokens": 4}));
    assert_eq!(status, 200);
}

#[test]
fn identical_seeded_requests_with_a_stop_end_identically() {
    let server = Server::start(&[]);
    let messages = json!([{"role": "user", "content": "the quick brown fox jumps over the lazy dog, again and again"}]);
    let run = |extra: Value| -> Value {
        let mut body = chat(messages.clone(), json!({"max_tokens": 48, "ignore_eos": true, "seed": 11}));
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (status, _, text) = server.post("/v1/chat/completions", &body);
        assert_eq!(status, 200, "{text}");
        serde_json::from_str(&text).unwrap()
    };
    let free = run(json!({}));
    let content = free["choices"][0]["message"]["content"].as_str().unwrap().to_owned();
    // A stop string taken from the middle of the free-running output.
    let chars: Vec<(usize, char)> = content.char_indices().collect();
    assert!(chars.len() > 12, "{content:?}");
    let (a, b) = (chars[chars.len() / 2].0, chars.get(chars.len() / 2 + 3).map_or(content.len(), |c| c.0));
    let stop = content[a..b].to_owned();
    let shown = &content[..content.find(&stop).unwrap()];
    let ends: Vec<(String, u64, String)> = (0..5)
        .map(|_| {
            let v = run(json!({"stop": ["\u{1F6AB}never", stop]}));
            let c = &v["choices"][0];
            (
                c["finish_reason"].as_str().unwrap().to_owned(),
                v["usage"]["completion_tokens"].as_u64().unwrap(),
                c["message"]["content"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    for e in &ends {
        assert_eq!(e, &ends[0], "{ends:?}");
    }
    assert_eq!((ends[0].0.as_str(), ends[0].2.as_str()), ("stop", shown), "stop {stop:?} in {content:?}");
    assert!(ends[0].1 < 48, "usage counts the tokens up to the stop: {ends:?}");

    // Anthropic names the stop string that matched.
    let body = json!({"model": "flare-sim", "max_tokens": 48, "messages": messages,
        "stop_sequences": ["\u{1F6AB}never", "the", "fox", " "]});
    let (status, _, text) = server.post("/v1/messages", &body);
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    if v["stop_reason"] == "stop_sequence" {
        let seq = v["stop_sequence"].as_str().unwrap();
        assert!(["the", "fox", " "].contains(&seq), "{v}");
    } else {
        assert!(v["stop_sequence"].is_null(), "{v}");
    }
}

// ---- Visibility: request ids, the per-request log line, `/metrics` families ----

/// A server started with `env` set (and `RUST_LOG` removed unless `env` sets it) on port 0,
/// ready once it listens and `/health` answers 200. It does not read the ready line, which a log
/// level may hide: the port is the one the child's own listening socket holds (`/proc`), so no
/// other process can take it between a probe and the bind.
fn start_with_env(env: &[(&str, &str)], extra: &[&str]) -> Server {
    let mut command = Command::new(env!("CARGO_BIN_EXE_flare"));
    command.args(["run", "--port", "0"]).args(extra).env_remove("RUST_LOG").stderr(Stdio::piped());
    for (k, v) in env {
        command.env(k, v);
    }
    let mut child = command.spawn().unwrap();
    let stderr = child.stderr.take().unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let lines = log.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            lines.lock().unwrap().push(line);
        }
    });
    let mut server = Server { child, port: 0, log };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            panic!("the server exited before it was ready ({status}): {:?}", server.log.lock().unwrap());
        }
        if server.port == 0 {
            server.port = listening_port(server.child.id()).unwrap_or(0);
        }
        if server.port != 0 && server.request("GET", "/health", None, "").0 == 200 {
            return server;
        }
        assert!(Instant::now() < deadline, "the server did not become ready in 60 s: {:?}", server.log.lock().unwrap());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The port of the TCP socket (IPv4 or IPv6) that process `pid` listens on, if it listens yet.
fn listening_port(pid: u32) -> Option<u16> {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .ok()?
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|t| Some(t.to_str()?.strip_prefix("socket:[")?.strip_suffix(']')?.to_owned()))
        .collect();
    let mut table = std::fs::read_to_string("/proc/net/tcp").ok()?;
    table += &std::fs::read_to_string("/proc/net/tcp6").unwrap_or_default();
    // `sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode`; 0A is LISTEN
    // (each file's header line has no inode among the child's).
    table.lines().find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        let listening = f.get(3) == Some(&"0A") && f.get(9).is_some_and(|i| inodes.iter().any(|n| n == i));
        if !listening {
            return None;
        }
        u16::from_str_radix(f.get(1)?.rsplit(':').next()?, 16).ok()
    })
}

/// A POST with extra request headers; (status, head, body).
fn post_with(server: &Server, path: &str, headers: &[(&str, &str)], body: &str) -> (u16, String, String) {
    let mut all = vec![("content-type", "application/json")];
    all.extend_from_slice(headers);
    server.exchange("localhost", "POST", path, &all, body)
}

/// Every `request done` JSON log line whose `request_id` is `id`, parsed.
fn request_lines(server: &Server, id: &str) -> Vec<Value> {
    server
        .log
        .lock()
        .unwrap()
        .iter()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["fields"]["request_id"] == id)
        .filter(|v| v["fields"]["message"].as_str().is_some_and(|m| m.starts_with("request done")))
        .collect()
}

/// The one `request done` line of request `id` (waits, bounded, for it to be written).
fn request_line(server: &Server, id: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let lines = request_lines(server, id);
        if let Some(first) = lines.first() {
            // Written once: a moment later there is still exactly one.
            std::thread::sleep(Duration::from_millis(100));
            assert_eq!(request_lines(server, id).len(), 1, "one line per request: {lines:?}");
            return first["fields"].clone();
        }
        assert!(Instant::now() < deadline, "no log line for {id}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The samples of `/metrics` whose name is exactly `name`, as (labels, value).
fn samples(text: &str, name: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (n, labels) = series.split_once('{').map_or((series, ""), |(n, rest)| (n, rest.trim_end_matches('}')));
            (n == name).then(|| (labels.to_owned(), value.parse().unwrap()))
        })
        .collect()
}

#[test]
fn metrics_expose_vllm_style_families_and_count_failures() {
    let server = Server::start(&[]);
    let conversation = json!([
        {"role": "system", "content": "A system prompt long enough to be cached. ".repeat(10)},
        {"role": "user", "content": "Name three colors."},
    ]);
    for extra in [json!({}), json!({"stream": true}), json!({})] {
        let (status, _, body) = server.post("/v1/chat/completions", &chat(conversation.clone(), extra));
        assert_eq!(status, 200, "{body}");
    }
    // Failures before admission: validation (400), an unparsable body (400), an unknown model (404).
    let user = json!([{"role": "user", "content": "hi"}]);
    assert_eq!(server.post("/v1/chat/completions", &chat(user.clone(), json!({"temperature": -1}))).0, 400);
    assert_eq!(server.request("POST", "/v1/chat/completions", Some("application/json"), "{bad").0, 400);
    assert_eq!(server.post("/v1/messages", &json!({"model": "nope", "max_tokens": 4, "messages": user})).0, 404);

    // The model thread publishes occupancy at the end of its turn, just after a response's
    // last event: wait (bounded) until it shows the server idle.
    let deadline = Instant::now() + Duration::from_secs(10);
    let (status, head, text) = loop {
        let (status, head, text) = server.request("GET", "/metrics", None, "");
        let running = samples(&text, "flare_num_requests_running").first().map(|s| s.1);
        if running == Some(0.0) || Instant::now() >= deadline {
            break (status, head, text);
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status, 200);
    assert!(head.contains("text/plain"), "{head}");
    let model = r#"model_name="flare-sim""#;
    let one = |name: &str| -> f64 {
        let s = samples(&text, name);
        assert_eq!(s.len(), 1, "{name}: {s:?}\n{text}");
        assert_eq!(s[0].0, model, "{name}");
        s[0].1
    };
    for (name, kind) in [
        ("flare_num_requests_running", "gauge"),
        ("flare_num_requests_waiting", "gauge"),
        ("flare_kv_cache_usage_perc", "gauge"),
        ("flare_prefix_cache_queries_total", "counter"),
        ("flare_prefix_cache_hits_total", "counter"),
        ("flare_e2e_request_latency_seconds", "histogram"),
        ("flare_request_queue_time_seconds", "histogram"),
        ("flare_request_prefill_time_seconds", "histogram"),
        ("flare_request_decode_time_seconds", "histogram"),
        ("flare_request_success_total", "counter"),
        ("flare_request_failures_total", "counter"),
    ] {
        assert!(text.contains(&format!("# TYPE {name} {kind}\n")), "{name} {kind}\n{text}");
        assert!(text.contains(&format!("# HELP {name} ")), "{name}");
    }
    // Idle now: nothing running or waiting, no page held by a request.
    assert_eq!(one("flare_num_requests_running"), 0.0);
    assert_eq!(one("flare_num_requests_waiting"), 0.0);
    let usage = one("flare_kv_cache_usage_perc");
    assert!((0.0..=1.0).contains(&usage), "{usage}");
    // The repeats restored the shared prompt from the cache.
    let (queries, hits) = (one("flare_prefix_cache_queries_total"), one("flare_prefix_cache_hits_total"));
    assert!(hits > 0.0 && hits <= queries, "hits {hits} of {queries}");
    // Three requests ran to their end; the failures never reached the scheduler.
    assert_eq!(one("flare_e2e_request_latency_seconds_count"), 3.0);
    for phase in ["queue", "prefill", "decode"] {
        let name = format!("flare_request_{phase}_time_seconds");
        assert_eq!(one(&format!("{name}_count")), 3.0, "{name}");
        let buckets = samples(&text, &format!("{name}_bucket"));
        assert!(buckets.len() > 10 && buckets.iter().all(|(l, _)| l.starts_with(model)), "{buckets:?}");
        assert_eq!(buckets.last().unwrap(), &(format!(r#"{model},le="+Inf""#), 3.0));
    }
    let failures = samples(&text, "flare_request_failures_total");
    for (status, code) in [(400, "invalid_parameter"), (400, "invalid_json"), (404, "model_not_found")] {
        let labels = format!(r#"{model},status="{status}",code="{code}""#);
        assert!(failures.contains(&(labels, 1.0)), "{code}: {failures:?}");
    }
    assert_eq!(failures.iter().map(|(_, v)| v).sum::<f64>(), 3.0, "{failures:?}");
    let successes: f64 = samples(&text, "flare_request_success_total").iter().map(|(_, v)| v).sum();
    assert_eq!(successes, 3.0);
    // The original families are still there, and balanced (what `flare load` checks).
    for name in ["flare_running_requests", "flare_queue_depth", "flare_pages_used", "flare_snapshot_rows_pinned"] {
        assert_eq!(samples(&text, name), vec![(String::new(), 0.0)], "{name}");
    }
    assert_eq!(server.metric("flare_requests_admitted_total"), 3.0);
    assert_eq!(server.metric("flare_requests_finished_total"), 3.0);
    assert!(!samples(&text, "flare_time_to_first_token_seconds_bucket").is_empty());
    // The simulated core has no speculative programs: speculation is declared, and idle.
    for name in [
        "flare_speculative_rounds_total",
        "flare_speculative_proposed_tokens_total",
        "flare_speculative_accepted_tokens_total",
        "flare_speculative_acceptance_ratio",
    ] {
        assert_eq!(samples(&text, name), vec![(String::new(), 0.0)], "{name}");
    }
    assert_eq!(samples(&text, "flare_decode_tokens_per_row"), vec![(String::new(), 1.0)]);
    // `flare load`'s parser reads the whole exposition, and its drain audit passes.
    flare_bench::metrics::parse(&text).unwrap();
    let audit = flare_bench::MetricsSnapshot::from_text(&text).violations();
    assert!(audit.is_empty(), "{audit:?}");

    // A 503 at admission (the queue takes nothing) is a failure too, by its code.
    let full = Server::start(&["--queue-limit", "0"]);
    assert_eq!(full.post("/v1/chat/completions", &chat(user, json!({}))).0, 503);
    let (_, _, text) = full.request("GET", "/metrics", None, "");
    assert_eq!(
        samples(&text, "flare_request_failures_total"),
        vec![(format!(r#"{model},status="503",code="queue_full""#), 1.0)]
    );
    assert_eq!(samples(&text, "flare_e2e_request_latency_seconds_count"), vec![(model.to_owned(), 0.0)]);
}

#[test]
fn a_client_request_id_is_kept_in_headers_and_logs() {
    let server = Server::start(&[]);
    let body = chat(json!([{"role": "user", "content": "hello"}]), json!({})).to_string();
    // Kept: the header comes back as sent, the body keeps its own response id.
    let (status, head, text) =
        post_with(&server, "/v1/chat/completions", &[("X-Request-Id", "client-42_a.b:c")], &body);
    assert_eq!(status, 200, "{text}");
    assert_eq!(request_id(&head), "client-42_a.b:c");
    let response_id = serde_json::from_str::<Value>(&text).unwrap()["id"].as_str().unwrap().to_owned();
    assert!(response_id.starts_with("chatcmpl-"), "{response_id}");
    let line = request_line(&server, "client-42_a.b:c");
    assert_eq!(line["response_id"], response_id.as_str(), "{line}");

    // Streams, errors before headers, rejected bodies and the Anthropic API keep it too.
    let streamed = chat(json!([{"role": "user", "content": "hello"}]), json!({"stream": true})).to_string();
    let (status, head, _) = post_with(&server, "/v1/chat/completions", &[("x-request-id", "stream-1")], &streamed);
    assert_eq!((status, request_id(&head).as_str()), (200, "stream-1"));
    let invalid = chat(json!([{"role": "user", "content": "hello"}]), json!({"top_p": 2})).to_string();
    let (status, head, _) = post_with(&server, "/v1/chat/completions", &[("x-request-id", "bad-1")], &invalid);
    assert_eq!((status, request_id(&head).as_str()), (400, "bad-1"));
    let (status, head, _) = post_with(&server, "/v1/completions", &[("x-request-id", "json-1")], "{oops");
    assert_eq!((status, request_id(&head).as_str()), (400, "json-1"));
    let messages = json!({"model": "flare-sim", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]});
    let (status, head, text) =
        post_with(&server, "/v1/messages", &[("x-request-id", "anthropic-1")], &messages.to_string());
    assert_eq!((status, request_id(&head).as_str()), (200, "anthropic-1"), "{text}");
    assert!(serde_json::from_str::<Value>(&text).unwrap()["id"].as_str().unwrap().starts_with("msg_"));
    for id in ["stream-1", "bad-1", "json-1", "anthropic-1"] {
        request_line(&server, id);
    }

    // Not kept (too long, not visible ASCII): a fresh id, as without one.
    let long = "x".repeat(129);
    for bad in [long.as_str(), "has space", "tab\there", "caf\u{e9}"] {
        let (status, head, _) = post_with(&server, "/v1/chat/completions", &[("x-request-id", bad)], &body);
        assert_eq!(status, 200);
        let id = request_id(&head);
        assert!(id.starts_with("chatcmpl-") && id != bad, "{bad:?} -> {id}");
    }
    let longest = "y".repeat(128);
    let (_, head, _) = post_with(&server, "/v1/chat/completions", &[("x-request-id", &longest)], &body);
    assert_eq!(request_id(&head), longest);
}

#[test]
fn every_request_logs_one_line_with_its_fields() {
    let server = Server::start(&[]);
    let id = |name: &str| [("x-request-id", name.to_owned())];
    let post = |name: &str, path: &str, body: &Value| {
        let headers = id(name);
        let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        post_with(&server, path, &headers, &body.to_string())
    };
    let user = json!([{"role": "user", "content": "Count from one to ten."}]);

    // A whole response with n = 2: one line, output tokens summed, reasons in index order.
    let (status, _, text) = post("whole", "/v1/chat/completions", &chat(user.clone(), json!({"n": 2})));
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    let line = request_line(&server, "whole");
    assert_eq!(
        (line["api"].as_str(), line["stream"].as_bool(), line["status"].as_u64()),
        (Some("chat"), Some(false), Some(200))
    );
    assert_eq!(line["prompt_tokens"], v["usage"]["prompt_tokens"]);
    assert_eq!(line["output_tokens"], v["usage"]["completion_tokens"]);
    assert_eq!(line["cached_tokens"], v["usage"]["prompt_tokens_details"]["cached_tokens"]);
    let reasons: Vec<&str> =
        v["choices"].as_array().unwrap().iter().map(|c| c["finish_reason"].as_str().unwrap()).collect();
    assert_eq!(line["finish_reason"], reasons.join(","));
    let (ttft, total) = (line["ttft_ms"].as_f64().unwrap(), line["duration_ms"].as_f64().unwrap());
    assert!(ttft > 0.0 && ttft <= total, "{line}");
    assert!(line.get("code").is_none() && line.get("response_id").is_some(), "{line}");
    assert_eq!(line["message"], "request done");

    // A stream: logged when it ends, with its usage.
    let (status, _, body) = post(
        "streamed",
        "/v1/chat/completions",
        &chat(user.clone(), json!({"stream": true, "stream_options": {"include_usage": true}})),
    );
    assert_eq!(status, 200);
    let events = sse_data(&body);
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    let line = request_line(&server, "streamed");
    assert_eq!((line["stream"].as_bool(), line["status"].as_u64()), (Some(true), Some(200)));
    assert_eq!(line["output_tokens"], usage["usage"]["completion_tokens"]);
    assert!(line["ttft_ms"].as_f64().is_some());

    // A failure after the SSE headers: status 200 was sent, the code says what failed.
    // (As in `typed_errors_before_headers_and_in_streams`: a call to a tool not offered.)
    let (history, extra) = undeclared_call();
    let (status, _, body) = post("stream-failed", "/v1/chat/completions", &chat(history, extra));
    assert_eq!(status, 200);
    assert!(!sse_data(&body).iter().any(|e| e == "[DONE]"), "{body}");
    let line = request_line(&server, "stream-failed");
    assert_eq!((line["status"].as_u64(), line["code"].as_str()), (Some(200), Some("undeclared_tool")), "{line}");
    assert_eq!(line["stage"], "output", "{line}");

    // A failure before headers: its status, code, stage and message.
    let (status, _, _) = post("rejected", "/v1/chat/completions", &chat(user.clone(), json!({"max_tokens": 0})));
    assert_eq!(status, 400);
    let line = request_line(&server, "rejected");
    assert_eq!((line["status"].as_u64(), line["code"].as_str()), (Some(400), Some("invalid_max_tokens")), "{line}");
    assert_eq!(line["stage"], "validation");
    assert!(line["message"].as_str().unwrap().starts_with("request done: "), "{line}");
    assert!(line.get("finish_reason").is_none() && line.get("ttft_ms").is_none(), "{line}");

    // The other APIs log the same fields.
    let messages = json!({"model": "flare-sim", "max_tokens": 6, "messages": [{"role": "user", "content": "hi"}]});
    assert_eq!(post("anthropic", "/v1/messages", &messages).0, 200);
    assert_eq!(request_line(&server, "anthropic")["api"], "messages");
    let responses = json!({"model": "flare-sim", "input": "hi", "max_output_tokens": 6, "stream": true});
    assert_eq!(post("responses", "/v1/responses", &responses).0, 200);
    assert_eq!(request_line(&server, "responses")["api"], "responses");
    let completion = json!({"model": "flare-sim", "prompt": "Once upon", "max_tokens": 6});
    let (status, _, text) = post("completion", "/v1/completions", &completion);
    assert_eq!(status, 200, "{text}");
    let usage = &serde_json::from_str::<Value>(&text).unwrap()["usage"];
    assert_eq!(request_line(&server, "completion")["output_tokens"], usage["completion_tokens"]);

    // A client that leaves mid-stream is logged as such, without a failure count.
    let mut s = server.connect();
    let body = chat(user, json!({"stream": true, "max_tokens": 8000, "ignore_eos": true})).to_string();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n\
         x-request-id: leaver\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    read_until(&mut s, "data: ");
    drop(s);
    let line = request_line(&server, "leaver");
    assert_eq!((line["code"].as_str(), line["status"].as_u64()), (Some("client_disconnected"), Some(200)), "{line}");
    let (_, _, text) = server.request("GET", "/metrics", None, "");
    let failures: f64 = samples(&text, "flare_request_failures_total").iter().map(|(_, v)| v).sum();
    assert_eq!(failures, 2.0, "the stream failure and the 400: {text}");

    // The text format: one line, fields as key=value.
    let text_server = Server::start_logging("text", &[]);
    let body = chat(json!([{"role": "user", "content": "hi"}]), json!({})).to_string();
    assert_eq!(post_with(&text_server, "/v1/chat/completions", &[("x-request-id", "text-1")], &body).0, 200);
    let line = text_server.wait_for_log(r#"request_id="text-1""#, Duration::from_secs(5)).expect("logged");
    for field in [
        " INFO request done ",
        "api=\"chat\"",
        "status=200",
        "finish_reason=",
        "prompt_tokens=",
        "cached_tokens=",
        "output_tokens=",
        "ttft_ms=",
        "duration_ms=",
    ] {
        assert!(line.contains(field), "{field} in {line}");
    }
}

#[test]
fn rust_log_wins_over_log_level_and_log_level_filters() {
    let user = json!([{"role": "user", "content": "hi"}]);
    // --log-level warn: request lines at info are gone, a 503 (warn) is logged.
    let server = start_with_env(&[], &["--log-level", "warn", "--log-format", "json", "--queue-limit", "0"]);
    assert_eq!(server.post("/v1/chat/completions", &chat(user.clone(), json!({}))).0, 503);
    let line = server.wait_for_log("queue_full", Duration::from_secs(5)).expect("the 503 is logged at warn");
    assert!(line.contains(r#""level":"WARN""#) && line.contains("request done"), "{line}");
    assert!(!server.log.lock().unwrap().iter().any(|l| l.contains(r#""level":"INFO""#)), "no info line");
    drop(server);

    // RUST_LOG, when set, decides: info for everything but the HTTP layer.
    let server = start_with_env(&[("RUST_LOG", "info,helios_http=warn")], &["--log-level", "error"]);
    assert!(server.wait_for_log("ready: listening", Duration::from_secs(5)).is_some());
    assert_eq!(server.post("/v1/chat/completions", &chat(user.clone(), json!({}))).0, 200);
    std::thread::sleep(Duration::from_millis(300));
    assert!(!server.log.lock().unwrap().iter().any(|l| l.contains("request done")), "helios_http is at warn");
    drop(server);

    // An invalid RUST_LOG is reported, and --log-level used.
    let server = start_with_env(&[("RUST_LOG", "info,helios_http=loudest")], &["--log-level", "info"]);
    assert!(server.wait_for_log("is invalid", Duration::from_secs(5)).is_some());
    assert_eq!(server.post("/v1/chat/completions", &chat(user, json!({}))).0, 200);
    assert!(server.wait_for_log("request done", Duration::from_secs(5)).is_some());
}

#[test]
fn slow_bodies_filling_the_connection_cap_do_not_lock_out_health() {
    let server = Server::start(&["--max-connections", "8"]);
    // One client fills the cap with requests whose body stalls after 1 byte of 100,000 (well
    // within the 30 s body timeout), and opens another whenever one is closed.
    let slow_body = || {
        let mut s = server.connect();
        s.write_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n\
              content-length: 100000\r\n\r\n{",
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(20));
        s
    };
    let mut slow: Vec<TcpStream> = (0..8).map(|_| slow_body()).collect();
    std::thread::sleep(Duration::from_millis(300));
    // /health answers at once, each time in place of the oldest slow body.
    for round in 0..3 {
        if round > 0 {
            slow.push(slow_body());
        }
        let started = Instant::now();
        let mut s = server.connect();
        s.write_all(b"GET /health HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n").unwrap();
        let (got, _) = read_until_closed(&mut s, started, Duration::from_millis(500));
        let took = started.elapsed();
        assert!(got.starts_with("HTTP/1.1 200") && got.ends_with(r#"{"status":"ok"}"#), "{got}");
        assert!(took < Duration::from_millis(500), "{took:?}");
        // Its own connection gone before the next round (an idle one would be evicted first).
        std::thread::sleep(Duration::from_millis(200));
    }
    // Evicted oldest first, closed unanswered; the others are still open.
    let closed: Vec<bool> = slow
        .iter_mut()
        .map(|s| {
            let (got, closed) = read_until_closed(s, Instant::now(), Duration::from_millis(100));
            assert!(got.is_empty(), "an evicted body is not answered: {got}");
            closed.is_some()
        })
        .collect();
    assert_eq!(closed, [true, true, true, false, false, false, false, false, false, false]);
    let line =
        server.wait_for_log("still sending a request body", Duration::from_secs(5)).expect("body evictions logged");
    assert!(line.contains(r#""max_connections":8"#), "{line}");
}

// ---- Access and compatibility: API key, served names, CORS, model lookup, count_tokens,
// body limit, the exposure warning ----

/// A request with extra headers (content type only with a body); (status, head, body).
fn request_with(
    server: &Server,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&Value>,
) -> (u16, String, String) {
    let body = body.map(Value::to_string).unwrap_or_default();
    let mut all = headers.to_vec();
    if !body.is_empty() {
        all.push(("content-type", "application/json"));
    }
    server.exchange("localhost", method, path, &all, &body)
}

/// The value of response header `name` (case-insensitive), if present.
fn header(head: &str, name: &str) -> Option<String> {
    head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim().eq_ignore_ascii_case(name).then(|| v.trim().to_owned())
    })
}

fn message(text: &str) -> Value {
    json!({"model": "flare-sim", "max_tokens": 8, "temperature": 0.5,
        "messages": [{"role": "user", "content": text}]})
}

#[test]
fn an_api_key_guards_every_route_but_health_and_metrics_in_both_envelopes() {
    let server = Server::start(&["--api-key", "sk-flag-key"]);
    let chat_body = chat(json!([{"role": "user", "content": "Hello"}]), json!({"max_tokens": 4}));
    // Open routes.
    assert_eq!(request_with(&server, "GET", "/health", &[], None).0, 200);
    assert_eq!(request_with(&server, "GET", "/metrics", &[], None).0, 200);
    // OpenAI routes: 401 in the OpenAI envelope, missing and wrong keys told apart.
    for (headers, code) in [
        (&[][..], "missing_api_key"),
        (&[("authorization", "Bearer sk-wrong")][..], "invalid_api_key"),
        (&[("authorization", "Basic c2stZmxhZy1rZXk=")][..], "invalid_api_key"),
        (&[("x-api-key", "sk-flag-ke")][..], "invalid_api_key"),
    ] {
        for (method, path, body) in [
            ("GET", "/v1/models", None),
            ("GET", "/v1/models/flare-sim", None),
            ("POST", "/v1/chat/completions", Some(&chat_body)),
            ("POST", "/tokenize", Some(&json!({"prompt": "hi"}))),
            ("GET", "/no/such/route", None),
        ] {
            let (status, head, body) = request_with(&server, method, path, headers, body);
            assert_eq!(status, 401, "{method} {path} {headers:?}: {body}");
            let v: Value = serde_json::from_str(&body).unwrap();
            assert_eq!(v["error"]["type"], "invalid_request_error", "{body}");
            assert_eq!(v["error"]["code"], code, "{body}");
            assert_eq!(header(&head, "www-authenticate").as_deref(), Some("Bearer"));
        }
        // Anthropic routes: the Anthropic envelope.
        for path in ["/v1/messages", "/v1/messages/count_tokens"] {
            let (status, _, body) = request_with(&server, "POST", path, headers, Some(&message("Hello")));
            assert_eq!(status, 401, "{path}: {body}");
            let v: Value = serde_json::from_str(&body).unwrap();
            assert_eq!(v["type"], "error", "{body}");
            assert_eq!(v["error"]["type"], "authentication_error", "{body}");
            assert_eq!(v["error"]["code"], code, "{body}");
        }
    }
    // The key as a bearer token or as `x-api-key`, on either API.
    for auth in [("authorization", "Bearer sk-flag-key"), ("x-api-key", "sk-flag-key")] {
        let (status, _, body) = request_with(&server, "POST", "/v1/chat/completions", &[auth], Some(&chat_body));
        assert_eq!(status, 200, "{auth:?}: {body}");
        let (status, _, body) = request_with(&server, "POST", "/v1/messages", &[auth], Some(&message("Hello")));
        assert_eq!(status, 200, "{auth:?}: {body}");
        assert_eq!(request_with(&server, "GET", "/v1/models", &[auth], None).0, 200);
    }
    // The key never reaches the log.
    assert!(server.wait_for_log("no valid API key", Duration::from_secs(5)).is_some());
    assert!(!server.log.lock().unwrap().iter().any(|l| l.contains("sk-flag-key") || l.contains("sk-wrong")));

    // FLARE_API_KEY when the flag is absent; the flag wins over it.
    let env_only = start_with_env(&[("FLARE_API_KEY", "sk-env-key")], &[]);
    let bearer = |k: &str| format!("Bearer {k}");
    let models =
        |s: &Server, key: &str| request_with(s, "GET", "/v1/models", &[("authorization", &bearer(key))], None).0;
    assert_eq!(request_with(&env_only, "GET", "/v1/models", &[], None).0, 401);
    assert_eq!(models(&env_only, "sk-env-key"), 200);
    drop(env_only);
    let both = start_with_env(&[("FLARE_API_KEY", "sk-env-key")], &["--api-key", "sk-flag-key"]);
    assert_eq!(models(&both, "sk-env-key"), 401);
    assert_eq!(models(&both, "sk-flag-key"), 200);
}

#[test]
fn served_model_names_are_aliases_and_the_first_is_listed_and_reported() {
    let server = Server::start(&["--served-model-name", "primary-name,alias-one", "org/alias-two"]);
    let (_, _, models) = request_with(&server, "GET", "/v1/models", &[], None);
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"].as_array().unwrap().len(), 1, "{models}");
    assert_eq!(models["data"][0]["id"], "primary-name");
    for name in ["primary-name", "alias-one", "org/alias-two"] {
        let body = chat(json!([{"role": "user", "content": "Hello"}]), json!({"model": name, "max_tokens": 4}));
        let (status, _, body) = server.post("/v1/chat/completions", &body);
        assert_eq!(status, 200, "{name}: {body}");
        assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["model"], "primary-name");
        let mut m = message("Hello");
        m["model"] = json!(name);
        let (status, _, body) = server.post("/v1/messages", &m);
        assert_eq!(status, 200, "{name}: {body}");
        assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["model"], "primary-name");
        // Each name retrieves the same object, under the first name.
        let (status, _, body) = request_with(&server, "GET", &format!("/v1/models/{name}"), &[], None);
        assert_eq!(status, 200, "{name}: {body}");
        assert_eq!(serde_json::from_str::<Value>(&body).unwrap(), models["data"][0]);
    }
    // The core's own name is no longer served.
    let (status, _, body) =
        server.post("/v1/chat/completions", &chat(json!([{"role": "user", "content": "Hello"}]), json!({})));
    assert_eq!(status, 404, "{body}");
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["error"]["code"], "model_not_found");
    // Logs and metric labels carry the first name.
    let (_, _, text) = request_with(&server, "GET", "/metrics", &[], None);
    assert!(text.contains(r#"model_name="primary-name""#), "{text}");
}

#[test]
fn models_by_id_are_found_or_404_and_no_cors_headers_by_default() {
    let server = Server::start(&[]);
    let (status, _, body) = request_with(&server, "GET", "/v1/models/flare-sim", &[], None);
    assert_eq!(status, 200, "{body}");
    let model: Value = serde_json::from_str(&body).unwrap();
    let (_, _, list) = request_with(&server, "GET", "/v1/models", &[], None);
    assert_eq!(model, serde_json::from_str::<Value>(&list).unwrap()["data"][0]);
    assert_eq!((model["id"].as_str(), model["object"].as_str()), (Some("flare-sim"), Some("model")));
    for missing in ["/v1/models/gpt-4o", "/v1/models/org/flare-sim", "/v1/models/flare-sim%20"] {
        let (status, _, body) = request_with(&server, "GET", missing, &[], None);
        assert_eq!(status, 404, "{missing}: {body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            (v["error"]["code"].as_str(), v["error"]["type"].as_str()),
            (Some("model_not_found"), Some("not_found_error"))
        );
    }
    // Without --allowed-origins: no CORS headers, preflights not answered.
    let (status, head, _) = request_with(
        &server,
        "OPTIONS",
        "/v1/chat/completions",
        &[("origin", "http://app.example"), ("access-control-request-method", "POST")],
        None,
    );
    assert_eq!(status, 405);
    let (_, get_head, _) = request_with(&server, "GET", "/v1/models", &[("origin", "http://app.example")], None);
    for h in [head, get_head] {
        assert!(!h.to_ascii_lowercase().contains("access-control-"), "{h}");
    }
    // Bound to loopback: no exposure warning.
    assert!(!server.log.lock().unwrap().iter().any(|l| l.contains("non-loopback")));
}

#[test]
fn cors_answers_preflights_and_marks_responses_only_for_allowed_origins() {
    let server = Server::start(&["--allowed-origins", "http://app.example,http://localhost:5173/", "--api-key", "k-1"]);
    let preflight = |origin: &str| {
        request_with(
            &server,
            "OPTIONS",
            "/v1/chat/completions",
            &[
                ("origin", origin),
                ("access-control-request-method", "POST"),
                ("access-control-request-headers", "authorization, content-type, x-stainless-os"),
            ],
            None,
        )
    };
    // Allowed: answered before the key check, the origin echoed.
    for origin in ["http://app.example", "http://localhost:5173"] {
        let (status, head, _) = preflight(origin);
        assert_eq!(status, 204, "{head}");
        assert_eq!(header(&head, "access-control-allow-origin").as_deref(), Some(origin));
        let methods = header(&head, "access-control-allow-methods").unwrap();
        for m in ["GET", "POST", "OPTIONS"] {
            assert!(methods.contains(m), "{methods}");
        }
        let allowed = header(&head, "access-control-allow-headers").unwrap();
        for h in ["authorization", "x-api-key", "content-type", "x-request-id", "x-stainless-os"] {
            assert!(allowed.contains(h), "{allowed}");
        }
        assert!(header(&head, "vary").is_some_and(|v| v.to_ascii_lowercase().contains("origin")), "{head}");
    }
    // Not allowed: no CORS headers (and the key check applies).
    for origin in ["http://evil.example", "http://app.example.evil.example", "http://localhost:5174"] {
        let (status, head, _) = preflight(origin);
        assert_eq!(status, 401, "{head}");
        assert!(header(&head, "access-control-allow-origin").is_none(), "{head}");
    }
    // Actual requests: served for every origin, marked only for allowed ones (errors included).
    let chat_body = chat(json!([{"role": "user", "content": "Hello"}]), json!({"max_tokens": 4}));
    for (origin, allowed) in [("http://app.example", true), ("http://evil.example", false)] {
        let (status, head, _) = request_with(
            &server,
            "POST",
            "/v1/chat/completions",
            &[("origin", origin), ("authorization", "Bearer k-1")],
            Some(&chat_body),
        );
        assert_eq!(status, 200);
        assert_eq!(header(&head, "access-control-allow-origin").as_deref(), allowed.then_some(origin), "{head}");
        if allowed {
            assert!(header(&head, "access-control-expose-headers").unwrap().contains("x-request-id"));
        }
        let (status, head, _) = request_with(&server, "GET", "/v1/models", &[("origin", origin)], None);
        assert_eq!(status, 401);
        assert_eq!(header(&head, "access-control-allow-origin").as_deref(), allowed.then_some(origin), "{head}");
    }
    drop(server);
    let any = Server::start(&["--allowed-origins", "*"]);
    let (status, head, _) = request_with(&any, "GET", "/v1/models", &[("origin", "http://anything.example")], None);
    assert_eq!(status, 200);
    assert_eq!(header(&head, "access-control-allow-origin").as_deref(), Some("*"));
    assert!(any.wait_for_log("without an API key", Duration::from_secs(5)).is_some());
}

#[test]
fn count_tokens_equals_the_input_tokens_messages_reports() {
    let server = Server::start(&[]);
    let weather = json!({"name": "get_weather", "description": "Current weather for a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}});
    let time = json!({"name": "get_time", "description": "Local time in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}});
    let conversation = json!([
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 degrees, sunny"},
            {"type": "text", "text": "And in Rome?"}]},
    ]);
    let cases = [
        json!({"messages": [{"role": "user", "content": "Hello"}]}),
        json!({"system": "You are terse.", "messages": conversation}),
        json!({"system": [{"type": "text", "text": "You are terse."}], "messages": conversation,
            "tools": [weather, time]}),
        json!({"messages": conversation, "tools": [weather, time], "tool_choice": {"type": "any"}}),
        json!({"system": "S.", "messages": conversation, "tools": [weather, time],
            "tool_choice": {"type": "tool", "name": "get_time"}}),
        json!({"messages": conversation, "tools": [weather], "tool_choice": {"type": "none"}}),
    ];
    let mut counts = Vec::new();
    for case in cases {
        let mut body = case.clone();
        body["model"] = json!("flare-sim");
        let (status, _, counted) = server.post("/v1/messages/count_tokens", &body);
        assert_eq!(status, 200, "{case}: {counted}");
        let counted: Value = serde_json::from_str(&counted).unwrap();
        assert_eq!(counted.as_object().unwrap().len(), 1, "{counted}");
        body["max_tokens"] = json!(4);
        body["temperature"] = json!(0.5);
        let (status, _, generated) = server.post("/v1/messages", &body);
        assert_eq!(status, 200, "{case}: {generated}");
        let generated: Value = serde_json::from_str(&generated).unwrap();
        assert_eq!(counted["input_tokens"], generated["usage"]["input_tokens"], "{case}");
        counts.push(counted["input_tokens"].as_u64().unwrap());
    }
    assert!(counts.windows(2).all(|w| w[0] != w[1]), "every case renders differently: {counts:?}");
    // Errors in the Anthropic envelope.
    for (body, status, code) in [
        (json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]}), 404, "model_not_found"),
        (json!({"model": "flare-sim", "messages": []}), 400, "empty_messages"),
        (json!({"model": "flare-sim"}), 400, "invalid_field"),
        (
            json!({"model": "flare-sim", "messages": [{"role": "user", "content": "x"}], "tools": [weather],
                "tool_choice": {"type": "tool", "name": "get_time"}}),
            400,
            "unknown_tool_choice",
        ),
    ] {
        let (got, _, text) = server.post("/v1/messages/count_tokens", &body);
        assert_eq!(got, status, "{body}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!((v["type"].as_str(), v["error"]["code"].as_str()), (Some("error"), Some(code)), "{text}");
    }
}

#[test]
fn max_body_bytes_bounds_request_bodies_and_is_in_help() {
    let help = Command::new(env!("CARGO_BIN_EXE_flare")).args(["run", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    for flag in ["--max-body-bytes", "--api-key", "FLARE_API_KEY", "--served-model-name", "--allowed-origins"] {
        assert!(help.contains(flag), "{flag} in --help: {help}");
    }
    let server = Server::start(&["--max-body-bytes", "4096"]);
    let small = chat(json!([{"role": "user", "content": "x".repeat(1000)}]), json!({"max_tokens": 2}));
    assert_eq!(server.post("/v1/chat/completions", &small).0, 200);
    let large = chat(json!([{"role": "user", "content": "x".repeat(5000)}]), json!({"max_tokens": 2}));
    let (status, _, body) = server.post("/v1/chat/completions", &large);
    assert_eq!(status, 413, "{body}");
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["error"]["code"], "body_too_large");
    let mut m = message(&"x".repeat(5000));
    let (status, _, body) = server.post("/v1/messages", &m);
    assert_eq!(status, 413, "{body}");
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["type"], "error");
    m = message("short");
    assert_eq!(server.post("/v1/messages", &m).0, 200);
}

#[test]
fn a_non_loopback_bind_without_a_key_warns() {
    // Bound to every interface on a free port; the test only connects over 127.0.0.1.
    let open = start_with_env(&[], &["--host", "0.0.0.0"]);
    assert!(open.wait_for_log("non-loopback address", Duration::from_secs(5)).is_some());
    drop(open);
    let keyed = start_with_env(&[], &["--host", "0.0.0.0", "--api-key", "k"]);
    assert!(keyed.wait_for_log("listening on", Duration::from_secs(5)).is_some());
    assert!(!keyed.log.lock().unwrap().iter().any(|l| l.contains("non-loopback")));
}

/// Sends SIGTERM and waits (bounded) for a clean exit.
fn terminate(mut server: Server) -> Server {
    let pid = server.child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            assert!(status.success(), "{status}");
            return server;
        }
        assert!(Instant::now() < deadline, "server did not exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// With a disk tier, a graceful shutdown writes the cached conversations out, and the next
/// server (same core, same directory) serves the continuation with its history cached.
#[test]
fn a_conversation_cached_before_a_restart_is_cached_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let flags = ["--disk-cache-dir", dir.path().to_str().unwrap(), "--disk-cache-gib", "1", "--host-cache-gib", "0.25"];
    let conversation = json!([
        {"role": "system", "content": "You are a careful coding agent. ".repeat(30)},
        {"role": "user", "content": "List the crates and what each one owns."},
    ]);
    let server = Server::start(&flags);
    let (status, _, body) = server.post("/v1/chat/completions", &chat(conversation.clone(), json!({})));
    assert_eq!(status, 200, "{body}");
    let first: Value = serde_json::from_str(&body).unwrap();
    let prompt_tokens = first["usage"]["prompt_tokens"].as_u64().unwrap();
    let server = terminate(server);
    let flushed = server.log.lock().unwrap().iter().find(|l| l.contains("disk cache: flushed")).cloned();
    assert!(flushed.is_some_and(|l| !l.contains("\"on_disk\":0")), "{:?}", server.log.lock().unwrap());

    let server = Server::start(&flags);
    let indexed = server.wait_for_log("disk cache tier indexed", Duration::from_secs(5)).expect("indexed");
    assert!(!indexed.contains("\"checkpoints\":0"), "{indexed}");
    let mut next = conversation.as_array().unwrap().clone();
    next.push(first["choices"][0]["message"].clone());
    next.push(json!({"role": "user", "content": "Now the tests."}));
    let (status, _, body) = server.post("/v1/chat/completions", &chat(Value::Array(next), json!({})));
    assert_eq!(status, 200, "{body}");
    let again: Value = serde_json::from_str(&body).unwrap();
    let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached >= prompt_tokens, "{cached} cached of the previous {prompt_tokens}-token prompt: {again}");
    // The tier gauges are published when the model thread turns idle: poll for them.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, _, metrics) = server.request("GET", "/metrics", None, "");
        let restores = metrics
            .lines()
            .find_map(|l| l.strip_prefix("flare_cache_tier_restores_total{tier=\"disk\"} "))
            .and_then(|v| v.trim().parse::<u64>().ok());
        if restores.is_some_and(|r| r >= 1) {
            break;
        }
        assert!(Instant::now() < deadline, "no disk restore in /metrics: {metrics}");
        std::thread::sleep(Duration::from_millis(20));
    }
    terminate(server);
}

/// A stand-in for `python3 -m ignition prepare`: copies the fixture core to `--out`, counts its
/// runs, and prints progress lines; with FAIL set it fails like a broken preparation.
fn fake_preparer(dir: &std::path::Path) -> std::path::PathBuf {
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/cores/abi2");
    let script = dir.join("fake-python");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nout=\"\"\nwhile [ $# -gt 0 ]; do case \"$1\" in --out) out=\"$2\"; shift;; esac; shift; done\n\
             echo '[ignition] prepare ...' >&2\n\
             if [ -n \"$FAIL\" ]; then echo 'torch.OutOfMemoryError: CUDA out of memory' >&2; exit 3; fi\n\
             cp -r '{}' \"$out\"\necho run >> '{}'\necho '[ignition] prepare: done in 0.1 s' >&2\n",
            fixture.display(),
            dir.join("runs").display()
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    script
}

/// `flare run --model DIR`: the first start prepares (progress in the log) and caches the core,
/// the next reuses it, a changed checkpoint prepares again, and a failing preparation is a
/// startup error carrying the preparer's own message, with no port bound.
#[test]
fn a_checkpoint_is_prepared_once_and_served_from_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::write(model.join("config.json"), r#"{"architectures": ["LlamaForCausalLM"]}"#).unwrap();
    std::fs::write(model.join("model.safetensors"), vec![0u8; 4 << 20]).unwrap();
    let python = fake_preparer(dir.path());
    let cache = dir.path().join("cache");
    let args = |m: &std::path::Path| -> Vec<String> {
        ["--sim", "--model", m.to_str().unwrap(), "--python", python.to_str().unwrap(), "--core-cache-dir"]
            .iter()
            .map(|s| (*s).to_owned())
            .chain([cache.to_str().unwrap().to_owned()])
            .collect()
    };
    let runs = || std::fs::read_to_string(dir.path().join("runs")).map_or(0, |s| s.lines().count());
    let start = |m: &std::path::Path| {
        let a = args(m);
        let refs: Vec<&str> = a.iter().map(String::as_str).collect();
        Server::start(&refs)
    };
    let server = start(&model);
    assert!(server.wait_for_log("preparing a runtime core", Duration::from_secs(1)).is_some());
    assert!(server.wait_for_log("[ignition] prepare: done", Duration::from_secs(1)).is_some(), "progress shown");
    let (status, _, models) = server.request("GET", "/v1/models", None, "");
    assert_eq!(status, 200, "{models}");
    terminate(server);
    assert_eq!(runs(), 1);
    let server = start(&model);
    assert!(server.wait_for_log("reusing the prepared core", Duration::from_secs(1)).is_some());
    terminate(server);
    assert_eq!(runs(), 1, "the cached core was reused");
    std::fs::write(model.join("config.json"), r#"{"architectures": ["LlamaForCausalLM"], "x": 1}"#).unwrap();
    terminate(start(&model));
    assert_eq!(runs(), 2, "a changed checkpoint is prepared again");
    // A failing preparation.
    let failing = dir.path().join("other");
    std::fs::create_dir_all(&failing).unwrap();
    std::fs::write(failing.join("config.json"), "{}").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_flare"))
        .arg("run")
        .args(args(&failing))
        .args(["--port", "0"])
        .env("FAIL", "1")
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{stderr}");
    assert!(stderr.contains("CUDA out of memory") && !stderr.contains("listening"), "{stderr}");
    let leftovers: Vec<_> = std::fs::read_dir(&cache).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(leftovers.iter().all(|n| !n.to_string_lossy().contains(".tmp")), "{leftovers:?}");
}
