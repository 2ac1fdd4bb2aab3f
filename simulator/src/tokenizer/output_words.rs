//! Picks the words a real tokenizer's answers are made of: English words that are single
//! tokens of its vocabulary and that keep their ids when an answer is tokenized again, so the
//! assistant's text sent back in the next turn re-tokenizes to the ids the engine generated
//! (and cached).
//!
//! A first word (`The`, no leading space: it follows the chat template's generation prompt)
//! and later words (` the`, ` and`...) qualify when each encodes to one token and every pair
//! among the kept ones (first + later, later + later) encodes to the two ids and decodes back
//! to the concatenated text. Byte-level BPE tokenizers whose pre-tokenizer splits before a
//! space (GPT-2, Llama 3, Qwen) keep longer answers alike too; that is not checked beyond pairs.

use std::sync::Arc;

use super::hf::encode;
use crate::engine::{OutputVocab, OutputWord};

const FIRST: [&str; 16] = [
    "The", "This", "It", "We", "You", "Here", "Yes", "So", "In", "For", "A", "One", "That",
    "There", "When", "If",
];

const LATER: [&str; 48] = [
    "the", "and", "for", "you", "not", "but", "can", "all", "was", "one", "our", "out", "day",
    "get", "has", "new", "is", "of", "to", "in", "it", "that", "with", "as", "on", "be", "at",
    "by", "this", "from", "or", "are", "more", "will", "time", "some", "what", "when", "which",
    "their", "there", "about", "would", "like", "so", "just", "into", "than",
];

/// The single-token id of `text`, if it is one.
fn single(t: &tokenizers::Tokenizer, text: &str) -> Option<u32> {
    match encode(t, text, false).ok()?.as_slice() {
        [id] => Some(*id),
        _ => None,
    }
}

/// `a` then `b` encode to their two ids and decode to their text.
fn pair_ok(t: &tokenizers::Tokenizer, a: &OutputWord, b: &OutputWord) -> bool {
    let text = format!("{}{}", a.text, b.text);
    encode(t, &text, false).is_ok_and(|ids| ids == [a.id, b.id])
        && t.decode(&[a.id, b.id], true).is_ok_and(|d| d == text)
}

fn candidates(t: &tokenizers::Tokenizer, words: &[&str], space: bool) -> Vec<OutputWord> {
    words
        .iter()
        .filter_map(|w| {
            let text = if space {
                format!(" {w}")
            } else {
                (*w).to_owned()
            };
            let id = single(t, &text)?;
            Some(OutputWord {
                id,
                text: Arc::from(text),
            })
        })
        .collect()
}

/// The vocabulary, or `None` when no first and later word qualify.
pub(super) fn choose(t: &tokenizers::Tokenizer) -> Option<OutputVocab> {
    let mut rest: Vec<OutputWord> = Vec::new();
    for w in candidates(t, &LATER, true) {
        if pair_ok(t, &w, &w) && rest.iter().all(|r| pair_ok(t, r, &w) && pair_ok(t, &w, r)) {
            rest.push(w);
        }
    }
    let first: Vec<OutputWord> = candidates(t, &FIRST, false)
        .into_iter()
        .filter(|f| rest.iter().all(|r| pair_ok(t, f, r)))
        .collect();
    OutputVocab::new(first, rest).ok()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn test_tokenizer() -> tokenizers::Tokenizer {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../testdata/tokenizer/tokenizer.json"
        );
        tokenizers::Tokenizer::from_file(path).unwrap()
    }

    #[test]
    fn answers_re_tokenize_to_the_generated_ids() {
        let t = test_tokenizer();
        let v = choose(&t).unwrap();
        assert!(v.first().len() >= 4 && v.rest().len() >= 16, "{v:?}");
        for request in 1..20u64 {
            let words: Vec<&OutputWord> = (0..40).map(|i| v.pick(request, i)).collect();
            let text: String = words.iter().map(|w| &*w.text).collect();
            let ids: Vec<u32> = words.iter().map(|w| w.id).collect();
            assert_eq!(encode(&t, &text, false).unwrap(), ids, "{text}");
            assert_eq!(t.decode(&ids, true).unwrap(), text);
            assert!(!text.starts_with(' '));
        }
    }
}
