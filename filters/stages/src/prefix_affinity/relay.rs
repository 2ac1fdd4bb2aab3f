//! Decisions relayed through the aggregator ([`kvoy_shared::relay`]), so that several proxies in
//! front of one pool share what each learned: the VM that holds the snapshot lease sends, every
//! `relay_flush_ms`, the decisions its proxy's workers logged since its last send
//! (`POST /v1/decisions`), and keeps a long poll open for the other proxies' decisions, which it
//! appends to the proxy's decision log, from which every worker replays them as it replays its
//! neighbours'. A turn that follows its predecessor's reply at once (an agent loop) finds the
//! decision there on another proxy. Nothing of this is on a request's path; a slow aggregator
//! costs decisions (a send is skipped while one is in flight, and the ring forgets what waits
//! too long), never latency.
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
    /// Per aggregator replica (each numbers its decisions and removals itself): the last
    /// relayed decision this VM has seen from it, and its removal cursor (0 until the first
    /// answer: start at its newest).
    cursors: Vec<(u64, u64)>,
    /// The long poll in flight for the other proxies' decisions: its token, when it started,
    /// and the replica asked (the snapshot's primary).
    receive: Option<(u32, u64, usize)>,
    /// Per replica, the send of this proxy's decisions in flight, with when it started: every
    /// replica gets every decision, so that any of them can hand them to the other proxies.
    sends: Vec<Option<(u32, u64)>>,
    /// Set after the aggregator answered 404 (an aggregator older than the relay).
    unsupported: bool,
    /// A replica whose long poll got no answer or a 5xx: the snapshot should follow another
    /// (read once by [`Relay::take_failed`]).
    failed: Option<usize>,
    scratch: Vec<u8>,
}

/// Which of the relay's calls an answer is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Call {
    Receive(usize),
    Send(usize),
}

impl Relay {
    pub fn new(namespace: &str, slots: u32, seed: u64, replicas: usize) -> Self {
        let mut log = DecisionLog::new(namespace, slots, RELAY_ORIGIN);
        log.start_at_head(&HostStore);
        let proxy_key = format!("{namespace}.relay.proxy");
        // The proxy's id, one for all its workers (the aggregator does not send a proxy its
        // own decisions back); whichever VM writes last, they all read the same one.
        if HostStore.get(&proxy_key).is_none() {
            let _ = HostStore.set(&proxy_key, &seed.to_le_bytes(), 0);
        }
        let replicas = replicas.max(1);
        Relay {
            log,
            proxy_key,
            cursors: vec![(0, 0); replicas],
            receive: None,
            sends: vec![None; replicas],
            unsupported: false,
            failed: None,
            scratch: Vec::new(),
        }
    }

    /// The replica whose last long poll failed (no answer, or a 5xx), once.
    pub fn take_failed(&mut self) -> Option<usize> {
        self.failed.take()
    }

    fn proxy(&self) -> u64 {
        HostStore
            .get(&self.proxy_key)
            .and_then(|(b, _)| b.get(..8).and_then(|b| b.try_into().ok()))
            .map_or(0, u64::from_le_bytes)
    }

    /// One relay tick of the VM holding the snapshot lease (every `relay_flush_ms`): sends the
    /// decisions the proxy's workers logged since the last send to every replica (unless a
    /// send to it is in flight), and keeps one long poll (`relay_wait_ms`) open at `primary`,
    /// the replica the snapshot follows, for the other proxies' decisions. Sends and the long
    /// poll are separate calls so that neither waits for the other: a decision reaches the
    /// aggregator within a flush interval of being made, and the other proxies one round trip
    /// later. Returns how many local decisions it sent.
    pub fn tick(
        &mut self,
        router: &Router,
        settings: &AggregatorSettings,
        authorization: Option<&str>,
        primary: usize,
        now_ms: u64,
    ) -> Option<usize> {
        if self.unsupported {
            return None;
        }
        let receive_timeout = settings.timeout_ms.saturating_add(settings.relay_wait_ms);
        // A lost callback must not stop the relay forever.
        let live = |started: u64, timeout: u64| {
            now_ms.saturating_sub(started) <= timeout.saturating_mul(2)
        };
        let primary = primary.min(self.cursors.len() - 1);
        // A long poll at a replica the snapshot no longer follows (it failed) is given up.
        self.receive = self
            .receive
            .filter(|&(_, started, r)| r == primary && live(started, receive_timeout));
        for send in &mut self.sends {
            *send = send.filter(|&(_, started)| live(started, settings.timeout_ms));
        }
        if self.receive.is_none() {
            self.start_receive(router, settings, authorization, primary, now_ms);
        }
        self.start_sends(router, settings, authorization, now_ms)
    }

    fn start_receive(
        &mut self,
        router: &Router,
        settings: &AggregatorSettings,
        authorization: Option<&str>,
        replica: usize,
        now_ms: u64,
    ) {
        self.scratch.clear();
        DecisionBatch {
            proxy: self.proxy(),
            cursor: 0,
            decisions: Vec::new(),
            removals: None,
        }
        .encode(&mut self.scratch);
        let (cursor, removal_cursor) = self.cursors[replica];
        let path = format!(
            "{}?since={cursor}&limit={RELAYED_PER_EXCHANGE}&removals_since={removal_cursor}&{}=1&{}={}&{}={}",
            relay::PATH,
            relay::TIERS_PARAM,
            relay::SCHEDULE_PARAM,
            relay::schedule_param(&router.key_schedule()),
            relay::WAIT_PARAM,
            settings.relay_wait_ms,
        );
        let timeout = settings.timeout_ms.saturating_add(settings.relay_wait_ms);
        let cluster = settings.cluster_of(replica);
        if let Some(token) = self.call(settings, cluster, authorization, &path, timeout) {
            self.receive = Some((token, now_ms, replica));
        }
    }

    fn start_sends(
        &mut self,
        router: &Router,
        settings: &AggregatorSettings,
        authorization: Option<&str>,
        now_ms: u64,
    ) -> Option<usize> {
        if self.sends.iter().all(Option::is_some) {
            return None;
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
        if decisions.is_empty() {
            return None;
        }
        let sent = decisions.len();
        self.scratch.clear();
        DecisionBatch {
            proxy: self.proxy(),
            cursor: 0,
            decisions,
            removals: None,
        }
        .encode(&mut self.scratch);
        let mut started = false;
        for replica in 0..self.sends.len() {
            if self.sends[replica].is_some() {
                // That replica misses this batch; the others have it.
                continue;
            }
            // `limit=0`: the answer carries nothing; the long poll brings the other proxies'.
            let path = format!(
                "{}?since={}&limit=0&{}={}",
                relay::PATH,
                self.cursors[replica].0,
                relay::SCHEDULE_PARAM,
                relay::schedule_param(&router.key_schedule())
            );
            let cluster = settings.cluster_of(replica);
            if let Some(token) =
                self.call(settings, cluster, authorization, &path, settings.timeout_ms)
            {
                self.sends[replica] = Some((token, now_ms));
                started = true;
            }
        }
        started.then_some(sent)
    }

    fn call(
        &self,
        settings: &AggregatorSettings,
        cluster: &str,
        authorization: Option<&str>,
        path: &str,
        timeout_ms: u64,
    ) -> Option<u32> {
        match call_aggregator(
            settings,
            cluster,
            authorization,
            "POST",
            path,
            Some((relay::CONTENT_TYPE, &self.scratch)),
            timeout_ms,
        ) {
            Ok(token) => Some(token),
            Err(status) => {
                debug!("decision relay: cannot call {cluster:?}: {status:?}");
                None
            }
        }
    }

    pub fn owns(&self, token: u32) -> bool {
        self.which(token).is_some()
    }

    fn which(&self, token: u32) -> Option<Call> {
        if let Some((t, _, replica)) = self.receive {
            if t == token {
                return Some(Call::Receive(replica));
            }
        }
        self.sends
            .iter()
            .position(|s| s.is_some_and(|(t, _)| t == token))
            .map(Call::Send)
    }

    /// The aggregator's answer: the other proxies' decisions go into the decision log (only
    /// for members of this proxy's pool). `Err` says why the answer was not used.
    pub fn on_response(
        &mut self,
        token: u32,
        status: Option<u32>,
        body: &CallBody,
        router: &Router,
    ) -> Result<Exchanged, String> {
        let replica = match self.which(token) {
            Some(Call::Receive(replica)) => {
                self.receive = None;
                replica
            }
            Some(Call::Send(replica)) => {
                self.sends[replica] = None;
                return match status {
                    Some(200) => Ok(Exchanged::default()),
                    Some(404) => {
                        self.unsupported = true;
                        Err("not supported by the aggregator".into())
                    }
                    status => Err(format!("send: status {status:?}")),
                };
            }
            None => return Ok(Exchanged::default()),
        };
        let body = match (status, body) {
            (Some(200), CallBody::Read(b)) => b,
            (Some(404), _) => {
                self.unsupported = true;
                warn!("the aggregator has no {}: decisions are not relayed (an aggregator older than this filter?)", relay::PATH);
                return Err("not supported by the aggregator".into());
            }
            (Some(200), CallBody::TooLarge(n)) => return Err(format!("answer of {n} bytes")),
            (status, _) => {
                if status.is_none_or(|s| s >= 500) {
                    self.failed = Some(replica);
                }
                return Err(format!("status {status:?}"));
            }
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
        let cursors = &mut self.cursors[replica];
        cursors.0 = batch.cursor;
        if let Some(Removals { cursor, .. }) = batch.removals {
            cursors.1 = cursor;
        }
        Ok(done)
    }
}
