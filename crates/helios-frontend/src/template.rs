//! Chat templates rendered with minijinja the way Transformers' `apply_chat_template` does.
//!
//! Byte marks: after the full render, each prefix `messages[..k]` is rendered without a
//! generation prompt; when that text is a byte prefix of the full render, its length is
//! the end of message `k`. This is exact (no sentinel ever enters the prompt) and
//! template-agnostic; a prefix that fails to render or diverges simply yields no mark.
//!
//! Cost: one full render, then at most [`MARK_EXHAUSTIVE`] prefix renders per call (each
//! aborted at the first byte that leaves the prompt), so preparation is linear in the
//! conversation: every pending prefix up to [`MARK_EXHAUSTIVE`] of them, else the last
//! [`MARK_TAIL`] plus [`MARK_SPREAD`] spread over the rest. Outcomes are remembered, so a
//! conversation growing turn by turn still gets a mark at every message end. Every mark
//! returned is exact.

use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind, State};
use serde_json::{Map, Value as Json};

use crate::cancel::Cancel;
use crate::error::TemplateError;
use crate::jsonfmt::{PyJsonOptions, dumps};

const TEMPLATE_NAME: &str = "chat";
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";
const RAISED_PREFIX: &str = "raise_exception: ";
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];
/// Room for the markup a template writes after a continued final message, while the
/// render is bounded by [`RenderLimits::max_bytes`].
const CONTINUE_SLACK: usize = 64 << 10;

/// Template source plus the special-token strings Transformers passes to it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TemplateConfig {
    pub chat_template: String,
    /// Name -> content, e.g. `bos_token` -> `<s>`.
    pub special_tokens: Vec<(String, String)>,
}

impl TemplateConfig {
    /// Reads `chat_template` and special tokens from a `tokenizer_config.json` document.
    pub fn from_tokenizer_config(json: &str) -> Result<Self, TemplateError> {
        let cfg: Json = serde_json::from_str(json).map_err(|e| TemplateError::Config(e.to_string()))?;
        let chat_template = match cfg.get("chat_template") {
            Some(Json::String(s)) => s.clone(),
            Some(Json::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(Json::as_str)
                .ok_or_else(|| TemplateError::Config("no default chat template".into()))?
                .to_string(),
            _ => return Err(TemplateError::Config("missing chat_template".into())),
        };
        let mut special_tokens = Vec::new();
        for name in ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"] {
            let content = match cfg.get(name) {
                Some(Json::String(s)) => Some(s.clone()),
                Some(Json::Object(o)) => o.get("content").and_then(Json::as_str).map(str::to_string),
                _ => None,
            };
            if let Some(c) = content {
                special_tokens.push((name.to_string(), c));
            }
        }
        Ok(TemplateConfig { chat_template, special_tokens })
    }
}

/// What to render. Messages and tools are OpenAI/Transformers-shaped JSON objects.
#[derive(Clone, Debug, Default)]
pub struct RenderInput {
    pub messages: Vec<Json>,
    pub tools: Option<Vec<Json>>,
    pub add_generation_prompt: bool,
    /// Leave the final message open (Transformers' `continue_final_message=True`).
    pub continue_final_message: bool,
    /// Extra template variables (e.g. `enable_thinking`).
    pub extra: Map<String, Json>,
    /// Clock for `strftime_now`, seconds since the epoch (UTC). `None`: the system clock.
    pub now_unix: Option<i64>,
}

/// Bounds on one render, checked while the template writes (before any tokenization).
#[derive(Clone, Debug, Default)]
pub struct RenderLimits {
    /// Stops the render (and its prefix probes) with [`TemplateError::Cancelled`].
    pub cancel: Cancel,
    /// Longest prompt text accepted: the render stops with [`TemplateError::TooLong`] as
    /// soon as its output passes this many bytes. `None`: unbounded.
    pub max_bytes: Option<usize>,
}

/// A rendered prompt.
///
/// Invariant: `message_ends` is sorted, unique, and every entry `e` satisfies
/// `0 < e < text.len()` and lies on a char boundary.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rendered {
    pub text: String,
    pub message_ends: Vec<usize>,
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    special_tokens: Vec<(String, String)>,
    reads_content: bool,
    /// The template calls `strftime_now`: prefix renders depend on the clock.
    reads_clock: bool,
    memo: std::sync::Mutex<MarkMemo>,
    /// Keys of the two SipHash-1-3 halves of the 128-bit memo hashes (random per template).
    hash_keys: (std::collections::hash_map::RandomState, std::collections::hash_map::RandomState),
}

/// Outcome of one prefix render, remembered by [`ChatTemplate::render`] across calls.
///
/// Keyed by a 128-bit hash of everything a prefix render reads (tools, extra variables,
/// clock override, and `messages[..k]` serialized); the template and its special tokens are
/// fixed per [`ChatTemplate`]. Entries are facts about the prefix render `R(k)` alone, checked
/// against each new prompt by 128-bit hashes of its byte prefixes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    /// `R(k)` is `len` bytes whose hash is `hash`.
    Rendered { len: usize, hash: u128 },
    /// `R(k)` differs from any text whose first `upto` bytes hash to `hash`.
    Diverged { upto: usize, hash: u128 },
    /// `R(k)` fails to render or is empty: never a mark.
    Never,
}

/// Bound on remembered prefix outcomes; the memo is cleared when it fills.
const MEMO_ENTRIES: usize = 1 << 16;

#[derive(Debug, Default)]
struct MarkMemo {
    map: std::collections::HashMap<u128, Outcome>,
}

/// Two keyed SipHash-1-3 streams: a 128-bit hash.
struct Hash128(std::collections::hash_map::DefaultHasher, std::collections::hash_map::DefaultHasher);

impl Hash128 {
    fn write(&mut self, bytes: &[u8]) {
        use std::hash::Hasher;
        self.0.write(bytes);
        self.1.write(bytes);
    }

    fn finish(&self) -> u128 {
        use std::hash::Hasher;
        (u128::from(self.0.finish()) << 64) | u128::from(self.1.finish())
    }
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

fn py_formatter(out: &mut minijinja::Output<'_>, state: &State<'_, '_>, value: &Value) -> Result<(), Error> {
    if value.is_none() {
        return out.write_str("None").map_err(Error::from);
    }
    if value.kind() == minijinja::value::ValueKind::Bool {
        return out.write_str(if value.is_true() { "True" } else { "False" }).map_err(Error::from);
    }
    minijinja::escape_formatter(out, state, value)
}

fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let json: Json =
        serde_json::to_value(&value).map_err(|e| Error::new(ErrorKind::BadSerialization, e.to_string()))?;
    let mut o = PyJsonOptions {
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ..Default::default()
    };
    if let Some(ind) = kwargs.get::<Option<Value>>("indent")? {
        if let Some(n) = ind.as_i64() {
            o.indent = Some(" ".repeat(usize::try_from(n).unwrap_or(0)));
        } else if let Some(s) = ind.as_str() {
            o.indent = Some(s.to_string());
        }
    }
    if let Some(seps) = kwargs.get::<Option<Vec<String>>>("separators")?
        && let [a, b] = seps.as_slice()
    {
        o.item_sep = Some(a.clone());
        o.key_sep = Some(b.clone());
    }
    kwargs.assert_all_used()?;
    Ok(Value::from_safe_string(dumps(&json, &o)))
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, format!("{RAISED_PREFIX}{msg}")))
}

fn map_error(e: &Error) -> TemplateError {
    if let Some(m) = e.detail().and_then(|d| d.strip_prefix(RAISED_PREFIX)) {
        return TemplateError::Raised(m.to_string());
    }
    let mut chain: &dyn std::error::Error = e;
    while let Some(src) = chain.source() {
        if let Some(m) =
            src.downcast_ref::<Error>().and_then(|inner| inner.detail()).and_then(|d| d.strip_prefix(RAISED_PREFIX))
        {
            return TemplateError::Raised(m.to_string());
        }
        chain = src;
    }
    match e.kind() {
        ErrorKind::SyntaxError | ErrorKind::BadEscape => TemplateError::Syntax(format!("{e:#}")),
        _ => TemplateError::Render(format!("{e:#}")),
    }
}

/// Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// Days since 1970-01-01 of a civil date.
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `datetime.strftime` for the common directives (UTC).
pub(crate) fn strftime(fmt: &str, unix: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let days = unix.div_euclid(86_400);
    let secs = unix.rem_euclid(86_400);
    let (y, m, d) = civil(days);
    let wd = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday.
    let yday = days - days_from_civil(y, 1, 1) + 1;
    let mut out = String::new();
    let mut it = fmt.chars();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mi = (m as usize).saturating_sub(1).min(11);
        match it.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('-') => match it.next() {
                Some('d') => out.push_str(&d.to_string()),
                Some('m') => out.push_str(&m.to_string()),
                Some(o) => {
                    out.push_str("%-");
                    out.push(o);
                }
                None => out.push_str("%-"),
            },
            Some('B') => out.push_str(MONTHS[mi]),
            Some('b') => out.push_str(&MONTHS[mi][..3]),
            Some('A') => out.push_str(DAYS[wd]),
            Some('a') => out.push_str(&DAYS[wd][..3]),
            Some('H') => out.push_str(&format!("{:02}", secs / 3600)),
            Some('M') => out.push_str(&format!("{:02}", secs / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", secs % 60)),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            Some(o) => {
                out.push('%');
                out.push(o);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Messages with `thinking` / `reasoning_content` aliased from whichever reasoning field is
/// set; borrowed unchanged (no copy) when no message has one.
fn alias_reasoning(messages: &[Json]) -> std::borrow::Cow<'_, [Json]> {
    let has_reasoning = |m: &Json| REASONING_FIELDS.iter().any(|k| m.get(*k).is_some_and(|v| !v.is_null()));
    if !messages.iter().any(has_reasoning) {
        return std::borrow::Cow::Borrowed(messages);
    }
    messages
        .iter()
        .map(|m| {
            let Json::Object(obj) = m else { return m.clone() };
            let Some(r) = REASONING_FIELDS.iter().find_map(|k| obj.get(*k).filter(|v| !v.is_null())).cloned() else {
                return m.clone();
            };
            let mut out = Map::new();
            out.insert("thinking".into(), r.clone());
            for (k, v) in obj {
                out.insert(k.clone(), v.clone());
            }
            out.insert("reasoning_content".into(), r);
            Json::Object(out)
        })
        .collect()
}

impl ChatTemplate {
    /// Compiles `config.chat_template` with Transformers' environment: trim/lstrip blocks,
    /// loop controls, pycompat methods, `raise_exception`, `strftime_now`, Python `tojson`.
    pub fn new(config: &TemplateConfig) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(py_formatter);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", |state: &State<'_, '_>, fmt: String| -> Result<Value, Error> {
            let now = state.lookup("__now_unix").and_then(|v| v.as_i64()).unwrap_or_else(|| {
                SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0)
            });
            Ok(Value::from(strftime(&fmt, now)))
        });
        env.add_template_owned(TEMPLATE_NAME, config.chat_template.clone()).map_err(|e| map_error(&e))?;
        let reads_content = config.chat_template.contains("content");
        Ok(ChatTemplate {
            env,
            special_tokens: config.special_tokens.clone(),
            reads_content,
            reads_clock: config.chat_template.contains("strftime_now"),
            memo: std::sync::Mutex::default(),
            hash_keys: Default::default(),
        })
    }

    /// Context values shared by every render of `input` (all but `messages` and
    /// `add_generation_prompt`), in Transformers' override order.
    fn base_context(&self, input: &RenderInput) -> Vec<(String, Value)> {
        let mut ctx: Vec<(String, Value)> = Vec::new();
        let mut set = |k: &str, v: Value| match ctx.iter_mut().find(|(n, _)| n == k) {
            Some(slot) => slot.1 = v,
            None => ctx.push((k.to_string(), v)),
        };
        for (k, v) in &self.special_tokens {
            set(k, Value::from(v.as_str()));
        }
        for (k, v) in &input.extra {
            set(k, Value::from_serialize(v));
        }
        set("messages", Value::UNDEFINED);
        set("tools", input.tools.as_ref().map_or(Value::from(()), Value::from_serialize));
        set("documents", Value::from(()));
        set("add_generation_prompt", Value::from(false));
        if let Some(t) = input.now_unix {
            set("__now_unix", Value::from(t));
        }
        ctx
    }

    fn context(base: &[(String, Value)], messages: Value, add_generation_prompt: bool) -> Value {
        base.iter()
            .map(|(k, v)| {
                let v = match k.as_str() {
                    "messages" => messages.clone(),
                    "add_generation_prompt" => Value::from(add_generation_prompt),
                    _ => v.clone(),
                };
                (k.as_str(), v)
            })
            .collect()
    }

    fn render_raw(
        &self,
        messages: &[Json],
        input: &RenderInput,
        add_generation_prompt: bool,
        limits: &RenderLimits,
        slack: usize,
    ) -> Result<String, TemplateError> {
        if limits.cancel.is_cancelled() {
            return Err(TemplateError::Cancelled);
        }
        let tmpl = self.env.get_template(TEMPLATE_NAME).map_err(|e| map_error(&e))?;
        let msgs: Vec<Value> = messages.iter().map(Value::from_serialize).collect();
        let ctx = Self::context(&self.base_context(input), Value::from(msgs), add_generation_prompt);
        let max = limits.max_bytes.map_or(usize::MAX, |m| m.saturating_add(slack));
        let mut w = BoundedWriter { out: Vec::new(), max, cancel: &limits.cancel, stop: None };
        let rendered = tmpl.render_captured_to(ctx, &mut w);
        match (w.stop, rendered) {
            (Some(TemplateError::TooLong { .. }), _) => Err(TemplateError::TooLong { max_bytes: max - slack }),
            (Some(stop), _) => Err(stop),
            (None, Err(e)) => Err(map_error(&e)),
            (None, Ok(_)) => String::from_utf8(w.out).map_err(|e| TemplateError::Render(e.to_string())),
        }
    }

    /// Renders the prompt text only (no marks).
    pub fn render_text(&self, input: &RenderInput) -> Result<String, TemplateError> {
        self.render_text_with(input, &RenderLimits::default())
    }

    /// [`render_text`](Self::render_text) under `limits`.
    pub fn render_text_with(&self, input: &RenderInput, limits: &RenderLimits) -> Result<String, TemplateError> {
        if input.continue_final_message && input.add_generation_prompt {
            return Err(TemplateError::ContinueWithGenerationPrompt);
        }
        if !input.continue_final_message {
            return self.render_raw(&alias_reasoning(&input.messages), input, input.add_generation_prompt, limits, 0);
        }
        let mut messages = alias_reasoning(&input.messages).into_owned();
        if !self.reads_content {
            return Err(TemplateError::NothingToContinue);
        }
        let last = messages.last_mut().ok_or(TemplateError::NothingToContinue)?;
        let final_text = match last.get_mut("content") {
            Some(Json::String(s)) => {
                let orig = s.clone();
                s.push_str(CONTINUE_TAG);
                orig
            }
            Some(Json::Array(parts)) => {
                let part = parts
                    .iter_mut()
                    .rev()
                    .find_map(|p| p.get_mut("text").filter(|t| t.is_string()))
                    .ok_or(TemplateError::NothingToContinue)?;
                let orig = part.as_str().unwrap_or_default().to_string();
                *part = Json::String(format!("{orig}{CONTINUE_TAG}"));
                orig
            }
            _ => return Err(TemplateError::NothingToContinue),
        };
        // The tag and the template's closing markup after it are cut again: they do not count
        // against the limit (the exact check follows the cut).
        let text = self.render_raw(&messages, input, false, limits, CONTINUE_TAG.len() + CONTINUE_SLACK)?;
        let tag = CONTINUE_TAG.trim();
        if !text.contains(final_text.trim()) {
            return Err(TemplateError::ContinuationLost);
        }
        let loc = text.rfind(tag).ok_or(TemplateError::ContinuationLost)?;
        let text = if text[loc..].starts_with(CONTINUE_TAG) { &text[..loc] } else { text[..loc].trim_end() };
        match limits.max_bytes {
            Some(max) if text.len() > max => Err(TemplateError::TooLong { max_bytes: max }),
            _ => Ok(text.to_string()),
        }
    }

    /// Renders the prompt and records the byte end of every completed message (and of a
    /// nonempty preamble rendered for zero messages). The open generation header and an
    /// open continued message are never marked.
    ///
    /// Mark `k` is `len(R(k))`, `R(k)` = render of `messages[..k]` without generation prompt,
    /// when `R(k)` is a proper byte prefix of the prompt. A template may read anything (the
    /// message count, the last message, `loop.last`, ...), so exactness needs `R(k)` itself:
    /// - outcomes of earlier calls are reused when the same prefix (same tools, extra
    ///   variables, messages) was rendered before, checked against this prompt by 128-bit
    ///   hashes of its byte prefixes, so a growing conversation renders only its new prefixes;
    /// - every remaining prefix render reuses one precomputed context (message values are
    ///   shared, nothing is re-serialized), streams into a comparator that aborts at the first
    ///   byte that differs from the prompt (nothing is allocated), and the prefixes are spread
    ///   over up to [`MARK_THREADS`] threads.
    ///
    /// Templates that call `strftime_now` without a fixed `now_unix` skip the memo.
    ///
    /// Bounded work: prefixes neither remembered nor among those chosen by
    /// [`select_probes`] are not rendered (and yield no mark in this call).
    pub fn render(&self, input: &RenderInput) -> Result<Rendered, TemplateError> {
        self.render_with(input, &RenderLimits::default())
    }

    /// [`render`](Self::render) under `limits`: the full render stops as soon as it passes
    /// `max_bytes`, and the render or any prefix probe stops once `cancel` is set.
    pub fn render_with(&self, input: &RenderInput, limits: &RenderLimits) -> Result<Rendered, TemplateError> {
        let text = self.render_text_with(input, limits)?;
        let message_ends = self.marks_with(input, &text, &limits.cancel)?;
        Ok(Rendered { text, message_ends })
    }

    /// The message ends of `text`, which must be `render_text(input)`: the second half of
    /// [`render_with`](Self::render_with), so a caller can check the prompt (its token count,
    /// say) before paying for prefix probes. Sorted, unique, inside `(0, text.len())`.
    pub fn marks_with(&self, input: &RenderInput, text: &str, cancel: &Cancel) -> Result<Vec<usize>, TemplateError> {
        let aliased = alias_reasoning(&input.messages);
        let complete = if input.continue_final_message { aliased.len().saturating_sub(1) } else { aliased.len() };
        let memo_on = !(self.reads_clock && input.now_unix.is_none());
        let keys = if memo_on { self.prefix_keys(input, &aliased[..complete]) } else { Vec::new() };
        let memo_on = memo_on && keys.len() == complete + 1;
        let cached: Vec<Option<Outcome>> = match self.memo.lock() {
            Ok(m) if memo_on => keys.iter().map(|k| m.map.get(k).copied()).collect(),
            _ => vec![None; complete + 1],
        };
        let lens = cached.iter().filter_map(|o| match o {
            Some(Outcome::Rendered { len, .. }) => Some(*len),
            Some(Outcome::Diverged { upto, .. }) => Some(*upto),
            _ => None,
        });
        let seen = self.prefix_hashes(text.as_bytes(), lens.collect());
        let matches = |len: usize, hash: u128| seen.get(&len) == Some(&hash);
        let mut marks: Vec<Option<usize>> = Vec::with_capacity(complete + 1);
        let mut todo = Vec::new();
        for (k, o) in cached.iter().enumerate() {
            marks.push(match *o {
                Some(Outcome::Rendered { len, hash }) if matches(len, hash) && len < text.len() => Some(len),
                Some(Outcome::Diverged { upto, hash }) if matches(upto, hash) => None,
                Some(Outcome::Never) => None,
                _ => {
                    todo.push(k);
                    None
                }
            });
        }
        let todo = select_probes(&todo);
        let probes = if todo.is_empty() {
            Vec::new()
        } else {
            let messages: Vec<Value> = aliased[..complete].iter().map(Value::from_serialize).collect();
            self.probe_prefixes(input, &messages, &todo, text, cancel)?
        };
        let mut fresh = Vec::with_capacity(probes.len());
        for (k, p) in probes {
            if let Probe::Mark(len) = p {
                marks[k] = Some(len);
            }
            fresh.push((k, p));
        }
        if memo_on && !fresh.is_empty() {
            let lens = fresh.iter().filter_map(|(_, p)| match *p {
                Probe::Mark(l) | Probe::Diverged(l) => Some(l),
                Probe::Overlong | Probe::Never | Probe::Cancelled => None,
            });
            let hashes = self.prefix_hashes(text.as_bytes(), lens.collect());
            if let Ok(mut m) = self.memo.lock() {
                if m.map.len() + fresh.len() > MEMO_ENTRIES {
                    m.map.clear();
                }
                for (k, p) in fresh {
                    let outcome = match p {
                        Probe::Mark(len) => hashes.get(&len).map(|&hash| Outcome::Rendered { len, hash }),
                        Probe::Diverged(upto) => hashes.get(&upto).map(|&hash| Outcome::Diverged { upto, hash }),
                        Probe::Never => Some(Outcome::Never),
                        Probe::Overlong | Probe::Cancelled => None,
                    };
                    if let (Some(o), Some(&key)) = (outcome, keys.get(k)) {
                        m.map.insert(key, o);
                    }
                }
            }
        }
        let mut message_ends: Vec<usize> = marks.into_iter().flatten().collect();
        message_ends.sort_unstable();
        message_ends.dedup();
        Ok(message_ends)
    }

    /// Forgets remembered prefix outcomes (results never depend on them).
    pub fn clear_mark_cache(&self) {
        if let Ok(mut m) = self.memo.lock() {
            m.map.clear();
        }
    }

    fn hasher(&self) -> Hash128 {
        use std::hash::BuildHasher;
        Hash128(self.hash_keys.0.build_hasher(), self.hash_keys.1.build_hasher())
    }

    /// Memo key of every prefix `messages[..k]`, `k = 0..=messages.len()`: one hash stream
    /// over the shared variables, then each message as JSON followed by 0xFF (never in UTF-8).
    fn prefix_keys(&self, input: &RenderInput, messages: &[Json]) -> Vec<u128> {
        let mut h = self.hasher();
        let mut buf = Vec::with_capacity(4096);
        let shared = (&input.tools, &input.extra, input.now_unix);
        let mut keys = Vec::with_capacity(messages.len() + 1);
        if serde_json::to_writer(&mut buf, &shared).is_err() {
            return keys;
        }
        buf.push(0xFF);
        h.write(&buf);
        keys.push(h.finish());
        for m in messages {
            buf.clear();
            if serde_json::to_writer(&mut buf, m).is_err() {
                return keys;
            }
            buf.push(0xFF);
            h.write(&buf);
            keys.push(h.finish());
        }
        keys
    }

    /// 128-bit hash of `text[..l]` for each requested `l <= text.len()`, in one pass.
    fn prefix_hashes(&self, text: &[u8], mut lens: Vec<usize>) -> std::collections::HashMap<usize, u128> {
        lens.retain(|&l| l <= text.len());
        lens.sort_unstable();
        lens.dedup();
        let mut out = std::collections::HashMap::with_capacity(lens.len());
        let mut h = self.hasher();
        let mut pos = 0;
        for l in lens {
            h.write(&text[pos..l]);
            pos = l;
            out.insert(l, h.finish());
        }
        out
    }

    /// Renders `R(k)` for each `k` in `ks` against `text` (on several threads when many).
    fn probe_prefixes(
        &self,
        input: &RenderInput,
        messages: &[Value],
        ks: &[usize],
        text: &str,
        cancel: &Cancel,
    ) -> Result<Vec<(usize, Probe)>, TemplateError> {
        let base = self.base_context(input);
        let tmpl = self.env.get_template(TEMPLATE_NAME).map_err(|e| map_error(&e))?;
        let probe = |k: usize| -> (usize, Probe) {
            if cancel.is_cancelled() {
                return (k, Probe::Cancelled);
            }
            let ctx = Self::context(&base, Value::from(messages[..k].to_vec()), false);
            let mut w = PrefixWriter { target: text.as_bytes(), pos: 0, stop: None, cancel };
            let ok = tmpl.render_captured_to(ctx, &mut w).is_ok();
            let p = match w.stop {
                Some(p) => p,
                None if ok && w.pos > 0 => Probe::Mark(w.pos),
                None => Probe::Never,
            };
            (k, p)
        };
        let threads = if ks.len() >= 16 {
            std::thread::available_parallelism().map_or(1, |n| n.get()).min(MARK_THREADS)
        } else {
            1
        };
        let all: Vec<(usize, Probe)> = if threads <= 1 {
            ks.iter().map(|&k| probe(k)).collect()
        } else {
            Self::probe_threads(ks, threads, &probe)
        };
        if all.iter().any(|(_, p)| *p == Probe::Cancelled) {
            return Err(TemplateError::Cancelled);
        }
        Ok(all)
    }

    fn probe_threads(
        ks: &[usize],
        threads: usize,
        probe: &(dyn Fn(usize) -> (usize, Probe) + Sync),
    ) -> Vec<(usize, Probe)> {
        // Prefix k costs about k; interleave so every thread gets a fair share.
        std::thread::scope(|s| {
            let probe = &probe;
            let handles: Vec<_> = (1..threads)
                .map(|t| s.spawn(move || ks.iter().skip(t).step_by(threads).map(|&k| probe(k)).collect::<Vec<_>>()))
                .collect();
            let mut all: Vec<(usize, Probe)> = ks.iter().step_by(threads).map(|&k| probe(k)).collect();
            for h in handles {
                // A panicking prefix render only loses its marks.
                all.extend(h.join().unwrap_or_default());
            }
            all
        })
    }

    /// The original O(n^2) mark discovery: every prefix rendered to a string through
    /// the serde context, then compared. Kept as the reference for tests.
    #[cfg(test)]
    pub(crate) fn render_reference(&self, input: &RenderInput) -> Result<Rendered, TemplateError> {
        let text = self.render_text(input)?;
        let messages = alias_reasoning(&input.messages);
        let complete = if input.continue_final_message { messages.len().saturating_sub(1) } else { messages.len() };
        let mut message_ends = Vec::with_capacity(complete + 1);
        for k in 0..=complete {
            let Ok(prefix) = self.render_raw_reference(&messages[..k], input, false) else { continue };
            let end = prefix.len();
            if end > 0 && end < text.len() && text.as_bytes().starts_with(prefix.as_bytes()) {
                message_ends.push(end);
            }
        }
        message_ends.sort_unstable();
        message_ends.dedup();
        Ok(Rendered { text, message_ends })
    }

    /// The original context construction (one serde_json map serialized per render).
    #[cfg(test)]
    fn render_raw_reference(
        &self,
        messages: &[Json],
        input: &RenderInput,
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        let tmpl = self.env.get_template(TEMPLATE_NAME).map_err(|e| map_error(&e))?;
        let mut ctx = Map::new();
        for (k, v) in &self.special_tokens {
            ctx.insert(k.clone(), Json::String(v.clone()));
        }
        for (k, v) in &input.extra {
            ctx.insert(k.clone(), v.clone());
        }
        ctx.insert("messages".into(), Json::Array(messages.to_vec()));
        ctx.insert("tools".into(), input.tools.clone().map(Json::Array).unwrap_or(Json::Null));
        ctx.insert("documents".into(), Json::Null);
        ctx.insert("add_generation_prompt".into(), Json::Bool(add_generation_prompt));
        if let Some(t) = input.now_unix {
            ctx.insert("__now_unix".into(), Json::from(t));
        }
        tmpl.render(Value::from_serialize(&ctx)).map_err(|e| map_error(&e))
    }
}

/// Most threads one [`ChatTemplate::render`] uses for prefix renders.
pub(crate) const MARK_THREADS: usize = 4;

/// Up to this many pending prefixes (outcome not remembered), a [`ChatTemplate::render`]
/// call renders them all: every mark is found, exactly as by rendering every prefix. It is
/// also the most prefix renders one call makes; each costs at most one render of the prompt,
/// so a call costs at most `MARK_EXHAUSTIVE + 1` renders whatever the message count.
pub const MARK_EXHAUSTIVE: usize = 64;

/// Beyond [`MARK_EXHAUSTIVE`] pending prefixes, a call renders the last `MARK_TAIL` (the
/// next turn of an agent conversation resumes there) ...
pub const MARK_TAIL: usize = 8;

/// ... and `MARK_SPREAD` spread evenly over the earlier ones, where the scheduler places
/// its few checkpoints (at most eight per request) at equal intervals anyway.
pub const MARK_SPREAD: usize = 8;

/// The prefixes to render among `todo` (ascending): all of them when at most
/// [`MARK_EXHAUSTIVE`]; otherwise the last [`MARK_TAIL`] and [`MARK_SPREAD`] evenly spaced
/// over the rest. Ascending, unique, a subset of `todo`.
pub fn select_probes(todo: &[usize]) -> Vec<usize> {
    if todo.len() <= MARK_EXHAUSTIVE {
        return todo.to_vec();
    }
    let (rest, tail) = todo.split_at(todo.len() - MARK_TAIL);
    let m = MARK_SPREAD;
    // rest.len() > m, so the midpoints of m equal slices are distinct indices.
    let mut out: Vec<usize> = (0..m).map(|i| rest[(2 * i + 1) * rest.len() / (2 * m)]).collect();
    out.extend_from_slice(tail);
    out
}

/// How a prefix render relates to the prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Probe {
    /// A proper, nonempty prefix of this length.
    Mark(usize),
    /// First differs from the prompt at byte `upto - 1`.
    Diverged(usize),
    /// Matches the whole prompt and may go on: not a mark here.
    Overlong,
    /// Fails to render, or renders nothing.
    Never,
    /// Stopped by cancellation: no outcome.
    Cancelled,
}

/// An `io::Write` that accepts output only while it stays a proper prefix of `target`;
/// the first differing (or overlong) write fails, which aborts the render.
struct PrefixWriter<'a> {
    target: &'a [u8],
    pos: usize,
    stop: Option<Probe>,
    cancel: &'a Cancel,
}

impl std::io::Write for PrefixWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.cancel.is_cancelled() {
            self.stop = Some(Probe::Cancelled);
            return Err(std::io::Error::other("cancelled"));
        }
        let end = self.pos + buf.len();
        if end < self.target.len() && &self.target[self.pos..end] == buf {
            self.pos = end;
            return Ok(buf.len());
        }
        let rest = &self.target[self.pos..];
        self.stop = Some(match buf.iter().zip(rest).position(|(a, b)| a != b) {
            Some(d) => Probe::Diverged(self.pos + d + 1),
            None => Probe::Overlong,
        });
        Err(std::io::Error::other("prefix render left the prompt"))
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Collects render output up to `max` bytes; aborts the render past it or on cancel.
struct BoundedWriter<'a> {
    out: Vec<u8>,
    max: usize,
    cancel: &'a Cancel,
    stop: Option<TemplateError>,
}

impl std::io::Write for BoundedWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.cancel.is_cancelled() {
            self.stop = Some(TemplateError::Cancelled);
        } else if self.out.len() + buf.len() > self.max {
            self.stop = Some(TemplateError::TooLong { max_bytes: self.max });
        } else {
            self.out.extend_from_slice(buf);
            return Ok(buf.len());
        }
        Err(std::io::Error::other("render stopped"))
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tmpl(src: &str) -> ChatTemplate {
        ChatTemplate::new(&TemplateConfig { chat_template: src.into(), special_tokens: vec![] }).expect("compiles")
    }

    const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

    #[test]
    fn marks_every_completed_message() {
        let t = tmpl(CHATML);
        let input = RenderInput {
            messages: vec![json!({"role":"user","content":"hi"}), json!({"role":"assistant","content":"yo"})],
            add_generation_prompt: true,
            ..Default::default()
        };
        let r = t.render(&input).expect("renders");
        assert_eq!(
            r.text,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n<|im_start|>assistant\n"
        );
        let first = "<|im_start|>user\nhi<|im_end|>\n".len();
        let second = first + "<|im_start|>assistant\nyo<|im_end|>\n".len();
        assert_eq!(r.message_ends, vec![first, second]);
    }

    #[test]
    fn continuation_leaves_final_message_open() {
        let t = tmpl(CHATML);
        let input = RenderInput {
            messages: vec![json!({"role":"user","content":"hi"}), json!({"role":"assistant","content":"Sure, "})],
            continue_final_message: true,
            ..Default::default()
        };
        let r = t.render(&input).expect("renders");
        assert!(r.text.ends_with("<|im_start|>assistant\nSure, "));
        assert_eq!(r.message_ends.len(), 1);
    }

    #[test]
    fn raise_exception_is_typed() {
        let t = tmpl("{{ raise_exception('bad role') }}");
        match t.render(&RenderInput::default()) {
            Err(TemplateError::Raised(m)) => assert_eq!(m, "bad role"),
            other => panic!("unexpected {other:?}"),
        }
        assert!(matches!(
            ChatTemplate::new(&TemplateConfig { chat_template: "{% for %}".into(), special_tokens: vec![] }),
            Err(TemplateError::Syntax(_))
        ));
    }

    #[test]
    fn python_compat_helpers() {
        let t = tmpl(
            "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ ' a '.strip() }}|{{ none }}|{{ true }}|{% for i in [1,2,3] %}{% if i == 2 %}{% continue %}{% endif %}{{ i }}{% endfor %}|{{ strftime_now('%Y-%m-%d %b %j') }}",
        );
        let mut extra = Map::new();
        extra.insert("x".into(), json!({"k": "<&>", "n": [1.5]}));
        let out = t
            .render_text(&RenderInput { extra, now_unix: Some(1_700_000_000), ..Default::default() })
            .expect("renders");
        assert_eq!(
            out,
            "{\"k\": \"<&>\", \"n\": [1.5]}|{\n  \"k\": \"<&>\",\n  \"n\": [\n    1.5\n  ]\n}|a|None|True|13|2023-11-14 Nov 318"
        );
    }

    fn fixture_dir() -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/frontend")
    }

    fn fixture_template(name: &str) -> ChatTemplate {
        let cfg = if name == "smollm2" {
            TemplateConfig::from_tokenizer_config(
                &std::fs::read_to_string(fixture_dir().join("smollm2/tokenizer_config.json")).expect("config"),
            )
            .expect("parses")
        } else {
            TemplateConfig {
                chat_template: std::fs::read_to_string(fixture_dir().join(name).join("chat_template.jinja"))
                    .expect("template"),
                special_tokens: vec![],
            }
        };
        ChatTemplate::new(&cfg).expect("compiles")
    }

    /// Before/after timing on the bench conversation (release build):
    /// `cargo test --release -p helios-frontend --lib marks_speed -- --ignored --nocapture`.
    #[test]
    #[ignore = "timing; run in release"]
    fn marks_speed_vs_reference() {
        const PARA: &str = "The agent inspects the repository, reads configuration files, runs the test-suite and reports findings — including Unicode like naïve café, 東京, and emoji 🚀✅. ";
        let t = fixture_template("qwen_style");
        let mut messages = vec![json!({"role": "system", "content": "You are a coding agent."})];
        let mut i = 0;
        while messages.len() < 200 {
            messages.push(json!({"role": "user", "content": format!("Step {i}: {}", PARA.repeat(4))}));
            messages.push(json!({"role": "assistant", "content": PARA.repeat(3), "tool_calls": [
                {"type": "function", "function": {"name": "run", "arguments": {"cmd": format!("cargo test --step {i}")}}}]}));
            messages.push(json!({"role": "tool", "content": PARA.repeat(5)}));
            messages.push(json!({"role": "assistant", "content": format!("Done with step {i}. {PARA}")}));
            i += 1;
        }
        messages.truncate(200);
        let tools =
            Some(vec![json!({"type": "function", "function": {"name": "run", "description": "Run a shell command.",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}})]);
        let input = RenderInput { messages, tools, add_generation_prompt: true, ..Default::default() };
        let time = |f: &dyn Fn() -> Rendered| {
            let mut v: Vec<_> = (0..7)
                .map(|_| {
                    let t0 = std::time::Instant::now();
                    f();
                    t0.elapsed()
                })
                .collect();
            v.sort_unstable();
            v[v.len() / 2]
        };
        let reference = t.render_reference(&input).expect("renders");
        assert_eq!(t.render(&input).expect("renders"), reference);
        let old = time(&|| t.render_reference(&input).expect("renders"));
        let cold = time(&|| {
            t.clear_mark_cache();
            t.render(&input).expect("renders")
        });
        let warm = time(&|| t.render(&input).expect("renders"));
        println!(
            "marks, 200 messages ({} marks): reference O(n^2) {old:?}, new cold {cold:?}, new warm (memo) {warm:?}",
            reference.message_ends.len()
        );
    }

    /// Streaming prefix hashes do not depend on where the stream was cut.
    #[test]
    fn prefix_hashes_are_chunking_invariant() {
        let t = tmpl(CHATML);
        let text = "héllo wörld 🚀 0123456789 abcdefghijklmnopqrstuvwxyz".repeat(5);
        let b = text.as_bytes();
        let all = t.prefix_hashes(b, (0..=b.len()).collect());
        for l in [0, 1, 7, 8, 9, 63, 64, 65, b.len()] {
            assert_eq!(t.prefix_hashes(b, vec![l]).get(&l), all.get(&l), "{l}");
        }
        assert_ne!(all.get(&10), all.get(&11));
    }

    /// New marks equal the O(n^2) reference marks on every differential fixture.
    #[test]
    fn marks_equal_reference_on_differential_fixtures() {
        let data: Json =
            serde_json::from_str(&std::fs::read_to_string(fixture_dir().join("differential.json")).expect("fixture"))
                .expect("json");
        let mut templates = std::collections::HashMap::new();
        let mut marks = 0;
        for case in data["cases"].as_array().expect("cases") {
            let name = case["template"].as_str().expect("template");
            let t = templates.entry(name.to_string()).or_insert_with(|| fixture_template(name));
            let inp = &case["input"];
            let input = RenderInput {
                messages: inp["messages"].as_array().expect("messages").clone(),
                tools: inp["tools"].as_array().cloned(),
                add_generation_prompt: inp["add_generation_prompt"].as_bool().unwrap_or(false),
                continue_final_message: inp["continue_final_message"].as_bool().unwrap_or(false),
                extra: inp["extra"].as_object().cloned().unwrap_or_default(),
                now_unix: None,
            };
            let fast = t.render(&input).expect("renders");
            assert_eq!(fast, t.render_reference(&input).expect("renders"), "{}", case["name"]);
            // A second render must agree too (the mark memo is hit this time).
            assert_eq!(fast, t.render(&input).expect("renders"), "{} (memo)", case["name"]);
            marks += fast.message_ends.len();
        }
        assert!(marks > 100);
    }

    /// A long agent conversation (tool runs, reasoning, both generation-prompt settings),
    /// grown and shrunk so memoized prefix outcomes are reused and invalidated.
    #[test]
    fn marks_equal_reference_on_agent_conversation() {
        let t = fixture_template("qwen_style");
        let mut messages = vec![json!({"role": "system", "content": "You are an agent. 🚀"})];
        for i in 0..12 {
            messages.push(json!({"role": "user", "content": format!("step {i}: naïve 東京")}));
            messages.push(json!({"role": "assistant", "content": "", "reasoning_content": format!("think {i}"),
                "tool_calls": [{"function": {"name": "run", "arguments": {"cmd": format!("ls {i}")}}}]}));
            messages.push(json!({"role": "tool", "content": format!("out {i}")}));
            if i % 2 == 0 {
                messages.push(json!({"role": "tool", "content": "second result"}));
            }
            messages.push(json!({"role": "assistant", "content": format!("<think>\nhm\n</think>\n\ndone {i}")}));
        }
        let tools = Some(vec![json!({"type": "function", "function": {"name": "run"}})]);
        // Growing, then shrinking again: remembered outcomes of longer prompts are checked
        // against shorter ones (and vice versa) without clearing the memo.
        let grow = (1..=messages.len()).step_by(3).chain([messages.len()]);
        let shrink = (1..messages.len()).rev().step_by(2);
        for n in grow.chain(shrink).chain([2, 3, 2]) {
            for add_generation_prompt in [false, true] {
                let input = RenderInput {
                    messages: messages[..n].to_vec(),
                    tools: tools.clone(),
                    add_generation_prompt,
                    ..Default::default()
                };
                assert_eq!(
                    format!("{:?}", t.render(&input)),
                    format!("{:?}", t.render_reference(&input)),
                    "n={n} agp={add_generation_prompt}"
                );
            }
        }
        t.clear_mark_cache();
        let input = RenderInput { messages, tools, add_generation_prompt: true, ..Default::default() };
        let (cold, reference) = (t.render(&input).expect("renders"), t.render_reference(&input).expect("renders"));
        assert_marks_within_budget(&cold, &reference);
    }

    /// A cold render of more than `MARK_EXHAUSTIVE` messages: same text, every mark exact
    /// (one of the reference marks), the marks of the last `MARK_TAIL` messages all present.
    fn assert_marks_within_budget(fast: &Rendered, reference: &Rendered) {
        assert_eq!(fast.text, reference.text);
        assert!(fast.message_ends.iter().all(|m| reference.message_ends.contains(m)), "a mark that is not exact");
        assert!(fast.message_ends.len() <= MARK_EXHAUSTIVE);
        let tail = &reference.message_ends[reference.message_ends.len().saturating_sub(MARK_TAIL)..];
        assert!(tail.iter().all(|m| fast.message_ends.contains(m)), "a tail mark is missing");
    }

    fn chat(n: usize) -> Vec<Json> {
        (0..n)
            .map(
                |i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": format!("m{i} naïve 🚀")}),
            )
            .collect()
    }

    #[test]
    fn probe_selection_is_a_bounded_spread_subset() {
        for n in [0, 1, MARK_EXHAUSTIVE, MARK_EXHAUSTIVE + 1, 100, 8_001] {
            let todo: Vec<usize> = (0..n).map(|k| 2 * k + 1).collect();
            let picked = select_probes(&todo);
            let want = if n <= MARK_EXHAUSTIVE { n } else { MARK_TAIL + MARK_SPREAD };
            assert_eq!(picked.len(), want, "n={n}");
            assert!(picked.windows(2).all(|w| w[0] < w[1]));
            assert!(picked.iter().all(|k| todo.contains(k)));
            if n > MARK_EXHAUSTIVE {
                assert_eq!(&picked[MARK_SPREAD..], &todo[n - MARK_TAIL..]);
                // The spread part reaches both halves of the earlier messages.
                assert!(picked[0] < todo[n / 4] && picked[MARK_SPREAD - 1] > todo[(n - MARK_TAIL) / 2]);
            }
        }
    }

    /// Long conversations: a cold render stays within the probe budget with exact marks;
    /// a conversation growing a few messages per turn (the agent case) gets every mark,
    /// exactly the reference's, because earlier probes are remembered.
    #[test]
    fn long_conversations_keep_exact_marks_within_the_budget() {
        let t = tmpl(CHATML);
        let messages = chat(300);
        let input = RenderInput { messages: messages.clone(), add_generation_prompt: true, ..Default::default() };
        assert_marks_within_budget(&t.render(&input).expect("renders"), &t.render_reference(&input).expect("renders"));
        t.clear_mark_cache();
        for n in (2..=messages.len()).step_by(7) {
            let input =
                RenderInput { messages: messages[..n].to_vec(), add_generation_prompt: true, ..Default::default() };
            assert_eq!(t.render(&input).expect("renders"), t.render_reference(&input).expect("renders"), "n={n}");
        }
    }

    #[test]
    fn cancelled_and_overlong_renders_stop_with_typed_errors() {
        let t = tmpl(CHATML);
        let input = RenderInput { messages: chat(50), add_generation_prompt: true, ..Default::default() };
        let full = t.render(&input).expect("renders").text;
        let cancel = Cancel::new();
        cancel.cancel();
        let cancelled = RenderLimits { cancel, max_bytes: None };
        assert!(matches!(t.render_with(&input, &cancelled), Err(TemplateError::Cancelled)));
        let short = RenderLimits { max_bytes: Some(full.len() - 1), ..Default::default() };
        assert!(
            matches!(t.render_with(&input, &short), Err(TemplateError::TooLong { max_bytes }) if max_bytes == full.len() - 1)
        );
        let exact = RenderLimits { max_bytes: Some(full.len()), ..Default::default() };
        assert_eq!(t.render_with(&input, &exact).expect("fits").text, full);
        // A continued final message: the continuation tag never counts against the limit.
        let cont = RenderInput { messages: chat(4), continue_final_message: true, ..Default::default() };
        let text = t.render_text(&cont).expect("renders");
        let exact = RenderLimits { max_bytes: Some(text.len()), ..Default::default() };
        assert_eq!(t.render_text_with(&cont, &exact).expect("fits"), text);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]
        /// Fuzz of renderer inputs: arbitrary roles, contents, tool calls and flags.
        #[test]
        fn renderer_inputs_never_panic(
            msgs in proptest::collection::vec(("(user|assistant|system|tool|other)", "\\PC{0,12}", proptest::bool::ANY), 0..6),
            gen_prompt in proptest::bool::ANY,
            cont in proptest::bool::ANY,
        ) {
            let src = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/frontend/qwen_style/chat_template.jinja")).expect("template");
            let t = tmpl(&src);
            let messages = msgs.into_iter().map(|(role, content, call)| {
                let mut m = json!({"role": role, "content": content});
                if call { m["tool_calls"] = json!([{"function": {"name": "f", "arguments": {"x": content}}}]); }
                m
            }).collect();
            let input = RenderInput { messages, tools: Some(vec![json!({"name": "f"})]), add_generation_prompt: gen_prompt, continue_final_message: cont, ..Default::default() };
            let r = t.render(&input);
            proptest::prop_assert_eq!(format!("{r:?}"), format!("{:?}", t.render_reference(&input)));
            if let Ok(r) = r {
                proptest::prop_assert!(r.message_ends.windows(2).all(|w| w[0] < w[1]));
                proptest::prop_assert!(r.message_ends.iter().all(|&e| e > 0 && e < r.text.len() && r.text.is_char_boundary(e)));
            }
        }
    }
}
