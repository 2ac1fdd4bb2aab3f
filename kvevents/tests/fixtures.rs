//! Decodes every fixture in `testdata/kvevents/` (made by `gen_fixtures.py` with msgspec, the
//! encoder vLLM uses) and asserts the exact values; where kvoy's encoder claims byte
//! compatibility, re-encoding must reproduce the file byte for byte.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use kvoy_kvevents::{decode_batch, encode_batch, BlockHash, EventBatch, KvEvent, Medium, WireForm};

const TS: f64 = 1_700_000_000.5;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/kvevents")
}

fn read(name: &str) -> Vec<u8> {
    std::fs::read(dir().join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn decode(name: &str) -> EventBatch {
    decode_batch(&read(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// The generator's 32-byte "sha256": bytes n, n+1, ... (mod 256).
fn sha(n: u8) -> BlockHash {
    let bytes: Vec<u8> = (0..32u8).map(|i| n.wrapping_add(i)).collect();
    BlockHash::from_be_slice(&bytes).unwrap()
}

fn ints(values: &[u64]) -> Vec<BlockHash> {
    values.iter().map(|v| BlockHash::from_u64(*v)).collect()
}

fn stored(hashes: Vec<BlockHash>, parent: Option<BlockHash>, tokens: Vec<u32>) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: hashes,
        parent_block_hash: parent,
        token_ids: tokens,
        block_size: 16,
        lora_id: None,
        medium: Medium::Gpu,
        lora_name: None,
        group_idx: None,
    }
}

fn removed(hashes: Vec<BlockHash>, medium: Medium, group_idx: Option<i64>) -> KvEvent {
    KvEvent::BlockRemoved {
        block_hashes: hashes,
        medium,
        group_idx,
    }
}

fn batch(events: Vec<KvEvent>, dp: Option<i64>) -> EventBatch {
    EventBatch {
        ts: TS,
        events,
        data_parallel_rank: dp,
    }
}

fn tokens_32() -> Vec<u32> {
    (1000..1032).collect()
}

fn tokens_16x3() -> Vec<u32> {
    (0..3).flat_map(|_| 1000..1016).collect()
}

fn assert_golden(name: &str, form: WireForm) {
    let bytes = read(name);
    let batch = decode_batch(&bytes).unwrap();
    assert_eq!(
        encode_batch(&batch, form),
        bytes,
        "{name}: re-encoding differs from msgspec's"
    );
}

/// `map_<name>.bin` and `array_<name>.bin` both decode to `want` and re-encode byte for byte.
fn assert_both_forms(name: &str, want: &EventBatch) {
    for (prefix, form) in [("map", WireForm::Map), ("array", WireForm::Array)] {
        let file = format!("{prefix}_{name}.bin");
        assert_eq!(decode(&file), *want, "{file}");
        assert_golden(&file, form);
    }
}

#[test]
fn vllm_current_byte_hashes() {
    let want = batch(
        vec![
            stored(vec![sha(1), sha(2)], None, tokens_32()),
            removed(vec![sha(1)], Medium::Gpu, None),
            KvEvent::AllBlocksCleared,
        ],
        Some(0),
    );
    assert_both_forms("vllm_current", &want);
}

#[test]
fn u64_hashes_beyond_i64_with_lora_and_groups() {
    let want = batch(
        vec![
            KvEvent::BlockStored {
                block_hashes: ints(&[u64::MAX, 1 << 63, 12345]),
                parent_block_hash: Some(BlockHash::from_u64(u64::MAX - 1)),
                token_ids: tokens_16x3(),
                block_size: 16,
                lora_id: Some(3),
                medium: Medium::Gpu,
                lora_name: Some("adapter-a".into()),
                group_idx: Some(1),
            },
            removed(ints(&[u64::MAX, 1 << 63]), Medium::Cpu, Some(0)),
        ],
        Some(2),
    );
    assert_both_forms("u64_hashes", &want);
}

#[test]
fn sglang_negative_i64_hashes() {
    let neg = |v: i64| BlockHash::from_i64(v);
    let want = batch(
        vec![
            stored(
                vec![neg(-1), neg(i64::MIN), neg(5)],
                Some(neg(-42)),
                tokens_16x3(),
            ),
            removed(vec![neg(-1)], Medium::Gpu, None),
        ],
        None,
    );
    let got = decode("array_sglang_i64.bin");
    assert_eq!(got, want);
    // The same 64-bit pattern is the same hash, whichever width it arrived in.
    let KvEvent::BlockStored { block_hashes, .. } = &got.events[0] else {
        panic!("not stored")
    };
    assert_eq!(block_hashes[..2], ints(&[u64::MAX, 1 << 63])[..]);
}

#[test]
fn unknown_event_types_are_kept_as_unknown() {
    let want = batch(
        vec![
            removed(ints(&[7]), Medium::Gpu, None),
            KvEvent::Unknown {
                type_name: "BlockPinned".into(),
            },
            KvEvent::AllBlocksCleared,
        ],
        Some(0),
    );
    for name in ["map_unknown_event_type.bin", "array_unknown_event_type.bin"] {
        let got = decode(name);
        assert_eq!(got, want, "{name}");
        assert_eq!(got.unknown_count(), 1);
    }
}

#[test]
fn unknown_extra_fields_are_skipped() {
    let want = batch(
        vec![KvEvent::BlockStored {
            block_hashes: vec![sha(9)],
            parent_block_hash: Some(sha(8)),
            token_ids: (1000..1016).collect(),
            block_size: 16,
            lora_id: None,
            medium: Medium::Storage,
            lora_name: None,
            group_idx: Some(0),
        }],
        Some(1),
    );
    assert_eq!(decode("map_extra_fields.bin"), want);
    assert_eq!(decode("array_extra_fields.bin"), want);
}

#[test]
fn oldest_release_without_trailing_fields() {
    let want = batch(
        vec![
            stored(ints(&[11, 12]), Some(BlockHash::from_u64(10)), tokens_32()),
            removed(ints(&[11]), Medium::Gpu, None),
            KvEvent::AllBlocksCleared,
        ],
        None,
    );
    assert_eq!(decode("array_oldest.bin"), want);
}

#[test]
fn map_batches_with_and_without_rank() {
    assert_eq!(
        decode("map_batch_no_dp_rank.bin"),
        batch(vec![KvEvent::AllBlocksCleared], None)
    );
    assert_eq!(
        decode("map_batch.bin"),
        batch(
            vec![
                removed(vec![sha(3)], Medium::Gpu, None),
                KvEvent::AllBlocksCleared
            ],
            Some(3)
        )
    );
}

#[test]
fn tag_after_fields_and_unknown_batch_key() {
    let want = batch(
        vec![
            stored(ints(&[21]), None, (1000..1016).collect()),
            removed(ints(&[21]), Medium::Gpu, None),
        ],
        None,
    );
    assert_eq!(decode("map_type_not_first.bin"), want);
}

#[test]
fn every_fixture_is_tested() {
    let mut names: Vec<String> = std::fs::read_dir(dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".bin"))
        .collect();
    names.sort();
    let tested = [
        "array_extra_fields.bin",
        "array_oldest.bin",
        "array_sglang_i64.bin",
        "array_u64_hashes.bin",
        "array_unknown_event_type.bin",
        "array_vllm_current.bin",
        "map_batch.bin",
        "map_batch_no_dp_rank.bin",
        "map_extra_fields.bin",
        "map_type_not_first.bin",
        "map_u64_hashes.bin",
        "map_unknown_event_type.bin",
        "map_vllm_current.bin",
    ];
    assert_eq!(names, tested);
}

#[test]
fn truncations_of_every_fixture_fail_cleanly() {
    for name in [
        "map_vllm_current.bin",
        "array_u64_hashes.bin",
        "map_extra_fields.bin",
    ] {
        let bytes = read(name);
        for cut in 0..bytes.len() {
            assert!(decode_batch(&bytes[..cut]).is_err(), "{name} cut at {cut}");
        }
    }
}
