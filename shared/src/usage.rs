//! The server's own token counts, found in a response body as it streams by: what the cost
//! model learns each model's bytes per token ([`UsageScanner`], the prompt's count) and its
//! expected output length ([`OutputScanner`], the answer's) from
//! ([`crate::prefix_affinity::Router::observe_usage`]).
//!
//! OpenAI answers end with `"usage":{"prompt_tokens":N,"completion_tokens":M,...}` (the
//! Responses API says `"input_tokens"` and `"output_tokens"`); a streamed answer carries it in
//! its last event when the client asked for `stream_options.include_usage` (and in every event
//! with vLLM's `continuous_usage_stats`, the output count growing: hence the last count, not
//! the first, for the output). The scanners are fed the body chunk by chunk (a number or the
//! key may straddle two chunks). They read raw bytes without parsing the JSON: a key only
//! matches with its quotes unescaped, so model output (a JSON string, where quotes are `\"`)
//! cannot forge it, and `"prompt_tokens_details"` does not match either. Total: any bytes
//! give a count or nothing, never a panic.
//!
//! ```
//! use kvoy_shared::request::Api;
//! use kvoy_shared::usage::{OutputScanner, UsageScanner};
//! let mut s = UsageScanner::new(Api::ChatCompletions);
//! assert_eq!(s.feed(br#"{"choices":[],"usage":{"prompt_to"#), None);
//! assert_eq!(s.feed(br#"kens": 1234,"completion_tokens":5}}"#), Some(1234));
//! let mut o = OutputScanner::new(Api::ChatCompletions);
//! o.feed(br#"data: {"usage":{"completion_tokens":1}}"#);
//! o.feed(br#"data: {"usage":{"completion_tokens":57}}"#);
//! assert_eq!(o.finish(), Some(57));
//! ```

use crate::request::Api;

/// One answer in this many (of requests routed by their body) has its `usage` read: enough to
/// learn a model's bytes per token and output length within minutes, without scanning every
/// answer.
pub const SAMPLE_EVERY: u64 = 8;

/// Bytes of one response a scanner reads at most: usage comes at the end of an answer, and
/// an answer longer than this is left unread rather than scanned at every chunk.
pub const MAX_SCANNED_BYTES: usize = 1 << 20;

/// Digits of a count at most (a larger number is not a token count).
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

/// Matches `"key": <digits>` byte by byte.
#[derive(Clone, Debug)]
struct KeyCount {
    key: &'static [u8],
    state: State,
}

impl KeyCount {
    fn new(key: &'static [u8]) -> Self {
        KeyCount {
            key,
            state: State::Key(0),
        }
    }

    /// The count a byte completes (the byte after its last digit); the match then starts
    /// again, from that byte.
    fn step(&mut self, b: u8) -> Option<u64> {
        // A quote may open the key: every other byte out of place restarts the match at 0.
        let restart = State::Key(usize::from(b == b'"'));
        self.state = match self.state {
            State::Key(n) if self.key.get(n) == Some(&b) => {
                if n + 1 == self.key.len() {
                    State::Colon
                } else {
                    State::Key(n + 1)
                }
            }
            // The key's only quotes are its first and last bytes: a quote restarts the match.
            State::Key(_) => restart,
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
            State::Digits { value, .. } => {
                self.state = restart;
                return Some(value);
            }
            State::Colon | State::Value => restart,
            State::Done => State::Done,
        };
        None
    }

    /// The end of the body: a count that ends the body is complete.
    fn finish(&mut self) -> Option<u64> {
        let found = match self.state {
            State::Digits { value, .. } => Some(value),
            _ => None,
        };
        self.state = State::Done;
        found
    }
}

/// The part of `chunk` a scanner that has read `scanned` bytes may still read.
fn within_cap(chunk: &[u8], scanned: &mut usize) -> usize {
    let room = MAX_SCANNED_BYTES.saturating_sub(*scanned);
    let n = chunk.len().min(room);
    *scanned += n;
    n
}

/// Finds the prompt-token count in a response body fed chunk by chunk: the first one.
#[derive(Clone, Debug)]
pub struct UsageScanner {
    count: KeyCount,
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
            count: KeyCount::new(key),
            scanned: 0,
        }
    }

    /// Whether the scanner has found a count or stopped looking.
    pub fn done(&self) -> bool {
        self.count.state == State::Done
    }

    /// Reads the next chunk; the count once it is complete (then never again).
    pub fn feed(&mut self, chunk: &[u8]) -> Option<u64> {
        if self.done() {
            return None;
        }
        let n = within_cap(chunk, &mut self.scanned);
        for &b in &chunk[..n] {
            if let Some(n) = self.count.step(b) {
                self.count.state = State::Done;
                return Some(n);
            }
        }
        if self.scanned >= MAX_SCANNED_BYTES {
            self.count.state = State::Done;
        }
        None
    }

    /// The end of the body: a count that ends the body is complete.
    pub fn finish(&mut self) -> Option<u64> {
        self.count.finish()
    }
}

/// Finds the output-token count in a response body fed chunk by chunk: the last one, known
/// only at the end of the body. A body longer than [`MAX_SCANNED_BYTES`] gives none (its last
/// count may lie past the cap).
#[derive(Clone, Debug)]
pub struct OutputScanner {
    count: KeyCount,
    last: Option<u64>,
    scanned: usize,
}

impl OutputScanner {
    /// A scanner for the answer of an `api` request.
    pub fn new(api: Api) -> Self {
        let key: &'static [u8] = match api {
            Api::Responses => br#""output_tokens""#,
            Api::ChatCompletions | Api::Completions => br#""completion_tokens""#,
        };
        OutputScanner {
            count: KeyCount::new(key),
            last: None,
            scanned: 0,
        }
    }

    /// Whether the scanner stopped looking (past the cap, or finished).
    pub fn done(&self) -> bool {
        self.count.state == State::Done
    }

    /// Reads the next chunk.
    pub fn feed(&mut self, chunk: &[u8]) {
        if self.done() {
            return;
        }
        let n = within_cap(chunk, &mut self.scanned);
        for &b in &chunk[..n] {
            if let Some(n) = self.count.step(b) {
                self.last = Some(n);
            }
        }
        if self.scanned >= MAX_SCANNED_BYTES && n < chunk.len() {
            // more than the cap: the last count is unknown
            self.count.state = State::Done;
            self.last = None;
        }
    }

    /// The end of the body: the last count, then never again.
    pub fn finish(&mut self) -> Option<u64> {
        if self.done() {
            return None;
        }
        if let Some(n) = self.count.finish() {
            self.last = Some(n);
        }
        self.last.take()
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

    fn output(api: Api, chunks: &[&[u8]]) -> Option<u64> {
        let mut s = OutputScanner::new(api);
        for c in chunks {
            s.feed(c);
        }
        s.finish()
    }

    #[test]
    fn the_output_count_is_the_last_one() {
        let chat = br#"{"choices":[],"usage":{"prompt_tokens":17,"completion_tokens":2,"completion_tokens_details":{"reasoning_tokens":1}}}"#;
        assert_eq!(output(Api::ChatCompletions, &[chat]), Some(2));
        // continuous usage stats: every event, growing
        let sse: &[&[u8]] = &[
            b"data: {\"usage\":{\"completion_tokens\":1}}\n\n",
            b"data: {\"usage\":{\"completion_tok",
            b"ens\": 2}}\n\ndata: {\"usage\":{\"completion_tokens\":30",
            b"}}\n\ndata: [DONE]\n\n",
        ];
        assert_eq!(output(Api::ChatCompletions, sse), Some(30));
        let responses =
            br#"{"usage":{"input_tokens":321,"output_tokens":9,"output_tokens_details":{}}}"#;
        assert_eq!(output(Api::Responses, &[responses]), Some(9));
        assert_eq!(
            output(Api::Completions, &[br#""completion_tokens":88"#]),
            Some(88)
        );
        // forged (escaped), absent, or not a number
        for body in [
            &br#"{"content":"\"completion_tokens\":99"}"#[..],
            br#""completion_tokens":"12""#,
            b"",
        ] {
            assert_eq!(output(Api::ChatCompletions, &[body]), None);
        }
        // finished once
        let mut s = OutputScanner::new(Api::Completions);
        s.feed(br#""completion_tokens":4,"#);
        assert_eq!((s.finish(), s.finish()), (Some(4), None));
    }

    #[test]
    fn an_answer_past_the_cap_has_no_output_count() {
        let mut s = OutputScanner::new(Api::Completions);
        s.feed(br#""completion_tokens":3,"#);
        s.feed(&vec![b'a'; MAX_SCANNED_BYTES]);
        assert!(s.done());
        assert_eq!(s.finish(), None);
        // exactly at the cap is still read whole
        let mut s = OutputScanner::new(Api::Completions);
        let body = br#""completion_tokens":3}"#;
        s.feed(&vec![b' '; MAX_SCANNED_BYTES - body.len()]);
        s.feed(body);
        assert_eq!(s.finish(), Some(3));
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
            let mut o = OutputScanner::new(Api::Responses);
            for c in &chunks {
                o.feed(c);
            }
            let _ = o.finish();
        }
    }
}
