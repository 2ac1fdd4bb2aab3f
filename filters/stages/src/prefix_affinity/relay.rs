//! Decisions relayed through the aggregator ([`kvoy_shared::relay`]), so that several proxies in
//! front of one pool share what each learned: the VM that holds the snapshot lease, on the tick
//! it polls, sends the decisions its proxy's workers logged since its last exchange
//! (`POST /v1/decisions`) and appends the other proxies' decisions from the answer to the
//! proxy's decision log, from which every worker replays them as it replays its neighbours'.
//! Nothing of this is on a request's path; a slow aggregator costs decisions (the exchange is
//! skipped while one is in flight, and the ring forgets what waits too long), never latency.
//!
//! The same exchange brings the confirmed removals (`removals_since`, format 2): keys whose
//! server blocks an endpoint evicted, as the aggregator's KV-event linker saw it. They go into
//! the decision log after the answer's decisions, and every worker's replay forgets them for
//! that endpoint ([`kvoy_shared::prefix_affinity::Router::apply_removal`]). With `tiers=1` (format 3) it also
//! brings the confirmed offloads, keys whose blocks left the endpoint's GPU for a slower tier,
//! which the replay moves down a tier there ([`kvoy_shared::prefix_affinity::Router::apply_demotion`]).

use log::{debug, warn};

use kvoy_filter_common::{call_aggregator, CallBody, HostStore};
use kvoy_shared::prefix_affinity::Router;
use kvoy_shared::relay::{self, DecisionBatch, RelayedDecision, Removals};
use kvoy_shared::shared_data::{DecisionLog, Logged, SharedStore};
use kvoy_shared::AggregatorSettings;

/// The origin of the records the relay appends: every worker replays them (their origins are
/// random seeds), and the relay's own reader skips them, so that nothing echoes back.
pub const RELAY_ORIGIN: u64 = u64::MAX;
/// Local decisions sent per exchange at most; the rest wait for the next one.
const FORWARD_PER_EXCHANGE: usize = 512;
/// Other proxies' decisions asked for per exchange at most (each costs two shared-data writes
/// on the tick of the VM that receives it).
const RELAYED_PER_EXCHANGE: usize = 512;
/// The answer's size at most: that many decisions at 64 keys each, with room to spare.
pub const MAX_ANSWER_BYTES: usize = 2 << 20;

/// What one exchange did, for the filter's counters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Exchanged {
    pub received: usize,
    /// Received for an address outside this proxy's pool: dropped.
    pub refused: usize,
    /// Removal records received for pool members (logged for every worker to apply).
    pub removals: usize,
}

/// One VM's side of the relay.
pub struct Relay {
    /// Reads every local worker's decisions (its origin is [`RELAY_ORIGIN`], so it skips the
    /// relayed ones) and appends the relayed ones.
    log: DecisionLog,
    proxy_key: String,
    /// The aggregator's cursor: the last relayed decision this VM has seen.
    cursor: u64,
    /// The aggregator's removal cursor (0 until the first answer: start at its newest).
    removal_cursor: u64,
    call: Option<(u32, u64)>,
    /// Set after the aggregator answered 404 (an aggregator older than the relay).
    unsupported: bool,
    scratch: Vec<u8>,
}

impl Relay {
    pub fn new(namespace: &str, slots: u32, seed: u64) -> Self {
        let mut log = DecisionLog::new(namespace, slots, RELAY_ORIGIN);
        log.start_at_head(&HostStore);
        let proxy_key = format!("{namespace}.relay.proxy");
        // The proxy's id, one for all its workers (the aggregator does not send a proxy its
        // own decisions back); whichever VM writes last, they all read the same one.
        if HostStore.get(&proxy_key).is_none() {
            let _ = HostStore.set(&proxy_key, &seed.to_le_bytes(), 0);
        }
        Relay {
            log,
            proxy_key,
            cursor: 0,
            removal_cursor: 0,
            call: None,
            unsupported: false,
            scratch: Vec::new(),
        }
    }

    fn proxy(&self) -> u64 {
        HostStore
            .get(&self.proxy_key)
            .and_then(|(b, _)| b.get(..8).and_then(|b| b.try_into().ok()))
            .map_or(0, u64::from_le_bytes)
    }

    /// Starts an exchange unless one is in flight (within twice the timeout); returns how many
    /// local decisions it sends when it started. Only the lease holder calls this, right after
    /// its snapshot poll started.
    pub fn exchange(
        &mut self,
        router: &Router,
        settings: &AggregatorSettings,
        authorization: Option<&str>,
        now_ms: u64,
    ) -> Option<usize> {
        if self.unsupported {
            return None;
        }
        if let Some((_, started)) = self.call {
            if now_ms.saturating_sub(started) <= settings.timeout_ms.saturating_mul(2) {
                return None;
            }
            self.call = None;
        }
        let pool = router.pool();
        let mut decisions = Vec::new();
        // The workers' decisions with their routing times (the aggregator's linker tells
        // prompts of one length apart by them); the relay's own records (relayed decisions,
        // removals) carry its origin and are skipped.
        self.log
            .poll_at_most_with(&HostStore, FORWARD_PER_EXCHANGE, |logged| {
                if let Logged::Routed(endpoint, keys, at_ms) = logged {
                    if let Some(e) = pool.get(endpoint) {
                        decisions.push(RelayedDecision {
                            endpoint: e.address,
                            keys: keys.to_vec(),
                            routed_at_ms: (at_ms > 0).then_some(at_ms),
                        });
                    }
                }
                true
            });
        let sent = decisions.len();
        self.scratch.clear();
        DecisionBatch {
            proxy: self.proxy(),
            cursor: 0,
            decisions,
            removals: None,
        }
        .encode(&mut self.scratch);
        let path = format!(
            "{}?since={}&limit={RELAYED_PER_EXCHANGE}&removals_since={}&{}=1&{}={}",
            relay::PATH,
            self.cursor,
            self.removal_cursor,
            relay::TIERS_PARAM,
            relay::SCHEDULE_PARAM,
            relay::schedule_param(&router.key_schedule())
        );
        match call_aggregator(
            settings,
            authorization,
            "POST",
            &path,
            Some((relay::CONTENT_TYPE, &self.scratch)),
        ) {
            Ok(token) => {
                self.call = Some((token, now_ms));
                Some(sent)
            }
            Err(status) => {
                debug!(
                    "decision relay: cannot call {:?}: {status:?}",
                    settings.cluster
                );
                None
            }
        }
    }

    pub fn owns(&self, token: u32) -> bool {
        self.call.is_some_and(|(t, _)| t == token)
    }

    /// The aggregator's answer: the other proxies' decisions go into the decision log (only
    /// for members of this proxy's pool). `Err` says why the answer was not used.
    pub fn on_response(
        &mut self,
        status: Option<u32>,
        body: &CallBody,
        router: &Router,
    ) -> Result<Exchanged, String> {
        self.call = None;
        let body = match (status, body) {
            (Some(200), CallBody::Read(b)) => b,
            (Some(404), _) => {
                self.unsupported = true;
                warn!("the aggregator has no {}: decisions are not relayed (an aggregator older than this filter?)", relay::PATH);
                return Err("not supported by the aggregator".into());
            }
            (Some(200), CallBody::TooLarge(n)) => return Err(format!("answer of {n} bytes")),
            (status, _) => return Err(format!("status {status:?}")),
        };
        let batch = DecisionBatch::decode(body).map_err(|e| e.to_string())?;
        let pool = router.pool();
        // An address outside this proxy's pool is never routed to, whoever names it.
        let accepted: Vec<_> = batch
            .decisions
            .iter()
            .filter_map(|d| pool.id_of(d.endpoint).map(|id| (id, &d.keys)))
            .collect();
        let removals = batch.removals.as_ref().map_or(&[][..], |r| &r.removals[..]);
        let removed: Vec<_> = removals
            .iter()
            .filter_map(|r| {
                pool.id_of(r.endpoint)
                    .map(|id| (id, r.offloaded_to, &r.keys))
            })
            .collect();
        let done = Exchanged {
            received: batch.decisions.len(),
            refused: batch.decisions.len() - accepted.len(),
            removals: removed.len(),
        };
        let records = accepted.len() + removed.len();
        if records > 0 {
            // The batch's slots are claimed in one write, then filled in order: the decisions,
            // then the removals and offloads.
            match self.log.claim(&HostStore, records as u64) {
                Ok(first) => {
                    let mut seq = first;
                    for (id, keys) in &accepted {
                        if let Err(e) = self.log.write(&HostStore, seq, *id, keys, 0) {
                            debug!("decision relay: cannot log a relayed decision: {e}");
                        }
                        seq += 1;
                    }
                    for &(id, offloaded_to, keys) in &removed {
                        let written = match offloaded_to {
                            None => self.log.write_removal(&HostStore, seq, id, keys),
                            Some(tier) => self.log.write_offload(&HostStore, seq, id, tier, keys),
                        };
                        if let Err(e) = written {
                            debug!("decision relay: cannot log a removal or offload: {e}");
                        }
                        seq += 1;
                    }
                }
                Err(e) => debug!("decision relay: cannot claim log slots: {e}"),
            }
        }
        self.cursor = batch.cursor;
        if let Some(Removals { cursor, .. }) = batch.removals {
            self.removal_cursor = cursor;
        }
        Ok(done)
    }
}
