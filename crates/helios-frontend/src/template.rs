//! Chat templates rendered with minijinja the way Transformers' `apply_chat_template` does.
//!
//! Byte marks: after the full render, each prefix `messages[..k]` is rendered without a
//! generation prompt; when that text is a byte prefix of the full render, its length is
//! the end of message `k`. This is exact (no sentinel ever enters the prompt) and
//! template-agnostic; a prefix that fails to render or diverges simply yields no mark.

use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind, State};
use serde_json::{Map, Value as Json};

use crate::error::TemplateError;
use crate::jsonfmt::{PyJsonOptions, dumps};

const TEMPLATE_NAME: &str = "chat";
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";
const RAISED_PREFIX: &str = "raise_exception: ";
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

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

fn alias_reasoning(messages: &[Json]) -> Vec<Json> {
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
        Ok(ChatTemplate { env, special_tokens: config.special_tokens.clone(), reads_content })
    }

    fn render_raw(
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

    /// Renders the prompt text only (no marks).
    pub fn render_text(&self, input: &RenderInput) -> Result<String, TemplateError> {
        if input.continue_final_message && input.add_generation_prompt {
            return Err(TemplateError::ContinueWithGenerationPrompt);
        }
        let mut messages = alias_reasoning(&input.messages);
        if !input.continue_final_message {
            return self.render_raw(&messages, input, input.add_generation_prompt);
        }
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
        let text = self.render_raw(&messages, input, false)?;
        let tag = CONTINUE_TAG.trim();
        if !text.contains(final_text.trim()) {
            return Err(TemplateError::ContinuationLost);
        }
        let loc = text.rfind(tag).ok_or(TemplateError::ContinuationLost)?;
        if text[loc..].starts_with(CONTINUE_TAG) {
            Ok(text[..loc].to_string())
        } else {
            Ok(text[..loc].trim_end().to_string())
        }
    }

    /// Renders the prompt and records the byte end of every completed message (and of a
    /// nonempty preamble rendered for zero messages). The open generation header and an
    /// open continued message are never marked.
    pub fn render(&self, input: &RenderInput) -> Result<Rendered, TemplateError> {
        let text = self.render_text(input)?;
        let messages = alias_reasoning(&input.messages);
        let complete = if input.continue_final_message { messages.len().saturating_sub(1) } else { messages.len() };
        let mut message_ends = Vec::with_capacity(complete + 1);
        for k in 0..=complete {
            let Ok(prefix) = self.render_raw(&messages[..k], input, false) else { continue };
            let end = prefix.len();
            if end > 0 && end < text.len() && text.as_bytes().starts_with(prefix.as_bytes()) {
                message_ends.push(end);
            }
        }
        message_ends.sort_unstable();
        message_ends.dedup();
        Ok(Rendered { text, message_ends })
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
            if let Ok(r) = t.render(&input) {
                proptest::prop_assert!(r.message_ends.windows(2).all(|w| w[0] < w[1]));
                proptest::prop_assert!(r.message_ends.iter().all(|&e| e > 0 && e < r.text.len() && r.text.is_char_boundary(e)));
            }
        }
    }
}
