//! Routing decisions relayed between proxies through kvoy-aggregator, so that every proxy in
//! front of a pool learns where the others sent each prompt prefix.
//!
//! A proxy's lease holder sends the decisions its workers logged since its last call in the
//! body of `POST /v1/decisions?since=C`; the answer carries the decisions the *other* proxies
//! sent after cursor `C`, and the cursor to ask from next. Both directions use one binary
//! format ([`DecisionBatch`]); the decoder is total and validating (the bytes come from the
//! network). Endpoints travel as addresses, not ids: each side maps them onto its own pool, and
//! an address outside the receiver's pool is dropped, never routed to.
//!
//! The aggregator keeps the decisions in a [`DecisionRelay`]: a ring bounded by the keys it
//! holds, which forgets the oldest first. A proxy that falls behind the ring gets what is left.
//!
//! A proxy that also asks `removals_since=R` gets, in format 2, the confirmed removals numbered
//! `R` or later ([`Removals`]; `R` = 0 on its first exchange, answered with no records and the
//! number to ask from): keys whose server blocks an endpoint evicted, as the aggregator's
//! KV-event linker saw them. A proxy that does not ask gets format 1, as before. A proxy that
//! also says `tiers=1` ([`TIERS_PARAM`]) gets the confirmed offloads too, in format 3: keys
//! whose blocks left the endpoint's GPU for its CPU memory or storage, which still save
//! prefill there (a format 2 reader is sent removals only).
//!
//! ```
//! use kvoy_shared::prefix::BlockKey;
//! use kvoy_shared::relay::{DecisionBatch, DecisionRelay, RelayedDecision};
//! let d = RelayedDecision {
//!     endpoint: "10.0.0.1:8000".parse().unwrap(),
//!     keys: vec![BlockKey(7)],
//!     routed_at_ms: None,
//! };
//! let mut relay = DecisionRelay::new(1_000);
//! relay.push(1, vec![d.clone()]);
//! // Proxy 2 sees proxy 1's decision; proxy 1 does not get its own back.
//! let (for_two, next) = relay.since(0, 2, 100);
//! assert_eq!((for_two, next), (vec![d.clone()], 1));
//! assert!(relay.since(0, 1, 100).0.is_empty());
//! let mut bytes = Vec::new();
//! DecisionBatch { proxy: 2, cursor: next, decisions: vec![d], removals: None }.encode(&mut bytes);
//! assert_eq!(DecisionBatch::decode(&bytes).unwrap().cursor, 1);
//! ```

use std::collections::VecDeque;
use std::net::SocketAddr;

use thiserror::Error;

use crate::index::Tier;
use crate::prefix::{BlockKey, KeySchedule};
use crate::shared_data::{decode_address, encode_address, ADDRESS_BYTES};

/// The HTTP `Content-Type` of an encoded [`DecisionBatch`].
pub const CONTENT_TYPE: &str = "application/x-kvoy-decisions";
/// The aggregator's path for the exchange.
pub use crate::protocol::DECISIONS_PATH as PATH;

const MAGIC: &[u8; 4] = b"KVDR";
/// Decisions only.
const FORMAT_DECISIONS: u8 = 1;
/// Decisions, then removals.
const FORMAT_REMOVALS: u8 = 2;
/// Decisions, then removals and offloads: format 2 followed by each removal record's fate.
const FORMAT_TIERS: u8 = 3;
/// A record's fate in format 3: removed, or offloaded to a tier.
const FATE_REMOVED: u8 = 0;
/// Set in the format byte when every decision's routing time follows the decisions (a `u64`
/// of milliseconds each, in order).
const TIMES_FLAG: u8 = 0x10;

/// The exchange's query parameter with which a proxy asks for offloads (format 3) as well as
/// removals: `tiers=1`.
pub const TIERS_PARAM: &str = "tiers";
/// Address, key count.
const DECISION_HEADER_BYTES: usize = ADDRESS_BYTES + 2;

/// The exchange's query parameter that names the proxy's key schedule
/// (`block_size.max_keys.dense.group`, see [`schedule_param`]): the aggregator links decisions
/// to the servers' blocks only for proxies keying prompts as its linker expects.
pub const SCHEDULE_PARAM: &str = "schedule";
/// `wait_ms=N` on `POST /v1/decisions`: with no other proxy's decision to answer with, the
/// aggregator holds the answer up to N ms until one arrives (a long poll).
pub const WAIT_PARAM: &str = "wait_ms";

/// A key schedule as [`SCHEDULE_PARAM`]'s value.
pub fn schedule_param(s: &KeySchedule) -> String {
    format!("{}.{}.{}.{}", s.block_size, s.max_keys, s.dense, s.group)
}

/// [`schedule_param`]'s value read back; `None` for anything else.
pub fn parse_schedule(value: &str) -> Option<KeySchedule> {
    let mut parts = value.split('.').map(|p| p.parse::<usize>().ok());
    let schedule = KeySchedule {
        block_size: parts.next()??,
        max_keys: parts.next()??,
        dense: parts.next()??,
        group: parts.next()??,
    };
    parts.next().is_none().then_some(schedule)
}

/// Decisions one batch carries at most.
pub const MAX_DECISIONS: usize = 4_096;
/// Keys one decision carries at most (a prompt's keys are bounded by the filter's
/// `max_blocks`, 512 by default).
pub const MAX_KEYS_PER_DECISION: usize = 1_024;
/// The largest encoded batch: what a reader needs to accept, and all it should.
pub const MAX_BATCH_BYTES: usize = 4 << 20;

/// One routing decision: the endpoint a prompt went to, and the prompt's prefix keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayedDecision {
    pub endpoint: SocketAddr,
    pub keys: Vec<BlockKey>,
    /// When the proxy routed it, in milliseconds since the Unix epoch (its clock), when it
    /// says: the aggregator's linker tells apart prompts of one length by it. A proxy sends it;
    /// the aggregator's answers carry none.
    pub routed_at_ms: Option<u64>,
}

impl RelayedDecision {
    /// The decision as the aggregator hands it on: with no routing time (a reader older than
    /// the times cannot decode them, and they only serve the linker).
    fn without_time(&self) -> RelayedDecision {
        RelayedDecision {
            routed_at_ms: None,
            ..self.clone()
        }
    }
}

/// Keys an endpoint no longer holds on its GPU: the server evicted the blocks they were linked
/// to (`offloaded_to` none), so the prefixes through them are not cached there whole, or moved
/// them to a slower tier, where they still save prefill at a lower credit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayedRemoval {
    pub endpoint: SocketAddr,
    pub keys: Vec<BlockKey>,
    pub offloaded_to: Option<Tier>,
}

/// Removals from the asked removal cursor on, and the cursor to ask with next (format 2; with
/// an offload among them, format 3).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Removals {
    pub cursor: u64,
    pub removals: Vec<RelayedRemoval>,
}

/// What a proxy sends (its decisions; `cursor` unused) or the aggregator answers (the other
/// proxies' decisions after the asked cursor, and the cursor to ask from next).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DecisionBatch {
    /// The sending proxy's id (any value distinct per proxy); 0 in an answer.
    pub proxy: u64,
    pub cursor: u64,
    pub decisions: Vec<RelayedDecision>,
    /// Encoded in format 2 when present; format 1 has none.
    pub removals: Option<Removals>,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("not a decision batch (bad magic)")]
    Magic,
    #[error("decision batch format {0} is not known (this build reads formats 1 to 3)")]
    Format(u8),
    #[error("removal {index} has fate {fate}, expected 0 (removed), 1 (CPU) or 2 (storage)")]
    Fate { index: usize, fate: u8 },
    #[error("a format 3 batch with no offload (format 2 carries removals only)")]
    NoOffload,
    #[error("routing times announced for a batch with no decision")]
    NoTimes,
    #[error("the batch ends early at byte {0}")]
    Truncated(usize),
    #[error("{0} decisions in one batch, at most {MAX_DECISIONS}")]
    TooManyDecisions(u32),
    #[error("decision {index} has {keys} keys, at most {MAX_KEYS_PER_DECISION}")]
    TooManyKeys { index: usize, keys: u16 },
    #[error("decision {0} has address family {1}, expected 4 or 6")]
    Family(usize, u8),
    #[error("{0} bytes after the last decision")]
    Trailing(usize),
}

impl DecisionBatch {
    /// Appends the encoded batch to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(MAGIC);
        let tiers = self.removals.as_ref().is_some_and(|r| {
            r.removals
                .iter()
                .take(MAX_DECISIONS)
                .any(|d| d.offloaded_to.is_some())
        });
        // Routing times travel when every decision has one.
        let timed = !self.decisions.is_empty()
            && self
                .decisions
                .iter()
                .take(MAX_DECISIONS)
                .all(|d| d.routed_at_ms.is_some());
        let format = match (&self.removals, tiers) {
            (None, _) => FORMAT_DECISIONS,
            (Some(_), false) => FORMAT_REMOVALS,
            (Some(_), true) => FORMAT_TIERS,
        };
        out.push(if timed { format | TIMES_FLAG } else { format });
        out.extend_from_slice(&self.proxy.to_le_bytes());
        out.extend_from_slice(&self.cursor.to_le_bytes());
        encode_records(
            self.decisions.iter().map(|d| (d.endpoint, &d.keys[..])),
            out,
        );
        if timed {
            for d in self.decisions.iter().take(MAX_DECISIONS) {
                out.extend_from_slice(&d.routed_at_ms.unwrap_or(0).to_le_bytes());
            }
        }
        if let Some(r) = &self.removals {
            out.extend_from_slice(&r.cursor.to_le_bytes());
            encode_records(r.removals.iter().map(|d| (d.endpoint, &d.keys[..])), out);
            if tiers {
                out.extend(
                    r.removals
                        .iter()
                        .take(MAX_DECISIONS)
                        .map(|d| d.offloaded_to.map_or(FATE_REMOVED, |t| t as u8)),
                );
            }
        }
    }

    /// Decodes a whole batch; any malformed input is an error, never a panic.
    pub fn decode(b: &[u8]) -> Result<DecisionBatch, DecodeError> {
        let mut r = Reader { b, at: 0 };
        if r.take(4)? != MAGIC {
            return Err(DecodeError::Magic);
        }
        let raw = r.take(1)?[0];
        let (format, timed) = (raw & !TIMES_FLAG, raw & TIMES_FLAG != 0);
        if !matches!(format, FORMAT_DECISIONS | FORMAT_REMOVALS | FORMAT_TIERS) {
            return Err(DecodeError::Format(raw));
        }
        let proxy = r.u64()?;
        let cursor = r.u64()?;
        let mut decisions = r.records()?;
        if timed {
            if decisions.is_empty() {
                return Err(DecodeError::NoTimes);
            }
            for d in &mut decisions {
                d.routed_at_ms = Some(r.u64()?);
            }
        }
        let removals = if format == FORMAT_DECISIONS {
            None
        } else {
            let cursor = r.u64()?;
            let mut removals: Vec<RelayedRemoval> = r
                .records()?
                .into_iter()
                .map(|d| RelayedRemoval {
                    endpoint: d.endpoint,
                    keys: d.keys,
                    offloaded_to: None,
                })
                .collect();
            if format == FORMAT_TIERS {
                let fates = r.take(removals.len())?;
                for (index, (removal, &fate)) in removals.iter_mut().zip(fates).enumerate() {
                    removal.offloaded_to = match fate {
                        FATE_REMOVED => None,
                        1 => Some(Tier::Cpu),
                        2 => Some(Tier::Storage),
                        _ => return Err(DecodeError::Fate { index, fate }),
                    };
                }
                // One encoding per batch: removals only are format 2.
                if removals.iter().all(|r| r.offloaded_to.is_none()) {
                    return Err(DecodeError::NoOffload);
                }
            }
            Some(Removals { cursor, removals })
        };
        if r.at != b.len() {
            return Err(DecodeError::Trailing(b.len() - r.at));
        }
        Ok(DecisionBatch {
            proxy,
            cursor,
            decisions,
            removals,
        })
    }
}

/// A count, then each record's address, key count and keys (at most [`MAX_DECISIONS`] records
/// of [`MAX_KEYS_PER_DECISION`] keys; more are left out).
fn encode_records<'a>(
    records: impl ExactSizeIterator<Item = (SocketAddr, &'a [BlockKey])>,
    out: &mut Vec<u8>,
) {
    let count = records.len().min(MAX_DECISIONS);
    out.extend_from_slice(&(count as u32).to_le_bytes());
    for (endpoint, keys) in records.take(count) {
        encode_address(endpoint, out);
        let n = keys.len().min(MAX_KEYS_PER_DECISION);
        out.extend_from_slice(&(n as u16).to_le_bytes());
        for k in keys.iter().take(n) {
            out.extend_from_slice(&k.0.to_le_bytes());
        }
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self
            .at
            .checked_add(n)
            .ok_or(DecodeError::Truncated(self.at))?;
        let s = self
            .b
            .get(self.at..end)
            .ok_or(DecodeError::Truncated(self.at))?;
        self.at = end;
        Ok(s)
    }

    fn u16(&mut self) -> Result<u16, DecodeError> {
        let s = self.take(2)?;
        Ok(u16::from_le_bytes([s[0], s[1]]))
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        let s = self.take(4)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }

    fn u64(&mut self) -> Result<u64, DecodeError> {
        let s = self.take(8)?;
        let mut w = [0u8; 8];
        w.copy_from_slice(s);
        Ok(u64::from_le_bytes(w))
    }

    /// What [`encode_records`] wrote.
    fn records(&mut self) -> Result<Vec<RelayedDecision>, DecodeError> {
        let count = self.u32()?;
        if count as usize > MAX_DECISIONS {
            return Err(DecodeError::TooManyDecisions(count));
        }
        // Every record needs its header: a count the bytes cannot hold fails before any
        // allocation sized by it.
        if (count as usize).saturating_mul(DECISION_HEADER_BYTES)
            > self.b.len().saturating_sub(self.at)
        {
            return Err(DecodeError::Truncated(self.b.len()));
        }
        let mut records = Vec::with_capacity(count as usize);
        for index in 0..count as usize {
            let raw = self.take(ADDRESS_BYTES)?;
            let endpoint = decode_address(raw).ok_or(DecodeError::Family(index, raw[0]))?;
            let keys = self.u16()?;
            if usize::from(keys) > MAX_KEYS_PER_DECISION {
                return Err(DecodeError::TooManyKeys { index, keys });
            }
            let raw = self.take(usize::from(keys) * 8)?;
            let keys = raw
                .chunks_exact(8)
                .map(|c| BlockKey(u64::from_le_bytes(c.try_into().unwrap_or([0; 8]))))
                .collect();
            records.push(RelayedDecision {
                endpoint,
                keys,
                routed_at_ms: None,
            });
        }
        Ok(records)
    }
}

/// The aggregator's store of relayed decisions: numbered from 1 in arrival order, bounded by
/// the keys held (the oldest are forgotten first).
#[derive(Debug)]
pub struct DecisionRelay {
    entries: VecDeque<(u64, u64, RelayedDecision)>,
    /// The number the next decision gets.
    next: u64,
    keys: usize,
    max_keys: usize,
}

impl DecisionRelay {
    /// A relay holding at most `max_keys` keys (at least one decision's worth).
    pub fn new(max_keys: usize) -> Self {
        Self::numbered_from(max_keys, 1)
    }

    /// [`DecisionRelay::new`] whose first decision gets number `first` (at least 1). An
    /// aggregator starts each life at a number of its own (from its epoch), so that a proxy's
    /// cursor from an earlier life lies outside this one's numbers and is taken as "start at
    /// the newest", not as a place in this life's decisions.
    pub fn numbered_from(max_keys: usize, first: u64) -> Self {
        DecisionRelay {
            entries: VecDeque::new(),
            next: first.max(1),
            keys: 0,
            max_keys: max_keys.max(MAX_KEYS_PER_DECISION),
        }
    }

    /// A first number for a life with `epoch`: 2^32 apart per epoch value, so 2^32 decisions
    /// fit in a life before its numbers reach another's.
    pub fn first_number(epoch: u64) -> u64 {
        ((epoch % (1 << 31)) + 1) << 32
    }

    /// Stores `decisions` from `proxy`.
    pub fn push(&mut self, proxy: u64, decisions: Vec<RelayedDecision>) {
        for d in decisions {
            self.keys += d.keys.len();
            self.entries.push_back((self.next, proxy, d));
            self.next += 1;
        }
        while self.keys > self.max_keys {
            match self.entries.pop_front() {
                Some((_, _, d)) => self.keys -= d.keys.len(),
                None => break,
            }
        }
    }

    /// Up to `limit` decisions numbered after `cursor` that `proxy` did not send, and the
    /// cursor to ask from next (the last number looked at; `cursor` itself when there is
    /// nothing new). A poller with no cursor (0: it just started), one behind what the relay
    /// still holds, or one ahead of it (the aggregator restarted) gets the newest `limit`
    /// decisions held: what a restarted proxy needs first is what the pool did last.
    pub fn since(&self, cursor: u64, proxy: u64, limit: usize) -> (Vec<RelayedDecision>, u64) {
        let first = self.entries.front().map_or(self.next, |e| e.0);
        let skip = if cursor == 0 || cursor >= self.next || cursor + 1 < first {
            self.entries.len().saturating_sub(limit)
        } else {
            usize::try_from(cursor + 1 - first).unwrap_or(usize::MAX)
        };
        let cursor = if cursor >= self.next { 0 } else { cursor };
        let mut out = Vec::new();
        let mut last = cursor;
        for (seq, from, d) in self.entries.iter().skip(skip) {
            if out.len() >= limit {
                break;
            }
            last = *seq;
            if *from != proxy {
                out.push(d.without_time());
            }
        }
        (out, last)
    }

    /// Up to `limit` decisions numbered after `cursor`, every proxy's, oldest first, with at
    /// most `max_keys` keys between them (at least one decision, whatever its keys), and the
    /// number of the last one returned (`cursor` when there is nothing new): a reader that
    /// pages through what the relay holds (the pool view's explain panel rebuilds the proxies'
    /// prefix index from it). A cursor behind what the relay still holds starts at the oldest
    /// held; one ahead of it (the aggregator restarted) starts over from the oldest too.
    pub fn after(&self, cursor: u64, limit: usize, max_keys: usize) -> (Vec<RelayedDecision>, u64) {
        let first = self.entries.front().map_or(self.next, |e| e.0);
        let cursor = if cursor >= self.next { 0 } else { cursor };
        let skip =
            usize::try_from(cursor.saturating_add(1).saturating_sub(first)).unwrap_or(usize::MAX);
        let mut last = cursor;
        let mut keys = 0usize;
        let mut out = Vec::new();
        for (seq, _, d) in self.entries.iter().skip(skip) {
            keys = keys.saturating_add(d.keys.len());
            if out.len() >= limit || (keys > max_keys && !out.is_empty()) {
                break;
            }
            last = *seq;
            out.push(d.without_time());
        }
        (out, last)
    }

    /// Decisions held now.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Keys held now.
    pub fn keys(&self) -> usize {
        self.keys
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Magic, format, proxy, cursor, count.
    const HEADER_BYTES: usize = 4 + 1 + 8 + 8 + 4;

    /// `batch`'s bytes, checked to decode back to it and to fail cleanly cut anywhere.
    fn encoded(batch: &DecisionBatch) -> Vec<u8> {
        let mut bytes = Vec::new();
        batch.encode(&mut bytes);
        assert_eq!(DecisionBatch::decode(&bytes).as_ref(), Ok(batch));
        for cut in 0..bytes.len() {
            assert!(
                DecisionBatch::decode(&bytes[..cut]).is_err(),
                "cut at {cut}"
            );
        }
        bytes
    }

    fn decision(port: u16, keys: &[u64]) -> RelayedDecision {
        RelayedDecision {
            endpoint: SocketAddr::from(([10, 0, 0, 1], port)),
            keys: keys.iter().copied().map(BlockKey).collect(),
            routed_at_ms: None,
        }
    }

    #[test]
    fn routing_times_travel_when_every_decision_has_one_and_never_in_answers() {
        let timed = |port, keys: &[u64], at| RelayedDecision {
            routed_at_ms: Some(at),
            ..decision(port, keys)
        };
        let batch = DecisionBatch {
            proxy: 7,
            cursor: 0,
            decisions: vec![
                timed(8000, &[1, 2], 1_700_000_000_123),
                timed(8001, &[3], 5),
            ],
            removals: None,
        };
        let bytes = encoded(&batch);
        assert_eq!(bytes[4], 0x11);
        assert_eq!(
            bytes.len(),
            HEADER_BYTES + 2 * DECISION_HEADER_BYTES + 3 * 8 + 2 * 8
        );
        // One decision without a time: none travel (the format 1 bytes).
        let mut partial = batch.clone();
        partial.decisions[1].routed_at_ms = None;
        let mut plain = Vec::new();
        partial.encode(&mut plain);
        assert_eq!(plain[4], 1);
        assert!(DecisionBatch::decode(&plain)
            .unwrap()
            .decisions
            .iter()
            .all(|d| d.routed_at_ms.is_none()));
        // Announced for no decision: refused (one encoding per batch).
        let mut empty = Vec::new();
        DecisionBatch::default().encode(&mut empty);
        empty[4] |= 0x10;
        assert_eq!(DecisionBatch::decode(&empty), Err(DecodeError::NoTimes));
        // The aggregator stores them and hands the decisions on without.
        let mut relay = DecisionRelay::new(1_000);
        relay.push(1, batch.decisions.clone());
        let (out, _) = relay.since(0, 2, 10);
        assert_eq!(out, vec![decision(8000, &[1, 2]), decision(8001, &[3])]);
        assert!(relay
            .after(0, 10, 100)
            .0
            .iter()
            .all(|d| d.routed_at_ms.is_none()));
    }

    #[test]
    fn a_batch_round_trips_and_every_truncation_fails_cleanly() {
        let batch = DecisionBatch {
            proxy: 42,
            cursor: 9,
            decisions: vec![
                decision(8000, &[1, 2, 3]),
                RelayedDecision {
                    endpoint: "[2001:db8::1]:9000".parse().unwrap(),
                    keys: vec![],
                    routed_at_ms: None,
                },
            ],
            removals: None,
        };
        let bytes = encoded(&batch);
        assert_eq!(
            bytes.len(),
            HEADER_BYTES + 2 * DECISION_HEADER_BYTES + 3 * 8
        );
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(
            DecisionBatch::decode(&longer),
            Err(DecodeError::Trailing(1))
        );
    }

    #[test]
    fn removals_round_trip_in_format_2_and_every_truncation_fails_cleanly() {
        let batch = with_removals(vec![
            removal(8001, &[2, 3], None),
            removal(8000, &[9], None),
        ]);
        let bytes = encoded(&batch);
        assert_eq!(bytes[4], 2);
        assert_eq!(
            bytes.len(),
            HEADER_BYTES + 8 + 4 + 3 * DECISION_HEADER_BYTES + 4 * 8
        );
        // No removals asked for: format 1, and nothing after the decisions.
        let mut plain = Vec::new();
        DecisionBatch {
            removals: None,
            ..batch
        }
        .encode(&mut plain);
        assert_eq!(
            (plain[4], plain.len()),
            (1, HEADER_BYTES + DECISION_HEADER_BYTES + 8)
        );
    }

    /// A batch of one decision (port 8000, key 1) from proxy 0 at cursor 4, and `removals` at
    /// cursor 17.
    fn with_removals(removals: Vec<RelayedRemoval>) -> DecisionBatch {
        DecisionBatch {
            proxy: 0,
            cursor: 4,
            decisions: vec![decision(8000, &[1])],
            removals: Some(Removals {
                cursor: 17,
                removals,
            }),
        }
    }

    fn removal(port: u16, keys: &[u64], offloaded_to: Option<Tier>) -> RelayedRemoval {
        let d = decision(port, keys);
        RelayedRemoval {
            endpoint: d.endpoint,
            keys: d.keys,
            offloaded_to,
        }
    }

    #[test]
    fn offloads_round_trip_in_format_3_and_every_truncation_fails_cleanly() {
        let batch = with_removals(vec![
            removal(8001, &[2, 3], Some(Tier::Cpu)),
            removal(8000, &[9], None),
            removal(8002, &[4], Some(Tier::Storage)),
        ]);
        let bytes = encoded(&batch);
        assert_eq!(bytes[4], 3);
        // Format 2's bytes, then one fate byte per record.
        assert_eq!(
            bytes.len(),
            HEADER_BYTES + 8 + 4 + 4 * DECISION_HEADER_BYTES + 5 * 8 + 3
        );
        assert_eq!(&bytes[bytes.len() - 3..], &[1, 0, 2]);
        let mut bad = bytes.clone();
        let last = bad.len() - 1;
        bad[last] = 7;
        assert_eq!(
            DecisionBatch::decode(&bad),
            Err(DecodeError::Fate { index: 2, fate: 7 })
        );
        // Every fate "removed": that batch is format 2's, and only that encoding is read.
        let n = bad.len();
        bad[n - 3..].copy_from_slice(&[0, 0, 0]);
        assert_eq!(DecisionBatch::decode(&bad), Err(DecodeError::NoOffload));
    }

    #[test]
    fn a_key_schedule_round_trips_as_a_query_value() {
        let s = KeySchedule {
            block_size: 64,
            max_keys: 512,
            dense: 128,
            group: 64,
        };
        assert_eq!(schedule_param(&s), "64.512.128.64");
        assert_eq!(parse_schedule(&schedule_param(&s)), Some(s));
        for bad in [
            "",
            "64",
            "64.512.128",
            "64.512.128.64.1",
            "64.x.128.64",
            "-1.2.3.4",
        ] {
            assert_eq!(parse_schedule(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn bad_fields_are_named() {
        let mut bytes = Vec::new();
        DecisionBatch {
            proxy: 1,
            cursor: 0,
            decisions: vec![decision(80, &[5])],
            removals: None,
        }
        .encode(&mut bytes);
        let mut bad = bytes.clone();
        bad[0] = b'X';
        assert_eq!(DecisionBatch::decode(&bad), Err(DecodeError::Magic));
        let mut bad = bytes.clone();
        bad[4] = 4;
        assert_eq!(DecisionBatch::decode(&bad), Err(DecodeError::Format(4)));
        // Format 2 without its removal section.
        let mut bad = bytes.clone();
        bad[4] = 2;
        assert!(matches!(
            DecisionBatch::decode(&bad),
            Err(DecodeError::Truncated(_))
        ));
        let mut bad = bytes.clone();
        bad[HEADER_BYTES] = 5;
        assert_eq!(DecisionBatch::decode(&bad), Err(DecodeError::Family(0, 5)));
        // A count far beyond the bytes fails without allocating for it.
        let mut bad = bytes.clone();
        bad[21..25].copy_from_slice(&4000u32.to_le_bytes());
        assert!(matches!(
            DecisionBatch::decode(&bad),
            Err(DecodeError::Truncated(_))
        ));
        let mut bad = bytes.clone();
        bad[21..25].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(
            DecisionBatch::decode(&bad),
            Err(DecodeError::TooManyDecisions(u32::MAX))
        );
        // An IPv4-family address that is not IPv4-mapped.
        let mut bad = bytes.clone();
        bad[HEADER_BYTES + 1] = 0x20;
        assert_eq!(DecisionBatch::decode(&bad), Err(DecodeError::Family(0, 4)));
    }

    #[test]
    fn a_reader_pages_through_every_proxys_decisions_oldest_first() {
        let mut relay = DecisionRelay::new(MAX_KEYS_PER_DECISION + 2);
        let all = usize::MAX;
        assert_eq!(relay.after(0, 10, all), (vec![], 0));
        relay.push(1, vec![decision(1, &[1]), decision(2, &[2])]);
        relay.push(2, vec![decision(3, &[3])]);
        assert_eq!(
            relay.after(0, 2, all),
            (vec![decision(1, &[1]), decision(2, &[2])], 2)
        );
        assert_eq!(relay.after(2, 2, all), (vec![decision(3, &[3])], 3));
        assert_eq!(relay.after(3, 2, all), (vec![], 3), "up to date");
        // A key budget ends the page early, but never before one decision.
        assert_eq!(relay.after(0, 10, 1), (vec![decision(1, &[1])], 1));
        assert_eq!(relay.after(0, 10, 0), (vec![decision(1, &[1])], 1));
        // Ahead of the relay (it restarted): from the oldest again.
        assert_eq!(relay.after(99, 1, all).1, 1);
        // The oldest forgotten: a cursor behind them starts at the oldest held.
        relay.push(3, vec![decision(4, &vec![9; MAX_KEYS_PER_DECISION])]);
        let (page, next) = relay.after(0, 10, all);
        let ports: Vec<u16> = page.iter().map(|d| d.endpoint.port()).collect();
        assert_eq!((ports, next), (vec![2, 3, 4], 4));
    }

    #[test]
    fn the_relay_skips_the_askers_own_pages_by_limit_and_forgets_the_oldest() {
        let mut relay = DecisionRelay::new(MAX_KEYS_PER_DECISION + 2);
        relay.push(1, vec![decision(1, &[1]), decision(2, &[2])]);
        relay.push(2, vec![decision(3, &[3])]);
        relay.push(1, vec![decision(4, &[4])]);
        // A poller without a cursor gets the newest: the last two looked at, its own skipped.
        assert_eq!(relay.since(0, 2, 2), (vec![decision(4, &[4])], 4));
        assert_eq!(relay.since(0, 2, 10).0.len(), 3);
        // From a cursor: in order, `limit` decisions at a time (its own skipped on the way).
        let (page, next) = relay.since(1, 2, 1);
        assert_eq!((page, next), (vec![decision(2, &[2])], 2));
        let (page, next) = relay.since(next, 2, 1);
        assert_eq!((page, next), (vec![decision(4, &[4])], 4));
        assert_eq!(relay.since(next, 2, 2), (vec![], 4));
        // Proxy 1 gets proxy 2's one.
        assert_eq!(relay.since(0, 1, 10), (vec![decision(3, &[3])], 4));
        // A cursor from before a restart (ahead of the relay) gets the newest too.
        assert_eq!(relay.since(99, 1, 10).1, 4);
        // Past the key bound the oldest go; a cursor behind them gets the newest held.
        relay.push(3, vec![decision(5, &vec![9; MAX_KEYS_PER_DECISION])]);
        assert_eq!((relay.len(), relay.keys()), (3, MAX_KEYS_PER_DECISION + 2));
        let (page, next) = relay.since(1, 2, 10);
        let ports: Vec<u16> = page.iter().map(|d| d.endpoint.port()).collect();
        assert_eq!((ports, next), (vec![4, 5], 5));
        let (page, next) = relay.since(1, 2, 1);
        assert_eq!((page.len(), next), (1, 5));
    }
}
