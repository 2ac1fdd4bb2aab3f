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
//!     prefill_tokens_per_s: Some(24_000.0),
//!     role: kvoy_shared::Role::Decode,
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
//!
//! # Formats
//! The first byte after the magic is the format. Format 2 adds each endpoint's prefill rate;
//! format 1 is format 2 without it; format 3 adds each endpoint's role (two flag bits). The
//! decoder reads all three. A filter names the newest format
//! it reads in its poll (`format=3`) and the aggregator answers with the newest it knows up
//! to that ([`SnapshotFormat::negotiate`]), format 1 when the poll names none: old filters and
//! new aggregators, and new filters and old aggregators, keep working during a rollout.

use std::collections::VecDeque;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use thiserror::Error;

use crate::endpoint::{EndpointId, Role};
use crate::prefix_affinity::config::MAX_ENDPOINTS;

/// The HTTP `Content-Type` of an encoded [`SnapshotDelta`].
pub const CONTENT_TYPE: &str = "application/x-kvoy-snapshot";
/// Models one endpoint may list.
pub const MAX_MODELS: usize = 64;
/// Longest model name, in bytes.
pub const MAX_MODEL_NAME_BYTES: usize = 256;
/// Removed slots the aggregator remembers; older `since` values get a full snapshot.
pub const MAX_TOMBSTONES: usize = 4096;

const MAGIC: &[u8; 3] = b"KVS";
const KIND_FULL: u8 = 0;
const KIND_INCREMENTAL: u8 = 1;
const FAMILY_V4: u8 = 4;
const FAMILY_V6: u8 = 6;
const FLAG_READY: u8 = 1;
const FLAG_STALE: u8 = 2;
const FLAG_HIT_RATE: u8 = 4;
const FLAG_PREFILL_RATE: u8 = 8;
/// Format 3: the endpoint prefills for others (role prefill or both).
const FLAG_PREFILLS: u8 = 16;
/// Format 3: the endpoint answers no request itself (role prefill); only with
/// [`FLAG_PREFILLS`].
const FLAG_NO_DECODE: u8 = 32;
/// The fewest bytes one encoded endpoint takes (IPv4, every varint one byte, no model).
const MIN_ENDPOINT_BYTES: usize = 1 + (1 + 4 + 2) + 1 + 2 + 4 + 2 + 3 + 1 + 1;

/// A snapshot encoding format (the byte after the magic).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SnapshotFormat {
    /// The first format: no prefill rate.
    V1 = 1,
    /// Adds each endpoint's prefill rate.
    V2 = 2,
    /// Adds each endpoint's role (prefill/decode disaggregation).
    V3 = 3,
}

impl SnapshotFormat {
    /// The newest format this build reads and writes.
    pub const LATEST: SnapshotFormat = SnapshotFormat::V3;

    /// The format to answer a poll that reads formats up to `requested` with: the newest
    /// known up to it; [`SnapshotFormat::V1`] when the poll names none (a filter older than
    /// format 2) or names 0.
    pub fn negotiate(requested: Option<u64>) -> SnapshotFormat {
        match requested {
            Some(n) if n >= SnapshotFormat::V3 as u64 => SnapshotFormat::V3,
            Some(n) if n >= SnapshotFormat::V2 as u64 => SnapshotFormat::V2,
            _ => SnapshotFormat::V1,
        }
    }

    fn from_byte(b: u8) -> Option<SnapshotFormat> {
        match b {
            1 => Some(SnapshotFormat::V1),
            2 => Some(SnapshotFormat::V2),
            3 => Some(SnapshotFormat::V3),
            _ => None,
        }
    }

    /// The endpoint flags this format defines.
    fn known_flags(self) -> u8 {
        match self {
            SnapshotFormat::V1 => FLAG_READY | FLAG_STALE | FLAG_HIT_RATE,
            SnapshotFormat::V2 => FLAG_READY | FLAG_STALE | FLAG_HIT_RATE | FLAG_PREFILL_RATE,
            SnapshotFormat::V3 => {
                FLAG_READY
                    | FLAG_STALE
                    | FLAG_HIT_RATE
                    | FLAG_PREFILL_RATE
                    | FLAG_PREFILLS
                    | FLAG_NO_DECODE
            }
        }
    }
}

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
    /// Prefill rate in prompt tokens per second (finite, above 0), estimated by the
    /// aggregator from the server's metrics, when known. Not carried by format 1.
    pub prefill_tokens_per_s: Option<f32>,
    /// The stages it serves. Formats 1 and 2 carry none: there a prefill-only endpoint is
    /// sent with no model, so that a filter which knows no roles never sends it a request.
    pub role: Role,
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
    /// A ready endpoint with fresh metrics, serving `models`, and nothing known yet of its load,
    /// blocks or cache (zeros and `None`): the base of a `..` update.
    pub fn ready(slot: u16, address: SocketAddr, models: &[&str]) -> EndpointStatus {
        EndpointStatus {
            slot,
            address,
            models: models.iter().map(|&m| m.to_owned()).collect(),
            ready: true,
            stale: false,
            waiting: 0,
            running: 0,
            kv_cache_usage: 0.0,
            block_size: 0,
            capacity_blocks: 0,
            cached_blocks: [0; 3],
            cache_generation: 0,
            prefix_hit_rate: None,
            prefill_tokens_per_s: None,
            role: Role::Decode,
        }
    }

    pub fn id(&self) -> EndpointId {
        EndpointId(self.slot)
    }

    /// Checks what decoding checks of one endpoint: slot range, usage and hit rate finite in
    /// 0..=1, a prefill rate finite and above 0, at most [`MAX_MODELS`] models named by
    /// 1..=[`MAX_MODEL_NAME_BYTES`] bytes.
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
        if let Some(rate) = self.prefill_tokens_per_s {
            if !(rate.is_finite() && rate > 0.0) {
                return Err(Invalid("prefill rate out of range"));
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
    /// non-finite hit rate is unknown, a finite one clamped; a prefill rate that is not finite
    /// and above 0 is unknown; invalid model names dropped and the list cut to [`MAX_MODELS`].
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
        self.prefill_tokens_per_s = self
            .prefill_tokens_per_s
            .filter(|r| r.is_finite() && *r > 0.0);
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

    /// Appends the encoding in [`SnapshotFormat::LATEST`] to `out`; see
    /// [`SnapshotDelta::encode_format`].
    pub fn encode(&self, out: &mut Vec<u8>) {
        self.encode_format(SnapshotFormat::LATEST, out);
    }

    /// Appends the encoding in `format` to `out` (format 1 leaves the prefill rates out). It
    /// does not validate: encode what [`SnapshotDelta::validate`] accepts, or the filters will
    /// refuse it.
    ///
    /// Layout, integers as LEB128 varints unless noted:
    ///
    /// ```text
    /// delta    = "KVS" format:u8 (1, 2 or 3) kind:u8 (0 full, 1 incremental)
    ///            epoch [base, incremental only] version
    ///            count endpoint*count  count slot*count (removed)
    /// endpoint = slot address flags:u8 waiting running kv_cache_usage:f32le
    ///            block_size capacity_blocks cached_gpu cached_cpu cached_storage
    ///            cache_generation [prefix_hit_rate:f32le, if flags & 4]
    ///            [prefill_tokens_per_s:f32le, if flags & 8 (format 2)]
    ///            count (len utf8-bytes)*count (models)
    /// address  = 4:u8 octets[4] port:u16be | 6:u8 octets[16] port:u16be
    /// flags    = 1 ready | 2 stale | 4 prefix_hit_rate present
    ///            | 8 prefill_tokens_per_s present (format 2)
    ///            | 16 prefills for others | 32 answers nothing itself, only with 16
    ///              (format 3: role decode = neither, both = 16, prefill = 16|32);
    ///            other bits zero; formats 1-2 send a prefill-only endpoint with no model
    /// ```
    ///
    /// Varints are canonical (the decoder refuses overlong ones); `u32` fields must fit a `u32`
    /// and slots stay below [`MAX_ENDPOINTS`]. IPv6 flow info and scope id are not carried.
    pub fn encode_format(&self, format: SnapshotFormat, out: &mut Vec<u8>) {
        encode_parts(
            format,
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
        let byte = r.u8()?;
        let format =
            SnapshotFormat::from_byte(byte).ok_or(SnapshotError::UnsupportedFormat(byte))?;
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
            upserts.push(r.endpoint(format)?);
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

    /// Appends `self.full()`'s encoding in [`SnapshotFormat::LATEST`] (see
    /// [`SnapshotDelta::encode_format`]) without cloning.
    pub fn encode(&self, out: &mut Vec<u8>) {
        encode_parts(
            SnapshotFormat::LATEST,
            self.epoch,
            None,
            self.version,
            &self.endpoints,
            &[],
            out,
        );
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
    format: SnapshotFormat,
    epoch: u64,
    base: Option<u64>,
    version: u64,
    upserts: &[EndpointStatus],
    removed: &[u16],
    out: &mut Vec<u8>,
) {
    out.extend_from_slice(MAGIC);
    out.push(format as u8);
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
        encode_endpoint(format, e, out);
    }
    put_varint(out, removed.len() as u64);
    for &slot in removed {
        put_varint(out, u64::from(slot));
    }
}

fn encode_endpoint(format: SnapshotFormat, e: &EndpointStatus, out: &mut Vec<u8>) {
    let prefill_rate = e
        .prefill_tokens_per_s
        .filter(|_| format >= SnapshotFormat::V2);
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
    if prefill_rate.is_some() {
        flags |= FLAG_PREFILL_RATE;
    }
    let roles = format >= SnapshotFormat::V3;
    if roles && e.role.prefills() {
        flags |= FLAG_PREFILLS;
    }
    if roles && !e.role.decodes() {
        flags |= FLAG_NO_DECODE;
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
    for rate in [e.prefix_hit_rate, prefill_rate].into_iter().flatten() {
        out.extend_from_slice(&rate.to_le_bytes());
    }
    let models: &[String] = if roles || e.role.decodes() {
        &e.models
    } else {
        &[]
    };
    put_varint(out, models.len() as u64);
    for m in models {
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

    fn endpoint(&mut self, format: SnapshotFormat) -> Result<EndpointStatus, SnapshotError> {
        let slot = self.slot()?;
        let address = self.address()?;
        let flags = self.u8()?;
        if flags & !format.known_flags() != 0 {
            return Err(Invalid("unknown endpoint flags"));
        }
        let role = match (flags & FLAG_PREFILLS != 0, flags & FLAG_NO_DECODE != 0) {
            (false, false) => Role::Decode,
            (true, false) => Role::Both,
            (true, true) => Role::Prefill,
            (false, true) => return Err(Invalid("an endpoint that neither prefills nor decodes")),
        };
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
        let prefill_tokens_per_s = if flags & FLAG_PREFILL_RATE != 0 {
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
            prefill_tokens_per_s,
            role,
        })
    }
}

mod history;
pub use history::SnapshotHistory;

#[cfg(test)]
mod tests;
