//! Single-pass serde visitors over OpenAI bodies. Prompt text is kept as borrowed raw JSON
//! string bytes; only array-shaped message content is scanned a second time.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

use super::{Api, ParsedRequest, RequestError, SEP_PART, SEP_ROLE};

type Segments<'a> = Vec<&'a [u8]>;

pub(super) fn parse_chat(body: &[u8]) -> Result<ParsedRequest<'_>, RequestError> {
    parse_body(Api::ChatCompletions, body)
}

pub(super) fn parse_completions(body: &[u8]) -> Result<ParsedRequest<'_>, RequestError> {
    parse_body(Api::Completions, body)
}

pub(super) fn parse_responses(body: &[u8]) -> Result<ParsedRequest<'_>, RequestError> {
    parse_body(Api::Responses, body)
}

fn json_err(e: serde_json::Error) -> RequestError {
    RequestError::Json(e.to_string())
}

fn parse_body(api: Api, body: &[u8]) -> Result<ParsedRequest<'_>, RequestError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let fields = BodySeed { api }.deserialize(&mut de).map_err(json_err)?;
    de.end().map_err(json_err)?;
    let model = fields.model.ok_or(RequestError::MissingModel)?;
    if model.is_empty() {
        return Err(RequestError::MissingModel);
    }
    let (field, main) = match api {
        Api::ChatCompletions => ("messages", fields.messages),
        Api::Completions => ("prompt", fields.prompt),
        Api::Responses => ("input", fields.input),
    };
    let mut prompt = main.ok_or(RequestError::MissingField { field })?;
    let mut head: Segments<'_> = Vec::new();
    if let Some(tools) = fields.tools {
        head.push(tools.get().as_bytes());
        head.push(SEP_PART);
    }
    if let Some(instructions) = fields.instructions {
        push_text_or_raw(&mut head, instructions);
        head.push(SEP_PART);
    }
    if !head.is_empty() {
        prompt.splice(0..0, head);
    }
    Ok(ParsedRequest {
        api,
        model,
        stream: fields.stream.unwrap_or(false),
        user: fields.user,
        cache_salt: fields.cache_salt,
        previous_response_id: fields.previous_response_id,
        prompt,
    })
}

/// The bytes between the quotes of a raw JSON string, or `None` if `raw` is not a string.
fn string_inner(raw: &RawValue) -> Option<&[u8]> {
    let b = raw.get().trim_ascii().as_bytes();
    match b {
        [b'"', inner @ .., b'"'] => Some(inner),
        _ => None,
    }
}

fn first_byte(raw: &RawValue) -> u8 {
    raw.get()
        .trim_ascii()
        .as_bytes()
        .first()
        .copied()
        .unwrap_or(0)
}

fn push_text_or_raw<'a>(out: &mut Segments<'a>, raw: &'a RawValue) {
    match string_inner(raw) {
        Some(inner) => out.push(inner),
        None => out.push(raw.get().as_bytes()),
    }
}

#[derive(Default)]
struct BodyFields<'a> {
    model: Option<Cow<'a, str>>,
    stream: Option<bool>,
    user: Option<Cow<'a, str>>,
    cache_salt: Option<Cow<'a, str>>,
    previous_response_id: Option<Cow<'a, str>>,
    tools: Option<&'a RawValue>,
    instructions: Option<&'a RawValue>,
    messages: Option<Segments<'a>>,
    prompt: Option<Segments<'a>>,
    input: Option<Segments<'a>>,
}

enum Field {
    Model,
    Stream,
    User,
    CacheSalt,
    PreviousResponseId,
    Tools,
    Instructions,
    Messages,
    Prompt,
    Input,
    Other,
}

impl<'de> Deserialize<'de> for Field {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Field;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a field name")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Field, E> {
                Ok(match v {
                    "model" => Field::Model,
                    "stream" => Field::Stream,
                    "user" => Field::User,
                    "cache_salt" => Field::CacheSalt,
                    "previous_response_id" => Field::PreviousResponseId,
                    "tools" => Field::Tools,
                    "instructions" => Field::Instructions,
                    "messages" => Field::Messages,
                    "prompt" => Field::Prompt,
                    "input" => Field::Input,
                    _ => Field::Other,
                })
            }
        }
        d.deserialize_identifier(V)
    }
}

/// A string that borrows from the body when it has no escapes.
struct CowStr<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for CowStr<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = CowStr<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(CowStr(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(CowStr(Cow::Owned(v.to_owned())))
            }
        }
        d.deserialize_str(V)
    }
}

fn opt_str<'de, A: MapAccess<'de>>(map: &mut A) -> Result<Option<Cow<'de, str>>, A::Error> {
    Ok(map.next_value::<Option<CowStr<'de>>>()?.map(|s| s.0))
}

struct BodySeed {
    api: Api,
}

impl<'de> DeserializeSeed<'de> for BodySeed {
    type Value = BodyFields<'de>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for BodySeed {
    type Value = BodyFields<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out = BodyFields::default();
        while let Some(field) = map.next_key::<Field>()? {
            match field {
                Field::Model => out.model = opt_str(&mut map)?,
                Field::Stream => out.stream = map.next_value()?,
                Field::User => out.user = opt_str(&mut map)?,
                Field::CacheSalt => out.cache_salt = opt_str(&mut map)?,
                Field::PreviousResponseId => out.previous_response_id = opt_str(&mut map)?,
                Field::Tools => out.tools = non_null(map.next_value()?),
                Field::Instructions if self.api == Api::Responses => {
                    out.instructions = non_null(map.next_value()?)
                }
                Field::Messages if self.api == Api::ChatCompletions => {
                    let mut segs = Vec::new();
                    map.next_value_seed(MessagesSeed(&mut segs))?;
                    out.messages = Some(segs);
                }
                Field::Prompt if self.api == Api::Completions => {
                    let raw: &'de RawValue = map.next_value()?;
                    out.prompt = Some(completion_prompt(raw).map_err(de::Error::custom)?);
                }
                Field::Input if self.api == Api::Responses => {
                    let raw: &'de RawValue = map.next_value()?;
                    out.input = Some(responses_input(raw).map_err(de::Error::custom)?);
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(out)
    }
}

fn non_null(raw: Option<&RawValue>) -> Option<&RawValue> {
    raw.filter(|r| r.get().trim_ascii() != "null")
}

/// `messages`: an array of message objects, flattened into segments in order.
struct MessagesSeed<'s, 'de>(&'s mut Segments<'de>);

impl<'de> DeserializeSeed<'de> for MessagesSeed<'_, 'de> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for MessagesSeed<'_, 'de> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array of messages")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(MessageSeed(self.0))?.is_some() {}
        Ok(())
    }
}

/// One message or Responses item: role, then content (string or parts), then any other
/// prompt-bearing field (`tool_calls`, `output`, `arguments`...) as raw JSON. Only `type`
/// is left out, so chat messages and Responses items with the same text key alike.
struct MessageSeed<'s, 'de>(&'s mut Segments<'de>);

impl<'de> DeserializeSeed<'de> for MessageSeed<'_, 'de> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for MessageSeed<'_, 'de> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a message object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let out = self.0;
        while let Some(key) = map.next_key::<CowStr<'de>>()? {
            let raw: &'de RawValue = map.next_value()?;
            match key.0.as_ref() {
                "type" | "cache_control" => {}
                "role" => {
                    push_text_or_raw(out, raw);
                    out.push(SEP_ROLE);
                }
                "content" => push_content(out, raw).map_err(de::Error::custom)?,
                _ => {
                    if raw.get() != "null" {
                        push_text_or_raw(out, raw);
                        out.push(SEP_ROLE);
                    }
                }
            }
        }
        out.push(SEP_PART);
        Ok(())
    }
}

/// Message content: a string, null, or an array of parts (`{"type":"text","text":...}`,
/// images and the like). Text parts contribute their text; other parts their raw fields.
fn push_content<'de>(out: &mut Segments<'de>, raw: &'de RawValue) -> Result<(), RequestError> {
    match first_byte(raw) {
        b'"' => push_text_or_raw(out, raw),
        b'n' => {}
        b'[' => {
            let mut de = serde_json::Deserializer::from_str(raw.get());
            PartsSeed(out).deserialize(&mut de).map_err(json_err)?;
        }
        _ => {
            return Err(RequestError::BadShape {
                field: "content",
                expected: "a string, an array of parts or null",
            })
        }
    }
    Ok(())
}

struct PartsSeed<'s, 'de>(&'s mut Segments<'de>);

impl<'de> DeserializeSeed<'de> for PartsSeed<'_, 'de> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for PartsSeed<'_, 'de> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array of content parts")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(PartSeed(self.0))?.is_some() {}
        Ok(())
    }
}

struct PartSeed<'s, 'de>(&'s mut Segments<'de>);

impl<'de> DeserializeSeed<'de> for PartSeed<'_, 'de> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for PartSeed<'_, 'de> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a content part object")
    }
    // Some servers accept bare strings as parts; they key like text parts when unescaped.
    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<(), E> {
        self.0.push(v.as_bytes());
        self.0.push(SEP_PART);
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key::<CowStr<'de>>()? {
            let raw: &'de RawValue = map.next_value()?;
            if !matches!(key.0.as_ref(), "type" | "cache_control") {
                push_text_or_raw(self.0, raw);
            }
        }
        self.0.push(SEP_PART);
        Ok(())
    }
}

/// `/v1/completions` `prompt`: a string, or a list of strings (or token ids), as sent.
fn completion_prompt(raw: &RawValue) -> Result<Segments<'_>, RequestError> {
    let mut out = Vec::new();
    match first_byte(raw) {
        b'"' => push_text_or_raw(&mut out, raw),
        b'[' => {
            let items: Vec<&RawValue> = serde_json::from_str(raw.get()).map_err(json_err)?;
            for item in items {
                push_text_or_raw(&mut out, item);
                out.push(SEP_PART);
            }
        }
        _ => {
            return Err(RequestError::BadShape {
                field: "prompt",
                expected: "a string or an array",
            })
        }
    }
    Ok(out)
}

/// `/v1/responses` `input`: a string or a list of items (messages, tool calls, outputs).
fn responses_input(raw: &RawValue) -> Result<Segments<'_>, RequestError> {
    let mut out = Vec::new();
    match first_byte(raw) {
        b'"' => push_text_or_raw(&mut out, raw),
        b'[' => {
            let items: Vec<&RawValue> = serde_json::from_str(raw.get()).map_err(json_err)?;
            for item in items {
                if first_byte(item) == b'{' {
                    let mut de = serde_json::Deserializer::from_str(item.get());
                    MessageSeed(&mut out)
                        .deserialize(&mut de)
                        .map_err(json_err)?;
                } else {
                    push_text_or_raw(&mut out, item);
                    out.push(SEP_PART);
                }
            }
        }
        _ => {
            return Err(RequestError::BadShape {
                field: "input",
                expected: "a string or an array of items",
            })
        }
    }
    Ok(out)
}
