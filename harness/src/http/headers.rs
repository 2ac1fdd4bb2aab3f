//! Header maps, and the ABI's serialized pair encoding from `kvoy_shared::header_map` (the
//! filters decode with the same code).

use std::fmt;

pub use kvoy_shared::header_map::{decode_pairs, encode_pairs, PairsError, RawPair};

/// An ordered multi-map of HTTP header names (always lower case, as Envoy stores them) to values.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct HeaderMap {
    entries: Vec<(String, String)>,
}

impl HeaderMap {
    /// An empty map.
    pub fn new() -> HeaderMap {
        HeaderMap::default()
    }

    /// Builds a map from pairs, lower-casing the names.
    pub fn from_pairs<K: AsRef<str>, V: AsRef<str>>(
        pairs: impl IntoIterator<Item = (K, V)>,
    ) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.add(name.as_ref(), value.as_ref());
        }
        map
    }

    /// The first value of `name` (looked up case-insensitively), as Envoy's
    /// `proxy_get_header_map_value` returns it.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.entries
            .iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    }

    /// Every value of `name`, in order.
    pub fn get_all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.entries
            .iter()
            .filter(move |(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    }

    /// Whether `name` is present.
    pub fn contains(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    /// Appends a value, keeping existing ones (`proxy_add_header_map_value`).
    pub fn add(&mut self, name: &str, value: &str) {
        self.entries
            .push((name.to_ascii_lowercase(), value.to_owned()));
    }

    /// Sets the value of `name`, replacing every existing one (`proxy_replace_header_map_value`):
    /// the first entry keeps its position, later duplicates are removed.
    pub fn replace(&mut self, name: &str, value: &str) {
        let mut seen = false;
        self.entries.retain_mut(|(key, existing)| {
            if !key.eq_ignore_ascii_case(name) {
                return true;
            }
            if seen {
                return false;
            }
            seen = true;
            value.clone_into(existing);
            true
        });
        if !seen {
            self.add(name, value);
        }
    }

    /// Removes every value of `name` (`proxy_remove_header_map_value`); absent names are fine.
    pub fn remove(&mut self, name: &str) {
        self.entries
            .retain(|(key, _)| !key.eq_ignore_ascii_case(name));
    }

    /// Number of entries (duplicates counted), the `num_headers` Envoy passes to callbacks.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the map has no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Entries in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> + Clone {
        self.entries.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    /// Owned copy of the entries.
    pub fn to_vec(&self) -> Vec<(String, String)> {
        self.entries.clone()
    }

    /// Sum of name and value lengths, what Envoy's `proxy_get_header_map_size` reports.
    pub fn byte_size(&self) -> usize {
        self.entries.iter().map(|(k, v)| k.len() + v.len()).sum()
    }

    /// The ABI's serialized form.
    pub fn encode(&self) -> Vec<u8> {
        encode_pairs(self.iter().map(|(k, v)| (k.as_bytes(), v.as_bytes())))
    }

    /// Decodes the ABI's serialized form, lower-casing names. Bytes that are not UTF-8 are
    /// replaced (U+FFFD): the harness keeps headers as text.
    pub fn decode(bytes: &[u8]) -> Result<HeaderMap, PairsError> {
        let pairs = decode_pairs(bytes)?;
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.add(
                &String::from_utf8_lossy(name),
                &String::from_utf8_lossy(value),
            );
        }
        Ok(map)
    }
}

impl fmt::Debug for HeaderMap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl<K: AsRef<str>, V: AsRef<str>> FromIterator<(K, V)> for HeaderMap {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> HeaderMap {
        HeaderMap::from_pairs(iter)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_map_round_trips_and_lower_cases() {
        // The SDK's own test vector's pairs (kvoy_shared::header_map checks the bytes).
        let bytes = encode_pairs([
            (&b":method"[..], &b"GET"[..]),
            (b":path", b"/bytes/1"),
            (b":authority", b"httpbin.org"),
            (b"Powered-By", b"proxy-wasm"),
        ]);
        let map = HeaderMap::decode(&bytes).expect("valid");
        assert_eq!(map.get("powered-by"), Some("proxy-wasm"));
        assert_eq!(map.get("POWERED-BY"), Some("proxy-wasm"));
        assert_eq!(map.iter().last(), Some(("powered-by", "proxy-wasm")));
        assert_eq!(HeaderMap::decode(&map.encode()).expect("valid"), map);
    }

    #[test]
    fn an_empty_map_encodes_to_a_zero_count() {
        assert_eq!(HeaderMap::new().encode(), [0, 0, 0, 0]);
    }

    #[test]
    fn replace_add_remove_follow_envoy() {
        let mut map = HeaderMap::from_pairs([("A", "1"), ("b", "2"), ("a", "3")]);
        map.add("a", "4");
        assert_eq!(map.get_all("a").collect::<Vec<_>>(), ["1", "3", "4"]);
        map.replace("A", "x");
        assert_eq!(
            map.to_vec(),
            [("a".into(), "x".into()), ("b".into(), "2".into())]
        );
        map.replace("c", "new");
        assert_eq!(map.get("c"), Some("new"));
        map.remove("B");
        map.remove("missing");
        assert_eq!(map.len(), 2);
        assert_eq!(map.byte_size(), 2 + 4);
    }
}
