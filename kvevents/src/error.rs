//! Decoding errors. Every byte offset is from the start of the payload.

/// Why a payload is not a KV-event batch. Decoding never panics: any input gives a batch or
/// one of these.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The payload ends inside a value.
    #[error("payload truncated at byte {at}")]
    UnexpectedEof {
        /// Where the missing bytes should have been.
        at: usize,
    },
    /// A value has the wrong msgpack type.
    #[error("{what} at byte {at}: expected {expected}, found {found}")]
    WrongType {
        /// Start of the value.
        at: usize,
        /// Which field or value.
        what: &'static str,
        /// The type(s) accepted.
        expected: &'static str,
        /// The msgpack type found.
        found: &'static str,
    },
    /// The reserved marker byte `0xc1`.
    #[error("invalid msgpack marker at byte {at}")]
    InvalidMarker {
        /// Where it is.
        at: usize,
    },
    /// A container or string declares more elements than the payload can hold.
    #[error("declared length at byte {at} exceeds the payload")]
    LengthTooLarge {
        /// Where the length is.
        at: usize,
    },
    /// An integer does not fit its field (a negative token id, a block size past `u32`).
    #[error("{what} at byte {at}: integer out of range")]
    OutOfRange {
        /// Start of the value.
        at: usize,
        /// Which field.
        what: &'static str,
    },
    /// A binary block hash longer than 32 bytes.
    #[error("block hash at byte {at} has {len} bytes (at most 32)")]
    HashTooLong {
        /// Start of the value.
        at: usize,
        /// Its length.
        len: usize,
    },
    /// A required field is absent.
    #[error("{what} at byte {at}: missing field `{field}`")]
    MissingField {
        /// Start of the enclosing value.
        at: usize,
        /// The enclosing value (`"batch"`, `"BlockStored"`, ...).
        what: &'static str,
        /// The missing field.
        field: &'static str,
    },
    /// Bytes follow the batch.
    #[error("{extra} trailing bytes after the batch")]
    TrailingBytes {
        /// How many.
        extra: usize,
    },
}
