//! Prometheus text-format metrics, written by the model thread and the HTTP layer and read by
//! `/metrics`.
//!
//! Two groups of families:
//! - the original unlabeled ones (`flare_queue_depth`, `flare_requests_finished_total`, …),
//!   kept as they are: `flare load` and dashboards read them;
//! - vLLM-style families (running/waiting requests, KV-cache usage, prefix-cache queries and
//!   hits, per-phase latency histograms, failures), each labeled with `model_name`, so a
//!   dashboard built for vLLM maps onto them by name (`vllm:x` → `flare_x`).
//!
//! Label values come from a bounded set: the served model's name, static error codes and
//! HTTP statuses, and static finish reasons; nothing a client sends becomes a label.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use helios_offload::TierStats;
use helios_scheduler::Occupancy;

use crate::output::{CellTimes, FinishCause};

const BUCKETS: [f64; 16] =
    [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// Buckets of whole-request and per-phase latencies (seconds): requests run for milliseconds
/// to minutes, so the range reaches further than the per-token buckets.
const REQUEST_BUCKETS: [f64; 20] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0,
];

/// A cumulative histogram with fixed buckets (seconds).
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    inner: Mutex<HistogramData>,
}

#[derive(Debug, Default, Clone)]
struct HistogramData {
    /// Cumulative: `counts[i]` holds the observations `<= bounds[i]`.
    counts: Vec<u64>,
    count: u64,
    sum: f64,
}

impl Default for Histogram {
    /// The per-token buckets (0.5 ms to 60 s).
    fn default() -> Self {
        Histogram::with_buckets(&BUCKETS)
    }
}

impl Histogram {
    /// A histogram over `bounds` (ascending upper bounds, seconds; `+Inf` is implied).
    pub fn with_buckets(bounds: &'static [f64]) -> Self {
        Histogram { bounds, inner: Mutex::new(HistogramData { counts: vec![0; bounds.len()], count: 0, sum: 0.0 }) }
    }

    /// The request-latency buckets (5 ms to 480 s).
    pub fn for_requests() -> Self {
        Histogram::with_buckets(&REQUEST_BUCKETS)
    }

    pub fn observe(&self, seconds: f64) {
        if let Ok(mut h) = self.inner.lock() {
            for (i, &b) in self.bounds.iter().enumerate() {
                if seconds <= b {
                    h.counts[i] += 1;
                }
            }
            h.count += 1;
            h.sum += seconds;
        }
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.inner.lock().map(|h| h.count).unwrap_or_default()
    }

    /// Writes the family; `labels` is empty or `name="value",` pairs, each with its comma.
    fn render(&self, name: &str, help: &str, labels: &str, out: &mut String) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        self.render_samples(name, labels, out);
    }

    /// The family's samples without its HELP/TYPE header (several label sets, one family).
    fn render_samples(&self, name: &str, labels: &str, out: &mut String) {
        let h = self.inner.lock().map(|h| h.clone()).unwrap_or_default();
        for (i, b) in self.bounds.iter().enumerate() {
            let _ = writeln!(out, "{name}_bucket{{{labels}le=\"{b}\"}} {}", h.counts.get(i).copied().unwrap_or(0));
        }
        // `name_sum{a="b"}`, or plain `name_sum` without labels (as before labels existed).
        let bare = labels.trim_end_matches(',');
        let bare = if bare.is_empty() { String::new() } else { format!("{{{bare}}}") };
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels}le=\"+Inf\"}} {}\n{name}_sum{bare} {}\n{name}_count{bare} {}",
            h.count, h.sum, h.count
        );
    }
}

const CAUSES: [FinishCause; 5] =
    [FinishCause::Eos, FinishCause::Length, FinishCause::Stop, FinishCause::Cancelled, FinishCause::PoolExhausted];

/// Worker metrics.
///
/// Units: `flare_requests_*` families of the first group count scheduler requests (one per
/// choice); `flare_request_failures_total` and `flare_e2e_request_latency_seconds` count HTTP
/// requests (whatever their `n`); `flare_request_success_total` counts finished choices, as
/// vLLM counts each of its `n` child requests.
#[derive(Debug, Default)]
pub struct Metrics {
    pub admitted: AtomicU64,
    finished: [AtomicU64; 5],
    pub failed: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub prefix_hit_tokens: AtomicU64,
    /// Prompt tokens of requests that looked up the prefix cache (at their first admission):
    /// the denominator of the prefix-cache hit rate, `prefix_hit_tokens` being its numerator.
    pub prefix_cache_queries: AtomicU64,
    pub steps: AtomicU64,
    pub preemptions: AtomicU64,
    /// Speculation, as the scheduler counts it: decode rows of every decoding step, speculative
    /// rounds, proposals verified and accepted.
    pub decode_rows: AtomicU64,
    pub speculative_rounds: AtomicU64,
    pub proposed_tokens: AtomicU64,
    pub accepted_tokens: AtomicU64,
    occupancy: Mutex<Occupancy>,
    pub ttft: Histogram,
    pub itl: Histogram,
    /// Time inside the executor per step (submit + poll): model time, as opposed to server time.
    pub executor: Histogram,
    /// Time the model thread waited for its oldest step in flight. With two steps in flight,
    /// waits near a step's graph time mean the device sets the pace; short ones with a slower
    /// step period mean the host or the gaps between graphs do.
    pub executor_wait: Histogram,
    /// Request arrival at the HTTP layer to its last byte (or failure), for requests whose
    /// choices were all admitted (see [`Metrics::observe_e2e`]).
    e2e: RequestHistogram,
    /// Submission to the model thread until the scheduler admitted the request.
    queue: RequestHistogram,
    /// Admission to the first sampled token.
    prefill: RequestHistogram,
    /// First sampled token to the end of the request.
    decode: RequestHistogram,
    /// Failed HTTP requests by (HTTP status, error code).
    failures: Mutex<BTreeMap<(u16, &'static str), u64>>,
    /// Finished choices by (OpenAI) finish reason.
    successes: Mutex<BTreeMap<&'static str, u64>>,
    model_name: OnceLock<String>,
    /// Device memory growth since readiness (bytes), when the executor owns a device and it has
    /// been sampled (`device_memory_sampled`).
    pub device_memory_growth: std::sync::atomic::AtomicI64,
    pub device_memory_sampled: std::sync::atomic::AtomicBool,
    /// The host tier's state, when the worker has one (published with the occupancy).
    host_tier: Mutex<Option<TierMetrics>>,
    /// The disk tier's state, likewise.
    disk_tier: Mutex<Option<TierMetrics>>,
    /// Submission of a restore's copy to the publication of its checkpoint.
    pub host_restore: Histogram,
    /// Start of a disk fetch to its bytes in the host tier (or its failure).
    pub disk_fetch: Histogram,
}

/// One cache tier's gauges and counters, with the scheduler's restore counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierMetrics {
    pub tier: TierStats,
    /// Transfers started (one per prefix, however many requests join it).
    pub restores: u64,
    /// Requests that joined a transfer already running.
    pub restore_joins: u64,
    /// Hits not restored: the GPU storage they needed was not available.
    pub restore_skips: u64,
    /// Restores that failed (their prefix recomputed instead).
    pub restore_failures: u64,
    /// Writes into the tier that failed (disk).
    pub write_failures: u64,
}

/// A [`Histogram`] with the request-latency buckets by default.
#[derive(Debug)]
struct RequestHistogram(Histogram);

impl Default for RequestHistogram {
    fn default() -> Self {
        RequestHistogram(Histogram::for_requests())
    }
}

impl Metrics {
    pub fn finished(&self, cause: FinishCause) {
        if let Some(i) = CAUSES.iter().position(|&c| c == cause) {
            self.finished[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Names the served model: the `model_name` label of the vLLM-style families. The first
    /// name set stays.
    pub fn set_model_name(&self, name: &str) {
        let _ = self.model_name.set(name.to_owned());
    }

    pub fn set_occupancy(&self, o: Occupancy) {
        if let Ok(mut g) = self.occupancy.lock() {
            *g = o;
        }
    }

    pub fn occupancy(&self) -> Occupancy {
        self.occupancy.lock().map(|o| *o).unwrap_or_default()
    }

    pub fn set_host_tier(&self, t: TierMetrics) {
        if let Ok(mut g) = self.host_tier.lock() {
            *g = Some(t);
        }
    }

    pub fn set_disk_tier(&self, t: TierMetrics) {
        if let Ok(mut g) = self.disk_tier.lock() {
            *g = Some(t);
        }
    }

    /// The disk tier's last published state; `None` without a disk tier.
    pub fn disk_tier(&self) -> Option<TierMetrics> {
        self.disk_tier.lock().ok().and_then(|t| *t)
    }

    /// The host tier's last published state; `None` without a host tier.
    pub fn host_tier(&self) -> Option<TierMetrics> {
        self.host_tier.lock().ok().and_then(|t| *t)
    }

    /// Finished (any cause) plus failed requests.
    pub fn retired(&self) -> u64 {
        self.finished.iter().map(|c| c.load(Ordering::Relaxed)).sum::<u64>() + self.failed.load(Ordering::Relaxed)
    }

    /// Accounts a scheduler request as it retires, whatever its outcome: the phases it went
    /// through (queue, prefill, decode; a phase it never reached is not observed) and, when it
    /// was admitted, its prefix-cache lookup. Observed at the end, as vLLM does, so a phase
    /// that is still running is not yet in the histograms.
    /// Its prefix-cache hits are `prefix_hit_tokens`, counted by the caller for every request.
    pub(crate) fn observe_retired(&self, submitted: Instant, times: CellTimes, prompt_tokens: u32) {
        let now = Instant::now();
        let Some(admitted) = times.admitted else { return };
        self.prefix_cache_queries.fetch_add(u64::from(prompt_tokens), Ordering::Relaxed);
        self.queue.0.observe(admitted.saturating_duration_since(submitted).as_secs_f64());
        if let Some(first) = times.first_token {
            self.prefill.0.observe(first.saturating_duration_since(admitted).as_secs_f64());
            self.decode.0.observe(now.saturating_duration_since(first).as_secs_f64());
        }
    }

    /// Observes one HTTP request's end-to-end latency (arrival to its last byte or failure).
    /// The HTTP layer calls it for requests whose choices were all admitted, whatever the
    /// outcome; requests refused before admission are counted as failures instead.
    pub fn observe_e2e(&self, seconds: f64) {
        self.e2e.0.observe(seconds);
    }

    /// Counts one failed HTTP request: answered with an error status, or ended by an error
    /// event after its headers (then `status` is the status the error maps to). `code` is the
    /// error's typed code.
    pub fn count_failure(&self, status: u16, code: &'static str) {
        if let Ok(mut m) = self.failures.lock() {
            *m.entry((status, code)).or_default() += 1;
        }
    }

    /// Failed HTTP requests counted so far.
    pub fn failures(&self) -> u64 {
        self.failures.lock().map(|m| m.values().sum()).unwrap_or_default()
    }

    /// Counts one choice that finished with `reason` (an OpenAI finish reason).
    pub fn count_success(&self, reason: &'static str) {
        if let Ok(mut m) = self.successes.lock() {
            *m.entry(reason).or_default() += 1;
        }
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
        self.render_speculation(&mut out);
        self.ttft.render("flare_time_to_first_token_seconds", "Submission to first sampled token.", "", &mut out);
        self.itl.render(
            "flare_inter_token_latency_seconds",
            "Time between consecutive sampled tokens of a request.",
            "",
            &mut out,
        );
        self.executor.render("flare_executor_step_seconds", "Executor time per step (submit and poll).", "", &mut out);
        let wait = "Time the model thread waited for its oldest step in flight.";
        self.executor_wait.render("flare_executor_wait_seconds", wait, "", &mut out);
        if self.device_memory_sampled.load(Ordering::Relaxed) {
            let _ = writeln!(
                out,
                "# HELP flare_device_memory_growth_bytes Device memory in use minus at readiness (0: nothing \
                 allocated since).\n# TYPE flare_device_memory_growth_bytes gauge\nflare_device_memory_growth_bytes {}",
                self.device_memory_growth.load(Ordering::Relaxed)
            );
        }
        self.render_tiers(&mut out);
        self.render_model_families(&o, &mut out);
        out
    }

    /// Speculative decoding: rounds, proposals verified and accepted, the acceptance rate and
    /// the tokens each decoding step produced (all zero where the core has no speculative
    /// programs or `--speculative-depth 0`).
    fn render_speculation(&self, out: &mut String) {
        let load = |v: &AtomicU64| v.load(Ordering::Relaxed);
        let (rounds, rows) = (load(&self.speculative_rounds), load(&self.decode_rows));
        let (proposed, accepted) = (load(&self.proposed_tokens), load(&self.accepted_tokens));
        for (name, help, v) in [
            ("flare_speculative_rounds_total", "Decode steps that verified copy proposals.", rounds),
            ("flare_speculative_proposed_tokens_total", "Copy proposals verified.", proposed),
            ("flare_speculative_accepted_tokens_total", "Copy proposals accepted.", accepted),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        }
        let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        let _ = writeln!(
            out,
            "# HELP flare_speculative_acceptance_ratio Accepted over proposed tokens.\n\
             # TYPE flare_speculative_acceptance_ratio gauge\nflare_speculative_acceptance_ratio {}",
            ratio(accepted, proposed)
        );
        // Every decode row samples one token, plus the proposals its round accepted.
        let _ = writeln!(
            out,
            "# HELP flare_decode_tokens_per_row Tokens a decode row produced per step (1 without \
             speculation).\n# TYPE flare_decode_tokens_per_row gauge\nflare_decode_tokens_per_row {}",
            if rows == 0 { 0.0 } else { 1.0 + ratio(accepted, rows) }
        );
    }

    /// Families of the cache tiers below the GPU, one sample per tier (absent without tiers).
    fn render_tiers(&self, out: &mut String) {
        let tiers: Vec<(&str, TierMetrics, &Histogram)> =
            [("host", self.host_tier(), &self.host_restore), ("disk", self.disk_tier(), &self.disk_fetch)]
                .into_iter()
                .filter_map(|(name, t, h)| t.map(|t| (name, t, h)))
                .collect();
        if tiers.is_empty() {
            return;
        }
        type Field = fn(&TierMetrics) -> u64;
        let families: [(&str, &str, &str, Field); 12] = [
            ("gauge", "flare_cache_tier_capacity_bytes", "Bytes the tier may hold.", |t| t.tier.capacity_bytes),
            ("gauge", "flare_cache_tier_resident_bytes", "Bytes the tier holds.", |t| t.tier.resident_bytes),
            ("gauge", "flare_cache_tier_checkpoints", "Checkpoints the tier holds.", |t| t.tier.entries),
            ("counter", "flare_cache_tier_demotions_total", "Checkpoints copied into the tier.", |t| t.tier.demotions),
            (
                "counter",
                "flare_cache_tier_demoted_bytes_total",
                "Bytes copied into the tier (pages it already held excluded).",
                |t| t.tier.demoted_bytes,
            ),
            ("counter", "flare_cache_tier_demotion_skips_total", "Checkpoints the tier had no room for.", |t| {
                t.tier.demotion_skips
            }),
            ("counter", "flare_cache_tier_evictions_total", "Checkpoints dropped from the tier for room.", |t| {
                t.tier.evictions
            }),
            ("counter", "flare_cache_tier_restores_total", "Restores started from the tier.", |t| t.restores),
            (
                "counter",
                "flare_cache_tier_restore_joins_total",
                "Requests that joined a restore already running.",
                |t| t.restore_joins,
            ),
            (
                "counter",
                "flare_cache_tier_restore_skips_total",
                "Hits not restored for lack of room in the tier above.",
                |t| t.restore_skips,
            ),
            (
                "counter",
                "flare_cache_tier_restore_failures_total",
                "Restores that failed (I/O error, checksum); their prefix was recomputed.",
                |t| t.restore_failures,
            ),
            ("counter", "flare_cache_tier_write_failures_total", "Writes into the tier that failed.", |t| {
                t.write_failures
            }),
        ];
        for (kind, name, help, field) in families {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (tier, t, _) in &tiers {
                let _ = writeln!(out, "{name}{{tier=\"{tier}\"}} {}", field(t));
            }
        }
        let _ = writeln!(
            out,
            "# HELP flare_cache_tier_restore_seconds Time to bring a checkpoint up one tier: host to GPU (copy \
             submitted to publication), disk to host (fetch start to its bytes in host memory).\n\
             # TYPE flare_cache_tier_restore_seconds histogram"
        );
        for (tier, _, h) in &tiers {
            h.render_samples("flare_cache_tier_restore_seconds", &format!("tier=\"{tier}\","), out);
        }
    }

    /// The vLLM-style families, labeled with `model_name`.
    fn render_model_families(&self, o: &Occupancy, out: &mut String) {
        let model = label_value(self.model_name.get().map_or("", String::as_str));
        let labels = format!("model_name=\"{model}\",");
        let one = |out: &mut String, kind: &str, name: &str, help: &str, v: &dyn std::fmt::Display| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{model_name=\"{model}\"}} {v}");
        };
        one(
            out,
            "gauge",
            "flare_num_requests_running",
            "Requests holding a slot (being prefilled or decoded).",
            &o.running,
        );
        one(out, "gauge", "flare_num_requests_waiting", "Requests waiting for admission.", &o.waiting);
        one(
            out,
            "gauge",
            "flare_kv_cache_usage_perc",
            "Fraction of KV pages held by running requests or in-flight captures (0 to 1); pages only cached \
             checkpoints own are evictable and count as free.",
            &kv_cache_usage(o),
        );
        one(
            out,
            "counter",
            "flare_prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache (at each request's first admission).",
            &self.prefix_cache_queries.load(Ordering::Relaxed),
        );
        one(
            out,
            "counter",
            "flare_prefix_cache_hits_total",
            "Prompt tokens restored from the prefix cache.",
            &self.prefix_hit_tokens.load(Ordering::Relaxed),
        );
        let histograms: [(&RequestHistogram, &str, &str); 4] = [
            (
                &self.e2e,
                "flare_e2e_request_latency_seconds",
                "HTTP request arrival to its last byte or failure, for requests whose choices were all admitted.",
            ),
            (&self.queue, "flare_request_queue_time_seconds", "Submission to scheduler admission, per choice."),
            (&self.prefill, "flare_request_prefill_time_seconds", "Admission to the first sampled token, per choice."),
            (
                &self.decode,
                "flare_request_decode_time_seconds",
                "First sampled token to the end of the choice, per choice.",
            ),
        ];
        for (h, name, help) in histograms {
            h.0.render(name, help, &labels, out);
        }
        let _ = writeln!(
            out,
            "# HELP flare_request_success_total Choices that finished, by finish reason.\n\
             # TYPE flare_request_success_total counter"
        );
        if let Ok(m) = self.successes.lock() {
            for (reason, n) in m.iter() {
                let _ = writeln!(out, "flare_request_success_total{{{labels}finished_reason=\"{reason}\"}} {n}");
            }
        }
        let _ = writeln!(
            out,
            "# HELP flare_request_failures_total HTTP requests that failed (an error answer, or an error event \
             after the headers), by the error's status and code.\n# TYPE flare_request_failures_total counter"
        );
        if let Ok(m) = self.failures.lock() {
            for ((status, code), n) in m.iter() {
                let _ =
                    writeln!(out, "flare_request_failures_total{{{labels}status=\"{status}\",code=\"{code}\"}} {n}");
            }
        }
    }
}

/// Pages held by requests over the pool (0 for an empty pool).
fn kv_cache_usage(o: &Occupancy) -> f64 {
    if o.pages_total == 0 { 0.0 } else { (o.pages_request as f64 / f64::from(o.pages_total)).clamp(0.0, 1.0) }
}

/// `v` escaped as a Prometheus label value (backslash, quote, newline).
fn label_value(v: &str) -> std::borrow::Cow<'_, str> {
    if !v.contains(['\\', '"', '\n']) {
        return std::borrow::Cow::Borrowed(v);
    }
    std::borrow::Cow::Owned(v.replace('\\', r"\\").replace('"', "\\\"").replace('\n', r"\n"))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn sample(text: &str, line_start: &str) -> Option<f64> {
        text.lines().find(|l| l.starts_with(line_start)).and_then(|l| l.rsplit(' ').next()?.parse().ok())
    }

    #[test]
    fn unlabeled_histograms_keep_their_format() {
        let m = Metrics::default();
        m.ttft.observe(0.003);
        let text = m.render(true);
        assert!(text.contains("\nflare_time_to_first_token_seconds_bucket{le=\"0.005\"} 1\n"), "{text}");
        assert!(text.contains("\nflare_time_to_first_token_seconds_sum 0.003\n"), "{text}");
        assert!(text.contains("\nflare_time_to_first_token_seconds_count 1\n"), "{text}");
        assert!(!text.contains("{}"), "{text}");
    }

    #[test]
    fn model_families_carry_the_model_name_and_usage_is_a_fraction() {
        let m = Metrics::default();
        m.set_model_name("my \"model\"");
        m.set_occupancy(Occupancy { running: 2, waiting: 3, pages_total: 8, pages_request: 2, ..Default::default() });
        let text = m.render(true);
        let l = r#"{model_name="my \"model\""}"#;
        assert_eq!(sample(&text, &format!("flare_num_requests_running{l}")), Some(2.0), "{text}");
        assert_eq!(sample(&text, &format!("flare_num_requests_waiting{l}")), Some(3.0));
        assert_eq!(sample(&text, &format!("flare_kv_cache_usage_perc{l}")), Some(0.25));
        // The original families are unchanged.
        assert_eq!(sample(&text, "flare_running_requests "), Some(2.0));
        assert_eq!(sample(&text, "flare_queue_depth "), Some(3.0));
        m.set_occupancy(Occupancy::default());
        assert_eq!(sample(&m.render(true), &format!("flare_kv_cache_usage_perc{l}")), Some(0.0));
    }

    #[test]
    fn retired_requests_feed_phases_and_prefix_queries() {
        let m = Metrics::default();
        m.set_model_name("m");
        let t0 = Instant::now();
        let admitted = t0 + Duration::from_millis(3);
        let first = admitted + Duration::from_millis(2);
        m.observe_retired(t0, CellTimes { admitted: Some(admitted), first_token: Some(first) }, 100);
        m.prefix_hit_tokens.fetch_add(60, Ordering::Relaxed);
        // Never admitted: no lookup, no phase.
        m.observe_retired(t0, CellTimes::default(), 50);
        // Admitted, failed before its first token: queue time only.
        m.observe_retired(t0, CellTimes { admitted: Some(admitted), first_token: None }, 10);
        assert_eq!((m.queue.0.count(), m.prefill.0.count(), m.decode.0.count()), (2, 1, 1));
        let text = m.render(true);
        assert_eq!(sample(&text, r#"flare_prefix_cache_queries_total{model_name="m"}"#), Some(110.0));
        assert_eq!(sample(&text, r#"flare_prefix_cache_hits_total{model_name="m"}"#), Some(60.0));
        assert_eq!(sample(&text, r#"flare_request_queue_time_seconds_count{model_name="m"}"#), Some(2.0));
        assert_eq!(
            sample(&text, r#"flare_request_queue_time_seconds_bucket{model_name="m",le="0.005"}"#),
            Some(2.0),
            "{text}"
        );
        assert_eq!(sample(&text, r#"flare_request_queue_time_seconds_bucket{model_name="m",le="+Inf"}"#), Some(2.0));
    }

    #[test]
    fn failures_and_successes_are_counted_by_bounded_labels() {
        let m = Metrics::default();
        m.set_model_name("m");
        m.count_failure(400, "invalid_parameter");
        m.count_failure(400, "invalid_parameter");
        m.count_failure(503, "queue_full");
        m.count_success("stop");
        m.observe_e2e(0.2);
        assert_eq!(m.failures(), 3);
        let text = m.render(false);
        assert_eq!(
            sample(&text, r#"flare_request_failures_total{model_name="m",status="400",code="invalid_parameter"}"#),
            Some(2.0)
        );
        assert_eq!(
            sample(&text, r#"flare_request_failures_total{model_name="m",status="503",code="queue_full"}"#),
            Some(1.0)
        );
        assert_eq!(sample(&text, r#"flare_request_success_total{model_name="m",finished_reason="stop"}"#), Some(1.0));
        assert_eq!(sample(&text, r#"flare_e2e_request_latency_seconds_count{model_name="m"}"#), Some(1.0));
        assert_eq!(sample(&text, r#"flare_e2e_request_latency_seconds_bucket{model_name="m",le="0.1"}"#), Some(0.0));
        assert_eq!(sample(&text, r#"flare_e2e_request_latency_seconds_bucket{model_name="m",le="0.25"}"#), Some(1.0));
        // Every sample line parses as `name{labels} value`.
        for l in text.lines().filter(|l| !l.starts_with('#')) {
            let (_, v) = l.rsplit_once(' ').expect("a value");
            assert!(v.parse::<f64>().is_ok(), "{l}");
        }
    }
}
