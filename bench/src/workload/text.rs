//! Prompt text, rendered on demand from compact [`Part`]s.
//!
//! Every part renders to a multiple of 4 bytes, the simulator tokenizer's chunk size
//! (`kvoy_sim_engine::tokenizer`), so that a prompt made of parts tokenizes part by part:
//! equal leading parts give equal leading tokens, and a turn's output appended to the next prompt
//! tokenizes back to the very ids the engine generated. The filters' 64-byte text blocks then
//! line up with the engine's 16-token KV blocks.

use kvoy_sim_engine::tokenizer::{generated_word, BYTES_PER_TOKEN};

/// One piece of a prompt.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Part {
    /// `tokens` tokens of deterministic text drawn from `seed`: equal seeds give equal text, and
    /// a shorter part with the same seed is a prefix of a longer one.
    Text { seed: u64, tokens: u32 },
    /// What request `request` generated (its first `tokens` tokens), as the server returned it.
    Output { request: u64, tokens: u32 },
}

impl Part {
    /// Tokens the part adds to a prompt.
    pub fn tokens(&self) -> u32 {
        match self {
            Part::Text { tokens, .. } | Part::Output { tokens, .. } => *tokens,
        }
    }

    /// Appends the part's text to `out`.
    pub fn render(&self, out: &mut String) {
        match *self {
            Part::Text { seed, tokens } => render_text(seed, tokens, out),
            Part::Output { request, tokens } => {
                out.reserve(tokens as usize * BYTES_PER_TOKEN);
                for i in 0..tokens {
                    out.push_str(generated_word(request, i));
                }
            }
        }
    }
}

/// Renders all `parts` after whatever `out` holds.
pub fn render_all(parts: &[Part], out: &mut String) {
    for p in parts {
        p.render(out);
    }
}

/// `tokens` words of three lowercase letters and a space, from a SplitMix64 stream of `seed`.
fn render_text(seed: u64, tokens: u32, out: &mut String) {
    let mut rng = kvoy_shared::Rng::new(seed ^ 0x5EED_7E47_0000_0001);
    out.reserve(tokens as usize * BYTES_PER_TOKEN);
    let mut buf = [b' '; 64 * BYTES_PER_TOKEN];
    let mut left = tokens as usize;
    while left > 0 {
        let n = left.min(64);
        for word in buf.chunks_exact_mut(BYTES_PER_TOKEN).take(n) {
            // Three letters from three 16-bit slices, scaled to 0..26 by a multiply.
            let x = rng.next_u64();
            let letter = |bits: u64| b'a' + (((bits & 0xFFFF) * 26) >> 16) as u8;
            word[0] = letter(x);
            word[1] = letter(x >> 16);
            word[2] = letter(x >> 32);
        }
        // ASCII letters and spaces: always UTF-8.
        out.push_str(std::str::from_utf8(&buf[..n * BYTES_PER_TOKEN]).unwrap_or_default());
        left -= n;
    }
}

/// A stable seed for a named piece of content (`kind`, then up to two indices).
pub fn seed_of(kind: &str, a: u64, b: u64) -> u64 {
    let mut buf = Vec::with_capacity(kind.len() + 16);
    buf.extend_from_slice(kind.as_bytes());
    buf.extend_from_slice(&a.to_le_bytes());
    buf.extend_from_slice(&b.to_le_bytes());
    xxhash_rust::xxh3::xxh3_64(&buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvoy_sim_engine::tokenizer::{generated_token, tokenize};

    #[test]
    fn parts_render_whole_tokens_and_prefixes() {
        let mut a = String::new();
        Part::Text {
            seed: 9,
            tokens: 10,
        }
        .render(&mut a);
        assert_eq!(a.len(), 40);
        let mut b = String::new();
        Part::Text { seed: 9, tokens: 4 }.render(&mut b);
        assert!(a.starts_with(&b));
        let mut c = String::new();
        Part::Text {
            seed: 10,
            tokens: 4,
        }
        .render(&mut c);
        assert_ne!(b, c);
    }

    #[test]
    fn outputs_tokenize_to_the_generated_ids() {
        let mut s = String::new();
        render_all(
            &[
                Part::Text { seed: 1, tokens: 3 },
                Part::Output {
                    request: 77,
                    tokens: 5,
                },
            ],
            &mut s,
        );
        let t = tokenize(&s);
        assert_eq!(t.len(), 8);
        for i in 0..5 {
            assert_eq!(t[3 + i], generated_token(77, i as u32));
        }
    }
}
