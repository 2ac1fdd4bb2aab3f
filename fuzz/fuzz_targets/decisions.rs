//! The decision-batch decoder (`kvoy_shared::relay`), which the aggregator runs on every
//! proxy's `POST /v1/decisions` body and every filter's lease holder on the aggregator's answer.
//!
//! Beyond "no panic":
//! - a batch that decodes re-encodes to exactly the input (the encoding is canonical);
//! - the memory it takes while decoding stays proportional to the input, whatever counts the
//!   input claims.
#![no_main]

use kvoy_fuzz::peak_bytes_during;
use kvoy_shared::relay::DecisionBatch;
use libfuzzer_sys::fuzz_target;

/// The smallest decision (21 bytes, no keys) decodes into a `RelayedDecision` of about 56
/// bytes; vector growth may double it.
const BYTES_PER_INPUT_BYTE: usize = 8;
const SLACK: usize = 4096;

fuzz_target!(|data: &[u8]| {
    let (decoded, peak) = peak_bytes_during(|| DecisionBatch::decode(data));
    assert!(
        peak <= BYTES_PER_INPUT_BYTE * data.len() + SLACK,
        "{peak} bytes to decode {} input bytes",
        data.len()
    );
    if let Ok(batch) = decoded {
        let mut again = Vec::new();
        batch.encode(&mut again);
        assert_eq!(again, data, "a decoded batch re-encodes to its input");
    }
});
