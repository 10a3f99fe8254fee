//! An in-process fake OpenAI-compatible server for the crate's tests (no real server needed).
//! It validates requests like the design says a server must, streams canned SSE, and keeps
//! `/metrics` gauges that a well-behaved server would report.

use serde_json::{Value, json};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Debug, Default)]
pub(crate) struct FakeState {
    pub running: AtomicI64,
    pub admitted: AtomicU64,
    pub finished: AtomicU64,
    pub next_id: AtomicU64,
    /// When set, the server "forgets" to finish requests: admitted stays above finished.
    pub leak: std::sync::atomic::AtomicBool,
}

pub(crate) async fn start() -> (SocketAddr, Arc<FakeState>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let state = Arc::new(FakeState::default());
    let st = Arc::clone(&state);
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            tokio::spawn(serve(sock, Arc::clone(&st)));
        }
    });
    (addr, state)
}

async fn read_request(sock: &mut TcpStream) -> Option<(String, String, String, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut tmp = [0u8; 65536];
    let head_end = loop {
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break p + 4;
        }
        let n = sock.read(&mut tmp).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&tmp[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let mut lines = head.split("\r\n");
    let mut first = lines.next()?.split(' ');
    let method = first.next()?.to_string();
    let path = first.next()?.to_string();
    let mut len = 0usize;
    let mut ct = String::new();
    for l in lines {
        let lower = l.to_ascii_lowercase();
        if let Some(v) = lower.strip_prefix("content-length:") {
            len = v.trim().parse().ok()?;
        }
        if let Some(v) = lower.strip_prefix("content-type:") {
            ct = v.trim().to_string();
        }
    }
    let mut body = buf[head_end..].to_vec();
    while body.len() < len {
        let n = sock.read(&mut tmp).await.ok()?;
        if n == 0 {
            return None;
        }
        body.extend_from_slice(&tmp[..n]);
    }
    Some((method, path, ct, body))
}

fn error(status: u16, code: &str) -> (u16, Value) {
    let kind = if status == 404 { "not_found_error" } else { "invalid_request_error" };
    (status, json!({"error": {"message": format!("bad: {code}"), "type": kind, "param": null, "code": code}}))
}

fn validate(ct: &str, body: &[u8]) -> Result<Value, (u16, Value)> {
    if !ct.starts_with("application/json") {
        return Err(error(415, "unsupported_media_type"));
    }
    let v: Value = serde_json::from_slice(body).map_err(|_| error(400, "invalid_json"))?;
    if !v.is_object() {
        return Err(error(400, "invalid_json"));
    }
    if v["model"] != "fake" {
        return Err(error(404, "model_not_found"));
    }
    let bad = v["temperature"].as_f64().is_some_and(|t| t < 0.0)
        || v["max_tokens"].as_i64().is_some_and(|m| m < 1)
        || v["top_p"].as_f64().is_some_and(|p| p > 1.0)
        || v["n"].as_i64().is_some_and(|n| n < 1);
    if bad {
        return Err(error(400, "invalid_parameter"));
    }
    if body.len() > 100_000 {
        return Err(error(400, "context_length_exceeded"));
    }
    Ok(v)
}

async fn respond(sock: &mut TcpStream, status: u16, ct: &str, body: &[u8]) {
    let head = format!(
        "HTTP/1.1 {status} X\r\ncontent-type: {ct}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let _ = sock.write_all(head.as_bytes()).await;
    let _ = sock.write_all(body).await;
}

async fn serve(mut sock: TcpStream, st: Arc<FakeState>) {
    let Some((method, path, ct, body)) = read_request(&mut sock).await else { return };
    match (method.as_str(), path.as_str()) {
        ("GET", "/v1/models") => {
            respond(&mut sock, 200, "application/json", br#"{"object":"list","data":[{"id":"fake","object":"model"}]}"#)
                .await
        }
        ("GET", "/health") => respond(&mut sock, 200, "application/json", b"{}").await,
        ("POST", "/tokenize") => {
            let req: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            // The same count the fake chat reports as prompt_tokens.
            let count = req["messages"].to_string().len() as u64 / 4;
            let out = json!({"count": count, "tokens": []}).to_string();
            respond(&mut sock, 200, "application/json", out.as_bytes()).await
        }
        ("GET", "/metrics") => {
            let text = format!(
                "# TYPE flare_running_requests gauge\nflare_running_requests {}\nflare_queue_depth 0\nflare_pages_used {}\n\
                 flare_snapshot_rows_pinned 0\nflare_requests_admitted_total{{api=\"chat\"}} {}\n\
                 flare_requests_finished_total{{outcome=\"any\"}} {}\n",
                st.running.load(Ordering::SeqCst),
                st.running.load(Ordering::SeqCst),
                st.admitted.load(Ordering::SeqCst),
                st.finished.load(Ordering::SeqCst)
            );
            respond(&mut sock, 200, "text/plain; version=0.0.4", text.as_bytes()).await
        }
        ("POST", "/v1/chat/completions") => match validate(&ct, &body) {
            Err((status, err)) => respond(&mut sock, status, "application/json", err.to_string().as_bytes()).await,
            Ok(req) => {
                st.admitted.fetch_add(1, Ordering::SeqCst);
                st.running.fetch_add(1, Ordering::SeqCst);
                let id = st.next_id.fetch_add(1, Ordering::SeqCst);
                let prompt_tokens = req["messages"].to_string().len() as u64 / 4;
                let max = req["max_tokens"].as_u64().unwrap_or(16);
                if req["stream"] == true {
                    stream(&mut sock, id, max, prompt_tokens).await;
                } else {
                    let v = json!({"id": format!("chatcmpl-{id}"), "object": "chat.completion", "choices": [{
                        "index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 1, "total_tokens": prompt_tokens + 1}});
                    respond(&mut sock, 200, "application/json", v.to_string().as_bytes()).await;
                }
                st.running.fetch_sub(1, Ordering::SeqCst);
                if !st.leak.load(Ordering::SeqCst) {
                    st.finished.fetch_add(1, Ordering::SeqCst);
                }
            }
        },
        _ => respond(&mut sock, 404, "application/json", error(404, "not_found").1.to_string().as_bytes()).await,
    }
}

/// Streams `max` one-token chunks, a finish chunk, a usage chunk and `[DONE]` (chunked encoding,
/// `x-request-id` header). Stops as soon as a write fails (client gone).
async fn stream(sock: &mut TcpStream, id: u64, max: u64, prompt_tokens: u64) {
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-request-id: req-{id}\r\ntransfer-encoding: chunked\r\n\r\n"
    );
    if sock.write_all(head.as_bytes()).await.is_err() {
        return;
    }
    let cid = format!("chatcmpl-{id}");
    let mut events = vec![json!({"id": cid, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})];
    for i in 0..max {
        events.push(json!({"id": cid, "choices": [{"index": 0, "delta": {"content": format!("t{i} ")}}]}));
    }
    events.push(json!({"id": cid, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}));
    events.push(json!({"id": cid, "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": max,
        "prompt_tokens_details": {"cached_tokens": prompt_tokens / 2}}}));
    let mut payloads: Vec<String> = events.iter().map(|e| format!("data: {e}\n\n")).collect();
    payloads.push("data: [DONE]\n\n".into());
    for p in payloads {
        let chunk = format!("{:x}\r\n{p}\r\n", p.len());
        if sock.write_all(chunk.as_bytes()).await.is_err() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let _ = sock.write_all(b"0\r\n\r\n").await;
}

/// A one-shot server answering the first connection with `raw` bytes, then closing. Returns a
/// receiver told whether the client closed its side before the server finished writing.
pub(crate) async fn one_shot(raw: Vec<Vec<u8>>, gap: Duration) -> (SocketAddr, tokio::sync::oneshot::Receiver<bool>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let Ok((mut sock, _)) = listener.accept().await else { return };
        let _ = read_request(&mut sock).await;
        let mut client_closed = false;
        for piece in raw {
            if sock.write_all(&piece).await.is_err() {
                client_closed = true;
                break;
            }
            tokio::time::sleep(gap).await;
        }
        if !client_closed {
            // Detect the client's close: a read returns 0 (or errors) once it is gone.
            let mut b = [0u8; 16];
            client_closed =
                matches!(tokio::time::timeout(Duration::from_millis(500), sock.read(&mut b)).await, Ok(Ok(0) | Err(_)));
        }
        let _ = tx.send(client_closed);
    });
    (addr, rx)
}
