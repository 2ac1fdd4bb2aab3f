//! The KV-event payload decoder (`kvoy_kvevents::decode_batch`), which the aggregator runs on
//! every ZMQ message from every model server.
//!
//! Beyond "no panic":
//! - a batch that decodes re-encodes, in either wire form, to a payload that decodes to the
//!   same batch (NaN timestamps compared by encoding);
//! - the memory decoding takes stays proportional to the payload (declared lengths are checked
//!   against the bytes left), and so does the number of events.
#![no_main]

use kvoy_fuzz::peak_bytes_during;
use kvoy_kvevents::{decode_batch, encode_batch, EventBatch, KvEvent, WireForm};
use libfuzzer_sys::fuzz_target;

/// Bytes a decoded batch may take per payload byte, plus a constant: a one-byte event
/// (`AllBlocksCleared` in a fixarray, or an unknown tag) becomes a `KvEvent` of about 130
/// bytes, and vector growth may double that.
const BYTES_PER_INPUT_BYTE: usize = 256;
const SLACK: usize = 64 << 10;

fn same(a: &EventBatch, b: &EventBatch) -> bool {
    if a.ts.is_nan() || b.ts.is_nan() {
        a.ts.to_bits() == b.ts.to_bits()
            && a.events == b.events
            && a.data_parallel_rank == b.data_parallel_rank
    } else {
        a == b
    }
}

fuzz_target!(|data: &[u8]| {
    let (decoded, peak) = peak_bytes_during(|| decode_batch(data));
    assert!(
        peak <= BYTES_PER_INPUT_BYTE * data.len() + SLACK,
        "decoding {} bytes took {peak} bytes",
        data.len()
    );
    let Ok(batch) = decoded else { return };
    assert!(batch.events.len() <= data.len());
    for event in &batch.events {
        if let KvEvent::BlockStored {
            block_hashes,
            token_ids,
            ..
        } = event
        {
            assert!(block_hashes.len() + token_ids.len() <= data.len());
        }
    }
    for form in [WireForm::Map, WireForm::Array] {
        let payload = encode_batch(&batch, form);
        match decode_batch(&payload) {
            Ok(again) => assert!(same(&batch, &again), "{form:?}: {batch:?} became {again:?}"),
            Err(e) => panic!("{form:?}: re-encoded batch does not decode: {e}"),
        }
    }
});
