//! A header map as the proxy-wasm ABI serializes it (`proxy_get_header_map_pairs`): a
//! little-endian `u32` pair count, each pair's name and value lengths (`u32` each), then each
//! name and each value followed by a NUL byte. Read as bytes: a header's value (and, from a
//! host that allows it, its name) need not be UTF-8, and the proxy-wasm SDK's own decoder
//! unwraps that conversion. A filter reads the whole map in one host call instead of one per
//! header it wants.

/// A serialized header map, checked once ([`SerializedMap::new`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SerializedMap {
    bytes: Vec<u8>,
    pairs: usize,
}

/// Why bytes are not a serialized map.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MapError {
    #[error("header map of {len} bytes cut short at byte {at}")]
    Truncated { len: usize, at: usize },
    #[error("header map entry {pair} lacks its NUL terminator")]
    Unterminated { pair: usize },
}

fn read_u32(bytes: &[u8], at: usize) -> Option<usize> {
    let b = bytes.get(at..at.checked_add(4)?)?;
    usize::try_from(u32::from_le_bytes([b[0], b[1], b[2], b[3]])).ok()
}

impl SerializedMap {
    /// Checks `bytes` (every length within the buffer, every entry NUL-terminated) and keeps
    /// them; an empty buffer is an empty map.
    pub fn new(bytes: Vec<u8>) -> Result<Self, MapError> {
        if bytes.is_empty() {
            return Ok(SerializedMap::default());
        }
        let len = bytes.len();
        let truncated = |at| MapError::Truncated { len, at };
        let pairs = read_u32(&bytes, 0).ok_or(truncated(0))?;
        let mut data = pairs
            .checked_mul(8)
            .and_then(|n| n.checked_add(4))
            .filter(|&n| n <= len)
            .ok_or(truncated(4))?;
        for pair in 0..pairs {
            for field in 0..2 {
                let size = read_u32(&bytes, 4 + pair * 8 + field * 4).ok_or(truncated(data))?;
                let end = data
                    .checked_add(size)
                    .filter(|&e| e < len)
                    .ok_or(truncated(data))?;
                if bytes[end] != 0 {
                    return Err(MapError::Unterminated { pair });
                }
                data = end + 1;
            }
        }
        Ok(SerializedMap { bytes, pairs })
    }

    /// Name and value of every pair, in the host's order.
    pub fn pairs(&self) -> impl Iterator<Item = (&[u8], &[u8])> + '_ {
        let mut data = 4 + self.pairs * 8;
        (0..self.pairs).map(move |pair| {
            // Checked in `new`: every length and entry lies within the buffer.
            let mut field = |i: usize| {
                let size = read_u32(&self.bytes, 4 + pair * 8 + i * 4).unwrap_or(0);
                let entry = self.bytes.get(data..data + size).unwrap_or(&[]);
                data += size + 1;
                entry
            };
            let name = field(0);
            (name, field(1))
        })
    }

    /// The value of the first header named `name` (ASCII case-insensitive), as the host's
    /// single-header read answers it.
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        self.pairs()
            .find(|(n, _)| n.eq_ignore_ascii_case(name.as_bytes()))
            .map(|(_, v)| v)
    }

    pub fn len(&self) -> usize {
        self.pairs
    }

    pub fn is_empty(&self) -> bool {
        self.pairs == 0
    }
}

/// `pairs` serialized as the host does (for tests and test hosts).
pub fn serialize<'a>(pairs: impl IntoIterator<Item = (&'a [u8], &'a [u8])>) -> Vec<u8> {
    let list: Vec<(&[u8], &[u8])> = pairs.into_iter().collect();
    let mut out = Vec::new();
    out.extend_from_slice(&(list.len() as u32).to_le_bytes());
    for (n, v) in &list {
        out.extend_from_slice(&(n.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (n, v) in &list {
        out.extend_from_slice(n);
        out.push(0);
        out.extend_from_slice(v);
        out.push(0);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_the_host_wrote_bytes_and_all() {
        let pairs: [(&[u8], &[u8]); 4] = [
            (b":path", b"/v1/chat/completions"),
            (b"x-session-id", b"a\xffb"),
            (b"empty", b""),
            (b"X-Session-Id", b"second"),
        ];
        let map = SerializedMap::new(serialize(pairs)).unwrap();
        assert_eq!(map.len(), 4);
        assert_eq!(map.pairs().collect::<Vec<_>>(), pairs.to_vec());
        assert_eq!(map.get(":PATH"), Some(&b"/v1/chat/completions"[..]));
        // The first of two, as the host's single-header read answers.
        assert_eq!(map.get("x-session-id"), Some(&b"a\xffb"[..]));
        assert_eq!(map.get("empty"), Some(&b""[..]));
        assert_eq!(map.get("absent"), None);
        assert!(SerializedMap::new(Vec::new()).unwrap().is_empty());
        assert!(SerializedMap::new(serialize([])).unwrap().is_empty());
    }

    #[test]
    fn malformed_maps_are_refused_not_misread() {
        let good = serialize([(&b"a"[..], &b"bc"[..])]);
        for cut in 1..good.len() {
            assert!(
                SerializedMap::new(good[..cut].to_vec()).is_err(),
                "cut {cut}"
            );
        }
        let mut unterminated = good.clone();
        let last = unterminated.len() - 1;
        unterminated[last] = b'x';
        assert_eq!(
            SerializedMap::new(unterminated),
            Err(MapError::Unterminated { pair: 0 })
        );
        // A pair count far beyond the buffer.
        let mut huge = good.clone();
        huge[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(SerializedMap::new(huge).is_err());
        // A length far beyond the buffer.
        let mut long = good;
        long[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(SerializedMap::new(long).is_err());
    }
}
