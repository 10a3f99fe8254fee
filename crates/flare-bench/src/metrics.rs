//! A small parser for the Prometheus text exposition format (version 0.0.4).

/// One sample line: `name{labels} value [timestamp]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Metric name (for histograms this includes the `_bucket`/`_sum`/`_count` suffix).
    pub name: String,
    /// Label pairs in the order written, values unescaped.
    pub labels: Vec<(String, String)>,
    /// The sample value (`+Inf`, `-Inf` and `NaN` accepted).
    pub value: f64,
}

/// Parses every sample in `text`, skipping `#` comment/metadata lines and blank lines.
/// Returns `Err` naming the first malformed line.
pub fn parse(text: &str) -> Result<Vec<Sample>, String> {
    let mut out = Vec::new();
    for (no, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        out.push(parse_line(line).map_err(|e| format!("line {}: {e}: {raw:?}", no + 1))?);
    }
    Ok(out)
}

/// Sum of the values of every sample named exactly `name` (all label sets), or `None` when the
/// metric does not appear.
pub fn sum(samples: &[Sample], name: &str) -> Option<f64> {
    let mut found = false;
    let mut total = 0.0;
    for s in samples.iter().filter(|s| s.name == name) {
        found = true;
        total += s.value;
    }
    found.then_some(total)
}

fn parse_line(line: &str) -> Result<Sample, String> {
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace()).ok_or("no value")?;
    let name = &line[..name_end];
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':') {
        return Err(format!("bad metric name {name:?}"));
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(after) = rest.strip_prefix('{') {
        let (parsed, tail) = parse_labels(after)?;
        labels = parsed;
        rest = tail;
    }
    let mut fields = rest.split_whitespace();
    let value = fields.next().ok_or("no value")?;
    let value = match value {
        "+Inf" | "Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        "NaN" => f64::NAN,
        v => v.parse::<f64>().map_err(|e| format!("bad value {v:?}: {e}"))?,
    };
    if let Some(ts) = fields.next() {
        ts.parse::<i64>().map_err(|e| format!("bad timestamp {ts:?}: {e}"))?;
    }
    if fields.next().is_some() {
        return Err("trailing fields".into());
    }
    Ok(Sample { name: name.to_string(), labels, value })
}

type Labels = Vec<(String, String)>;

/// Parses `k="v",k2="v2"}` (the text after `{`); returns the labels and the text after `}`.
fn parse_labels(mut s: &str) -> Result<(Labels, &str), String> {
    let mut labels = Vec::new();
    loop {
        s = s.trim_start();
        if let Some(tail) = s.strip_prefix('}') {
            return Ok((labels, tail));
        }
        let eq = s.find('=').ok_or("label without '='")?;
        let key = s[..eq].trim().to_string();
        s = s[eq + 1..].trim_start();
        s = s.strip_prefix('"').ok_or("label value not quoted")?;
        let mut value = String::new();
        let mut chars = s.char_indices();
        let end = loop {
            match chars.next() {
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c)) => value.push(c),
                    None => return Err("unterminated escape".into()),
                },
                Some((_, c)) => value.push(c),
                None => return Err("unterminated label value".into()),
            }
        };
        labels.push((key, value));
        s = s[end + 1..].trim_start();
        if let Some(tail) = s.strip_prefix(',') {
            s = tail;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP flare_requests_finished_total Requests finished.
# TYPE flare_requests_finished_total counter
flare_requests_finished_total{outcome="stop"} 10
flare_requests_finished_total{outcome="cancelled",why="a \"quoted\", {brace}"} 3 1700000000000
flare_running_requests 0
flare_ttft_seconds_bucket{le="+Inf"} 13
flare_weird NaN

"#;

    #[test]
    fn parses_and_sums_over_labels() {
        let s = parse(TEXT).expect("valid exposition");
        assert_eq!(s.len(), 5);
        assert_eq!(sum(&s, "flare_requests_finished_total"), Some(13.0));
        assert_eq!(sum(&s, "flare_running_requests"), Some(0.0));
        assert_eq!(sum(&s, "flare_missing"), None);
        assert_eq!(s[1].labels[1], ("why".to_string(), "a \"quoted\", {brace}".to_string()));
        assert_eq!(s[3].labels[0].1, "+Inf");
        assert!(s[4].value.is_nan());
        // Prefix names do not match.
        assert_eq!(sum(&s, "flare_requests_finished"), None);
    }

    #[test]
    fn rejects_malformed_lines() {
        assert!(parse("flare_x").is_err());
        assert!(parse("flare_x{a=\"b\" 1").is_err());
        assert!(parse("flare_x abc").is_err());
        assert!(parse("flare_x 1 2 3").is_err());
        assert!(parse("bad-name 1").is_err());
        assert!(parse("flare_x{a=b} 1").is_err());
    }
}
