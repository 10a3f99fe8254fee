//! `flare run` (embedded simulated core) over real sockets: readiness, generation, usage and
//! cached tokens, typed errors, streamed failures, cancellation, and signal shutdown.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

struct Server {
    child: Child,
    port: u16,
}

impl Server {
    fn start(extra: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_flare"))
            .args(["run", "--port", "0", "--log-format", "json"])
            .args(extra)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut sent = false;
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if !sent && let Some(rest) = line.split("listening on http://127.0.0.1:").nth(1) {
                    let port: String = rest.chars().take_while(char::is_ascii_digit).collect();
                    tx.send(port.parse::<u16>().unwrap()).unwrap();
                    sent = true;
                }
            }
        });
        let port = rx.recv_timeout(Duration::from_secs(60)).expect("server became ready");
        Server { child, port }
    }

    fn request(&self, method: &str, path: &str, content_type: Option<&str>, body: &str) -> (u16, String, String) {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let ct = content_type.map(|c| format!("content-type: {c}\r\n")).unwrap_or_default();
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nhost: x\r\n{ct}content-length: {}\r\nconnection: close\r\n\r\n{body}",
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
        write!(s, "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{b}", b.len()).unwrap();
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
