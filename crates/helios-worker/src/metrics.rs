//! Prometheus text-format metrics, written by the model thread and read by `/metrics`.

use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use helios_scheduler::Occupancy;

use crate::output::FinishCause;

const BUCKETS: [f64; 16] =
    [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// A cumulative histogram with fixed buckets (seconds).
#[derive(Debug, Default)]
pub struct Histogram {
    inner: Mutex<HistogramData>,
}

#[derive(Debug, Default, Clone)]
struct HistogramData {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    pub fn observe(&self, seconds: f64) {
        if let Ok(mut h) = self.inner.lock() {
            for (i, &b) in BUCKETS.iter().enumerate() {
                if seconds <= b {
                    h.counts[i] += 1;
                }
            }
            h.count += 1;
            h.sum += seconds;
        }
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        let h = self.inner.lock().map(|h| h.clone()).unwrap_or_default();
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (i, b) in BUCKETS.iter().enumerate() {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {}", h.counts[i]);
        }
        let _ =
            writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}", h.count, h.sum, h.count);
    }
}

const CAUSES: [FinishCause; 5] =
    [FinishCause::Eos, FinishCause::Length, FinishCause::Stop, FinishCause::Cancelled, FinishCause::PoolExhausted];

/// Worker metrics.
#[derive(Debug, Default)]
pub struct Metrics {
    pub admitted: AtomicU64,
    finished: [AtomicU64; 5],
    pub failed: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub prefix_hit_tokens: AtomicU64,
    pub steps: AtomicU64,
    pub preemptions: AtomicU64,
    occupancy: Mutex<Occupancy>,
    pub ttft: Histogram,
    pub itl: Histogram,
    /// Time inside the executor per step (submit + poll): model time, as opposed to server time.
    pub executor: Histogram,
    /// Device memory growth since readiness (bytes), when the executor owns a device and it has
    /// been sampled (`device_memory_sampled`).
    pub device_memory_growth: std::sync::atomic::AtomicI64,
    pub device_memory_sampled: std::sync::atomic::AtomicBool,
}

impl Metrics {
    pub fn finished(&self, cause: FinishCause) {
        if let Some(i) = CAUSES.iter().position(|&c| c == cause) {
            self.finished[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn set_occupancy(&self, o: Occupancy) {
        if let Ok(mut g) = self.occupancy.lock() {
            *g = o;
        }
    }

    pub fn occupancy(&self) -> Occupancy {
        self.occupancy.lock().map(|o| *o).unwrap_or_default()
    }

    /// Finished (any cause) plus failed requests.
    pub fn retired(&self) -> u64 {
        self.finished.iter().map(|c| c.load(Ordering::Relaxed)).sum::<u64>() + self.failed.load(Ordering::Relaxed)
    }

    /// The Prometheus exposition text.
    pub fn render(&self, ready: bool) -> String {
        let mut out = String::new();
        let o = self.occupancy();
        let gauge = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        let counter = |out: &mut String, name: &str, help: &str, v: &AtomicU64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}", v.load(Ordering::Relaxed));
        };
        gauge(&mut out, "flare_ready", "1 when the worker serves requests.", u64::from(ready));
        gauge(&mut out, "flare_queue_depth", "Requests waiting for admission.", o.waiting as u64);
        gauge(&mut out, "flare_running_requests", "Requests holding a slot.", o.running as u64);
        gauge(&mut out, "flare_pages_total", "KV pages in the pool.", u64::from(o.pages_total));
        gauge(&mut out, "flare_pages_free", "Free KV pages.", o.pages_free as u64);
        gauge(
            &mut out,
            "flare_pages_used",
            "KV pages held by running requests or in-flight captures.",
            o.pages_request as u64,
        );
        gauge(&mut out, "flare_pages_cached", "KV pages owned by cached checkpoints.", o.pages_cached as u64);
        gauge(&mut out, "flare_snapshot_rows_total", "Snapshot rows in the pool.", u64::from(o.snapshot_rows_total));
        gauge(
            &mut out,
            "flare_snapshot_rows_used",
            "Snapshot rows held by checkpoints or captures.",
            o.snapshot_rows_used as u64,
        );
        gauge(
            &mut out,
            "flare_snapshot_rows_pinned",
            "Checkpoints pinned by running requests or publications.",
            o.checkpoints_pinned as u64,
        );
        gauge(&mut out, "flare_checkpoints", "Cached checkpoints.", o.checkpoints as u64);
        counter(&mut out, "flare_requests_admitted_total", "Requests the scheduler accepted.", &self.admitted);
        let _ = writeln!(
            out,
            "# HELP flare_requests_finished_total Requests retired, by cause.\n# TYPE flare_requests_finished_total counter"
        );
        for (i, c) in CAUSES.iter().enumerate() {
            let _ = writeln!(
                out,
                "flare_requests_finished_total{{reason=\"{}\"}} {}",
                c.as_str(),
                self.finished[i].load(Ordering::Relaxed)
            );
        }
        let _ =
            writeln!(out, "flare_requests_finished_total{{reason=\"failed\"}} {}", self.failed.load(Ordering::Relaxed));
        counter(&mut out, "flare_prompt_tokens_total", "Prompt tokens of admitted requests.", &self.prompt_tokens);
        counter(&mut out, "flare_generation_tokens_total", "Tokens sampled.", &self.generated_tokens);
        counter(
            &mut out,
            "flare_prefix_hit_tokens_total",
            "Prompt tokens restored from checkpoints.",
            &self.prefix_hit_tokens,
        );
        counter(&mut out, "flare_steps_total", "Steps submitted to the executor.", &self.steps);
        counter(&mut out, "flare_preemptions_total", "Decoder preemptions.", &self.preemptions);
        self.ttft.render("flare_time_to_first_token_seconds", "Submission to first sampled token.", &mut out);
        self.itl.render(
            "flare_inter_token_latency_seconds",
            "Time between consecutive sampled tokens of a request.",
            &mut out,
        );
        self.executor.render("flare_executor_step_seconds", "Executor time per step (submit and poll).", &mut out);
        if self.device_memory_sampled.load(Ordering::Relaxed) {
            let _ = writeln!(
                out,
                "# HELP flare_device_memory_growth_bytes Device memory in use minus at readiness (0: nothing \
                 allocated since).\n# TYPE flare_device_memory_growth_bytes gauge\nflare_device_memory_growth_bytes {}",
                self.device_memory_growth.load(Ordering::Relaxed)
            );
        }
        out
    }
}
