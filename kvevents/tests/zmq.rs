//! The ZMQ transport on 127.0.0.1 with ephemeral ports: live stream, gap detection, replay.
//! Every loop is bounded by a count and a deadline.
#![cfg(feature = "zmq")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use kvoy_kvevents::{ReplayClient, SeqStatus, SeqTracker, Subscriber, WireForm, ZmqContext};

use common::{batch, publish_range, publisher, ts_of, WAIT};

const TOPIC: &str = "kv@127.0.0.1:8000@llama";

#[test]
fn subscriber_receives_batches_in_order() {
    let p = publisher(TOPIC, 100);
    let ctx = ZmqContext::new();
    let sub = Subscriber::connect(&ctx, p.endpoint(), b"kv@").unwrap();
    assert!(
        p.wait_for_subscriptions(1, WAIT),
        "subscription never arrived"
    );
    publish_range(&p, 0..50);
    let deadline = Instant::now() + WAIT;
    for want in 0..50u64 {
        assert!(Instant::now() < deadline);
        let msg = sub.recv(WAIT).unwrap().expect("timed out");
        assert_eq!(msg.topic, TOPIC.as_bytes());
        assert_eq!(msg.seq, want);
        assert_eq!(ts_of(&msg.payload), want);
    }
    assert_eq!(sub.recv(Duration::from_millis(50)).unwrap(), None);
}

#[test]
fn late_subscriber_detects_gap_and_replays() {
    let p = publisher(TOPIC, 1000);
    publish_range(&p, 0..20); // nobody listens: lost to PUB/SUB
    let ctx = ZmqContext::new();
    let sub = Subscriber::connect(&ctx, p.endpoint(), TOPIC.as_bytes()).unwrap();
    let mut replay = ReplayClient::connect(&ctx, p.replay_endpoint().unwrap()).unwrap();
    assert!(p.wait_for_subscriptions(1, WAIT));
    publish_range(&p, 20..30);

    let mut tracker = SeqTracker::from_start();
    let mut seen = Vec::new();
    let deadline = Instant::now() + WAIT;
    while seen.len() < 30 {
        assert!(Instant::now() < deadline, "saw only {seen:?}");
        let msg = sub.recv(WAIT).unwrap().expect("timed out");
        match tracker.observe(msg.seq) {
            SeqStatus::InOrder => {}
            SeqStatus::Gap { missing } => {
                assert_eq!(missing, 0..20);
                let got = replay.replay(missing.start, 10_000, WAIT).unwrap();
                assert!(got.complete);
                for (seq, payload) in got.batches.into_iter().filter(|(s, _)| missing.contains(s)) {
                    assert_eq!(ts_of(&payload), seq);
                    seen.push(seq);
                }
            }
            SeqStatus::Restart { .. } => panic!("no restart happened"),
        }
        assert_eq!(ts_of(&msg.payload), msg.seq);
        seen.push(msg.seq);
    }
    assert_eq!(seen, (0..30).collect::<Vec<_>>());
    assert_eq!(p.replays_served(), 1);
}

#[test]
fn replay_buffer_is_bounded() {
    let p = publisher(TOPIC, 5);
    publish_range(&p, 0..12);
    let ctx = ZmqContext::new();
    let mut replay = ReplayClient::connect(&ctx, p.replay_endpoint().unwrap()).unwrap();
    let got = replay.replay(0, 100, WAIT).unwrap();
    assert!(got.complete);
    let seqs: Vec<u64> = got.batches.iter().map(|(s, _)| *s).collect();
    assert_eq!(seqs, (7..12).collect::<Vec<_>>());
    // A second request on the same client, from the middle, stops at max_batches.
    let part = replay.replay(9, 2, WAIT).unwrap();
    assert!(!part.complete);
    assert_eq!(
        part.batches.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        vec![9, 10]
    );
    // The reopened socket does not see the rest of the interrupted reply.
    let again = replay.replay(11, 100, WAIT).unwrap();
    assert!(again.complete);
    assert_eq!(
        again.batches.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        vec![11]
    );
}

#[test]
fn topic_prefix_filters() {
    let p = publisher(TOPIC, 10);
    let ctx = ZmqContext::new();
    let other = Subscriber::connect(&ctx, p.endpoint(), b"kv@10.0.0.1").unwrap();
    let mine = Subscriber::connect(&ctx, p.endpoint(), b"kv@127.0.0.1").unwrap();
    assert!(p.wait_for_subscriptions(2, WAIT));
    publish_range(&p, 0..3);
    for want in 0..3 {
        assert_eq!(mine.recv(WAIT).unwrap().expect("timed out").seq, want);
    }
    assert_eq!(other.recv(Duration::from_millis(100)).unwrap(), None);
}

#[test]
fn replay_without_a_server_times_out() {
    let ctx = ZmqContext::new();
    // Nothing listens on port 1; connecting is asynchronous, so only the timeout tells.
    let mut replay = ReplayClient::connect(&ctx, "tcp://127.0.0.1:1").unwrap();
    let started = Instant::now();
    let got = replay.replay(0, 10, Duration::from_millis(200)).unwrap();
    assert!(!got.complete);
    assert!(got.batches.is_empty());
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn publisher_flushes_on_shutdown() {
    let p = publisher(TOPIC, 10);
    let ctx = ZmqContext::new();
    let sub = Subscriber::connect(&ctx, p.endpoint(), b"").unwrap();
    assert!(p.wait_for_subscriptions(1, WAIT));
    for i in 0..5 {
        p.publish_batch(&batch(i), WireForm::Array).unwrap();
    }
    p.shutdown();
    for want in 0..5 {
        let msg = sub.recv(WAIT).unwrap().expect("timed out");
        assert_eq!((msg.seq, ts_of(&msg.payload)), (want, want));
    }
}
