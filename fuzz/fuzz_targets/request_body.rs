//! The OpenAI request-body scanner (`kvoy_shared::request`), which reads every proxied body.
//!
//! Beyond "no panic", on every input and API:
//! - an accepted body is JSON that serde_json accepts structurally (strings not checked for
//!   UTF-8, as the scanner documents), and a body that serde_json accepts with valid UTF-8 is
//!   never refused as bad JSON;
//! - the fields read agree with serde_json's (`model`, `stream`, `user`, `cache_salt`,
//!   `previous_response_id`), duplicates resolved the same way (the last wins);
//! - the prompt runs are separators or slices of the body, at most the segment cap of them;
//! - a body over the size limit is refused before parsing; the path classifier is total and
//!   ignores the query string.
#![no_main]

use kvoy_shared::request::{classify_path, parse, parse_with, Api, PathClass, RequestError};
use libfuzzer_sys::fuzz_target;
use serde::de::IgnoredAny;
use serde_json::Value;

const APIS: [Api; 3] = [Api::ChatCompletions, Api::Completions, Api::Responses];

/// Nesting serde_json refuses (128 levels); the scanner walks a few levels itself before it
/// bounds skipped values at 128, so deeper bodies are not compared.
fn too_deep(e: &serde_json::Error) -> bool {
    e.to_string().contains("recursion limit")
}

fn within(body: &[u8], run: &[u8]) -> bool {
    let (b, r) = (body.as_ptr() as usize, run.as_ptr() as usize);
    r >= b && r + run.len() <= b + body.len()
}

fuzz_target!(|data: &[u8]| {
    let (cap_byte, body) = match data.split_first() {
        Some((&c, rest)) => (c, rest),
        None => (0, data),
    };
    let structural = serde_json::from_slice::<IgnoredAny>(body);
    let value = std::str::from_utf8(body)
        .ok()
        .and_then(|s| serde_json::from_str::<Value>(s).ok());
    for api in APIS {
        match parse(api, body, usize::MAX) {
            Ok(req) => {
                if let Err(e) = &structural {
                    assert!(too_deep(e), "scanner accepted what serde_json refuses: {e}");
                }
                assert!(!req.model.is_empty());
                if let Some(v) = &value {
                    let text = |k: &str| v.get(k).and_then(Value::as_str);
                    assert_eq!(text("model"), Some(req.model.as_ref()));
                    assert_eq!(
                        v.get("stream").and_then(Value::as_bool).unwrap_or(false),
                        req.stream
                    );
                    assert_eq!(text("user"), req.user.as_deref());
                    assert_eq!(text("cache_salt"), req.cache_salt.as_deref());
                    assert_eq!(
                        text("previous_response_id"),
                        req.previous_response_id.as_deref()
                    );
                }
                assert!(req.prompt.len() <= kvoy_shared::request::DEFAULT_MAX_SEGMENTS);
                for run in &req.prompt {
                    assert!(
                        within(body, run) || matches!(*run, b"\x1e" | b"\x1f"),
                        "prompt run neither a slice of the body nor a separator"
                    );
                }
                assert_eq!(
                    req.prompt_len(),
                    req.prompt.iter().map(|r| r.len()).sum::<usize>()
                );
                // A small segment cap: accepted only with at most that many runs.
                let cap = usize::from(cap_byte);
                match parse_with(api, body, usize::MAX, cap) {
                    Ok(small) => assert!(small.prompt.len() <= cap && small == req),
                    Err(e) => assert_eq!(e, RequestError::TooManySegments { limit: cap }),
                }
            }
            Err(RequestError::Json(e)) => {
                // A JSON object that serde_json reads as text (valid UTF-8, escapes included) is
                // never refused as bad JSON: its nesting is within serde_json's limit, which is
                // also the scanner's.
                assert!(
                    !value.as_ref().is_some_and(Value::is_object),
                    "valid JSON refused: {e}"
                );
            }
            Err(_) => {}
        }
        if !body.is_empty() {
            assert!(matches!(
                parse(api, body, body.len() - 1),
                Err(RequestError::TooLarge { .. })
            ));
        }
    }
    if let Ok(path) = std::str::from_utf8(body) {
        let class = classify_path(path);
        if !path.contains(['?', '#']) {
            assert_eq!(classify_path(&format!("{path}?stream=true")), class);
        }
        if let PathClass::Api(api) = class {
            assert_eq!(Api::from_path(path), Some(api));
        }
    }
});
