//! A Hugging Face tokenizer (`tokenizer.json`) with the model's chat template and special
//! tokens (`tokenizer_config.json`), loaded once at start-up.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;

use super::output_words;
use super::template::{ChatInput, ChatTemplate, RenderError};
use crate::engine::OutputVocab;

/// Why a tokenizer could not be loaded; each names the file at fault.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot read {}: {source}", .path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{} is not a valid tokenizer.json: {message}", .path.display())]
    Tokenizer { path: PathBuf, message: String },
    #[error("{} is not a valid tokenizer_config.json: {message}", .path.display())]
    Config { path: PathBuf, message: String },
    #[error("the chat template from {} does not compile: {message}", .path.display())]
    Template { path: PathBuf, message: String },
    #[error(
        "{}: none of kvoy-sim's output words (`The`, ` the`, ` and`...) is a single token \
         that re-tokenizes alike, so answers cannot be made of this vocabulary",
        .path.display()
    )]
    NoOutputWords { path: PathBuf },
}

/// A tokenizer failure on some input (rare: byte-level tokenizers encode any text).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("tokenizer: {0}")]
pub struct EncodeError(pub String);

/// The fields read from `tokenizer_config.json` (it has many more; they are ignored).
#[derive(Debug, Default, Deserialize)]
struct Config {
    #[serde(default)]
    chat_template: Option<TemplateField>,
    #[serde(default)]
    bos_token: Option<TokenField>,
    #[serde(default)]
    eos_token: Option<TokenField>,
}

/// `chat_template`: one template, or named ones (`default`, `tool_use`...).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum TemplateField {
    One(String),
    Named(Vec<NamedTemplate>),
}

#[derive(Debug, Deserialize)]
struct NamedTemplate {
    name: String,
    template: String,
}

/// A special token: its text, or an `AddedToken` object with its `content`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum TokenField {
    Text(String),
    Added { content: String },
}

impl TokenField {
    fn into_text(self) -> String {
        match self {
            TokenField::Text(t) | TokenField::Added { content: t } => t,
        }
    }
}

/// A loaded tokenizer (see the module doc).
pub struct HfTokenizer {
    path: PathBuf,
    inner: tokenizers::Tokenizer,
    template: Option<ChatTemplate>,
    output: Arc<OutputVocab>,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size())
            .field("chat_template", &self.template.is_some())
            .finish_non_exhaustive()
    }
}

fn read(path: &Path) -> Result<String, LoadError> {
    std::fs::read_to_string(path).map_err(|source| LoadError::Read {
        path: path.to_owned(),
        source,
    })
}

impl HfTokenizer {
    /// Loads `tokenizer_json`; see [`Tokenizer::load`](super::Tokenizer::load) for where the
    /// chat template comes from.
    pub fn load(tokenizer_json: &Path, chat_template: Option<&Path>) -> Result<Self, LoadError> {
        let text = read(tokenizer_json)?;
        let mut inner: tokenizers::Tokenizer = text.parse().map_err(|e| LoadError::Tokenizer {
            path: tokenizer_json.to_owned(),
            message: format!("{e}"),
        })?;
        // As transformers calls it: no truncation or padding unless asked (a tokenizer.json
        // may carry the settings of its training run).
        inner
            .with_truncation(None)
            .map_err(|e| LoadError::Tokenizer {
                path: tokenizer_json.to_owned(),
                message: format!("{e}"),
            })?
            .with_padding(None);
        let dir = tokenizer_json.parent().unwrap_or(Path::new("."));
        let config_path = dir.join("tokenizer_config.json");
        let config = if config_path.exists() {
            serde_json::from_str::<Config>(&read(&config_path)?).map_err(|e| LoadError::Config {
                path: config_path.clone(),
                message: e.to_string(),
            })?
        } else {
            Config::default()
        };
        let bos = config.bos_token.map(TokenField::into_text);
        let eos = config.eos_token.map(TokenField::into_text);
        let jinja_path = dir.join("chat_template.jinja");
        let source = match (chat_template, config.chat_template) {
            (Some(p), _) => Some((p.to_owned(), read(p)?)),
            (None, _) if jinja_path.exists() => Some((jinja_path.clone(), read(&jinja_path)?)),
            (None, Some(TemplateField::One(t))) => Some((config_path.clone(), t)),
            (None, Some(TemplateField::Named(named))) => {
                let pick = named
                    .iter()
                    .position(|n| n.name == "default")
                    .unwrap_or_default();
                named
                    .into_iter()
                    .nth(pick)
                    .map(|n| (config_path.clone(), n.template))
            }
            (None, None) => None,
        };
        let template = match source {
            Some((path, source)) => {
                Some(
                    ChatTemplate::new(source, bos, eos).map_err(|e| LoadError::Template {
                        path,
                        message: e.to_string(),
                    })?,
                )
            }
            None => {
                log::warn!(
                    "{}: no chat template; chat requests will be refused",
                    tokenizer_json.display()
                );
                None
            }
        };
        let output = output_words::choose(&inner).ok_or_else(|| LoadError::NoOutputWords {
            path: tokenizer_json.to_owned(),
        })?;
        Ok(HfTokenizer {
            path: tokenizer_json.to_owned(),
            inner,
            template,
            output: Arc::new(output),
        })
    }

    /// The `tokenizer.json` it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Token ids of `text`; `add_special_tokens` runs the post-processor (a BOS for Llama).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, EncodeError> {
        encode(&self.inner, text, add_special_tokens)
    }

    /// The text of `ids`, special tokens skipped (vLLM's default for answers).
    pub fn decode(&self, ids: &[u32]) -> Result<String, EncodeError> {
        self.inner
            .decode(ids, true)
            .map_err(|e| EncodeError(e.to_string()))
    }

    /// Ids, added tokens included, are below this.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The vocabulary entry of `id` (byte-level tokens show `Ġ` for a space, as in vLLM's
    /// `token_strs`).
    pub fn token_str(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The chat template, when the model has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }

    /// Renders a conversation with the chat template; `now_unix` is the time `strftime_now`
    /// formats.
    pub fn render_chat(&self, input: &ChatInput, now_unix: u64) -> Result<String, RenderError> {
        self.template
            .as_ref()
            .ok_or(RenderError::NoTemplate)?
            .render(input, now_unix)
    }

    /// The words answers are made of: single tokens of this vocabulary.
    pub fn output(&self) -> Arc<OutputVocab> {
        self.output.clone()
    }
}

pub(super) fn encode(
    t: &tokenizers::Tokenizer,
    text: &str,
    add_special_tokens: bool,
) -> Result<Vec<u32>, EncodeError> {
    t.encode_fast(text, add_special_tokens)
        .map(|e| e.get_ids().to_vec())
        .map_err(|e| EncodeError(e.to_string()))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn testdata(file: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../testdata/tokenizer")
            .join(file)
    }

    #[test]
    fn loads_the_test_tokenizer_with_its_template_and_special_tokens() {
        let t = HfTokenizer::load(&testdata("tokenizer.json"), None).unwrap();
        assert!(t.vocab_size() > 1000, "{}", t.vocab_size());
        assert!(t.chat_template().is_some());
        let bos = t.token_id("<|begin_of_text|>").unwrap();
        let ids = t.encode("hello", true).unwrap();
        assert_eq!(ids[0], bos);
        assert_eq!(t.encode("hello", false).unwrap(), ids[1..]);
        // special tokens in the text are matched whole, with or without add_special_tokens
        let eot = t.token_id("<|eot_id|>").unwrap();
        assert_eq!(t.encode("<|eot_id|>", false).unwrap(), vec![eot]);
        assert!(format!("{t:?}").contains("tokenizer.json"));
    }

    #[test]
    fn bad_files_are_named_in_the_error() {
        let missing = Path::new("/nonexistent/tokenizer.json");
        let e = HfTokenizer::load(missing, None).unwrap_err();
        assert!(matches!(e, LoadError::Read { .. }), "{e}");
        assert!(e.to_string().contains("/nonexistent/tokenizer.json"), "{e}");

        let dir = std::env::temp_dir().join(format!("kvoy-sim-hf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bad = dir.join("tokenizer.json");
        std::fs::write(&bad, "{\"not\": \"a tokenizer\"}").unwrap();
        let e = HfTokenizer::load(&bad, None).unwrap_err();
        assert!(matches!(e, LoadError::Tokenizer { .. }), "{e}");
        assert!(e.to_string().contains(&bad.display().to_string()), "{e}");

        // a good tokenizer with a broken config beside it
        std::fs::copy(testdata("tokenizer.json"), &bad).unwrap();
        let config = dir.join("tokenizer_config.json");
        std::fs::write(&config, "{\"chat_template\": 5}").unwrap();
        let e = HfTokenizer::load(&bad, None).unwrap_err();
        assert!(matches!(e, LoadError::Config { .. }), "{e}");
        assert!(e.to_string().contains("tokenizer_config.json"), "{e}");

        // a template that does not compile, and a missing --chat-template file
        std::fs::write(&config, "{\"chat_template\": \"{% for m in messages %}\"}").unwrap();
        let e = HfTokenizer::load(&bad, None).unwrap_err();
        assert!(matches!(e, LoadError::Template { .. }), "{e}");
        let e = HfTokenizer::load(&bad, Some(&dir.join("nope.jinja"))).unwrap_err();
        assert!(e.to_string().contains("nope.jinja"), "{e}");

        // no config at all: loads, without a chat template
        std::fs::remove_file(&config).unwrap();
        let t = HfTokenizer::load(&bad, None).unwrap();
        assert!(t.chat_template().is_none());
        let e = t.render_chat(&ChatInput::default(), 0).unwrap_err();
        assert_eq!(e, RenderError::NoTemplate);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
