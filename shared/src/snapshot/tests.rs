//! Tests of the snapshot codec and history.

use super::*;
use proptest::prelude::*;

fn status(slot: u16) -> EndpointStatus {
    EndpointStatus {
        slot,
        address: SocketAddr::new(
            IpAddr::V4(Ipv4Addr::new(10, 0, (slot >> 8) as u8, slot as u8)),
            8000,
        ),
        models: vec!["llama-3-8b".into()],
        ready: true,
        stale: false,
        waiting: 3,
        running: 20,
        kv_cache_usage: 0.42,
        block_size: 16,
        capacity_blocks: 30_000,
        cached_blocks: [12_000, 0, 0],
        cache_generation: 1,
        prefix_hit_rate: Some(0.6),
        prefill_tokens_per_s: Some(24_200.0),
        role: Role::Decode,
    }
}

fn incremental(base: u64, version: u64, upserts: Vec<EndpointStatus>) -> SnapshotDelta {
    SnapshotDelta {
        epoch: 9,
        base: Some(base),
        version,
        upserts,
        removed: Vec::new(),
    }
}

fn encoded(d: &SnapshotDelta) -> Vec<u8> {
    let mut out = Vec::new();
    d.encode(&mut out);
    out
}

fn round_trip(d: &SnapshotDelta) {
    let bytes = encoded(d);
    assert_eq!(SnapshotDelta::decode(&bytes).as_ref(), Ok(d));
}

fn pool(n: u16, epoch: u64, version: u64) -> Snapshot {
    Snapshot {
        epoch,
        version,
        endpoints: (0..n).map(status).collect(),
    }
}

#[test]
fn round_trips_ipv4_and_ipv6() {
    let mut v6 = status(7);
    v6.address = "[2001:db8::1:2]:65535".parse().unwrap();
    v6.ready = false;
    v6.stale = true;
    v6.prefix_hit_rate = None;
    v6.models = vec!["a".into(), "é/ü".into(), "x".repeat(MAX_MODEL_NAME_BYTES)];
    v6.waiting = u32::MAX;
    v6.cached_blocks = [u32::MAX, 1, 1 << 20];
    v6.kv_cache_usage = 1.0;
    let mut v4 = status(4095);
    v4.address = "255.255.255.255:0".parse().unwrap();
    v4.kv_cache_usage = 0.0;
    v4.models = (0..MAX_MODELS).map(|i| format!("m{i}")).collect();
    round_trip(&SnapshotDelta {
        epoch: u64::MAX,
        base: None,
        version: u64::MAX,
        upserts: vec![v6.clone(), v4.clone()],
        removed: vec![],
    });
    round_trip(&SnapshotDelta {
        epoch: 1,
        base: Some(0),
        version: 3,
        upserts: vec![v4, v6],
        removed: vec![0, 4094, 12],
    });
}

#[test]
fn round_trips_empty_pool() {
    let empty = Snapshot::default();
    let mut bytes = Vec::new();
    empty.encode(&mut bytes);
    assert_eq!(bytes, b"KVS\x03\x00\x00\x00\x00\x00");
    assert_eq!(Snapshot::decode(&bytes), Ok(empty));
    round_trip(&incremental(5, 5, vec![]));
}

#[test]
fn round_trips_the_largest_pool() {
    let mut snapshot = pool(MAX_ENDPOINTS as u16, 3, 1 << 40);
    snapshot.endpoints[100].address = "[::1]:8000".parse().unwrap();
    let mut bytes = Vec::new();
    snapshot.encode(&mut bytes);
    assert_eq!(bytes, encoded(&snapshot.full()));
    assert_eq!(Snapshot::decode(&bytes).as_ref(), Ok(&snapshot));
    let mut too_many = snapshot.full();
    too_many.upserts.push(status(0));
    assert_eq!(
        SnapshotDelta::decode(&encoded(&too_many)),
        Err(Invalid("too many endpoints"))
    );
}

#[test]
fn eight_endpoints_are_small() {
    let mut snapshot = pool(8, 1_767_225_600_000, 12_345);
    let mut full = Vec::new();
    snapshot.encode(&mut full);
    // 4 bytes per endpoint for the prefill rate (format 1: 335)
    assert_eq!(full.len(), 367);
    let mut v1 = Vec::new();
    snapshot.full().encode_format(SnapshotFormat::V1, &mut v1);
    assert_eq!(v1.len(), 335);
    snapshot.endpoints[3].waiting += 1;
    let delta =
        incremental(12_345, 12_346, vec![snapshot.endpoints[3].clone()]).with_epoch(snapshot.epoch);
    assert_eq!(encoded(&delta).len(), 61);
    let nothing = incremental(12_346, 12_346, vec![]).with_epoch(snapshot.epoch);
    assert_eq!(encoded(&nothing).len(), 17);
}

#[test]
fn decode_rejects_invalid_values() {
    let full = |upserts: Vec<EndpointStatus>, removed: Vec<u16>| SnapshotDelta {
        epoch: 1,
        base: None,
        version: 1,
        upserts,
        removed,
    };
    let with = |f: &dyn Fn(&mut EndpointStatus)| {
        let mut s = status(1);
        f(&mut s);
        full(vec![s], vec![])
    };
    let cases: Vec<(SnapshotDelta, &str)> = vec![
        (with(&|s| s.slot = 4096), "slot out of range"),
        (full(vec![], vec![4096]), "slot out of range"),
        (full(vec![status(1), status(1)], vec![]), "duplicate slot"),
        (
            full(vec![status(1)], vec![1]),
            "slot both upserted and removed",
        ),
        (full(vec![], vec![2, 3, 2]), "duplicate removed slot"),
        (
            with(&|s| s.kv_cache_usage = 1.5),
            "kv cache usage out of range",
        ),
        (
            with(&|s| s.kv_cache_usage = -0.1),
            "kv cache usage out of range",
        ),
        (
            with(&|s| s.kv_cache_usage = f32::NAN),
            "kv cache usage out of range",
        ),
        (
            with(&|s| s.kv_cache_usage = f32::INFINITY),
            "kv cache usage out of range",
        ),
        (
            with(&|s| s.prefix_hit_rate = Some(f32::NAN)),
            "prefix hit rate out of range",
        ),
        (
            with(&|s| s.prefix_hit_rate = Some(1.01)),
            "prefix hit rate out of range",
        ),
        (
            with(&|s| s.models = vec!["m".into(); MAX_MODELS + 1]),
            "too many models",
        ),
        (
            with(&|s| s.models = vec![String::new()]),
            "empty model name",
        ),
        (
            with(&|s| s.models = vec!["m".repeat(MAX_MODEL_NAME_BYTES + 1)]),
            "model name too long",
        ),
        (incremental(5, 4, vec![]), "version older than base"),
        (
            with(&|s| s.prefill_tokens_per_s = Some(f32::NAN)),
            "prefill rate out of range",
        ),
        (
            with(&|s| s.prefill_tokens_per_s = Some(0.0)),
            "prefill rate out of range",
        ),
        (
            with(&|s| s.prefill_tokens_per_s = Some(-5.0)),
            "prefill rate out of range",
        ),
        (
            with(&|s| s.prefill_tokens_per_s = Some(f32::INFINITY)),
            "prefill rate out of range",
        ),
    ];
    for (delta, reason) in cases {
        assert_eq!(delta.validate(), Err(Invalid(reason)), "{delta:?}");
        assert_eq!(
            SnapshotDelta::decode(&encoded(&delta)),
            Err(Invalid(reason)),
            "{delta:?}"
        );
    }
}

#[test]
fn decode_rejects_malformed_bytes() {
    // epoch 1, version 1, one endpoint: slot at 8, family at 9, flags at 16, waiting at 17
    let good = encoded(&SnapshotDelta {
        epoch: 1,
        base: None,
        version: 1,
        upserts: vec![status(1)],
        removed: vec![],
    });
    assert!(SnapshotDelta::decode(&good).is_ok());
    assert_eq!(good[9], FAMILY_V4);
    let patched = |at: std::ops::Range<usize>, with: &[u8]| {
        let mut b = good.clone();
        b.splice(at, with.iter().copied());
        SnapshotDelta::decode(&b)
    };
    assert_eq!(patched(0..1, b"X"), Err(SnapshotError::BadMagic));
    assert_eq!(
        patched(3..4, &[4]),
        Err(SnapshotError::UnsupportedFormat(4))
    );
    assert_eq!(
        patched(3..4, &[0]),
        Err(SnapshotError::UnsupportedFormat(0))
    );
    // format 1 has no prefill rate: its flag is unknown there
    assert_eq!(good[16] & FLAG_PREFILL_RATE, FLAG_PREFILL_RATE);
    assert_eq!(patched(3..4, &[1]), Err(Invalid("unknown endpoint flags")));
    assert_eq!(patched(4..5, &[2]), Err(Invalid("unknown kind")));
    assert_eq!(patched(9..10, &[5]), Err(Invalid("unknown address family")));
    assert_eq!(
        patched(16..17, &[0x81]),
        Err(Invalid("unknown endpoint flags"))
    );
    let big = encoded_varint(1 << 32);
    assert_eq!(patched(17..18, &big), Err(Invalid("integer out of range")));
    assert_eq!(
        patched(17..18, &[0x83, 0x00]),
        Err(Invalid("overlong varint"))
    );
    let mut overflow = vec![0xff; 9];
    overflow.push(0x02);
    assert_eq!(
        patched(5..6, &overflow),
        Err(Invalid("varint overflows u64"))
    );
    assert_eq!(
        patched(5..6, &[0xff; 11]),
        Err(Invalid("varint overflows u64"))
    );
    assert_eq!(
        patched(8..9, &[0x80, 0x20]),
        Err(Invalid("slot out of range"))
    );
    // the model name "llama-3-8b" is followed only by the removed count
    let name = good.len() - 11;
    assert_eq!(
        patched(name..name + 2, &[0xff, 0xfe]),
        Err(Invalid("model name is not utf-8"))
    );
    let mut trailing = good.clone();
    trailing.push(0);
    assert_eq!(
        SnapshotDelta::decode(&trailing),
        Err(SnapshotError::TrailingBytes)
    );
    // a count the rest cannot hold is truncation, not fewer items
    let two = encoded(&pool(2, 1, 1).full());
    let one = encoded(&pool(1, 1, 1).full());
    let mut short = two[..one.len() - 1].to_vec();
    short.push(0); // as if the removed count followed the first endpoint
    assert_eq!(SnapshotDelta::decode(&short), Err(SnapshotError::Truncated));
    assert_eq!(SnapshotDelta::decode(b""), Err(SnapshotError::Truncated));
    assert_eq!(SnapshotDelta::decode(b"KVS"), Err(SnapshotError::Truncated));
    let mut many = b"KVS\x02\x00\x01\x01".to_vec();
    many.extend(encoded_varint(MAX_ENDPOINTS as u64 + 1));
    assert_eq!(
        SnapshotDelta::decode(&many),
        Err(Invalid("too many endpoints"))
    );
    let mut huge = b"KVS\x02\x00\x01\x01".to_vec();
    huge.extend(encoded_varint(u64::MAX));
    assert_eq!(
        SnapshotDelta::decode(&huge),
        Err(Invalid("too many endpoints"))
    );
    let mut claims = b"KVS\x02\x00\x01\x01".to_vec();
    claims.extend(encoded_varint(MAX_ENDPOINTS as u64));
    assert_eq!(
        SnapshotDelta::decode(&claims),
        Err(SnapshotError::Truncated)
    );
    assert_eq!(
        Snapshot::decode(&encoded(&incremental(1, 2, vec![]))),
        Err(Invalid(
            "incremental delta where a full snapshot was expected"
        ))
    );
}

fn encoded_varint(v: u64) -> Vec<u8> {
    let mut out = Vec::new();
    put_varint(&mut out, v);
    out
}

#[test]
fn varints_round_trip_at_the_edges() {
    for v in [
        0,
        1,
        127,
        128,
        16_383,
        16_384,
        u32::MAX as u64,
        u64::MAX - 1,
        u64::MAX,
    ] {
        let bytes = encoded_varint(v);
        let mut r = Reader { bytes: &bytes };
        assert_eq!(r.varint(), Ok(v));
        assert!(r.bytes.is_empty());
    }
    assert_eq!(encoded_varint(u64::MAX).len(), 10);
}

/// Format 1 as the first aggregators wrote it, byte by byte: what a filter of this build still
/// reads, and what an aggregator of this build writes for a filter that names no format.
#[test]
fn format_1_is_read_and_written_as_before() {
    let e = status(1);
    let mut v1 = b"KVS\x01\x00\x01\x01\x01".to_vec(); // full, epoch 1, version 1, 1 endpoint
    v1.extend([1, 4, 10, 0, 0, 1, 0x1f, 0x40]); // slot 1, 10.0.0.1:8000
    v1.extend([1 | 4, 3, 20]); // ready, hit rate; waiting, running
    v1.extend(0.42f32.to_le_bytes());
    v1.extend([16, 0xb0, 0xea, 0x01, 0xe0, 0x5d, 0, 0, 1]); // 16, 30000, 12000, 0, 0, gen 1
    v1.extend(0.6f32.to_le_bytes());
    v1.extend([1, 10]);
    v1.extend(b"llama-3-8b");
    v1.push(0); // nothing removed
    let delta = SnapshotDelta {
        epoch: 1,
        base: None,
        version: 1,
        upserts: vec![e.clone()],
        removed: vec![],
    };
    let mut written = Vec::new();
    delta.encode_format(SnapshotFormat::V1, &mut written);
    assert_eq!(written, v1);
    let without_rate = EndpointStatus {
        prefill_tokens_per_s: None,
        ..e
    };
    let read = SnapshotDelta::decode(&v1).unwrap();
    assert_eq!(read.upserts, vec![without_rate.clone()]);
    // format 2: the same plus the flag and the rate after the hit rate
    let mut v2 = Vec::new();
    delta.encode_format(SnapshotFormat::V2, &mut v2);
    assert_eq!(v2.len(), v1.len() + 4);
    assert_eq!((v2[3], v2[16]), (2, 1 | 4 | 8));
    assert_eq!(SnapshotDelta::decode(&v2), Ok(delta.clone()));
    // without a rate, format 2 is format 1 but for the format byte
    let none = SnapshotDelta {
        upserts: vec![without_rate],
        ..delta
    };
    let mut v2_none = Vec::new();
    none.encode_format(SnapshotFormat::V2, &mut v2_none);
    assert_eq!(v2_none[3], 2);
    v2_none[3] = 1;
    assert_eq!(v2_none, v1);
    // format 3, a decode endpoint: format 2 but for the format byte
    let mut v3 = encoded(&none);
    assert_eq!(v3[3], 3);
    v3[3] = 1;
    assert_eq!(v3, v1);
}

#[test]
fn formats_are_negotiated() {
    use SnapshotFormat::{V1, V2, V3};
    for (asked, answered) in [
        (None, V1),
        (Some(0), V1),
        (Some(1), V1),
        (Some(2), V2),
        (Some(3), V3),
        (Some(4), V3),
        (Some(u64::MAX), V3),
    ] {
        assert_eq!(SnapshotFormat::negotiate(asked), answered, "{asked:?}");
    }
    assert_eq!(SnapshotFormat::LATEST, V3);
}

#[test]
fn roles_travel_in_format_3_and_older_filters_never_see_a_prefill_only_endpoint() {
    let addr = |p| SocketAddr::from(([10, 0, 0, 1], p));
    let with = |slot, role| EndpointStatus {
        role,
        ..EndpointStatus::ready(slot, addr(slot), &["m"])
    };
    let snapshot = Snapshot {
        epoch: 1,
        version: 2,
        endpoints: vec![
            with(0, Role::Decode),
            with(1, Role::Prefill),
            with(2, Role::Both),
        ],
    };
    let mut v3 = Vec::new();
    snapshot.encode(&mut v3);
    assert_eq!(Snapshot::decode(&v3).as_ref(), Ok(&snapshot));
    for old in [SnapshotFormat::V1, SnapshotFormat::V2] {
        let mut bytes = Vec::new();
        snapshot.full().encode_format(old, &mut bytes);
        let read = Snapshot::decode(&bytes).unwrap();
        let models: Vec<(Role, usize)> = read
            .endpoints
            .iter()
            .map(|e| (e.role, e.models.len()))
            .collect();
        assert_eq!(
            models,
            [(Role::Decode, 1), (Role::Decode, 0), (Role::Decode, 1)],
            "{old:?}: the prefill-only endpoint serves no model"
        );
    }
    // "answers nothing" without "prefills" names no role at all.
    let mut bad = Vec::new();
    Snapshot {
        endpoints: vec![with(0, Role::Prefill)],
        ..snapshot.clone()
    }
    .encode(&mut bad);
    let flags_at = bad.iter().rposition(|&b| b & 0x30 == 0x30).unwrap();
    bad[flags_at] &= !0x10;
    assert_eq!(
        Snapshot::decode(&bad),
        Err(SnapshotError::Invalid(
            "an endpoint that neither prefills nor decodes"
        ))
    );
}

#[test]
fn apply_full_replaces_and_sorts() {
    let mut snapshot = pool(3, 1, 10);
    let mut delta = pool(0, 2, 4).full();
    delta.upserts = vec![status(9), status(5)];
    snapshot.apply(delta).unwrap();
    assert_eq!(
        snapshot,
        Snapshot {
            epoch: 2,
            version: 4,
            endpoints: vec![status(5), status(9)],
        }
    );
    assert_eq!(snapshot.get(9), Some(&status(9)));
    assert_eq!(snapshot.get(0), None);
}

#[test]
fn apply_incremental_upserts_and_removes_in_slot_order() {
    let mut snapshot = Snapshot {
        epoch: 9,
        version: 10,
        endpoints: vec![status(1), status(3), status(5)],
    };
    let mut changed = status(3);
    changed.waiting = 100;
    let mut delta = incremental(10, 12, vec![status(4), changed.clone(), status(0)]);
    delta.removed = vec![5, 7];
    snapshot.apply(delta).unwrap();
    assert_eq!(snapshot.version, 12);
    assert_eq!(
        snapshot.endpoints,
        vec![status(0), status(1), changed, status(4)]
    );
    snapshot.apply(incremental(12, 12, vec![])).unwrap();
    assert_eq!(snapshot.version, 12);
}

#[test]
fn apply_refuses_mismatches_and_leaves_the_snapshot_alone() {
    let snapshot = pool(2, 9, 10);
    let refused = [
        (incremental(9, 11, vec![status(7)]), true),
        (incremental(11, 12, vec![status(7)]), true),
        (
            SnapshotDelta {
                epoch: 8,
                ..incremental(10, 11, vec![status(7)])
            },
            true,
        ),
        (incremental(10, 11, vec![status(7), status(7)]), false),
        (
            SnapshotDelta {
                upserts: vec![status(1), status(1)],
                ..pool(0, 9, 10).full()
            },
            false,
        ),
    ];
    for (delta, mismatch) in refused {
        let mut s = snapshot.clone();
        let err = s.apply(delta).unwrap_err();
        assert_eq!(matches!(err, SnapshotError::Mismatch { .. }), mismatch);
        assert_eq!(s, snapshot);
    }
    let mut s = snapshot.clone();
    assert_eq!(
        s.apply(incremental(9, 11, vec![])),
        Err(SnapshotError::Mismatch {
            epoch: 9,
            version: 10,
            delta_epoch: 9,
            delta_base: Some(9),
        })
    );
}

fn waiting(slot: u16, waiting: u32) -> EndpointStatus {
    EndpointStatus {
        waiting,
        ..status(slot)
    }
}

fn slots(d: &SnapshotDelta) -> Vec<u16> {
    d.upserts.iter().map(|e| e.slot).collect()
}

#[test]
fn history_versions_only_changes() {
    let mut h = SnapshotHistory::new(77);
    assert_eq!((h.epoch(), h.version()), (77, 0));
    assert!(!h.update(vec![]));
    assert_eq!(h.version(), 0);
    assert!(h.update(vec![status(2), status(0), status(1)]));
    assert_eq!(h.version(), 1);
    assert!(!h.update(vec![status(1), status(2), status(0)]));
    assert_eq!(h.version(), 1);
    let at1 = h.snapshot();
    assert_eq!(at1.endpoints, vec![status(0), status(1), status(2)]);

    assert!(h.update(vec![status(0), waiting(1, 9), status(2), status(3)]));
    assert_eq!(h.version(), 2);
    let d = h.delta_since(Some(77), Some(1));
    assert_eq!((d.base, d.version), (Some(1), 2));
    assert_eq!(slots(&d), vec![1, 3]);
    assert!(d.removed.is_empty());

    assert!(h.update(vec![waiting(1, 9), status(3)]));
    let d = h.delta_since(Some(77), Some(2));
    assert_eq!(slots(&d), Vec::<u16>::new());
    assert_eq!(d.removed, vec![0, 2]);
    let d = h.delta_since(Some(77), Some(1));
    assert_eq!(slots(&d), vec![1, 3]);
    assert_eq!(d.removed, vec![0, 2]);

    // a removed slot that comes back is an upsert, not a removal
    assert!(h.update(vec![waiting(1, 9), status(3), waiting(2, 5)]));
    let d = h.delta_since(Some(77), Some(1));
    assert_eq!(slots(&d), vec![1, 2, 3]);
    assert_eq!(d.removed, vec![0]);

    let now = h.delta_since(Some(77), Some(h.version()));
    assert_eq!(now, incremental(4, 4, vec![]).with_epoch(77));
    let mut s = at1;
    s.apply(h.delta_since(Some(77), Some(1))).unwrap();
    assert_eq!(s, h.snapshot());
}

impl SnapshotDelta {
    fn with_epoch(self, epoch: u64) -> Self {
        SnapshotDelta { epoch, ..self }
    }
}

#[test]
fn history_answers_full_when_it_cannot_do_better() {
    let mut h = SnapshotHistory::new(5);
    h.update(vec![status(0), status(1)]);
    h.update(vec![status(1)]);
    let full = h.snapshot().full();
    assert_eq!(full.version, 2);
    for (epoch, since) in [
        (None, None),
        (None, Some(1)),
        (Some(5), None),
        (Some(4), Some(1)),
        (Some(5), Some(3)),
    ] {
        assert_eq!(h.delta_since(epoch, since), full, "{epoch:?} {since:?}");
    }
    assert!(!h.delta_since(Some(5), Some(0)).is_full());
}

#[test]
fn history_forgets_the_oldest_tombstones() {
    let mut h = SnapshotHistory::with_tombstone_limit(1, 2);
    h.update((0..5).map(status).collect()); // v1
    for n in (0..4).rev() {
        h.update((0..n).map(status).collect()); // v2..=v5 remove {3, 4}, 2, 1, 0
    }
    assert_eq!(h.version(), 5);
    assert_eq!(h.tombstones.len(), 2);
    for since in 0..3 {
        assert!(h.delta_since(Some(1), Some(since)).is_full(), "{since}");
    }
    let d = h.delta_since(Some(1), Some(3));
    assert_eq!((d.base, d.removed.clone()), (Some(3), vec![0, 1]));
    // slot 2's tombstone (v3) was dropped, but a filter at v3 had already removed it
    let mut at3 = Snapshot {
        epoch: 1,
        version: 3,
        endpoints: (0..2).map(status).collect(),
    };
    at3.apply(d).unwrap();
    assert_eq!(at3, h.snapshot());
}

#[test]
fn history_normalizes_what_would_not_decode() {
    let mut h = SnapshotHistory::new(1);
    let mut wild = waiting(3, 1);
    wild.kv_cache_usage = f32::NAN;
    wild.prefix_hit_rate = Some(f32::INFINITY);
    wild.models = vec![
        String::new(),
        "ok".into(),
        "x".repeat(MAX_MODEL_NAME_BYTES + 1),
    ];
    wild.prefill_tokens_per_s = Some(f32::NAN);
    let mut clamped = status(4);
    clamped.kv_cache_usage = 1.5;
    clamped.prefix_hit_rate = Some(-2.0);
    clamped.prefill_tokens_per_s = Some(-1.0);
    h.update(vec![
        waiting(3, 0),
        wild,
        status(MAX_ENDPOINTS as u16),
        clamped,
    ]);
    let s = h.snapshot();
    assert_eq!(s.endpoints.len(), 2);
    let e = &s.endpoints[0];
    assert_eq!((e.waiting, e.kv_cache_usage), (1, 1.0));
    assert_eq!(
        (e.prefix_hit_rate, e.models.clone()),
        (None, vec!["ok".to_string()])
    );
    assert_eq!(e.prefill_tokens_per_s, None);
    let e = &s.endpoints[1];
    assert_eq!((e.kv_cache_usage, e.prefix_hit_rate), (1.0, Some(0.0)));
    assert_eq!(e.prefill_tokens_per_s, None);
    let mut bytes = Vec::new();
    s.encode(&mut bytes);
    assert_eq!(Snapshot::decode(&bytes), Ok(s));
}

fn arb_address() -> impl Strategy<Value = SocketAddr> {
    prop_oneof![
        (any::<[u8; 4]>(), any::<u16>()).prop_map(|(o, p)| SocketAddr::new(o.into(), p)),
        (any::<[u8; 16]>(), any::<u16>()).prop_map(|(o, p)| SocketAddr::new(o.into(), p)),
    ]
}

fn arb_unit() -> impl Strategy<Value = f32> {
    prop_oneof![Just(0.0f32), Just(1.0f32), 0.0f32..=1.0f32]
}

fn arb_u32() -> impl Strategy<Value = u32> {
    prop_oneof![0u32..200, any::<u32>()]
}

fn arb_status(slot: u16) -> impl Strategy<Value = EndpointStatus> {
    (
        arb_address(),
        prop::collection::vec("[a-zA-Z0-9/._é-]{1,24}", 0..4),
        any::<(bool, bool)>(),
        (arb_u32(), arb_u32(), arb_unit()),
        (
            arb_u32(),
            arb_u32(),
            [arb_u32(), arb_u32(), arb_u32()],
            arb_u32(),
        ),
        (
            prop::option::of(arb_unit()),
            prop::option::of(prop_oneof![
                Just(f32::MIN_POSITIVE),
                Just(f32::MAX),
                1.0f32..1e7
            ]),
        ),
        prop_oneof![Just(Role::Decode), Just(Role::Prefill), Just(Role::Both)],
    )
        .prop_map(
            move |(
                address,
                models,
                (ready, stale),
                (waiting, running, kv_cache_usage),
                (block_size, capacity_blocks, cached_blocks, cache_generation),
                (prefix_hit_rate, prefill_tokens_per_s),
                role,
            )| EndpointStatus {
                slot,
                address,
                models,
                ready,
                stale,
                waiting,
                running,
                kv_cache_usage,
                block_size,
                capacity_blocks,
                cached_blocks,
                cache_generation,
                prefix_hit_rate,
                prefill_tokens_per_s,
                role,
            },
        )
}

fn arb_delta() -> impl Strategy<Value = SnapshotDelta> {
    let max = MAX_ENDPOINTS as u16;
    (
        prop::collection::btree_set(0..max, 0..10),
        prop::collection::btree_set(0..max, 0..6),
        any::<u64>(),
        prop::option::of(any::<u64>()),
        0u64..1000,
    )
        .prop_flat_map(|(slots, removed, epoch, base, ahead)| {
            let removed: Vec<u16> = removed.difference(&slots).copied().collect();
            let upserts: Vec<_> = slots.into_iter().map(arb_status).collect();
            let version = base.map_or(ahead, |b| b.saturating_add(ahead));
            (upserts.prop_shuffle(), Just(removed)).prop_map(move |(upserts, removed)| {
                SnapshotDelta {
                    epoch,
                    base,
                    version,
                    upserts,
                    removed,
                }
            })
        })
}

#[derive(Clone, Debug)]
enum Step {
    Repeat,
    Set(Vec<EndpointStatus>),
}

/// Few slots and few values, so that slots come and go and statuses repeat.
fn small_status(slot: u16) -> impl Strategy<Value = EndpointStatus> {
    (0u32..3, any::<bool>(), 0usize..3).prop_map(move |(waiting, ready, models)| EndpointStatus {
        waiting,
        ready,
        models: ["a", "b"]
            .iter()
            .take(models)
            .map(|m| m.to_string())
            .collect(),
        ..status(slot)
    })
}

fn arb_step() -> impl Strategy<Value = Step> {
    prop_oneof![
        1 => Just(Step::Repeat),
        4 => prop::collection::btree_set(0u16..10, 0..8).prop_flat_map(|slots| {
            let statuses: Vec<_> = slots.into_iter().map(small_status).collect();
            statuses.prop_shuffle().prop_map(Step::Set)
        }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    #[test]
    fn random_bytes_never_panic(
        bytes in prop::collection::vec(any::<u8>(), 0..256),
        header in 0u8..4,
    ) {
        let mut input = match header {
            0 => Vec::new(),
            h => vec![b'K', b'V', b'S', h],
        };
        input.extend(bytes);
        let _ = SnapshotDelta::decode(&input);
        let _ = Snapshot::decode(&input);
    }

    #[test]
    fn deltas_round_trip(delta in arb_delta()) {
        let bytes = encoded(&delta);
        prop_assert_eq!(SnapshotDelta::decode(&bytes), Ok(delta.clone()));
        // format 1 carries everything but the prefill rates
        let mut v1 = Vec::new();
        delta.encode_format(SnapshotFormat::V1, &mut v1);
        let mut without = delta.clone();
        for e in &mut without.upserts {
            e.prefill_tokens_per_s = None;
            if !e.role.decodes() {
                e.models.clear();
            }
            e.role = Role::Decode;
        }
        prop_assert_eq!(SnapshotDelta::decode(&v1), Ok(without));
        if delta.is_full() && delta.removed.is_empty() {
            let mut snapshot = Snapshot::default();
            snapshot.apply(delta).unwrap();
            let mut again = Vec::new();
            snapshot.encode(&mut again);
            prop_assert_eq!(Snapshot::decode(&again), Ok(snapshot));
        }
    }

    #[test]
    fn truncations_and_corruptions_are_errors(
        delta in arb_delta(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        v1: bool,
    ) {
        let format = if v1 { SnapshotFormat::V1 } else { SnapshotFormat::LATEST };
        let mut bytes = Vec::new();
        delta.encode_format(format, &mut bytes);
        for cut in 0..bytes.len() {
            prop_assert!(SnapshotDelta::decode(&bytes[..cut]).is_err(), "cut at {}", cut);
            prop_assert!(Snapshot::decode(&bytes[..cut]).is_err());
        }
        let mut corrupt = bytes.clone();
        for (at, byte) in flips {
            corrupt[at.index(bytes.len())] = byte;
        }
        if let Ok(decoded) = SnapshotDelta::decode(&corrupt) {
            prop_assert_eq!(SnapshotDelta::decode(&encoded(&decoded)), Ok(decoded));
        }
    }

    #[test]
    fn history_deltas_bring_any_past_snapshot_up_to_date(
        steps in prop::collection::vec(arb_step(), 1..24),
        limit in prop_oneof![Just(MAX_TOMBSTONES), 1usize..4],
    ) {
        let mut h = SnapshotHistory::with_tombstone_limit(42, limit);
        let mut seen = vec![h.snapshot()];
        let mut last = Vec::new();
        for step in steps {
            let before = h.version();
            let (statuses, repeat) = match step {
                Step::Repeat => (last.clone(), true),
                Step::Set(s) => (s, false),
            };
            let changed = h.update(statuses.clone());
            prop_assert!(!(repeat && changed));
            prop_assert_eq!(h.version(), before + u64::from(changed));
            prop_assert!(h.tombstones.len() <= limit);
            last = statuses;
            if changed {
                seen.push(h.snapshot());
            }
        }
        let current = h.snapshot();
        for past in &seen {
            let delta = h.delta_since(Some(42), Some(past.version));
            prop_assert!(limit < MAX_TOMBSTONES || !delta.is_full());
            if !delta.is_full() {
                let upserted = slots(&delta);
                for e in &current.endpoints {
                    if past.get(e.slot) != Some(e) {
                        prop_assert!(upserted.contains(&e.slot));
                    }
                }
                for e in &past.endpoints {
                    if current.get(e.slot).is_none() {
                        prop_assert!(delta.removed.contains(&e.slot));
                    }
                }
                for slot in &delta.removed {
                    prop_assert!(current.get(*slot).is_none());
                }
            }
            let decoded = SnapshotDelta::decode(&encoded(&delta)).unwrap();
            prop_assert_eq!(&decoded, &delta);
            let mut replica = past.clone();
            replica.apply(decoded).unwrap();
            prop_assert_eq!(&replica, &current);
        }
    }
}
