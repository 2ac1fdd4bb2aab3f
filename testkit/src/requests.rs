//! OpenAI request bodies the tests send, written once so that tests comparing kvoy-local with
//! Envoy send the same bytes.

use serde_json::json;

/// The sentence [`prompt`] repeats.
pub const ASSISTANT_BRIEF: &str = "You are a meticulous assistant for the kvoy project; answer \
     precisely, cite the relevant configuration keys, and keep answers short. ";

/// About `bytes` of prose that starts with `tag`, so prompts with different tags differ from
/// their first block on: `[tag] ` then `sentence` numbered and repeated.
pub fn prose(tag: &str, sentence: &str, bytes: usize) -> String {
    let mut text = format!("[{tag}] ");
    let mut i = 0u64;
    while text.len() < bytes {
        text.push_str(&format!("{i}. {sentence}"));
        i += 1;
    }
    text
}

/// [`prose`] of [`ASSISTANT_BRIEF`].
pub fn prompt(tag: &str, bytes: usize) -> String {
    prose(tag, ASSISTANT_BRIEF, bytes)
}

/// A chat completion for `model`: a system message, then a user message.
pub fn chat_body(model: &str, system: &str, user: &str) -> Vec<u8> {
    json!({
        "model": model,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ],
    })
    .to_string()
    .into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prose_is_tagged_numbered_and_long_enough() {
        let p = prose("a", "Hi. ", 20);
        assert!(p.starts_with("[a] 0. Hi. 1. Hi. "), "{p}");
        assert!(p.len() >= 20);
        assert_ne!(prompt("a", 300)[..64], prompt("b", 300)[..64]);
    }
}
