//! OpenAI bodies walked once with [`Cursor`]. Prompt text stays borrowed as the raw JSON string
//! bytes the client sent; only the few scalar fields kvoy reads are unescaped.

use std::borrow::Cow;

use super::json::{unescape, Cursor, JsonError};
use super::{Api, ParsedRequest, RequestError, SEP_PART, SEP_ROLE};

/// The prompt's byte runs, at most `limit` of them: a body of many tiny messages or parts
/// cannot grow the list (and the work per request) without bound.
struct Segments<'a> {
    parts: Vec<&'a [u8]>,
    limit: usize,
}

impl<'a> Segments<'a> {
    fn new(limit: usize) -> Self {
        Segments {
            parts: Vec::new(),
            limit,
        }
    }

    fn push(&mut self, run: &'a [u8]) -> Result<()> {
        if self.parts.len() >= self.limit {
            return Err(FieldError::Shape(RequestError::TooManySegments {
                limit: self.limit,
            }));
        }
        self.parts.push(run);
        Ok(())
    }
}

/// An error inside a field: a JSON error, or a well-formed value of the wrong shape.
enum FieldError {
    Json(JsonError),
    Shape(RequestError),
}

impl From<JsonError> for FieldError {
    fn from(e: JsonError) -> Self {
        FieldError::Json(e)
    }
}

impl From<FieldError> for RequestError {
    fn from(e: FieldError) -> Self {
        match e {
            FieldError::Json(e) => RequestError::Json(e.to_string()),
            FieldError::Shape(e) => e,
        }
    }
}

type Result<T, E = FieldError> = std::result::Result<T, E>;

/// A value of the wrong shape, unless the body simply ended (a truncated body is a JSON error).
fn shape(c: &mut Cursor<'_>, field: &'static str, expected: &'static str) -> FieldError {
    if c.peek().is_none() {
        return FieldError::Json(JsonError::Eof);
    }
    FieldError::Shape(RequestError::BadShape { field, expected })
}

/// Runs an object walk whose member handler can fail with a shape error.
fn walk_object<'a>(
    cur: &mut Cursor<'a>,
    mut member: impl FnMut(&mut Cursor<'a>, &'a [u8]) -> Result<()>,
) -> Result<()> {
    let mut shape_err = None;
    let walked = cur.object(|c, key| match member(c, key) {
        Ok(()) => Ok(()),
        Err(FieldError::Json(e)) => Err(e),
        Err(FieldError::Shape(e)) => {
            shape_err = Some(e);
            Err(JsonError::Eof) // stops the walk; replaced below
        }
    });
    match (walked, shape_err) {
        (_, Some(e)) => Err(FieldError::Shape(e)),
        (Err(e), None) => Err(e.into()),
        (Ok(()), None) => Ok(()),
    }
}

/// Same as [`walk_object`] for arrays.
fn walk_array<'a>(
    cur: &mut Cursor<'a>,
    mut element: impl FnMut(&mut Cursor<'a>) -> Result<()>,
) -> Result<()> {
    let mut shape_err = None;
    let walked = cur.array(|c| match element(c) {
        Ok(()) => Ok(()),
        Err(FieldError::Json(e)) => Err(e),
        Err(FieldError::Shape(e)) => {
            shape_err = Some(e);
            Err(JsonError::Eof)
        }
    });
    match (walked, shape_err) {
        (_, Some(e)) => Err(FieldError::Shape(e)),
        (Err(e), None) => Err(e.into()),
        (Ok(()), None) => Ok(()),
    }
}

#[derive(Default)]
struct BodyFields<'a> {
    model: Option<Cow<'a, str>>,
    stream: Option<bool>,
    user: Option<Cow<'a, str>>,
    cache_salt: Option<Cow<'a, str>>,
    previous_response_id: Option<Cow<'a, str>>,
    conversation: Option<Cow<'a, str>>,
    tools: Option<&'a [u8]>,
    instructions: Option<&'a [u8]>,
    main: Option<Segments<'a>>,
}

/// A key as text: raw when it has no escapes (the common case), unescaped otherwise.
fn key_text(raw: &[u8]) -> Cow<'_, [u8]> {
    if raw.contains(&b'\\') {
        if let Some(k) = unescape(raw) {
            return Cow::Owned(k.into_owned().into_bytes());
        }
    }
    Cow::Borrowed(raw)
}

fn opt_text<'a>(cur: &mut Cursor<'a>, field: &'static str) -> Result<Option<Cow<'a, str>>> {
    if cur.null()? {
        return Ok(None);
    }
    if cur.peek() != Some(b'"') {
        return Err(shape(cur, field, "a string"));
    }
    Ok(Some(cur.text()?))
}

fn opt_raw<'a>(cur: &mut Cursor<'a>) -> Result<Option<&'a [u8]>> {
    if cur.null()? {
        return Ok(None);
    }
    Ok(Some(cur.value()?))
}

pub(super) fn parse_body(
    api: Api,
    body: &[u8],
    max_segments: usize,
) -> Result<ParsedRequest<'_>, RequestError> {
    let mut cur = Cursor::new(body);
    let mut f = BodyFields::default();
    let main_field = match api {
        Api::ChatCompletions => "messages",
        Api::Completions => "prompt",
        Api::Responses => "input",
    };
    if cur.peek() != Some(b'{') {
        return Err(RequestError::Json(
            "the body must be a JSON object".to_owned(),
        ));
    }
    walk_object(&mut cur, |c, key| {
        match (key_text(key).as_ref(), api) {
            (b"model", _) => f.model = opt_text(c, "model")?,
            (b"stream", _) => {
                f.stream = if c.null()? { None } else { Some(c.boolean()?) };
            }
            (b"user", _) => f.user = opt_text(c, "user")?,
            (b"cache_salt", _) => f.cache_salt = opt_text(c, "cache_salt")?,
            (b"previous_response_id", _) => {
                f.previous_response_id = opt_text(c, "previous_response_id")?
            }
            (b"conversation", Api::Responses) => f.conversation = conversation(c)?,
            (b"tools", _) => f.tools = opt_raw(c)?,
            (b"instructions", Api::Responses) => f.instructions = opt_raw(c)?,
            (b"messages", Api::ChatCompletions) => {
                let mut segs = Segments::new(max_segments);
                if c.peek() != Some(b'[') {
                    return Err(shape(c, "messages", "an array of message objects"));
                }
                walk_array(c, |c| message(c, &mut segs, "messages"))?;
                f.main = Some(segs);
            }
            (b"prompt", Api::Completions) => f.main = Some(completion_prompt(c, max_segments)?),
            (b"input", Api::Responses) => f.main = Some(responses_input(c, max_segments)?),
            _ => {
                c.value()?;
            }
        }
        Ok(())
    })?;
    cur.end().map_err(|e| RequestError::Json(e.to_string()))?;

    let model = f
        .model
        .filter(|m| !m.is_empty())
        .ok_or(RequestError::MissingModel)?;
    let main = f
        .main
        .ok_or(RequestError::MissingField { field: main_field })?;
    let mut prompt = Segments::new(max_segments);
    if let Some(tools) = f.tools {
        prompt.push(tools)?;
        prompt.push(SEP_PART)?;
    }
    if let Some(instructions) = f.instructions {
        prompt.push(text_or_raw(instructions))?;
        prompt.push(SEP_PART)?;
    }
    let prompt = if prompt.parts.is_empty() {
        main.parts
    } else {
        for run in main.parts {
            prompt.push(run)?;
        }
        prompt.parts
    };
    Ok(ParsedRequest {
        api,
        model,
        stream: f.stream.unwrap_or(false),
        user: f.user,
        cache_salt: f.cache_salt,
        previous_response_id: f.previous_response_id,
        conversation: f.conversation,
        prompt,
    })
}

/// Responses API `conversation`: an id string, or an object with an `id`.
fn conversation<'a>(cur: &mut Cursor<'a>) -> Result<Option<Cow<'a, str>>> {
    match cur.peek() {
        Some(b'{') => {
            let mut id = None;
            walk_object(cur, |c, key| {
                if key_text(key).as_ref() == b"id" {
                    id = opt_text(c, "conversation.id")?;
                } else {
                    c.value()?;
                }
                Ok(())
            })?;
            Ok(id)
        }
        _ => opt_text(cur, "conversation"),
    }
}

/// The inside of a raw JSON string value, or the raw value itself for anything else.
fn text_or_raw(raw: &[u8]) -> &[u8] {
    match raw {
        [b'"', inner @ .., b'"'] => inner,
        _ => raw,
    }
}

/// One chat message or Responses item: role, then content (string or parts), then any other
/// prompt-bearing field (`tool_calls`, `output`, `arguments`...) as raw JSON. `type` and
/// `cache_control` are left out, so chat messages and Responses items with the same text key
/// alike.
fn message<'a>(c: &mut Cursor<'a>, out: &mut Segments<'a>, field: &'static str) -> Result<()> {
    if c.peek() != Some(b'{') {
        return Err(shape(c, field, "an array of message objects"));
    }
    walk_object(c, |c, key| {
        match key_text(key).as_ref() {
            b"type" | b"cache_control" => {
                c.value()?;
            }
            b"role" => {
                out.push(text_or_raw(c.value()?))?;
                out.push(SEP_ROLE)?;
            }
            b"content" => content(c, out)?,
            _ => {
                let raw = c.value()?;
                if raw != b"null" {
                    out.push(text_or_raw(raw))?;
                    out.push(SEP_ROLE)?;
                }
            }
        }
        Ok(())
    })?;
    out.push(SEP_PART)?;
    Ok(())
}

/// Message content: a string, null, or an array of parts (`{"type":"text","text":...}`,
/// images and the like). Text parts contribute their text; other parts their raw fields.
fn content<'a>(c: &mut Cursor<'a>, out: &mut Segments<'a>) -> Result<()> {
    match c.peek() {
        Some(b'"') => out.push(c.string()?)?,
        Some(b'n') => {
            c.null()?;
        }
        Some(b'[') => walk_array(c, |c| {
            match c.peek() {
                Some(b'"') => out.push(c.string()?)?,
                Some(b'{') => walk_object(c, |c, key| {
                    let raw = c.value()?;
                    if !matches!(key_text(key).as_ref(), b"type" | b"cache_control") {
                        out.push(text_or_raw(raw))?;
                    }
                    Ok(())
                })?,
                _ => return Err(shape(c, "content", "an array of part objects or strings")),
            }
            out.push(SEP_PART)?;
            Ok(())
        })?,
        _ => return Err(shape(c, "content", "a string, an array of parts or null")),
    }
    Ok(())
}

/// `/v1/completions` `prompt`: a string, or a list of strings (or token ids), as sent.
fn completion_prompt<'a>(c: &mut Cursor<'a>, limit: usize) -> Result<Segments<'a>> {
    let mut out = Segments::new(limit);
    match c.peek() {
        Some(b'"') => out.push(c.string()?)?,
        Some(b'[') => walk_array(c, |c| {
            out.push(text_or_raw(c.value()?))?;
            out.push(SEP_PART)?;
            Ok(())
        })?,
        _ => return Err(shape(c, "prompt", "a string or an array")),
    }
    Ok(out)
}

/// `/v1/responses` `input`: a string or a list of items (messages, tool calls, outputs).
fn responses_input<'a>(c: &mut Cursor<'a>, limit: usize) -> Result<Segments<'a>> {
    let mut out = Segments::new(limit);
    match c.peek() {
        Some(b'"') => out.push(c.string()?)?,
        Some(b'[') => walk_array(c, |c| {
            if c.peek() == Some(b'{') {
                message(c, &mut out, "input")
            } else {
                out.push(text_or_raw(c.value()?))?;
                out.push(SEP_PART)?;
                Ok(())
            }
        })?,
        _ => return Err(shape(c, "input", "a string or an array of items")),
    }
    Ok(out)
}
