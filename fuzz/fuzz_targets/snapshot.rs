//! The pool snapshot decoder (`kvoy_shared::snapshot`), which every filter VM runs on the
//! aggregator's answers.
//!
//! Beyond "no panic":
//! - a delta that decodes is valid, and re-encodes in its format to exactly the input (the
//!   encoding is canonical), and decodes again to itself;
//! - the memory it takes while decoding stays proportional to the input, whatever counts the
//!   input claims;
//! - a full delta decodes into a [`Snapshot`] sorted by slot that round-trips through its own
//!   encoding; applying a delta never breaks the slot order or uniqueness.
#![no_main]

use kvoy_fuzz::peak_bytes_during;
use kvoy_shared::snapshot::{Snapshot, SnapshotDelta, SnapshotFormat};
use libfuzzer_sys::fuzz_target;

/// Bytes a decoded delta may take per input byte, plus a constant: the smallest endpoint
/// (19 bytes) decodes into one `EndpointStatus` (about 120 bytes) and vector growth may
/// double it.
const BYTES_PER_INPUT_BYTE: usize = 16;
const SLACK: usize = 4096;

fn sorted_unique(s: &Snapshot) -> bool {
    s.endpoints.windows(2).all(|w| w[0].slot < w[1].slot)
}

fuzz_target!(|data: &[u8]| {
    let (decoded, peak) = peak_bytes_during(|| SnapshotDelta::decode(data));
    assert!(
        peak <= BYTES_PER_INPUT_BYTE * data.len() + SLACK,
        "decoding {} bytes took {peak} bytes",
        data.len()
    );
    let Ok(delta) = decoded else { return };
    assert_eq!(delta.validate(), Ok(()));
    let format = match data[3] {
        1 => SnapshotFormat::V1,
        2 => SnapshotFormat::V2,
        _ => SnapshotFormat::V3,
    };
    let mut again = Vec::new();
    delta.encode_format(format, &mut again);
    assert_eq!(again, data, "re-encoding differs");
    assert_eq!(SnapshotDelta::decode(&again).as_ref(), Ok(&delta));

    // Apply it to an empty snapshot, and to the snapshot it names as its base.
    let mut base = Snapshot {
        epoch: delta.epoch,
        version: delta.base.unwrap_or(0),
        endpoints: Vec::new(),
    };
    let before = base.clone();
    match base.apply(delta.clone()) {
        Ok(()) => {
            assert!(sorted_unique(&base));
            assert_eq!(base.version, delta.version);
            assert!(base.endpoints.len() <= delta.upserts.len());
        }
        Err(_) => assert_eq!(base, before, "a refused delta changed the snapshot"),
    }
    if delta.is_full() {
        let snapshot = Snapshot::decode(data).expect("a full delta is a snapshot");
        assert!(sorted_unique(&snapshot));
        let mut bytes = Vec::new();
        snapshot.encode(&mut bytes);
        assert_eq!(Snapshot::decode(&bytes).as_ref(), Ok(&snapshot));
        // An incremental delta on top: re-upsert everything and remove nothing.
        let mut next = snapshot.clone();
        let incremental = SnapshotDelta {
            epoch: snapshot.epoch,
            base: Some(snapshot.version),
            version: snapshot.version,
            upserts: snapshot.endpoints.clone(),
            removed: Vec::new(),
        };
        assert_eq!(next.apply(incremental), Ok(()));
        assert_eq!(next, snapshot);
    }
});
