//! A deterministic stand-in tokenizer: about 4 bytes per token.
//!
//! The UTF-8 bytes of a text are cut into 4-byte chunks counted from the start of the text (the
//! last chunk may be shorter); each chunk becomes one token whose id is the low 32 bits of
//! `xxh3_64(chunk)`. Hence:
//! - equal texts give equal token sequences;
//! - two texts sharing a byte prefix of `L` bytes share their first `L / 4` tokens (the shared
//!   prefix is fully tokenized alike only when it ends on a 4-byte boundary; the chunk straddling
//!   the end of the shared bytes differs in general);
//! - a text of `n` bytes has `ceil(n / 4)` tokens.
//!
//! Chunks may split a multi-byte UTF-8 character: tokens are over bytes, not characters.
//!
//! Generated (output) tokens come from a fixed vocabulary of 4-byte ASCII words
//! ([`generated_word`]), so that the text a server returns, appended to the next prompt at a
//! 4-byte boundary, tokenizes back to the very same ids ([`generated_token`]) — the multi-turn
//! case where a conversation's history is served from the prefix cache.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Bytes per token.
pub const BYTES_PER_TOKEN: usize = 4;

/// Output vocabulary: 4-byte ASCII words, each one token.
pub(crate) const WORDS: [&str; 16] = [
    "the ", "and ", "for ", "you ", "not ", "but ", "can ", "all ", "was ", "one ", "our ", "out ",
    "day ", "get ", "has ", "new ",
];

/// The token id of one chunk of at most [`BYTES_PER_TOKEN`] bytes.
pub fn chunk_token(chunk: &[u8]) -> u32 {
    // Truncation to the low 32 bits is the documented id.
    xxh3_64(chunk) as u32
}

/// Tokenizes `text` (see the module doc).
pub fn tokenize(text: &str) -> Vec<u32> {
    tokenize_bytes(text.as_bytes())
}

/// Tokenizes raw bytes (see the module doc).
pub fn tokenize_bytes(bytes: &[u8]) -> Vec<u32> {
    bytes.chunks(BYTES_PER_TOKEN).map(chunk_token).collect()
}

/// The number of tokens [`tokenize`] gives for `text`, without allocating.
pub fn count_tokens(text: &str) -> usize {
    text.len().div_ceil(BYTES_PER_TOKEN)
}

/// The text of the `index`-th generated token of request `request_id`: a 4-byte ASCII word.
pub fn generated_word(request_id: u64, index: u32) -> &'static str {
    let h = xxh3_64_with_seed(&index.to_le_bytes(), request_id);
    WORDS[(h % WORDS.len() as u64) as usize]
}

/// The id of the `index`-th generated token of request `request_id`; equals
/// `tokenize(generated_word(request_id, index))[0]`.
pub fn generated_token(request_id: u64, index: u32) -> u32 {
    chunk_token(generated_word(request_id, index).as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_text_equal_tokens_and_shared_prefix() {
        let a = tokenize("hello world, this is a prompt");
        assert_eq!(a, tokenize("hello world, this is a prompt"));
        assert_eq!(a.len(), count_tokens("hello world, this is a prompt"));
        // 12 shared bytes: 3 shared tokens, then divergence.
        let b = tokenize("hello world!something else");
        assert_eq!(a[..2], b[..2]);
        let c = tokenize("hello world,XXXX");
        assert_eq!(a[..3], c[..3]);
        assert_ne!(a[3], c[3]);
    }

    #[test]
    fn empty_and_short_texts() {
        assert!(tokenize("").is_empty());
        assert_eq!(tokenize("ab").len(), 1);
        assert_eq!(count_tokens("abcde"), 2);
        // Multi-byte characters are split on byte boundaries without panicking.
        assert_eq!(tokenize("日本語").len(), 3);
    }

    #[test]
    fn generated_words_round_trip() {
        for i in 0..100 {
            let word = generated_word(42, i);
            assert_eq!(word.len(), BYTES_PER_TOKEN);
            assert_eq!(tokenize(word), vec![generated_token(42, i)]);
        }
    }
}
