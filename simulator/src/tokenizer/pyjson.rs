//! The `tojson` filter of transformers' chat templates: Python's
//! `json.dumps(x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)`,
//! byte for byte (`", "` and `": "` between items, non-ASCII text as is, floats as Python
//! writes them), so that tools and tool calls render as they do in vLLM. (minijinja's own
//! `tojson` escapes `<`, `>`, `&` and `'` for HTML.)

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};

struct Style {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

/// The filter: `value | tojson`, `tojson(indent=2)`, `tojson(separators=(",", ":"))`,
/// `tojson(sort_keys=true)`; `ensure_ascii` is accepted and must be false.
pub fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    if ensure_ascii == Some(true) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: ensure_ascii=true is not supported",
        ));
    }
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_owned()),
            None => Some(" ".repeat(usize::try_from(v)?)),
        },
    };
    // Python's defaults: (", ", ": ") without indent, ("," , ": ") with one.
    let (mut item_sep, mut key_sep) = match indent {
        None => (", ".to_owned(), ": ".to_owned()),
        Some(_) => (",".to_owned(), ": ".to_owned()),
    };
    if let Some(seps) = separators.filter(|s| !s.is_none()) {
        let parts: Vec<Value> = seps.try_iter()?.collect();
        match (
            parts.first().and_then(Value::as_str),
            parts.get(1).and_then(Value::as_str),
        ) {
            (Some(i), Some(k)) if parts.len() == 2 => {
                item_sep = i.to_owned();
                key_sep = k.to_owned();
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: separators must be two strings",
                ))
            }
        }
    }
    let style = Style {
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    write_value(&mut out, value, &style, 0)?;
    Ok(Value::from(out))
}

fn newline(out: &mut String, style: &Style, depth: usize) {
    if let Some(indent) = &style.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(indent);
        }
    }
}

fn write_value(out: &mut String, v: &Value, style: &Style, depth: usize) -> Result<(), Error> {
    if depth > 128 {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: too deeply nested",
        ));
    }
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if v.is_integer() {
                out.push_str(&v.to_string());
            } else {
                write_float(out, f64::try_from(v.clone())?);
            }
        }
        ValueKind::String => write_str(out, v.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable | ValueKind::Bytes => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(out, style, depth + 1);
                write_value(out, item, style, depth + 1)?;
            }
            newline(out, style, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if style.sort_keys {
                keys.sort_by_cached_key(|k| k.to_string());
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(out, style, depth + 1);
                match key.as_str() {
                    Some(k) => write_str(out, k),
                    None => write_str(out, &key.to_string()),
                }
                out.push_str(&style.key_sep);
                write_value(out, &v.get_item(key)?, style, depth + 1)?;
            }
            newline(out, style, depth);
            out.push('}');
        }
        ValueKind::Plain | ValueKind::Invalid => write_str(out, &v.to_string()),
        // A future kind: its text, as Python's `default=str` would.
        _ => write_str(out, &v.to_string()),
    }
    Ok(())
}

/// A JSON string as Python writes it with `ensure_ascii=False`.
fn write_str(out: &mut String, s: &str) {
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
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A float as Python's `repr`: shortest round-trip digits, positional for exponents -4..16
/// (with `.0` when whole), else `1e+20` / `1.5e-05`; non-finite as `NaN`, `Infinity`.
fn write_float(out: &mut String, f: f64) {
    if f.is_nan() {
        out.push_str("NaN");
        return;
    }
    if f.is_infinite() {
        out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
        return;
    }
    let sci = format!("{f:e}"); // e.g. "1.5e-5", "-1e20", "0e0"
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let text = f.to_string();
        out.push_str(&text);
        if !text.contains('.') {
            out.push_str(".0");
        }
    } else {
        out.push_str(mantissa);
        out.push('e');
        out.push(if exp < 0 { '-' } else { '+' });
        out.push_str(&format!("{:02}", exp.abs()));
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn json(v: &str) -> Value {
        serde_json::from_str(v).unwrap()
    }

    fn dumps(v: &Value, kwargs: &[(&str, Value)]) -> String {
        let kwargs = Kwargs::from_iter(kwargs.iter().map(|(k, v)| (*k, v.clone())));
        tojson(v, kwargs).unwrap().as_str().unwrap().to_owned()
    }

    #[test]
    fn writes_what_python_json_dumps_writes() {
        // json.dumps(json.loads(s), ensure_ascii=False) for each s
        let v = json(r#"{"name": "get_weather", "b": [1, 2.5, true, null], "é": "<a & 'b'>\n"}"#);
        assert_eq!(
            dumps(&v, &[]),
            r#"{"name": "get_weather", "b": [1, 2.5, true, null], "é": "<a & 'b'>\n"}"#
        );
        assert_eq!(
            dumps(&v, &[("indent", Value::from(2))]),
            "{\n  \"name\": \"get_weather\",\n  \"b\": [\n    1,\n    2.5,\n    true,\n    null\n  ],\n  \"é\": \"<a & 'b'>\\n\"\n}"
        );
        let seps = Value::from(vec![Value::from(","), Value::from(":")]);
        assert_eq!(
            dumps(
                &v,
                &[("separators", seps), ("sort_keys", Value::from(true))]
            ),
            r#"{"b":[1,2.5,true,null],"name":"get_weather","é":"<a & 'b'>\n"}"#
        );
        assert_eq!(dumps(&json("[]"), &[]), "[]");
        assert_eq!(dumps(&json("{}"), &[("indent", Value::from(2))]), "{}");
        assert_eq!(dumps(&Value::from("\u{1}\t"), &[]), r#""\u0001\t""#);
    }

    #[test]
    fn floats_as_python_repr() {
        for (f, py) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (1.5e-5, "1.5e-05"),
            (0.0001, "0.0001"),
            (0.0, "0.0"),
            (f64::INFINITY, "Infinity"),
        ] {
            let mut out = String::new();
            write_float(&mut out, f);
            assert_eq!(out, py, "{f}");
        }
    }

    #[test]
    fn bad_arguments_are_errors() {
        let kw = |k: &str, v: Value| Kwargs::from_iter([(k, v)]);
        assert!(tojson(&Value::from(1), kw("ensure_ascii", Value::from(true))).is_err());
        assert!(tojson(&Value::from(1), kw("separators", Value::from(","))).is_err());
        assert!(tojson(&Value::from(1), kw("frobnicate", Value::from(1))).is_err());
        assert!(tojson(&Value::from(1), kw("indent", Value::from(-1))).is_err());
    }
}
