//! `flare load`: a bounded concurrent load test plus an audit of the server afterwards.

use crate::bench::Rng;
use crate::error::BenchError;
use crate::http::{
    ConnOptions, ReadPolicy, StreamEnd, StreamOutcome, Target, check_error_envelope, first_model, get, post_json,
    request, stream_chat,
};
use crate::metrics;
use bytes::Bytes;
use serde::Serialize;
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Arguments of `flare load`.
#[derive(clap::Args, Debug, Clone)]
pub struct LoadArgs {
    /// Server root URL (plain http).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub url: String,
    /// Model id; default: the first id listed by GET /v1/models.
    #[arg(long)]
    pub model: Option<String>,
    /// Concurrent streaming clients.
    #[arg(long, default_value_t = 256)]
    pub clients: usize,
    /// How long clients keep starting requests, seconds.
    #[arg(long, default_value_t = 30)]
    pub duration_secs: u64,
    /// Fraction of clients that close the connection mid-stream.
    #[arg(long, default_value_t = 0.1)]
    pub disconnect_fraction: f64,
    /// Fraction of clients that read slowly through a small socket buffer.
    #[arg(long, default_value_t = 0.1)]
    pub slow_fraction: f64,
    /// `max_tokens` of normal and disconnecting clients' requests.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: u32,
    /// `max_tokens` of slow clients' requests: long enough to overrun the socket buffers, so the
    /// server sees real backpressure.
    #[arg(long, default_value_t = 1024)]
    pub slow_max_tokens: u32,
    /// Pause before each body read of a slow client, milliseconds. With the defaults a slow
    /// request streams for about 10 s and keeps roughly 90 KB queued in the server's socket.
    #[arg(long, default_value_t = 10)]
    pub slow_read_delay_ms: u64,
    /// Seed for assigning client behaviours and disconnect points.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// How long to wait after the load for the server's gauges to return to idle, seconds.
    #[arg(long, default_value_t = 10)]
    pub settle_secs: u64,
    /// Per-request time limit, seconds; a request still running after it counts as lost.
    #[arg(long, default_value_t = 120)]
    pub request_timeout_secs: u64,
    /// Words in the prompt that must exceed the server's context limit.
    #[arg(long, default_value_t = 50_000)]
    pub huge_prompt_words: usize,
    /// Print the report as JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// How a load client reads its streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ClientKind {
    /// Reads as fast as data arrives.
    Normal,
    /// Sleeps between reads of a small buffer.
    Slow,
    /// Closes the connection after a random number of content chunks.
    Disconnect,
}

/// The server gauges and counters read from `/metrics` after the load.
#[derive(Debug, Clone, Default, Serialize)]
pub struct MetricsSnapshot {
    /// `flare_running_requests`.
    pub running_requests: Option<f64>,
    /// `flare_queue_depth`.
    pub queue_depth: Option<f64>,
    /// `flare_pages_used`.
    pub pages_used: Option<f64>,
    /// `flare_snapshot_rows_pinned`.
    pub snapshot_rows_pinned: Option<f64>,
    /// `flare_requests_admitted_total`, summed over labels.
    pub requests_admitted: Option<f64>,
    /// `flare_requests_finished_total`, summed over labels.
    pub requests_finished: Option<f64>,
    /// Why `/metrics` could not be read or parsed, when it could not.
    pub error: Option<String>,
}

impl MetricsSnapshot {
    /// Parses a Prometheus text exposition.
    pub fn from_text(text: &str) -> Self {
        match metrics::parse(text) {
            Err(e) => Self { error: Some(format!("unparsable /metrics: {e}")), ..Self::default() },
            Ok(s) => Self {
                running_requests: metrics::sum(&s, "flare_running_requests"),
                queue_depth: metrics::sum(&s, "flare_queue_depth"),
                pages_used: metrics::sum(&s, "flare_pages_used"),
                snapshot_rows_pinned: metrics::sum(&s, "flare_snapshot_rows_pinned"),
                requests_admitted: metrics::sum(&s, "flare_requests_admitted_total"),
                requests_finished: metrics::sum(&s, "flare_requests_finished_total"),
                error: None,
            },
        }
    }

    /// Every way this snapshot differs from an idle, balanced server.
    pub fn violations(&self) -> Vec<String> {
        if let Some(e) = &self.error {
            return vec![e.clone()];
        }
        let mut v = Vec::new();
        for (name, val) in [
            ("flare_running_requests", self.running_requests),
            ("flare_queue_depth", self.queue_depth),
            ("flare_pages_used", self.pages_used),
            ("flare_snapshot_rows_pinned", self.snapshot_rows_pinned),
        ] {
            match val {
                None => v.push(format!("metric {name} missing from /metrics")),
                Some(x) if x != 0.0 => v.push(format!("{name} = {x} after the load, expected 0")),
                Some(_) => {}
            }
        }
        match (self.requests_admitted, self.requests_finished) {
            (Some(a), Some(f)) if a != f => {
                v.push(format!("flare_requests_admitted_total = {a} but flare_requests_finished_total = {f}"))
            }
            (Some(_), Some(_)) => {}
            (a, f) => {
                if a.is_none() {
                    v.push("metric flare_requests_admitted_total missing from /metrics".into());
                }
                if f.is_none() {
                    v.push("metric flare_requests_finished_total missing from /metrics".into());
                }
            }
        }
        v
    }
}

/// One malformed request and what the server answered.
#[derive(Debug, Clone, Serialize)]
pub struct MalformedCase {
    /// What was wrong with the request.
    pub name: String,
    /// Acceptable statuses.
    pub expected: Vec<u16>,
    /// The status received (`None` when the request failed at the transport level).
    pub status: Option<u16>,
    /// `None` when the status is acceptable and the body is a typed error object; otherwise why not.
    pub problem: Option<String>,
}

/// What `flare load` observed.
#[derive(Debug, Clone, Serialize)]
pub struct LoadReport {
    /// Server URL.
    pub url: String,
    /// Model id used.
    pub model: String,
    /// Clients by behaviour.
    pub clients: BTreeMap<String, usize>,
    /// Load phase length, seconds.
    pub duration_secs: f64,
    /// Requests sent.
    pub started: u64,
    /// Streams that ended with `[DONE]` and no error.
    pub completed: u64,
    /// Streams the client closed on purpose.
    pub disconnected: u64,
    /// Typed failures by kind: `http_<status>`, `stream_error`, `transport`.
    pub errors: BTreeMap<String, u64>,
    /// Requests with no completion, no deliberate disconnect and no typed error.
    pub lost: u64,
    /// Up to 10 descriptions of lost requests.
    pub lost_examples: Vec<String>,
    /// Completions delivered twice (within one stream, or a server id reused across requests).
    pub duplicated: u64,
    /// Up to 10 descriptions of duplicates.
    pub duplicate_examples: Vec<String>,
    /// Output tokens received by completed streams.
    pub output_tokens: u64,
    /// Seconds until the gauges read idle after the load (or the settle limit).
    pub settle_secs: f64,
    /// `/metrics` after settling.
    pub metrics: MetricsSnapshot,
    /// The malformed-request batch.
    pub malformed: Vec<MalformedCase>,
    /// `None` when the final GET /health returned 200; otherwise what happened.
    pub final_health_error: Option<String>,
    /// `None` when the final short chat completion succeeded; otherwise what happened.
    pub final_chat_error: Option<String>,
}

impl LoadReport {
    /// Every acceptance violation: non-idle gauges, admitted ≠ finished, lost or duplicated
    /// requests, untyped or wrong responses to malformed requests, no successful completion at
    /// all, or a server that no longer answers.
    pub fn violations(&self) -> Vec<String> {
        let mut v = self.metrics.violations();
        if self.lost > 0 {
            v.push(format!("{} request(s) lost, e.g. {:?}", self.lost, self.lost_examples.first()));
        }
        if self.duplicated > 0 {
            v.push(format!("{} completion(s) duplicated, e.g. {:?}", self.duplicated, self.duplicate_examples.first()));
        }
        if self.completed == 0 {
            v.push("no request completed during the load".into());
        }
        for m in &self.malformed {
            if let Some(p) = &m.problem {
                v.push(format!("malformed request {:?}: {p}", m.name));
            }
        }
        if let Some(e) = &self.final_health_error {
            v.push(format!("final GET /health: {e}"));
        }
        if let Some(e) = &self.final_chat_error {
            v.push(format!("final chat completion: {e}"));
        }
        v
    }

    /// `Err` with the list of violations, if any.
    pub fn check(&self) -> Result<(), Vec<String>> {
        let v = self.violations();
        if v.is_empty() { Ok(()) } else { Err(v) }
    }

    /// The report as pretty JSON.
    pub fn to_json(&self) -> Result<String, BenchError> {
        Ok(serde_json::to_string_pretty(self)?)
    }
}

impl fmt::Display for LoadReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "flare load: {} (model {}), {:.1} s", self.url, self.model, self.duration_secs)?;
        let kinds: Vec<String> = self.clients.iter().map(|(k, n)| format!("{n} {k}")).collect();
        writeln!(f, "clients: {}", kinds.join(", "))?;
        writeln!(
            f,
            "requests: {} started, {} completed, {} disconnected on purpose, {} lost, {} duplicated; {} output tokens",
            self.started, self.completed, self.disconnected, self.lost, self.duplicated, self.output_tokens
        )?;
        if !self.errors.is_empty() {
            let e: Vec<String> = self.errors.iter().map(|(k, n)| format!("{k}: {n}")).collect();
            writeln!(f, "typed errors: {}", e.join(", "))?;
        }
        let m = &self.metrics;
        let show = |x: Option<f64>| x.map_or("missing".to_string(), |x| x.to_string());
        writeln!(
            f,
            "after {:.1} s settle: running {}, queue {}, pages used {}, rows pinned {}, admitted {}, finished {}",
            self.settle_secs,
            show(m.running_requests),
            show(m.queue_depth),
            show(m.pages_used),
            show(m.snapshot_rows_pinned),
            show(m.requests_admitted),
            show(m.requests_finished)
        )?;
        for c in &self.malformed {
            let got = c.status.map_or("no response".to_string(), |s| s.to_string());
            match &c.problem {
                None => writeln!(f, "malformed {:<34} -> {got} ok", c.name)?,
                Some(p) => writeln!(f, "malformed {:<34} -> {got} FAIL: {p}", c.name)?,
            }
        }
        match self.check() {
            Ok(()) => writeln!(f, "check: ok"),
            Err(v) => {
                writeln!(f, "check: {} violation(s)", v.len())?;
                for x in v {
                    writeln!(f, "  - {x}")?;
                }
                Ok(())
            }
        }
    }
}

/// Assigns behaviours: exactly `round(n·fraction)` disconnecting and slow clients (disconnects
/// first when the fractions overlap), at seed-shuffled positions.
pub(crate) fn assign_kinds(n: usize, disconnect_fraction: f64, slow_fraction: f64, seed: u64) -> Vec<ClientKind> {
    let count = |f: f64| ((n as f64) * f.clamp(0.0, 1.0)).round() as usize;
    let d = count(disconnect_fraction).min(n);
    let s = count(slow_fraction).min(n - d);
    let mut kinds: Vec<ClientKind> = (0..n)
        .map(|i| {
            if i < d {
                ClientKind::Disconnect
            } else if i < d + s {
                ClientKind::Slow
            } else {
                ClientKind::Normal
            }
        })
        .collect();
    let mut rng = Rng::new(seed);
    for i in (1..n).rev() {
        let j = (rng.next() % (i as u64 + 1)) as usize;
        kinds.swap(i, j);
    }
    kinds
}

#[derive(Debug, Default)]
struct Tally {
    started: u64,
    accounted: u64,
    completed: u64,
    disconnected: u64,
    errors: BTreeMap<String, u64>,
    lost: u64,
    lost_examples: Vec<String>,
    duplicated: u64,
    duplicate_examples: Vec<String>,
    output_tokens: u64,
    /// Server ids (x-request-id, chunk id) → the client request id that first carried them.
    server_ids: HashMap<String, String>,
}

impl Tally {
    fn lose(&mut self, what: String) {
        self.lost += 1;
        if self.lost_examples.len() < 10 {
            self.lost_examples.push(what);
        }
    }

    fn duplicate(&mut self, what: String) {
        self.duplicated += 1;
        if self.duplicate_examples.len() < 10 {
            self.duplicate_examples.push(what);
        }
    }

    fn record(&mut self, id: &str, out: &StreamOutcome) {
        self.accounted += 1;
        match &out.end {
            StreamEnd::Done => {
                self.completed += 1;
                self.output_tokens += out.output_tokens();
                if out.duplicated() {
                    self.duplicate(format!(
                        "{id}: {} [DONE] markers, finish reasons {:?}",
                        out.done_markers, out.finish_reasons
                    ));
                }
                if out.finish_reasons.is_empty() {
                    self.lose(format!("{id}: [DONE] without a finish_reason"));
                }
            }
            StreamEnd::Disconnected => self.disconnected += 1,
            StreamEnd::HttpStatus { status, typed: true, .. } => {
                *self.errors.entry(format!("http_{status}")).or_default() += 1
            }
            StreamEnd::HttpStatus { status, typed: false, body } => {
                self.lose(format!("{id}: HTTP {status} without a typed error body: {body}"))
            }
            StreamEnd::StreamError(_) => *self.errors.entry("stream_error".into()).or_default() += 1,
            StreamEnd::Transport(_) => *self.errors.entry("transport".into()).or_default() += 1,
            StreamEnd::Protocol(e) => self.lose(format!("{id}: protocol violation: {e}")),
            StreamEnd::Eof => self.lose(format!("{id}: stream ended without [DONE] or an error event")),
            StreamEnd::Timeout => self.lose(format!("{id}: no end within the request time limit")),
        }
        let ids = out
            .request_id
            .iter()
            .map(|r| format!("x-request-id {r}"))
            .chain(out.chunk_ids.iter().map(|c| format!("chunk id {c}")));
        for sid in ids {
            if let Some(first) = self.server_ids.get(&sid) {
                let msg = format!("{sid} served both {first} and {id}");
                self.duplicate(msg);
            } else {
                self.server_ids.insert(sid, id.to_string());
            }
        }
    }
}

fn chat_body(model: &str, content: &str, max_tokens: u32, stream: bool) -> Value {
    let mut body = json!({
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
    });
    if stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    body
}

async fn client_loop(
    target: Target,
    model: String,
    client: usize,
    kind: ClientKind,
    args: LoadArgs,
    deadline: Instant,
    tally: Arc<Mutex<Tally>>,
) {
    let mut rng = Rng::new(args.seed ^ (client as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let timeout = Duration::from_secs(args.request_timeout_secs.max(1));
    let mut seq = 0u64;
    while Instant::now() < deadline {
        seq += 1;
        let id = format!("load-{}-{client}-{seq}", args.seed);
        let (max_tokens, policy, opts) = match kind {
            ClientKind::Normal => (args.max_tokens, ReadPolicy::Normal, ConnOptions::default()),
            ClientKind::Disconnect => {
                let at = rng.range(1, u64::from(args.max_tokens / 2).max(1)) as usize;
                (args.max_tokens, ReadPolicy::DisconnectAfter(at), ConnOptions::default())
            }
            ClientKind::Slow => (
                args.slow_max_tokens,
                ReadPolicy::Slow(Duration::from_millis(args.slow_read_delay_ms)),
                ConnOptions { recv_buffer: Some(4096), read_exact: Some(512) },
            ),
        };
        let mut body =
            chat_body(&model, &format!("Request {id}: tell me a long story about the number {seq}."), max_tokens, true);
        body["temperature"] = json!(1.0);
        body["ignore_eos"] = json!(true);
        if let Ok(mut t) = tally.lock() {
            t.started += 1;
        }
        let out = stream_chat(&target, &body, policy, opts, timeout).await;
        let backoff = matches!(out.end, StreamEnd::HttpStatus { .. } | StreamEnd::Transport(_));
        if let Ok(mut t) = tally.lock() {
            t.record(&id, &out);
        }
        if backoff {
            // Overload answers are immediate; do not spin on them.
            tokio::time::sleep(Duration::from_millis(20 + rng.range(0, 30))).await;
        }
    }
}

async fn malformed_batch(target: &Target, model: &str, huge_words: usize) -> Vec<MalformedCase> {
    let t = Duration::from_secs(60);
    let base = || chat_body(model, "hello", 8, false);
    let with = |k: &str, v: Value| {
        let mut b = base();
        b[k] = v;
        b
    };
    let json_ct = Some("application/json");
    let mut cases: Vec<(String, Vec<u16>, Option<&str>, Bytes)> = vec![
        ("invalid JSON body".into(), vec![400], json_ct, Bytes::from_static(b"{\"model\": \"x\", \"messages\": [")),
        ("JSON body that is not an object".into(), vec![400], json_ct, Bytes::from_static(b"[1, 2, 3]")),
        ("wrong content type (text/plain)".into(), vec![415, 400], Some("text/plain"), to_bytes(&base())),
    ];
    let huge = "hello ".repeat(huge_words);
    for (name, expected, body) in [
        (format!("prompt of {huge_words} words (over context)"), vec![400], chat_body(model, &huge, 8, false)),
        ("temperature -1".to_string(), vec![400], with("temperature", json!(-1))),
        ("max_tokens 0".to_string(), vec![400], with("max_tokens", json!(0))),
        ("max_tokens -5".to_string(), vec![400], with("max_tokens", json!(-5))),
        ("top_p 2".to_string(), vec![400], with("top_p", json!(2))),
        ("n 0".to_string(), vec![400], with("n", json!(0))),
        ("temperature -1 with stream: true".to_string(), vec![400], {
            let mut b = with("temperature", json!(-1));
            b["stream"] = json!(true);
            b
        }),
        ("unknown model".to_string(), vec![404], with("model", json!("no-such-model-flare-load"))),
    ] {
        cases.push((name, expected, json_ct, to_bytes(&body)));
    }
    let mut out = Vec::new();
    for (name, expected, ct, body) in cases {
        let case = match request(target, "POST", "/v1/chat/completions", ct, body, t).await {
            Err(e) => MalformedCase { name, expected, status: None, problem: Some(e.to_string()) },
            Ok(resp) => {
                let problem = if !expected.contains(&resp.status) {
                    Some(format!("HTTP {} (expected {:?}): {}", resp.status, expected, resp.text()))
                } else {
                    check_error_envelope(&resp.body).err()
                };
                MalformedCase { name, expected, status: Some(resp.status), problem }
            }
        };
        out.push(case);
    }
    out
}

fn to_bytes(v: &Value) -> Bytes {
    Bytes::from(v.to_string())
}

async fn read_metrics(target: &Target) -> MetricsSnapshot {
    match get(target, "/metrics", Duration::from_secs(10)).await {
        Err(e) => MetricsSnapshot { error: Some(format!("GET /metrics: {e}")), ..MetricsSnapshot::default() },
        Ok(r) if r.status != 200 => MetricsSnapshot {
            error: Some(format!("GET /metrics: HTTP {}: {}", r.status, r.text())),
            ..MetricsSnapshot::default()
        },
        Ok(r) => MetricsSnapshot::from_text(&String::from_utf8_lossy(&r.body)),
    }
}

async fn final_chat(target: &Target, model: &str) -> Option<String> {
    let resp = match post_json(
        target,
        "/v1/chat/completions",
        &chat_body(model, "Say hi.", 8, false),
        Duration::from_secs(60),
    )
    .await
    {
        Err(e) => return Some(e.to_string()),
        Ok(r) => r,
    };
    if resp.status != 200 {
        return Some(format!("HTTP {}: {}", resp.status, resp.text()));
    }
    match resp.json() {
        Err(e) => Some(e.to_string()),
        Ok(v) if v.pointer("/choices/0/message").is_none() => Some(format!("no choices[0].message in {v}")),
        Ok(_) => None,
    }
}

/// Runs the load, the malformed batch and the audit. Fails only when the server cannot be
/// reached at all (no model list); everything else is recorded in the report.
pub async fn run_load(args: &LoadArgs) -> Result<LoadReport, BenchError> {
    let target = Target::parse(&args.url)?;
    let model = match &args.model {
        Some(m) => m.clone(),
        None => first_model(&target).await?,
    };
    let malformed = malformed_batch(&target, &model, args.huge_prompt_words).await;

    let kinds = assign_kinds(args.clients, args.disconnect_fraction, args.slow_fraction, args.seed);
    let tally = Arc::new(Mutex::new(Tally::default()));
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs(args.duration_secs);
    let handles: Vec<_> = kinds
        .iter()
        .enumerate()
        .map(|(client, &kind)| {
            tokio::spawn(client_loop(
                target.clone(),
                model.clone(),
                client,
                kind,
                args.clone(),
                deadline,
                Arc::clone(&tally),
            ))
        })
        .collect();
    // Requests still running this long after the deadline count as lost.
    let hard_stop = deadline + Duration::from_secs(args.request_timeout_secs.max(1) + 5);
    for h in handles {
        let abort = h.abort_handle();
        if tokio::time::timeout_at(hard_stop.into(), h).await.is_err() {
            abort.abort();
        }
    }
    let duration_secs = t0.elapsed().as_secs_f64();

    let settle_start = Instant::now();
    let settle_limit = Duration::from_secs(args.settle_secs);
    let mut snapshot = read_metrics(&target).await;
    while !snapshot.violations().is_empty() && settle_start.elapsed() < settle_limit {
        tokio::time::sleep(Duration::from_millis(250)).await;
        snapshot = read_metrics(&target).await;
    }
    let settle_secs = settle_start.elapsed().as_secs_f64();

    let final_health_error = match get(&target, "/health", Duration::from_secs(10)).await {
        Ok(r) if r.status == 200 => None,
        Ok(r) => Some(format!("HTTP {}: {}", r.status, r.text())),
        Err(e) => Some(e.to_string()),
    };
    let final_chat_error = final_chat(&target, &model).await;

    let mut t = match Arc::try_unwrap(tally) {
        Ok(m) => m.into_inner().unwrap_or_else(|p| p.into_inner()),
        Err(shared) => std::mem::take(&mut *shared.lock().unwrap_or_else(|p| p.into_inner())),
    };
    let unaccounted = t.started.saturating_sub(t.accounted);
    for _ in 0..unaccounted {
        t.lose("request still running at the hard stop (client aborted)".into());
    }
    let mut clients = BTreeMap::new();
    for k in &kinds {
        let name = match k {
            ClientKind::Normal => "normal",
            ClientKind::Slow => "slow",
            ClientKind::Disconnect => "disconnecting",
        };
        *clients.entry(name.to_string()).or_default() += 1;
    }
    Ok(LoadReport {
        url: args.url.clone(),
        model,
        clients,
        duration_secs,
        started: t.started,
        completed: t.completed,
        disconnected: t.disconnected,
        errors: t.errors,
        lost: t.lost,
        lost_examples: t.lost_examples,
        duplicated: t.duplicated,
        duplicate_examples: t.duplicate_examples,
        output_tokens: t.output_tokens,
        settle_secs,
        metrics: snapshot,
        malformed,
        final_health_error,
        final_chat_error,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(end: StreamEnd) -> StreamOutcome {
        StreamOutcome {
            end,
            request_id: None,
            ttft: None,
            itl: Vec::new(),
            total: Duration::ZERO,
            content_chunks: 0,
            text: String::new(),
            usage: None,
            finish_reasons: vec![(0, "length".into())],
            done_markers: 1,
            chunk_ids: Default::default(),
        }
    }

    #[derive(clap::Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        args: LoadArgs,
    }

    #[test]
    fn cli_defaults() {
        use clap::Parser;
        let a = Cli::try_parse_from(["load"]).expect("defaults parse").args;
        assert_eq!((a.clients, a.duration_secs, a.max_tokens, a.settle_secs), (256, 30, 64, 10));
        assert_eq!((a.disconnect_fraction, a.slow_fraction), (0.1, 0.1));
        let a = Cli::try_parse_from(["load", "--clients", "8", "--seed", "9", "--disconnect-fraction", "0.5"])
            .expect("overrides parse")
            .args;
        assert_eq!((a.clients, a.seed, a.disconnect_fraction), (8, 9, 0.5));
    }

    #[test]
    fn kinds_have_exact_counts_and_depend_on_seed() {
        let k = assign_kinds(256, 0.1, 0.1, 1);
        assert_eq!(k.len(), 256);
        assert_eq!(k.iter().filter(|&&x| x == ClientKind::Disconnect).count(), 26);
        assert_eq!(k.iter().filter(|&&x| x == ClientKind::Slow).count(), 26);
        assert_eq!(k, assign_kinds(256, 0.1, 0.1, 1));
        assert_ne!(k, assign_kinds(256, 0.1, 0.1, 2));
        let all = assign_kinds(4, 0.8, 0.8, 3);
        assert_eq!(all.iter().filter(|&&x| x == ClientKind::Disconnect).count(), 3);
        assert_eq!(all.iter().filter(|&&x| x == ClientKind::Slow).count(), 1);
        assert!(assign_kinds(0, 0.5, 0.5, 1).is_empty());
    }

    #[test]
    fn tally_classifies_outcomes() {
        let mut t = Tally::default();
        let mut done = outcome(StreamEnd::Done);
        done.request_id = Some("r1".into());
        done.chunk_ids.insert("c1".into());
        done.usage = Some(json!({"completion_tokens": 9}));
        t.record("a", &done);
        t.record("b", &outcome(StreamEnd::Disconnected));
        t.record("c", &outcome(StreamEnd::HttpStatus { status: 503, typed: true, body: String::new() }));
        t.record("d", &outcome(StreamEnd::HttpStatus { status: 500, typed: false, body: "oops".into() }));
        t.record("e", &outcome(StreamEnd::StreamError("x".into())));
        t.record("f", &outcome(StreamEnd::Transport("reset".into())));
        t.record("g", &outcome(StreamEnd::Eof));
        t.record("h", &outcome(StreamEnd::Protocol("bad".into())));
        t.record("i", &outcome(StreamEnd::Timeout));
        assert_eq!((t.completed, t.disconnected, t.lost, t.duplicated, t.output_tokens), (1, 1, 4, 0, 9));
        assert_eq!(t.errors.get("http_503"), Some(&1));
        assert_eq!(t.errors.get("stream_error"), Some(&1));
        assert_eq!(t.errors.get("transport"), Some(&1));
        // The same server request id on another request is a duplicate.
        let mut again = outcome(StreamEnd::Done);
        again.request_id = Some("r1".into());
        t.record("j", &again);
        assert_eq!(t.duplicated, 1);
        // Two finish reasons for choice 0 in one stream is a duplicate; none at all is lost.
        let mut twice = outcome(StreamEnd::Done);
        twice.finish_reasons.push((0, "stop".into()));
        t.record("k", &twice);
        assert_eq!(t.duplicated, 2);
        let mut none = outcome(StreamEnd::Done);
        none.finish_reasons.clear();
        t.record("l", &none);
        assert_eq!(t.lost, 5);
        assert_eq!(t.accounted, 12);
    }

    const IDLE: &str = "flare_running_requests 0\nflare_queue_depth 0\nflare_pages_used 0\nflare_snapshot_rows_pinned 0\n\
        flare_requests_admitted_total{api=\"chat\"} 5\nflare_requests_admitted_total{api=\"messages\"} 2\n\
        flare_requests_finished_total{outcome=\"stop\"} 4\nflare_requests_finished_total{outcome=\"cancelled\"} 3\n";

    fn report(metrics: &str) -> LoadReport {
        LoadReport {
            url: "http://x".into(),
            model: "m".into(),
            clients: BTreeMap::new(),
            duration_secs: 1.0,
            started: 3,
            completed: 2,
            disconnected: 1,
            errors: BTreeMap::new(),
            lost: 0,
            lost_examples: vec![],
            duplicated: 0,
            duplicate_examples: vec![],
            output_tokens: 10,
            settle_secs: 0.0,
            metrics: MetricsSnapshot::from_text(metrics),
            malformed: vec![MalformedCase {
                name: "n 0".into(),
                expected: vec![400],
                status: Some(400),
                problem: None,
            }],
            final_health_error: None,
            final_chat_error: None,
        }
    }

    #[test]
    fn check_passes_an_idle_balanced_server() {
        let r = report(IDLE);
        assert_eq!(r.check(), Ok(()));
        assert!(r.to_string().contains("check: ok"));
    }

    #[test]
    fn check_lists_every_violation() {
        let busy = IDLE
            .replace("flare_pages_used 0", "flare_pages_used 3")
            .replace("outcome=\"stop\"} 4", "outcome=\"stop\"} 3");
        let mut r = report(&busy);
        r.lost = 1;
        r.lost_examples = vec!["x".into()];
        r.duplicated = 2;
        r.final_chat_error = Some("HTTP 500".into());
        r.malformed[0].problem = Some("HTTP 200".into());
        let v = r.check().expect_err("violations expected");
        assert_eq!(v.len(), 6, "{v:#?}");
        assert!(v.iter().any(|x| x.contains("flare_pages_used = 3")));
        assert!(v.iter().any(|x| x.contains("admitted_total = 7") && x.contains("finished_total = 6")));
        assert!(r.to_string().contains("6 violation(s)"));

        let missing = report("flare_running_requests 0\n");
        let v = missing.check().expect_err("missing metrics");
        assert_eq!(v.iter().filter(|x| x.contains("missing")).count(), 5);

        let garbage = report("flare_running_requests zero\n");
        assert!(garbage.check().is_err_and(|v| v[0].contains("unparsable")));
    }

    fn small_args(url: String) -> LoadArgs {
        LoadArgs {
            url,
            model: None,
            clients: 6,
            duration_secs: 1,
            disconnect_fraction: 0.34,
            slow_fraction: 0.34,
            max_tokens: 8,
            slow_max_tokens: 16,
            slow_read_delay_ms: 2,
            seed: 7,
            settle_secs: 2,
            request_timeout_secs: 10,
            huge_prompt_words: 30_000,
            json: false,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn run_load_against_a_well_behaved_fake_passes() {
        let (addr, _state) = crate::fake::start().await;
        let r = run_load(&small_args(format!("http://{addr}"))).await.expect("load runs");
        assert_eq!(r.check(), Ok(()), "{r}");
        assert_eq!(r.model, "fake");
        assert!(r.completed > 0 && r.disconnected > 0, "{r}");
        assert_eq!(r.started, r.completed + r.disconnected + r.errors.values().sum::<u64>() + r.lost);
        assert_eq!(r.clients.values().sum::<usize>(), 6);
        assert_eq!(r.malformed.len(), 11);
        assert!(r.malformed.iter().all(|m| m.problem.is_none()), "{r}");
        assert!(r.to_json().is_ok());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn run_load_catches_a_leaking_server() {
        let (addr, state) = crate::fake::start().await;
        state.leak.store(true, std::sync::atomic::Ordering::SeqCst);
        let mut args = small_args(format!("http://{addr}"));
        args.settle_secs = 0;
        args.clients = 2;
        let r = run_load(&args).await.expect("load runs");
        let v = r.check().expect_err("leak must be reported");
        assert!(v.iter().any(|x| x.contains("flare_requests_admitted_total")), "{v:?}");
    }

    #[tokio::test]
    async fn run_load_needs_a_reachable_server() {
        let mut args = small_args("http://127.0.0.1:1".into());
        args.clients = 1;
        assert!(matches!(run_load(&args).await, Err(BenchError::Connect { .. })));
    }
}
