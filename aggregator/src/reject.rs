//! Rejected input, counted by reason and logged once per reason with what was wrong.
//!
//! Every place that refuses something from outside the process (a KV-event message or event, a
//! block over an endpoint's cap, an HTTP connection or request) calls [`Rejections::reject`]
//! with a [`Reason`] and a description. The first rejection of each reason is logged at `warn`
//! with that description; later ones only at `debug`, so that a misbehaving peer cannot flood
//! the log. Counts appear in `/metrics` with a `reason` label, the last description of each
//! reason in `/v1/endpoints`.
//!
//! ```
//! use kvoy_aggregator::reject::{Reason, Rejections};
//! let r = Rejections::new("kvoy-aggregator 10.0.0.1:8000");
//! r.reject(Reason::MalformedEvent, "BlockStored: 2 block hashes, block_size 16, 31 token ids");
//! assert_eq!(r.count(Reason::MalformedEvent), 1);
//! assert!(r.last(Reason::MalformedEvent).unwrap().contains("31 token ids"));
//! ```

use std::fmt::Display;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use log::{debug, warn};

/// Why an input was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    // KV events, per endpoint.
    /// A message without the three frames `[topic, seq, payload]`, or a bad sequence frame.
    MalformedMessage,
    /// A payload that is not a KV-event batch.
    UndecodableBatch,
    /// A `BlockStored` whose token ids do not give each block `block_size` tokens (its blocks
    /// are kept, keyed without tokens).
    MalformedEvent,
    /// An event of a type kvoy does not know (skipped).
    UnknownEvent,
    /// Blocks beyond the endpoint's block cap (not stored).
    BlockCap,
    /// The connection to the publisher dropped: a frame over `kv_events_max_message_bytes`,
    /// or the publisher went away.
    PublisherDisconnect,
    /// A replay stopped at its batch, byte or time budget.
    ReplayBudget,
    // HTTP, for the whole API.
    /// A request to a protected path without the configured bearer token.
    Unauthorized,
    /// A connection over `http.max_connections` (closed at once).
    ConnectionCap,
    /// A connection that did not send its request headers within the timeout, or sent
    /// headers hyper refused.
    BadRequest,
    /// `accept` failed (e.g. out of file descriptors); the loop backed off.
    AcceptError,
}

impl Reason {
    /// Every reason, in label order: the KV events' reasons, then the HTTP API's.
    pub const ALL: [Reason; 11] = [
        Reason::MalformedMessage,
        Reason::UndecodableBatch,
        Reason::MalformedEvent,
        Reason::UnknownEvent,
        Reason::BlockCap,
        Reason::PublisherDisconnect,
        Reason::ReplayBudget,
        Reason::Unauthorized,
        Reason::ConnectionCap,
        Reason::BadRequest,
        Reason::AcceptError,
    ];
    /// The reasons of one endpoint's KV events.
    pub const KV: &'static [Reason] = Self::ALL.split_at(Reason::Unauthorized as usize).0;
    /// The reasons of the HTTP API.
    pub const HTTP: &'static [Reason] = Self::ALL.split_at(Reason::Unauthorized as usize).1;

    /// The `reason` label.
    pub fn label(self) -> &'static str {
        match self {
            Reason::MalformedMessage => "malformed_message",
            Reason::UndecodableBatch => "undecodable_batch",
            Reason::MalformedEvent => "malformed_event",
            Reason::UnknownEvent => "unknown_event",
            Reason::BlockCap => "block_cap",
            Reason::PublisherDisconnect => "publisher_disconnect",
            Reason::ReplayBudget => "replay_budget",
            Reason::Unauthorized => "unauthorized",
            Reason::ConnectionCap => "connection_cap",
            Reason::BadRequest => "bad_request",
            Reason::AcceptError => "accept_error",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

const N: usize = Reason::ALL.len();

/// Counts and last descriptions per [`Reason`], for one scope (an endpoint, the API).
#[derive(Debug)]
pub struct Rejections {
    scope: String,
    counts: [AtomicU64; N],
    logged: [AtomicBool; N],
    last: Mutex<[Option<String>; N]>,
}

impl Rejections {
    /// `scope` prefixes the log lines.
    pub fn new(scope: impl Into<String>) -> Self {
        Rejections {
            scope: scope.into(),
            counts: std::array::from_fn(|_| AtomicU64::new(0)),
            logged: std::array::from_fn(|_| AtomicBool::new(false)),
            last: Mutex::new(std::array::from_fn(|_| None)),
        }
    }

    /// Counts one rejection.
    pub fn reject(&self, reason: Reason, what: impl Display) {
        self.reject_n(reason, 1, what);
    }

    /// Counts `n` rejections of one kind (e.g. blocks of one event), described once.
    pub fn reject_n(&self, reason: Reason, n: u64, what: impl Display) {
        if n == 0 {
            return;
        }
        let i = reason.index();
        self.counts[i].fetch_add(n, Ordering::Relaxed);
        let text = what.to_string();
        if !self.logged[i].swap(true, Ordering::Relaxed) {
            warn!(
                "{}: rejected ({}): {text}; counted in the `{}` reason from now on, not logged again",
                self.scope,
                reason.label(),
                reason.label()
            );
        } else {
            debug!("{}: rejected ({}): {text}", self.scope, reason.label());
        }
        if let Ok(mut last) = self.last.lock() {
            last[i] = Some(text);
        }
    }

    pub fn count(&self, reason: Reason) -> u64 {
        self.counts[reason.index()].load(Ordering::Relaxed)
    }

    /// The description of the latest rejection of `reason`.
    pub fn last(&self, reason: Reason) -> Option<String> {
        self.last
            .lock()
            .ok()
            .and_then(|l| l[reason.index()].clone())
    }

    /// `{label: {"count": n, "last": "..."}}` for the reasons in `reasons` that happened.
    pub fn json(&self, reasons: &[Reason]) -> serde_json::Value {
        let mut out = serde_json::Map::new();
        for &r in reasons {
            let n = self.count(r);
            if n > 0 {
                out.insert(
                    r.label().to_owned(),
                    serde_json::json!({"count": n, "last": self.last(r)}),
                );
            }
        }
        serde_json::Value::Object(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_distinct_and_indices_match() {
        for (i, r) in Reason::ALL.iter().enumerate() {
            assert_eq!(r.index(), i);
        }
        let mut labels: Vec<_> = Reason::ALL.iter().map(|r| r.label()).collect();
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), N);
        assert_eq!(Reason::KV.len() + Reason::HTTP.len(), N);
    }

    #[test]
    fn counts_and_remembers_the_last_reason() {
        let r = Rejections::new("t");
        r.reject_n(Reason::BlockCap, 0, "nothing");
        assert_eq!(r.count(Reason::BlockCap), 0);
        r.reject_n(Reason::BlockCap, 5, "first");
        r.reject(Reason::BlockCap, "second");
        assert_eq!(r.count(Reason::BlockCap), 6);
        assert_eq!(r.last(Reason::BlockCap).as_deref(), Some("second"));
        assert_eq!(
            r.json(Reason::KV),
            serde_json::json!({"block_cap": {"count": 6, "last": "second"}})
        );
    }
}
