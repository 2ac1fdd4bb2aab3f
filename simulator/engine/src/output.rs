//! What the simulated model generates: words of a fixed vocabulary, chosen by a hash of the
//! request id and the token's position, so a run replays exactly.
//!
//! The engine appends the chosen token ids to the sequence (they fill its output blocks and
//! their KV events); the server streams the words' text. The stand-in tokenizer's vocabulary
//! ([`OutputVocab::stand_in`]) gives exactly [`generated_token`](super::tokenizer::generated_token)
//! and [`generated_word`](super::tokenizer::generated_word); a real tokenizer supplies its own
//! (words that are single tokens of its vocabulary), with a separate list for the first token
//! of an answer, which follows the chat template's generation prompt (`The`, not ` the`).
//!
//! ```
//! use kvoy_sim_engine::tokenizer::{generated_token, generated_word};
//! use kvoy_sim_engine::OutputVocab;
//!
//! let vocab = OutputVocab::stand_in();
//! let word = vocab.pick(7, 3);
//! assert_eq!((word.id, &*word.text), (generated_token(7, 3), generated_word(7, 3)));
//! ```

use std::sync::{Arc, LazyLock};

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::tokenizer::{chunk_token, WORDS};

/// One generated token: its id and the text it adds to the answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputWord {
    pub id: u32,
    pub text: Arc<str>,
}

/// The words an answer is made of (see the module doc). Never empty.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputVocab {
    /// For the answer's first token.
    first: Vec<OutputWord>,
    /// For every later token.
    rest: Vec<OutputWord>,
}

/// Why a vocabulary cannot be built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("an output vocabulary needs at least one first word and one later word")]
pub struct EmptyVocab;

static STAND_IN: LazyLock<Arc<OutputVocab>> = LazyLock::new(|| {
    let words: Vec<OutputWord> = WORDS
        .iter()
        .map(|w| OutputWord {
            id: chunk_token(w.as_bytes()),
            text: Arc::from(*w),
        })
        .collect();
    Arc::new(OutputVocab {
        first: words.clone(),
        rest: words,
    })
});

impl OutputVocab {
    /// A vocabulary from words for the first token and words for the later ones.
    pub fn new(first: Vec<OutputWord>, rest: Vec<OutputWord>) -> Result<OutputVocab, EmptyVocab> {
        if first.is_empty() || rest.is_empty() {
            return Err(EmptyVocab);
        }
        Ok(OutputVocab { first, rest })
    }

    /// The stand-in tokenizer's 16 four-byte words (shared, built once).
    pub fn stand_in() -> Arc<OutputVocab> {
        STAND_IN.clone()
    }

    /// The `index`-th generated token of request `request_id`.
    pub fn pick(&self, request_id: u64, index: u32) -> &OutputWord {
        let words = if index == 0 { &self.first } else { &self.rest };
        let h = xxh3_64_with_seed(&index.to_le_bytes(), request_id);
        // `new` refuses empty lists; the modulo keeps the index in range.
        &words[(h % words.len() as u64) as usize]
    }

    /// The words for the first token.
    pub fn first(&self) -> &[OutputWord] {
        &self.first
    }

    /// The words for the later tokens.
    pub fn rest(&self) -> &[OutputWord] {
        &self.rest
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::tokenizer::{generated_token, generated_word};

    #[test]
    fn the_stand_in_vocabulary_is_the_stand_in_tokenizers() {
        let v = OutputVocab::stand_in();
        for id in [1, 2, 99, u64::MAX] {
            for i in 0..50 {
                let w = v.pick(id, i);
                assert_eq!(w.id, generated_token(id, i));
                assert_eq!(&*w.text, generated_word(id, i));
            }
        }
    }

    #[test]
    fn first_and_later_words_come_from_their_lists() {
        let word = |id, text: &str| OutputWord {
            id,
            text: Arc::from(text),
        };
        let v = OutputVocab::new(vec![word(1, "The")], vec![word(2, " a"), word(3, " b")]).unwrap();
        assert_eq!(v.pick(5, 0).id, 1);
        assert!((1..40).all(|i| v.pick(5, i).id != 1));
        assert_eq!(
            OutputVocab::new(vec![], vec![word(2, " a")]),
            Err(EmptyVocab)
        );
        assert_eq!(
            OutputVocab::new(vec![word(1, "The")], vec![]),
            Err(EmptyVocab)
        );
    }
}
