//! Request bodies decoded for a chat template (real-tokenizer mode), as vLLM prepares them:
//! each message's text parts joined by newlines (vLLM's `string` content format), a tool
//! call's `arguments` parsed from their JSON text, and the Responses API's items turned into
//! chat messages (`function_call` to an assistant tool call, `function_call_output` to a `tool`
//! message, `instructions` to a system message) with its function tools in chat form.
//! Key order is kept from the request, so `tojson` writes what the client sent.

use minijinja::value::ValueKind;
use minijinja::Value;
use serde::Deserialize;

use super::api::ApiError;
use crate::tokenizer::ChatInput;

/// The chat completion fields a template sees (the others are read elsewhere or ignored).
#[derive(Debug, Deserialize)]
struct ChatFields {
    #[serde(default)]
    messages: Vec<Value>,
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    add_generation_prompt: Option<bool>,
    #[serde(default)]
    add_special_tokens: Option<bool>,
    #[serde(default)]
    chat_template_kwargs: Option<Value>,
}

/// A chat body ready for the template.
#[derive(Debug)]
pub struct ChatRequest {
    pub input: ChatInput,
    /// Whether the rendered text is tokenized with special tokens (vLLM: false for chat,
    /// the template writes them).
    pub add_special_tokens: bool,
}

fn bad(field: &'static str, message: impl Into<String>) -> ApiError {
    ApiError::bad_request(message).with_param(field)
}

/// The text of a message's content: a string as is, parts' texts joined by newlines (image
/// and other parts dropped), anything else unchanged.
fn content_text(content: Value) -> Value {
    if content.kind() != ValueKind::Seq {
        return content;
    }
    let Ok(parts) = content.try_iter() else {
        return content;
    };
    let texts: Vec<String> = parts
        .filter_map(|part| match part.kind() {
            ValueKind::String => part.as_str().map(str::to_owned),
            ValueKind::Map => part
                .get_attr("text")
                .ok()
                .and_then(|t| t.as_str().map(str::to_owned)),
            _ => None,
        })
        .collect();
    Value::from(texts.join("\n"))
}

/// A tool call's `function.arguments` parsed from JSON text (left as is when it is not JSON).
fn parse_arguments(call: Value) -> Value {
    let function = call.get_attr("function").unwrap_or_default();
    let Some(arguments) = function
        .get_attr("arguments")
        .ok()
        .and_then(|a| a.as_str().map(str::to_owned))
    else {
        return call;
    };
    let Ok(parsed) = serde_json::from_str::<Value>(&arguments) else {
        return call;
    };
    let function = replace(&function, "arguments", parsed);
    replace(&call, "function", function)
}

/// `map` with `key` set to `value` (in place when present, else appended).
fn replace(map: &Value, key: &str, value: Value) -> Value {
    let mut pairs = pairs(map);
    match pairs.iter_mut().find(|(k, _)| k.as_str() == Some(key)) {
        Some(slot) => slot.1 = value,
        None => pairs.push((Value::from(key), value)),
    }
    Value::from_pairs(pairs)
}

fn pairs(map: &Value) -> Vec<(Value, Value)> {
    let Ok(keys) = map.try_iter() else {
        return Vec::new();
    };
    keys.map(|k| {
        let v = map.get_item(&k).unwrap_or_default();
        (k, v)
    })
    .collect()
}

/// One chat message as the template gets it.
fn chat_message(message: &Value) -> Result<Value, ApiError> {
    if message.kind() != ValueKind::Map {
        return Err(bad("messages", "each message must be an object"));
    }
    let pairs = pairs(message).into_iter().map(|(k, v)| {
        let v = match k.as_str() {
            Some("content") => content_text(v),
            Some("tool_calls") if v.kind() == ValueKind::Seq => v
                .try_iter()
                .map(|calls| calls.map(parse_arguments).collect())
                .unwrap_or(v),
            _ => v,
        };
        (k, v)
    });
    Ok(Value::from_pairs(pairs.collect::<Vec<_>>()))
}

/// `chat_template_kwargs`: an object of more template variables.
fn kwargs(v: Option<Value>) -> Result<Vec<(String, Value)>, ApiError> {
    match v {
        None => Ok(Vec::new()),
        Some(v) if v.is_none() => Ok(Vec::new()),
        Some(v) if v.kind() == ValueKind::Map => Ok(pairs(&v)
            .into_iter()
            .filter_map(|(k, v)| Some((k.as_str()?.to_owned(), v)))
            .collect()),
        Some(_) => Err(bad(
            "chat_template_kwargs",
            "`chat_template_kwargs` must be an object",
        )),
    }
}

/// Decodes a `/v1/chat/completions` (or `/tokenize`) body for the template.
pub fn chat_request(body: &[u8]) -> Result<ChatRequest, ApiError> {
    let f: ChatFields =
        serde_json::from_slice(body).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let messages = f
        .messages
        .iter()
        .map(chat_message)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(ChatRequest {
        input: ChatInput {
            messages,
            tools: f.tools.filter(|t| !t.is_none()),
            add_generation_prompt: f.add_generation_prompt.unwrap_or(true),
            kwargs: kwargs(f.chat_template_kwargs)?,
        },
        add_special_tokens: f.add_special_tokens.unwrap_or(false),
    })
}

/// The Responses API fields that become messages.
#[derive(Debug, Deserialize)]
struct ResponsesFields {
    input: Value,
    #[serde(default)]
    instructions: Option<Value>,
    #[serde(default)]
    tools: Option<Vec<Value>>,
}

/// One Responses turn as chat messages, and its tools in chat form.
#[derive(Debug)]
pub struct ResponsesTurn {
    pub messages: Vec<Value>,
    pub tools: Option<Value>,
}

fn text_of(v: &Value, key: &str) -> Value {
    v.get_attr(key).unwrap_or_default()
}

/// A Responses input item as a chat message; `None` for items a chat template has no place
/// for (reasoning, built-in tool calls...).
fn item_message(item: &Value) -> Result<Option<Value>, ApiError> {
    if item.kind() != ValueKind::Map {
        return Err(bad("input", "each input item must be an object"));
    }
    let kind = text_of(item, "type");
    match kind.as_str() {
        Some("message") | None if !text_of(item, "role").is_undefined() => {
            Ok(Some(Value::from_pairs([
                ("role", text_of(item, "role")),
                ("content", content_text(text_of(item, "content"))),
            ])))
        }
        Some("function_call") => {
            let function = Value::from_pairs([
                ("name", text_of(item, "name")),
                ("arguments", text_of(item, "arguments")),
            ]);
            let call = parse_arguments(Value::from_pairs([
                ("id", text_of(item, "call_id")),
                ("type", Value::from("function")),
                ("function", function),
            ]));
            Ok(Some(Value::from_pairs([
                ("role", Value::from("assistant")),
                ("content", Value::from("")),
                ("tool_calls", Value::from(vec![call])),
            ])))
        }
        Some("function_call_output") => Ok(Some(Value::from_pairs([
            ("role", Value::from("tool")),
            ("tool_call_id", text_of(item, "call_id")),
            ("content", content_text(text_of(item, "output"))),
        ]))),
        _ => Ok(None),
    }
}

/// A Responses function tool (`{"type":"function","name",...}`) in chat form
/// (`{"type":"function","function":{"name",...}}`); other tools are dropped.
fn chat_tool(tool: &Value) -> Option<Value> {
    if text_of(tool, "type").as_str() != Some("function") {
        return None;
    }
    let function: Vec<(Value, Value)> = pairs(tool)
        .into_iter()
        .filter(|(k, _)| k.as_str() != Some("type"))
        .collect();
    Some(Value::from_pairs([
        ("type", Value::from("function")),
        ("function", Value::from_pairs(function)),
    ]))
}

/// Decodes a `/v1/responses` body's `instructions`, `input` and `tools`.
pub fn responses_turn(body: &[u8]) -> Result<ResponsesTurn, ApiError> {
    let f: ResponsesFields =
        serde_json::from_slice(body).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let mut messages = Vec::new();
    if let Some(instructions) = f.instructions.filter(|i| !i.is_none()) {
        messages.push(Value::from_pairs([
            ("role", Value::from("system")),
            ("content", content_text(instructions)),
        ]));
    }
    match f.input.kind() {
        ValueKind::String => messages.push(Value::from_pairs([
            ("role", Value::from("user")),
            ("content", f.input),
        ])),
        ValueKind::Seq => {
            let items = f
                .input
                .try_iter()
                .map_err(|e| bad("input", e.to_string()))?;
            for item in items {
                messages.extend(item_message(&item)?);
            }
        }
        _ => return Err(bad("input", "`input` must be a string or a list of items")),
    }
    let tools: Vec<Value> = f
        .tools
        .unwrap_or_default()
        .iter()
        .filter_map(chat_tool)
        .collect();
    Ok(ResponsesTurn {
        messages,
        tools: (!tools.is_empty()).then(|| Value::from(tools)),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn json(v: &Value) -> String {
        serde_json::to_string(v).unwrap()
    }

    #[test]
    fn chat_bodies() {
        let r = chat_request(
            br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},
                {"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"b"}]},
                {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function",
                 "function":{"name":"f","arguments":"{\"z\": 1, \"a\": 2}"}}]}],
                "tools":[{"type":"function","function":{"name":"f"}}],
                "add_generation_prompt":false,"chat_template_kwargs":{"enable_thinking":false}}"#,
        )
        .unwrap();
        assert!(!r.add_special_tokens);
        assert!(!r.input.add_generation_prompt);
        assert_eq!(
            json(&r.input.messages[0]),
            r#"{"role":"user","content":"a\nb"}"#
        );
        assert_eq!(
            json(&r.input.messages[1]),
            r#"{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":{"z":1,"a":2}}}]}"#
        );
        assert_eq!(r.input.kwargs[0].0, "enable_thinking");
        assert!(r.input.tools.is_some());
        let r = chat_request(br#"{"messages":[],"tools":null,"add_special_tokens":true}"#).unwrap();
        assert!(r.input.tools.is_none() && r.add_special_tokens && r.input.add_generation_prompt);
        for bad in [
            &br#"{"messages":[5]}"#[..],
            br#"{"messages":[],"chat_template_kwargs":[1]}"#,
            br#"{"messages":"x"}"#,
            b"{",
        ] {
            assert_eq!(chat_request(bad).unwrap_err().status, 400);
        }
    }

    #[test]
    fn responses_bodies() {
        let t = responses_turn(
            br#"{"model":"m","instructions":"be brief","input":[
                {"role":"user","content":[{"type":"input_text","text":"hi"}]},
                {"type":"reasoning","summary":[]},
                {"type":"function_call","call_id":"c1","name":"f","arguments":"{\"x\":1}"},
                {"type":"function_call_output","call_id":"c1","output":"42"}],
                "tools":[{"type":"function","name":"f","parameters":{}},{"type":"web_search"}]}"#,
        )
        .unwrap();
        let m: Vec<String> = t.messages.iter().map(json).collect();
        assert_eq!(
            m,
            [
                r#"{"role":"system","content":"be brief"}"#,
                r#"{"role":"user","content":"hi"}"#,
                r#"{"role":"assistant","content":"","tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":{"x":1}}}]}"#,
                r#"{"role":"tool","tool_call_id":"c1","content":"42"}"#,
            ]
        );
        assert_eq!(
            json(&t.tools.unwrap()),
            r#"[{"type":"function","function":{"name":"f","parameters":{}}}]"#
        );
        let t = responses_turn(br#"{"input":"hello"}"#).unwrap();
        assert_eq!(json(&t.messages[0]), r#"{"role":"user","content":"hello"}"#);
        assert!(t.tools.is_none());
        assert_eq!(responses_turn(br#"{"input":5}"#).unwrap_err().status, 400);
        assert_eq!(responses_turn(br#"{"input":[5]}"#).unwrap_err().status, 400);
    }
}
