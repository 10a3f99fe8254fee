//! Structured output through llguidance, over our own `tokenizers` instance.
//!
//! The answer grammar is composed with the output protocol's delimiters: an optional
//! `<think>…</think>` block (free text) and, when tools are offered, `<tool_call>…</tool_call>`
//! blocks. Offered as an alternative to the answer, a call's payload stays unconstrained (it
//! keeps its normal parsing); when the tool choice requires a call (`required`, or a named
//! tool), only calls are allowed, and with JSON calls each one must name an offered tool and
//! carry arguments of its parameter schema.

use std::sync::Arc;

use helios_contract::{ReasoningParser, ToolParser};
use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value as Json;

use crate::error::{GrammarError, ParserFailure};
use crate::tokenizer::Tokenizer;

/// `TokenizerEnv` over a shared [`Tokenizer`]; special tokens carry toktrie's 0xFF marker.
struct HeliosTokEnv {
    tokenizer: Arc<Tokenizer>,
    trie: TokTrie,
}

impl TokenizerEnv for HeliosTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |s| {
            self.tokenizer.inner().encode_fast(s, false).map(|e| e.get_ids().to_vec()).unwrap_or_default()
        })
    }

    fn tokenize_is_canonical(&self) -> bool {
        true
    }
}

/// The parser limits every grammar runs under (llguidance's `ParserLimits`). They bound a
/// grammar's compile and each mask computation by work, not time, so a grammar that would need
/// unbounded work fails fast with a limit error ([`GrammarError::exceeds_limits`]) instead.
/// The values are llguidance's defaults (a large real schema, FHIR, compiles within half of
/// them), fixed here so they are ours; at llguidance's rates one mask costs at most about
/// 15 ms of lexer work and 2.5 ms of parser items. Errors are terse: no grammar dump.
pub(crate) fn parser_limits() -> ParserLimits {
    ParserLimits {
        // Earley items in one row: the grammar's branching factor at a position.
        max_items_in_row: 2_000,
        // Building the initial lexer (compile).
        initial_lexer_fuel: 1_000_000,
        // Lexer work for one token mask.
        step_lexer_fuel: 200_000,
        // Earley items created for one token mask.
        step_max_items: 50_000,
        max_lexer_states: 250_000,
        // Symbols in the grammar's productions (compile).
        max_grammar_size: 500_000,
        precompute_large_lexemes: true,
        verbose_errors: false,
    }
}

/// llguidance's messages for the limits of [`parser_limits`] (compile and per-mask).
const LIMIT_MESSAGES: &[&str] = &[
    "items; max is",                    // max_items_in_row
    "Too many items (limit",            // step_max_items
    "too many expressions constructed", // step_lexer_fuel
    "too many states",                  // max_lexer_states
    "too big (limit",                   // max_grammar_size, initial_lexer_fuel
    "fuel exhausted",                   // initial_lexer_fuel (lexeme relevance)
    "relevance check fuel",
    "lexer precomputation failed",
];

impl GrammarError {
    /// Whether the grammar exceeded the parser's limits ([`parser_limits`]), at compile or
    /// computing a mask: the grammar is too complex to serve, the request's fault. Any other
    /// matcher failure is not.
    pub fn exceeds_limits(&self) -> bool {
        matches!(self, GrammarError::Limit(_))
    }
}

/// An llguidance failure, typed once here: a limit of [`parser_limits`] (its messages are
/// llguidance's only report of which), else `otherwise` (compile or matcher failure).
fn llg_error<E>(e: E, otherwise: fn(ParserFailure) -> GrammarError) -> GrammarError
where
    E: std::fmt::Display + Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let message = first_line(&e);
    let limit = LIMIT_MESSAGES.iter().any(|p| message.contains(p));
    let failure = ParserFailure { message, source: Some(e.into()) };
    if limit { GrammarError::Limit(failure) } else { otherwise(failure) }
}

fn matcher_error<E>(e: E) -> GrammarError
where
    E: std::fmt::Display + Into<Box<dyn std::error::Error + Send + Sync>>,
{
    llg_error(e, GrammarError::Matcher)
}

fn compile_error<E>(e: E) -> GrammarError
where
    E: std::fmt::Display + Into<Box<dyn std::error::Error + Send + Sync>>,
{
    llg_error(e, GrammarError::Compile)
}

/// Per-tokenizer grammar machinery; build once and share.
pub struct GrammarEnv {
    tokenizer: Arc<Tokenizer>,
    factory: ParserFactory,
}

impl std::fmt::Debug for GrammarEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarEnv").field("vocab_size", &self.tokenizer.vocab_size()).finish()
    }
}

/// The answer's constraint.
#[derive(Clone, Debug, PartialEq)]
pub enum AnswerFormat {
    /// Free text (only the protocol's delimiters are structured).
    Text,
    JsonSchema(Json),
    /// Any JSON object (`response_format: json_object`).
    JsonObject,
    /// A Rust-`regex`-syntax pattern the whole answer must match.
    Regex(String),
}

/// The output protocol the answer grammar is composed with.
#[derive(Clone, Debug, PartialEq)]
pub struct OutputProtocol {
    pub reasoning: ReasoningParser,
    pub tools: ToolParser,
    /// What the request's tools allow or require.
    pub calls: Calls,
    /// The prompt already opened a reasoning block.
    pub starts_in_reasoning: bool,
}

/// Tool calls in the output, as the request's `tool_choice` has them.
#[derive(Clone, Debug, PartialEq)]
pub enum Calls {
    /// No tools offered.
    None,
    /// Tools offered: calls are an alternative to the answer.
    Optional,
    /// Only calls, at least one, each to one of these tools (name, parameter schema).
    Required(Vec<(String, Json)>),
    /// Only calls, at least one, their payloads unconstrained (the tools' schemas did not
    /// compile into one grammar).
    RequiredAny,
}

/// Allowed-token set for one step. Invariant: one bit per vocabulary id.
#[derive(Clone, Debug)]
pub struct TokenMask(SimpleVob);

impl TokenMask {
    pub fn is_allowed(&self, id: u32) -> bool {
        (id as usize) < self.0.len() && self.0.is_allowed(id)
    }
    /// Packed bits, 32 ids per word, id `i` at bit `i % 32` of word `i / 32`.
    pub fn words(&self) -> &[u32] {
        self.0.as_slice()
    }
    pub fn num_allowed(&self) -> usize {
        self.0.num_set()
    }
}

/// Per-request matcher: the runtime calls `compute_mask`, samples, then `consume_token`;
/// speculation uses `rollback`.
pub struct GrammarMatcher {
    matcher: Matcher,
    consumed: usize,
}

fn lit(tok: &Tokenizer, s: &str) -> String {
    match tok.token_id(s).filter(|&id| tok.is_special(id)) {
        Some(id) => format!("<[{id}]>"),
        None => serde_json::to_string(s).unwrap_or_default(),
    }
}

fn serialized(schema: &Json) -> Result<String, GrammarError> {
    serde_json::to_string(schema)
        .map_err(|e| GrammarError::Compile(ParserFailure { message: e.to_string(), source: Some(Box::new(e)) }))
}

/// One JSON call to one of `tools`: `{"name": <its name>, "arguments": <its parameters>}`, in
/// the compact separators the JSON answers use.
fn required_call_schema(tools: &[(String, Json)]) -> Json {
    let one = |(name, parameters): &(String, Json)| {
        let arguments = if parameters.is_object() { parameters.clone() } else { serde_json::json!({"type": "object"}) };
        serde_json::json!({
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": arguments},
            "required": ["name", "arguments"],
            "additionalProperties": false,
        })
    };
    // Lenient: a keyword llguidance does not implement is ignored rather than refused.
    let guidance = serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": ",
        "lenient": true});
    match tools {
        [single] => {
            let mut schema = one(single);
            if let Some(o) = schema.as_object_mut() {
                o.insert("x-guidance".into(), guidance);
            }
            schema
        }
        _ => serde_json::json!({"anyOf": tools.iter().map(one).collect::<Vec<_>>(), "x-guidance": guidance}),
    }
}

impl GrammarEnv {
    /// `eos_token_ids` from the core's frontend section; the first is the primary EOS.
    pub fn new(tokenizer: Arc<Tokenizer>, eos_token_ids: &[u32]) -> Result<Self, GrammarError> {
        let n = tokenizer.vocab_size();
        let words: Vec<Vec<u8>> = (0..n as u32)
            .map(|id| {
                let b = tokenizer.token_bytes(id).unwrap_or(&[]);
                if tokenizer.is_special(id) {
                    let mut v = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    v.extend_from_slice(b);
                    v
                } else {
                    b.to_vec()
                }
            })
            .collect();
        let eos = *eos_token_ids.first().ok_or_else(|| GrammarError::Env("no EOS token".into()))?;
        if eos as usize >= n {
            return Err(GrammarError::Env(format!("EOS {eos} outside vocabulary")));
        }
        let info = TokRxInfo::new(n as u32, eos);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(HeliosTokEnv { tokenizer: tokenizer.clone(), trie });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| GrammarError::Env(e.to_string()))?;
        factory.quiet();
        *factory.limits_mut() = parser_limits();
        Ok(GrammarEnv { tokenizer, factory })
    }

    /// The composed Lark grammar (exposed for inspection and tests).
    pub fn lark(&self, format: &AnswerFormat, proto: &OutputProtocol) -> Result<String, GrammarError> {
        let t = &self.tokenizer;
        let answer = match format {
            AnswerFormat::Text => "answer: /(?s:.*)/".to_string(),
            AnswerFormat::JsonSchema(s) => format!("answer: %json {}", serialized(s)?),
            AnswerFormat::JsonObject => "answer: %json {\"type\": \"object\"}".to_string(),
            AnswerFormat::Regex(r) => format!("answer: /{}/", r.replace('/', "\\/")),
        };
        let mut g = String::new();
        let (open, close) = (lit(t, "<tool_call>"), lit(t, "</tool_call>"));
        let body = match (&proto.calls, proto.tools) {
            (_, ToolParser::None) | (Calls::None, _) => "answer",
            (Calls::Optional, _) => {
                g.push_str(&format!(
                    "body: answer | tool_call (sep? tool_call)*\ntool_call: {open} tool_body\n\
                     tool_body[lazy]: /(?s:.*)/ {close}\n"
                ));
                "body"
            }
            (Calls::Required(tools), ToolParser::HermesJson) => {
                g.push_str(&format!(
                    "body: tool_call (sep? tool_call)*\ntool_call: {open} sep? call sep? {close}\ncall: %json {}\n",
                    serialized(&required_call_schema(tools))?
                ));
                "body"
            }
            (Calls::Required(_), ToolParser::Qwen3CoderXml) | (Calls::RequiredAny, _) => {
                g.push_str(&format!(
                    "body: tool_call (sep? tool_call)*\ntool_call: {open} tool_body\ntool_body[lazy]: /(?s:.*)/ {close}\n"
                ));
                "body"
            }
        };
        match proto.reasoning {
            ReasoningParser::None => g.push_str(&format!("start: {body}\n")),
            ReasoningParser::ThinkTags => {
                let open = if proto.starts_in_reasoning { String::new() } else { format!("{} ", lit(t, "<think>")) };
                let think = if proto.starts_in_reasoning { "think" } else { "think?" };
                g.push_str(&format!(
                    "start: {think} sep? {body}\nthink: {open}think_body\nthink_body[lazy]: /(?s:.*)/ {}\n",
                    lit(t, "</think>")
                ));
            }
        }
        // Bounded: free whitespace between delimiters would let a sampler pad forever.
        g.push_str("sep: /[ \\t\\r\\n]{1,8}/\n");
        g.push_str(&answer);
        g.push('\n');
        Ok(g)
    }

    /// Builds a matcher for one request. Compiling is bounded by [`parser_limits`]; a grammar
    /// over them fails with [`GrammarError::Limit`].
    pub fn matcher(&self, format: &AnswerFormat, proto: &OutputProtocol) -> Result<GrammarMatcher, GrammarError> {
        let grammar = TopLevelGrammar::from_lark(self.lark(format, proto)?);
        let parser = self.factory.create_parser(grammar).map_err(compile_error)?;
        let matcher = Matcher::new(Ok(parser)).into_cancellable();
        if let Some(e) = matcher.get_error() {
            return Err(compile_error(e));
        }
        Ok(GrammarMatcher { matcher, consumed: 0 })
    }
}

impl std::fmt::Debug for GrammarMatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarMatcher").field("consumed", &self.consumed).finish_non_exhaustive()
    }
}

/// llguidance's message without its trailer (state and grammar dump, or `<non-verbose/>`).
fn first_line(e: &impl std::fmt::Display) -> String {
    let m = e.to_string();
    m.split("\n<").next().unwrap_or_default().to_owned()
}

/// How many tokens of the first mask [`GrammarMatcher::start`] checks one step ahead.
const START_PROBES: usize = 16;

impl GrammarMatcher {
    /// The first mask, for the sample that ends the prompt. When it allows few tokens (a JSON
    /// answer starts with `{`), each of them is also consumed on a copy and its mask computed,
    /// so a grammar that exceeds the parser's limits at its first token (a schema with
    /// thousands of optional properties) fails here, before generation, rather than after its
    /// first token was streamed. Only limit errors of those probes are reported.
    pub fn start(&mut self) -> Result<TokenMask, GrammarError> {
        let mask = self.compute_mask()?;
        if mask.num_allowed() <= START_PROBES && !self.matcher.is_stopped() {
            for id in mask.0.to_list() {
                let mut probe = GrammarMatcher { matcher: self.matcher.clone(), consumed: self.consumed };
                if let Err(e) = probe.consume_token(id).and_then(|()| probe.compute_mask().map(drop))
                    && e.exceeds_limits()
                {
                    return Err(e);
                }
            }
        }
        Ok(mask)
    }

    /// One step of a constrained request: consumes the sampled `id`, then computes the mask
    /// for the next sample. Each part is bounded by [`parser_limits`].
    pub fn advance(&mut self, id: u32) -> Result<TokenMask, GrammarError> {
        self.consume_token(id)?;
        self.compute_mask()
    }

    /// An independent copy in the same state, for use on another thread: its own lexer caches
    /// (a plain clone would share them behind a lock) and its own cancellation.
    pub fn fork(&self) -> GrammarMatcher {
        GrammarMatcher { matcher: self.matcher.deep_clone(), consumed: self.consumed }
    }

    /// A function that cancels this matcher from another thread: a computation running on it
    /// stops early with an error, and every later call fails. Permanent; for abandoning a
    /// matcher whose work ran past its budget.
    pub fn canceller(&self) -> impl Fn() + Send + Sync + 'static {
        let handle = self.matcher.cancellation_handle();
        move || {
            if let Some(h) = &handle {
                h.cancel();
            }
        }
    }

    /// Whether [`canceller`](Self::canceller) was called.
    pub fn is_cancelled(&self) -> bool {
        self.matcher.is_cancelled()
    }

    /// Tokens allowed next (EOS is allowed exactly when the grammar accepts; once the
    /// grammar has nothing left to match, only EOS).
    pub fn compute_mask(&mut self) -> Result<TokenMask, GrammarError> {
        self.matcher.compute_mask_or_eos().map(TokenMask).map_err(matcher_error)
    }

    /// Advances by one sampled token; a token the grammar forbids is rejected and the
    /// matcher state is unchanged.
    pub fn consume_token(&mut self, id: u32) -> Result<(), GrammarError> {
        if self.matcher.is_stopped() && !self.matcher.is_error() {
            // A complete grammar accepts only EOS, which ends the request.
            let eos = self.compute_mask()?;
            return if eos.is_allowed(id) {
                self.consumed += 1;
                Ok(())
            } else {
                Err(GrammarError::Rejected(id))
            };
        }
        match self.matcher.try_consume_tokens(&[id]) {
            Ok(1) => {
                self.consumed += 1;
                Ok(())
            }
            Ok(_) => Err(GrammarError::Rejected(id)),
            Err(e) => Err(matcher_error(e)),
        }
    }

    /// The longest prefix of `candidates` the grammar accepts from its current state (whose
    /// mask is `mask`), each with the mask that follows it: lane `j + 1` of a verify round
    /// samples under `masks[j]`. The matcher ends where it started. Stops at a token the
    /// grammar forbids and once the grammar is complete (only EOS may follow, and EOS is never
    /// proposed). Costs one mask computation per accepted candidate.
    pub fn lookahead(
        &mut self,
        mask: &TokenMask,
        candidates: &[u32],
    ) -> Result<(Vec<u32>, Vec<TokenMask>), GrammarError> {
        let (mut tokens, mut masks) = (Vec::new(), Vec::new());
        let mut allowed = mask.clone();
        for &c in candidates {
            if self.matcher.is_stopped() || !allowed.is_allowed(c) {
                break;
            }
            match self.matcher.try_consume_tokens(&[c]) {
                Ok(1) => {}
                Ok(_) => break,
                Err(e) => return Err(matcher_error(e)),
            }
            tokens.push(c);
            allowed = self.compute_mask()?;
            masks.push(allowed.clone());
        }
        self.matcher.rollback(tokens.len()).map_err(matcher_error)?;
        Ok((tokens, masks))
    }

    /// Undoes the last `n` consumed tokens (speculative decoding).
    pub fn rollback(&mut self, n: usize) -> Result<(), GrammarError> {
        if n > self.consumed {
            return Err(GrammarError::Rollback { requested: n, available: self.consumed });
        }
        self.matcher.rollback(n).map_err(matcher_error)?;
        self.consumed -= n;
        Ok(())
    }

    /// Whether ending now satisfies the grammar.
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }

    /// Tokens consumed and not rolled back.
    pub fn consumed(&self) -> usize {
        self.consumed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::tests::smol;
    use serde_json::json;

    fn env() -> GrammarEnv {
        let t = smol();
        let eos = t.token_id("<|im_end|>").expect("eos");
        GrammarEnv::new(t, &[eos]).expect("env")
    }

    fn drive(env: &GrammarEnv, m: &mut GrammarMatcher, text: &str) -> Result<(), GrammarError> {
        for id in env.tokenizer.encode(text, false).map_err(|e| GrammarError::Env(e.to_string()))?.ids {
            let mask = m.compute_mask()?;
            if !mask.is_allowed(id) {
                return Err(GrammarError::Rejected(id));
            }
            m.consume_token(id)?;
        }
        Ok(())
    }

    #[test]
    fn json_schema_with_reasoning_and_tools() {
        let e = env();
        let schema = json!({"type":"object","properties":{"n":{"type":"integer"}},"required":["n"],"additionalProperties":false});
        let proto = OutputProtocol {
            reasoning: ReasoningParser::ThinkTags,
            tools: ToolParser::HermesJson,
            calls: Calls::Optional,
            starts_in_reasoning: false,
        };
        let mut m = e.matcher(&AnswerFormat::JsonSchema(schema.clone()), &proto).expect("compiles");
        drive(&e, &mut m, "<think>weigh {options}</think>\n{\"n\": 42}").expect("accepted");
        assert!(m.is_accepting());
        let mut m = e.matcher(&AnswerFormat::JsonSchema(schema.clone()), &proto).expect("compiles");
        drive(&e, &mut m, "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>").expect("accepted");
        assert!(m.is_accepting());
        let mut m = e.matcher(&AnswerFormat::JsonSchema(schema), &proto).expect("compiles");
        assert!(drive(&e, &mut m, "{\"m\": 1}").is_err());
    }

    /// Lookahead keeps the candidates the grammar accepts, each with the mask after it, and
    /// leaves the matcher where it was.
    #[test]
    fn lookahead_keeps_the_accepted_prefix_and_its_masks() {
        let e = env();
        let schema = json!({"type":"object","properties":{"n":{"type":"integer"}},"required":["n"],"additionalProperties":false});
        let format = AnswerFormat::JsonSchema(schema);
        let mut m = e.matcher(&format, &plain()).expect("compiles");
        let ids = e.tokenizer.encode("{\"n\": 42}", false).expect("encodes").ids;
        let bad = e.tokenizer.encode("{\"m\": 1}", false).expect("encodes").ids;
        let mask = m.compute_mask().expect("mask");
        let (kept, masks) = m.lookahead(&mask, &ids).expect("lookahead");
        assert_eq!(kept, ids, "a valid continuation is kept whole");
        assert_eq!(masks.len(), ids.len());
        // Each mask is what the matcher computes after the tokens before it.
        let mut probe = e.matcher(&format, &plain()).expect("compiles");
        for (id, after) in ids.iter().zip(&masks) {
            probe.consume_token(*id).expect("accepted");
            assert_eq!(probe.compute_mask().expect("mask").words(), after.words());
        }
        // The matcher is back where it started: the same mask, and the bad continuation stops
        // where the grammar refuses it.
        assert_eq!(m.compute_mask().expect("mask").words(), mask.words());
        let (kept, _) = m.lookahead(&mask, &bad).expect("lookahead");
        assert!(kept.len() < bad.len() && bad.starts_with(&kept), "{kept:?} of {bad:?}");
        drive(&e, &mut m, "{\"n\": 7}").expect("still at the start");
    }

    #[test]
    fn a_required_call_names_an_offered_tool_with_its_arguments() {
        let e = env();
        let weather = json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]});
        let tools = vec![("get_weather".to_string(), weather), ("get_time".to_string(), json!({"type": "object"}))];
        let proto = OutputProtocol {
            reasoning: ReasoningParser::ThinkTags,
            tools: ToolParser::HermesJson,
            calls: Calls::Required(tools),
            starts_in_reasoning: false,
        };
        let ok = [
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
            "<think>which one</think>\n<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>",
        ];
        for text in ok {
            let mut m = e.matcher(&AnswerFormat::Text, &proto).expect("compiles");
            drive(&e, &mut m, text).expect(text);
            assert!(m.is_accepting(), "{text}");
        }
        let refused = [
            "It is sunny.",
            "<tool_call>\n{\"name\": \"get_stock\", \"arguments\": {}}\n</tool_call>",
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"town\": \"Paris\"}}\n</tool_call>",
        ];
        for text in refused {
            let mut m = e.matcher(&AnswerFormat::Text, &proto).expect("compiles");
            assert!(drive(&e, &mut m, text).is_err(), "{text}");
        }
        // Nothing but the opening of a call can follow an empty output.
        let mut m = e.matcher(&AnswerFormat::Text, &proto).expect("compiles");
        assert!(!m.is_accepting());
    }

    #[test]
    fn a_finished_grammar_allows_only_eos() {
        let e = env();
        let eos = e.tokenizer.token_id("<|im_end|>").expect("eos");
        let proto = OutputProtocol {
            reasoning: ReasoningParser::None,
            tools: ToolParser::None,
            calls: Calls::None,
            starts_in_reasoning: false,
        };
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
            "additionalProperties": false, "x-guidance": {"whitespace_flexible": false}});
        let mut m = e.matcher(&AnswerFormat::JsonSchema(schema), &proto).expect("compiles");
        drive(&e, &mut m, "{\"a\":1}").expect("accepted");
        let mask = m.compute_mask().expect("a stopped grammar still has a mask");
        assert!(mask.is_allowed(eos));
        assert_eq!(mask.num_allowed(), 1);
        m.consume_token(eos).expect("EOS ends it");
        assert!(matches!(m.consume_token(7), Err(GrammarError::Rejected(7))));
    }

    #[test]
    fn regex_json_object_and_rollback() {
        let e = env();
        let proto = OutputProtocol {
            reasoning: ReasoningParser::None,
            tools: ToolParser::None,
            calls: Calls::None,
            starts_in_reasoning: false,
        };
        let mut m = e.matcher(&AnswerFormat::Regex("[0-9]{3}-a/b".into()), &proto).expect("compiles");
        drive(&e, &mut m, "123-a/b").expect("accepted");
        assert!(m.is_accepting());
        let n = m.consumed();
        m.rollback(n).expect("rolls back");
        assert!(matches!(m.rollback(1), Err(GrammarError::Rollback { .. })));
        drive(&e, &mut m, "987-a/b").expect("accepted again");
        let mut m = e.matcher(&AnswerFormat::JsonObject, &proto).expect("compiles");
        let bad = e.tokenizer.encode("x", false).expect("enc").ids[0];
        assert!(matches!(m.consume_token(bad), Err(GrammarError::Rejected(_))));
        drive(&e, &mut m, "{\"a\": [1]}").expect("accepted");
        assert!(m.is_accepting());
    }

    fn plain() -> OutputProtocol {
        OutputProtocol {
            reasoning: ReasoningParser::None,
            tools: ToolParser::None,
            calls: Calls::None,
            starts_in_reasoning: false,
        }
    }

    /// An object with `n` optional string properties: its key position branches `n` ways.
    fn wide_schema(n: usize) -> Json {
        let props: serde_json::Map<String, Json> =
            (0..n).map(|i| (format!("property_{i}"), json!({"type": "string"}))).collect();
        json!({"type": "object", "properties": props})
    }

    #[test]
    fn a_schema_over_the_parser_limits_fails_at_start() {
        let e = env();
        // Compiles, but the row after `{` holds more Earley items than `max_items_in_row`.
        let mut m = e.matcher(&AnswerFormat::JsonSchema(wide_schema(800)), &plain()).expect("compiles");
        let err = m.start().expect_err("over the limits at the first token");
        assert!(err.exceeds_limits(), "{err}");
        assert!(err.to_string().contains("max is 2000"), "{err}");
        assert!(!err.to_string().contains('\n'), "terse message: {err}");
        // Within the limits: starts, and forks advance on their own.
        let mut m = e.matcher(&AnswerFormat::JsonSchema(wide_schema(50)), &plain()).expect("compiles");
        let first = m.start().expect("starts");
        let open = e.tokenizer.encode("{", false).expect("enc").ids[0];
        assert!(first.is_allowed(open));
        let mut fork = m.fork();
        let next = fork.advance(open).expect("advances");
        assert!(!next.is_allowed(open));
        assert_eq!(m.consumed(), 0, "the original did not move");
        assert!(m.advance(open).is_ok());
        // Other failures are not limit failures.
        assert!(!GrammarError::Matcher("boom".into()).exceeds_limits());
        assert!(!GrammarError::Rejected(3).exceeds_limits());
        assert!(compile_error("grammar size (number of symbols) too big (limit for this grammar: 9)").exceeds_limits());
        // llguidance's error is kept whole, under the first line as the message.
        let e = compile_error("unknown rule\n<the grammar dump follows>");
        let GrammarError::Compile(failure) = &e else { panic!("{e:?}") };
        assert_eq!(failure.message, "unknown rule");
        let source = std::error::Error::source(failure).map(ToString::to_string);
        assert_eq!(source.as_deref(), Some("unknown rule\n<the grammar dump follows>"));
        assert!(std::error::Error::source(&e).is_some(), "the failure is the grammar error's source");
    }

    #[test]
    fn a_cancelled_matcher_fails_its_next_computation() {
        let e = env();
        let mut m = e.matcher(&AnswerFormat::JsonObject, &plain()).expect("compiles");
        let cancel = m.canceller();
        m.compute_mask().expect("computes");
        std::thread::spawn(cancel).join().expect("cancels from another thread");
        assert!(m.is_cancelled());
        let err = m.compute_mask().expect_err("cancelled");
        assert!(!err.exceeds_limits(), "{err}");
    }
}
