//! Process-wide shared data with compare-and-swap, as Envoy's `SharedData` implements it.
//!
//! Every successful set stamps the value with a fresh CAS number from one counter (never 0). A set
//! with CAS 0 is unconditional; a set with a stale CAS fails with `CasMismatch`; a set with any
//! CAS on a missing key succeeds (Envoy only compares when the key exists). There is no delete.

use std::collections::HashMap;

use crate::types::Status;

/// The key-value store behind `proxy_get_shared_data` / `proxy_set_shared_data`.
#[derive(Debug, Clone)]
pub struct SharedData {
    entries: HashMap<String, (Vec<u8>, u32)>,
    next_cas: u32,
}

impl Default for SharedData {
    fn default() -> Self {
        SharedData {
            entries: HashMap::new(),
            next_cas: 1,
        }
    }
}

impl SharedData {
    /// The value and its CAS, or `None` if the key was never set.
    pub fn get(&self, key: &str) -> Option<(&[u8], u32)> {
        self.entries
            .get(key)
            .map(|(value, cas)| (value.as_slice(), *cas))
    }

    /// Stores `value` under `key` if `cas` is 0 or matches the stored CAS.
    pub fn set(&mut self, key: &str, value: &[u8], cas: u32) -> Result<(), Status> {
        let next = self.take_cas();
        match self.entries.get_mut(key) {
            Some(entry) => {
                if cas != 0 && cas != entry.1 {
                    return Err(Status::CasMismatch);
                }
                *entry = (value.to_vec(), next);
            }
            None => {
                self.entries.insert(key.to_owned(), (value.to_vec(), next));
            }
        }
        Ok(())
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Total bytes of keys and values, to watch the memory a filter keeps in shared data.
    pub fn byte_size(&self) -> usize {
        self.entries
            .iter()
            .map(|(k, (v, _))| k.len() + v.len())
            .sum()
    }

    fn take_cas(&mut self) -> u32 {
        let cas = self.next_cas;
        self.next_cas = self.next_cas.wrapping_add(1).max(1);
        cas
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_key_is_none() {
        assert!(SharedData::default().get("k").is_none());
    }

    #[test]
    fn cas_zero_is_unconditional_and_stale_cas_fails() {
        let mut data = SharedData::default();
        data.set("k", b"v1", 0).expect("first set");
        let (value, cas1) = data.get("k").expect("present");
        assert_eq!(value, b"v1");
        assert_ne!(cas1, 0);

        data.set("k", b"v2", cas1).expect("matching cas");
        let (_, cas2) = data.get("k").expect("present");
        assert_ne!(cas1, cas2);

        assert_eq!(data.set("k", b"v3", cas1), Err(Status::CasMismatch));
        assert_eq!(data.get("k").expect("present").0, b"v2");

        data.set("k", b"v4", 0).expect("unconditional");
        assert_eq!(data.get("k").expect("present").0, b"v4");
    }

    #[test]
    fn any_cas_on_a_missing_key_succeeds() {
        let mut data = SharedData::default();
        data.set("fresh", b"x", 12345).expect("Envoy inserts");
        assert_eq!(data.get("fresh").expect("present").0, b"x");
    }

    #[test]
    fn cas_never_wraps_to_zero() {
        let mut data = SharedData {
            next_cas: u32::MAX,
            ..SharedData::default()
        };
        data.set("a", b"", 0).expect("set");
        data.set("b", b"", 0).expect("set");
        assert_eq!(data.get("a").expect("a").1, u32::MAX);
        assert_eq!(data.get("b").expect("b").1, 1);
        assert_eq!(data.len(), 2);
        assert_eq!(data.byte_size(), 2);
    }
}
