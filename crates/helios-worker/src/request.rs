//! Normalized requests (what the HTTP layer hands the worker) and their prepared form.

use std::sync::Arc;

use helios_frontend::{
    AnswerFormat, Calls, Cancel, GrammarMatcher, MAX_STOP_BYTES, MAX_STOP_TOTAL_BYTES, MAX_STOPS, OutputParser,
    OutputProtocol, Prompt, RenderInput, ResolvedSampling, SamplingRequest, StopSet, ToolChoice,
};
use helios_replay::SamplingParams;
use serde_json::{Map, Value as Json};

use crate::decode::ChoiceDecoder;
use crate::error::{InvalidRequest, RequestError};
use crate::frontend::Frontend;
use crate::grammar_pool::ReadyGrammar;
use helios_frontend::{FrontendError, GrammarError, RenderLimits, TemplateError};

/// Most choices one request may ask for.
pub const MAX_CHOICES: u32 = 16;

/// A chat conversation to render with the core's template.
#[derive(Clone, Debug)]
pub struct ChatPrompt {
    /// OpenAI/Transformers-shaped message objects.
    pub messages: Vec<Json>,
    /// Declared tools (OpenAI `{"type": "function", "function": {...}}` objects).
    pub tools: Vec<Json>,
    pub tool_choice: ToolChoice,
    /// Leave the final assistant message open instead of adding a generation prompt.
    pub continue_final_message: bool,
    /// Extra template variables (`chat_template_kwargs`).
    pub template_kwargs: Map<String, Json>,
}

/// The prompt of a request.
#[derive(Clone, Debug)]
pub enum PromptInput {
    Chat(ChatPrompt),
    /// Raw text, encoded without added special tokens.
    Text(String),
    Tokens(Vec<u32>),
}

/// A validated, protocol-neutral generation request.
#[derive(Clone, Debug)]
pub struct GenerationInput {
    /// Stable id used in logs and the `x-request-id` response header: the client's
    /// `X-Request-Id` when it sent a valid one, else a fresh one.
    pub request_id: String,
    pub prompt: PromptInput,
    pub sampling: SamplingRequest,
    /// `None`: a fresh seed per request, except for top-1 (greedy) sampling: [`GREEDY_SEED`].
    pub seed: Option<u64>,
    pub n: u32,
    pub stop: Vec<String>,
    pub answer: AnswerFormat,
    /// Generate to the output limit even past EOS (benchmarks).
    pub ignore_eos: bool,
}

/// A request after rendering, tokenization, sampling resolution and grammar compilation.
///
/// Invariant: `grammars` is empty or holds exactly `n` matchers in their start state, each
/// with its first mask.
#[derive(Debug)]
pub struct Prepared {
    pub request_id: String,
    pub prompt_ids: Arc<[u32]>,
    /// Checkpoint endpoints (token counts) at completed messages, strictly inside the prompt.
    pub message_endpoints: Vec<u32>,
    pub prompt_text: String,
    pub sampling: ResolvedSampling,
    pub seed: u64,
    pub n: u32,
    /// The request's stop strings, compiled once and shared by its choices.
    pub stop: Arc<StopSet>,
    pub ignore_eos: bool,
    /// Tools the prompt offered (after `tool_choice` filtering).
    pub tools: Vec<Json>,
    pub tool_choice: ToolChoice,
    /// Whether output is parsed for reasoning and tool calls (chat), or is raw text.
    pub chat: bool,
    pub starts_in_reasoning: bool,
    pub(crate) grammars: Vec<ReadyGrammar>,
}

impl Prepared {
    pub fn sampling_params(&self) -> SamplingParams {
        let s = &self.sampling;
        SamplingParams {
            temperature: s.temperature as f32,
            top_k: s.top_k,
            top_p: s.top_p as f32,
            min_p: s.min_p as f32,
            repetition_penalty: s.repetition_penalty as f32,
            presence_penalty: s.presence_penalty as f32,
            frequency_penalty: s.frequency_penalty as f32,
        }
    }

    /// A fresh output decoder for one choice.
    pub fn decoder(&self, frontend: &Frontend) -> ChoiceDecoder {
        let parser = if self.chat {
            OutputParser::new(frontend.reasoning_parser, frontend.tool_parser, &self.tools, self.starts_in_reasoning)
        } else {
            OutputParser::new(helios_contract::ReasoningParser::None, helios_contract::ToolParser::None, &[], false)
        };
        let tail_start = self.prompt_ids.len().saturating_sub(4);
        ChoiceDecoder::new(frontend.tokenizer.clone(), &self.prompt_ids[tail_start..], self.stop.clone(), parser)
    }

    /// The names of the tools the request offered.
    pub fn tool_names(&self) -> Vec<String> {
        self.tools.iter().filter_map(tool_name).collect()
    }
}

/// The `name` of an OpenAI tool definition (or a bare function object).
pub fn tool_name(t: &Json) -> Option<String> {
    t.get("function").unwrap_or(t).get("name").and_then(Json::as_str).map(str::to_owned)
}

/// The checks that cost O(1) per item, run before anything that renders or encodes:
/// choice count, stop strings, message count and raw prompt sizes.
///
/// Every chat message renders to at least one token in the templates served, so more
/// messages than the context limit can never fit; a raw text longer than the tokenizer's
/// byte bound for the context limit cannot either.
pub fn check_limits(frontend: &Frontend, input: &GenerationInput) -> Result<(), RequestError> {
    if input.n == 0 || input.n > MAX_CHOICES {
        return Err(InvalidRequest::ChoiceCount { got: input.n, max: MAX_CHOICES }.into());
    }
    if input.stop.len() > MAX_STOPS {
        return Err(InvalidRequest::Parameter {
            param: "stop",
            reason: format!("at most {MAX_STOPS} stop strings, got {}", input.stop.len()),
        }
        .into());
    }
    if let Some(long) = input.stop.iter().find(|s| s.len() > MAX_STOP_BYTES) {
        return Err(InvalidRequest::Parameter {
            param: "stop",
            reason: format!("stop strings are at most {MAX_STOP_BYTES} bytes, got one of {}", long.len()),
        }
        .into());
    }
    let total: usize = input.stop.iter().map(String::len).sum();
    if total > MAX_STOP_TOTAL_BYTES {
        return Err(InvalidRequest::Parameter {
            param: "stop",
            reason: format!("stop strings are at most {MAX_STOP_TOTAL_BYTES} bytes in all, got {total}"),
        }
        .into());
    }
    check_prompt(frontend, &input.prompt)
}

/// The prompt's O(1) limits (see [`check_limits`]).
fn check_prompt(frontend: &Frontend, prompt: &PromptInput) -> Result<(), RequestError> {
    let limit = frontend.context_limit as usize;
    match prompt {
        PromptInput::Chat(chat) if chat.messages.len() > limit => {
            Err(InvalidRequest::TooManyMessages { got: chat.messages.len(), max: limit }.into())
        }
        PromptInput::Text(text) if frontend.tokenizer.max_text_bytes(limit).is_some_and(|max| text.len() > max) => {
            Err(InvalidRequest::PromptTooLong { limit: frontend.context_limit }.into())
        }
        PromptInput::Tokens(ids) if ids.len() > limit => {
            Err(InvalidRequest::PromptTooLong { limit: frontend.context_limit }.into())
        }
        _ => Ok(()),
    }
}

/// Token ids of a prompt as `/tokenize` and `count_tokens` report them: the generation path's
/// render (tool filtering and instruction included) and bounds (a prompt past the context
/// limit's byte bound, or with more messages than context tokens, is refused), without
/// checkpoint marks; the render stops once `cancel` is set. Chat prompts are encoded without
/// added special tokens, as for generation.
pub fn tokenize(
    frontend: &Frontend,
    prompt: PromptInput,
    add_special_tokens: bool,
    cancel: &Cancel,
) -> Result<Vec<u32>, RequestError> {
    check_prompt(frontend, &prompt)?;
    match prompt {
        PromptInput::Text(text) => Ok(frontend.tokenizer.encode(&text, add_special_tokens)?.ids),
        PromptInput::Chat(chat) => {
            let (render, _) = render_input(chat)?;
            let max_bytes = frontend.tokenizer.max_text_bytes(frontend.context_limit as usize);
            let limits = RenderLimits { cancel: cancel.clone(), max_bytes };
            let text = frontend
                .template
                .render_text_with(&render, &limits)
                .map_err(|e| context_error(frontend, FrontendError::Template(e)))?;
            Ok(frontend.tokenizer.encode(&text, false)?.ids)
        }
        PromptInput::Tokens(ids) => Ok(ids),
    }
}

/// What the template renders for a chat, and the tools it offers: only the tools
/// `tool_choice` allows, and the system instruction it adds. Generation and token counts
/// (`/tokenize`, Anthropic `count_tokens`) render the same prompt.
fn render_input(chat: ChatPrompt) -> Result<(RenderInput, Vec<Json>), RequestError> {
    if let ToolChoice::Named(name) = &chat.tool_choice
        && !chat.tools.iter().any(|t| tool_name(t).as_deref() == Some(name))
    {
        return Err(InvalidRequest::UnknownToolChoice(name.clone()).into());
    }
    let offered = chat.tool_choice.offered_tools(&chat.tools);
    let mut messages = chat.messages;
    if let Some(instruction) = chat.tool_choice.instruction() {
        add_system_instruction(&mut messages, instruction);
    }
    let render = RenderInput {
        messages,
        tools: (!offered.is_empty()).then(|| offered.clone()),
        add_generation_prompt: !chat.continue_final_message,
        continue_final_message: chat.continue_final_message,
        extra: chat.template_kwargs,
        now_unix: None,
    };
    Ok((render, offered))
}

/// A prompt found too long during preparation is refused like admission refuses one.
fn context_error(frontend: &Frontend, e: FrontendError) -> RequestError {
    match e {
        FrontendError::Template(TemplateError::TooLong { .. }) => {
            InvalidRequest::PromptTooLong { limit: frontend.context_limit }.into()
        }
        FrontendError::ContextLimit { tokens, .. } => {
            helios_scheduler::AdmissionError::ContextLimit { tokens, limit: frontend.context_limit }.into()
        }
        e => e.into(),
    }
}

/// Renders, tokenizes and compiles one request. CPU-heavy: runs on a preparation worker.
/// Rendering stops early once `cancel` is set (its client left) or the prompt passes the
/// longest text that fits the context.
pub fn prepare(frontend: &Frontend, input: GenerationInput, cancel: &Cancel) -> Result<Prepared, RequestError> {
    check_limits(frontend, &input)?;
    prepare_checked(frontend, input, cancel)
}

/// [`prepare`] of an input [`check_limits`] already passed.
pub(crate) fn prepare_checked(
    frontend: &Frontend,
    input: GenerationInput,
    cancel: &Cancel,
) -> Result<Prepared, RequestError> {
    let sampling = helios_frontend::resolve_sampling(&frontend.sampling, &input.sampling, frontend.max_output_tokens)?;
    let (prompt_ids, message_endpoints, prompt_text, tools, tool_choice, chat) = match input.prompt {
        PromptInput::Chat(chat) => {
            let tool_choice = chat.tool_choice.clone();
            let (render, offered) = render_input(chat)?;
            let limit = Some(frontend.context_limit as usize);
            let prompt = Prompt::prepare_with(&frontend.template, &frontend.tokenizer, &render, limit, cancel)
                .map_err(|e| context_error(frontend, e))?;
            let endpoints = prompt.checkpoints.iter().map(|&k| k as u32).collect();
            (prompt.ids, endpoints, prompt.text, offered, tool_choice, true)
        }
        PromptInput::Text(text) => {
            let ids = frontend.tokenizer.encode(&text, false)?.ids;
            (ids, Vec::new(), text, Vec::new(), ToolChoice::None, false)
        }
        PromptInput::Tokens(ids) => {
            if let Some(&token) = ids.iter().find(|&&t| t >= frontend.vocab_size) {
                return Err(InvalidRequest::TokenOutOfVocabulary { token, vocab: frontend.vocab_size }.into());
            }
            let text = frontend.tokenizer.decode(&ids, false)?;
            (ids, Vec::new(), text, Vec::new(), ToolChoice::None, false)
        }
    };
    if prompt_ids.is_empty() {
        return Err(InvalidRequest::EmptyPrompt.into());
    }
    let starts_in_reasoning = chat && prompt_opens_reasoning(&prompt_text);
    let tool_syntax = if chat { frontend.tool_parser } else { helios_contract::ToolParser::None };
    // `required` and a named tool are enforced while sampling: only calls, to offered tools.
    let calls = match &tool_choice {
        _ if tools.is_empty() => Calls::None,
        ToolChoice::Required | ToolChoice::Named(_) if tool_syntax != helios_contract::ToolParser::None => {
            Calls::Required(tools.iter().filter_map(tool_schema).collect())
        }
        _ => Calls::Optional,
    };
    let grammars = if input.answer == AnswerFormat::Text && !matches!(calls, Calls::Required(_)) {
        Vec::new()
    } else {
        let proto = OutputProtocol {
            reasoning: if chat { frontend.reasoning_parser } else { helios_contract::ReasoningParser::None },
            tools: tool_syntax,
            calls,
            starts_in_reasoning,
        };
        // One compile, and the first mask (for the sample that ends the prompt) computed here,
        // off the model thread; every choice gets its own copy of the matcher and shares it.
        let mut first: GrammarMatcher = match frontend.grammar.matcher(&input.answer, &proto) {
            // Tool schemas that do not compile into one grammar (references to definitions of
            // their own, keywords the grammar engine lacks) still get calls-only output; the
            // parser checks the calls, as without a required call.
            Err(GrammarError::Compile(e)) if matches!(proto.calls, Calls::Required(_)) => {
                tracing::debug!(error = %e, "tool schemas did not compile: calls are required, payloads unconstrained");
                frontend.grammar.matcher(&input.answer, &OutputProtocol { calls: Calls::RequiredAny, ..proto })?
            }
            other => other?,
        };
        let mask: Arc<[u32]> = first.start()?.words().into();
        let mut grammars: Vec<ReadyGrammar> =
            (1..input.n).map(|_| ReadyGrammar::new(Box::new(first.fork()), mask.clone())).collect();
        grammars.push(ReadyGrammar::new(Box::new(first), mask));
        grammars
    };
    Ok(Prepared {
        request_id: input.request_id,
        prompt_ids: prompt_ids.into(),
        message_endpoints,
        prompt_text,
        sampling,
        seed: input.seed.unwrap_or_else(|| if sampling.top_k == 1 { GREEDY_SEED } else { fresh_seed() }),
        n: input.n,
        stop: Arc::new(StopSet::new(&input.stop)),
        ignore_eos: input.ignore_eos,
        tools,
        tool_choice,
        chat,
        starts_in_reasoning,
        grammars,
    })
}

/// An OpenAI tool definition's name and parameter schema (an object schema if it has none).
fn tool_schema(t: &Json) -> Option<(String, Json)> {
    let parameters = t.get("function").unwrap_or(t).get("parameters");
    Some((tool_name(t)?, parameters.cloned().unwrap_or_else(|| serde_json::json!({"type": "object"}))))
}

fn prompt_opens_reasoning(prompt: &str) -> bool {
    match (prompt.rfind("<think>"), prompt.rfind("</think>")) {
        (Some(o), Some(c)) => o > c,
        (Some(_), None) => true,
        _ => false,
    }
}

/// Appends to the leading system message, or inserts one.
fn add_system_instruction(messages: &mut Vec<Json>, instruction: &str) {
    if let Some(first) = messages.first_mut()
        && first.get("role").and_then(Json::as_str) == Some("system")
        && let Some(Json::String(content)) = first.get_mut("content")
    {
        content.push_str("\n\n");
        content.push_str(instruction);
        return;
    }
    messages.insert(0, serde_json::json!({"role": "system", "content": instruction}));
}

/// The seed of a top-1 request that names none. Top-1 keeps every token tied at the highest
/// probability and draws among them by the seed (bf16 logits tie often, above all with random
/// weights); a fixed seed makes a greedy answer a function of its prompt, the same on every run
/// and every server, as users of temperature 0 expect.
pub const GREEDY_SEED: u64 = 0;

fn fresh_seed() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    t ^ COUNTER.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed)
}
