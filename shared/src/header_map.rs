//! The proxy-wasm ABI's serialized header map (proxy-wasm spec, "header map"), for both sides of
//! the ABI: the filters read the request headers in one host call
//! (`proxy_get_header_map_pairs`) and decode them here, and the wasmtime test host encodes and
//! decodes with the same code. The encoding: a little-endian `u32` pair count, then for each
//! pair a `u32` name length and a `u32` value length, then for each pair the name bytes, a `\0`,
//! the value bytes and a `\0`. Read as bytes: a header's value (and, from a host that allows it,
//! its name) need not be UTF-8, and the proxy-wasm SDK's own decoder unwraps that conversion.

/// One decoded (name, value) pair, borrowed from the buffer.
pub type RawPair<'a> = (&'a [u8], &'a [u8]);

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

/// Walks the pairs of `bytes` in order, each checked against the buffer; the first error ends
/// the walk. An empty buffer is an empty map (the SDK passes one for "no trailers"). Bytes past
/// the last pair are ignored, as the SDK's reader ignores them.
fn walk(bytes: &[u8]) -> impl Iterator<Item = Result<RawPair<'_>, PairsError>> + '_ {
    let table = if bytes.is_empty() {
        Ok((0, 0))
    } else {
        read_u32(bytes, 0)
            .map(|count| count as usize)
            .and_then(|count| {
                count
                    .checked_mul(8)
                    .and_then(|n| n.checked_add(4))
                    .filter(|&end| end <= bytes.len())
                    .map(|end| (count, end))
            })
            .ok_or(PairsError::ShortHeader)
    };
    let (count, mut at, mut failed) = match table {
        Ok((count, end)) => (count, end, None),
        Err(e) => (0, 0, Some(e)),
    };
    let mut index = 0;
    std::iter::from_fn(move || {
        if let Some(e) = failed.take() {
            return Some(Err(e));
        }
        if index >= count {
            return None;
        }
        let pair = (|| {
            let name_len = read_u32(bytes, 4 + index * 8).ok_or(PairsError::ShortHeader)?;
            let value_len = read_u32(bytes, 8 + index * 8).ok_or(PairsError::ShortHeader)?;
            let name = take(bytes, &mut at, name_len as usize, index)?;
            let value = take(bytes, &mut at, value_len as usize, index)?;
            Ok((name, value))
        })();
        index = if pair.is_ok() { index + 1 } else { count };
        Some(pair)
    })
}

/// Decodes the ABI's encoding into borrowed pairs.
pub fn decode_pairs(bytes: &[u8]) -> Result<Vec<RawPair<'_>>, PairsError> {
    walk(bytes).collect()
}

/// Serializes pairs in the ABI's encoding.
pub fn encode_pairs<'a>(pairs: impl IntoIterator<Item = RawPair<'a>> + Clone) -> Vec<u8> {
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

/// Lengths in guest memory are 32-bit; anything serialized here is far below 4 GiB.
fn len_u32(len: usize) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX)
}

/// A serialized header map as the host gave it, checked once ([`SerializedMap::new`]) and read
/// in place: the filters look up a handful of headers per request without copying the map.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SerializedMap {
    bytes: Vec<u8>,
    pairs: usize,
}

impl SerializedMap {
    /// Checks `bytes` (every length within the buffer, every entry NUL-terminated) and keeps
    /// them.
    pub fn new(bytes: Vec<u8>) -> Result<Self, PairsError> {
        let mut pairs = 0;
        for pair in walk(&bytes) {
            pair?;
            pairs += 1;
        }
        Ok(SerializedMap { bytes, pairs })
    }

    /// Name and value of every pair, in the host's order.
    pub fn pairs(&self) -> impl Iterator<Item = RawPair<'_>> + '_ {
        // Checked in `new`: no pair fails.
        walk(&self.bytes).filter_map(Result::ok)
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
    fn decodes_and_encodes_the_sdk_vector() {
        let pairs: [RawPair; 4] = [
            (b":method", b"GET"),
            (b":path", b"/bytes/1"),
            (b":authority", b"httpbin.org"),
            (b"Powered-By", b"proxy-wasm"),
        ];
        assert_eq!(decode_pairs(SDK_VECTOR).unwrap(), pairs.to_vec());
        assert_eq!(encode_pairs(pairs), SDK_VECTOR);
    }

    #[test]
    fn empty_buffers_and_empty_maps() {
        assert!(decode_pairs(&[]).unwrap().is_empty());
        assert!(decode_pairs(&[0, 0, 0, 0]).unwrap().is_empty());
        assert_eq!(encode_pairs([]), [0, 0, 0, 0]);
        assert!(SerializedMap::new(Vec::new()).unwrap().is_empty());
        assert!(SerializedMap::new(encode_pairs([])).unwrap().is_empty());
    }

    #[test]
    fn malformed_buffers_say_where() {
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
    fn reads_what_the_host_wrote_bytes_and_all() {
        let pairs: [RawPair; 4] = [
            (b":path", b"/v1/chat/completions"),
            (b"x-session-id", b"a\xffb"),
            (b"empty", b""),
            (b"X-Session-Id", b"second"),
        ];
        let map = SerializedMap::new(encode_pairs(pairs)).unwrap();
        assert_eq!(map.len(), 4);
        assert_eq!(map.pairs().collect::<Vec<_>>(), pairs.to_vec());
        assert_eq!(map.get(":PATH"), Some(&b"/v1/chat/completions"[..]));
        // The first of two, as the host's single-header read answers.
        assert_eq!(map.get("x-session-id"), Some(&b"a\xffb"[..]));
        assert_eq!(map.get("empty"), Some(&b""[..]));
        assert_eq!(map.get("absent"), None);
    }

    #[test]
    fn malformed_maps_are_refused_not_misread() {
        let good = encode_pairs([(&b"a"[..], &b"bc"[..])]);
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
            Err(PairsError::MissingTerminator(0))
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
