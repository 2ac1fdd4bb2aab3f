//! How a simulator turns prompts into token ids, and what its answers are made of.
//!
//! [`Tokenizer::StandIn`] (the default) is the engine's deterministic stand-in
//! ([`engine::tokenizer`](crate::engine::tokenizer)): about 4 bytes per token over the prompt
//! bytes kvoy-shared's parser sees. [`Tokenizer::Hf`] is a real Hugging Face tokenizer
//! (`--tokenizer PATH/tokenizer.json`), used as vLLM uses it: chat messages are rendered with
//! the model's chat template ([`ChatTemplate`]) and the text tokenized without special tokens;
//! completion prompts are tokenized with them. The KV events then carry the token ids a real
//! vLLM serving that tokenizer would publish.
//!
//! ```
//! use kvoy_sim::tokenizer::Tokenizer;
//!
//! let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/tokenizer");
//! let t = Tokenizer::load(format!("{dir}/tokenizer.json").as_ref(), None).unwrap();
//! let hf = t.hf().unwrap();
//! let ids = hf.encode("The cache is warm.", true).unwrap();
//! assert_eq!(ids[0], hf.token_id("<|begin_of_text|>").unwrap());
//! assert_eq!(hf.decode(&ids[1..]).unwrap(), "The cache is warm.");
//! ```

mod hf;
mod output_words;
mod pyjson;
mod strftime;
mod template;

use std::path::Path;
use std::sync::Arc;

use crate::engine::OutputVocab;

pub use hf::{EncodeError, HfTokenizer, LoadError};
pub use template::{ChatInput, ChatTemplate, RenderError};

/// A simulator's tokenizer (see the module doc).
#[derive(Debug, Clone, Default)]
pub enum Tokenizer {
    /// The engine's stand-in: 4-byte chunks of kvoy-shared's prompt bytes.
    #[default]
    StandIn,
    /// A real tokenizer and chat template.
    Hf(Arc<HfTokenizer>),
}

impl Tokenizer {
    /// Loads `tokenizer_json` and the chat template: `chat_template` when given, else the
    /// model's (`chat_template.jinja` or the `chat_template` field of `tokenizer_config.json`
    /// beside the tokenizer, as Hugging Face models keep them).
    pub fn load(tokenizer_json: &Path, chat_template: Option<&Path>) -> Result<Self, LoadError> {
        Ok(Tokenizer::Hf(Arc::new(HfTokenizer::load(
            tokenizer_json,
            chat_template,
        )?)))
    }

    /// The real tokenizer, if this is one.
    pub fn hf(&self) -> Option<&Arc<HfTokenizer>> {
        match self {
            Tokenizer::StandIn => None,
            Tokenizer::Hf(t) => Some(t),
        }
    }

    /// The words answers are made of.
    pub fn output(&self) -> Arc<OutputVocab> {
        match self {
            Tokenizer::StandIn => OutputVocab::stand_in(),
            Tokenizer::Hf(t) => t.output(),
        }
    }
}
