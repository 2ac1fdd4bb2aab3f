//! Sharing routing state between the worker threads of one proxy.
//!
//! Envoy gives each worker its own VM; the only process-wide state is *shared data*: a map of
//! small byte values with compare-and-swap and no delete, which every read copies into the VM.
//! Two structures sit on it, both bounded:
//!
//! - [`InflightTable`]: one value holding a `u32` per endpoint, changed by CAS. Every VM reads
//!   the same counts, so "in flight" means across the whole proxy.
//! - [`DecisionLog`]: a ring of `slots` values plus a head counter. A VM appends each decision
//!   (endpoint + prefix keys) and, before routing, replays the records other VMs appended since
//!   it last looked into its own prefix index. A request only ever reads the head and the few
//!   new records, never a big copy. A VM that falls more than `slots` records behind skips the
//!   overwritten ones: it loses some affinity, never correctness.
//!
//! The log's head lives in the [`OutstandingTable`]'s value (see [`state_key`]): a request
//! reads the outstanding work and the head in one operation, and the compare-and-swap that
//! counts it outstanding also claims its record's slot. Every shared-data operation takes
//! Envoy's process-wide lock, so two fewer per request is what this layout is for.
//!
//! The store is a trait so the logic is tested natively; the filter implements it over
//! `get_shared_data` / `set_shared_data`.

use thiserror::Error;

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use std::time::Duration;

use crate::endpoint::{EndpointId, Pool};
use crate::index::Tier;
use crate::outstanding::{Outstanding, OutstandingDelta};
use crate::prefix::BlockKey;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum StoreError {
    #[error("compare-and-swap mismatch")]
    CasMismatch,
    #[error("shared data unavailable: {0}")]
    Unavailable(String),
    #[error("the shared table is full")]
    Full,
}

/// Envoy's shared data: values with a version (`cas`); `set` with `cas` 0 is unconditional.
pub trait SharedStore {
    fn get(&self, key: &str) -> Option<(Vec<u8>, u32)>;
    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError>;
}

const CAS_RETRIES: usize = 32;

/// The version a read may prime the next compare-and-swap write with (see
/// [`OutstandingTable`]): only an existing value's, since a version of 0 would make that write
/// unconditional and could drop what other workers wrote since the read.
fn prime(cas: u32) -> Option<u32> {
    (cas != 0).then_some(cas)
}

/// The shared-data namespace of one filter configuration: `{prefix}.{xxh3(config):016x}`.
/// Keys differ per configuration, so a new one (new endpoint order) never reads the old state.
pub fn namespace(prefix: &str, config: &[u8]) -> String {
    format!("{prefix}.{:016x}", xxhash_rust::xxh3::xxh3_64(config))
}

/// The shared-data namespace of a pool's routing state: `{prefix}.p{hash:016x}`, from what the
/// state's meaning depends on and nothing else: the static endpoints in id order (a decision
/// record names its endpoint by id), the aggregator's cluster (a live pool's ids are the
/// aggregator's slots) and the decision log's ring size (a record's slot). A new configuration
/// that changes any other field (scorer, cost, block size, admission...) keeps the namespace, so
/// its VMs find the outstanding work and replay the decisions of the configuration before;
/// a changed pool (new endpoint, other order) starts apart, as it must.
pub fn pool_namespace(prefix: &str, config: &crate::prefix_affinity::PluginConfig) -> String {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    // v2: the decision log's head moved into the outstanding value ([`state_key`]).
    h.update(b"kvoy-pool-v2");
    for (id, endpoint) in config.pool.iter() {
        h.update(&(id.index() as u64).to_le_bytes());
        h.update(endpoint.address.to_string().as_bytes());
        h.update(b";");
    }
    if let Some(a) = &config.aggregator {
        h.update(b"aggregator:");
        h.update(a.cluster.as_bytes());
    }
    h.update(&config.decision_log_slots.to_le_bytes());
    format!("{prefix}.p{:016x}", h.digest())
}

/// Per-endpoint in-flight counts shared by all VMs of a proxy. A read primes the next add, as
/// for [`OutstandingTable`].
#[derive(Debug, Clone)]
pub struct InflightTable {
    key: String,
    endpoints: usize,
    /// The value and version the last read saw, if not yet used (only an existing value).
    primed: Option<(Vec<u8>, u32)>,
}

impl InflightTable {
    pub fn new(namespace: &str, endpoints: usize) -> Self {
        InflightTable {
            key: format!("{namespace}.inflight"),
            endpoints,
            primed: None,
        }
    }

    fn decode(&self, bytes: &[u8], out: &mut Vec<u32>) {
        out.clear();
        out.extend(
            bytes
                .chunks_exact(4)
                .take(self.endpoints)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        );
        out.resize(self.endpoints, 0);
    }

    /// Reads the counts into `out` (one per endpoint; zeros when nothing is stored yet).
    pub fn read(&mut self, store: &impl SharedStore, out: &mut Vec<u32>) {
        self.primed = None;
        match store.get(&self.key) {
            Some((bytes, cas)) => {
                self.decode(&bytes, out);
                self.primed = prime(cas).map(|cas| (bytes, cas));
            }
            None => {
                out.clear();
                out.resize(self.endpoints, 0);
            }
        }
    }

    /// Sizes reads to `endpoints` ids (the pool changed).
    pub fn set_endpoints(&mut self, endpoints: usize) {
        self.endpoints = endpoints;
    }

    /// Adds `delta` to `endpoint`'s count (saturating at 0 and `u32::MAX`). Counts of ids
    /// beyond this VM's pool are kept: another VM may already route to them.
    pub fn add(
        &mut self,
        store: &impl SharedStore,
        endpoint: EndpointId,
        delta: i32,
    ) -> Result<(), StoreError> {
        if endpoint.index() >= crate::MAX_ENDPOINTS {
            return Ok(());
        }
        let mut counts: Vec<u32> = Vec::with_capacity(self.endpoints);
        let mut bytes = Vec::with_capacity(self.endpoints * 4);
        let mut last = StoreError::CasMismatch;
        for _ in 0..CAS_RETRIES {
            counts.clear();
            let cas = match self.primed.take().or_else(|| store.get(&self.key)) {
                Some((b, cas)) => {
                    counts.extend(
                        b.chunks_exact(4)
                            .take(crate::MAX_ENDPOINTS)
                            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                    );
                    cas
                }
                None => 0,
            };
            if counts.len() <= endpoint.index() {
                counts.resize(endpoint.index() + 1, 0);
            }
            let c = &mut counts[endpoint.index()];
            *c = c.saturating_add_signed(delta);
            bytes.clear();
            for c in &counts {
                bytes.extend_from_slice(&c.to_le_bytes());
            }
            match store.set(&self.key, &bytes, cas) {
                Ok(()) => return Ok(()),
                Err(e) => last = e,
            }
        }
        Err(last)
    }
}

/// The shared-data key of a pool's routing state: the [`OutstandingTable`]'s entries, then the
/// [`DecisionLog`]'s head (8 bytes, little-endian). The head comes last so that a reader that
/// walks whole entries never mistakes it for one (it is shorter than an entry).
pub fn state_key(namespace: &str) -> String {
    // The entry layout's version: a module of another layout on the same VM id (an upgrade in
    // place) keeps a table of its own instead of misreading this one.
    format!("{namespace}.outstanding.2")
}

/// Bytes of the log head at the end of the routing state value.
const HEAD_BYTES: usize = 8;

/// The entries and the log head of a routing state value ([`state_key`]); a value without a
/// head (nothing was ever logged) has head 0.
fn split_state(bytes: &[u8]) -> (&[u8], u64) {
    let whole = bytes.len() - bytes.len() % OUTSTANDING_ENTRY_BYTES;
    let (entries, rest) = bytes.split_at(whole);
    let head = <[u8; HEAD_BYTES]>::try_from(rest).map_or(0, u64::from_le_bytes);
    (entries, head)
}

/// Per-endpoint [`Outstanding`] work shared by all VMs of a proxy, keyed by the endpoint's
/// address: one value of [`OUTSTANDING_ENTRY_BYTES`] per endpoint with work outstanding
/// (address, then the [`Outstanding`] fields in order, little-endian), then the decision log's
/// head ([`state_key`]), changed by CAS. It feeds the cost model, so every worker sees the
/// prefill work every other worker queued. Keyed by address, not by pool id: a pool change or an aggregator restart renumbers
/// endpoints, and a request that started before must still release what it charged, at the
/// endpoint it was sent to, whatever id that endpoint has now (or had on another worker).
/// Entries with nothing in flight are dropped once their measured rate is
/// [`crate::outstanding::IDLE_KEEP`] old, so the value holds live work and fresh rates.
///
/// A [`OutstandingTable::read`] primes the next [`OutstandingTable::add`]: its first attempt
/// writes against the value and version just read instead of reading them again, saving a
/// shared-data operation (under Envoy's process-wide lock) per request. A prime gone stale
/// costs one failed compare-and-swap and a fresh read, never a lost update: only a value that
/// existed primes (a version of 0 would make the write unconditional).
#[derive(Debug, Clone)]
pub struct OutstandingTable {
    key: String,
    scratch: Vec<(SocketAddr, Outstanding)>,
    /// The decision log's head in the value `scratch` was decoded from.
    head: u64,
    bytes: Vec<u8>,
    /// The version `scratch` was decoded from by the last read, if it has not been used.
    primed: Option<u32>,
}

/// Bytes of one entry: family (1), address (16), port (2), five counts (20), the clock (8),
/// three rates (12), the measurement's time (8), the hold time (4).
pub const OUTSTANDING_ENTRY_BYTES: usize = 71;
/// Entries the table holds at most (twice the largest pool: a pool change may leave the old
/// endpoints' work outstanding for a while).
const OUTSTANDING_MAX_ENTRIES: usize = 2 * crate::MAX_ENDPOINTS;

/// Bytes of an address on the wire: family (4 or 6), the address (16, IPv4 as IPv4-mapped),
/// the port (2, little-endian). The outstanding table and the decision relay both use it.
pub(crate) const ADDRESS_BYTES: usize = 19;

pub(crate) fn encode_address(address: SocketAddr, out: &mut Vec<u8>) {
    let (family, ip) = match address.ip() {
        IpAddr::V4(a) => (4u8, a.to_ipv6_mapped().octets()),
        IpAddr::V6(a) => (6u8, a.octets()),
    };
    out.push(family);
    out.extend_from_slice(&ip);
    out.extend_from_slice(&address.port().to_le_bytes());
}

/// The address at the start of `c` ([`encode_address`]); `None` when it is short, its family
/// is neither 4 nor 6, or a family 4 address is not IPv4-mapped.
pub(crate) fn decode_address(c: &[u8]) -> Option<SocketAddr> {
    let ip: [u8; 16] = c.get(1..17)?.try_into().ok()?;
    let ip = Ipv6Addr::from(ip);
    let ip = match c.first()? {
        4 => IpAddr::V4(ip.to_ipv4_mapped()?),
        6 => IpAddr::V6(ip),
        _ => return None,
    };
    let port = u16::from_le_bytes(c.get(17..ADDRESS_BYTES)?.try_into().ok()?);
    Some(SocketAddr::new(ip, port))
}

fn encode_entry(address: SocketAddr, o: &Outstanding, out: &mut Vec<u8>) {
    encode_address(address, out);
    out.extend_from_slice(&o.requests.to_le_bytes());
    out.extend_from_slice(&o.prefilling.to_le_bytes());
    out.extend_from_slice(&o.prefill_tokens.to_le_bytes());
    out.extend_from_slice(&o.prompt_tokens.to_le_bytes());
    out.extend_from_slice(&o.kv_tokens.to_le_bytes());
    out.extend_from_slice(&o.drained_at_us.to_le_bytes());
    out.extend_from_slice(&o.nominal_rate.to_le_bytes());
    out.extend_from_slice(&o.answered_tokens.to_le_bytes());
    out.extend_from_slice(&o.busy_s.to_le_bytes());
    out.extend_from_slice(&o.measured_at_us.to_le_bytes());
    out.extend_from_slice(&o.hold_s.to_le_bytes());
}

fn decode_entry(c: &[u8]) -> Option<(SocketAddr, Outstanding)> {
    let address = decode_address(c)?;
    let word =
        |i: usize| -> Option<u32> { Some(u32::from_le_bytes(c.get(i..i + 4)?.try_into().ok()?)) };
    let long =
        |i: usize| -> Option<u64> { Some(u64::from_le_bytes(c.get(i..i + 8)?.try_into().ok()?)) };
    // A rate that is not a finite number at or above 0 reads as none (the value is only ever
    // written by this code, but shared data outlives a module version).
    let rate = |i: usize| -> Option<f32> {
        let r = f32::from_bits(word(i)?);
        Some(if r.is_finite() && r >= 0.0 { r } else { 0.0 })
    };
    Some((
        address,
        Outstanding {
            requests: word(19)?,
            prefilling: word(23)?,
            prefill_tokens: word(27)?,
            prompt_tokens: word(31)?,
            kv_tokens: word(35)?,
            drained_at_us: long(39)?,
            nominal_rate: rate(47)?,
            answered_tokens: rate(51)?,
            busy_s: rate(55)?,
            measured_at_us: long(59)?,
            hold_s: rate(67)?,
        },
    ))
}

fn decode_outstanding(bytes: &[u8], out: &mut Vec<(SocketAddr, Outstanding)>) {
    out.clear();
    out.extend(
        bytes
            .chunks_exact(OUTSTANDING_ENTRY_BYTES)
            .take(OUTSTANDING_MAX_ENTRIES)
            .filter_map(decode_entry),
    );
}

impl OutstandingTable {
    pub fn new(namespace: &str) -> Self {
        OutstandingTable {
            key: state_key(namespace),
            scratch: Vec::new(),
            head: 0,
            bytes: Vec::new(),
            primed: None,
        }
    }

    /// Reads the work outstanding at each member of `pool` into `out`, indexed by id (one per
    /// id up to [`Pool::id_bound`]; zeros for members with none). Work at addresses outside
    /// `pool` is not this pool's and is skipped. The decision log's head read with it is
    /// [`OutstandingTable::log_head`].
    pub fn read(&mut self, store: &impl SharedStore, pool: &Pool, out: &mut Vec<Outstanding>) {
        out.clear();
        out.resize(pool.id_bound(), Outstanding::default());
        self.primed = None;
        match store.get(&self.key) {
            Some((bytes, cas)) => {
                self.decode(&bytes);
                for (address, o) in &self.scratch {
                    if let Some(slot) = pool.id_of(*address).and_then(|id| out.get_mut(id.index()))
                    {
                        *slot = *o;
                    }
                }
                self.primed = prime(cas);
            }
            None => {
                self.scratch.clear();
                self.head = 0;
            }
        }
    }

    /// The decision log's head as the last read (or write) of the value saw it: what
    /// [`DecisionLog::poll_to_with`] replays up to.
    pub fn log_head(&self) -> u64 {
        self.head
    }

    fn decode(&mut self, bytes: &[u8]) {
        let (entries, head) = split_state(bytes);
        decode_outstanding(entries, &mut self.scratch);
        self.head = head;
    }

    /// Applies `delta` at `now` to the entry of `address` (see [`Outstanding::apply`]).
    pub fn add(
        &mut self,
        store: &impl SharedStore,
        address: SocketAddr,
        delta: OutstandingDelta,
        now: Duration,
    ) -> Result<(), StoreError> {
        self.write(store, address, delta, now, false).map(|_| ())
    }

    /// [`OutstandingTable::add`], and in the same write claims the decision log's next slot:
    /// returns its sequence number, for [`DecisionLog::write`].
    pub fn add_claiming(
        &mut self,
        store: &impl SharedStore,
        address: SocketAddr,
        delta: OutstandingDelta,
        now: Duration,
    ) -> Result<u64, StoreError> {
        self.write(store, address, delta, now, true)
    }

    /// Returns the log head written (advanced by one if `claim`).
    fn write(
        &mut self,
        store: &impl SharedStore,
        address: SocketAddr,
        delta: OutstandingDelta,
        now: Duration,
        claim: bool,
    ) -> Result<u64, StoreError> {
        let mut last = StoreError::CasMismatch;
        for _ in 0..CAS_RETRIES {
            let cas = match self.primed.take() {
                Some(cas) => cas,
                None => match store.get(&self.key) {
                    Some((b, cas)) => {
                        self.decode(&b);
                        cas
                    }
                    None => {
                        self.scratch.clear();
                        self.head = 0;
                        0
                    }
                },
            };
            let full = self.scratch.len() >= OUTSTANDING_MAX_ENTRIES;
            match self.scratch.iter_mut().find(|(a, _)| *a == address) {
                Some((_, o)) => o.apply(delta, now),
                None if full => return Err(StoreError::Full),
                None => {
                    let mut o = Outstanding::default();
                    o.apply(delta, now);
                    self.scratch.push((address, o));
                }
            }
            self.scratch.retain(|(_, o)| !o.is_spent(now));
            let head = if claim {
                self.head.wrapping_add(1)
            } else {
                self.head
            };
            self.bytes.clear();
            for (a, o) in &self.scratch {
                encode_entry(*a, o, &mut self.bytes);
            }
            self.bytes.extend_from_slice(&head.to_le_bytes());
            match store.set(&self.key, &self.bytes, cas) {
                Ok(()) => {
                    self.head = head;
                    return Ok(head);
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }
}

/// One decision as written to the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogRecord {
    pub seq: u64,
    /// The VM that appended it, so a VM skips its own records.
    pub origin: u64,
    pub endpoint: EndpointId,
    pub keys: Vec<BlockKey>,
    pub kind: RecordKind,
    /// When the decision was routed, ms since the Unix epoch by the writer's clock; 0 when not
    /// known (a relayed decision, a removal).
    pub at_ms: u64,
}

/// What a [`LogRecord`] says of its endpoint and keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordKind {
    /// A prompt with these keys was routed there.
    Routed,
    /// A confirmed removal: the endpoint evicted these keys' blocks.
    Removed,
    /// A confirmed offload: the endpoint moved these keys' blocks off its GPU, to this tier.
    Offloaded(Tier),
}

const RECORD_HEADER: usize = 8 + 8 + 2 + 4 + 8;
/// Set in a record's endpoint field for a removal or an offload: endpoint ids stay below
/// [`crate::prefix_affinity::config::MAX_ENDPOINTS`], far under this bit and [`TIER_BITS`].
const REMOVAL_BIT: u16 = 0x8000;
/// With [`REMOVAL_BIT`]: 0 a removal, else the tier offloaded to (1 CPU, 2 storage).
const TIER_SHIFT: u16 = 13;
const TIER_BITS: u16 = 0x3 << TIER_SHIFT;

/// What a record of the log says, as [`DecisionLog::poll_to_with`] hands it out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logged<'a> {
    /// A prompt was routed to the endpoint, at this time (ms since the Unix epoch; 0: not
    /// known).
    Routed(EndpointId, &'a [BlockKey], u64),
    /// The endpoint evicted these keys' blocks.
    Removed(EndpointId, &'a [BlockKey]),
    /// The endpoint moved these keys' blocks off its GPU, to this tier.
    Offloaded(EndpointId, Tier, &'a [BlockKey]),
}

impl LogRecord {
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.clear();
        out.extend_from_slice(&self.seq.to_le_bytes());
        out.extend_from_slice(&self.origin.to_le_bytes());
        let endpoint = match self.kind {
            RecordKind::Routed => self.endpoint.0,
            RecordKind::Removed => self.endpoint.0 | REMOVAL_BIT,
            RecordKind::Offloaded(tier) => {
                self.endpoint.0 | REMOVAL_BIT | ((tier as u16) << TIER_SHIFT)
            }
        };
        out.extend_from_slice(&endpoint.to_le_bytes());
        out.extend_from_slice(&(self.keys.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.at_ms.to_le_bytes());
        for k in &self.keys {
            out.extend_from_slice(&k.0.to_le_bytes());
        }
    }

    /// Decodes a record; `None` for anything malformed.
    pub fn decode(b: &[u8]) -> Option<LogRecord> {
        let header = b.get(..RECORD_HEADER)?;
        let seq = u64::from_le_bytes(header[0..8].try_into().ok()?);
        let origin = u64::from_le_bytes(header[8..16].try_into().ok()?);
        let raw = u16::from_le_bytes(header[16..18].try_into().ok()?);
        let endpoint = EndpointId(raw & !(REMOVAL_BIT | TIER_BITS));
        let kind = match (raw & REMOVAL_BIT != 0, (raw & TIER_BITS) >> TIER_SHIFT) {
            (false, 0) => RecordKind::Routed,
            (true, 0) => RecordKind::Removed,
            (true, 1) => RecordKind::Offloaded(Tier::Cpu),
            (true, 2) => RecordKind::Offloaded(Tier::Storage),
            _ => return None,
        };
        let n = u32::from_le_bytes(header[18..22].try_into().ok()?) as usize;
        let at_ms = u64::from_le_bytes(header[22..30].try_into().ok()?);
        let body = &b[RECORD_HEADER..];
        if body.len() != n.checked_mul(8)? {
            return None;
        }
        let keys = body
            .chunks_exact(8)
            .map(|c| {
                BlockKey(u64::from_le_bytes([
                    c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7],
                ]))
            })
            .collect();
        Some(LogRecord {
            seq,
            origin,
            endpoint,
            keys,
            kind,
            at_ms,
        })
    }
}

/// Reads a record's header only (seq, origin) without decoding keys.
fn peek_header(b: &[u8]) -> Option<(u64, u64)> {
    let seq = u64::from_le_bytes(b.get(0..8)?.try_into().ok()?);
    let origin = u64::from_le_bytes(b.get(8..16)?.try_into().ok()?);
    Some((seq, origin))
}

/// The cross-VM decision log (see the module doc). Its head is kept in the routing state value
/// ([`state_key`]), beside the outstanding work.
#[derive(Debug, Clone)]
pub struct DecisionLog {
    state_key: String,
    slot_prefix: String,
    slots: u64,
    origin: u64,
    /// Highest sequence number this VM has consumed.
    seen: u64,
    /// Polls spent waiting on a slot whose writer has not finished.
    stalled: u32,
    scratch: Vec<u8>,
}

/// A slot whose writer has not finished after this many polls is given up on.
const MAX_STALL_POLLS: u32 = 64;

impl DecisionLog {
    /// `origin` identifies this VM (any value distinct per VM, e.g. random).
    pub fn new(namespace: &str, slots: u32, origin: u64) -> Self {
        DecisionLog {
            state_key: state_key(namespace),
            slot_prefix: format!("{namespace}.log."),
            slots: u64::from(slots.max(1)),
            origin,
            seen: 0,
            stalled: 0,
            scratch: Vec::new(),
        }
    }

    fn slot_key(&self, seq: u64) -> String {
        format!("{}{}", self.slot_prefix, seq % self.slots)
    }

    fn head(&self, store: &impl SharedStore) -> u64 {
        store
            .get(&self.state_key)
            .map_or(0, |(b, _)| split_state(&b).1)
    }

    /// Skips everything already logged: a VM that starts late does not replay old history.
    pub fn start_at_head(&mut self, store: &impl SharedStore) {
        self.seen = self.head(store);
    }

    /// Starts at the oldest record the ring still holds, so that the next polls replay what
    /// the pool's VMs decided before this one started (a new configuration's VMs, or a worker
    /// that joins late, begin with the pool's recent history instead of an empty index). At
    /// most `slots` records, read through the usual bounded polls.
    pub fn start_with_history(&mut self, store: &impl SharedStore) {
        self.seen = self.head(store).saturating_sub(self.slots);
    }

    /// Claims the next `n` slots (at least 1): returns the first one's sequence number, the
    /// others follow it. The outstanding entries in the same value are kept as they are.
    pub fn claim(&mut self, store: &impl SharedStore, n: u64) -> Result<u64, StoreError> {
        let n = n.max(1);
        let mut last = StoreError::CasMismatch;
        for _ in 0..CAS_RETRIES {
            let (bytes, cas) = store.get(&self.state_key).unwrap_or_default();
            let (entries, head) = split_state(&bytes);
            self.scratch.clear();
            self.scratch.extend_from_slice(entries);
            self.scratch
                .extend_from_slice(&head.wrapping_add(n).to_le_bytes());
            match store.set(&self.state_key, &self.scratch, cas) {
                Ok(()) => return Ok(head.wrapping_add(1)),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// Appends a decision; returns its sequence number. (A request claims its slot with
    /// [`OutstandingTable::add_claiming`] and calls [`DecisionLog::write`] instead.)
    pub fn append(
        &mut self,
        store: &impl SharedStore,
        endpoint: EndpointId,
        keys: &[BlockKey],
    ) -> Result<u64, StoreError> {
        let seq = self.claim(store, 1)?;
        self.write(store, seq, endpoint, keys, 0)?;
        Ok(seq)
    }

    /// Writes a decision, routed at `at_ms` (ms since the Unix epoch; 0: not known), into the
    /// slot `seq`, claimed by [`DecisionLog::claim`] or [`OutstandingTable::add_claiming`].
    pub fn write(
        &mut self,
        store: &impl SharedStore,
        seq: u64,
        endpoint: EndpointId,
        keys: &[BlockKey],
        at_ms: u64,
    ) -> Result<(), StoreError> {
        self.write_record(store, seq, endpoint, keys, RecordKind::Routed, at_ms)
    }

    /// Writes a confirmed removal into the slot `seq` (claimed by [`DecisionLog::claim`]):
    /// every other VM's [`DecisionLog::poll_to_with`] hands it out as [`Logged::Removed`].
    pub fn write_removal(
        &mut self,
        store: &impl SharedStore,
        seq: u64,
        endpoint: EndpointId,
        keys: &[BlockKey],
    ) -> Result<(), StoreError> {
        self.write_record(store, seq, endpoint, keys, RecordKind::Removed, 0)
    }

    /// Writes a confirmed offload into the slot `seq` (claimed by [`DecisionLog::claim`]):
    /// every other VM's [`DecisionLog::poll_to_with`] hands it out as [`Logged::Offloaded`].
    pub fn write_offload(
        &mut self,
        store: &impl SharedStore,
        seq: u64,
        endpoint: EndpointId,
        tier: Tier,
        keys: &[BlockKey],
    ) -> Result<(), StoreError> {
        self.write_record(store, seq, endpoint, keys, RecordKind::Offloaded(tier), 0)
    }

    fn write_record(
        &mut self,
        store: &impl SharedStore,
        seq: u64,
        endpoint: EndpointId,
        keys: &[BlockKey],
        kind: RecordKind,
        at_ms: u64,
    ) -> Result<(), StoreError> {
        // Nothing between what this VM has seen and its own record: the next poll need not
        // read the record back only to skip it.
        if seq == self.seen.wrapping_add(1) {
            self.seen = seq;
        }
        let record = LogRecord {
            seq,
            origin: self.origin,
            endpoint,
            keys: keys.to_vec(),
            kind,
            at_ms,
        };
        record.encode(&mut self.scratch);
        store.set(&self.slot_key(seq), &self.scratch, 0)
    }

    /// Calls `apply` for every record other VMs appended since the last poll, in order, reading
    /// at most `max_slots` records (its own and overwritten ones included), so that one call's
    /// shared-data reads and replay work are bounded; the rest waits, in order, for the next
    /// call. See [`DecisionLog::poll_to_with`] for what `apply` returns.
    pub fn poll_at_most_with(
        &mut self,
        store: &impl SharedStore,
        max_slots: usize,
        apply: impl FnMut(Logged<'_>) -> bool,
    ) -> usize {
        let head = self.head(store);
        self.poll_to_with(store, head, max_slots, apply)
    }

    /// [`DecisionLog::poll_at_most_with`] up to a `head` already read (with the outstanding
    /// work, [`OutstandingTable::log_head`]). Decisions, removals and offloads come in log order.
    /// `apply` returns whether it took the record: `false` stops the poll before it (the
    /// next poll hands it out again), so that a caller can leave costly records for later.
    pub fn poll_to_with(
        &mut self,
        store: &impl SharedStore,
        head: u64,
        max_slots: usize,
        mut apply: impl FnMut(Logged<'_>) -> bool,
    ) -> usize {
        if head < self.seen {
            // The log restarted (e.g. lost state): follow it from its head.
            self.seen = head;
            return 0;
        }
        if head - self.seen > self.slots {
            self.seen = head - self.slots;
        }
        let mut applied = 0;
        let mut read = 0usize;
        while self.seen < head && read < max_slots {
            read += 1;
            let want = self.seen + 1;
            let header = store
                .get(&self.slot_key(want))
                .and_then(|(b, _)| peek_header(&b).map(|h| (h, b)));
            match header {
                Some(((seq, origin), bytes)) if seq == want => {
                    if origin != self.origin {
                        if let Some(rec) = LogRecord::decode(&bytes) {
                            let taken = apply(match rec.kind {
                                RecordKind::Routed => {
                                    Logged::Routed(rec.endpoint, &rec.keys, rec.at_ms)
                                }
                                RecordKind::Removed => Logged::Removed(rec.endpoint, &rec.keys),
                                RecordKind::Offloaded(tier) => {
                                    Logged::Offloaded(rec.endpoint, tier, &rec.keys)
                                }
                            });
                            if !taken {
                                return applied;
                            }
                            applied += 1;
                        }
                    }
                }
                Some(((seq, _), _)) if seq > want => {} // overwritten: we were lapped
                _ => {
                    // Claimed but not written yet: wait for it, within reason.
                    self.stalled += 1;
                    if self.stalled < MAX_STALL_POLLS {
                        return applied;
                    }
                }
            }
            self.stalled = 0;
            self.seen = want;
        }
        applied
    }

    pub fn seen(&self) -> u64 {
        self.seen
    }
}

/// Values with their cas, and the last cas handed out.
type MemoryMap = (std::collections::HashMap<String, (Vec<u8>, u32)>, u32);

/// An in-process [`SharedStore`] with Envoy's semantics, for tests and native tools.
#[derive(Debug, Default)]
pub struct MemoryStore {
    inner: std::cell::RefCell<MemoryMap>,
}

impl SharedStore for MemoryStore {
    fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        self.inner.borrow().0.get(key).cloned()
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
        let mut inner = self.inner.borrow_mut();
        let (map, counter) = &mut *inner;
        *counter = counter.wrapping_add(1).max(1);
        let next = *counter;
        match map.get_mut(key) {
            Some(entry) => {
                if cas != 0 && cas != entry.1 {
                    return Err(StoreError::CasMismatch);
                }
                *entry = (value.to_vec(), next);
            }
            None => {
                map.insert(key.to_owned(), (value.to_vec(), next));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The decisions other VMs logged, in order (removals and offloads taken and skipped), up
    /// to `head` (the log's own when `None`), at most `max_slots` records: what the filters
    /// replay, less the records they apply otherwise. Returns how many were applied.
    fn routed(
        log: &mut DecisionLog,
        store: &impl SharedStore,
        head: Option<u64>,
        max_slots: usize,
        mut apply: impl FnMut(EndpointId, &[BlockKey]),
    ) -> usize {
        let head = head.unwrap_or_else(|| log.head(store));
        let mut n = 0;
        log.poll_to_with(store, head, max_slots, |logged| {
            if let Logged::Routed(endpoint, keys, _) = logged {
                apply(endpoint, keys);
                n += 1;
            }
            true
        });
        n
    }
    use crate::endpoint::Endpoint;
    use crate::outstanding::Charge;

    fn keys(v: &[u64]) -> Vec<BlockKey> {
        v.iter().copied().map(BlockKey).collect()
    }

    /// A [`MemoryStore`] that counts operations.
    #[derive(Default)]
    struct Counting {
        store: MemoryStore,
        gets: std::cell::Cell<u32>,
        sets: std::cell::Cell<u32>,
    }

    impl SharedStore for Counting {
        fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
            self.gets.set(self.gets.get() + 1);
            self.store.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
            self.sets.set(self.sets.get() + 1);
            self.store.set(key, value, cas)
        }
    }

    impl Counting {
        fn ops(&self) -> (u32, u32) {
            let ops = (self.gets.get(), self.sets.get());
            self.gets.set(0);
            self.sets.set(0);
            ops
        }
    }

    #[test]
    fn a_log_started_with_history_replays_what_the_ring_still_holds() {
        let store = MemoryStore::default();
        let mut writer = DecisionLog::new("ns", 4, 1);
        for k in 0..6u64 {
            writer
                .append(&store, EndpointId(k as u16 % 2), &keys(&[k]))
                .unwrap();
        }
        // The ring holds the last 4 of 6: a VM started with history replays exactly those.
        let mut late = DecisionLog::new("ns", 4, 2);
        late.start_with_history(&store);
        let mut seen = Vec::new();
        routed(&mut late, &store, None, usize::MAX, |_, k| {
            seen.push(k[0].0)
        });
        assert_eq!(seen, [2, 3, 4, 5]);
        // One started at the head replays nothing of it.
        let mut fresh = DecisionLog::new("ns", 4, 3);
        fresh.start_at_head(&store);
        assert_eq!(routed(&mut fresh, &store, None, usize::MAX, |_, _| {}), 0);
    }

    #[test]
    fn the_pool_namespace_follows_the_pool_and_nothing_else() {
        let parse =
            |json: &str| crate::prefix_affinity::PluginConfig::from_json(json.as_bytes()).unwrap();
        let base = parse(
            r#"{"endpoints":[{"address":"10.0.0.1:80","models":["m"]},{"address":"10.0.0.2:80","models":["m"]}]}"#,
        );
        let tuned = parse(
            r#"{"endpoints":[{"address":"10.0.0.1:80","models":["m"]},{"address":"10.0.0.2:80","models":["m"]}],"max_body_bytes":1024,"weights":{"prefix":2}}"#,
        );
        let reordered = parse(
            r#"{"endpoints":[{"address":"10.0.0.2:80","models":["m"]},{"address":"10.0.0.1:80","models":["m"]}]}"#,
        );
        let bigger = parse(
            r#"{"endpoints":[{"address":"10.0.0.1:80","models":["m"]},{"address":"10.0.0.2:80","models":["m"]},{"address":"10.0.0.3:80","models":["m"]}]}"#,
        );
        let ring = parse(
            r#"{"endpoints":[{"address":"10.0.0.1:80","models":["m"]},{"address":"10.0.0.2:80","models":["m"]}],"decision_log_slots":8}"#,
        );
        let ns = |c: &crate::prefix_affinity::PluginConfig| pool_namespace("kvoy.pa", c);
        assert_eq!(ns(&base), ns(&tuned));
        for other in [&reordered, &bigger, &ring] {
            assert_ne!(ns(&base), ns(other));
        }
    }

    #[test]
    fn a_read_primes_the_next_add_and_a_stale_prime_loses_nothing() {
        let store = Counting::default();
        let pool = pool_of(&[1, 2]);
        let (mut a, mut b) = (OutstandingTable::new("ns"), OutstandingTable::new("ns"));
        let mut out = Vec::new();
        // Nothing stored yet: the read does not prime (a version of 0 would make the write
        // unconditional), so the add reads again.
        a.read(&store, &pool, &mut out);
        a.add(&store, at(1), sent(10), T0).unwrap();
        assert_eq!(store.ops(), (2, 1));
        // Read then add: one get and one set.
        a.read(&store, &pool, &mut out);
        a.add(&store, at(1), sent(20), T0).unwrap();
        assert_eq!(store.ops(), (1, 1));
        // The prime is used once: the next add reads.
        a.add(&store, at(2), sent(5), T0).unwrap();
        assert_eq!(store.ops(), (1, 1));
        // Another worker writes between the read and the add: the primed write fails its
        // compare-and-swap and is retried on a fresh read; both changes survive.
        a.read(&store, &pool, &mut out);
        b.add(&store, at(2), sent(7), T0).unwrap();
        store.ops();
        a.add(&store, at(1), sent(30), T0).unwrap();
        assert_eq!(store.ops(), (1, 2));
        b.read(&store, &pool, &mut out);
        assert_eq!(out[0].prefill_tokens, 60);
        assert_eq!(out[1].prefill_tokens, 12);
        assert_eq!(out[0].requests, 3);
    }

    #[test]
    fn an_inflight_read_primes_the_next_add() {
        let store = Counting::default();
        let (mut a, mut b) = (InflightTable::new("ns", 2), InflightTable::new("ns", 2));
        let mut out = Vec::new();
        a.add(&store, EndpointId(0), 1).unwrap();
        store.ops();
        a.read(&store, &mut out);
        a.add(&store, EndpointId(1), 1).unwrap();
        assert_eq!(store.ops(), (1, 1));
        a.read(&store, &mut out);
        b.add(&store, EndpointId(1), 1).unwrap();
        a.add(&store, EndpointId(0), 1).unwrap();
        b.read(&store, &mut out);
        assert_eq!(out, vec![2, 2], "the stale prime lost nothing");
    }

    #[test]
    fn a_request_reads_the_log_head_with_its_outstanding_work_and_claims_its_slot_in_one_write() {
        let store = Counting::default();
        let pool = pool_of(&[1, 2]);
        let mut out = Vec::new();
        let (mut at_a, mut log_a) = (OutstandingTable::new("ns"), DecisionLog::new("ns", 8, 1));
        let (mut at_b, mut log_b) = (OutstandingTable::new("ns"), DecisionLog::new("ns", 8, 2));
        // A request on a worker: read, replay up to the head read, count and claim, write.
        let mut request = |table: &mut OutstandingTable,
                           log: &mut DecisionLog,
                           port: u16,
                           key: u64,
                           seen: &mut Vec<u64>| {
            table.read(&store, &pool, &mut out);
            routed(log, &store, Some(table.log_head()), 32, |_, k| {
                seen.push(k[0].0)
            });
            let seq = table.add_claiming(&store, at(port), sent(10), T0).unwrap();
            log.write(&store, seq, EndpointId(0), &keys(&[key]), 0)
                .unwrap();
            seq
        };
        let (mut seen_a, mut seen_b) = (Vec::new(), Vec::new());
        // Nothing stored yet: the read does not prime, so the claim reads again.
        assert_eq!(request(&mut at_a, &mut log_a, 1, 100, &mut seen_a), 1);
        assert_eq!(store.ops(), (2, 2));
        // Then one get and two sets: no head of its own, no record of its own read back.
        assert_eq!(request(&mut at_a, &mut log_a, 1, 101, &mut seen_a), 2);
        assert_eq!(store.ops(), (1, 2));
        // The other worker reads the two new records besides the value.
        assert_eq!(request(&mut at_b, &mut log_b, 2, 200, &mut seen_b), 3);
        assert_eq!(store.ops(), (3, 2));
        assert_eq!(seen_b, [100, 101]);
        // b writes between a's read and a's claim: a's primed write fails its compare-and-swap
        // and claims the slot after b's, on a fresh read; nothing is lost.
        at_a.read(&store, &pool, &mut out);
        let b_seq = at_b.add_claiming(&store, at(2), sent(1), T0).unwrap();
        let a_seq = at_a.add_claiming(&store, at(1), sent(1), T0).unwrap();
        assert_eq!((b_seq, a_seq), (4, 5));
        log_b
            .write(&store, b_seq, EndpointId(1), &keys(&[201]), 0)
            .unwrap();
        log_a
            .write(&store, a_seq, EndpointId(0), &keys(&[102]), 0)
            .unwrap();
        // A relay's batch claims its slots in one write and keeps the outstanding work.
        let mut relay = DecisionLog::new("ns", 8, 3);
        relay.start_at_head(&store);
        assert_eq!(relay.claim(&store, 2).unwrap(), 6);
        relay
            .write(&store, 6, EndpointId(1), &keys(&[300]), 0)
            .unwrap();
        relay
            .write(&store, 7, EndpointId(1), &keys(&[301]), 0)
            .unwrap();
        at_b.read(&store, &pool, &mut out);
        assert_eq!(at_b.log_head(), 7);
        assert_eq!((out[0].requests, out[1].requests), (3, 2));
        let mut all = Vec::new();
        routed(
            &mut DecisionLog::new("ns", 8, 4),
            &store,
            None,
            usize::MAX,
            |_, k| all.push(k[0].0),
        );
        assert_eq!(all, [100, 101, 200, 201, 102, 300, 301]);
    }

    #[test]
    fn inflight_counts_are_shared_and_saturate() {
        let store = MemoryStore::default();
        let mut t = InflightTable::new("ns", 3);
        let mut out = Vec::new();
        t.read(&store, &mut out);
        assert_eq!(out, vec![0, 0, 0]);
        t.add(&store, EndpointId(1), 1).unwrap();
        t.add(&store, EndpointId(1), 1).unwrap();
        t.add(&store, EndpointId(2), 1).unwrap();
        t.add(&store, EndpointId(0), -1).unwrap();
        InflightTable::new("ns", 3).read(&store, &mut out);
        assert_eq!(out, vec![0, 2, 1]);
        // an id beyond this VM's pool is kept for VMs that know it, and not lost when a VM
        // with a smaller pool writes
        t.add(&store, EndpointId(9), 1).unwrap();
        t.add(&store, EndpointId(1), -1).unwrap();
        t.read(&store, &mut out);
        assert_eq!(out, vec![0, 1, 1]);
        let mut wide = InflightTable::new("ns", 3);
        wide.set_endpoints(10);
        wide.read(&store, &mut out);
        assert_eq!(out, vec![0, 1, 1, 0, 0, 0, 0, 0, 0, 1]);
        t.add(&store, EndpointId(u16::MAX), 1).unwrap();
        wide.read(&store, &mut out);
        assert_eq!(out.len(), 10, "ids beyond MAX_ENDPOINTS are ignored");
    }

    fn pool_of(ports: &[u16]) -> Pool {
        Pool::new(
            ports
                .iter()
                .map(|&p| Endpoint::new(SocketAddr::from(([10, 0, 0, 1], p)), vec!["m".into()]))
                .collect(),
        )
    }

    fn at(port: u16) -> SocketAddr {
        SocketAddr::from(([10, 0, 0, 1], port))
    }

    const T0: Duration = Duration::from_secs(1_000);

    fn charge(tokens: u32) -> Charge {
        Charge {
            prefill_tokens: tokens,
            prompt_tokens: tokens * 2,
            kv_tokens: tokens + 100,
            rate: 1_000.0,
            sent_us: 0,
        }
    }

    fn sent(tokens: u32) -> OutstandingDelta {
        OutstandingDelta::sent(charge(tokens))
    }

    fn answered(tokens: u32) -> OutstandingDelta {
        OutstandingDelta::answered(charge(tokens))
    }

    fn finished(tokens: u32, answered: bool) -> OutstandingDelta {
        OutstandingDelta::finished(charge(tokens), answered)
    }

    /// (requests, prefilling, prefill tokens) of each entry.
    fn counts(out: &[Outstanding]) -> Vec<(u32, u32, u32)> {
        out.iter()
            .map(|o| (o.requests, o.prefilling, o.prefill_tokens))
            .collect()
    }

    #[test]
    fn outstanding_work_is_shared_and_saturates() {
        let store = MemoryStore::default();
        let pool = pool_of(&[1, 2, 3]);
        let mut t = OutstandingTable::new("ns");
        let mut out = Vec::new();
        t.read(&store, &pool, &mut out);
        assert_eq!(out, vec![Outstanding::default(); 3]);
        t.add(&store, at(2), sent(700), T0).unwrap();
        t.add(&store, at(2), sent(300), T0).unwrap();
        t.add(&store, at(3), sent(50), T0).unwrap();
        let mut other = OutstandingTable::new("ns");
        other.read(&store, &pool, &mut out);
        assert_eq!(counts(&out), vec![(0, 0, 0), (2, 2, 1000), (1, 1, 50)]);
        assert_eq!(out[1].prompt_tokens, 2_000);
        // One answered, then both finished: back to zero, never below.
        other.add(&store, at(2), answered(700), T0).unwrap();
        t.read(&store, &pool, &mut out);
        assert_eq!(counts(&out)[1], (2, 1, 300));
        t.add(&store, at(2), finished(700, true), T0).unwrap();
        t.add(&store, at(2), finished(300, false), T0).unwrap();
        t.add(&store, at(2), finished(300, false), T0).unwrap();
        t.read(&store, &pool, &mut out);
        assert_eq!(counts(&out)[1], (0, 0, 0));
        assert_eq!(out[1].prompt_tokens, 0);
        // An endpoint with nothing in flight keeps its entry (its measured rate) for a while,
        // then only live work is stored: one entry left (port 3). The log's head follows the
        // entries.
        let (bytes, _) = store.get("ns.outstanding.2").unwrap();
        assert_eq!(bytes.len(), 2 * OUTSTANDING_ENTRY_BYTES + HEAD_BYTES);
        let later = T0 + crate::outstanding::IDLE_KEEP;
        t.add(&store, at(3), sent(0), later).unwrap();
        let (bytes, _) = store.get("ns.outstanding.2").unwrap();
        assert_eq!(bytes.len(), OUTSTANDING_ENTRY_BYTES + HEAD_BYTES);
        // Work at addresses outside the pool is kept for whoever routes there.
        t.add(&store, at(9), sent(1), later).unwrap();
        t.add(
            &store,
            SocketAddr::from(([0xfd00, 0, 0, 0, 0, 0, 0, 1], 9)),
            sent(4),
            later,
        )
        .unwrap();
        t.read(&store, &pool_of(&[9, 3]), &mut out);
        assert_eq!(counts(&out), vec![(1, 1, 1), (2, 2, 50)]);
        // A garbled value reads as what it can decode, padded with zeros.
        store.set("ns.outstanding.2", &[1, 2, 3], 0).unwrap();
        t.read(&store, &pool, &mut out);
        assert_eq!(out, vec![Outstanding::default(); 3]);
    }

    #[test]
    fn an_outstanding_entry_round_trips_and_a_garbled_rate_reads_as_none() {
        let o = Outstanding {
            requests: 3,
            prefilling: 2,
            prefill_tokens: 4_000,
            prompt_tokens: 9_000,
            kv_tokens: 5_500,
            drained_at_us: 1_234_567_890,
            nominal_rate: 25_000.0,
            answered_tokens: 61_000.5,
            busy_s: 3.25,
            measured_at_us: 1_234_000_000,
            hold_s: 31.5,
        };
        let mut bytes = Vec::new();
        encode_entry(at(7), &o, &mut bytes);
        assert_eq!(bytes.len(), OUTSTANDING_ENTRY_BYTES);
        assert_eq!(decode_entry(&bytes), Some((at(7), o)));
        // The nominal rate's bytes (after the address, five counts and the clock) as NaN.
        bytes[47..51].copy_from_slice(&f32::NAN.to_bits().to_le_bytes());
        let (_, garbled) = decode_entry(&bytes).unwrap();
        assert_eq!(garbled.nominal_rate, 0.0);
        assert_eq!(decode_entry(&bytes[..OUTSTANDING_ENTRY_BYTES - 1]), None);
    }

    #[test]
    fn outstanding_work_follows_the_address_across_renumbering() {
        // A request charged 10.0.0.1:1 while it was id 0; an aggregator restart renumbers the
        // pool (it is id 1 now, and id 0 is another server); the release still lands on it.
        let store = MemoryStore::default();
        let mut t = OutstandingTable::new("ns");
        let before = pool_of(&[1, 2]);
        let after = pool_of(&[2, 1]);
        t.add(&store, at(1), sent(100), T0).unwrap();
        t.add(&store, at(2), sent(5), T0).unwrap();
        let mut out = Vec::new();
        t.read(&store, &before, &mut out);
        assert_eq!((out[0].requests, out[1].requests), (1, 1));
        t.read(&store, &after, &mut out);
        assert_eq!((out[0].prefill_tokens, out[1].prefill_tokens), (5, 100));
        t.add(&store, at(1), finished(100, false), T0).unwrap();
        t.read(&store, &after, &mut out);
        assert_eq!(counts(&out), vec![(1, 1, 5), (0, 0, 0)]);
    }

    /// A store that fails the first `n` CAS writes, as if another VM raced each one.
    struct Racy {
        inner: MemoryStore,
        fail: std::cell::Cell<u32>,
    }
    impl SharedStore for Racy {
        fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
            self.inner.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
            if cas != 0 && self.fail.get() > 0 {
                self.fail.set(self.fail.get() - 1);
                // the racer's write lands first
                let (v, _) = self.inner.get(key).unwrap_or_default();
                self.inner.set(key, &v, 0)?;
                return Err(StoreError::CasMismatch);
            }
            self.inner.set(key, value, cas)
        }
    }

    #[test]
    fn inflight_retries_on_cas_mismatch() {
        let store = Racy {
            inner: MemoryStore::default(),
            fail: std::cell::Cell::new(0),
        };
        let mut t = InflightTable::new("ns", 2);
        t.add(&store, EndpointId(0), 1).unwrap();
        store.fail.set(5);
        t.add(&store, EndpointId(0), 1).unwrap();
        let mut out = Vec::new();
        t.read(&store, &mut out);
        assert_eq!(out, vec![2, 0]);
        store.fail.set(1000);
        assert_eq!(
            t.add(&store, EndpointId(0), 1),
            Err(StoreError::CasMismatch)
        );
    }

    #[test]
    fn log_replays_other_vms_records_once() {
        let store = MemoryStore::default();
        let mut a = DecisionLog::new("ns", 8, 1);
        let mut b = DecisionLog::new("ns", 8, 2);
        a.append(&store, EndpointId(0), &keys(&[1, 2])).unwrap();
        a.append(&store, EndpointId(1), &keys(&[3])).unwrap();
        b.append(&store, EndpointId(2), &keys(&[4])).unwrap();
        let mut got = Vec::new();
        assert_eq!(
            routed(&mut b, &store, None, usize::MAX, |e, k| got
                .push((e, k.to_vec()))),
            2
        );
        assert_eq!(
            got,
            vec![(EndpointId(0), keys(&[1, 2])), (EndpointId(1), keys(&[3]))]
        );
        got.clear();
        assert_eq!(
            routed(&mut b, &store, None, usize::MAX, |e, k| got
                .push((e, k.to_vec()))),
            0
        );
        assert_eq!(
            routed(&mut a, &store, None, usize::MAX, |e, k| got
                .push((e, k.to_vec()))),
            1
        );
        assert_eq!(got, vec![(EndpointId(2), keys(&[4]))]);
    }

    #[test]
    fn a_bounded_poll_reads_at_most_its_slots_and_the_next_goes_on_in_order() {
        let store = Counting::default();
        let mut a = DecisionLog::new("ns", 64, 1);
        let mut b = DecisionLog::new("ns", 64, 2);
        for i in 0..10u64 {
            a.append(&store, EndpointId(0), &keys(&[i])).unwrap();
        }
        b.append(&store, EndpointId(1), &keys(&[100])).unwrap();
        for i in 10..12u64 {
            a.append(&store, EndpointId(0), &keys(&[i])).unwrap();
        }
        store.ops();
        let mut got = Vec::new();
        assert_eq!(routed(&mut b, &store, None, 4, |_, k| got.push(k[0].0)), 4);
        // The head, then four slots.
        assert_eq!(store.ops(), (5, 0));
        assert_eq!((got.clone(), b.seen()), (vec![0, 1, 2, 3], 4));
        assert_eq!(routed(&mut b, &store, None, 7, |_, k| got.push(k[0].0)), 6);
        // Its own record (seq 11) takes a read and applies nothing.
        assert_eq!(store.ops(), (8, 0));
        assert_eq!(b.seen(), 11);
        assert_eq!(
            routed(&mut b, &store, None, usize::MAX, |_, k| got.push(k[0].0)),
            2
        );
        assert_eq!(got, (0..10).chain(10..12).collect::<Vec<u64>>());
        assert_eq!(b.seen(), 13);
        assert_eq!(routed(&mut b, &store, None, 0, |_, _| panic!("nothing")), 0);
    }

    #[test]
    fn lapped_reader_skips_overwritten_records() {
        let store = MemoryStore::default();
        let mut a = DecisionLog::new("ns", 4, 1);
        let mut b = DecisionLog::new("ns", 4, 2);
        for i in 0..10u64 {
            a.append(&store, EndpointId(0), &keys(&[i])).unwrap();
        }
        let mut got = Vec::new();
        routed(&mut b, &store, None, usize::MAX, |_, k| got.push(k[0].0));
        assert_eq!(got, vec![6, 7, 8, 9]);
        assert_eq!(b.seen(), 10);
    }

    #[test]
    fn unwritten_slot_waits_then_is_skipped() {
        let store = MemoryStore::default();
        let mut a = DecisionLog::new("ns", 8, 1);
        let mut b = DecisionLog::new("ns", 8, 2);
        a.append(&store, EndpointId(0), &keys(&[1])).unwrap();
        // A writer that claimed seq 2 and has not written it yet.
        assert_eq!(DecisionLog::new("ns", 8, 3).claim(&store, 1).unwrap(), 2);
        let mut got = Vec::new();
        routed(&mut b, &store, None, usize::MAX, |_, k| got.push(k[0].0));
        assert_eq!((got.clone(), b.seen()), (vec![1], 1));
        for _ in 0..MAX_STALL_POLLS {
            routed(&mut b, &store, None, usize::MAX, |_, k| got.push(k[0].0));
        }
        assert_eq!(b.seen(), 2);
        a.append(&store, EndpointId(0), &keys(&[3])).unwrap();
        routed(&mut b, &store, None, usize::MAX, |_, k| got.push(k[0].0));
        assert_eq!(got, vec![1, 3]);
    }

    #[test]
    fn removals_and_offloads_travel_in_order_with_decisions_and_plain_polls_skip_them() {
        let store = MemoryStore::default();
        let mut relay = DecisionLog::new("ns", 8, 9);
        relay.append(&store, EndpointId(2), &keys(&[1, 2])).unwrap();
        let seq = relay.claim(&store, 2).unwrap();
        relay
            .write_removal(&store, seq, EndpointId(2), &keys(&[2]))
            .unwrap();
        relay
            .write_offload(
                &store,
                seq + 1,
                EndpointId(4095),
                Tier::Storage,
                &keys(&[5]),
            )
            .unwrap();
        relay.append(&store, EndpointId(1), &keys(&[7])).unwrap();
        let mut all = Vec::new();
        // A reader that leaves removals for later stops before the first one, and gets it again.
        let mut reader = DecisionLog::new("ns", 8, 1);
        let mut first = Vec::new();
        let handed = reader.poll_at_most_with(&store, 8, |l| match l {
            Logged::Routed(e, _, _) => {
                first.push(e.0);
                true
            }
            Logged::Removed(..) | Logged::Offloaded(..) => false,
        });
        assert_eq!((handed, first, reader.seen()), (1, vec![2], 1));
        let handed = DecisionLog::new("ns", 8, 1).poll_at_most_with(&store, 8, |l| {
            all.push(match l {
                Logged::Routed(e, k, _) => (RecordKind::Routed, e.0, k.to_vec()),
                Logged::Removed(e, k) => (RecordKind::Removed, e.0, k.to_vec()),
                Logged::Offloaded(e, t, k) => (RecordKind::Offloaded(t), e.0, k.to_vec()),
            });
            true
        });
        assert_eq!(handed, 4);
        assert_eq!(
            all,
            vec![
                (RecordKind::Routed, 2, keys(&[1, 2])),
                (RecordKind::Removed, 2, keys(&[2])),
                (RecordKind::Offloaded(Tier::Storage), 4095, keys(&[5])),
                (RecordKind::Routed, 1, keys(&[7]))
            ]
        );
        let mut endpoints = Vec::new();
        let n = routed(
            &mut DecisionLog::new("ns", 8, 1),
            &store,
            None,
            usize::MAX,
            |e, _| endpoints.push(e.0),
        );
        assert_eq!((n, endpoints), (2, vec![2, 1]));
    }

    #[test]
    fn a_record_of_an_unknown_kind_does_not_decode() {
        let mut bytes = Vec::new();
        LogRecord {
            seq: 1,
            origin: 2,
            endpoint: EndpointId(3),
            keys: keys(&[4]),
            kind: RecordKind::Offloaded(Tier::Cpu),
            at_ms: 9,
        }
        .encode(&mut bytes);
        assert_eq!(
            LogRecord::decode(&bytes).map(|r| r.kind),
            Some(RecordKind::Offloaded(Tier::Cpu))
        );
        // Tier bits without the removal bit, or tier 3.
        for raw in [0x2003u16, 0xE003] {
            bytes[16..18].copy_from_slice(&raw.to_le_bytes());
            assert_eq!(LogRecord::decode(&bytes), None, "{raw:#x}");
        }
    }

    #[test]
    fn garbage_records_are_ignored() {
        assert_eq!(LogRecord::decode(b""), None);
        assert_eq!(LogRecord::decode(&[0u8; 21]), None);
        let mut rec = Vec::new();
        LogRecord {
            seq: 1,
            origin: 2,
            endpoint: EndpointId(3),
            keys: keys(&[4, 5]),
            kind: RecordKind::Routed,
            at_ms: 0,
        }
        .encode(&mut rec);
        assert_eq!(LogRecord::decode(&rec).unwrap().keys, keys(&[4, 5]));
        rec.pop();
        assert_eq!(LogRecord::decode(&rec), None);
        let store = MemoryStore::default();
        store.set("ns.log.head", b"\x01", 0).unwrap(); // short head reads as 0
        let mut b = DecisionLog::new("ns", 8, 2);
        assert_eq!(
            routed(&mut b, &store, None, usize::MAX, |_, _| panic!(
                "nothing to apply"
            )),
            0
        );
    }
}
