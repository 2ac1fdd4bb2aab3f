//! Property tests: encode -> decode is the identity in both forms, and no input panics the
//! decoder (random bytes, and valid payloads with bytes flipped or cut).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvoy_kvevents::{decode_batch, encode_batch, BlockHash, EventBatch, KvEvent, Medium, WireForm};
use proptest::prelude::*;

fn hash() -> impl Strategy<Value = BlockHash> {
    prop_oneof![
        any::<u64>().prop_map(BlockHash::from_u64),
        any::<i64>().prop_map(BlockHash::from_i64),
        any::<[u8; 32]>().prop_map(BlockHash::from_canonical),
        proptest::collection::vec(any::<u8>(), 0..=32)
            .prop_map(|b| BlockHash::from_be_slice(&b).unwrap()),
    ]
}

fn medium() -> impl Strategy<Value = Medium> {
    prop_oneof![
        Just(Medium::Gpu),
        Just(Medium::Cpu),
        Just(Medium::Storage),
        "[a-z]{1,40}"
            .prop_filter("not a known name", |s| !["gpu", "cpu", "storage"]
                .contains(&s.as_str()))
            .prop_map(Medium::Other),
    ]
}

fn event() -> impl Strategy<Value = KvEvent> {
    let stored = (
        proptest::collection::vec(hash(), 0..6),
        proptest::option::of(hash()),
        proptest::collection::vec(any::<u32>(), 0..40),
        any::<u32>(),
        proptest::option::of(any::<i64>()),
        medium(),
        proptest::option::of(".{0,300}"),
        proptest::option::of(any::<i64>()),
    )
        .prop_map(
            |(h, p, t, bs, lora_id, medium, lora_name, g)| KvEvent::BlockStored {
                block_hashes: h,
                parent_block_hash: p,
                token_ids: t,
                block_size: bs,
                lora_id,
                medium,
                lora_name,
                group_idx: g,
            },
        );
    let removed = (
        proptest::collection::vec(hash(), 0..20),
        medium(),
        proptest::option::of(any::<i64>()),
    )
        .prop_map(|(h, medium, g)| KvEvent::BlockRemoved {
            block_hashes: h,
            medium,
            group_idx: g,
        });
    let unknown = "[A-Za-z]{1,40}"
        .prop_filter("not a known type", |s| {
            !["BlockStored", "BlockRemoved", "AllBlocksCleared"].contains(&s.as_str())
        })
        .prop_map(|type_name| KvEvent::Unknown { type_name });
    prop_oneof![4 => stored, 3 => removed, 1 => Just(KvEvent::AllBlocksCleared), 1 => unknown]
}

fn batch() -> impl Strategy<Value = EventBatch> {
    (
        any::<f64>().prop_filter("NaN never equals itself", |t| !t.is_nan()),
        proptest::collection::vec(event(), 0..20),
        proptest::option::of(any::<i64>()),
    )
        .prop_map(|(ts, events, data_parallel_rank)| EventBatch {
            ts,
            events,
            data_parallel_rank,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn roundtrip_map_form(b in batch()) {
        prop_assert_eq!(decode_batch(&encode_batch(&b, WireForm::Map)), Ok(b));
    }

    #[test]
    fn roundtrip_array_form(b in batch()) {
        prop_assert_eq!(decode_batch(&encode_batch(&b, WireForm::Array)), Ok(b));
    }

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_batch(&bytes);
    }

    #[test]
    fn corrupted_payloads_never_panic(
        b in batch(),
        array in any::<bool>(),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
    ) {
        let form = if array { WireForm::Array } else { WireForm::Map };
        let mut bytes = encode_batch(&b, form);
        for (at, byte) in flips {
            let i = at.index(bytes.len());
            bytes[i] = byte;
        }
        let _ = decode_batch(&bytes);
        let _ = decode_batch(&bytes[..cut.index(bytes.len() + 1)]);
    }
}

#[test]
fn hostile_lengths_fail_fast() {
    // array32 of 4 billion events, map32 of 4 billion entries, bin32 of 4 GB.
    for bytes in [
        vec![0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff, 0xc0],
        vec![0xdf, 0xff, 0xff, 0xff, 0xff, 0xa2, b't', b's'],
        vec![
            0x92, 0x00, 0x91, 0x92, 0xa3, b'F', b'o', b'o', 0xc6, 0xff, 0xff, 0xff, 0xff,
        ],
    ] {
        assert!(decode_batch(&bytes).is_err(), "{bytes:x?}");
    }
    // Deep nesting inside an unknown event is skipped iteratively, without recursion.
    let mut deep = vec![0x92, 0x00, 0x91, 0x92, 0xa3, b'F', b'o', b'o'];
    deep.extend(std::iter::repeat_n(0x91, 200_000));
    deep.push(0xc0);
    let batch = decode_batch(&deep).unwrap();
    assert_eq!(batch.unknown_count(), 1);
}
