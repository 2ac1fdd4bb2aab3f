//! gRPC's message framing, by hand: each message is a 1-byte compressed flag, a 4-byte
//! big-endian length and the protobuf bytes; the call ends with `grpc-status` in the trailers.

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// The largest message accepted: a whole buffered request body travels in one (Envoy's own
/// buffer limit on the listener is 16 MiB).
pub const MAX_MESSAGE_BYTES: usize = 32 << 20;

const PREFIX: usize = 5;

/// gRPC status codes used here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    Ok = 0,
    InvalidArgument = 3,
    ResourceExhausted = 8,
    Unimplemented = 12,
    Internal = 13,
}

/// A call's end: its status code and message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    pub code: Code,
    pub message: String,
}

impl Status {
    pub fn ok() -> Status {
        Status {
            code: Code::Ok,
            message: String::new(),
        }
    }

    pub fn new(code: Code, message: impl Into<String>) -> Status {
        Status {
            code,
            message: message.into(),
        }
    }

    /// `grpc-message`: percent-encoded in the spec; printable ASCII but `%` passes as is, so
    /// anything else is dropped rather than encoded.
    pub fn header_message(&self) -> String {
        self.message
            .chars()
            .filter(|c| (' '..='~').contains(c) && *c != '%')
            .take(200)
            .collect()
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    #[error("compressed messages are not supported")]
    Compressed,
    #[error("message of {0} bytes is over the limit of {MAX_MESSAGE_BYTES}")]
    TooLarge(usize),
    #[error("bad compressed flag {0}")]
    BadFlag(u8),
    #[error("the stream ended inside a message")]
    Truncated,
}

impl FrameError {
    pub fn status(&self) -> Status {
        let code = match self {
            FrameError::Compressed => Code::Unimplemented,
            FrameError::TooLarge(_) => Code::ResourceExhausted,
            FrameError::BadFlag(_) | FrameError::Truncated => Code::InvalidArgument,
        };
        Status::new(code, self.to_string())
    }
}

/// Cuts a byte stream into messages.
#[derive(Debug, Default)]
pub struct Deframer {
    buf: BytesMut,
}

impl Deframer {
    pub fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// The next whole message, if one is buffered.
    pub fn next_message(&mut self) -> Result<Option<Bytes>, FrameError> {
        if self.buf.len() < PREFIX {
            return Ok(None);
        }
        let flag = self.buf[0];
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        match flag {
            0 => {}
            1 => return Err(FrameError::Compressed),
            other => return Err(FrameError::BadFlag(other)),
        }
        if len > MAX_MESSAGE_BYTES {
            return Err(FrameError::TooLarge(len));
        }
        if self.buf.len() < PREFIX + len {
            // Reserve once for the whole message instead of growing by each data frame.
            self.buf.reserve(PREFIX + len - self.buf.len());
            return Ok(None);
        }
        self.buf.advance(PREFIX);
        Ok(Some(self.buf.split_to(len).freeze()))
    }

    /// Called at the end of the stream: bytes left over are a cut message.
    pub fn finish(&self) -> Result<(), FrameError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(FrameError::Truncated)
        }
    }
}

/// `message` as one uncompressed gRPC frame.
pub fn frame(message: &impl prost::Message) -> Bytes {
    let len = message.encoded_len();
    let mut out = BytesMut::with_capacity(PREFIX + len);
    out.put_u8(0);
    // Our own messages are small (a header mutation or a local reply).
    out.put_u32(len as u32);
    // Cannot fail: the buffer has the capacity encoded_len asked for.
    let _ = message.encode(&mut out);
    out.freeze()
}
