//! The pool snapshot: what kvoy-aggregator knows of each endpoint, as the filters poll it.
//!
//! The aggregator keeps a [`SnapshotHistory`] and answers `GET /v1/snapshot?epoch=E&since=V`
//! with [`SnapshotHistory::delta_since`], encoded with [`SnapshotDelta::encode`]. One filter VM
//! per proxy decodes the answer ([`SnapshotDelta::decode`], total and validating: the bytes come
//! from the network) and applies it to its [`Snapshot`]; a delta that does not fit the snapshot
//! (new epoch, other base) is refused, and the filter asks again without `since`.
//!
//! ```
//! use kvoy_shared::snapshot::{EndpointStatus, Snapshot, SnapshotDelta, SnapshotHistory};
//! let status = EndpointStatus {
//!     slot: 0,
//!     address: "10.0.0.1:8000".parse().unwrap(),
//!     models: vec!["llama".into()],
//!     ready: true,
//!     stale: false,
//!     waiting: 0,
//!     running: 3,
//!     kv_cache_usage: 0.25,
//!     block_size: 16,
//!     capacity_blocks: 4096,
//!     cached_blocks: [900, 0, 0],
//!     cache_generation: 1,
//!     prefix_hit_rate: Some(0.5),
//! };
//! // aggregator
//! let mut history = SnapshotHistory::new(7);
//! assert!(history.update(vec![status.clone()]));
//! let mut body = Vec::new();
//! history.delta_since(None, None).encode(&mut body);
//! // filter
//! let mut snapshot = Snapshot::default();
//! snapshot.apply(SnapshotDelta::decode(&body).unwrap()).unwrap();
//! assert_eq!(snapshot.get(0), Some(&status));
//! // next poll: only what changed since the version the filter holds
//! history.update(vec![EndpointStatus { waiting: 5, ..status }]);
//! let delta = history.delta_since(Some(snapshot.epoch), Some(snapshot.version));
//! assert!(!delta.is_full());
//! snapshot.apply(delta).unwrap();
//! assert_eq!(snapshot, history.snapshot());
//! ```

use std::collections::VecDeque;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use thiserror::Error;

use crate::config::MAX_ENDPOINTS;
use crate::endpoint::EndpointId;

/// The HTTP `Content-Type` of an encoded [`SnapshotDelta`].
pub const CONTENT_TYPE: &str = "application/x-kvoy-snapshot";
/// Models one endpoint may list.
pub const MAX_MODELS: usize = 64;
/// Longest model name, in bytes.
pub const MAX_MODEL_NAME_BYTES: usize = 256;
/// Removed slots the aggregator remembers; older `since` values get a full snapshot.
pub const MAX_TOMBSTONES: usize = 4096;

const MAGIC: &[u8; 3] = b"KVS";
const FORMAT: u8 = 1;
const KIND_FULL: u8 = 0;
const KIND_INCREMENTAL: u8 = 1;
const FAMILY_V4: u8 = 4;
const FAMILY_V6: u8 = 6;
const FLAG_READY: u8 = 1;
const FLAG_STALE: u8 = 2;
const FLAG_HIT_RATE: u8 = 4;
const FLAGS_KNOWN: u8 = FLAG_READY | FLAG_STALE | FLAG_HIT_RATE;
/// The fewest bytes one encoded endpoint takes (IPv4, every varint one byte, no model).
const MIN_ENDPOINT_BYTES: usize = 1 + (1 + 4 + 2) + 1 + 2 + 4 + 2 + 3 + 1 + 1;

/// One endpoint as the filters see it.
#[derive(Clone, Debug, PartialEq)]
pub struct EndpointStatus {
    /// Stable id assigned by the aggregator, below [`MAX_ENDPOINTS`]; the filters use it as
    /// [`EndpointId`].
    pub slot: u16,
    pub address: SocketAddr,
    pub models: Vec<String>,
    /// The last scrapes succeeded.
    pub ready: bool,
    /// The metrics are older than the staleness threshold.
    pub stale: bool,
    pub waiting: u32,
    pub running: u32,
    /// KV-cache use in 0..=1.
    pub kv_cache_usage: f32,
    /// Tokens per KV block, 0 = unknown.
    pub block_size: u32,
    /// GPU KV blocks, 0 = unknown.
    pub capacity_blocks: u32,
    /// Blocks known cached from KV events: GPU, CPU, STORAGE.
    pub cached_blocks: [u32; 3],
    /// Bumped whenever the endpoint's cache was cleared or its event publisher restarted.
    pub cache_generation: u32,
    /// Prefix-cache hit rate in 0..=1 from the server's counters, when known.
    pub prefix_hit_rate: Option<f32>,
}

/// The whole pool at one version. `endpoints` is sorted by slot, slots unique.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Snapshot {
    pub epoch: u64,
    pub version: u64,
    pub endpoints: Vec<EndpointStatus>,
}

/// What one poll returns: everything (`base` `None`) or the changes since `base`.
#[derive(Clone, Debug, PartialEq)]
pub struct SnapshotDelta {
    pub epoch: u64,
    pub base: Option<u64>,
    pub version: u64,
    pub upserts: Vec<EndpointStatus>,
    /// Slots to drop. A full delta needs none (it replaces everything) but may carry some.
    pub removed: Vec<u16>,
}

#[derive(Debug, Error, PartialEq)]
pub enum SnapshotError {
    #[error("snapshot truncated")]
    Truncated,
    #[error("not a kvoy snapshot (bad magic)")]
    BadMagic,
    #[error("unsupported snapshot format version {0}")]
    UnsupportedFormat(u8),
    #[error("invalid snapshot: {0}")]
    Invalid(&'static str),
    #[error("trailing bytes after the snapshot")]
    TrailingBytes,
    #[error(
        "delta for epoch {delta_epoch} since {delta_base:?} does not apply to \
         epoch {epoch} version {version}"
    )]
    /// An incremental delta for another epoch or base than the snapshot's `epoch` and
    /// `version`: poll again without `since`.
    Mismatch {
        epoch: u64,
        version: u64,
        delta_epoch: u64,
        delta_base: Option<u64>,
    },
}

use SnapshotError::Invalid;

impl EndpointStatus {
    pub fn id(&self) -> EndpointId {
        EndpointId(self.slot)
    }

    /// Checks what decoding checks of one endpoint: slot range, usage and hit rate finite in
    /// 0..=1, at most [`MAX_MODELS`] models named by 1..=[`MAX_MODEL_NAME_BYTES`] bytes.
    pub fn validate(&self) -> Result<(), SnapshotError> {
        if usize::from(self.slot) >= MAX_ENDPOINTS {
            return Err(Invalid("slot out of range"));
        }
        if !(0.0..=1.0).contains(&self.kv_cache_usage) {
            return Err(Invalid("kv cache usage out of range"));
        }
        if let Some(rate) = self.prefix_hit_rate {
            if !(0.0..=1.0).contains(&rate) {
                return Err(Invalid("prefix hit rate out of range"));
            }
        }
        if self.models.len() > MAX_MODELS {
            return Err(Invalid("too many models"));
        }
        for m in &self.models {
            if m.is_empty() {
                return Err(Invalid("empty model name"));
            }
            if m.len() > MAX_MODEL_NAME_BYTES {
                return Err(Invalid("model name too long"));
            }
        }
        Ok(())
    }

    /// Brings a status the aggregator built into what [`EndpointStatus::validate`] accepts:
    /// `None` for a slot out of range; usage clamped into 0..=1 (NaN counts as full); a
    /// non-finite hit rate is unknown, a finite one clamped; invalid model names dropped and
    /// the list cut to [`MAX_MODELS`].
    fn normalized(mut self) -> Option<Self> {
        if usize::from(self.slot) >= MAX_ENDPOINTS {
            return None;
        }
        self.kv_cache_usage = if self.kv_cache_usage.is_nan() {
            1.0
        } else {
            self.kv_cache_usage.clamp(0.0, 1.0)
        };
        self.prefix_hit_rate = self
            .prefix_hit_rate
            .filter(|r| r.is_finite())
            .map(|r| r.clamp(0.0, 1.0));
        self.models
            .retain(|m| !m.is_empty() && m.len() <= MAX_MODEL_NAME_BYTES);
        self.models.truncate(MAX_MODELS);
        Some(self)
    }
}

/// A set of slots, one bit each.
struct SlotSet([u64; MAX_ENDPOINTS / 64]);

impl SlotSet {
    fn new() -> Self {
        SlotSet([0; MAX_ENDPOINTS / 64])
    }

    /// Adds `slot`; false if it was already there or is out of range.
    fn insert(&mut self, slot: u16) -> bool {
        let i = usize::from(slot);
        let Some(word) = self.0.get_mut(i / 64) else {
            return false;
        };
        let bit = 1u64 << (i % 64);
        let fresh = *word & bit == 0;
        *word |= bit;
        fresh
    }

    fn contains(&self, slot: u16) -> bool {
        let i = usize::from(slot);
        self.0
            .get(i / 64)
            .is_some_and(|w| w & (1u64 << (i % 64)) != 0)
    }
}

impl SnapshotDelta {
    pub fn is_full(&self) -> bool {
        self.base.is_none()
    }

    /// Checks everything [`SnapshotDelta::decode`] checks: each endpoint
    /// ([`EndpointStatus::validate`]), upserted slots unique, removed slots in range, unique
    /// and not upserted, and `version >= base`.
    pub fn validate(&self) -> Result<(), SnapshotError> {
        if self.upserts.len() > MAX_ENDPOINTS || self.removed.len() > MAX_ENDPOINTS {
            return Err(Invalid("too many endpoints"));
        }
        if self.base.is_some_and(|base| self.version < base) {
            return Err(Invalid("version older than base"));
        }
        let mut upserted = SlotSet::new();
        for e in &self.upserts {
            e.validate()?;
            if !upserted.insert(e.slot) {
                return Err(Invalid("duplicate slot"));
            }
        }
        let mut removed = SlotSet::new();
        for &slot in &self.removed {
            if usize::from(slot) >= MAX_ENDPOINTS {
                return Err(Invalid("slot out of range"));
            }
            if upserted.contains(slot) {
                return Err(Invalid("slot both upserted and removed"));
            }
            if !removed.insert(slot) {
                return Err(Invalid("duplicate removed slot"));
            }
        }
        Ok(())
    }

    /// Appends the encoding to `out`. It does not validate: encode what
    /// [`SnapshotDelta::validate`] accepts, or the filters will refuse it.
    ///
    /// Layout, integers as LEB128 varints unless noted:
    ///
    /// ```text
    /// delta    = "KVS" format:u8=1 kind:u8 (0 full, 1 incremental)
    ///            epoch [base, incremental only] version
    ///            count endpoint*count  count slot*count (removed)
    /// endpoint = slot address flags:u8 waiting running kv_cache_usage:f32le
    ///            block_size capacity_blocks cached_gpu cached_cpu cached_storage
    ///            cache_generation [prefix_hit_rate:f32le, if flags & 4]
    ///            count (len utf8-bytes)*count (models)
    /// address  = 4:u8 octets[4] port:u16be | 6:u8 octets[16] port:u16be
    /// flags    = 1 ready | 2 stale | 4 prefix_hit_rate present; other bits zero
    /// ```
    ///
    /// Varints are canonical (the decoder refuses overlong ones); `u32` fields must fit a `u32`
    /// and slots stay below [`MAX_ENDPOINTS`]. IPv6 flow info and scope id are not carried.
    pub fn encode(&self, out: &mut Vec<u8>) {
        encode_parts(
            self.epoch,
            self.base,
            self.version,
            &self.upserts,
            &self.removed,
            out,
        );
    }

    /// Decodes and validates (see [`SnapshotDelta::validate`]) one delta that must span all of
    /// `bytes`. Never panics; allocations are bounded by `bytes.len()`.
    pub fn decode(bytes: &[u8]) -> Result<Self, SnapshotError> {
        let mut r = Reader { bytes };
        let magic = r.take(MAGIC.len())?;
        if magic != MAGIC {
            return Err(SnapshotError::BadMagic);
        }
        let format = r.u8()?;
        if format != FORMAT {
            return Err(SnapshotError::UnsupportedFormat(format));
        }
        let kind = r.u8()?;
        let epoch = r.varint()?;
        let base = match kind {
            KIND_FULL => None,
            KIND_INCREMENTAL => Some(r.varint()?),
            _ => return Err(Invalid("unknown kind")),
        };
        let version = r.varint()?;
        let count = r.count(MAX_ENDPOINTS, "too many endpoints")?;
        let mut upserts = Vec::with_capacity(r.capacity(count, MIN_ENDPOINT_BYTES));
        for _ in 0..count {
            upserts.push(r.endpoint()?);
        }
        let count = r.count(MAX_ENDPOINTS, "too many endpoints")?;
        let mut removed = Vec::with_capacity(r.capacity(count, 1));
        for _ in 0..count {
            removed.push(r.slot()?);
        }
        if !r.bytes.is_empty() {
            return Err(SnapshotError::TrailingBytes);
        }
        let delta = SnapshotDelta {
            epoch,
            base,
            version,
            upserts,
            removed,
        };
        delta.validate()?;
        Ok(delta)
    }
}

impl Snapshot {
    /// This snapshot as a full delta.
    pub fn full(&self) -> SnapshotDelta {
        SnapshotDelta {
            epoch: self.epoch,
            base: None,
            version: self.version,
            upserts: self.endpoints.clone(),
            removed: Vec::new(),
        }
    }

    /// [`Snapshot::full`] without the clone.
    fn into_full(self) -> SnapshotDelta {
        SnapshotDelta {
            epoch: self.epoch,
            base: None,
            version: self.version,
            upserts: self.endpoints,
            removed: Vec::new(),
        }
    }

    /// Applies a poll result. A full delta replaces everything; an incremental one needs
    /// `delta.epoch == self.epoch` and `delta.base == Some(self.version)`, else
    /// [`SnapshotError::Mismatch`]. Upserts replace or insert by slot (keeping slot order),
    /// removed slots are dropped. An invalid delta is refused too; on any error `self` is
    /// unchanged.
    pub fn apply(&mut self, delta: SnapshotDelta) -> Result<(), SnapshotError> {
        if let Some(base) = delta.base {
            if delta.epoch != self.epoch || base != self.version {
                return Err(SnapshotError::Mismatch {
                    epoch: self.epoch,
                    version: self.version,
                    delta_epoch: delta.epoch,
                    delta_base: delta.base,
                });
            }
        }
        delta.validate()?;
        self.epoch = delta.epoch;
        self.version = delta.version;
        if delta.is_full() {
            self.endpoints = delta.upserts;
            self.endpoints.sort_unstable_by_key(|e| e.slot);
            return Ok(());
        }
        if !delta.removed.is_empty() {
            let mut removed = SlotSet::new();
            for &slot in &delta.removed {
                removed.insert(slot);
            }
            self.endpoints.retain(|e| !removed.contains(e.slot));
        }
        let existing = self.endpoints.len();
        for e in delta.upserts {
            match self.endpoints[..existing].binary_search_by_key(&e.slot, |x| x.slot) {
                Ok(i) => self.endpoints[i] = e,
                Err(_) => self.endpoints.push(e),
            }
        }
        if self.endpoints.len() > existing {
            self.endpoints.sort_unstable_by_key(|e| e.slot);
        }
        Ok(())
    }

    /// The endpoint with this slot.
    pub fn get(&self, slot: u16) -> Option<&EndpointStatus> {
        self.endpoints
            .binary_search_by_key(&slot, |e| e.slot)
            .ok()
            .and_then(|i| self.endpoints.get(i))
    }

    /// Appends `self.full()`'s encoding (see [`SnapshotDelta::encode`]) without cloning.
    pub fn encode(&self, out: &mut Vec<u8>) {
        encode_parts(self.epoch, None, self.version, &self.endpoints, &[], out);
    }

    /// Decodes a full delta into a snapshot; an incremental one is an error.
    pub fn decode(bytes: &[u8]) -> Result<Self, SnapshotError> {
        let delta = SnapshotDelta::decode(bytes)?;
        if !delta.is_full() {
            return Err(Invalid(
                "incremental delta where a full snapshot was expected",
            ));
        }
        let mut snapshot = Snapshot::default();
        snapshot.apply(delta)?;
        Ok(snapshot)
    }
}

fn encode_parts(
    epoch: u64,
    base: Option<u64>,
    version: u64,
    upserts: &[EndpointStatus],
    removed: &[u16],
    out: &mut Vec<u8>,
) {
    out.extend_from_slice(MAGIC);
    out.push(FORMAT);
    out.push(if base.is_some() {
        KIND_INCREMENTAL
    } else {
        KIND_FULL
    });
    put_varint(out, epoch);
    if let Some(base) = base {
        put_varint(out, base);
    }
    put_varint(out, version);
    put_varint(out, upserts.len() as u64);
    for e in upserts {
        encode_endpoint(e, out);
    }
    put_varint(out, removed.len() as u64);
    for &slot in removed {
        put_varint(out, u64::from(slot));
    }
}

fn encode_endpoint(e: &EndpointStatus, out: &mut Vec<u8>) {
    put_varint(out, u64::from(e.slot));
    match e.address.ip() {
        IpAddr::V4(ip) => {
            out.push(FAMILY_V4);
            out.extend_from_slice(&ip.octets());
        }
        IpAddr::V6(ip) => {
            out.push(FAMILY_V6);
            out.extend_from_slice(&ip.octets());
        }
    }
    out.extend_from_slice(&e.address.port().to_be_bytes());
    let mut flags = 0;
    if e.ready {
        flags |= FLAG_READY;
    }
    if e.stale {
        flags |= FLAG_STALE;
    }
    if e.prefix_hit_rate.is_some() {
        flags |= FLAG_HIT_RATE;
    }
    out.push(flags);
    put_varint(out, u64::from(e.waiting));
    put_varint(out, u64::from(e.running));
    out.extend_from_slice(&e.kv_cache_usage.to_le_bytes());
    for v in [e.block_size, e.capacity_blocks]
        .into_iter()
        .chain(e.cached_blocks)
        .chain([e.cache_generation])
    {
        put_varint(out, u64::from(v));
    }
    if let Some(rate) = e.prefix_hit_rate {
        out.extend_from_slice(&rate.to_le_bytes());
    }
    put_varint(out, e.models.len() as u64);
    for m in &e.models {
        put_varint(out, m.len() as u64);
        out.extend_from_slice(m.as_bytes());
    }
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// The unread rest of the input.
struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], SnapshotError> {
        if n > self.bytes.len() {
            return Err(SnapshotError::Truncated);
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], SnapshotError> {
        let mut a = [0; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u8(&mut self) -> Result<u8, SnapshotError> {
        let [b] = self.array()?;
        Ok(b)
    }

    /// A canonical LEB128 `u64`: at most ten bytes, no trailing zero group.
    fn varint(&mut self) -> Result<u64, SnapshotError> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.u8()?;
            if shift == 63 && b > 1 {
                return Err(Invalid("varint overflows u64"));
            }
            value |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                if b == 0 && shift > 0 {
                    return Err(Invalid("overlong varint"));
                }
                return Ok(value);
            }
        }
        Err(Invalid("varint overflows u64"))
    }

    fn u32(&mut self) -> Result<u32, SnapshotError> {
        u32::try_from(self.varint()?).map_err(|_| Invalid("integer out of range"))
    }

    fn f32(&mut self) -> Result<f32, SnapshotError> {
        Ok(f32::from_le_bytes(self.array()?))
    }

    fn slot(&mut self) -> Result<u16, SnapshotError> {
        match u16::try_from(self.varint()?) {
            Ok(slot) if usize::from(slot) < MAX_ENDPOINTS => Ok(slot),
            _ => Err(Invalid("slot out of range")),
        }
    }

    /// A count of at most `max` items, or `too_many`.
    fn count(&mut self, max: usize, too_many: &'static str) -> Result<usize, SnapshotError> {
        match usize::try_from(self.varint()?) {
            Ok(n) if n <= max => Ok(n),
            _ => Err(Invalid(too_many)),
        }
    }

    /// A capacity for `n` items of at least `min_bytes` each: never more than the rest of the
    /// input can hold, whatever count the input claims.
    fn capacity(&self, n: usize, min_bytes: usize) -> usize {
        n.min(self.bytes.len() / min_bytes)
    }

    fn address(&mut self) -> Result<SocketAddr, SnapshotError> {
        let ip = match self.u8()? {
            FAMILY_V4 => IpAddr::V4(Ipv4Addr::from(self.array::<4>()?)),
            FAMILY_V6 => IpAddr::V6(Ipv6Addr::from(self.array::<16>()?)),
            _ => return Err(Invalid("unknown address family")),
        };
        let port = u16::from_be_bytes(self.array()?);
        Ok(SocketAddr::new(ip, port))
    }

    fn endpoint(&mut self) -> Result<EndpointStatus, SnapshotError> {
        let slot = self.slot()?;
        let address = self.address()?;
        let flags = self.u8()?;
        if flags & !FLAGS_KNOWN != 0 {
            return Err(Invalid("unknown endpoint flags"));
        }
        let waiting = self.u32()?;
        let running = self.u32()?;
        let kv_cache_usage = self.f32()?;
        let block_size = self.u32()?;
        let capacity_blocks = self.u32()?;
        let cached_blocks = [self.u32()?, self.u32()?, self.u32()?];
        let cache_generation = self.u32()?;
        let prefix_hit_rate = if flags & FLAG_HIT_RATE != 0 {
            Some(self.f32()?)
        } else {
            None
        };
        let n = self.count(MAX_MODELS, "too many models")?;
        let mut models = Vec::with_capacity(self.capacity(n, 2));
        for _ in 0..n {
            let len = match usize::try_from(self.varint()?) {
                Ok(0) => return Err(Invalid("empty model name")),
                Ok(len) if len <= MAX_MODEL_NAME_BYTES => len,
                _ => return Err(Invalid("model name too long")),
            };
            let name = std::str::from_utf8(self.take(len)?)
                .map_err(|_| Invalid("model name is not utf-8"))?;
            models.push(name.to_owned());
        }
        Ok(EndpointStatus {
            slot,
            address,
            models,
            ready: flags & FLAG_READY != 0,
            stale: flags & FLAG_STALE != 0,
            waiting,
            running,
            kv_cache_usage,
            block_size,
            capacity_blocks,
            cached_blocks,
            cache_generation,
            prefix_hit_rate,
        })
    }
}

/// The aggregator's side: the current statuses with the version each last changed at, and
/// tombstones of removed slots, to answer `since` queries.
#[derive(Debug, Clone)]
pub struct SnapshotHistory {
    epoch: u64,
    version: u64,
    /// Sorted by slot: (version it last changed at, status).
    current: Vec<(u64, EndpointStatus)>,
    /// (version removed at, slot), oldest first; at most one per slot, none for a present slot.
    tombstones: VecDeque<(u64, u16)>,
    max_tombstones: usize,
    /// The oldest `since` still answered incrementally: tombstones before it were dropped.
    horizon: u64,
}

impl SnapshotHistory {
    /// An empty pool at version 0. Choose a new `epoch` on every start (a clock reading, a
    /// random number), so that filters holding an older history's versions reload.
    pub fn new(epoch: u64) -> Self {
        Self::with_tombstone_limit(epoch, MAX_TOMBSTONES)
    }

    fn with_tombstone_limit(epoch: u64, max_tombstones: usize) -> Self {
        SnapshotHistory {
            epoch,
            version: 0,
            current: Vec::new(),
            tombstones: VecDeque::new(),
            max_tombstones,
            horizon: 0,
        }
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn version(&self) -> u64 {
        self.version
    }

    /// Replaces the whole set of endpoints with `statuses` (any order). Endpoints whose status
    /// differs from the current one (or are new) are stamped with a new version; slots no
    /// longer present become tombstones. The version is bumped once per call, only if anything
    /// changed. Returns whether anything changed.
    ///
    /// So that every answer decodes, statuses are normalized first: a repeated slot keeps its
    /// last status, a slot out of range is dropped, usage is clamped into 0..=1 (NaN counts as
    /// full), a non-finite hit rate becomes unknown and a finite one is clamped, invalid model
    /// names are dropped and the list cut to [`MAX_MODELS`].
    pub fn update(&mut self, statuses: Vec<EndpointStatus>) -> bool {
        let mut next: Vec<EndpointStatus> = statuses
            .into_iter()
            .filter_map(EndpointStatus::normalized)
            .collect();
        // stable: among equal slots the input order stays, and the last one wins below
        next.sort_by_key(|e| e.slot);
        let mut deduped: Vec<EndpointStatus> = Vec::with_capacity(next.len());
        for e in next {
            match deduped.last_mut() {
                Some(last) if last.slot == e.slot => *last = e,
                _ => deduped.push(e),
            }
        }

        let stamp = self.version.saturating_add(1);
        let mut changed = false;
        // new slots: any tombstone of theirs is dropped, the upsert covers it
        let mut added = SlotSet::new();
        let mut any_added = false;
        let mut merged = Vec::with_capacity(deduped.len());
        let mut old = std::mem::take(&mut self.current).into_iter().peekable();
        for e in deduped {
            while let Some((_, gone)) = old.next_if(|(_, o)| o.slot < e.slot) {
                self.tombstones.push_back((stamp, gone.slot));
                changed = true;
            }
            match old.next_if(|(_, o)| o.slot == e.slot) {
                Some((at, o)) if o == e => merged.push((at, o)),
                Some(_) => {
                    merged.push((stamp, e));
                    changed = true;
                }
                None => {
                    any_added |= added.insert(e.slot);
                    merged.push((stamp, e));
                    changed = true;
                }
            }
        }
        for (_, gone) in old {
            self.tombstones.push_back((stamp, gone.slot));
            changed = true;
        }
        self.current = merged;
        if any_added && !self.tombstones.is_empty() {
            self.tombstones.retain(|&(_, slot)| !added.contains(slot));
        }
        while self.tombstones.len() > self.max_tombstones {
            if let Some((at, _)) = self.tombstones.pop_front() {
                self.horizon = self.horizon.max(at);
            }
        }
        if changed {
            self.version = stamp;
        }
        changed
    }

    /// What a filter holding (`epoch`, `since`) needs. Full if the epoch is unknown or not
    /// ours, `since` is unknown or newer than our version, or older than the tombstones kept;
    /// else the changes after `since` (possibly none, with `version` the current version).
    pub fn delta_since(&self, epoch: Option<u64>, since: Option<u64>) -> SnapshotDelta {
        let since = match (epoch, since) {
            (Some(e), Some(s)) if e == self.epoch && s <= self.version && s >= self.horizon => s,
            _ => return self.snapshot().into_full(),
        };
        let upserts = self
            .current
            .iter()
            .filter(|(at, _)| *at > since)
            .map(|(_, e)| e.clone())
            .collect();
        let mut removed: Vec<u16> = self
            .tombstones
            .iter()
            .filter(|(at, _)| *at > since)
            .map(|&(_, slot)| slot)
            .collect();
        removed.sort_unstable();
        SnapshotDelta {
            epoch: self.epoch,
            base: Some(since),
            version: self.version,
            upserts,
            removed,
        }
    }

    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            epoch: self.epoch,
            version: self.version,
            endpoints: self.current.iter().map(|(_, e)| e.clone()).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
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
        assert_eq!(bytes, b"KVS\x01\x00\x00\x00\x00\x00");
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
        assert_eq!(full.len(), 335);
        snapshot.endpoints[3].waiting += 1;
        let delta = incremental(12_345, 12_346, vec![snapshot.endpoints[3].clone()])
            .with_epoch(snapshot.epoch);
        assert_eq!(encoded(&delta).len(), 57);
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
            patched(3..4, &[2]),
            Err(SnapshotError::UnsupportedFormat(2))
        );
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
        let mut many = b"KVS\x01\x00\x01\x01".to_vec();
        many.extend(encoded_varint(MAX_ENDPOINTS as u64 + 1));
        assert_eq!(
            SnapshotDelta::decode(&many),
            Err(Invalid("too many endpoints"))
        );
        let mut huge = b"KVS\x01\x00\x01\x01".to_vec();
        huge.extend(encoded_varint(u64::MAX));
        assert_eq!(
            SnapshotDelta::decode(&huge),
            Err(Invalid("too many endpoints"))
        );
        let mut claims = b"KVS\x01\x00\x01\x01".to_vec();
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
        let mut clamped = status(4);
        clamped.kv_cache_usage = 1.5;
        clamped.prefix_hit_rate = Some(-2.0);
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
        let e = &s.endpoints[1];
        assert_eq!((e.kv_cache_usage, e.prefix_hit_rate), (1.0, Some(0.0)));
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
            prop::option::of(arb_unit()),
        )
            .prop_map(
                move |(
                    address,
                    models,
                    (ready, stale),
                    (waiting, running, kv_cache_usage),
                    (block_size, capacity_blocks, cached_blocks, cache_generation),
                    prefix_hit_rate,
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
        (0u32..3, any::<bool>(), 0usize..3).prop_map(move |(waiting, ready, models)| {
            EndpointStatus {
                waiting,
                ready,
                models: ["a", "b"]
                    .iter()
                    .take(models)
                    .map(|m| m.to_string())
                    .collect(),
                ..status(slot)
            }
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
            with_header in any::<bool>(),
        ) {
            let mut input = if with_header { b"KVS\x01".to_vec() } else { Vec::new() };
            input.extend(bytes);
            let _ = SnapshotDelta::decode(&input);
            let _ = Snapshot::decode(&input);
        }

        #[test]
        fn deltas_round_trip(delta in arb_delta()) {
            let bytes = encoded(&delta);
            prop_assert_eq!(SnapshotDelta::decode(&bytes), Ok(delta.clone()));
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
        ) {
            let bytes = encoded(&delta);
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
}
