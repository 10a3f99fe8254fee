//! Shared request-parameter validation (OpenAI ranges) and message normalization.

use helios_frontend::{AnswerFormat, SamplingRequest, ToolChoice};
use serde::Deserialize;
use serde_json::{Map, Value as Json};

use crate::error::{ApiCode, ApiError};
use helios_worker::ErrorCode;

/// `stop`: one string or a list.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum StopSpec {
    One(String),
    Many(Vec<String>),
}

impl StopSpec {
    pub(crate) fn into_vec(self) -> Vec<String> {
        match self {
            StopSpec::One(s) => vec![s],
            StopSpec::Many(v) => v,
        }
    }
}

fn range(name: &str, v: Option<f64>, lo: f64, hi: f64, lo_open: bool) -> Result<(), ApiError> {
    if let Some(x) = v {
        let below = if lo_open { x <= lo } else { x < lo };
        if !x.is_finite() || below || x > hi {
            let open = if lo_open { "(" } else { "[" };
            return Err(ApiError::invalid(
                ErrorCode::InvalidParameter,
                Some(name),
                format!("`{name}` must be in {open}{lo}, {hi}], got {x}"),
            ));
        }
    }
    Ok(())
}

/// Sampling controls as clients send them.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RawSampling {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<f64>,
    pub min_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub max_tokens: Option<i64>,
}

impl RawSampling {
    /// Checks OpenAI's documented ranges; the core's ranges clamp afterwards. Temperature 0
    /// asks for greedy decoding (`helios_frontend::sampling::resolve_sampling`).
    pub(crate) fn validate(self, max_tokens_param: &str) -> Result<SamplingRequest, ApiError> {
        range("temperature", self.temperature, 0.0, 2.0, false)?;
        range("top_p", self.top_p, 0.0, 1.0, true)?;
        range("min_p", self.min_p, 0.0, 1.0, false)?;
        range("presence_penalty", self.presence_penalty, -2.0, 2.0, false)?;
        range("frequency_penalty", self.frequency_penalty, -2.0, 2.0, false)?;
        range("repetition_penalty", self.repetition_penalty, 0.0, f64::MAX, true)?;
        if let Some(k) = self.top_k
            && (!k.is_finite() || k < -1.0 || k.fract() != 0.0)
        {
            return Err(ApiError::invalid(
                ErrorCode::InvalidParameter,
                Some("top_k"),
                "`top_k` must be an integer >= -1",
            ));
        }
        let max_output_tokens = match self.max_tokens {
            None => None,
            Some(n) if n >= 1 => Some(u32::try_from(n).unwrap_or(u32::MAX)),
            Some(n) => {
                return Err(ApiError::invalid(
                    ErrorCode::InvalidMaxTokens,
                    Some(max_tokens_param),
                    format!("`{max_tokens_param}` must be at least 1, got {n}"),
                ));
            }
        };
        Ok(SamplingRequest {
            temperature: self.temperature,
            top_k: self.top_k.map(|k| if k < 0.0 { 0.0 } else { k }),
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            max_output_tokens,
        })
    }
}

/// OpenAI parameters Flare does not implement. Sent with an effect they are refused (400
/// `unsupported_parameter`), never accepted and silently ignored; their neutral values
/// (empty `logit_bias`, `best_of` 1, `top_logprobs` 0) pass.
#[derive(Clone, Debug, Default, Deserialize)]
pub(crate) struct Unsupported {
    logit_bias: Option<Map<String, Json>>,
    best_of: Option<i64>,
    top_logprobs: Option<i64>,
}

impl Unsupported {
    pub(crate) fn check(&self) -> Result<(), ApiError> {
        let refuse = |name: &'static str, what: &str| {
            Err(ApiError::invalid(
                ApiCode::UnsupportedParameter,
                Some(name),
                format!("`{name}` is not supported: {what}"),
            ))
        };
        if self.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
            return refuse("logit_bias", "sampling has no per-token bias");
        }
        if self.best_of.is_some_and(|b| b != 1) {
            return refuse("best_of", "use `n` for several completions");
        }
        if self.top_logprobs.is_some_and(|t| t != 0) {
            return refuse("top_logprobs", "logprobs are not returned");
        }
        Ok(())
    }
}

/// `n`.
pub(crate) fn choices(n: Option<i64>) -> Result<u32, ApiError> {
    match n {
        None => Ok(1),
        Some(n) if (1..=i64::from(helios_worker::MAX_CHOICES)).contains(&n) => Ok(n as u32),
        Some(n) => Err(ApiError::invalid(
            ErrorCode::InvalidChoiceCount,
            Some("n"),
            format!("`n` must be between 1 and {}, got {n}", helios_worker::MAX_CHOICES),
        )),
    }
}

/// `seed` (any integer; negative values wrap).
pub(crate) fn seed(v: Option<i64>) -> Option<u64> {
    v.map(|s| s as u64)
}

/// OpenAI `response_format` (plus a `regex` extension). Schemas are free form, so they stay
/// JSON values.
pub(crate) fn answer_format(v: Option<&Json>) -> Result<AnswerFormat, ApiError> {
    let Some(v) = v else { return Ok(AnswerFormat::Text) };
    let bad = |m: &str| ApiError::invalid(ApiCode::InvalidResponseFormat, Some("response_format"), m.to_owned());
    match v.get("type").and_then(Json::as_str) {
        Some("text") => Ok(AnswerFormat::Text),
        Some("json_object") => Ok(AnswerFormat::JsonSchema(compact(serde_json::json!({"type": "object"})))),
        Some("json_schema") => {
            let schema = v
                .get("json_schema")
                .and_then(|s| s.get("schema"))
                .ok_or_else(|| bad("json_schema.schema is required"))?;
            if !schema.is_object() {
                return Err(bad("json_schema.schema must be an object"));
            }
            Ok(AnswerFormat::JsonSchema(compact(schema.clone())))
        }
        Some("regex") => match v.get("regex").and_then(Json::as_str) {
            Some(r) => Ok(AnswerFormat::Regex(r.to_owned())),
            None => Err(bad("regex response_format needs a `regex` string")),
        },
        _ => Err(bad("response_format.type must be text, json_object, json_schema or regex")),
    }
}

/// JSON answers use Python's `", "` / `": "` separators and no free whitespace (llguidance's
/// `x-guidance`), unless the schema chooses otherwise: unbounded whitespace lets a
/// sampler pad forever without ever closing the value.
fn compact(mut schema: Json) -> Json {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance").or_insert_with(
            || serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    schema
}

/// OpenAI `tool_choice`.
pub(crate) fn tool_choice(v: Option<&Json>, has_tools: bool) -> Result<ToolChoice, ApiError> {
    let bad = |m: String| ApiError::invalid(ApiCode::InvalidToolChoice, Some("tool_choice"), m);
    let choice = match v {
        None => return Ok(if has_tools { ToolChoice::Auto } else { ToolChoice::None }),
        Some(Json::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => return Err(bad(format!("unknown tool_choice {other:?}"))),
        },
        Some(obj @ Json::Object(_)) => {
            let name = obj
                .get("function")
                .and_then(|f| f.get("name"))
                .or_else(|| obj.get("name"))
                .and_then(Json::as_str)
                .ok_or_else(|| bad("a named tool_choice needs function.name".into()))?;
            ToolChoice::Named(name.to_owned())
        }
        Some(_) => return Err(bad("tool_choice must be a string or an object".into())),
    };
    if !has_tools && !matches!(choice, ToolChoice::None) {
        return Err(bad("tool_choice requires `tools`".into()));
    }
    Ok(choice)
}

/// Validates OpenAI tool definitions (`{"type": "function", "function": {"name", …}}`).
pub(crate) fn tools(v: Option<Vec<Json>>) -> Result<Vec<Json>, ApiError> {
    let tools = v.unwrap_or_default();
    for (i, t) in tools.iter().enumerate() {
        let f = t.get("function").unwrap_or(t);
        if f.get("name").and_then(Json::as_str).is_none_or(str::is_empty) {
            return Err(ApiError::invalid(
                ApiCode::InvalidTools,
                Some("tools"),
                format!("tools[{i}] lacks function.name"),
            ));
        }
        if f.get("strict").and_then(Json::as_bool) == Some(true) {
            return Err(ApiError::invalid(
                ApiCode::UnsupportedParameter,
                Some("tools"),
                format!("tools[{i}]: strict function schemas are not supported"),
            ));
        }
    }
    Ok(tools)
}

/// Text of OpenAI content: a string, or a list of `text` parts.
pub(crate) fn text_content(v: &Json, param: &str) -> Result<Option<String>, ApiError> {
    match v {
        Json::Null => Ok(None),
        Json::String(s) => Ok(Some(s.clone())),
        Json::Array(parts) => {
            let mut out = String::new();
            for p in parts {
                match p.get("type").and_then(Json::as_str) {
                    Some("text" | "input_text" | "output_text") => {
                        out.push_str(p.get("text").and_then(Json::as_str).unwrap_or_default())
                    }
                    Some(other) => {
                        return Err(ApiError::invalid(
                            ApiCode::UnsupportedContent,
                            Some(param),
                            format!("content part type {other:?} is not supported by this model"),
                        ));
                    }
                    None => {
                        return Err(ApiError::invalid(
                            ApiCode::InvalidContent,
                            Some(param),
                            "content part lacks `type`",
                        ));
                    }
                }
            }
            Ok(Some(out))
        }
        _ => {
            Err(ApiError::invalid(ApiCode::InvalidContent, Some(param), "content must be a string or a list of parts"))
        }
    }
}

/// Normalizes OpenAI chat messages for templates: text parts joined, tool-call
/// arguments parsed from JSON strings into objects (what chat templates expect).
pub(crate) fn normalize_messages(messages: Vec<Json>) -> Result<Vec<Json>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid(ApiCode::EmptyMessages, Some("messages"), "`messages` must not be empty"));
    }
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.into_iter().enumerate() {
        let Json::Object(mut m) = m else {
            return Err(ApiError::invalid(
                ApiCode::InvalidMessage,
                Some("messages"),
                format!("messages[{i}] is not an object"),
            ));
        };
        let role = m.get("role").and_then(Json::as_str).unwrap_or_default().to_owned();
        let role = if role == "developer" { "system".to_owned() } else { role };
        if !matches!(role.as_str(), "system" | "user" | "assistant" | "tool") {
            return Err(ApiError::invalid(
                ApiCode::InvalidRole,
                Some("messages"),
                format!("messages[{i}].role must be system, developer, user, assistant or tool"),
            ));
        }
        m.insert("role".into(), Json::String(role.clone()));
        let content = text_content(m.get("content").unwrap_or(&Json::Null), "messages")?;
        match content {
            Some(c) => m.insert("content".into(), Json::String(c)),
            None if role == "assistant" => m.insert("content".into(), Json::String(String::new())),
            None => {
                return Err(ApiError::invalid(
                    ApiCode::InvalidContent,
                    Some("messages"),
                    format!("messages[{i}] ({role}) needs content"),
                ));
            }
        };
        if let Some(Json::Array(calls)) = m.get_mut("tool_calls") {
            for call in calls.iter_mut() {
                if let Some(Json::String(args)) = call.get("function").and_then(|f| f.get("arguments")).cloned()
                    && let Ok(parsed @ Json::Object(_)) = serde_json::from_str::<Json>(&args)
                    && let Some(f) = call.get_mut("function").and_then(Json::as_object_mut)
                {
                    f.insert("arguments".into(), parsed);
                }
            }
        }
        out.push(Json::Object(m));
    }
    Ok(out)
}

/// `chat_template_kwargs`.
pub(crate) fn template_kwargs(v: Option<Map<String, Json>>) -> Map<String, Json> {
    v.unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn ranges_reject_out_of_bounds() {
        let ok = RawSampling { temperature: Some(0.7), top_p: Some(1.0), max_tokens: Some(5), ..Default::default() };
        assert!(ok.validate("max_tokens").is_ok());
        let greedy = RawSampling { temperature: Some(0.0), ..Default::default() };
        assert_eq!(greedy.validate("max_tokens").expect("greedy").temperature, Some(0.0));
        for bad in [
            RawSampling { temperature: Some(-0.1), ..Default::default() },
            RawSampling { temperature: Some(2.5), ..Default::default() },
            RawSampling { top_p: Some(2.0), ..Default::default() },
            RawSampling { max_tokens: Some(0), ..Default::default() },
            RawSampling { top_k: Some(1.5), ..Default::default() },
        ] {
            let e = bad.validate("max_tokens").expect_err("rejected");
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
        }
    }

    #[test]
    fn messages_are_normalized() {
        let m = normalize_messages(vec![
            json!({"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}),
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "f", "arguments": "{\"x\": 1}"}}]}),
        ])
        .expect("valid");
        assert_eq!(m[0], json!({"role": "system", "content": "ab"}));
        assert_eq!(m[1]["tool_calls"][0]["function"]["arguments"], json!({"x": 1}));
        assert_eq!(m[1]["content"], json!(""));
        assert!(normalize_messages(vec![json!({"role": "wizard", "content": "x"})]).is_err());
        assert!(normalize_messages(vec![json!({"role": "user", "content": [{"type": "image_url"}]})]).is_err());
    }

    #[test]
    fn tool_choice_forms() {
        assert_eq!(tool_choice(None, true).expect("ok"), ToolChoice::Auto);
        assert_eq!(tool_choice(None, false).expect("ok"), ToolChoice::None);
        let named = json!({"type": "function", "function": {"name": "f"}});
        assert_eq!(tool_choice(Some(&named), true).expect("ok"), ToolChoice::Named("f".into()));
        assert!(tool_choice(Some(&json!("required")), false).is_err());
        assert!(tool_choice(Some(&json!("sometimes")), true).is_err());
    }
}
