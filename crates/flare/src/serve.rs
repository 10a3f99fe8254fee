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

#[derive(Debug, clap::Args)]
pub(crate) struct RunArgs {
    /// Directory of a runtime core. Without one, the embedded simulated core is served.
    core: Option<PathBuf>,
    /// Serve through the simulated executor (no GPU): the embedded core, or CORE's frontend.
    #[arg(long)]
    sim: bool,
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
    /// Caps every request's output tokens.
    #[arg(long)]
    max_output_tokens: Option<u32>,
    /// GPU memory kept free for other processes, in GiB (applied by the CUDA executor).
    #[arg(long, default_value_t = 0.0)]
    gpu_reserve_gib: f64,
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
    /// Seconds running requests may take to finish after SIGINT/SIGTERM before cancellation.
    #[arg(long, default_value_t = 10)]
    shutdown_grace_secs: u64,
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

fn init_logging(format: LogFormat) {
    use std::io::IsTerminal;
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::stderr().is_terminal());
    // Timestamps are RFC 3339 in UTC (GMT).
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

fn progress(started: Instant, what: &str) {
    tracing::info!(elapsed_ms = started.elapsed().as_millis() as u64, "startup: {what}");
}

pub(crate) fn run(args: RunArgs) -> Result<(), CliError> {
    init_logging(args.log_format);
    let started = Instant::now();
    if !(args.gpu_reserve_gib.is_finite() && args.gpu_reserve_gib >= 0.0) {
        return Err(CliError::Startup("--gpu-reserve-gib must be a non-negative number".into()));
    }
    let addr: SocketAddr = format!("{}:{}", args.host, args.port)
        .parse()
        .map_err(|e| CliError::Startup(format!("invalid --host/--port: {e}")))?;
    // The embedded core lives in a temporary directory for the life of the server.
    let mut _sim_dir = None;
    let core_dir = match &args.core {
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
            _sim_dir = Some(dir);
            path
        }
    };
    let simulate = args.sim || args.core.is_none();
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
    let options = EngineOptions {
        max_concurrency: args.max_concurrency.unwrap_or(manifest.capacities.request_slots),
        queue_limit: args.queue_limit,
        max_output_tokens: args.max_output_tokens,
        prep_threads: args.prep_threads,
        prep_queue: args.queue_limit.max(1),
        device_fed_decode: !args.host_fed_decode,
    };
    let engine = if simulate {
        progress(started, "starting the model thread (simulated executor)");
        let (scheme, caps) = (manifest.cache_scheme.clone(), manifest.capacities.clone());
        Engine::start(&manifest, frontend, options, move || {
            // Completions one step late, like a device with two steps in flight.
            Ok(SimulatedExecutor::with_completion_lag(&scheme, &caps, 1)
                .with_model(SimModel::Induction)
                .with_device_fed_decode())
        })
    } else {
        progress(started, "starting the model thread: loading the core onto the GPU");
        let reserve_bytes = (args.gpu_reserve_gib * (1u64 << 30) as f64) as u64;
        start_cuda(&manifest, core, frontend, options, reserve_bytes, started)
    }
    .map_err(|e| CliError::Startup(e.to_string()))?;
    let rt = crate::runtime()?;
    rt.block_on(async move {
        let listener =
            tokio::net::TcpListener::bind(addr).await.map_err(|e| CliError::Startup(format!("bind {addr}: {e}")))?;
        let bound = listener.local_addr().map_err(|e| CliError::Startup(e.to_string()))?;
        let f = engine.frontend();
        tracing::info!(
            model = %f.model_name,
            context = f.context_limit,
            concurrency = engine.max_concurrency(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "ready: listening on http://{bound}"
        );
        let app = helios_http::router(engine.clone(), helios_http::HttpOptions::default());
        let grace = Duration::from_secs(args.shutdown_grace_secs);
        let draining = engine.clone();
        let shutdown = async move {
            wait_for_signal().await;
            tracing::info!("shutdown: admission stopped, draining running requests");
            tokio::spawn(async move { draining.shutdown(grace).await });
        };
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
            .map_err(|e| CliError::Startup(format!("server: {e}")))?;
        engine.shutdown(grace).await;
        tracing::info!("shutdown: complete");
        Ok(())
    })
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

async fn wait_for_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}
