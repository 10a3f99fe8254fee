//! Incremental Server-Sent Events parsing and OpenAI-style stream classification.
//!
//! [`SseParser`] turns arbitrary byte chunks (split anywhere, even inside a UTF-8 sequence or a
//! `\r\n` pair) into complete [`SseEvent`]s following the WHATWG event-stream rules: `\n`, `\r\n`
//! or `\r` end a line, a blank line dispatches the event, lines starting with `:` are comments,
//! multiple `data:` lines join with `\n`, and one space after the colon is stripped.
//! [`classify`] then maps an event to the OpenAI streaming protocol: `[DONE]`, an error (an
//! `event: error` or a JSON payload carrying an `error` object), or a JSON data payload.

use serde_json::Value;

/// One dispatched event.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SseEvent {
    /// The `event:` field, when present.
    pub event: Option<String>,
    /// The `data:` lines joined with `\n`.
    pub data: String,
    /// The `id:` field, when present.
    pub id: Option<String>,
}

/// Byte-level incremental parser.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
    /// The previous chunk ended in `\r`; a leading `\n` in the next chunk belongs to it.
    skip_lf: bool,
    event: Option<String>,
    data: Vec<String>,
    id: Option<String>,
    saw_data: bool,
}

impl SseParser {
    /// A parser with no buffered input.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds a chunk of bytes and returns every event it completed.
    pub fn feed(&mut self, chunk: &[u8]) -> Vec<SseEvent> {
        let mut out = Vec::new();
        let mut rest = chunk;
        if self.skip_lf && !rest.is_empty() {
            if let Some((&b'\n', tail)) = rest.split_first() {
                rest = tail;
            }
            self.skip_lf = false;
        }
        self.buf.extend_from_slice(rest);
        let mut start = 0;
        let mut i = 0;
        while i < self.buf.len() {
            match self.buf[i] {
                b'\n' => {
                    let line = self.buf[start..i].to_vec();
                    self.line(&line, &mut out);
                    i += 1;
                    start = i;
                }
                b'\r' => {
                    let line = self.buf[start..i].to_vec();
                    self.line(&line, &mut out);
                    i += 1;
                    if i < self.buf.len() {
                        if self.buf[i] == b'\n' {
                            i += 1;
                        }
                    } else {
                        self.skip_lf = true;
                    }
                    start = i;
                }
                _ => i += 1,
            }
        }
        self.buf.drain(..start);
        out
    }

    /// Ends the stream. Per the event-stream rules an event not terminated by a blank line is
    /// discarded; this returns whether such an incomplete event (or partial line) was pending.
    pub fn finish(&mut self) -> bool {
        let pending = !self.buf.is_empty() || self.saw_data || self.event.is_some();
        self.buf.clear();
        self.reset();
        pending
    }

    fn reset(&mut self) {
        self.event = None;
        self.data.clear();
        self.id = None;
        self.saw_data = false;
    }

    fn line(&mut self, raw: &[u8], out: &mut Vec<SseEvent>) {
        if raw.is_empty() {
            if self.saw_data || self.event.is_some() {
                out.push(SseEvent { event: self.event.take(), data: self.data.join("\n"), id: self.id.take() });
            }
            self.reset();
            return;
        }
        let line = String::from_utf8_lossy(raw);
        if line.starts_with(':') {
            return;
        }
        let (field, value) = match line.find(':') {
            Some(pos) => {
                let value = &line[pos + 1..];
                (&line[..pos], value.strip_prefix(' ').unwrap_or(value))
            }
            None => (&line[..], ""),
        };
        match field {
            "data" => {
                self.data.push(value.to_string());
                self.saw_data = true;
            }
            "event" => self.event = Some(value.to_string()),
            "id" => self.id = Some(value.to_string()),
            _ => {}
        }
    }
}

/// What an event means in the OpenAI streaming protocol.
#[derive(Debug, Clone, PartialEq)]
pub enum StreamItem {
    /// The `data: [DONE]` success marker.
    Done,
    /// An error event: `event: error`, or a JSON payload with an `error` object (or
    /// `"type": "error"`, the Anthropic form). Holds the payload (JSON when it parses).
    Error(Value),
    /// A regular JSON payload.
    Data(Value),
}

/// Classifies one event. Returns `Err` with a description when a non-error payload is not JSON.
pub fn classify(ev: &SseEvent) -> Result<StreamItem, String> {
    let data = ev.data.trim();
    if data == "[DONE]" {
        return Ok(StreamItem::Done);
    }
    let parsed: Option<Value> = serde_json::from_str(data).ok();
    if ev.event.as_deref() == Some("error") {
        return Ok(StreamItem::Error(parsed.unwrap_or_else(|| Value::String(data.to_string()))));
    }
    match parsed {
        Some(v) => {
            let is_error =
                v.get("error").is_some_and(|e| !e.is_null()) || v.get("type").and_then(Value::as_str) == Some("error");
            Ok(if is_error { StreamItem::Error(v) } else { StreamItem::Data(v) })
        }
        None => Err(format!("SSE data is neither [DONE] nor JSON: {:?}", truncate(data, 200))),
    }
}

/// A short description of an error payload: its `type`/`code` and `message`.
pub fn error_summary(v: &Value) -> String {
    let inner = v.get("error").filter(|e| e.is_object()).unwrap_or(v);
    let kind = inner
        .get("code")
        .and_then(Value::as_str)
        .or_else(|| inner.get("type").and_then(Value::as_str))
        .unwrap_or("unknown");
    let msg = inner.get("message").and_then(Value::as_str).unwrap_or_default();
    format!("{kind}: {}", truncate(msg, 200))
}

pub(crate) fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn feed_all(chunks: &[&[u8]]) -> Vec<SseEvent> {
        let mut p = SseParser::new();
        chunks.iter().flat_map(|c| p.feed(c)).collect()
    }

    #[test]
    fn parses_data_lines_and_done() {
        let evs = feed_all(&[b"data: {\"a\":1}\n\ndata: [DONE]\n\n"]);
        assert_eq!(evs.len(), 2);
        assert_eq!(evs[0].data, "{\"a\":1}");
        assert_eq!(classify(&evs[0]), Ok(StreamItem::Data(json!({"a": 1}))));
        assert_eq!(classify(&evs[1]), Ok(StreamItem::Done));
    }

    #[test]
    fn splits_anywhere_including_crlf_and_utf8() {
        let whole = "event: message\r\ndata: {\"t\":\"h\u{e9}llo\"}\r\n\r\ndata: [DONE]\r\n\r\n".as_bytes();
        for cut in 0..whole.len() {
            let evs = feed_all(&[&whole[..cut], &whole[cut..]]);
            assert_eq!(evs.len(), 2, "cut at {cut}");
            assert_eq!(evs[0].event.as_deref(), Some("message"));
            assert_eq!(classify(&evs[0]), Ok(StreamItem::Data(json!({"t": "h\u{e9}llo"}))), "cut at {cut}");
            assert_eq!(classify(&evs[1]), Ok(StreamItem::Done));
        }
        // Byte by byte.
        let mut p = SseParser::new();
        let evs: Vec<_> = whole.iter().flat_map(|b| p.feed(std::slice::from_ref(b))).collect();
        assert_eq!(evs.len(), 2);
        assert!(!p.finish());
    }

    #[test]
    fn lone_cr_ends_lines() {
        let evs = feed_all(&[b"data: x\r\rdata: y\r", b"\r"]);
        assert_eq!(evs.iter().map(|e| e.data.as_str()).collect::<Vec<_>>(), vec!["x", "y"]);
        // A `\r\n` split across chunks followed by a `\n` blank line in a later chunk.
        let evs = feed_all(&[b"data: z\r", b"\n", b"\n"]);
        assert_eq!(evs.iter().map(|e| e.data.as_str()).collect::<Vec<_>>(), vec!["z"]);
    }

    #[test]
    fn comments_multiline_and_field_rules() {
        let evs = feed_all(&[b": keep-alive\n\ndata:a\ndata:  b\nid: 7\nretry: 10\n\n"]);
        assert_eq!(evs.len(), 1, "a comment-only block dispatches nothing");
        assert_eq!(evs[0].data, "a\n b");
        assert_eq!(evs[0].id.as_deref(), Some("7"));
    }

    #[test]
    fn error_forms_are_recognised() {
        let ev = SseEvent {
            event: Some("error".into()),
            data: "{\"error\":{\"message\":\"boom\",\"code\":\"x\"}}".into(),
            id: None,
        };
        let item = classify(&ev);
        let Ok(StreamItem::Error(v)) = item else { panic!("expected error, got {item:?}") };
        assert_eq!(error_summary(&v), "x: boom");

        let ev = SseEvent {
            event: None,
            data: "{\"error\":{\"message\":\"m\",\"type\":\"server_error\"}}".into(),
            id: None,
        };
        assert!(matches!(classify(&ev), Ok(StreamItem::Error(_))));

        let ev = SseEvent { event: Some("error".into()), data: "not json".into(), id: None };
        assert_eq!(classify(&ev), Ok(StreamItem::Error(Value::String("not json".into()))));

        let anthropic = SseEvent {
            event: None,
            data: "{\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"busy\"}}".into(),
            id: None,
        };
        let Ok(StreamItem::Error(v)) = classify(&anthropic) else { panic!("anthropic error not recognised") };
        assert_eq!(error_summary(&v), "overloaded_error: busy");

        // `"error": null` is not an error.
        let ev = SseEvent { event: None, data: "{\"error\":null,\"x\":1}".into(), id: None };
        assert!(matches!(classify(&ev), Ok(StreamItem::Data(_))));
    }

    #[test]
    fn non_json_data_is_a_protocol_error() {
        let ev = SseEvent { event: None, data: "garbage".into(), id: None };
        assert!(classify(&ev).is_err());
    }

    #[test]
    fn unterminated_event_is_reported_by_finish() {
        let mut p = SseParser::new();
        assert!(p.feed(b"data: [DONE]\n").is_empty());
        assert!(p.finish());
        assert!(!p.finish());
    }

    #[test]
    fn truncate_respects_char_boundaries() {
        assert_eq!(truncate("h\u{e9}llo", 2), "h");
        assert_eq!(truncate("abc", 10), "abc");
    }
}
