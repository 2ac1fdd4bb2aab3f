//! Header maps and the ABI's serialized pair encoding.
//!
//! The encoding (proxy-wasm spec, "header map"): a little-endian `u32` pair count, then for each
//! pair a `u32` key length and a `u32` value length, then for each pair the key bytes, a `\0`, the
//! value bytes and a `\0`.

use std::fmt;

/// An ordered multi-map of HTTP header names (always lower case, as Envoy stores them) to values.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct HeaderMap {
    entries: Vec<(String, String)>,
}

/// Why a serialized pair buffer could not be decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PairsError {
    #[error("the buffer ends inside the pair count or the length table")]
    ShortHeader,
    #[error("pair {0} runs past the end of the buffer")]
    Truncated(usize),
    #[error("pair {0} is not followed by its \\0 terminator")]
    MissingTerminator(usize),
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

/// Serializes pairs in the ABI's encoding.
pub fn encode_pairs<'a>(pairs: impl IntoIterator<Item = (&'a [u8], &'a [u8])> + Clone) -> Vec<u8> {
    let count = pairs.clone().into_iter().count();
    let data: usize = pairs
        .clone()
        .into_iter()
        .map(|(k, v)| k.len() + v.len() + 2)
        .sum();
    let mut out = Vec::with_capacity(4 + count * 8 + data);
    out.extend_from_slice(&len_u32(count).to_le_bytes());
    for (key, value) in pairs.clone() {
        out.extend_from_slice(&len_u32(key.len()).to_le_bytes());
        out.extend_from_slice(&len_u32(value.len()).to_le_bytes());
    }
    for (key, value) in pairs {
        out.extend_from_slice(key);
        out.push(0);
        out.extend_from_slice(value);
        out.push(0);
    }
    out
}

/// One decoded (name, value) pair, borrowed from the buffer.
pub type RawPair<'a> = (&'a [u8], &'a [u8]);

/// Decodes the ABI's encoding into borrowed pairs. An empty buffer is an empty map (the SDK
/// passes one for "no trailers").
pub fn decode_pairs(bytes: &[u8]) -> Result<Vec<RawPair<'_>>, PairsError> {
    if bytes.is_empty() {
        return Ok(Vec::new());
    }
    let count = read_u32(bytes, 0).ok_or(PairsError::ShortHeader)? as usize;
    let table_end = count
        .checked_mul(8)
        .and_then(|n| n.checked_add(4))
        .filter(|&end| end <= bytes.len())
        .ok_or(PairsError::ShortHeader)?;
    let mut pairs = Vec::with_capacity(count);
    let mut at = table_end;
    for index in 0..count {
        let key_len = read_u32(bytes, 4 + index * 8).ok_or(PairsError::ShortHeader)? as usize;
        let value_len = read_u32(bytes, 8 + index * 8).ok_or(PairsError::ShortHeader)? as usize;
        let key = take(bytes, &mut at, key_len, index)?;
        let value = take(bytes, &mut at, value_len, index)?;
        pairs.push((key, value));
    }
    Ok(pairs)
}

fn take<'a>(
    bytes: &'a [u8],
    at: &mut usize,
    len: usize,
    index: usize,
) -> Result<&'a [u8], PairsError> {
    let end = at.checked_add(len).ok_or(PairsError::Truncated(index))?;
    let field = bytes.get(*at..end).ok_or(PairsError::Truncated(index))?;
    match bytes.get(end) {
        Some(0) => {}
        Some(_) => return Err(PairsError::MissingTerminator(index)),
        None => return Err(PairsError::Truncated(index)),
    }
    *at = end + 1;
    Ok(field)
}

fn read_u32(bytes: &[u8], at: usize) -> Option<u32> {
    let raw = bytes.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]))
}

/// Lengths in guest memory are 32-bit; everything the harness serializes is far below 4 GiB.
fn len_u32(len: usize) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    // The SDK's own test vector (proxy-wasm 0.2.5, hostcalls.rs `SERIALIZED_MAP`).
    #[rustfmt::skip]
    const SDK_VECTOR: &[u8] = &[
        4, 0, 0, 0,
        7, 0, 0, 0, 3, 0, 0, 0,
        5, 0, 0, 0, 8, 0, 0, 0,
        10, 0, 0, 0, 11, 0, 0, 0,
        10, 0, 0, 0, 10, 0, 0, 0,
        58, 109, 101, 116, 104, 111, 100, 0,
        71, 69, 84, 0,
        58, 112, 97, 116, 104, 0,
        47, 98, 121, 116, 101, 115, 47, 49, 0,
        58, 97, 117, 116, 104, 111, 114, 105, 116, 121, 0,
        104, 116, 116, 112, 98, 105, 110, 46, 111, 114, 103, 0,
        80, 111, 119, 101, 114, 101, 100, 45, 66, 121, 0,
        112, 114, 111, 120, 121, 45, 119, 97, 115, 109, 0,
    ];

    #[test]
    fn decodes_the_sdk_vector() {
        let pairs = decode_pairs(SDK_VECTOR).expect("valid");
        let pairs: Vec<(&str, &str)> = pairs
            .iter()
            .map(|(k, v)| {
                (
                    std::str::from_utf8(k).expect("utf8"),
                    std::str::from_utf8(v).expect("utf8"),
                )
            })
            .collect();
        assert_eq!(
            pairs,
            [
                (":method", "GET"),
                (":path", "/bytes/1"),
                (":authority", "httpbin.org"),
                ("Powered-By", "proxy-wasm")
            ]
        );
    }

    #[test]
    fn encodes_the_sdk_vector() {
        let pairs: [(&[u8], &[u8]); 4] = [
            (b":method", b"GET"),
            (b":path", b"/bytes/1"),
            (b":authority", b"httpbin.org"),
            (b"Powered-By", b"proxy-wasm"),
        ];
        assert_eq!(encode_pairs(pairs), SDK_VECTOR);
    }

    #[test]
    fn header_map_round_trips_and_lower_cases() {
        let map = HeaderMap::decode(SDK_VECTOR).expect("valid");
        assert_eq!(map.get("powered-by"), Some("proxy-wasm"));
        assert_eq!(map.get("POWERED-BY"), Some("proxy-wasm"));
        assert_eq!(map.iter().last(), Some(("powered-by", "proxy-wasm")));
        assert_eq!(HeaderMap::decode(&map.encode()).expect("valid"), map);
    }

    #[test]
    fn empty_buffers_and_empty_maps() {
        assert!(decode_pairs(&[]).expect("empty is fine").is_empty());
        assert!(decode_pairs(&[0, 0, 0, 0]).expect("zero pairs").is_empty());
        assert_eq!(HeaderMap::new().encode(), [0, 0, 0, 0]);
    }

    #[test]
    fn rejects_malformed_buffers() {
        assert_eq!(decode_pairs(&[1, 0]), Err(PairsError::ShortHeader));
        // Claims a billion pairs.
        assert_eq!(
            decode_pairs(&[0, 0, 0, 64, 0, 0]),
            Err(PairsError::ShortHeader)
        );
        // One pair, key of 3 bytes, but only 2 present.
        assert_eq!(
            decode_pairs(&[1, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, b'a', b'b']),
            Err(PairsError::Truncated(0))
        );
        // Key without its terminator.
        assert_eq!(
            decode_pairs(&[1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, b'a', b'b', 0]),
            Err(PairsError::MissingTerminator(0))
        );
        // Lengths near u32::MAX must not overflow.
        assert_eq!(
            decode_pairs(&[1, 0, 0, 0, 255, 255, 255, 255, 255, 255, 255, 255, 0]),
            Err(PairsError::Truncated(0))
        );
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
