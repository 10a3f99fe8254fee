//! Python `json.dumps` formatting, as Transformers' `tojson` filter produces it.

use serde_json::Value;

/// Options of `json.dumps` that chat templates use.
#[derive(Clone, Debug, Default)]
pub(crate) struct PyJsonOptions {
    pub(crate) ensure_ascii: bool,
    pub(crate) indent: Option<String>,
    pub(crate) item_sep: Option<String>,
    pub(crate) key_sep: Option<String>,
    pub(crate) sort_keys: bool,
}

/// Formats `v` exactly like `json.dumps(v, ...)` with the given options.
pub(crate) fn dumps(v: &Value, opts: &PyJsonOptions) -> String {
    let mut out = String::new();
    let item_sep =
        opts.item_sep.clone().unwrap_or_else(|| if opts.indent.is_some() { ",".into() } else { ", ".into() });
    let key_sep = opts.key_sep.clone().unwrap_or_else(|| ": ".into());
    write_value(&mut out, v, opts, &item_sep, &key_sep, 0);
    out
}

fn newline(out: &mut String, indent: &Option<String>, level: usize) {
    if let Some(ind) = indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(ind);
        }
    }
}

fn write_value(out: &mut String, v: &Value, o: &PyJsonOptions, isep: &str, ksep: &str, level: usize) {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => {
            if n.is_f64() {
                out.push_str(&py_float(n.as_f64().unwrap_or(f64::NAN)));
            } else {
                out.push_str(&n.to_string());
            }
        }
        Value::String(s) => write_str(out, s, o.ensure_ascii),
        Value::Array(a) => {
            if a.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(isep);
                }
                newline(out, &o.indent, level + 1);
                write_value(out, x, o, isep, ksep, level + 1);
            }
            newline(out, &o.indent, level);
            out.push(']');
        }
        Value::Object(m) => {
            if m.is_empty() {
                out.push_str("{}");
                return;
            }
            let mut entries: Vec<(&String, &Value)> = m.iter().collect();
            if o.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, x)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(isep);
                }
                newline(out, &o.indent, level + 1);
                write_str(out, k, o.ensure_ascii);
                out.push_str(ksep);
                write_value(out, x, o, isep, ksep, level + 1);
            }
            newline(out, &o.indent, level);
            out.push('}');
        }
    }
}

fn write_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for u in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{:04x}", u));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python `repr(float)`.
pub(crate) fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    // Shortest round-trip digits in scientific form: "-1.2345e3".
    let sci = format!("{f:e}");
    let (mant, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let neg = mant.starts_with('-');
    let digits: String = mant.chars().filter(char::is_ascii_digit).collect();
    let sign = if neg { "-" } else { "" };
    if (-4..16).contains(&exp) {
        let point = exp + 1;
        let s = if point <= 0 {
            format!("0.{}{}", "0".repeat((-point) as usize), digits)
        } else if point as usize >= digits.len() {
            format!("{}{}.0", digits, "0".repeat(point as usize - digits.len()))
        } else {
            format!("{}.{}", &digits[..point as usize], &digits[point as usize..])
        };
        format!("{sign}{s}")
    } else {
        let m = if digits.len() > 1 { format!("{}.{}", &digits[..1], &digits[1..]) } else { digits };
        let es = if exp < 0 { "-" } else { "+" };
        format!("{sign}{m}e{es}{:02}", exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn matches_python_defaults() {
        let v = json!({"b": [1, 2.5, "é\n"], "a": {"x": null, "y": true}, "c": {}});
        assert_eq!(
            dumps(&v, &PyJsonOptions::default()),
            r#"{"b": [1, 2.5, "é\n"], "a": {"x": null, "y": true}, "c": {}}"#
        );
        let o = PyJsonOptions { indent: Some("  ".into()), sort_keys: true, ensure_ascii: true, ..Default::default() };
        assert_eq!(
            dumps(&json!({"b": ["😀"], "a": 1}), &o),
            "{\n  \"a\": 1,\n  \"b\": [\n    \"\\ud83d\\ude00\"\n  ]\n}"
        );
    }

    #[test]
    fn floats_like_repr() {
        for (f, s) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1e16, "1e+16"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (-2.5e20, "-2.5e+20"),
            (123456.789, "123456.789"),
        ] {
            assert_eq!(py_float(f), s);
        }
    }
}
