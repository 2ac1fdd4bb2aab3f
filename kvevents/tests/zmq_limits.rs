//! The ZMQ transport's bounds on 127.0.0.1 with ephemeral ports: the frame size limit (a
//! larger frame drops the connection, which is counted, and the subscriber connects afresh) and
//! the replay's byte budget. A file of its own: a test binary runs alone, so these do not
//! compete with `zmq.rs`'s timing-sensitive replays. Every loop is bounded by a deadline.
#![cfg(feature = "zmq")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use kvoy_kvevents::{EventBatch, KvEvent, ReplayClient, Subscriber, WireForm, ZmqContext};

use common::{publish_range, publisher, ts_of, WAIT};

/// A batch whose msgpack payload is about `bytes` long (one event type name padded out).
fn big_batch(bytes: usize) -> EventBatch {
    EventBatch {
        ts: 1.0,
        events: vec![KvEvent::Unknown {
            type_name: "x".repeat(bytes),
        }],
        data_parallel_rank: None,
    }
}

#[test]
fn a_frame_over_the_limit_drops_the_connection_and_is_counted() {
    let p = publisher("", 100);
    let ctx = ZmqContext::new();
    let mut sub = Subscriber::connect_limited(&ctx, p.endpoint(), b"", Some(4096)).unwrap();
    assert!(p.wait_for_subscriptions(1, WAIT));
    p.publish_batch(&big_batch(64 * 1024), WireForm::Map)
        .unwrap();
    let deadline = Instant::now() + WAIT;
    let mut drops = 0;
    while drops == 0 {
        assert!(
            Instant::now() < deadline,
            "the oversized frame was not refused"
        );
        assert_eq!(
            sub.recv(Duration::from_millis(20)).unwrap(),
            None,
            "the oversized batch must not be delivered"
        );
        drops += sub.take_disconnects();
    }
    // ZMQ reconnects by itself; later batches within the limit arrive.
    assert!(p.wait_for_subscriptions(2, WAIT), "no resubscription");
    publish_range(&p, 0..1);
    let msg = sub
        .recv(WAIT)
        .unwrap()
        .expect("a small batch after the drop");
    assert_eq!(ts_of(&msg.payload), 0);
}

#[test]
fn replay_stops_at_its_byte_budget() {
    let p = publisher("", 100);
    publish_range(&p, 0..10);
    let ctx = ZmqContext::new();
    let mut replay = ReplayClient::connect(&ctx, p.replay_endpoint().unwrap()).unwrap();
    let one = replay.replay(0, 1, WAIT).unwrap().bytes;
    assert!(one > 0);
    let limits = kvoy_kvevents::ReplayLimits {
        max_batches: 100,
        max_bytes: one * 3,
        timeout: WAIT,
    };
    let got = replay.replay_bounded(0, limits).unwrap();
    assert!(!got.complete);
    assert_eq!(got.batches.len(), 3);
    assert_eq!(got.bytes, one * 3);
    // The socket was reopened: a full replay afterwards sees no leftovers.
    let all = replay.replay(5, 100, WAIT).unwrap();
    assert!(all.complete);
    assert_eq!(all.batches.first().map(|(s, _)| *s), Some(5));
}
