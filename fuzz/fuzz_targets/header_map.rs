//! The proxy-wasm serialized header map (`kvoy_shared::header_map`), which carries client
//! headers into the filter.
//!
//! Beyond "no panic": the map accepts exactly what `decode_pairs` (the test host's decoder)
//! decodes, with the same pairs; an accepted map re-serializes to the same bytes; a lookup finds
//! the first pair of that name.
#![no_main]

use kvoy_shared::header_map::{decode_pairs, encode_pairs, SerializedMap};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let decoded = decode_pairs(data);
    let Ok(map) = SerializedMap::new(data.to_vec()) else {
        assert!(decoded.is_err(), "refused by the map, decoded as pairs");
        return;
    };
    let pairs: Vec<(&[u8], &[u8])> = map.pairs().collect();
    assert_eq!(decoded.as_deref(), Ok(&pairs[..]));
    assert_eq!(pairs.len(), map.len());
    if !data.is_empty() {
        // Trailing bytes past the last entry are tolerated, as the host's own reader does.
        let again = encode_pairs(pairs.iter().copied());
        assert_eq!(&data[..again.len()], &again[..]);
    }
    for (name, _) in &pairs {
        if let Ok(name) = std::str::from_utf8(name) {
            let first = pairs
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case(name.as_bytes()))
                .map(|(_, v)| *v);
            assert_eq!(map.get(name), first);
        }
    }
});
