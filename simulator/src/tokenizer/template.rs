//! Chat templates rendered as Hugging Face transformers (and so vLLM) render them: jinja2 with
//! `trim_blocks` and `lstrip_blocks`, loop controls, the variables `messages`, `tools`,
//! `add_generation_prompt`, `bos_token` and `eos_token` (plus the request's
//! `chat_template_kwargs`), the helpers `raise_exception` and `strftime_now`, Python's string
//! and dict methods (`.strip()`, `.items()`...) and a `tojson` that writes what Python's
//! `json.dumps` writes.
//!
//! ```
//! use kvoy_sim::tokenizer::{ChatInput, ChatTemplate};
//! use minijinja::Value;
//!
//! let t = ChatTemplate::new(
//!     "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content.strip() }}\n{% endfor %}"
//!         .to_owned(),
//!     Some("<s>".to_owned()),
//!     None,
//! )
//! .unwrap();
//! let hi = Value::from_pairs([("role", "user"), ("content", " hi ")]);
//! let input = ChatInput::new(vec![hi]);
//! assert_eq!(t.render(&input, 0).unwrap(), "<s>[user] hi\n");
//! ```

use minijinja::syntax::SyntaxConfig;
use minijinja::{AutoEscape, Environment, Error, ErrorKind, Value};

use super::{pyjson, strftime};

const NAME: &str = "chat_template";

/// What a chat template is rendered with.
#[derive(Debug, Clone)]
pub struct ChatInput {
    /// The conversation, each message a map (`role`, `content`, and any other field sent).
    pub messages: Vec<Value>,
    /// The request's tools, as sent (`none` when it has none, as transformers passes them).
    pub tools: Option<Value>,
    /// End the prompt with the assistant's header (true unless the request says otherwise).
    pub add_generation_prompt: bool,
    /// The request's `chat_template_kwargs`: more variables (the ones above take precedence).
    pub kwargs: Vec<(String, Value)>,
}

impl ChatInput {
    /// A conversation with no tools, ending in a generation prompt.
    pub fn new(messages: Vec<Value>) -> Self {
        ChatInput {
            messages,
            tools: None,
            add_generation_prompt: true,
            kwargs: Vec::new(),
        }
    }
}

impl Default for ChatInput {
    fn default() -> Self {
        ChatInput::new(Vec::new())
    }
}

/// Why a conversation could not be rendered: a client error (HTTP 400) in vLLM, too.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RenderError {
    #[error(
        "the model has no chat template: chat requests need one (kvoy-sim --chat-template PATH)"
    )]
    NoTemplate,
    /// The template failed, or called `raise_exception` (e.g. roles out of order).
    #[error("the chat template failed on this conversation: {0}")]
    Template(String),
}

/// A compiled chat template and the special tokens it is given.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos: Option<String>,
    eos: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish_non_exhaustive()
    }
}

/// jinja2's `raise_exception`, which templates call to refuse a conversation.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// A template error with its cause and location, as one line.
fn describe(e: &Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

impl ChatTemplate {
    /// Compiles `source`; `bos` and `eos` become `bos_token` and `eos_token`.
    pub fn new(source: String, bos: Option<String>, eos: Option<String>) -> Result<Self, Error> {
        let mut env = Environment::new();
        env.set_syntax(
            SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()?,
        );
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", pyjson::tojson);
        env.add_template_owned(NAME, source)?;
        Ok(ChatTemplate { env, bos, eos })
    }

    /// Renders `input`; `now_unix` (seconds) is what `strftime_now` formats, in UTC.
    pub fn render(&self, input: &ChatInput, now_unix: u64) -> Result<String, RenderError> {
        let mut vars: Vec<(String, Value)> = input.kwargs.clone();
        let own = [
            ("messages", Value::from(input.messages.clone())),
            ("tools", input.tools.clone().unwrap_or(Value::from(()))),
            ("documents", Value::from(())),
            (
                "add_generation_prompt",
                Value::from(input.add_generation_prompt),
            ),
            (
                "strftime_now",
                Value::from_function(move |format: &str| strftime::format(format, now_unix)),
            ),
        ];
        vars.extend(own.into_iter().map(|(k, v)| (k.to_owned(), v)));
        for (name, token) in [("bos_token", &self.bos), ("eos_token", &self.eos)] {
            if let Some(t) = token {
                vars.push((name.to_owned(), Value::from(t.as_str())));
            }
        }
        let template = self
            .env
            .get_template(NAME)
            .map_err(|e| RenderError::Template(describe(&e)))?;
        template
            .render(Value::from_pairs(vars))
            .map_err(|e| RenderError::Template(describe(&e)))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn message(role: &str, content: &str) -> Value {
        Value::from_pairs([("role", role), ("content", content)])
    }

    fn template(source: &str) -> ChatTemplate {
        ChatTemplate::new(source.to_owned(), Some("<s>".into()), Some("</s>".into())).unwrap()
    }

    #[test]
    fn hf_conventions() {
        // trim_blocks and lstrip_blocks: block tags leave no whitespace behind
        let t = template(
            "{% for m in messages %}\n    {% if loop.first %}\n[{{ m['role'] }}]{% endif %}\n{{ m.content | trim }}|{% endfor %}\n",
        );
        let input = ChatInput::new(vec![message("user", " a "), message("assistant", "b")]);
        assert_eq!(t.render(&input, 0).unwrap(), "[user]a|b|");
        // special tokens, the generation flag, kwargs (which cannot override messages)
        let t = template(
            "{{ bos_token }}{{ messages | length }}{{ add_generation_prompt }}{{ eos_token }}{{ extra }}",
        );
        let mut input = ChatInput::new(vec![message("user", "x")]);
        input.add_generation_prompt = false;
        input.kwargs = vec![
            ("extra".into(), Value::from("!")),
            ("messages".into(), Value::from(7)),
        ];
        // booleans print as Python prints them
        assert_eq!(t.render(&input, 0).unwrap(), "<s>1False</s>!");
        // loop controls and python methods
        let t = template(
            "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}{{ m.content.upper() }}{% for k, v in m.items() %}{{ k }}{% endfor %}{% endfor %}",
        );
        let input = ChatInput::new(vec![message("system", "s"), message("user", "u")]);
        assert_eq!(t.render(&input, 0).unwrap(), "Urolecontent");
        // tools are none when absent, as transformers passes them
        let t = template("{% if tools is none %}none{% else %}{{ tools | tojson }}{% endif %}");
        let mut input = ChatInput::new(vec![]);
        assert_eq!(t.render(&input, 0).unwrap(), "none");
        input.tools = Some(Value::from_pairs([("b", 1), ("a", 2)]));
        assert_eq!(t.render(&input, 0).unwrap(), r#"{"b": 1, "a": 2}"#);
        // strftime_now formats the time given
        let t = template("{{ strftime_now('%d %b %Y') }}");
        assert_eq!(t.render(&input, 1_721_952_000).unwrap(), "26 Jul 2024");
    }

    #[test]
    fn failures_are_errors_not_panics() {
        let t = template(
            "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok",
        );
        let e = t
            .render(&ChatInput::new(vec![message("assistant", "x")]), 0)
            .unwrap_err();
        assert!(
            matches!(&e, RenderError::Template(m) if m.contains("first must be user")),
            "{e}"
        );
        assert_eq!(
            t.render(&ChatInput::new(vec![message("user", "x")]), 0)
                .unwrap(),
            "ok"
        );
        // an undefined method on client data, an index out of range
        let t = template("{{ messages[0].content.frobnicate() }}");
        assert!(t
            .render(&ChatInput::new(vec![message("user", "x")]), 0)
            .is_err());
        let t = template("{{ messages[3]['role'].strip() }}");
        assert!(t.render(&ChatInput::new(vec![]), 0).is_err());
        assert!(ChatTemplate::new("{% if %}".into(), None, None).is_err());
        assert!(
            ChatTemplate::new("{% generation %}x{% endgeneration %}".into(), None, None).is_err()
        );
    }
}
