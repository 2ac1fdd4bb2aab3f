//! What the ZMQ transport tests share: a publisher on ephemeral ports, numbered batches and a
//! bounded wait for them to be sent.
#![allow(dead_code, clippy::unwrap_used)]

use std::time::{Duration, Instant};

use kvoy_kvevents::{decode_batch, EventBatch, KvEvent, Publisher, PublisherConfig, WireForm};

pub const WAIT: Duration = Duration::from_secs(10);

/// A publisher on 127.0.0.1 (live and replay sockets on ephemeral ports) under `topic`,
/// keeping `buffer_steps` batches for replay.
pub fn publisher(topic: &str, buffer_steps: usize) -> Publisher {
    Publisher::start(PublisherConfig {
        endpoint: "tcp://127.0.0.1:*".into(),
        replay_endpoint: Some("tcp://127.0.0.1:*".into()),
        topic: topic.into(),
        buffer_steps,
        ..PublisherConfig::default()
    })
    .unwrap()
}

/// Batch `i` carries `ts = i`, so a payload says which batch it is.
pub fn batch(i: u64) -> EventBatch {
    #[allow(clippy::cast_precision_loss)]
    let ts = i as f64;
    EventBatch {
        ts,
        events: vec![KvEvent::AllBlocksCleared],
        data_parallel_rank: Some(0),
    }
}

/// Which [`batch`] a payload is.
pub fn ts_of(payload: &[u8]) -> u64 {
    let ts = decode_batch(payload).unwrap().ts;
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let i = ts as u64;
    i
}

/// Publishes batches `range` (map form) and waits until the publisher has sent them.
pub fn publish_range(p: &Publisher, range: std::ops::Range<u64>) {
    for i in range.clone() {
        p.publish_batch(&batch(i), WireForm::Map).unwrap();
    }
    let deadline = Instant::now() + WAIT;
    while p.published() < range.end {
        assert!(
            Instant::now() < deadline,
            "publisher did not send {range:?}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}
