//! The token count scanners over a response body (`kvoy_shared::usage`): the prompt's
//! (`UsageScanner`, the first count) and the output's (`OutputScanner`, the last).
//!
//! Beyond "no panic": the count found does not depend on how the body is cut into chunks,
//! nor on whether the body ends there (`finish`); a count has at most 12 digits and its digits
//! appear in the body.
#![no_main]

use kvoy_fuzz::{chunking, chunks};
use kvoy_shared::request::Api;
use kvoy_shared::usage::{OutputScanner, UsageScanner};
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

fn output(api: Api, chunks: &[&[u8]]) -> Option<u64> {
    let mut s = OutputScanner::new(api);
    for c in chunks {
        s.feed(c);
    }
    let found = s.finish();
    assert!(s.done() && s.finish().is_none(), "a second answer");
    found
}

fuzz_target!(|data: &[u8]| {
    let (cuts, body) = chunking(data);
    for api in [Api::ChatCompletions, Api::Responses] {
        let whole = scan(api, &[body]);
        assert_eq!(whole, scan(api, &chunks(body, &cuts)), "cut at {cuts:?}");
        let bytes: Vec<&[u8]> = body.chunks(1).collect();
        assert_eq!(whole, scan(api, &bytes), "byte by byte");
        let last = output(api, &[body]);
        assert_eq!(
            last,
            output(api, &chunks(body, &cuts)),
            "output, cut at {cuts:?}"
        );
        assert_eq!(last, output(api, &bytes), "output, byte by byte");
        for n in [whole, last].into_iter().flatten() {
            assert!(n < 1_000_000_000_000);
            let digits = n.to_string();
            assert!(body.windows(digits.len()).any(|w| w == digits.as_bytes()));
        }
    }
});
