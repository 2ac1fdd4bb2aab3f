//! The binding table: session key -> endpoint with a TTL, in Envoy shared data.
//!
//! Shared data has no delete, so one key per session would grow without bound. The table is a
//! fixed set of buckets instead (`ceil(max_bindings / 8)` shared-data keys, created on first
//! use), each holding at most [`BINDINGS_PER_BUCKET`] fixed-size entries: a 64-bit tag of the
//! session key, the expiry, and the endpoint. A full bucket gives up its expired entry, else the
//! one closest to expiry. Updates are compare-and-swap, so every worker sees one table.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use crate::shared_data::{SharedStore, StoreError};

/// Entries per bucket.
pub const BINDINGS_PER_BUCKET: usize = 8;
const ENTRY: usize = 8 + 8 + 1 + 16 + 2;
const CAS_RETRIES: usize = 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    tag: u64,
    expires_ms: u64,
    endpoint: SocketAddr,
}

impl Entry {
    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.tag.to_le_bytes());
        out.extend_from_slice(&self.expires_ms.to_le_bytes());
        let mut ip = [0u8; 16];
        let family = match self.endpoint.ip() {
            IpAddr::V4(v4) => {
                ip[..4].copy_from_slice(&v4.octets());
                4
            }
            IpAddr::V6(v6) => {
                ip = v6.octets();
                6
            }
        };
        out.push(family);
        out.extend_from_slice(&ip);
        out.extend_from_slice(&self.endpoint.port().to_le_bytes());
    }

    fn decode(b: &[u8]) -> Option<Entry> {
        let word = |i: usize| -> Option<u64> {
            Some(u64::from_le_bytes(b.get(i..i + 8)?.try_into().ok()?))
        };
        let ip: [u8; 16] = b.get(17..33)?.try_into().ok()?;
        let ip = match b.get(16)? {
            4 => IpAddr::V4(Ipv4Addr::new(ip[0], ip[1], ip[2], ip[3])),
            6 => IpAddr::V6(Ipv6Addr::from(ip)),
            _ => return None,
        };
        let port = u16::from_le_bytes(b.get(33..35)?.try_into().ok()?);
        Some(Entry {
            tag: word(0)?,
            expires_ms: word(8)?,
            endpoint: SocketAddr::new(ip, port),
        })
    }
}

/// Session bindings shared by every worker of a proxy (see the module doc).
#[derive(Clone, Debug)]
pub struct BindingTable {
    prefix: String,
    buckets: u64,
    seed: u64,
    ttl_ms: u64,
}

impl BindingTable {
    /// A table under `namespace` holding about `max_bindings`, each living `ttl_ms` after its
    /// last bind.
    pub fn new(namespace: &str, max_bindings: u32, ttl_ms: u64) -> Self {
        let buckets = u64::from(max_bindings)
            .div_ceil(BINDINGS_PER_BUCKET as u64)
            .max(1);
        BindingTable {
            prefix: format!("{namespace}.bind."),
            buckets,
            seed: xxhash_rust::xxh3::xxh3_64(namespace.as_bytes()),
            ttl_ms,
        }
    }

    /// Bindings the table can hold.
    pub fn capacity(&self) -> u64 {
        self.buckets * BINDINGS_PER_BUCKET as u64
    }

    fn locate(&self, key: &str) -> (String, u64) {
        let h = xxhash_rust::xxh3::xxh3_64_with_seed(key.as_bytes(), self.seed);
        // Tag 0 never occurs, so a zeroed entry can't match.
        let tag = h.max(1);
        (format!("{}{}", self.prefix, h % self.buckets), tag)
    }

    fn entries(bytes: &[u8]) -> impl Iterator<Item = Entry> + '_ {
        bytes
            .chunks_exact(ENTRY)
            .take(BINDINGS_PER_BUCKET)
            .filter_map(Entry::decode)
    }

    /// The endpoint `key` is bound to, unless the binding expired.
    pub fn lookup(&self, store: &impl SharedStore, key: &str, now_ms: u64) -> Option<SocketAddr> {
        let (bucket, tag) = self.locate(key);
        let (bytes, _) = store.get(&bucket)?;
        let found = Self::entries(&bytes)
            .find(|e| e.tag == tag && e.expires_ms > now_ms)
            .map(|e| e.endpoint);
        found
    }

    /// Binds `key` to `endpoint` until `now_ms + ttl`.
    pub fn bind(
        &self,
        store: &impl SharedStore,
        key: &str,
        endpoint: SocketAddr,
        now_ms: u64,
    ) -> Result<(), StoreError> {
        let (bucket, tag) = self.locate(key);
        let fresh = Entry {
            tag,
            expires_ms: now_ms.saturating_add(self.ttl_ms),
            endpoint,
        };
        let mut entries: Vec<Entry> = Vec::with_capacity(BINDINGS_PER_BUCKET);
        let mut out = Vec::with_capacity(BINDINGS_PER_BUCKET * ENTRY);
        let mut last = StoreError::CasMismatch;
        for _ in 0..CAS_RETRIES {
            entries.clear();
            let cas = match store.get(&bucket) {
                Some((bytes, cas)) => {
                    entries.extend(Self::entries(&bytes));
                    cas
                }
                None => 0,
            };
            if let Some(e) = entries.iter_mut().find(|e| e.tag == tag) {
                *e = fresh;
            } else if entries.len() < BINDINGS_PER_BUCKET {
                entries.push(fresh);
            } else if let Some(victim) = entries.iter_mut().min_by_key(|e| e.expires_ms) {
                *victim = fresh;
            }
            out.clear();
            for e in &entries {
                e.encode(&mut out);
            }
            match store.set(&bucket, &out, cas) {
                Ok(()) => return Ok(()),
                Err(e) => last = e,
            }
        }
        Err(last)
    }
}
