use super::*;
use proptest::prelude::*;

fn prompt_text(req: &ParsedRequest<'_>) -> Vec<u8> {
    req.prompt.concat()
}

const LIMIT: usize = 1 << 20;

#[test]
fn api_from_path() {
    assert_eq!(
        Api::from_path("/v1/chat/completions"),
        Some(Api::ChatCompletions)
    );
    assert_eq!(
        Api::from_path("/v1/chat/completions?x=1"),
        Some(Api::ChatCompletions)
    );
    assert_eq!(Api::from_path("/v1/completions/"), Some(Api::Completions));
    assert_eq!(Api::from_path("/v1/responses"), Some(Api::Responses));
    assert_eq!(Api::from_path("/v1/models"), None);
    assert_eq!(Api::from_path(""), None);
}

#[test]
fn encoded_paths_cannot_skip_the_body() {
    // What Envoy's normalize_path + merge_slashes make of them, the filter makes too.
    for path in [
        "/v1/%63hat/completions",
        "/v1/chat/%63%6Fmpletions",
        "//v1//chat/completions",
        "/v1/./chat/completions",
        "/v1/x/../chat/completions",
        "/%761/chat/completions?stream=1",
    ] {
        assert_eq!(
            classify_path(path),
            PathClass::Api(Api::ChatCompletions),
            "{path}"
        );
    }
    // An encoded separator or a broken escape is never guessed at.
    for path in [
        "/v1/chat%2Fcompletions",
        "/v1/chat%2fcompletions",
        "/v1%5Cchat/completions",
        "/v1/chat\\completions",
        "/v1/chat/completions%",
        "/v1/chat/completions%zz",
        "/v1/chat/completions%00",
    ] {
        assert_eq!(classify_path(path), PathClass::Ambiguous, "{path}");
        assert_eq!(Api::from_path(path), None, "{path}");
    }
    assert_eq!(classify_path("/v1/models"), PathClass::Other);
    assert_eq!(classify_path("/v1/chat/completions%20"), PathClass::Other);
    assert_eq!(classify_path(&"/a".repeat(5000)), PathClass::Other);
}

#[test]
fn prompt_segments_are_capped() {
    let messages: Vec<String> = (0..100)
        .map(|i| format!(r#"{{"role":"user","content":"m{i}"}}"#))
        .collect();
    let body = format!(r#"{{"model":"m","messages":[{}]}}"#, messages.join(","));
    // Each message is role, separator, content, separator: 400 runs.
    assert_eq!(
        parse_with(Api::ChatCompletions, body.as_bytes(), LIMIT, 400)
            .unwrap()
            .prompt
            .len(),
        400
    );
    assert_eq!(
        parse_with(Api::ChatCompletions, body.as_bytes(), LIMIT, 399),
        Err(RequestError::TooManySegments { limit: 399 })
    );
    let parts: Vec<String> = (0..50).map(|i| format!(r#""p{i}""#)).collect();
    let body = format!(r#"{{"model":"m","prompt":[{}]}}"#, parts.join(","));
    assert!(matches!(
        parse_with(Api::Completions, body.as_bytes(), LIMIT, 20),
        Err(RequestError::TooManySegments { .. })
    ));
    let body = br#"{"model":"m","tools":[1],"instructions":"x","input":"a"}"#;
    assert_eq!(
        parse_with(Api::Responses, body, LIMIT, 5)
            .unwrap()
            .prompt
            .len(),
        5
    );
    assert!(parse_with(Api::Responses, body, LIMIT, 4).is_err());
}

#[test]
fn chat_string_and_parts_content() {
    let body = br#"{"model":"m","stream":true,"user":"u1","cache_salt":"s",
        "messages":[{"role":"system","content":"be brief"},
                    {"role":"user","content":[{"type":"text","text":"hi \"there\""},
                                              {"type":"image_url","image_url":{"url":"data:x"}}]},
                    {"role":"assistant","content":null,"tool_calls":[{"id":"c1"}]}],
        "temperature":0.2,"extra":{"nested":[1,2,3]}}"#;
    let req = parse(Api::ChatCompletions, body, LIMIT).unwrap();
    assert_eq!(req.model, "m");
    assert!(req.stream);
    assert_eq!(req.user.as_deref(), Some("u1"));
    assert_eq!(req.cache_salt.as_deref(), Some("s"));
    let text = prompt_text(&req);
    let expected: Vec<u8> = [
        &b"system\x1fbe brief\x1e"[..],
        b"user\x1fhi \\\"there\\\"\x1e{\"url\":\"data:x\"}\x1e\x1e",
        b"assistant\x1f[{\"id\":\"c1\"}]\x1f\x1e",
    ]
    .concat();
    assert_eq!(
        String::from_utf8_lossy(&text),
        String::from_utf8_lossy(&expected)
    );
}

#[test]
fn chat_tools_come_first() {
    let a = br#"{"messages":[{"role":"user","content":"q"}],"tools":[{"type":"function"}],"model":"m"}"#;
    let b = br#"{"model":"m","tools":[{"type":"function"}],"messages":[{"role":"user","content":"q"}]}"#;
    let pa = prompt_text(&parse(Api::ChatCompletions, a, LIMIT).unwrap());
    let pb = prompt_text(&parse(Api::ChatCompletions, b, LIMIT).unwrap());
    assert_eq!(pa, pb);
    assert!(pa.starts_with(b"[{\"type\":\"function\"}]"));
}

#[test]
fn string_and_text_part_key_alike() {
    let a = br#"{"model":"m","messages":[{"role":"user","content":"hello"}]}"#;
    let b =
        br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hello"}]}]}"#;
    let pa = prompt_text(&parse(Api::ChatCompletions, a, LIMIT).unwrap());
    let pb = prompt_text(&parse(Api::ChatCompletions, b, LIMIT).unwrap());
    // parts add one separator after each part; the leading text is the same
    assert!(pb.starts_with(&pa[..pa.len() - 1]));
}

#[test]
fn completions_prompt_shapes() {
    let req = parse(
        Api::Completions,
        br#"{"model":"m","prompt":"once upon"}"#,
        LIMIT,
    )
    .unwrap();
    assert_eq!(prompt_text(&req), b"once upon");
    let req = parse(
        Api::Completions,
        br#"{"model":"m","prompt":["a","b"]}"#,
        LIMIT,
    )
    .unwrap();
    assert_eq!(prompt_text(&req), b"a\x1eb\x1e");
    let req = parse(
        Api::Completions,
        br#"{"model":"m","prompt":[1,2,3]}"#,
        LIMIT,
    )
    .unwrap();
    assert_eq!(prompt_text(&req), b"1\x1e2\x1e3\x1e");
    let e = parse(Api::Completions, br#"{"model":"m","prompt":5}"#, LIMIT).unwrap_err();
    assert!(e.to_string().contains("prompt"), "{e}");
    let e = parse(Api::Completions, br#"{"model":"m"}"#, LIMIT).unwrap_err();
    assert_eq!(e, RequestError::MissingField { field: "prompt" });
}

#[test]
fn responses_input_shapes() {
    let req = parse(
        Api::Responses,
        br#"{"model":"m","input":"hi","instructions":"be nice","previous_response_id":"resp_1"}"#,
        LIMIT,
    )
    .unwrap();
    assert_eq!(prompt_text(&req), b"be nice\x1ehi");
    assert_eq!(req.previous_response_id.as_deref(), Some("resp_1"));
    assert_eq!(req.conversation, None);
    for (body, want) in [
        (
            &br#"{"model":"m","input":"hi","conversation":"conv_1"}"#[..],
            Some("conv_1"),
        ),
        (
            br#"{"model":"m","input":"hi","conversation":{"id":"conv_2","x":[1]}}"#,
            Some("conv_2"),
        ),
        (br#"{"model":"m","input":"hi","conversation":null}"#, None),
    ] {
        let req = parse(Api::Responses, body, 1 << 20).unwrap();
        assert_eq!(req.conversation.as_deref(), want);
    }
    assert!(parse(
        Api::Responses,
        br#"{"model":"m","input":"hi","conversation":5}"#,
        1 << 20
    )
    .is_err());
    let req = parse(
        Api::Responses,
        br#"{"model":"m","input":[{"type":"message","role":"user","content":[{"type":"input_text","text":"hello"}]},
            {"type":"function_call_output","call_id":"c1","output":"42"}]}"#,
        LIMIT,
    )
    .unwrap();
    assert_eq!(
        prompt_text(&req),
        b"user\x1fhello\x1e\x1ec1\x1f42\x1f\x1e".to_vec()
    );
    // chat message and responses message with the same text key alike
    let chat = parse(
        Api::ChatCompletions,
        br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hello"}]}]}"#,
        LIMIT,
    )
    .unwrap();
    let resp = parse(Api::Responses, br#"{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"hello"}]}]}"#, LIMIT).unwrap();
    assert_eq!(prompt_text(&chat), prompt_text(&resp));
}

#[test]
fn errors_are_typed() {
    assert_eq!(
        parse(Api::ChatCompletions, b"  ", LIMIT),
        Err(RequestError::Empty)
    );
    assert!(matches!(
        parse(Api::ChatCompletions, b"{", LIMIT),
        Err(RequestError::Json(_))
    ));
    assert!(matches!(
        parse(Api::ChatCompletions, b"[]", LIMIT),
        Err(RequestError::Json(_))
    ));
    assert!(matches!(
        parse(Api::ChatCompletions, b"{} x", LIMIT),
        Err(RequestError::Json(_))
    ));
    assert_eq!(
        parse(Api::ChatCompletions, br#"{"messages":[]}"#, LIMIT),
        Err(RequestError::MissingModel)
    );
    assert_eq!(
        parse(Api::ChatCompletions, br#"{"model":"m"}"#, LIMIT),
        Err(RequestError::MissingField { field: "messages" })
    );
    assert!(matches!(
        parse(
            Api::ChatCompletions,
            br#"{"model":"m","messages":[{"role":"user","content":7}]}"#,
            LIMIT
        ),
        Err(RequestError::BadShape {
            field: "content",
            ..
        })
    ));
    assert!(matches!(
        parse(
            Api::ChatCompletions,
            br#"{"model":"m","messages":{}}"#,
            LIMIT
        ),
        Err(RequestError::BadShape {
            field: "messages",
            ..
        })
    ));
    assert!(matches!(
        parse(Api::ChatCompletions, br#"{"model":5,"messages":[]}"#, LIMIT),
        Err(RequestError::BadShape { field: "model", .. })
    ));
    assert!(matches!(
        parse(
            Api::ChatCompletions,
            br#"{"model":"m","stream":"yes","messages":[]}"#,
            LIMIT
        ),
        Err(RequestError::Json(_))
    ));
    assert_eq!(
        parse(Api::ChatCompletions, &[b' '; 11], 10),
        Err(RequestError::TooLarge {
            size: 11,
            limit: 10
        })
    );
    assert!(matches!(
        parse(Api::ChatCompletions, b"\xff\xfe", LIMIT),
        Err(RequestError::Json(_))
    ));
}

#[test]
fn escaped_model_is_unescaped() {
    let req = parse(
        Api::ChatCompletions,
        br#"{"model":"a\/b","messages":[]}"#,
        LIMIT,
    )
    .unwrap();
    assert_eq!(req.model, "a/b");
}

fn json_value() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        ".{0,20}".prop_map(serde_json::Value::from),
    ];
    leaf.prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::from),
            prop::collection::btree_map(
                prop_oneof![
                    Just("model".to_string()),
                    Just("messages".to_string()),
                    Just("content".to_string()),
                    Just("role".to_string()),
                    Just("text".to_string()),
                    Just("prompt".to_string()),
                    Just("input".to_string()),
                    Just("tools".to_string()),
                    ".{0,8}"
                ],
                inner,
                0..6
            )
            .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn never_panics_on_bytes(body in prop::collection::vec(any::<u8>(), 0..512)) {
        for api in [Api::ChatCompletions, Api::Completions, Api::Responses] {
            let _ = parse(api, &body, LIMIT);
        }
    }

    #[test]
    fn never_panics_on_json_shapes(v in json_value()) {
        let body = v.to_string();
        for api in [Api::ChatCompletions, Api::Completions, Api::Responses] {
            let _ = parse(api, body.as_bytes(), LIMIT);
        }
    }

    #[test]
    fn valid_chat_always_parses(
        model in "[a-z0-9/.-]{1,20}",
        msgs in prop::collection::vec(("(system|user|assistant)", ".{0,200}"), 1..8),
    ) {
        let messages: Vec<_> = msgs.iter().map(|(r, c)| serde_json::json!({"role": r, "content": c})).collect();
        let body = serde_json::json!({"model": model, "messages": messages}).to_string();
        let req = parse(Api::ChatCompletions, body.as_bytes(), LIMIT).unwrap();
        prop_assert_eq!(req.model.as_ref(), model.as_str());
        // one message separator per message (JSON escapes control characters in the text)
        let text = prompt_text(&req);
        prop_assert_eq!(text.iter().filter(|&&b| b == 0x1e).count(), msgs.len());
    }
}

/// The prompt bytes the rules in `openai.rs` give for a chat body, computed over a
/// `serde_json::Value`. For bodies serialised by serde_json, raw bytes are the value's own
/// serialisation, so the two must agree byte for byte.
fn reference_chat_prompt(v: &serde_json::Value) -> Option<Vec<u8>> {
    use serde_json::Value;
    fn raw(v: &Value) -> Vec<u8> {
        let s = serde_json::to_string(v).unwrap();
        match v {
            Value::String(_) => s.as_bytes()[1..s.len() - 1].to_vec(),
            _ => s.into_bytes(),
        }
    }
    let obj = v.as_object()?;
    let mut out = Vec::new();
    if let Some(t) = obj.get("tools").filter(|t| !t.is_null()) {
        out.extend(serde_json::to_vec(t).unwrap());
        out.push(0x1e);
    }
    for m in obj.get("messages")?.as_array()? {
        for (k, val) in m.as_object()? {
            match k.as_str() {
                "type" | "cache_control" => {}
                "role" => {
                    out.extend(raw(val));
                    out.push(0x1f);
                }
                "content" => match val {
                    Value::String(_) => out.extend(raw(val)),
                    Value::Null => {}
                    Value::Array(parts) => {
                        for p in parts {
                            match p {
                                Value::String(_) => out.extend(raw(p)),
                                Value::Object(fields) => {
                                    for (pk, pv) in fields {
                                        if pk != "type" && pk != "cache_control" {
                                            out.extend(raw(pv));
                                        }
                                    }
                                }
                                _ => return None,
                            }
                            out.push(0x1e);
                        }
                    }
                    _ => return None,
                },
                _ => {
                    if !val.is_null() {
                        out.extend(raw(val));
                        out.push(0x1f);
                    }
                }
            }
        }
        out.push(0x1e);
    }
    Some(out)
}

fn chat_body_strategy() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::{json, Value};
    let text = "(.|\n|\"|\\\\){0,40}";
    let part = prop_oneof![
        text.prop_map(|t| json!({"type": "text", "text": t})),
        text.prop_map(|t| json!({"type": "image_url", "image_url": {"url": t}})),
        text.prop_map(Value::from),
    ];
    let content = prop_oneof![
        text.prop_map(Value::from),
        Just(Value::Null),
        prop::collection::vec(part, 0..4).prop_map(Value::from),
    ];
    let message = (
        "(system|user|assistant|tool)",
        content,
        prop::option::of(json_value()),
    )
        .prop_map(|(role, content, extra)| {
            let mut m = json!({"role": role, "content": content});
            if let Some(extra) = extra {
                m["tool_calls"] = extra;
            }
            m
        });
    (
        prop::collection::vec(message, 0..6),
        prop::option::of(json_value()),
        prop::option::of(json_value()),
    )
        .prop_map(|(messages, tools, noise)| {
            let mut body = json!({"model": "m", "messages": messages});
            if let Some(t) = tools {
                body["tools"] = t;
            }
            if let Some(n) = noise {
                body["temperature"] = n;
            }
            body
        })
}

/// Bytes drawn mostly from JSON's structural alphabet, so that random inputs reach deep into
/// the scanner instead of failing at the first byte.
fn jsonish() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop_oneof![
            prop::sample::select(vec![
                "{",
                "}",
                "[",
                "]",
                ",",
                ":",
                "\"",
                "\\",
                "\\u00e9",
                "\\n",
                "0",
                "-1.5e3",
                "1.",
                "01",
                "true",
                "false",
                "null",
                "nul",
                " ",
                "\n",
                "\"model\"",
                "\"messages\"",
                "\"content\"",
                "\"role\"",
                "\"prompt\"",
                "\"input\"",
                "\"a\"",
                "é",
                "\u{1}",
            ])
            .prop_map(str::to_owned),
            ".".prop_map(|s: String| s),
        ],
        0..40,
    )
    .prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    #[test]
    fn scanner_accepts_exactly_what_serde_json_accepts(s in jsonish()) {
        let mut cur = json::Cursor::new(s.as_bytes());
        let ours = cur.value().and_then(|_| cur.end()).is_ok();
        let theirs = serde_json::from_str::<serde_json::Value>(&s).is_ok();
        prop_assert_eq!(ours, theirs, "input {:?}", s);
    }

    #[test]
    fn chat_prompt_matches_the_reference(body in chat_body_strategy()) {
        let bytes = serde_json::to_vec(&body).unwrap();
        let expected = reference_chat_prompt(&body);
        let ours = parse(Api::ChatCompletions, &bytes, LIMIT).ok().map(|r| prompt_text(&r));
        prop_assert_eq!(ours, expected);
    }
}

#[test]
fn truncated_bodies_are_json_errors() {
    let full =
        br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#;
    for cut in 1..full.len() {
        match parse(Api::ChatCompletions, &full[..cut], LIMIT) {
            Err(RequestError::Json(_)) => {}
            other => panic!("cut at {cut}: {other:?}"),
        }
    }
}
