//! Python's `json.dumps` for template values: the `tojson` filter HF transformers installs in
//! its chat-template environment (`ensure_ascii=False`, `", "` / `": "` separators, keys in
//! insertion order, floats as Python's `repr`). minijinja's own `tojson` is compact and
//! HTML-escapes `<>&'`, which would change the rendered prompt and so its tokens.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};

/// Options of `json.dumps` that templates pass to `tojson`.
#[derive(Debug, Clone, Default)]
pub struct DumpOptions {
    pub indent: Option<String>,
    pub item_sep: Option<String>,
    pub key_sep: Option<String>,
    pub sort_keys: bool,
}

/// The `tojson` filter: `x | tojson(indent=None, separators=None, sort_keys=False)`.
pub fn tojson_filter(
    value: &Value,
    indent: Option<Value>,
    kwargs: Kwargs,
) -> Result<String, Error> {
    let indent = match indent {
        Some(i) => Some(i),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let mut opts = DumpOptions::default();
    if let Some(indent) = indent.filter(|v| !v.is_none() && !v.is_undefined()) {
        opts.indent = Some(match indent.as_str() {
            Some(s) => s.to_string(),
            None => {
                let n = i64::try_from(indent.clone()).map_err(|_| {
                    Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: indent must be an int or str",
                    )
                })?;
                " ".repeat(n.max(0) as usize)
            }
        });
    }
    if let Some(seps) = kwargs.get::<Option<Value>>("separators")? {
        if !seps.is_none() {
            let item = seps.get_item_by_index(0)?;
            let key = seps.get_item_by_index(1)?;
            match (item.as_str(), key.as_str()) {
                (Some(i), Some(k)) => {
                    opts.item_sep = Some(i.to_string());
                    opts.key_sep = Some(k.to_string());
                }
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair of strings",
                    ))
                }
            }
        }
    }
    opts.sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    // `ensure_ascii` is accepted for compatibility; HF's default (False) is the only behaviour.
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    dumps(value, &opts)
}

/// `json.dumps(value, ensure_ascii=False, ...)`.
pub fn dumps(value: &Value, opts: &DumpOptions) -> Result<String, Error> {
    // Python: with an indent the item separator defaults to "," (no trailing space).
    let item_sep = opts
        .item_sep
        .clone()
        .unwrap_or_else(|| if opts.indent.is_some() { "," } else { ", " }.to_string());
    let key_sep = opts.key_sep.clone().unwrap_or_else(|| ": ".to_string());
    let mut out = String::new();
    write_value(&mut out, value, opts, &item_sep, &key_sep, 0)?;
    Ok(out)
}

fn newline(out: &mut String, indent: &Option<String>, depth: usize) {
    if let Some(ind) = indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(ind);
        }
    }
}

fn write_str(out: &mut String, s: &str) {
    // serde_json escapes exactly what Python does with ensure_ascii=False: `"`, `\`, and
    // control characters below 0x20 (\b \f \n \r \t by name, others as \u00XX).
    match serde_json::to_string(s) {
        Ok(q) => out.push_str(&q),
        Err(_) => out.push_str("\"\""),
    }
}

fn write_value(
    out: &mut String,
    value: &Value,
    opts: &DumpOptions,
    item_sep: &str,
    key_sep: &str,
    depth: usize,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if value.is_integer() {
                let n = i128::try_from(value.clone())?;
                let _ = write!(out, "{n}");
            } else {
                let f = f64::try_from(value.clone())?;
                out.push_str(&python_float_repr(f));
            }
        }
        ValueKind::String => write_str(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, &opts.indent, depth + 1);
                write_value(out, item, opts, item_sep, key_sep, depth + 1)?;
            }
            newline(out, &opts.indent, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if opts.sort_keys {
                keys.sort_by_key(key_string);
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, &opts.indent, depth + 1);
                write_str(out, &key_string(key));
                out.push_str(key_sep);
                let v = value.get_item(key)?;
                write_value(out, &v, opts, item_sep, key_sep, depth + 1)?;
            }
            newline(out, &opts.indent, depth);
            out.push('}');
        }
        ValueKind::Bytes | ValueKind::Plain | ValueKind::Invalid => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!(
                    "tojson: object of kind {} is not JSON serializable",
                    value.kind()
                ),
            ))
        }
        // ValueKind is non-exhaustive.
        _ => write_str(out, &value.to_string()),
    }
    Ok(())
}

/// Python coerces non-string keys: True → "true", None → "null", numbers → their repr.
fn key_string(key: &Value) -> String {
    match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_string(),
        ValueKind::Bool => if key.is_true() { "true" } else { "false" }.to_string(),
        ValueKind::None | ValueKind::Undefined => "null".to_string(),
        _ => key.to_string(),
    }
}

/// Python's `repr(float)` as `json.dumps` prints it: shortest round-trip digits, positional
/// for exponents in [-4, 16), else `d.ddde+XX`; non-finite as `NaN` / `Infinity`.
pub fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // Rust's `{:e}` yields the shortest round-trip digits, e.g. "-1.2345e-5".
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (neg, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let mut out = String::new();
    if neg {
        out.push('-');
    }
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                out.push_str(&digits);
                out.extend(std::iter::repeat_n('0', int_len - digits.len()));
                out.push_str(".0");
            } else {
                out.push_str(&digits[..int_len]);
                out.push('.');
                out.push_str(&digits[int_len..]);
            }
        } else {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', (-exp - 1) as usize));
            out.push_str(&digits);
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_match_python_repr() {
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (123456.789, "123456.789"),
            (1e16, "1e+16"),
            (1.5e-5, "1.5e-05"),
            (0.0001, "0.0001"),
            (1234567890123456.0, "1234567890123456.0"),
            (1e100, "1e+100"),
            (f64::INFINITY, "Infinity"),
        ];
        for (f, want) in cases {
            assert_eq!(python_float_repr(f), want, "{f}");
        }
    }

    #[test]
    fn dumps_like_python() {
        let v: serde_json::Value = serde_json::from_str(
            r#"{"b": [1, 2.0, "x<y>&'z\n\u00e9"], "a": {"c": null, "d": true}, "e": {}, "f": []}"#,
        )
        .unwrap();
        let mv = Value::from_serialize(&v);
        assert_eq!(
            dumps(&mv, &DumpOptions::default()).unwrap(),
            r#"{"b": [1, 2.0, "x<y>&'z\né"], "a": {"c": null, "d": true}, "e": {}, "f": []}"#
        );
        let opts = DumpOptions {
            indent: Some("  ".into()),
            sort_keys: true,
            ..Default::default()
        };
        assert_eq!(
            dumps(&mv, &opts).unwrap(),
            "{\n  \"a\": {\n    \"c\": null,\n    \"d\": true\n  },\n  \"b\": [\n    1,\n    2.0,\n    \"x<y>&'z\\né\"\n  ],\n  \"e\": {},\n  \"f\": []\n}"
        );
    }
}
