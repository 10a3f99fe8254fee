//! Human-readable summary of a validated core, printed by `flare check`.

use std::collections::BTreeMap;
use std::fmt;

use crate::model::{GraphKind, Manifest, ReasoningParser, SamplingParameter, ToolParser};

/// Display adapter over a manifest.
#[derive(Debug)]
pub struct Summary<'a>(pub &'a Manifest);

fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 { format!("{n} B") } else { format!("{value:.2} {}", UNITS[unit]) }
}

fn param(p: &SamplingParameter) -> String {
    match p.range {
        Some((lo, hi)) => format!("{} in [{lo}, {hi}]", p.default),
        None => format!("{} (fixed)", p.default),
    }
}

impl fmt::Display for Summary<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = self.0;
        let id = &m.identity;
        writeln!(f, "identity")?;
        writeln!(f, "  execution ABI      {}", id.abi_version)?;
        writeln!(f, "  model fingerprint  {}", id.model_fingerprint)?;
        writeln!(
            f,
            "  prepared on        {} (sm_{}{}, {} SMs, {})",
            id.device.name,
            id.device.compute_capability.0,
            id.device.compute_capability.1,
            id.device.sm_count,
            bytes(id.device.total_memory_bytes)
        )?;
        writeln!(f, "  CUDA driver/toolkit {} / {}", id.cuda_driver_version, id.cuda_toolkit_version)?;
        if !id.producer.is_empty() {
            writeln!(f, "  producer           {}", id.producer)?;
        }
        writeln!(
            f,
            "arena  base {:#x}, {} (alignment {})",
            m.arena.base_address,
            bytes(m.arena.byte_size),
            m.arena.alignment
        )?;

        writeln!(f, "buffers  {} in all", m.buffers.len())?;
        for (role, (count, total)) in m.bytes_by_role() {
            writeln!(f, "  {:<20} {count:>5}  {}", role.name(), bytes(total))?;
        }

        let mut by_kind: BTreeMap<GraphKind, Vec<String>> = BTreeMap::new();
        for g in &m.graphs {
            let c = g.capacity;
            let label = match g.kind {
                GraphKind::Prefill => format!("T={}", c.token_capacity),
                GraphKind::Decode if c.proposal_depth > 0 => format!("B={} D={}", c.request_count, c.proposal_depth),
                GraphKind::Decode | GraphKind::ResumeSampling => format!("B={}", c.request_count),
                GraphKind::StateMaintenance => {
                    format!("{:?} B={}", g.maintenance_op.unwrap_or(crate::MaintenanceOp::Reset), c.request_count)
                }
                GraphKind::Vision => format!("patches={}", c.patch_capacity),
                GraphKind::TuningProducer => g.name.clone(),
                GraphKind::Speculative => {
                    format!("B={} D={} P={}", c.request_count, c.proposal_depth, c.token_capacity)
                }
            };
            let programmatic = g.programmatic_edges().count();
            let shape = match programmatic {
                0 => format!("{} nodes", g.nodes.len()),
                n => format!("{} nodes, {n} programmatic edges", g.nodes.len()),
            };
            by_kind.entry(g.kind).or_default().push(format!("{label} ({shape})"));
        }
        writeln!(f, "graphs  {} in all", m.graphs.len())?;
        for (kind, labels) in by_kind {
            writeln!(f, "  {:<18} {}", kind.name(), labels.join(", "))?;
        }

        let param_slots: usize = m.kernels.iter().map(|k| k.params.len()).sum();
        writeln!(f, "kernel images  {} ({param_slots} parameter slots)", m.kernels.len())?;
        for k in m.kernels.iter().take(8) {
            writeln!(f, "  {:>4}  {:?}  {}  {}", k.id.0, k.format, &k.sha256[..12], k.function_name)?;
        }
        if m.kernels.len() > 8 {
            writeln!(f, "  ... {} more", m.kernels.len() - 8)?;
        }

        let s = &m.cache_scheme;
        let c = &m.capacities;
        writeln!(f, "cache scheme")?;
        writeln!(f, "  page               {} tokens, {} per page", s.page_tokens, bytes(s.bytes_per_page()))?;
        for r in &s.page_regions {
            writeln!(f, "    {:<16} {}", r.name, bytes(r.bytes_per_page))?;
        }
        writeln!(
            f,
            "  continuation row   {} ({} regions); {} live rows/slot x verification width {}",
            bytes(s.continuation_row_bytes),
            s.row_layout.len(),
            s.live_rows_per_slot,
            s.verification_width
        )?;
        writeln!(
            f,
            "  rows               null + {} slots x {} + {} snapshots = {}",
            c.request_slots,
            s.rows_per_slot(),
            c.snapshot_rows,
            s.total_rows(c.request_slots, c.snapshot_rows)
        )?;
        writeln!(f, "capacities")?;
        writeln!(f, "  context limit      {}", c.context_limit)?;
        writeln!(f, "  decode buckets     {:?}", c.decode_request_buckets)?;
        writeln!(f, "  prefill chunks     {:?}", c.prefill_chunk_capacities)?;
        if !c.image_patch_buckets.is_empty() {
            writeln!(f, "  image patches      {:?}", c.image_patch_buckets)?;
        }
        if !c.speculative_programs.is_empty() {
            let programs: Vec<String> =
                c.speculative_programs.iter().map(|p| format!("B={} D={}", p.requests, p.depth)).collect();
            writeln!(f, "  speculative        {}", programs.join(", "))?;
        }
        writeln!(f, "  kv pages (virtual) {}", c.max_kv_pages)?;
        writeln!(f, "  vocabulary         {}", c.vocab_size)?;

        let fe = &m.frontend;
        writeln!(f, "frontend")?;
        writeln!(f, "  served model name  {}", fe.served_model_name)?;
        writeln!(f, "  tokenizer          {} ({})", fe.tokenizer.path, &fe.tokenizer.sha256[..12])?;
        writeln!(f, "  chat template      {} ({})", fe.chat_template.path, &fe.chat_template.sha256[..12])?;
        writeln!(f, "  eos token ids      {:?}", fe.eos_token_ids)?;
        let reasoning = match fe.reasoning_parser {
            ReasoningParser::None => "none",
            ReasoningParser::ThinkTags => "think tags",
        };
        let tools = match fe.tool_parser {
            ToolParser::None => "none",
            ToolParser::HermesJson => "hermes json",
            ToolParser::Qwen3CoderXml => "qwen3-coder xml",
        };
        writeln!(f, "  parsers            reasoning: {reasoning}, tools: {tools}")?;
        let sp = &fe.sampling;
        writeln!(f, "  sampling           temperature {}", param(&sp.temperature))?;
        writeln!(
            f,
            "                     top_k {}, top_p {}, min_p {}",
            param(&sp.top_k),
            param(&sp.top_p),
            param(&sp.min_p)
        )?;
        writeln!(
            f,
            "                     repetition {}, presence {}, frequency {}",
            param(&sp.repetition_penalty),
            param(&sp.presence_penalty),
            param(&sp.frequency_penalty)
        )?;
        write!(f, "                     max output tokens {}", sp.max_output_tokens)
    }
}
