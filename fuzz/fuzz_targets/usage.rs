//! The prompt-token count scanner over a response body (`kvoy_shared::usage`).
//!
//! Beyond "no panic": the count found does not depend on how the body is cut into chunks,
//! nor on whether the body ends there (`finish`); a count has at most 12 digits and its digits
//! appear in the body.
#![no_main]

use kvoy_fuzz::{chunking, chunks};
use kvoy_shared::request::Api;
use kvoy_shared::usage::UsageScanner;
use libfuzzer_sys::fuzz_target;

fn scan(api: Api, chunks: &[&[u8]]) -> Option<u64> {
    let mut s = UsageScanner::new(api);
    let mut found = None;
    for c in chunks {
        if let Some(n) = s.feed(c) {
            assert!(found.is_none(), "a second count");
            found = Some(n);
        }
    }
    if let Some(n) = s.finish() {
        assert!(found.is_none(), "a second count at the end");
        found = Some(n);
    }
    assert!(
        s.done() && s.feed(b"1234").is_none(),
        "read on after the end"
    );
    found
}

fuzz_target!(|data: &[u8]| {
    let (cuts, body) = chunking(data);
    for api in [Api::ChatCompletions, Api::Responses] {
        let whole = scan(api, &[body]);
        assert_eq!(whole, scan(api, &chunks(body, &cuts)), "cut at {cuts:?}");
        let bytes: Vec<&[u8]> = body.chunks(1).collect();
        assert_eq!(whole, scan(api, &bytes), "byte by byte");
        if let Some(n) = whole {
            assert!(n < 1_000_000_000_000);
            let digits = n.to_string();
            assert!(body.windows(digits.len()).any(|w| w == digits.as_bytes()));
        }
    }
});
