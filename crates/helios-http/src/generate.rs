//! The protocol-neutral part of a generation: prepare, admit every choice, and turn each
//! choice's events into presentation pieces; and the per-request accounting ([`RequestLog`]):
//! the request id, the one log line per request and its counts in `/metrics`.

use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Instant;

use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream, StreamExt};

use helios_frontend::{OutputDelta, OutputError, ParsedOutput, ToolChoice};
use helios_worker::{
    ChoiceDecoder, ChoiceEvent, ChoiceStream, Engine, FinishCause, FinishInfo, GenerationInput, Prepared, RequestError,
    Stage, StopHit, Unavailable,
};

use crate::AppState;
use crate::error::{ApiError, Flavor, escape_for_log};
use crate::extract::ApiJson;

/// What a client sees of one choice.
#[derive(Clone, Debug)]
pub(crate) enum Piece {
    Delta(OutputDelta),
    Done(ChoiceEnd),
    Failed(ApiError),
}

/// The end of one choice.
#[derive(Clone, Debug)]
pub(crate) struct ChoiceEnd {
    pub info: FinishInfo,
    pub parsed: ParsedOutput,
    /// The stop string that ended the choice (then `info.cause` is `Stop`).
    pub stop_sequence: Option<String>,
}

impl ChoiceEnd {
    /// OpenAI finish reason.
    pub(crate) fn finish_reason(&self) -> &'static str {
        match self.info.cause {
            FinishCause::Length | FinishCause::PoolExhausted => "length",
            _ if !self.parsed.tool_calls.is_empty() => "tool_calls",
            _ => "stop",
        }
    }
}

/// One admitted choice and its decoder.
#[derive(Debug)]
pub(crate) struct ChoiceRun {
    pub index: u32,
    stream: ChoiceStream,
    decoder: ChoiceDecoder,
    tool_choice: ToolChoice,
    tool_names: Vec<String>,
    flavor: Flavor,
    request_id: String,
    finished: bool,
    log: RequestLog,
}

impl ChoiceRun {
    fn fail(&mut self, e: &RequestError) -> Vec<Piece> {
        self.finished = true;
        let err = ApiError::from_request(e).flavor(self.flavor).request_id(&self.request_id);
        self.log.fail(&err, e.stage());
        vec![Piece::Failed(err)]
    }

    /// Next pieces; `None` after the terminal piece.
    pub(crate) async fn next(&mut self) -> Option<Vec<Piece>> {
        if self.finished {
            return None;
        }
        let event = match self.stream.next().await {
            Some(e) => e,
            None => return Some(self.fail(&RequestError::ChannelClosed)),
        };
        let named = matches!(self.tool_choice, ToolChoice::Named(_));
        let keep = |d: &OutputDelta| !(named && matches!(d, OutputDelta::Content(_)));
        if matches!(event, ChoiceEvent::Tokens(_)) {
            self.log.token_arrived();
        }
        match event {
            ChoiceEvent::Tokens(ids) => match self.decoder.push(&ids) {
                Ok(decoded) => {
                    if decoded.stopped {
                        self.stream.stop();
                    }
                    Some(decoded.deltas.into_iter().filter(keep).map(Piece::Delta).collect())
                }
                Err(e) => Some(self.fail(&e)),
            },
            ChoiceEvent::Finished(info) if info.cause == FinishCause::Cancelled => {
                Some(self.fail(&RequestError::Unavailable(Unavailable::Draining)))
            }
            ChoiceEvent::Finished(mut info) => {
                // A matched stop string ends the choice wherever the scheduler stopped it: its
                // cancellation may land after the output limit or EOS, and after more tokens.
                stop_wins(&mut info, self.decoder.stop_hit());
                // An output limit may cut a tool call or the required call short: that is a
                // `length` finish with what was parsed, not a malformed output.
                let truncated = matches!(info.cause, FinishCause::Length | FinishCause::PoolExhausted);
                let (deltas, mut parsed) = match self.decoder.finish() {
                    Ok(done) => done,
                    Err(RequestError::Output(OutputError::UnterminatedToolCall { .. })) if truncated => {
                        (Vec::new(), self.decoder.output())
                    }
                    Err(e) => return Some(self.fail(&e)),
                };
                if !truncated && let Err(e) = parsed.check_tool_choice(&self.tool_choice, &self.tool_names) {
                    return Some(self.fail(&RequestError::Output(e)));
                }
                self.finished = true;
                if named {
                    parsed.content.clear();
                }
                stop_wins(&mut info, self.decoder.stop_hit());
                let stop_sequence = self.decoder.stop_hit().map(|h| h.string.clone());
                let mut out: Vec<Piece> = deltas.into_iter().filter(keep).map(Piece::Delta).collect();
                out.push(Piece::Done(ChoiceEnd { info, parsed, stop_sequence }));
                if let Some(Piece::Done(end)) = out.last() {
                    self.log.choice_done(self.index, end);
                }
                Some(out)
            }
            ChoiceEvent::Failed(e) => Some(self.fail(&e)),
        }
    }

    /// Runs to the end; returns the end or the failure.
    pub(crate) async fn collect(mut self) -> Result<ChoiceEnd, ApiError> {
        while let Some(pieces) = self.next().await {
            for p in pieces {
                match p {
                    Piece::Done(end) => return Ok(end),
                    Piece::Failed(e) => return Err(e),
                    Piece::Delta(_) => {}
                }
            }
        }
        Err(ApiError::from_request(&RequestError::ChannelClosed).flavor(self.flavor))
    }
}

/// A stop string's match decides the finish: cause `Stop`, output counted up to the token that
/// completed it, so identical seeded requests report identical ends.
fn stop_wins(info: &mut FinishInfo, hit: Option<&StopHit>) {
    if let Some(h) = hit {
        info.cause = FinishCause::Stop;
        info.generated = info.generated.min(u32::try_from(h.tokens).unwrap_or(u32::MAX));
    }
}

/// A prepared, admitted generation.
#[derive(Debug)]
pub(crate) struct Generation {
    /// The response id (the body's `id`; `x-request-id` is [`RequestLog::id`]).
    pub request_id: String,
    pub prompt_tokens: u32,
    pub choices: Vec<ChoiceRun>,
    /// The request's accounting; a streamed response holds it through [`logged`].
    pub log: RequestLog,
}

impl Generation {
    /// Runs every choice to its end: the ends in index order and their usage; the failure of
    /// the first choice (by index) that failed otherwise.
    pub(crate) async fn collect(self) -> Result<(Vec<(u32, ChoiceEnd)>, Tally), ApiError> {
        let runs = self.choices.into_iter().map(|c| async move { (c.index, c.collect().await) });
        let ends = futures_util::future::join_all(runs).await;
        let mut usage = Tally::new(self.prompt_tokens);
        let mut out = Vec::with_capacity(ends.len());
        for (index, end) in ends {
            let end = end?;
            usage.add(&end);
            out.push((index, end));
        }
        Ok((out, usage))
    }

    /// Runs the only choice of an API without `n` to its end.
    pub(crate) async fn collect_one(self) -> Result<ChoiceEnd, ApiError> {
        match self.choices.into_iter().next() {
            Some(choice) => choice.collect().await,
            None => Err(ApiError::from_request(&RequestError::ChannelClosed)),
        }
    }
}

/// A request's token counts over all its choices, as `usage` reports them: output summed,
/// cached tokens the largest of any choice (they share one prompt).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Tally {
    pub prompt: u32,
    pub completion: u32,
    pub cached: u32,
}

impl Tally {
    pub(crate) fn new(prompt: u32) -> Self {
        Tally { prompt, completion: 0, cached: 0 }
    }

    pub(crate) fn add(&mut self, end: &ChoiceEnd) {
        self.completion += end.info.generated;
        self.cached = self.cached.max(end.info.cached_tokens);
    }
}

/// Prepares `input` and admits all its choices; errors here precede any response header.
pub(crate) async fn start(
    engine: &Arc<Engine>,
    input: GenerationInput,
    flavor: Flavor,
    log: &RequestLog,
) -> Result<Generation, ApiError> {
    let request_id = input.request_id.clone();
    let fail = |e: RequestError| {
        let err = ApiError::from_request(&e).flavor(flavor).request_id(log.id());
        log.fail(&err, e.stage());
        err
    };
    let mut prepared: Prepared = engine.prepare(input).await.map_err(fail)?;
    log.prepared(prepared.prompt_ids.len() as u32);
    let mut choices = Vec::with_capacity(prepared.n as usize);
    for index in 0..prepared.n {
        let stream = engine.generate(&mut prepared, index).await.map_err(fail)?;
        choices.push(ChoiceRun {
            index,
            stream,
            decoder: prepared.decoder(engine.frontend()),
            tool_choice: prepared.tool_choice.clone(),
            tool_names: prepared.tool_names(),
            flavor,
            request_id: log.id().to_owned(),
            finished: false,
            log: log.clone(),
        });
    }
    log.admitted();
    Ok(Generation { request_id, prompt_tokens: prepared.prompt_ids.len() as u32, choices, log: log.clone() })
}

/// A fresh response id after the protocol's prefix (`chatcmpl-`, `msg_`, …).
pub(crate) fn new_id(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}{:012x}{:06x}", t & 0xffff_ffff_ffff, n & 0xff_ffff)
}

/// The unique part of an id made by [`new_id`].
pub(crate) fn id_suffix(id: &str) -> &str {
    id.rsplit(['-', '_']).next().unwrap_or(id)
}

/// Seconds since the Unix epoch.
pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Runs a generation route's handler body under its request's accounting ([`RequestLog`]):
/// the request id (the client's `X-Request-Id`, else a fresh one after `id_prefix`), the log
/// line and the `/metrics` counts, also for a body the extractor rejected; every error is
/// answered in `flavor`'s envelope.
pub(crate) async fn handle<T, E, Fut>(
    state: AppState,
    headers: &HeaderMap,
    body: Result<ApiJson<T, E>, ApiError>,
    api: Api,
    (id_prefix, flavor): (&str, Flavor),
    inner: impl FnOnce(AppState, T, String, RequestLog) -> Fut,
) -> Response
where
    Fut: Future<Output = Result<Response, ApiError>>,
{
    let request_id = new_id(id_prefix);
    let log = RequestLog::new(&state.engine, api, headers, &request_id);
    let result = match body {
        Ok(ApiJson(req, _)) => inner(state, req, request_id, log.clone()).await,
        Err(e) => Err(e),
    };
    log.respond(result.map_err(|e| e.flavor(flavor)))
}

/// Longest client `X-Request-Id` kept, in bytes.
pub(crate) const MAX_CLIENT_REQUEST_ID: usize = 128;

/// The client's `X-Request-Id` when it is 1 to [`MAX_CLIENT_REQUEST_ID`] bytes of visible
/// ASCII (`!` to `~`); `None` otherwise, and a fresh id is used. Visible ASCII is safe as a
/// header value and on a log line (no spaces, quotes are escaped in JSON), and the bound keeps
/// a client from inflating every log line.
pub(crate) fn client_request_id(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get("x-request-id")?.to_str().ok()?;
    (!v.is_empty() && v.len() <= MAX_CLIENT_REQUEST_ID && v.bytes().all(|b| b.is_ascii_graphic())).then_some(v)
}

/// The API a generation came through: the `api` field of its log line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Api {
    Chat,
    Completions,
    Responses,
    Messages,
}

impl Api {
    fn as_str(self) -> &'static str {
        match self {
            Api::Chat => "chat",
            Api::Completions => "completions",
            Api::Responses => "responses",
            Api::Messages => "messages",
        }
    }
}

/// One generation request's accounting, shared (cheap clones) by its handler, its choices and
/// its response stream. When the last clone drops (the response was built, its stream ended,
/// or the client left) it writes the request's single log line and counts it in `/metrics`.
///
/// The line (`request done`, info; warn when the error is a 5xx) carries `request_id` (the
/// client's `X-Request-Id` when valid, else the response id), `response_id` (only when it
/// differs), `api`, `stream`, `status` (the HTTP status sent; absent when the client left
/// before any), `code` and `stage` of a failure, `finish_reason`, `prompt_tokens`,
/// `cached_tokens`, `output_tokens`, `ttft_ms` (arrival to the first token, absent without
/// one) and `duration_ms`. A request with `n` choices logs one line: output tokens summed,
/// cached tokens the largest of its choices (as `usage` reports them), finish reasons in
/// index order joined by commas. Finish reasons are OpenAI's (`stop`, `length`,
/// `tool_calls`) whatever the API, so lines of every API read alike. A client that left
/// logs `code=client_disconnected` and is not counted as a failure (its choices count as
/// cancelled in `flare_requests_finished_total`).
#[derive(Clone, Debug)]
pub(crate) struct RequestLog(Arc<Shared>);

#[derive(Debug)]
struct Shared {
    id: String,
    /// When the first token arrived: set once, read per token without the lock.
    first_token: OnceLock<Instant>,
    record: Mutex<Record>,
}

#[derive(Debug)]
struct Record {
    engine: Arc<Engine>,
    /// The body's id, when the client's `X-Request-Id` replaced it as the request id.
    response_id: Option<String>,
    api: Api,
    stream: bool,
    arrived: Instant,
    /// Every choice was admitted (the generation ran).
    admitted: bool,
    /// The status of the response sent, once one was.
    sent: Option<u16>,
    prompt_tokens: Option<u32>,
    cached_tokens: u32,
    output_tokens: u32,
    finish_reasons: Vec<(u32, &'static str)>,
    end: Option<End>,
}

/// How a request ended on the server's side.
#[derive(Debug)]
enum End {
    /// Answered in full.
    Answered(Instant),
    /// The first failure (an error answer, or an error event after the headers).
    Failed { at: Instant, status: u16, code: &'static str, stage: &'static str, message: String },
}

impl RequestLog {
    /// Starts the accounting of a request that arrived now; `response_id` is its body id, and
    /// its request id too unless the client sent a valid `X-Request-Id`.
    pub(crate) fn new(engine: &Arc<Engine>, api: Api, headers: &HeaderMap, response_id: &str) -> Self {
        let (id, response_id) = match client_request_id(headers) {
            Some(client) => (client.to_owned(), Some(response_id.to_owned())),
            None => (response_id.to_owned(), None),
        };
        let record = Record {
            engine: engine.clone(),
            response_id,
            api,
            stream: false,
            arrived: Instant::now(),
            admitted: false,
            sent: None,
            prompt_tokens: None,
            cached_tokens: 0,
            output_tokens: 0,
            finish_reasons: Vec::new(),
            end: None,
        };
        RequestLog(Arc::new(Shared { id, first_token: OnceLock::new(), record: Mutex::new(record) }))
    }

    /// The request id: the `x-request-id` response header and the log's `request_id`.
    pub(crate) fn id(&self) -> &str {
        &self.0.id
    }

    fn with(&self, f: impl FnOnce(&mut Record)) {
        f(&mut self.0.record.lock().unwrap_or_else(PoisonError::into_inner));
    }

    /// Marks the response as a stream (its end is the stream's, see [`logged`]).
    pub(crate) fn set_stream(&self, stream: bool) {
        self.with(|r| r.stream = stream);
    }

    fn prepared(&self, prompt_tokens: u32) {
        self.with(|r| r.prompt_tokens = Some(prompt_tokens));
    }

    fn admitted(&self) {
        self.with(|r| r.admitted = true);
    }

    fn token_arrived(&self) {
        self.0.first_token.get_or_init(Instant::now);
    }

    fn choice_done(&self, index: u32, end: &ChoiceEnd) {
        self.with(|r| {
            r.output_tokens += end.info.generated;
            r.cached_tokens = r.cached_tokens.max(end.info.cached_tokens);
            r.finish_reasons.push((index, end.finish_reason()));
        });
    }

    /// Records a failure; only the first one counts (a later one is its consequence).
    pub(crate) fn fail(&self, e: &ApiError, stage: Stage) {
        self.fail_at(e, stage.as_str());
    }

    fn fail_at(&self, e: &ApiError, stage: &'static str) {
        self.with(|r| {
            if r.end.is_none() {
                r.end = Some(End::Failed {
                    at: Instant::now(),
                    status: e.status.as_u16(),
                    code: e.code.as_str(),
                    stage,
                    message: escape_for_log(&e.message).into_owned(),
                });
            }
        });
    }

    /// Marks a streamed response as answered in full (no-op after a failure).
    fn stream_ended(&self) {
        self.with(|r| {
            r.end.get_or_insert(End::Answered(Instant::now()));
        });
    }

    /// The handler's answer, with `x-request-id` set: a response (a whole one is answered now;
    /// a stream ends later) or an error before any header. An error not recorded yet (body,
    /// model or parameter validation) is recorded here, at stage `validation` (`execution` for
    /// a 5xx).
    pub(crate) fn respond(&self, result: Result<Response, ApiError>) -> Response {
        let mut response = match result {
            Ok(r) => r,
            Err(e) => {
                let stage = if e.status.is_server_error() { "execution" } else { "validation" };
                self.fail_at(&e, stage);
                e.request_id(self.id()).into_response()
            }
        };
        if let Ok(v) = HeaderValue::from_str(self.id()) {
            response.headers_mut().insert("x-request-id", v);
        }
        let status = response.status().as_u16();
        self.with(|r| {
            r.sent = Some(status);
            if !r.stream {
                r.end.get_or_insert(End::Answered(Instant::now()));
            }
        });
        response
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        let r = self.record.get_mut().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        let metrics = r.engine.metrics();
        let ended = match &r.end {
            Some(End::Answered(at) | End::Failed { at, .. }) => *at,
            None => now,
        };
        let ms = |d: std::time::Duration| d.as_micros() as f64 / 1000.0;
        let duration_ms = ms(ended.saturating_duration_since(r.arrived));
        let ttft_ms = self.first_token.get().map(|t| ms(t.saturating_duration_since(r.arrived)));
        r.finish_reasons.sort_unstable();
        for (_, reason) in &r.finish_reasons {
            metrics.count_success(reason);
        }
        let finish_reason = (!r.finish_reasons.is_empty())
            .then(|| r.finish_reasons.iter().map(|(_, f)| *f).collect::<Vec<_>>().join(","));
        // Latency is the server's: a request the client left says nothing about it.
        if r.admitted && r.end.is_some() {
            metrics.observe_e2e(ended.saturating_duration_since(r.arrived).as_secs_f64());
        }
        let (code, stage, message, server_error) = match &r.end {
            Some(End::Failed { status, code, stage, message, .. }) => {
                metrics.count_failure(*status, code);
                (Some(*code), Some(*stage), Some(message.as_str()), *status >= 500)
            }
            Some(End::Answered(_)) => (None, None, None, false),
            None => (Some("client_disconnected"), None, None, false),
        };
        macro_rules! line {
            ($level:ident) => {
                tracing::$level!(
                    request_id = self.id.as_str(),
                    response_id = r.response_id.as_deref(),
                    api = r.api.as_str(),
                    stream = r.stream,
                    status = r.sent,
                    code,
                    stage,
                    finish_reason = finish_reason.as_deref(),
                    prompt_tokens = r.prompt_tokens,
                    cached_tokens = r.cached_tokens,
                    output_tokens = r.output_tokens,
                    ttft_ms,
                    duration_ms,
                    "request done{}{}",
                    if message.is_some() { ": " } else { "" },
                    message.unwrap_or_default()
                )
            };
        }
        if server_error {
            line!(warn);
        } else {
            line!(info);
        }
    }
}

/// `events`, then the request marked as answered in full once they are exhausted. The stream
/// holds `log` until it is dropped, so a client that leaves first is logged as having left.
pub(crate) fn logged<S: Stream + Send + 'static>(events: S, log: RequestLog) -> impl Stream<Item = S::Item> + Send {
    events.chain(stream::poll_fn(move |_| {
        log.stream_ended();
        std::task::Poll::Ready(None)
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id_of(value: &[u8]) -> Option<String> {
        let mut h = HeaderMap::new();
        h.insert("x-request-id", HeaderValue::from_bytes(value).expect("a header value"));
        client_request_id(&h).map(str::to_owned)
    }

    #[test]
    fn client_request_ids_are_kept_only_when_short_visible_ascii() {
        assert_eq!(id_of(b"req-42_a.b:c/d").as_deref(), Some("req-42_a.b:c/d"));
        let longest = "x".repeat(MAX_CLIENT_REQUEST_ID);
        assert_eq!(id_of(longest.as_bytes()), Some(longest.clone()));
        assert_eq!(id_of(format!("{longest}x").as_bytes()), None, "too long");
        assert_eq!(id_of(b"has space"), None);
        assert_eq!(id_of(b"tab\there"), None);
        assert_eq!(id_of("caf\u{e9}".as_bytes()), None, "not ASCII");
        assert_eq!(id_of(b""), None);
        assert_eq!(client_request_id(&HeaderMap::new()), None);
    }
}
