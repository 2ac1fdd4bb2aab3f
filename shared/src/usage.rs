//! The server's own prompt-token count, found in a response body as it streams by: what the
//! cost model learns each model's bytes per token from ([`crate::prefix_affinity::Router::observe_usage`]).
//!
//! OpenAI answers end with `"usage":{"prompt_tokens":N,...}` (the Responses API says
//! `"input_tokens"`); a streamed answer carries it in its last event when the client asked
//! for `stream_options.include_usage`. The scanner is fed the body chunk by chunk (a number or
//! the key may straddle two chunks) and gives the first count it finds. It reads raw bytes
//! without parsing the JSON: the key only matches with its quotes unescaped, so model output
//! (a JSON string, where quotes are `\"`) cannot forge it, and `"prompt_tokens_details"` does
//! not match either. Total: any bytes give a count or nothing, never a panic.
//!
//! ```
//! use kvoy_shared::request::Api;
//! use kvoy_shared::usage::UsageScanner;
//! let mut s = UsageScanner::new(Api::ChatCompletions);
//! assert_eq!(s.feed(br#"{"choices":[],"usage":{"prompt_to"#), None);
//! assert_eq!(s.feed(br#"kens": 1234,"completion_tokens":5}}"#), Some(1234));
//! ```

use crate::request::Api;

/// Bytes of one response a scanner reads at most: usage comes at the end of an answer, and
/// an answer longer than this is left unread rather than scanned at every chunk.
pub const MAX_SCANNED_BYTES: usize = 1 << 20;

/// Digits of a count at most (a larger number is not a prompt's token count).
const MAX_DIGITS: u32 = 12;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// `key[..n]` matched.
    Key(usize),
    /// The key matched; spaces, then `:`.
    Colon,
    /// After `:`; spaces, then the first digit.
    Value,
    /// Digits so far.
    Digits { value: u64, digits: u32 },
    /// Found or given up: nothing more is read.
    Done,
}

/// Finds the prompt-token count in a response body fed chunk by chunk.
#[derive(Clone, Debug)]
pub struct UsageScanner {
    key: &'static [u8],
    state: State,
    scanned: usize,
}

impl UsageScanner {
    /// A scanner for the answer of an `api` request.
    pub fn new(api: Api) -> Self {
        let key: &'static [u8] = match api {
            Api::Responses => br#""input_tokens""#,
            Api::ChatCompletions | Api::Completions => br#""prompt_tokens""#,
        };
        UsageScanner {
            key,
            state: State::Key(0),
            scanned: 0,
        }
    }

    /// Whether the scanner has found a count or stopped looking.
    pub fn done(&self) -> bool {
        self.state == State::Done
    }

    /// Reads the next chunk; the count once it is complete (then never again).
    pub fn feed(&mut self, chunk: &[u8]) -> Option<u64> {
        if self.state == State::Done {
            return None;
        }
        let room = MAX_SCANNED_BYTES.saturating_sub(self.scanned);
        let chunk = &chunk[..chunk.len().min(room)];
        self.scanned += chunk.len();
        for &b in chunk {
            if let Some(n) = self.step(b) {
                self.state = State::Done;
                return Some(n);
            }
        }
        if self.scanned >= MAX_SCANNED_BYTES {
            self.state = State::Done;
        }
        None
    }

    /// The end of the body: a count that ends the body is complete.
    pub fn finish(&mut self) -> Option<u64> {
        let found = match self.state {
            State::Digits { value, .. } => Some(value),
            _ => None,
        };
        self.state = State::Done;
        found
    }

    fn step(&mut self, b: u8) -> Option<u64> {
        self.state = match self.state {
            State::Key(n) if self.key.get(n) == Some(&b) => {
                if n + 1 == self.key.len() {
                    State::Colon
                } else {
                    State::Key(n + 1)
                }
            }
            // The key's only quotes are its first and last bytes: a quote restarts the match.
            State::Key(_) => State::Key(usize::from(b == b'"')),
            State::Colon if b.is_ascii_whitespace() => State::Colon,
            State::Colon if b == b':' => State::Value,
            State::Value if b.is_ascii_whitespace() => State::Value,
            State::Value if b.is_ascii_digit() => State::Digits {
                value: u64::from(b - b'0'),
                digits: 1,
            },
            State::Digits { value, digits } if b.is_ascii_digit() => {
                if digits >= MAX_DIGITS {
                    State::Key(0)
                } else {
                    State::Digits {
                        value: value * 10 + u64::from(b - b'0'),
                        digits: digits + 1,
                    }
                }
            }
            State::Digits { value, .. } => return Some(value),
            State::Colon | State::Value => State::Key(usize::from(b == b'"')),
            State::Done => State::Done,
        };
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(api: Api, body: &[u8]) -> Option<u64> {
        let mut s = UsageScanner::new(api);
        s.feed(body).or_else(|| s.finish())
    }

    #[test]
    fn finds_the_count_in_every_answer_shape() {
        let chat = br#"{"id":"x","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":17,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":16}}}"#;
        assert_eq!(scan(Api::ChatCompletions, chat), Some(17));
        let sse = b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":null}\n\n\
            data: {\"choices\":[],\"usage\":{\"prompt_tokens\" : \n 4096 ,\"total_tokens\":4100}}\n\n\
            data: [DONE]\n\n";
        assert_eq!(scan(Api::Completions, sse), Some(4096));
        let responses = br#"{"output":[],"usage":{"input_tokens":321,"output_tokens":9}}"#;
        assert_eq!(scan(Api::Responses, responses), Some(321));
        assert_eq!(scan(Api::ChatCompletions, responses), None);
        // A count that ends the body.
        assert_eq!(scan(Api::Completions, br#""prompt_tokens":88"#), Some(88));
    }

    #[test]
    fn every_split_of_a_body_gives_the_same_count() {
        let body = br#"{"x":"\"prompt_tokens\":5","usage":{"prompt_tokens_details":{},"prompt_tokens": 1234}}"#;
        for cut in 0..=body.len() {
            let mut s = UsageScanner::new(Api::ChatCompletions);
            let got = s
                .feed(&body[..cut])
                .or_else(|| s.feed(&body[cut..]))
                .or_else(|| s.finish());
            assert_eq!(got, Some(1234), "cut at {cut}");
        }
    }

    #[test]
    fn forged_or_malformed_keys_give_nothing() {
        for body in [
            &br#"{"content":"\"prompt_tokens\":99"}"#[..],
            br#""prompt_tokens_details":{"cached_tokens":3}"#,
            br#""prompt_tokens":"12""#,
            br#""prompt_tokens":-4"#,
            br#""prompt_tokens" x :5"#,
            br#""prompt_tokens":12345678901234567"#,
            b"",
            b"\xff\xfe\"prompt",
        ] {
            assert_eq!(
                scan(Api::ChatCompletions, body),
                None,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn gives_one_count_and_reads_a_bounded_body() {
        let mut s = UsageScanner::new(Api::Completions);
        assert_eq!(s.feed(br#""prompt_tokens":1,"#), Some(1));
        assert!(s.done());
        assert_eq!(s.feed(br#""prompt_tokens":2,"#), None);
        let mut long = UsageScanner::new(Api::Completions);
        let filler = vec![b'a'; MAX_SCANNED_BYTES];
        assert_eq!(long.feed(&filler), None);
        assert!(long.done());
        assert_eq!(long.feed(br#""prompt_tokens":3,"#), None);
    }

    proptest::proptest! {
        #[test]
        fn never_panics(chunks in proptest::collection::vec(
            proptest::collection::vec(proptest::num::u8::ANY, 0..64), 0..8)) {
            let mut s = UsageScanner::new(Api::ChatCompletions);
            for c in &chunks {
                let _ = s.feed(c);
            }
            let _ = s.finish();
        }
    }
}
