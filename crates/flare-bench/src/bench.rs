//! `flare bench`: the design's latency/throughput workloads against any OpenAI-compatible server.

use crate::error::BenchError;
use crate::http::{
    ConnOptions, ReadPolicy, StreamEnd, StreamOutcome, Target, first_model_info, post_json, stream_chat,
};
use crate::stats::Summary;
use serde::Serialize;
use serde_json::{Value, json};
use std::fmt;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Which workloads `flare bench` runs.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkloadKind {
    /// Every workload below but `copy`, in order.
    All,
    /// A long never-seen prompt: time to first token with nothing cached.
    Cold,
    /// Fixed-length decode (`ignore_eos`) at each `--concurrency` level.
    Decode,
    /// A multi-turn agent conversation growing by a tool call and a tool result per turn.
    Agent,
    /// `--branches` requests sharing a long prefix with different suffixes.
    Branches,
    /// A `--prefix-tokens` cached prefix, then requests adding a short (~11-token) tail: prefix-hit TTFT.
    Prefix,
    /// Copy-heavy decode, what speculation with copy proposals is for: a `--copy-lines` source
    /// file the model reproduces with one function renamed, greedily, at each `--concurrency`
    /// level (compare runs with and without `--speculative-depth` on the server).
    Copy,
}

/// Arguments of `flare bench`.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// Server root URL (plain http).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub url: String,
    /// Model id; default: the first id listed by GET /v1/models.
    #[arg(long)]
    pub model: Option<String>,
    /// Which workload to run.
    #[arg(long, value_enum, default_value_t = WorkloadKind::All)]
    pub workload: WorkloadKind,
    /// Tokens generated per request in the decode workload.
    #[arg(long, default_value_t = 256)]
    pub output_tokens: u32,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Concurrency levels of the decode workload.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub concurrency: Vec<usize>,
    /// Rounds per decode concurrency level (each round starts `concurrency` requests at once).
    #[arg(long, default_value_t = 2)]
    pub decode_rounds: usize,
    /// Words in the cold prompt (used when `--cold-tokens` is empty).
    #[arg(long, default_value_t = 2000)]
    pub cold_prompt_words: usize,
    /// Cold prompt sizes in prompt tokens, each sized with the server's `/tokenize` where it has
    /// one (capped to its context); empty: one cold prompt of `--cold-prompt-words`.
    #[arg(long, value_delimiter = ',', default_value = "512,4096")]
    pub cold_tokens: Vec<usize>,
    /// Cached prefix of the prefix-hit workload, in tokens.
    #[arg(long, default_value_t = 4096)]
    pub prefix_tokens: usize,
    /// Prefix-hit requests after the one that fills the cache.
    #[arg(long, default_value_t = 3)]
    pub prefix_hits: usize,
    /// Cold requests (each with a fresh prompt).
    #[arg(long, default_value_t = 3)]
    pub cold_requests: usize,
    /// Turns of the agent conversation.
    #[arg(long, default_value_t = 8)]
    pub agent_turns: usize,
    /// Requests in the shared-prefix workload.
    #[arg(long, default_value_t = 4)]
    pub branches: usize,
    /// Words in the shared prefix.
    #[arg(long, default_value_t = 1500)]
    pub prefix_words: usize,
    /// Per-request time limit, seconds.
    #[arg(long, default_value_t = 300)]
    pub timeout_secs: u64,
    /// Lines of the copy workload's source file (fewer where the served context is short).
    #[arg(long, default_value_t = 200)]
    pub copy_lines: usize,
    /// Seed of the copy workload's files: the same prompts on every run, so that two servers'
    /// outputs compare by `output_digest` (with and without speculation, say). Default: fresh
    /// files per run, which no earlier run cached.
    #[arg(long)]
    pub copy_seed: Option<u64>,
    /// Keep each copy request's streamed text in its record (`output`): where two servers'
    /// digests differ, the texts say where the outputs first part.
    #[arg(long)]
    pub keep_outputs: bool,
    /// The copy workload as an agent turn: the file arrives as a `read_file` tool result and the
    /// model quotes it back with the rename (workloads `copy from tool c=N`), instead of inside
    /// the user's message.
    #[arg(long)]
    pub copy_from_tool: bool,
}

/// One request as measured by the client.
#[derive(Debug, Clone, Serialize)]
pub struct RequestRecord {
    /// Whether the stream ended with `[DONE]` and no error.
    pub ok: bool,
    /// Why it failed, when it did.
    pub error: Option<String>,
    /// Server's `x-request-id`.
    pub request_id: Option<String>,
    /// Request sent → first content chunk, ms.
    pub ttft_ms: Option<f64>,
    /// Request sent → end of stream, ms.
    pub total_ms: f64,
    /// `usage.completion_tokens`, else content chunks.
    pub output_tokens: u64,
    /// Content chunks received.
    pub chunks: usize,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: Option<u64>,
    /// FNV-1a (64-bit, hex) of the streamed `content` text: equal digests, equal outputs.
    pub output_digest: String,
    /// The streamed `content` text (copy workload with `--keep-outputs`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output: Option<String>,
}

/// The summary of one workload (or one concurrency level of the decode workload).
#[derive(Debug, Clone, Serialize)]
pub struct Workload {
    /// Display name, e.g. `decode c=4`.
    pub name: String,
    /// The workload family.
    pub kind: WorkloadKind,
    /// Requests in flight at once.
    pub concurrency: usize,
    /// Requests sent.
    pub requests: usize,
    /// Requests that did not end with `[DONE]`.
    pub failed: usize,
    /// Time to first token.
    pub ttft: Summary,
    /// Inter-token latency: gaps between consecutive content chunks, over all requests.
    pub itl: Summary,
    /// Total output tokens.
    pub output_tokens: u64,
    /// Wall time of the workload, seconds.
    pub wall_secs: f64,
    /// `output_tokens / wall_secs`: aggregate streamed tokens per second.
    pub output_tokens_per_sec: f64,
    /// Median per-stream decode rate: (tokens − 1) / (end − first token), tokens/s.
    pub stream_tokens_per_sec: f64,
    /// Sum of `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// Sum of `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: u64,
    /// Every request.
    pub records: Vec<RequestRecord>,
}

/// One turn of the agent workload.
#[derive(Debug, Clone, Serialize)]
pub struct AgentTurn {
    /// 1-based turn number.
    pub turn: usize,
    /// Messages in the request.
    pub messages: usize,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: Option<u64>,
    /// Time to first token, ms.
    pub ttft_ms: Option<f64>,
}

/// What `flare bench` measured.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// Server URL.
    pub url: String,
    /// Model id used.
    pub model: String,
    /// The context the server stated, if it did.
    pub max_model_len: Option<u32>,
    /// Words in the cold prompt and the shared prefix, after capping to the context.
    pub cold_prompt_words: usize,
    pub prefix_words: usize,
    /// Per-workload summaries, in run order.
    pub workloads: Vec<Workload>,
    /// Per-turn detail of the agent workload (empty when it did not run).
    pub agent_turns: Vec<AgentTurn>,
}

impl BenchReport {
    /// Requests that failed across all workloads.
    pub fn failed_requests(&self) -> usize {
        self.workloads.iter().map(|w| w.failed).sum()
    }

    /// The report as pretty JSON.
    pub fn to_json(&self) -> Result<String, BenchError> {
        Ok(serde_json::to_string_pretty(self)?)
    }
}

/// Runs the selected workloads against `args.url`.
/// Caps a prompt's word count to fit the served context: at most 2 tokens per word, with 512
/// tokens kept for the template and the output, so a small model's workloads still run.
fn fit_words(words: usize, max_model_len: Option<u32>) -> usize {
    match max_model_len {
        Some(len) => words.min((len as usize).saturating_sub(512) / 2).max(1),
        None => words,
    }
}

pub async fn run_bench(args: &BenchArgs) -> Result<BenchReport, BenchError> {
    let target = Target::parse(&args.url)?;
    let (model, max_model_len) = match &args.model {
        Some(m) => (m.clone(), first_model_info(&target).await.ok().and_then(|(_, len)| len)),
        None => first_model_info(&target).await?,
    };
    let mut args = args.clone();
    args.cold_prompt_words = fit_words(args.cold_prompt_words, max_model_len);
    args.prefix_words = fit_words(args.prefix_words, max_model_len);
    let args = &args;
    let b = Bench {
        target,
        model,
        timeout: Duration::from_secs(args.timeout_secs.max(1)),
        words: Words::new(nonce()),
        max_model_len,
    };
    let mut report = BenchReport {
        url: args.url.clone(),
        model: b.model.clone(),
        max_model_len,
        cold_prompt_words: args.cold_prompt_words,
        prefix_words: args.prefix_words,
        workloads: Vec::new(),
        agent_turns: Vec::new(),
    };
    let all = args.workload == WorkloadKind::All;
    if all || args.workload == WorkloadKind::Cold {
        if args.cold_tokens.is_empty() {
            report.workloads.push(b.cold(args).await);
        }
        for &tokens in &args.cold_tokens {
            report.workloads.push(b.cold_sized(args, tokens).await);
        }
    }
    if all || args.workload == WorkloadKind::Decode {
        for &c in &args.concurrency {
            report.workloads.push(b.decode(args, c.max(1)).await);
        }
    }
    if all || args.workload == WorkloadKind::Agent {
        let (w, turns) = b.agent(args).await;
        report.workloads.push(w);
        report.agent_turns = turns;
    }
    if all || args.workload == WorkloadKind::Branches {
        report.workloads.push(b.branches(args).await);
    }
    if all || args.workload == WorkloadKind::Prefix {
        report.workloads.push(b.prefix(args).await);
    }
    if args.workload == WorkloadKind::Copy {
        for &c in &args.concurrency {
            report.workloads.push(b.copy(args, c.max(1)).await);
        }
    }
    Ok(report)
}

/// Tokens one line of the copy workload's file takes, about (the budget for prompt and copy).
const COPY_TOKENS_PER_LINE: usize = 14;

/// The copy workload's file: `lines` lines of small functions, distinct per `seed`.
fn source_file(lines: usize, seed: u64) -> String {
    let mut rng = Rng::new(seed);
    let mut out = String::new();
    let mut f = 0;
    while out.lines().count() + 4 <= lines.max(4) {
        let (a, b) = (rng.range(2, 97), rng.range(1, 999));
        let word = VOCAB[(rng.next() % VOCAB.len() as u64) as usize];
        out.push_str(&format!(
            "def step_{f}(state, x):\n    \"\"\"Advance the {word} by one step.\"\"\"\n    return state * {a} + x - {b}\n\n"
        ));
        f += 1;
    }
    out
}

struct Bench {
    target: Target,
    model: String,
    timeout: Duration,
    words: Words,
    max_model_len: Option<u32>,
}

impl Bench {
    fn body(&self, messages: Value, max_tokens: u32, extra: Value) -> Value {
        let mut body = json!({
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        if let (Some(obj), Value::Object(extra)) = (body.as_object_mut(), extra) {
            obj.extend(extra);
        }
        body
    }

    async fn one(&self, body: Value) -> StreamOutcome {
        stream_chat(&self.target, &body, ReadPolicy::Normal, ConnOptions::default(), self.timeout).await
    }

    /// Runs `bodies` all at once; returns outcomes in order and the wall time.
    async fn concurrent(&self, bodies: Vec<Value>) -> (Vec<StreamOutcome>, Duration) {
        let t0 = Instant::now();
        let handles: Vec<_> = bodies
            .into_iter()
            .map(|body| {
                let target = self.target.clone();
                let timeout = self.timeout;
                tokio::spawn(async move {
                    stream_chat(&target, &body, ReadPolicy::Normal, ConnOptions::default(), timeout).await
                })
            })
            .collect();
        let mut outs = Vec::with_capacity(handles.len());
        for h in handles {
            match h.await {
                Ok(o) => outs.push(o),
                Err(e) => {
                    let mut o = failed_outcome();
                    o.end = StreamEnd::Transport(format!("client task failed: {e}"));
                    outs.push(o);
                }
            }
        }
        (outs, t0.elapsed())
    }

    async fn cold(&self, args: &BenchArgs) -> Workload {
        let mut outs = Vec::new();
        let mut wall = Duration::ZERO;
        for i in 0..args.cold_requests.max(1) {
            let prompt = format!(
                "Document {} (id {}):\n{}\n\nSummarise the document above in one sentence.",
                i,
                nonce(),
                self.words.text(args.cold_prompt_words, i as u64 + 1)
            );
            let body = self.body(json!([{"role": "user", "content": prompt}]), 16, json!({}));
            let t0 = Instant::now();
            outs.push(self.one(body).await);
            wall += t0.elapsed();
        }
        summarise("cold", WorkloadKind::Cold, 1, outs, wall)
    }

    /// Prompt tokens of `messages` as the server renders them (`POST /tokenize`), if it says.
    async fn count_tokens(&self, messages: &Value) -> Option<u64> {
        let body = json!({"model": self.model, "messages": messages});
        let r = post_json(&self.target, "/tokenize", &body, Duration::from_secs(30)).await.ok()?;
        if r.status != 200 {
            return None;
        }
        r.json().ok()?.get("count")?.as_u64()
    }

    /// Messages from `make(document)` whose rendered prompt is about `target` tokens (within 2%,
    /// never above when the server counts; ~4/3 tokens per word when it cannot), capped to the
    /// context less `output` tokens. Returns the messages and the counted size.
    async fn sized_messages(
        &self,
        target: usize,
        output: usize,
        seed: u64,
        make: impl Fn(&str) -> Value,
    ) -> (Value, Option<u64>) {
        let target = match self.max_model_len {
            Some(len) => target.min((len as usize).saturating_sub(output + 16)).max(1),
            None => target,
        };
        let mut words = (target * 3 / 4).max(1);
        let mut best: Option<(Value, u64)> = None;
        for _ in 0..5 {
            let messages = make(&self.words.text(words, seed));
            let Some(count) = self.count_tokens(&messages).await else { return (messages, None) };
            if count as usize <= target && best.as_ref().is_none_or(|(_, c)| count > *c) {
                best = Some((messages.clone(), count));
            }
            if (count as usize).abs_diff(target) * 50 <= target && count as usize <= target {
                break;
            }
            let next = (words as f64 * target as f64 / count.max(1) as f64 * 0.99) as usize;
            words = next.max(1);
        }
        match best {
            Some((m, c)) => (m, Some(c)),
            None => (make(&self.words.text(1, seed)), None),
        }
    }

    /// Never-seen prompts of about `tokens` prompt tokens: cold TTFT and prefill throughput.
    async fn cold_sized(&self, args: &BenchArgs, tokens: usize) -> Workload {
        let mut outs = Vec::new();
        let mut wall = Duration::ZERO;
        for i in 0..args.cold_requests.max(1) {
            let id = nonce();
            let make = |doc: &str| {
                json!([{"role": "user", "content": format!(
                    "Document {i} (id {id}):\n{doc}\n\nSummarise the document above in one sentence.")}])
            };
            let (messages, _) = self.sized_messages(tokens, 16, 7000 + (tokens * 31 + i) as u64, make).await;
            let body = self.body(messages, 16, json!({}));
            let t0 = Instant::now();
            outs.push(self.one(body).await);
            wall += t0.elapsed();
        }
        summarise(&format!("cold {tokens} tok"), WorkloadKind::Cold, 1, outs, wall)
    }

    /// A cached prefix of about `--prefix-tokens`, then requests that add only a short user
    /// message: the prefix-hit TTFT the design measures (4,096 cached + an ~11-token tail).
    async fn prefix(&self, args: &BenchArgs) -> Workload {
        let id = nonce();
        let question = |i: usize| json!({"role": "user", "content": format!("Question {i}: what is the gist?")});
        let make =
            |doc: &str| json!([{"role": "system", "content": format!("Shared notes {id}.\n{doc}")}, question(0)]);
        let (first, _) = self.sized_messages(args.prefix_tokens, 32, 9000, make).await;
        let system = first.get(0).cloned().unwrap_or(Value::Null);
        let fill = self.one(self.body(first, 8, json!({}))).await;
        let mut outs = Vec::new();
        let mut wall = Duration::ZERO;
        if fill.end != StreamEnd::Done {
            outs.push(fill);
        }
        for i in 1..=args.prefix_hits.max(1) {
            let body = self.body(json!([system, question(i)]), 8, json!({}));
            let t0 = Instant::now();
            outs.push(self.one(body).await);
            wall += t0.elapsed();
        }
        summarise(&format!("prefix {}+tail", args.prefix_tokens), WorkloadKind::Prefix, 1, outs, wall)
    }

    /// `concurrency` requests at once, each reproducing its own file with one rename: long
    /// outputs that are mostly copies of the prompt.
    async fn copy(&self, args: &BenchArgs, concurrency: usize) -> Workload {
        // Prompt and copy each take about the file's tokens; keep both inside the context.
        let lines = match self.max_model_len {
            Some(len) => args.copy_lines.min((len as usize).saturating_sub(512) / (2 * COPY_TOKENS_PER_LINE)),
            None => args.copy_lines,
        };
        let seed = args.copy_seed.unwrap_or_else(nonce);
        let max_tokens = (lines * COPY_TOKENS_PER_LINE * 5 / 4) as u32;
        let bodies = (0..concurrency)
            .map(|i| match args.copy_from_tool {
                false => {
                    let prompt = copy_prompt(lines, seed, i);
                    self.body(json!([{"role": "user", "content": prompt}]), max_tokens, json!({"temperature": 0}))
                }
                true => {
                    let (messages, tools) = copy_from_tool_messages(lines, seed, i);
                    self.body(messages, max_tokens, json!({"temperature": 0, "tools": tools}))
                }
            })
            .collect();
        let (outs, wall) = self.concurrent(bodies).await;
        let texts: Vec<String> = if args.keep_outputs { outs.iter().map(|o| o.text.clone()).collect() } else { vec![] };
        let name = if args.copy_from_tool { "copy from tool" } else { "copy" };
        let mut w = summarise(&format!("{name} c={concurrency}"), WorkloadKind::Copy, concurrency, outs, wall);
        for (r, text) in w.records.iter_mut().zip(texts) {
            r.output = Some(text);
        }
        w
    }

    async fn decode(&self, args: &BenchArgs, concurrency: usize) -> Workload {
        let mut outs = Vec::new();
        let mut wall = Duration::ZERO;
        for round in 0..args.decode_rounds.max(1) {
            let bodies = (0..concurrency)
                .map(|i| {
                    let prompt = format!(
                        "Stream {i} of round {round}: write a long story about {}.",
                        self.words.text(8, 1000 + (round * concurrency + i) as u64)
                    );
                    self.body(
                        json!([{"role": "user", "content": prompt}]),
                        args.output_tokens.max(1),
                        json!({"temperature": 1.0, "ignore_eos": true}),
                    )
                })
                .collect();
            let (o, w) = self.concurrent(bodies).await;
            outs.extend(o);
            wall += w;
        }
        summarise(&format!("decode c={concurrency}"), WorkloadKind::Decode, concurrency, outs, wall)
    }

    async fn agent(&self, args: &BenchArgs) -> (Workload, Vec<AgentTurn>) {
        let cities = ["Paris", "Lima", "Oslo", "Kyoto", "Accra", "Quito", "Perth", "Riga"];
        let tools = json!([{
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather for a city.",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }]);
        let mut messages = vec![
            json!({"role": "system", "content": format!(
                "You are a travel agent (session {}). Use the tools to answer. Background notes:\n{}",
                nonce(),
                self.words.text(300, 2000)
            )}),
            json!({"role": "user", "content": "Compare the weather in all the cities on my itinerary, one at a time."}),
        ];
        let mut outs = Vec::new();
        let mut turns = Vec::new();
        let mut wall = Duration::ZERO;
        for turn in 0..args.agent_turns.max(1) {
            let body = self.body(Value::Array(messages.clone()), 96, json!({"tools": tools, "tool_choice": "auto"}));
            let t0 = Instant::now();
            let out = self.one(body).await;
            wall += t0.elapsed();
            turns.push(AgentTurn {
                turn: turn + 1,
                messages: messages.len(),
                prompt_tokens: out.usage_u64(&["prompt_tokens"]),
                cached_tokens: out.cached_tokens(),
                ttft_ms: out.ttft.map(ms),
            });
            outs.push(out);
            let city = cities[turn % cities.len()];
            let call_id = format!("call_{turn}");
            messages.push(json!({
                "role": "assistant",
                "content": null,
                "tool_calls": [{
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json!({"city": city}).to_string()},
                }],
            }));
            messages.push(json!({
                "role": "tool",
                "tool_call_id": call_id,
                "content": json!({"city": city, "temp_c": 12 + turn, "sky": "clear"}).to_string(),
            }));
        }
        (summarise("agent", WorkloadKind::Agent, 1, outs, wall), turns)
    }

    async fn branches(&self, args: &BenchArgs) -> Workload {
        let k = args.branches.max(1);
        let system = format!(
            "Shared context {}. Read the following notes carefully.\n{}",
            nonce(),
            self.words.text(args.prefix_words, 3000)
        );
        let body = |i: usize| {
            self.body(
                json!([
                    {"role": "system", "content": system},
                    {"role": "user", "content": format!("Question {i}: what do the notes say about {}?", self.words.text(3, 4000 + i as u64))},
                ]),
                32,
                json!({}),
            )
        };
        // The first branch fills the cache; the others then share its prefix concurrently.
        let t0 = Instant::now();
        let mut outs = vec![self.one(body(0)).await];
        let mut wall = t0.elapsed();
        if k > 1 {
            let (rest, w) = self.concurrent((1..k).map(body).collect()).await;
            outs.extend(rest);
            wall += w;
        }
        summarise(&format!("branches k={k}"), WorkloadKind::Branches, k.saturating_sub(1).max(1), outs, wall)
    }
}

fn failed_outcome() -> StreamOutcome {
    StreamOutcome {
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
        chunk_ids: Default::default(),
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn end_error(end: &StreamEnd) -> Option<String> {
    match end {
        StreamEnd::Done => None,
        StreamEnd::Disconnected => Some("disconnected".into()),
        StreamEnd::HttpStatus { status, body, .. } => Some(format!("HTTP {status}: {body}")),
        StreamEnd::StreamError(e) => Some(format!("stream error: {e}")),
        StreamEnd::Transport(e) => Some(format!("transport: {e}")),
        StreamEnd::Protocol(e) => Some(format!("protocol: {e}")),
        StreamEnd::Eof => Some("stream ended without [DONE]".into()),
        StreamEnd::Timeout => Some("timed out".into()),
    }
}

fn summarise(name: &str, kind: WorkloadKind, concurrency: usize, outs: Vec<StreamOutcome>, wall: Duration) -> Workload {
    let ttfts: Vec<Duration> = outs.iter().filter_map(|o| o.ttft).collect();
    let itls: Vec<Duration> = outs.iter().flat_map(|o| o.itl.iter().copied()).collect();
    let output_tokens: u64 = outs.iter().map(StreamOutcome::output_tokens).sum();
    let mut rates: Vec<f64> = outs
        .iter()
        .filter_map(|o| {
            let decode = o.total.checked_sub(o.ttft?)?.as_secs_f64();
            let toks = o.output_tokens();
            (toks > 1 && decode > 0.0).then(|| (toks - 1) as f64 / decode)
        })
        .collect();
    rates.sort_by(f64::total_cmp);
    let records: Vec<RequestRecord> = outs
        .iter()
        .map(|o| RequestRecord {
            ok: o.end == StreamEnd::Done,
            error: end_error(&o.end),
            request_id: o.request_id.clone(),
            ttft_ms: o.ttft.map(ms),
            total_ms: ms(o.total),
            output_tokens: o.output_tokens(),
            chunks: o.content_chunks,
            prompt_tokens: o.usage_u64(&["prompt_tokens"]),
            cached_tokens: o.cached_tokens(),
            output_digest: format!("{:016x}", fnv1a(o.text.as_bytes())),
            output: None,
        })
        .collect();
    let wall_secs = wall.as_secs_f64();
    Workload {
        name: name.to_string(),
        kind,
        concurrency,
        requests: outs.len(),
        failed: records.iter().filter(|r| !r.ok).count(),
        ttft: Summary::of(&ttfts),
        itl: Summary::of(&itls),
        output_tokens,
        wall_secs,
        output_tokens_per_sec: if wall_secs > 0.0 { output_tokens as f64 / wall_secs } else { 0.0 },
        stream_tokens_per_sec: if rates.is_empty() { 0.0 } else { crate::stats::percentile_sorted(&rates, 50.0) },
        prompt_tokens: records.iter().filter_map(|r| r.prompt_tokens).sum(),
        cached_tokens: records.iter().filter_map(|r| r.cached_tokens).sum(),
        records,
    }
}

impl fmt::Display for BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "flare bench: {} (model {})", self.url, self.model)?;
        if let Some(len) = self.max_model_len {
            writeln!(
                f,
                "context {len} tokens: cold prompt {} words, shared prefix {} words",
                self.cold_prompt_words, self.prefix_words
            )?;
        }
        writeln!(
            f,
            "{:<14} {:>4} {:>5} {:>4}  {:>19}  {:>17}  {:>9} {:>11}  {:>15}",
            "workload",
            "conc",
            "reqs",
            "fail",
            "TTFT med/p99 ms",
            "ITL med/p99 ms",
            "out tok/s",
            "stream tok/s",
            "cached/prompt"
        )?;
        for w in &self.workloads {
            writeln!(
                f,
                "{:<14} {:>4} {:>5} {:>4}  {:>9.2}/{:<9.2}  {:>8.3}/{:<8.3}  {:>9.1} {:>11.1}  {:>15}",
                w.name,
                w.concurrency,
                w.requests,
                w.failed,
                w.ttft.median_ms,
                w.ttft.p99_ms,
                w.itl.median_ms,
                w.itl.p99_ms,
                w.output_tokens_per_sec,
                w.stream_tokens_per_sec,
                format!("{}/{}", w.cached_tokens, w.prompt_tokens),
            )?;
        }
        if !self.agent_turns.is_empty() {
            writeln!(f, "agent turns (TTFT ms, cached/prompt tokens):")?;
            for t in &self.agent_turns {
                let opt = |v: Option<u64>| v.map_or("-".to_string(), |v| v.to_string());
                writeln!(
                    f,
                    "  turn {:>2}: {:>3} msgs  TTFT {:>9}  cached {}/{}",
                    t.turn,
                    t.messages,
                    t.ttft_ms.map_or("-".to_string(), |v| format!("{v:.2}")),
                    opt(t.cached_tokens),
                    opt(t.prompt_tokens)
                )?;
            }
        }
        if let Some(w) = self.workloads.iter().find(|w| w.kind == WorkloadKind::Decode && w.concurrency == 1) {
            writeln!(
                f,
                "server overhead (meaningful with a zero-time executor such as `flare run --sim`): \
                 {:.1} tokens/s per stream, {:.3} ms median added ITL per token",
                w.stream_tokens_per_sec, w.itl.median_ms
            )?;
        }
        let failures: Vec<_> = self
            .workloads
            .iter()
            .flat_map(|w| w.records.iter().filter_map(|r| r.error.as_ref().map(|e| (&w.name, e))))
            .collect();
        for (name, err) in failures.iter().take(10) {
            writeln!(f, "failed ({name}): {err}")?;
        }
        if failures.len() > 10 {
            writeln!(f, "... and {} more failures", failures.len() - 10)?;
        }
        Ok(())
    }
}

/// A deterministic word generator, so prompts are reproducible within a run but unique across
/// runs through the nonce.
#[derive(Debug, Clone)]
struct Words {
    seed: u64,
}

const VOCAB: &[&str] = &[
    "river", "stone", "quiet", "lantern", "market", "copper", "winter", "garden", "signal", "harbor", "meadow",
    "engine", "violet", "thunder", "ladder", "orbit", "pepper", "canyon", "marble", "whisper", "saddle", "glacier",
    "ember", "pocket", "falcon", "velvet", "tunnel", "biscuit", "compass", "ribbon", "summit", "anchor", "blossom",
    "cobalt", "drift", "feather", "gravel", "horizon", "island", "jasmine", "kettle", "lemon", "mirror", "nectar",
    "opal", "prairie", "quartz", "rocket", "spindle", "timber", "umbrella", "valley", "walnut", "yonder", "zephyr",
    "almond", "bridge", "candle", "dune", "echo", "fjord", "granite", "hollow", "ivory",
];

impl Words {
    fn new(seed: u64) -> Self {
        Self { seed }
    }

    /// `n` words from stream `stream`.
    fn text(&self, n: usize, stream: u64) -> String {
        let mut rng = Rng::new(self.seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let mut s = String::with_capacity(n * 8);
        for i in 0..n {
            if i > 0 {
                s.push(if i % 16 == 0 { '\n' } else { ' ' });
            }
            s.push_str(VOCAB[(rng.next() % VOCAB.len() as u64) as usize]);
        }
        s
    }
}

/// xorshift64* — small, fast, good enough for choosing words and client behaviours.
#[derive(Debug, Clone)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1)
    }

    pub(crate) fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `[lo, hi]`.
    pub(crate) fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo { lo } else { lo + self.next() % (hi - lo + 1) }
    }
}

/// Stream `i`'s copy request: its own file (from `seed ^ i`) to reproduce with one rename.
/// Stream `i`'s file and the function it renames.
fn copy_task(lines: usize, seed: u64, i: usize) -> (String, usize) {
    let file = source_file(lines, seed ^ i as u64);
    let functions = file.matches("def step_").count().max(1);
    (file, i % functions)
}

fn copy_prompt(lines: usize, seed: u64, i: usize) -> String {
    let (file, renamed) = copy_task(lines, seed, i);
    format!(
        "Here is a Python file:\n\n{file}\nRepeat the whole file exactly as it is, except that the function \
         `step_{renamed}` is renamed to `advance_{renamed}`. Output only the file."
    )
}

/// [`copy_prompt`]'s file as an agent turn: the user asks for the edit, the assistant reads the
/// file with a tool, and the tool's result is the file, which the model then writes back
/// edited. Returns the messages and the tool declarations.
fn copy_from_tool_messages(lines: usize, seed: u64, i: usize) -> (Value, Value) {
    let (file, renamed) = copy_task(lines, seed, i);
    let path = format!("src/stepper_{i}.py");
    let tools = json!([{
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "The contents of a file in the repository.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    }]);
    let messages = json!([
        {"role": "system", "content": "You are a coding agent. Read files with the tools; answer with file contents only."},
        {"role": "user", "content": format!(
            "In {path}, rename the function `step_{renamed}` to `advance_{renamed}` and show me the whole edited file."
        )},
        {"role": "assistant", "content": null, "tool_calls": [{
            "id": "call_0",
            "type": "function",
            "function": {"name": "read_file", "arguments": json!({"path": path}).to_string()},
        }]},
        {"role": "tool", "tool_call_id": "call_0", "content": file},
    ]);
    (messages, tools)
}

/// FNV-1a, 64-bit: a digest of outputs for comparing runs, not a defence against collisions.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

fn nonce() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let t = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    t ^ COUNTER.fetch_add(1, Ordering::Relaxed).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(clap::Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        args: BenchArgs,
    }

    #[test]
    fn cli_defaults_and_overrides() {
        use clap::Parser;
        let a = Cli::try_parse_from(["bench"]).expect("defaults parse").args;
        assert_eq!(a.url, "http://127.0.0.1:8000");
        assert_eq!((a.model, a.workload, a.output_tokens, a.json), (None, WorkloadKind::All, 256, false));
        assert_eq!(a.concurrency, [1, 2, 4]);
        let a = Cli::try_parse_from([
            "bench",
            "--url",
            "http://h:1",
            "--model",
            "m",
            "--workload",
            "branches",
            "--output-tokens",
            "8",
            "--json",
            "--concurrency",
            "8,16",
        ])
        .expect("overrides parse")
        .args;
        assert_eq!((a.url.as_str(), a.model.as_deref(), a.workload), ("http://h:1", Some("m"), WorkloadKind::Branches));
        assert_eq!((a.output_tokens, a.json, a.concurrency), (8, true, vec![8, 16]));
        assert!(Cli::try_parse_from(["bench", "--workload", "nope"]).is_err());
    }

    #[test]
    fn words_are_deterministic_per_stream_and_distinct_across_streams() {
        let w = Words::new(7);
        assert_eq!(w.text(50, 1), w.text(50, 1));
        assert_ne!(w.text(50, 1), w.text(50, 2));
        assert_eq!(w.text(50, 1).split_whitespace().count(), 50);
        assert_ne!(Words::new(8).text(50, 1), w.text(50, 1));
        assert_ne!(nonce(), nonce());
    }

    #[test]
    fn rng_range_is_inclusive_and_bounded() {
        let mut r = Rng::new(1);
        let mut seen = [false; 4];
        for _ in 0..1000 {
            let v = r.range(2, 5);
            assert!((2..=5).contains(&v));
            seen[(v - 2) as usize] = true;
        }
        assert!(seen.iter().all(|&s| s));
        assert_eq!(r.range(3, 3), 3);
    }

    #[test]
    fn summarise_counts_tokens_failures_and_cache() {
        let mut a = failed_outcome();
        a.end = StreamEnd::Done;
        a.ttft = Some(Duration::from_millis(10));
        a.itl = vec![Duration::from_millis(1), Duration::from_millis(3)];
        a.total = Duration::from_millis(1010);
        a.content_chunks = 3;
        a.usage = Some(
            json!({"prompt_tokens": 100, "completion_tokens": 11, "prompt_tokens_details": {"cached_tokens": 64}}),
        );
        let mut b = failed_outcome();
        b.end = StreamEnd::HttpStatus { status: 503, typed: true, body: "busy".into() };
        let w = summarise("x", WorkloadKind::Cold, 1, vec![a, b], Duration::from_secs(2));
        assert_eq!(w.requests, 2);
        assert_eq!(w.failed, 1);
        assert_eq!(w.output_tokens, 11);
        assert!((w.output_tokens_per_sec - 5.5).abs() < 1e-9);
        assert!((w.stream_tokens_per_sec - 10.0).abs() < 1e-9, "10 tokens over 1 s of decode");
        assert_eq!((w.prompt_tokens, w.cached_tokens), (100, 64));
        assert_eq!(w.ttft.count, 1);
        assert_eq!(w.itl.count, 2);
        assert!(w.records[1].error.as_deref().is_some_and(|e| e.contains("503")));
        let report = BenchReport {
            url: "u".into(),
            model: "m".into(),
            max_model_len: None,
            cold_prompt_words: 50,
            prefix_words: 50,
            workloads: vec![w],
            agent_turns: vec![],
        };
        assert_eq!(report.failed_requests(), 1);
        let shown = report.to_string();
        assert!(shown.contains("cold") || shown.contains('x'));
        assert!(shown.contains("HTTP 503"));
        assert!(report.to_json().is_ok_and(|j| j.contains("\"output_tokens\": 11")));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn run_bench_against_a_fake_server() {
        let (addr, _state) = crate::fake::start().await;
        let args = BenchArgs {
            url: format!("http://{addr}/v1"),
            model: None,
            workload: WorkloadKind::All,
            output_tokens: 8,
            json: false,
            concurrency: vec![1, 2],
            decode_rounds: 1,
            cold_prompt_words: 50,
            cold_tokens: vec![],
            prefix_tokens: 300,
            prefix_hits: 2,
            cold_requests: 2,
            agent_turns: 3,
            branches: 3,
            prefix_words: 50,
            timeout_secs: 10,
            copy_lines: 40,
            copy_seed: None,
            keep_outputs: false,
            copy_from_tool: false,
        };
        let r = run_bench(&args).await.expect("bench runs");
        assert_eq!(r.model, "fake");
        assert_eq!(r.failed_requests(), 0, "{r}");
        let names: Vec<&str> = r.workloads.iter().map(|w| w.name.as_str()).collect();
        assert_eq!(names, ["cold", "decode c=1", "decode c=2", "agent", "branches k=3", "prefix 300+tail"]);
        let d2 = &r.workloads[2];
        assert_eq!((d2.requests, d2.output_tokens), (2, 16));
        assert_eq!(d2.itl.count, 2 * 7, "8 content chunks per stream give 7 gaps");
        assert!(d2.output_tokens_per_sec > 0.0 && d2.stream_tokens_per_sec > 0.0);
        assert_eq!(r.agent_turns.len(), 3);
        assert_eq!(r.agent_turns.iter().map(|t| t.messages).collect::<Vec<_>>(), [2, 4, 6]);
        let prompts: Vec<u64> = r.agent_turns.iter().filter_map(|t| t.prompt_tokens).collect();
        assert!(prompts.windows(2).all(|w| w[0] < w[1]), "the agent conversation grows: {prompts:?}");
        assert!(r.workloads[4].cached_tokens > 0);
        let shown = r.to_string();
        assert!(shown.contains("server overhead") && shown.contains("turn  3"), "{shown}");

        let prefix = &r.workloads[5];
        assert_eq!((prefix.requests, prefix.failed), (2, 0));
        assert!(prefix.prompt_tokens > 0);

        let copy = BenchArgs { workload: WorkloadKind::Copy, ..args.clone() };
        let r = run_bench(&copy).await.expect("bench runs");
        let names: Vec<&str> = r.workloads.iter().map(|w| w.name.as_str()).collect();
        assert_eq!(names, ["copy c=1", "copy c=2"]);
        assert!(r.workloads.iter().all(|w| w.failed == 0 && w.prompt_tokens > 0));
        // The fake server streams "t0 t1 ... " whatever the prompt.
        let text: String = (0..r.workloads[0].records[0].output_tokens).map(|i| format!("t{i} ")).collect();
        assert_eq!(r.workloads[0].records[0].output_digest, format!("{:016x}", fnv1a(text.as_bytes())));
        assert!(r.workloads[0].records[0].output.is_none(), "texts are kept only when asked");
        let kept = run_bench(&BenchArgs { keep_outputs: true, ..copy.clone() }).await.expect("bench runs");
        assert_eq!(kept.workloads[0].records[0].output.as_deref(), Some(text.as_str()));
        // The same files as tool results quoted back in an agent turn.
        let tool = run_bench(&BenchArgs { copy_from_tool: true, ..copy.clone() }).await.expect("bench runs");
        let names: Vec<&str> = tool.workloads.iter().map(|w| w.name.as_str()).collect();
        assert_eq!(names, ["copy from tool c=1", "copy from tool c=2"]);
        assert!(tool.workloads.iter().all(|w| w.failed == 0 && w.prompt_tokens > 0));
        let (messages, tools) = copy_from_tool_messages(40, 7, 1);
        assert_eq!(messages[3]["content"].as_str(), Some(source_file(40, 7 ^ 1).as_str()));
        assert_eq!(messages[2]["tool_calls"][0]["id"], messages[3]["tool_call_id"]);
        assert_eq!(tools[0]["function"]["name"], messages[2]["tool_calls"][0]["function"]["name"]);
        // A seeded copy run sends the same prompts every run, one file per stream.
        assert_eq!(copy_prompt(40, 7, 1), copy_prompt(40, 7, 1));
        assert_ne!(copy_prompt(40, 7, 0), copy_prompt(40, 7, 1));

        let only = BenchArgs { workload: WorkloadKind::Cold, ..args.clone() };
        assert_eq!(run_bench(&only).await.expect("bench runs").workloads.len(), 1);
        // Token-sized cold prompts: the fake server counts a prompt as its JSON length / 4.
        let sized = BenchArgs { workload: WorkloadKind::Cold, cold_tokens: vec![200, 800], ..args };
        let r = run_bench(&sized).await.expect("bench runs");
        let got: Vec<u64> = r.workloads.iter().map(|w| w.prompt_tokens / w.requests as u64).collect();
        assert_eq!(r.workloads.iter().map(|w| w.name.as_str()).collect::<Vec<_>>(), ["cold 200 tok", "cold 800 tok"]);
        assert!(got[0] <= 200 && got[0] >= 190 && got[1] <= 800 && got[1] >= 780, "{got:?}");
    }

    #[test]
    fn copy_files_have_the_asked_lines_and_differ_per_seed() {
        let a = source_file(200, 1);
        assert!((196..=200).contains(&a.lines().count()), "{}", a.lines().count());
        assert!(a.contains("def step_0(") && a.contains("def step_48("));
        assert_ne!(a, source_file(200, 2));
        assert_eq!(a, source_file(200, 1));
    }

    #[test]
    fn long_prompts_are_capped_to_the_served_context() {
        assert_eq!(fit_words(2000, None), 2000);
        assert_eq!(fit_words(2000, Some(2048)), 768);
        assert_eq!(fit_words(100, Some(2048)), 100);
        assert_eq!(fit_words(2000, Some(100)), 1);
    }
}
