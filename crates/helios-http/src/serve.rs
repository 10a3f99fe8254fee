//! The HTTP/1 accept loop: per-connection timeouts, a connection cap, and a shutdown that
//! cannot be held open by a client.
//!
//! Each connection has a phase, kept beside it and watched by a timer of its own:
//!
//! - *head*: from accept, or from the first byte after an idle keep-alive period, until the
//!   request head is complete: bounded by [`ConnectionLimits::header_read_timeout`];
//! - *body*: the request head is complete but its body has not arrived in full: bounded by
//!   [`ConnectionLimits::body_read_timeout`] (the handler reading it answers 408). The request
//!   has not reached its handler's work yet: every body-taking route extracts the whole body
//!   before it runs, so closing the connection here cancels nothing but the read;
//! - *busy*: a request is being served (its body read, its response written): a write the
//!   client does not take is bounded by [`ConnectionLimits::write_stall_timeout`]; generation
//!   itself is not bounded here. A request without a body goes from *head* straight to *busy*;
//! - *idle*: keep-alive, waiting for the next request's first byte: bounded by
//!   [`ConnectionLimits::idle_timeout`].
//!
//! hyper's own `header_read_timeout` is not used: its timer starts as soon as a connection
//! goes idle, so it would bound keep-alive idle time by the (shorter) header timeout.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::IntoResponse;
use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, watch};
use tokio::time::Sleep;

use crate::error::{ApiCode, ApiError};

/// Per-connection limits of [`serve`]. Every duration must be positive and `max_connections`
/// at least one ([`ServeError::ZeroLimit`] otherwise).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Longest time from accept, or from the first byte after an idle keep-alive period, to a
    /// complete request head. On expiry the connection is closed without a response (no
    /// request was read to answer). Bounds slow-header (slowloris) connections and connections
    /// that never send anything.
    pub header_read_timeout: Duration,
    /// Longest time a request body may take to arrive in full, counted from the complete
    /// head, however it trickles. On expiry the handler reading it answers 408
    /// (`body_timeout`) and the connection is closed after the answer.
    pub body_read_timeout: Duration,
    /// Longest time a keep-alive connection may wait, with no request in progress, for the
    /// next request's first byte. On expiry it is closed (clients reopen idle connections).
    pub idle_timeout: Duration,
    /// Longest time a response write may wait for a client that stopped reading (a write
    /// that makes no progress). On expiry the connection is closed, which cancels its
    /// request. A client that reads, however slowly, is never cut off by this.
    pub write_stall_timeout: Duration,
    /// Connections served at once, at most. At the cap a new connection replaces one that is
    /// not serving a request, chosen in this order (the one that has been in its phase longest
    /// first within a phase):
    ///
    /// 1. *idle* keep-alive connections: nothing is lost, clients reopen them;
    /// 2. connections still sending a request *head*: nothing was read that needs an answer,
    ///    and a real client sends its head at once, so a long wait is a stalled or hostile one;
    /// 3. connections still sending a request *body*: the client loses its upload (closed
    ///    unanswered), but no work has begun for it, and a body that never completes would
    ///    otherwise hold its slot for the whole body timeout, so a flood of them could lock
    ///    out `/health`. The oldest is the slowest, and the likeliest to be one of a flood.
    ///
    /// Only when every connection is serving a request (its body read) is the new one
    /// answered 503 (`too_many_connections`, `Retry-After: 1`) and closed. Evictions and
    /// refusals are logged, at most once a second each with their count. Keep it under the
    /// process's open-file limit.
    pub max_connections: usize,
    /// After the shutdown future resolves: the listener is closed at once, connections
    /// without a request in progress are closed, and those serving one may finish for this
    /// long; then every connection still open is dropped (which cancels its request) and
    /// [`serve`] returns.
    pub shutdown_grace: Duration,
}

impl Default for ConnectionLimits {
    /// 10 s head, 30 s body, 60 s idle and write stall, 2048 connections, 10 s grace.
    fn default() -> Self {
        ConnectionLimits {
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            write_stall_timeout: Duration::from_secs(60),
            max_connections: 2048,
            shutdown_grace: Duration::from_secs(10),
        }
    }
}

impl ConnectionLimits {
    /// Checks the invariants stated on the type.
    pub fn validate(&self) -> Result<(), ServeError> {
        let zero = [
            ("header_read_timeout", self.header_read_timeout.is_zero()),
            ("body_read_timeout", self.body_read_timeout.is_zero()),
            ("idle_timeout", self.idle_timeout.is_zero()),
            ("write_stall_timeout", self.write_stall_timeout.is_zero()),
            ("max_connections", self.max_connections == 0),
        ];
        match zero.into_iter().find(|(_, z)| *z) {
            Some((name, _)) => Err(ServeError::ZeroLimit(name)),
            None => Ok(()),
        }
    }
}

/// Why [`serve`] could not run.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A [`ConnectionLimits`] field that must be positive is zero.
    #[error("connection limit `{0}` must be positive")]
    ZeroLimit(&'static str),
}

/// Serves `router` on `listener` over HTTP/1.1 under `limits` until `shutdown` resolves,
/// then drains as [`ConnectionLimits::shutdown_grace`] describes. Accept failures (such as
/// running out of file descriptors) are logged and retried after a short pause; they never
/// end the loop.
pub async fn serve<F>(
    listener: TcpListener,
    router: Router,
    limits: ConnectionLimits,
    shutdown: F,
) -> Result<(), ServeError>
where
    F: Future<Output = ()> + Send,
{
    limits.validate()?;
    let ctx = Arc::new(Ctx {
        router,
        limits,
        builder: {
            let mut b = http1::Builder::new();
            // Timeouts are ours (see the module docs); hyper's would need a timer.
            b.keep_alive(true).header_read_timeout(None);
            b
        },
        // More than the semaphore can count is as good as unlimited.
        permits: Arc::new(Semaphore::new(limits.max_connections.min(Semaphore::MAX_PERMITS))),
        registry: Mutex::new(Registry::default()),
        logs: Logs::default(),
    });
    let (stage_tx, stage_rx) = watch::channel(Stage::Serving);
    let mut flush = tokio::time::interval(LOG_INTERVAL);
    flush.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            biased;
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => ctx.admit(stream, &stage_rx),
                Err(e) if is_per_connection(&e) => {}
                Err(e) => {
                    ctx.logs.hit(&ctx.limits, Event::AcceptFailed, Some(&e));
                    // EMFILE and friends would otherwise spin: the socket stays readable.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            _ = flush.tick() => ctx.logs.flush(&ctx.limits),
        }
    }
    // Closing the listener now (not after the drain) makes new connections fail fast.
    drop(listener);
    drop(stage_rx);
    let open = stage_tx.receiver_count();
    tracing::info!(connections = open, "shutdown: listener closed, draining connections");
    stage_tx.send_replace(Stage::Draining);
    if tokio::time::timeout(limits.shutdown_grace, stage_tx.closed()).await.is_err() {
        tracing::warn!(
            connections = stage_tx.receiver_count(),
            grace_ms = limits.shutdown_grace.as_millis() as u64,
            "shutdown: grace over, dropping the connections still open"
        );
        stage_tx.send_replace(Stage::Aborting);
        // Each task drops its connection as soon as it sees the change.
        let _ = tokio::time::timeout(Duration::from_secs(1), stage_tx.closed()).await;
    }
    ctx.logs.flush_all(&ctx.limits);
    Ok(())
}

/// Accept errors that concern one connection only (the loop just moves on).
fn is_per_connection(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused | io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset
    )
}

/// What connections are told by [`serve`] at shutdown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Serving,
    /// Finish the request in progress, then close.
    Draining,
    /// Close now.
    Aborting,
}

/// State shared by the accept loop and every connection task.
struct Ctx {
    router: Router,
    limits: ConnectionLimits,
    builder: http1::Builder,
    /// One permit per served connection.
    permits: Arc<Semaphore>,
    registry: Mutex<Registry>,
    logs: Logs,
}

#[derive(Default)]
struct Registry {
    next_id: u64,
    conns: HashMap<u64, Arc<Conn>>,
}

impl Ctx {
    fn registry(&self) -> MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes a permit for `stream`, evicting a waiting connection at the cap, or refuses it.
    fn admit(self: &Arc<Self>, stream: TcpStream, stage: &watch::Receiver<Stage>) {
        let stage = stage.clone();
        if let Ok(permit) = self.permits.clone().try_acquire_owned() {
            tokio::spawn(run_connection(self.clone(), stream, permit, stage));
            return;
        }
        if let Some(phase) = self.evict_one() {
            let event = if phase == Phase::Body { Event::EvictedBody } else { Event::Evicted };
            self.logs.hit(&self.limits, event, None);
            let ctx = self.clone();
            // The evicted connection gives its permit back as soon as its task sees the
            // eviction; each waiter here stands for one such connection.
            tokio::spawn(async move {
                match tokio::time::timeout(Duration::from_secs(1), ctx.permits.clone().acquire_owned()).await {
                    Ok(Ok(permit)) => run_connection(ctx, stream, permit, stage).await,
                    _ => ctx.refuse(stream),
                }
            });
        } else {
            self.refuse(stream);
        }
    }

    /// Marks a connection that is not serving a request for closing, in the order
    /// [`ConnectionLimits::max_connections`] states (idle, then head, then body; the longest in
    /// its phase first), and returns the phase it was taken from; None when every connection
    /// is serving a request.
    fn evict_one(&self) -> Option<Phase> {
        let registry = self.registry();
        let mut victims: Vec<((u8, Instant), &Arc<Conn>)> = registry
            .conns
            .values()
            .filter_map(|c| {
                let s = c.lock();
                let rank = match s.phase {
                    Phase::Idle => 0,
                    Phase::Head => 1,
                    Phase::Body => 2,
                    Phase::Busy | Phase::Evicted => return None,
                };
                Some(((rank, s.since), c))
            })
            .collect();
        victims.sort_unstable_by_key(|(key, _)| *key);
        // A candidate may have begun serving since the scan: take the next one. (The registry
        // lock is held throughout; connection locks are only ever taken inside it or alone.)
        victims.into_iter().find_map(|(_, c)| c.try_evict())
    }

    /// Answers a minimal 503 (best effort, never waiting) and closes.
    fn refuse(&self, stream: TcpStream) {
        self.logs.hit(&self.limits, Event::Refused, None);
        let _ = stream.try_write(&REFUSAL);
    }
}

/// The answer to a connection over the cap, in the OpenAI error envelope.
static REFUSAL: LazyLock<Vec<u8>> = LazyLock::new(|| {
    let body = crate::sse::json_text(&too_many_connections().body());
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
});

fn too_many_connections() -> ApiError {
    ApiError::invalid(ApiCode::TooManyConnections, None, "the server is at its connection limit; retry shortly")
        .with_status(StatusCode::SERVICE_UNAVAILABLE)
}

/// Where a connection is in its request cycle (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Head,
    /// The head is in, the body is still arriving (ends at [`Conn::body_done`]).
    Body,
    Busy,
    Idle,
    /// Chosen for closing at the cap; never serves another request.
    Evicted,
}

#[derive(Debug)]
struct ConnState {
    phase: Phase,
    /// When `phase` began.
    since: Instant,
    /// Requests whose response is not finished (HTTP/1 serves one at a time, but a response
    /// body can outlive the call that made it by a moment).
    in_flight: u32,
    /// Requests begun on this connection: numbers each, so that a body that ends late (after
    /// its response) cannot end the body phase of the request after it.
    requests: u64,
}

/// One connection's phase and clocks, shared by its socket, its service and its watchdog.
#[derive(Debug)]
struct Conn {
    state: Mutex<ConnState>,
    /// Wakes the watchdog when a deadline may have moved.
    wake: Notify,
    accepted: Instant,
    /// Milliseconds after `accepted`, plus one, since which a write has been waiting for the
    /// client; 0 while writes make progress.
    write_blocked: AtomicU64,
}

impl Conn {
    fn new() -> Self {
        let now = Instant::now();
        Conn {
            state: Mutex::new(ConnState { phase: Phase::Head, since: now, in_flight: 0, requests: 0 }),
            wake: Notify::new(),
            accepted: now,
            write_blocked: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, ConnState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn on_bytes_read(&self) {
        let mut s = self.lock();
        if s.phase == Phase::Idle {
            s.phase = Phase::Head;
            s.since = Instant::now();
            drop(s);
            self.wake.notify_one();
        }
    }

    /// A request head arrived: the connection reads its body (`has_body`) or serves it.
    /// Returns the request's number; None when the connection was evicted: the request must
    /// not be served.
    fn begin_request(&self, has_body: bool) -> Option<u64> {
        let mut s = self.lock();
        if s.phase == Phase::Evicted {
            return None;
        }
        s.phase = if has_body { Phase::Body } else { Phase::Busy };
        s.since = Instant::now();
        s.in_flight += 1;
        s.requests += 1;
        Some(s.requests)
    }

    /// The body of request number `request` was read to its end, failed, or was dropped
    /// unread: the request is served from now on. False when the connection was evicted (the
    /// request must not go on).
    fn body_done(&self, request: u64) -> bool {
        let mut s = self.lock();
        match s.phase {
            Phase::Evicted => false,
            Phase::Body if s.requests == request => {
                s.phase = Phase::Busy;
                s.since = Instant::now();
                true
            }
            // The response finished first, or a later request is under way.
            Phase::Head | Phase::Body | Phase::Busy | Phase::Idle => true,
        }
    }

    fn end_request(&self) {
        let mut s = self.lock();
        s.in_flight = s.in_flight.saturating_sub(1);
        // Body: the response finished while the handler still held an unread body.
        if s.in_flight == 0 && matches!(s.phase, Phase::Busy | Phase::Body) {
            s.phase = Phase::Idle;
            s.since = Instant::now();
            drop(s);
            self.wake.notify_one();
        }
    }

    /// Marks the connection for closing unless it is serving a request; returns the phase it
    /// was in.
    fn try_evict(&self) -> Option<Phase> {
        let mut s = self.lock();
        let phase = s.phase;
        if matches!(phase, Phase::Idle | Phase::Head | Phase::Body) {
            s.phase = Phase::Evicted;
            drop(s);
            self.wake.notify_one();
            Some(phase)
        } else {
            None
        }
    }

    /// Whether a request is in progress (its body arriving, or being served).
    fn has_request(&self) -> bool {
        matches!(self.lock().phase, Phase::Body | Phase::Busy)
    }

    fn on_write(&self, progressed: bool) {
        let blocked = self.write_blocked.load(Ordering::Relaxed);
        if progressed {
            if blocked != 0 {
                self.write_blocked.store(0, Ordering::Relaxed);
            }
        } else if blocked == 0 {
            let ms = self.accepted.elapsed().as_millis() as u64 + 1;
            self.write_blocked.store(ms, Ordering::Relaxed);
            self.wake.notify_one();
        }
    }

    fn write_blocked_since(&self) -> Option<Instant> {
        match self.write_blocked.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(self.accepted + Duration::from_millis(ms - 1)),
        }
    }
}

/// Why a connection task ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Closed {
    /// hyper finished the connection (client closed, error, or keep-alive over).
    Done,
    HeaderTimeout,
    IdleTimeout,
    WriteStalled,
    Evicted,
    /// Shutdown began while no request was in progress.
    Drained,
    /// Shutdown grace over.
    Aborted,
}

/// Resolves when the connection must be closed for its phase's deadline or an eviction.
async fn watchdog(conn: &Conn, limits: &ConnectionLimits) -> Closed {
    loop {
        // `notify_one` keeps a permit, so a change between here and the await is not lost.
        let notified = conn.wake.notified();
        let (phase, since) = {
            let s = conn.lock();
            (s.phase, s.since)
        };
        let deadline = match phase {
            Phase::Evicted => return Closed::Evicted,
            Phase::Head => Some((since + limits.header_read_timeout, Closed::HeaderTimeout)),
            Phase::Idle => Some((since + limits.idle_timeout, Closed::IdleTimeout)),
            // The body's own deadline is kept by the handler reading it ([`DeadlineBody`]).
            Phase::Body | Phase::Busy => {
                conn.write_blocked_since().map(|t| (t + limits.write_stall_timeout, Closed::WriteStalled))
            }
        };
        match deadline {
            Some((at, why)) if Instant::now() >= at => return why,
            Some((at, _)) => {
                tokio::select! {
                    () = notified => {}
                    () = tokio::time::sleep_until(at.into()) => {}
                }
            }
            None => notified.await,
        }
    }
}

/// Registers the connection for eviction scans for the life of its task.
struct Registered<'a> {
    ctx: &'a Ctx,
    id: u64,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        self.ctx.registry().conns.remove(&self.id);
    }
}

async fn run_connection(ctx: Arc<Ctx>, stream: TcpStream, permit: OwnedSemaphorePermit, stage: watch::Receiver<Stage>) {
    let _permit = permit;
    let mut stage = stage;
    // Tokens go out as they are made; Nagle would hold small SSE writes back.
    let _ = stream.set_nodelay(true);
    let conn = Arc::new(Conn::new());
    let _registered = {
        let mut r = ctx.registry();
        r.next_id += 1;
        let id = r.next_id;
        r.conns.insert(id, conn.clone());
        Registered { ctx: &ctx, id }
    };
    let service = ConnService { router: ctx.router.clone(), conn: conn.clone(), ctx: ctx.clone() };
    let io = TokioIo::new(TrackedStream { inner: stream, conn: conn.clone() });
    let connection = ctx.builder.serve_connection(io, service);
    let mut connection = std::pin::pin!(connection);
    let mut draining = false;
    let closed = loop {
        let now = *stage.borrow_and_update();
        match now {
            Stage::Aborting => break Closed::Aborted,
            Stage::Draining if !draining => {
                if !conn.has_request() {
                    break Closed::Drained;
                }
                // Finish the request in progress, then close.
                connection.as_mut().graceful_shutdown();
                draining = true;
            }
            _ => {}
        }
        tokio::select! {
            _ = connection.as_mut() => break Closed::Done,
            why = watchdog(&conn, &ctx.limits) => break why,
            changed = stage.changed() => if changed.is_err() { break Closed::Aborted },
        }
    };
    match closed {
        Closed::HeaderTimeout => ctx.logs.hit(&ctx.limits, Event::HeaderTimeout, None),
        Closed::WriteStalled => ctx.logs.hit(&ctx.limits, Event::WriteStalled, None),
        Closed::IdleTimeout => tracing::debug!("closed an idle keep-alive connection"),
        Closed::Done | Closed::Evicted | Closed::Drained | Closed::Aborted => {}
    }
}

/// The socket, reporting reads and write progress to its [`Conn`].
struct TrackedStream {
    inner: TcpStream,
    conn: Arc<Conn>,
}

impl AsyncRead for TrackedStream {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.conn.on_bytes_read();
        }
        r
    }
}

impl AsyncWrite for TrackedStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.conn.on_write(!r.is_pending());
        r
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.conn.on_write(!r.is_pending());
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The router behind one connection: marks the connection as reading a body (then busy) for
/// each request, bounds the request body's arrival, and keeps the connection busy until the
/// response body is done.
#[derive(Clone)]
struct ConnService {
    router: Router,
    conn: Arc<Conn>,
    ctx: Arc<Ctx>,
}

type ServiceFuture = Pin<Box<dyn Future<Output = Result<hyper::Response<TrackedBody>, Infallible>> + Send>>;

impl hyper::service::Service<hyper::Request<Incoming>> for ConnService {
    type Response = hyper::Response<TrackedBody>;
    type Error = Infallible;
    type Future = ServiceFuture;

    fn call(&self, req: hyper::Request<Incoming>) -> Self::Future {
        // hyper gives a request without a body (no length, or length 0) an empty one.
        let has_body = !req.body().is_end_stream();
        let Some(request) = self.conn.begin_request(has_body) else {
            // Evicted between its head and this call (a narrow race): answer like a refusal.
            let mut response = too_many_connections().into_response();
            response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
            return Box::pin(std::future::ready(Ok(response.map(|inner| TrackedBody { inner, _guard: None }))));
        };
        let guard = RequestGuard(self.conn.clone());
        let timeout = self.ctx.limits.body_read_timeout;
        let ctx = self.ctx.clone();
        let conn = self.conn.clone();
        let req = req.map(|inner| {
            Body::new(DeadlineBody {
                inner,
                deadline: Instant::now() + timeout,
                timeout,
                timer: None,
                ctx,
                conn,
                request,
                expired: false,
                done: !has_body,
            })
        });
        let mut router = self.router.clone();
        Box::pin(async move {
            let response = match tower_service::Service::call(&mut router, req).await {
                Ok(r) => r,
                Err(never) => match never {},
            };
            Ok(response.map(|inner| TrackedBody { inner, _guard: Some(guard) }))
        })
    }
}

/// Ends the request on its connection when dropped (with the response body, or with the
/// service future when the connection goes first).
struct RequestGuard(Arc<Conn>);

impl Drop for RequestGuard {
    fn drop(&mut self) {
        self.0.end_request();
    }
}

/// A response body that keeps its connection busy until hyper is done with it.
struct TrackedBody {
    inner: Body,
    _guard: Option<RequestGuard>,
}

impl HttpBody for TrackedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Why reading a request body failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BodyReadError {
    /// The body did not arrive in full within the body read timeout.
    #[error("the request body did not arrive within {} ms", .0.as_millis())]
    TimedOut(Duration),
    #[error("reading the request body: {0}")]
    Read(#[from] hyper::Error),
    /// The connection was closed for a new one at the connection cap while its body arrived.
    #[error("the connection was closed at the connection cap")]
    Evicted,
}

/// A request body that fails with [`BodyReadError::TimedOut`] once `deadline` passes, and
/// moves its connection from the body phase to busy when it ends (read in full, failed, or
/// dropped unread).
struct DeadlineBody {
    inner: Incoming,
    deadline: Instant,
    timeout: Duration,
    /// Made on the first wait, so requests whose body is already there need no timer.
    timer: Option<Pin<Box<Sleep>>>,
    ctx: Arc<Ctx>,
    conn: Arc<Conn>,
    /// Its request's number on `conn`.
    request: u64,
    expired: bool,
    /// The connection has been told the body is over.
    done: bool,
}

impl DeadlineBody {
    /// Tells the connection (once) that the body is over; false when it was evicted meanwhile.
    fn finish(&mut self) -> bool {
        if self.done {
            return true;
        }
        self.done = true;
        self.conn.body_done(self.request)
    }
}

impl HttpBody for DeadlineBody {
    type Data = Bytes;
    type Error = BodyReadError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BodyReadError>>> {
        let this = &mut *self;
        if this.expired {
            return Poll::Ready(None);
        }
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            // The end: no more frames, a failure, or the last byte of a known length.
            let end = !matches!(frame, Some(Ok(_))) || this.inner.is_end_stream();
            if end && !this.finish() {
                // Evicted just now: the whole body must not reach the handler's work (the
                // connection is being closed, so no answer goes out).
                this.expired = true;
                return Poll::Ready(Some(Err(BodyReadError::Evicted)));
            }
            return Poll::Ready(frame.map(|f| f.map_err(BodyReadError::Read)));
        }
        let deadline = this.deadline;
        let timer = this.timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline.into())));
        if timer.as_mut().poll(cx).is_ready() {
            this.expired = true;
            this.finish();
            this.ctx.logs.hit(&this.ctx.limits, Event::BodyTimeout, None);
            return Poll::Ready(Some(Err(BodyReadError::TimedOut(this.timeout))));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.expired || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for DeadlineBody {
    /// A body dropped before its end (a handler that answers without reading it, such as a
    /// 413 on its stated length, or a 404) leaves the request served, not evictable.
    fn drop(&mut self) {
        self.finish();
    }
}

/// Whether a body-reading failure (anywhere in its source chain) is a body timeout.
pub(crate) fn is_body_timeout(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(e) = cur {
        if matches!(e.downcast_ref::<BodyReadError>(), Some(BodyReadError::TimedOut(_))) {
            return true;
        }
        cur = e.source();
    }
    false
}

/// How often a repeated connection event is logged, at most.
const LOG_INTERVAL: Duration = Duration::from_secs(1);

/// Connection events logged at most once per [`LOG_INTERVAL`] each, with their count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Event {
    Refused,
    /// An idle connection or one still sending its head, closed at the cap.
    Evicted,
    /// A connection still sending a request body, closed at the cap.
    EvictedBody,
    HeaderTimeout,
    BodyTimeout,
    WriteStalled,
    AcceptFailed,
}

const EVENTS: [Event; 7] = [
    Event::Refused,
    Event::Evicted,
    Event::EvictedBody,
    Event::HeaderTimeout,
    Event::BodyTimeout,
    Event::WriteStalled,
    Event::AcceptFailed,
];

#[derive(Debug, Default)]
struct Throttle {
    last: Option<Instant>,
    pending: u64,
}

impl Throttle {
    /// The pending count, taken, when there is one and the last line is older than the interval.
    fn take_due(&mut self) -> Option<u64> {
        if self.pending == 0 || self.last.is_some_and(|at| at.elapsed() < LOG_INTERVAL) {
            return None;
        }
        self.last = Some(Instant::now());
        Some(std::mem::take(&mut self.pending))
    }
}

#[derive(Debug, Default)]
struct Logs {
    throttles: [Mutex<Throttle>; EVENTS.len()],
}

impl Logs {
    fn slot(&self, event: Event) -> MutexGuard<'_, Throttle> {
        self.throttles[event as usize].lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts `event`; logs the count when the last line for it is older than the interval.
    fn hit(&self, limits: &ConnectionLimits, event: Event, error: Option<&io::Error>) {
        let due = {
            let mut t = self.slot(event);
            t.pending += 1;
            t.take_due()
        };
        if let Some(n) = due {
            emit(limits, event, n, error);
        }
    }

    /// Logs counts held back for longer than the interval.
    fn flush(&self, limits: &ConnectionLimits) {
        for event in EVENTS {
            let due = self.slot(event).take_due();
            if let Some(n) = due {
                emit(limits, event, n, None);
            }
        }
    }

    fn flush_all(&self, limits: &ConnectionLimits) {
        for event in EVENTS {
            let n = std::mem::take(&mut self.slot(event).pending);
            if n > 0 {
                emit(limits, event, n, None);
            }
        }
    }
}

fn emit(limits: &ConnectionLimits, event: Event, count: u64, error: Option<&io::Error>) {
    let max_connections = limits.max_connections;
    match event {
        Event::Refused => tracing::warn!(
            count,
            max_connections,
            "connection cap reached: refused {count} connection(s) with 503 (every connection is serving a request)"
        ),
        Event::Evicted => tracing::info!(
            count,
            max_connections,
            "connection cap reached: closed {count} waiting connection(s) (idle or still sending a head) for new ones"
        ),
        Event::EvictedBody => tracing::warn!(
            count,
            max_connections,
            "connection cap reached: closed {count} connection(s) still sending a request body, unanswered, for new \
             ones (no idle ones or ones sending a head were left)"
        ),
        Event::HeaderTimeout => tracing::info!(
            count,
            timeout_ms = limits.header_read_timeout.as_millis() as u64,
            "closed {count} connection(s) that sent no complete request head in time"
        ),
        Event::BodyTimeout => tracing::info!(
            count,
            timeout_ms = limits.body_read_timeout.as_millis() as u64,
            "answered 408 to {count} request(s) whose body did not arrive in time"
        ),
        Event::WriteStalled => tracing::info!(
            count,
            timeout_ms = limits.write_stall_timeout.as_millis() as u64,
            "closed {count} connection(s) whose client stopped reading a response"
        ),
        Event::AcceptFailed => match error {
            Some(e) => tracing::warn!(count, "accept failed ({count} time(s)): {e}"),
            None => tracing::warn!(count, "accept failed {count} more time(s)"),
        },
    }
}

#[cfg(test)]
mod tests {
    //! Real sockets on 127.0.0.1 against a small router; every wait is bounded.
    use std::net::SocketAddr;

    use axum::routing::{get, post};
    use futures_util::stream;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::sync::oneshot;

    use super::*;
    use crate::extract::ApiJson;

    fn limits() -> ConnectionLimits {
        ConnectionLimits {
            header_read_timeout: Duration::from_millis(400),
            body_read_timeout: Duration::from_millis(500),
            idle_timeout: Duration::from_millis(1500),
            write_stall_timeout: Duration::from_millis(500),
            max_connections: 64,
            shutdown_grace: Duration::from_millis(500),
        }
    }

    /// Sets its flag when dropped: shows a response (and so its connection) went away.
    struct DropFlag(Arc<std::sync::atomic::AtomicBool>);
    impl Drop for DropFlag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    fn router(dropped: Arc<std::sync::atomic::AtomicBool>) -> Router {
        Router::new()
            .route("/health", get(|| async { "ok" }))
            .route("/echo", post(|ApiJson(v, _): ApiJson<serde_json::Value>| async move { v.to_string() }))
            .route("/hang", get(std::future::pending::<&'static str>))
            // Reads its whole body, then never answers.
            .route("/slurp", post(|ApiJson(_, _): ApiJson<serde_json::Value>| std::future::pending::<&'static str>()))
            .route(
                "/flood",
                get(move || {
                    let flag = DropFlag(dropped.clone());
                    let chunks = stream::repeat_with(move || {
                        let _ = &flag;
                        Ok::<_, Infallible>(Bytes::from(vec![b'x'; 64 << 10]))
                    });
                    async move { Body::from_stream(chunks) }
                }),
            )
    }

    struct Running {
        addr: SocketAddr,
        stop: Option<oneshot::Sender<()>>,
        task: tokio::task::JoinHandle<Result<(), ServeError>>,
        dropped: Arc<std::sync::atomic::AtomicBool>,
    }

    async fn start(limits: ConnectionLimits) -> Running {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(serve(listener, router(dropped.clone()), limits, async move {
            let _ = stopped.await;
        }));
        Running { addr, stop: Some(stop), task, dropped }
    }

    async fn connect(addr: SocketAddr) -> TcpStream {
        TcpStream::connect(addr).await.expect("connect")
    }

    /// Reads until the server closes (EOF or reset) or `limit` passes; returns what came and
    /// when the close came (None: still open at `limit`).
    async fn read_to_close(s: &mut TcpStream, limit: Duration) -> (String, Option<Duration>) {
        let started = Instant::now();
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match tokio::time::timeout_at((started + limit).into(), s.read(&mut buf)).await {
                Err(_) => return (String::from_utf8_lossy(&got).into_owned(), None),
                Ok(Ok(0) | Err(_)) => return (String::from_utf8_lossy(&got).into_owned(), Some(started.elapsed())),
                Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            }
        }
    }

    async fn fetch(addr: SocketAddr, path: &str) -> String {
        let mut s = connect(addr).await;
        s.write_all(format!("GET {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n").as_bytes())
            .await
            .expect("write");
        read_to_close(&mut s, Duration::from_secs(5)).await.0
    }

    #[tokio::test]
    async fn limits_must_be_positive() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let limits = ConnectionLimits { max_connections: 0, ..limits() };
        let r = serve(listener, Router::new(), limits, async {}).await;
        assert!(matches!(r, Err(ServeError::ZeroLimit("max_connections"))), "{r:?}");
    }

    #[tokio::test]
    async fn silent_and_partial_heads_are_closed_after_the_header_timeout() {
        let server = start(limits()).await;
        let mut silent = connect(server.addr).await;
        let mut partial = connect(server.addr).await;
        partial.write_all(b"GET /health HTTP/1.1\r\nhost: localhost\r\nx-slow: ").await.expect("write");
        let started = Instant::now();
        for s in [&mut silent, &mut partial] {
            let (got, closed) = read_to_close(s, Duration::from_secs(5)).await;
            assert!(closed.is_some(), "closed within the bound");
            assert_eq!(got, "", "no response to a request never read");
        }
        let closed = started.elapsed();
        assert!(closed >= Duration::from_millis(300) && closed < Duration::from_secs(3), "{closed:?}");
        assert!(fetch(server.addr, "/health").await.starts_with("HTTP/1.1 200"));
    }

    #[tokio::test]
    async fn stalled_and_trickling_bodies_get_408_and_close() {
        let server = start(limits()).await;
        // Stalled: 10 of 100 bytes, then nothing.
        let mut stalled = connect(server.addr).await;
        stalled
            .write_all(b"POST /echo HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"a\": 1, ")
            .await
            .expect("write");
        // Trickling: a byte every 100 ms, never done in time.
        let mut trickle = connect(server.addr).await;
        trickle
            .write_all(b"POST /echo HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: 60\r\n\r\n")
            .await
            .expect("write");
        let writer = tokio::spawn(async move {
            for _ in 0..40 {
                if trickle.write_all(b" ").await.is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            trickle
        });
        let (got, closed) = read_to_close(&mut stalled, Duration::from_secs(5)).await;
        assert!(got.starts_with("HTTP/1.1 408"), "{got}");
        assert!(got.contains(r#""code":"body_timeout""#), "{got}");
        let closed = closed.expect("closed after the 408");
        assert!(closed >= Duration::from_millis(400) && closed < Duration::from_secs(3), "{closed:?}");
        let mut trickle = writer.await.expect("writer");
        let (got, _) = read_to_close(&mut trickle, Duration::from_secs(5)).await;
        assert!(got.starts_with("HTTP/1.1 408"), "{got}");
        // A body that arrives in time is served.
        let mut ok = connect(server.addr).await;
        ok.write_all(b"POST /echo HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: 8\r\nconnection: close\r\n\r\n{\"a\": 1}")
            .await
            .expect("write");
        let (got, _) = read_to_close(&mut ok, Duration::from_secs(5)).await;
        assert!(got.starts_with("HTTP/1.1 200") && got.ends_with(r#"{"a":1}"#), "{got}");
    }

    #[tokio::test]
    async fn idle_keep_alive_is_closed_after_the_idle_timeout_not_the_header_timeout() {
        let server = start(limits()).await;
        let mut s = connect(server.addr).await;
        for _ in 0..2 {
            s.write_all(b"GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n").await.expect("write");
            let mut buf = [0u8; 1024];
            let n =
                tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await.expect("answer").expect("read");
            assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
            // Idle for longer than the header timeout (400 ms), shorter than the idle one.
            tokio::time::sleep(Duration::from_millis(600)).await;
        }
        s.write_all(b"GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n").await.expect("write");
        let mut buf = [0u8; 1024];
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await.expect("answer").expect("read");
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
        let (_, closed) = read_to_close(&mut s, Duration::from_secs(5)).await;
        let closed = closed.expect("idle connection closed");
        assert!(closed >= Duration::from_millis(1300) && closed < Duration::from_secs(5), "{closed:?}");
    }

    #[tokio::test]
    async fn pipelined_requests_are_all_answered() {
        let server = start(limits()).await;
        let mut s = connect(server.addr).await;
        s.write_all(b"GET /health HTTP/1.1\r\nhost: localhost\r\n\r\nGET /health HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n")
            .await
            .expect("write");
        let (got, closed) = read_to_close(&mut s, Duration::from_secs(5)).await;
        assert!(closed.is_some());
        assert_eq!(got.matches("HTTP/1.1 200").count(), 2, "{got}");
    }

    #[tokio::test]
    async fn the_cap_evicts_waiting_connections_and_refuses_when_all_are_busy() {
        let server = start(ConnectionLimits { max_connections: 2, ..limits() }).await;
        // Two connections that send nothing fill the cap; /health still gets through by
        // replacing the older one.
        let mut first = connect(server.addr).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        let _second = connect(server.addr).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(fetch(server.addr, "/health").await.starts_with("HTTP/1.1 200"));
        let (_, closed) = read_to_close(&mut first, Duration::from_millis(300)).await;
        assert!(closed.is_some(), "the oldest waiting connection was evicted");

        // Two requests in progress fill the cap: a third connection is answered 503.
        let mut busy = Vec::new();
        for _ in 0..2 {
            let mut s = connect(server.addr).await;
            s.write_all(b"GET /hang HTTP/1.1\r\nhost: localhost\r\n\r\n").await.expect("write");
            busy.push(s);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut refused = connect(server.addr).await;
        let (got, closed) = read_to_close(&mut refused, Duration::from_secs(5)).await;
        assert!(closed.is_some());
        assert!(got.starts_with("HTTP/1.1 503"), "{got}");
        assert!(got.contains("retry-after: 1") && got.contains(r#""code":"too_many_connections""#), "{got}");
        drop(busy);
        // Freed: served again.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !fetch(server.addr, "/health").await.starts_with("HTTP/1.1 200") {
            assert!(Instant::now() < deadline, "not served after the busy connections left");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Sends a head announcing a 100-byte JSON body to `path`, and its first byte only.
    async fn slow_body(addr: SocketAddr, path: &str) -> TcpStream {
        let mut s = connect(addr).await;
        s.write_all(
            format!(
                "POST {path} HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n\
                 content-length: 100\r\n\r\n{{"
            )
            .as_bytes(),
        )
        .await
        .expect("write");
        s
    }

    #[tokio::test]
    async fn the_cap_evicts_slow_bodies_oldest_first_but_not_requests_whose_body_is_in() {
        // Long timeouts: anything closed here was evicted, not timed out.
        let limits = ConnectionLimits {
            header_read_timeout: Duration::from_secs(20),
            body_read_timeout: Duration::from_secs(20),
            max_connections: 3,
            ..limits()
        };
        let server = start(limits).await;
        // A request being served (its body in), then two bodies that stall after one byte.
        let mut served = connect(server.addr).await;
        served
            .write_all(b"POST /slurp HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
            .await
            .expect("write");
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut older = slow_body(server.addr, "/echo").await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut newer = slow_body(server.addr, "/echo").await;
        tokio::time::sleep(Duration::from_millis(50)).await;

        // At the cap: /health is served at once, in place of the oldest slow body, which is
        // closed unanswered (its request never reached the handler).
        let started = Instant::now();
        assert!(fetch(server.addr, "/health").await.starts_with("HTTP/1.1 200"));
        assert!(started.elapsed() < Duration::from_secs(1), "{:?}", started.elapsed());
        let (got, closed) = read_to_close(&mut older, Duration::from_millis(500)).await;
        assert!(closed.is_some(), "the oldest slow body was evicted");
        assert_eq!(got, "", "an evicted body is not answered");
        let (_, closed) = read_to_close(&mut newer, Duration::from_millis(100)).await;
        assert!(closed.is_none(), "only one connection was evicted");

        // The cap full again: the next oldest slow body goes, never the request being served.
        // (A moment first, for the /health connection to be gone: idle, it would go first.)
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut newest = slow_body(server.addr, "/echo").await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(fetch(server.addr, "/health").await.starts_with("HTTP/1.1 200"));
        let (_, closed) = read_to_close(&mut newer, Duration::from_millis(500)).await;
        assert!(closed.is_some(), "the older remaining slow body was evicted");
        for s in [&mut newest, &mut served] {
            let (_, closed) = read_to_close(s, Duration::from_millis(100)).await;
            assert!(closed.is_none(), "the newest slow body and the request being served stay");
        }
        drop(newest);

        // Every connection serving a request whose body is in: refused.
        let mut busy = Vec::new();
        for _ in 0..2 {
            let mut s = connect(server.addr).await;
            s.write_all(b"POST /slurp HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
                .await
                .expect("write");
            busy.push(s);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut refused = connect(server.addr).await;
        let (got, closed) = read_to_close(&mut refused, Duration::from_secs(5)).await;
        assert!(closed.is_some());
        assert!(got.starts_with("HTTP/1.1 503"), "{got}");
        for s in &mut busy {
            let (_, closed) = read_to_close(s, Duration::from_millis(50)).await;
            assert!(closed.is_none(), "still served");
        }
    }

    #[test]
    fn a_body_phase_ends_once_for_its_own_request_and_is_evictable() {
        let phase = |c: &Conn| c.lock().phase;
        let conn = Conn::new();
        // No body: straight to busy, not evictable.
        let first = conn.begin_request(false).expect("not evicted");
        assert_eq!(phase(&conn), Phase::Busy);
        assert_eq!(conn.try_evict(), None);
        conn.end_request();
        assert_eq!(phase(&conn), Phase::Idle);
        // A body: evictable until it ends; a late end of the earlier request changes nothing.
        let second = conn.begin_request(true).expect("not evicted");
        assert_eq!(phase(&conn), Phase::Body);
        assert!(conn.body_done(first));
        assert_eq!(phase(&conn), Phase::Body);
        assert!(conn.body_done(second));
        assert_eq!(phase(&conn), Phase::Busy);
        assert_eq!(conn.try_evict(), None);
        conn.end_request();
        // Evicted while its body arrives: the body's end reports it, and nothing more is served.
        let third = conn.begin_request(true).expect("not evicted");
        assert_eq!(conn.try_evict(), Some(Phase::Body));
        assert!(!conn.body_done(third));
        assert_eq!(conn.begin_request(false), None);
    }

    #[tokio::test]
    async fn a_client_that_stops_reading_is_cut_off() {
        let server = start(limits()).await;
        let mut s = connect(server.addr).await;
        s.write_all(b"GET /flood HTTP/1.1\r\nhost: localhost\r\n\r\n").await.expect("write");
        // Never read: the socket buffers fill, the write stalls, the connection is closed and
        // the response dropped.
        let started = Instant::now();
        while !server.dropped.load(Ordering::SeqCst) {
            assert!(started.elapsed() < Duration::from_secs(10), "non-reading client still served");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    #[tokio::test]
    async fn shutdown_closes_the_listener_and_drops_stuck_connections_after_the_grace() {
        let mut server = start(ConnectionLimits { write_stall_timeout: Duration::from_secs(60), ..limits() }).await;
        let mut partial_head = connect(server.addr).await;
        partial_head.write_all(b"GET /health HTTP/1.1\r\nhost: local").await.expect("write");
        let mut partial_body = connect(server.addr).await;
        partial_body
            .write_all(b"POST /echo HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: 9\r\n\r\n{")
            .await
            .expect("write");
        let mut hanging = connect(server.addr).await;
        hanging.write_all(b"GET /hang HTTP/1.1\r\nhost: localhost\r\n\r\n").await.expect("write");
        let mut flood = connect(server.addr).await;
        flood.write_all(b"GET /flood HTTP/1.1\r\nhost: localhost\r\n\r\n").await.expect("write");
        tokio::time::sleep(Duration::from_millis(200)).await;

        let started = Instant::now();
        let _ = server.stop.take().map(|s| s.send(()));
        let served = tokio::time::timeout(Duration::from_secs(5), &mut server.task).await;
        let took = started.elapsed();
        assert!(matches!(served, Ok(Ok(Ok(())))), "{served:?}");
        // Grace 500 ms, then the drop (bounded, however stuck the clients).
        assert!(took >= Duration::from_millis(400) && took < Duration::from_secs(3), "{took:?}");
        assert!(server.dropped.load(Ordering::SeqCst), "the unread response was dropped");
        assert!(TcpStream::connect(server.addr).await.is_err(), "listener closed");
        for s in [&mut partial_head, &mut partial_body, &mut hanging] {
            let (_, closed) = read_to_close(s, Duration::from_secs(2)).await;
            assert!(closed.is_some());
        }
    }
}
