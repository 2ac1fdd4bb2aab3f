//! [`BlockHash`]: an engine's block hash, whatever width it arrived in.

use std::fmt;

/// A model server's hash of one KV-cache block, in one canonical form.
///
/// Servers send block hashes in three shapes: vLLM as a `u64` (with
/// `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`, values may exceed `i64::MAX`) or as raw hash bytes
/// (32 bytes for sha256, 16 for xxh3-128), SGLang as an `i64` (often negative).
///
/// **Canonicalisation.** A hash is the unsigned integer its wire value denotes, held as 32
/// big-endian bytes:
/// - an unsigned integer `u` is `u` (left-padded with zeros);
/// - a signed integer `i` is its 64-bit two's-complement pattern `i as u64` — SGLang's signed
///   hashes are 64-bit hashes viewed as `i64`, so `-1i64` and `u64::MAX` are the same hash;
/// - a binary of `n <= 32` bytes is the big-endian integer of those bytes (left-padded).
///
/// Equal canonical values compare and hash equal, whatever width they arrived in. The low 64
/// bits ([`BlockHash::low_u64`]) are exactly what vLLM publishes as the integer form of a byte
/// hash (`int.from_bytes(h, "big") & (2**64 - 1)`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash([u8; 32]);

impl BlockHash {
    /// Length of the canonical form, and the longest binary hash accepted.
    pub const MAX_BYTES: usize = 32;

    /// The hash of an unsigned integer value.
    pub const fn from_u64(value: u64) -> Self {
        let mut bytes = [0u8; 32];
        let be = value.to_be_bytes();
        let mut i = 0;
        while i < 8 {
            bytes[24 + i] = be[i];
            i += 1;
        }
        Self(bytes)
    }

    /// The hash of a signed integer value: its 64-bit two's-complement pattern.
    pub const fn from_i64(value: i64) -> Self {
        Self::from_u64(value as u64)
    }

    /// The hash of a binary value of at most 32 bytes (big-endian); `None` if longer.
    pub fn from_be_slice(bytes: &[u8]) -> Option<Self> {
        let start = Self::MAX_BYTES.checked_sub(bytes.len())?;
        let mut out = [0u8; 32];
        out[start..].copy_from_slice(bytes);
        Some(Self(out))
    }

    /// The hash whose canonical 32 bytes are `bytes`.
    pub const fn from_canonical(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The canonical 32 big-endian bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The value as a `u64` if it fits (every integer hash does).
    pub fn as_u64(&self) -> Option<u64> {
        if self.0[..24].iter().all(|b| *b == 0) {
            Some(self.low_u64())
        } else {
            None
        }
    }

    /// The low 64 bits: vLLM's integer form of a byte hash.
    pub fn low_u64(&self) -> u64 {
        let mut low = [0u8; 8];
        low.copy_from_slice(&self.0[24..]);
        u64::from_be_bytes(low)
    }
}

impl From<u64> for BlockHash {
    fn from(value: u64) -> Self {
        Self::from_u64(value)
    }
}

impl From<i64> for BlockHash {
    fn from(value: i64) -> Self {
        Self::from_i64(value)
    }
}

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockHash({self})")
    }
}

/// Integers print in decimal, wider hashes as `0x` and 64 hex digits.
impl fmt::Display for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.as_u64() {
            Some(v) => write!(f, "{v}"),
            None => {
                f.write_str("0x")?;
                self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widths_canonicalise_to_one_value() {
        assert_eq!(BlockHash::from_i64(-1), BlockHash::from_u64(u64::MAX));
        assert_eq!(BlockHash::from_i64(7), BlockHash::from_u64(7));
        assert_eq!(
            BlockHash::from_be_slice(&7u64.to_be_bytes()),
            Some(BlockHash::from_u64(7))
        );
        assert_eq!(BlockHash::from_be_slice(&[0u8; 33]), None);
        assert_eq!(BlockHash::from_be_slice(&[]), Some(BlockHash::from_u64(0)));
    }

    #[test]
    fn low_u64_is_vllms_integer_form() {
        let mut raw = [0xabu8; 32];
        raw[24..].copy_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
        let h = BlockHash::from_canonical(raw);
        assert_eq!(h.low_u64(), 0x0102_0304_0506_0708);
        assert_eq!(h.as_u64(), None);
        assert_eq!(BlockHash::from_u64(u64::MAX).as_u64(), Some(u64::MAX));
    }

    #[test]
    fn display() {
        assert_eq!(BlockHash::from_u64(42).to_string(), "42");
        let wide = BlockHash::from_canonical([0xff; 32]);
        assert_eq!(wide.to_string(), format!("0x{}", "ff".repeat(32)));
    }
}
