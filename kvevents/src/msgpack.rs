//! A minimal msgpack reader over a borrowed buffer and an infallible writer into a `Vec`.
//!
//! The reader never allocates, never recurses (skipping is iterative) and bounds every declared
//! length by the bytes left, so hostile input costs at most one pass and cannot panic. The
//! writer picks the smallest representation for every value, as msgspec (and rmp) do.

use rmp::Marker;

use crate::DecodeError;

pub(crate) type Result<T> = std::result::Result<T, DecodeError>;

/// A cursor over one msgpack buffer.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub(crate) fn rewind(&mut self, pos: usize) {
        self.pos = pos.min(self.buf.len());
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(DecodeError::UnexpectedEof { at: self.pos });
        }
        let out = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn len8(&mut self) -> Result<usize> {
        Ok(usize::from(self.be::<1>()?[0]))
    }

    fn len16(&mut self) -> Result<usize> {
        Ok(usize::from(u16::from_be_bytes(self.be()?)))
    }

    fn len32(&mut self) -> Result<usize> {
        usize::try_from(u32::from_be_bytes(self.be()?))
            .map_err(|_| DecodeError::LengthTooLarge { at: self.pos })
    }

    pub(crate) fn peek(&self) -> Result<Marker> {
        match self.buf.get(self.pos) {
            Some(b) => Ok(Marker::from_u8(*b)),
            None => Err(DecodeError::UnexpectedEof { at: self.pos }),
        }
    }

    fn marker(&mut self) -> Result<Marker> {
        let m = self.peek()?;
        self.pos += 1;
        Ok(m)
    }

    /// Consumes a `nil` if one is next; tells whether it did.
    pub(crate) fn eat_nil(&mut self) -> Result<bool> {
        if self.peek()? == Marker::Null {
            self.pos += 1;
            Ok(true)
        } else {
            Ok(false)
        }
    }

    fn wrong(
        &self,
        at: usize,
        what: &'static str,
        expected: &'static str,
        m: Marker,
    ) -> DecodeError {
        DecodeError::WrongType {
            at,
            what,
            expected,
            found: marker_kind(m),
        }
    }

    /// A container length, checked against the bytes left (every element takes at least one
    /// byte, `per_item` for maps' key-value pairs).
    fn bounded(&self, n: usize, per_item: usize) -> Result<usize> {
        if n.saturating_mul(per_item) > self.remaining() {
            Err(DecodeError::LengthTooLarge { at: self.pos })
        } else {
            Ok(n)
        }
    }

    /// The length of an array, or `None` (nothing consumed) when the next value is a map.
    pub(crate) fn array_or_map(&mut self, what: &'static str) -> Result<Container> {
        let at = self.pos;
        let c = match self.marker()? {
            Marker::FixArray(n) => Container::Array(usize::from(n)),
            Marker::Array16 => Container::Array(self.len16()?),
            Marker::Array32 => Container::Array(self.len32()?),
            Marker::FixMap(n) => Container::Map(usize::from(n)),
            Marker::Map16 => Container::Map(self.len16()?),
            Marker::Map32 => Container::Map(self.len32()?),
            m => return Err(self.wrong(at, what, "array or map", m)),
        };
        match c {
            Container::Array(n) => self.bounded(n, 1).map(Container::Array),
            Container::Map(n) => self.bounded(n, 2).map(Container::Map),
        }
    }

    pub(crate) fn array_len(&mut self, what: &'static str) -> Result<usize> {
        let at = self.pos;
        match self.array_or_map(what)? {
            Container::Array(n) => Ok(n),
            Container::Map(_) => {
                self.rewind(at);
                let m = self.peek()?;
                Err(self.wrong(at, what, "array", m))
            }
        }
    }

    /// A string or binary's raw bytes (msgpack producers differ in which they use for text).
    pub(crate) fn str_bytes(&mut self, what: &'static str) -> Result<&'a [u8]> {
        let at = self.pos;
        let n = match self.marker()? {
            Marker::FixStr(n) => usize::from(n),
            Marker::Str8 | Marker::Bin8 => self.len8()?,
            Marker::Str16 | Marker::Bin16 => self.len16()?,
            Marker::Str32 | Marker::Bin32 => self.len32()?,
            m => return Err(self.wrong(at, what, "string", m)),
        };
        self.take(n)
    }

    /// An owned string (invalid UTF-8 replaced, never an error).
    pub(crate) fn string(&mut self, what: &'static str) -> Result<String> {
        Ok(String::from_utf8_lossy(self.str_bytes(what)?).into_owned())
    }

    /// Any integer, widened.
    pub(crate) fn int(&mut self, what: &'static str) -> Result<i128> {
        let at = self.pos;
        Ok(match self.marker()? {
            Marker::FixPos(v) => i128::from(v),
            Marker::FixNeg(v) => i128::from(v),
            Marker::U8 => i128::from(self.be::<1>()?[0]),
            Marker::U16 => i128::from(u16::from_be_bytes(self.be()?)),
            Marker::U32 => i128::from(u32::from_be_bytes(self.be()?)),
            Marker::U64 => i128::from(u64::from_be_bytes(self.be()?)),
            Marker::I8 => i128::from(i8::from_be_bytes(self.be()?)),
            Marker::I16 => i128::from(i16::from_be_bytes(self.be()?)),
            Marker::I32 => i128::from(i32::from_be_bytes(self.be()?)),
            Marker::I64 => i128::from(i64::from_be_bytes(self.be()?)),
            m => return Err(self.wrong(at, what, "integer", m)),
        })
    }

    /// An integer converted to `T`, or [`DecodeError::OutOfRange`].
    pub(crate) fn int_as<T: TryFrom<i128>>(&mut self, what: &'static str) -> Result<T> {
        let at = self.pos;
        let v = self.int(what)?;
        T::try_from(v).map_err(|_| DecodeError::OutOfRange { at, what })
    }

    /// A float (msgspec also accepts integers for float fields).
    pub(crate) fn float(&mut self, what: &'static str) -> Result<f64> {
        let at = self.pos;
        match self.peek()? {
            Marker::F64 => {
                self.pos += 1;
                Ok(f64::from_be_bytes(self.be()?))
            }
            Marker::F32 => {
                self.pos += 1;
                Ok(f64::from(f32::from_be_bytes(self.be()?)))
            }
            _ => {
                // Integers are far below 2^53 in practice; precision loss is acceptable.
                #[allow(clippy::cast_precision_loss)]
                let v = self.int(what).map_err(|_| DecodeError::WrongType {
                    at,
                    what,
                    expected: "float",
                    found: self
                        .buf
                        .get(at)
                        .map_or("eof", |b| marker_kind(Marker::from_u8(*b))),
                })? as f64;
                Ok(v)
            }
        }
    }

    /// An integer or binary block hash (see [`crate::BlockHash`] for the canonical form).
    pub(crate) fn hash(&mut self, what: &'static str) -> Result<crate::BlockHash> {
        let at = self.pos;
        match self.peek()? {
            Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => {
                let bytes = self.str_bytes(what)?;
                crate::BlockHash::from_be_slice(bytes).ok_or(DecodeError::HashTooLong {
                    at,
                    len: bytes.len(),
                })
            }
            _ => {
                let v = self.int(what)?;
                if let Ok(u) = u64::try_from(v) {
                    Ok(crate::BlockHash::from_u64(u))
                } else if let Ok(i) = i64::try_from(v) {
                    Ok(crate::BlockHash::from_i64(i))
                } else {
                    Err(DecodeError::OutOfRange { at, what })
                }
            }
        }
    }

    /// Skips one value of any type, iteratively.
    pub(crate) fn skip(&mut self) -> Result<()> {
        let mut pending: usize = 1;
        while pending > 0 {
            pending -= 1;
            let at = self.pos;
            let (data, children) = match self.marker()? {
                Marker::FixPos(_)
                | Marker::FixNeg(_)
                | Marker::Null
                | Marker::True
                | Marker::False => (0, 0),
                Marker::U8 | Marker::I8 => (1, 0),
                Marker::U16 | Marker::I16 => (2, 0),
                Marker::U32 | Marker::I32 | Marker::F32 => (4, 0),
                Marker::U64 | Marker::I64 | Marker::F64 => (8, 0),
                Marker::FixStr(n) => (usize::from(n), 0),
                Marker::Str8 | Marker::Bin8 => (self.len8()?, 0),
                Marker::Str16 | Marker::Bin16 => (self.len16()?, 0),
                Marker::Str32 | Marker::Bin32 => (self.len32()?, 0),
                Marker::FixExt1 => (2, 0),
                Marker::FixExt2 => (3, 0),
                Marker::FixExt4 => (5, 0),
                Marker::FixExt8 => (9, 0),
                Marker::FixExt16 => (17, 0),
                Marker::Ext8 => (self.len8()? + 1, 0),
                Marker::Ext16 => (self.len16()? + 1, 0),
                Marker::Ext32 => (self.len32()?.saturating_add(1), 0),
                Marker::FixArray(n) => (0, usize::from(n)),
                Marker::Array16 => (0, self.len16()?),
                Marker::Array32 => (0, self.len32()?),
                Marker::FixMap(n) => (0, usize::from(n) * 2),
                Marker::Map16 => (0, self.len16()? * 2),
                Marker::Map32 => (0, self.len32()?.saturating_mul(2)),
                Marker::Reserved => return Err(DecodeError::InvalidMarker { at }),
            };
            self.take(data)?;
            pending = pending.saturating_add(children);
            if pending > self.remaining() {
                return Err(DecodeError::LengthTooLarge { at });
            }
        }
        Ok(())
    }
}

/// What [`Reader::array_or_map`] found, with its length (entries for a map).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Container {
    Array(usize),
    Map(usize),
}

/// A short name of a marker's type, for error messages.
pub(crate) fn marker_kind(m: Marker) -> &'static str {
    match m {
        Marker::FixPos(_) | Marker::U8 | Marker::U16 | Marker::U32 | Marker::U64 => "uint",
        Marker::FixNeg(_) | Marker::I8 | Marker::I16 | Marker::I32 | Marker::I64 => "int",
        Marker::Null => "nil",
        Marker::True | Marker::False => "bool",
        Marker::F32 | Marker::F64 => "float",
        Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => "str",
        Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => "bin",
        Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => "array",
        Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => "map",
        Marker::Reserved => "reserved",
        _ => "ext",
    }
}

/// Appends msgpack values to a `Vec`, smallest representation first (msgspec's choices).
pub(crate) struct Writer<'a>(pub(crate) &'a mut Vec<u8>);

impl Writer<'_> {
    pub(crate) fn nil(&mut self) {
        self.0.push(0xc0);
    }

    pub(crate) fn uint(&mut self, v: u64) {
        if v < 0x80 {
            self.0.push(v as u8);
        } else if let Ok(v) = u8::try_from(v) {
            self.0.extend_from_slice(&[0xcc, v]);
        } else if let Ok(v) = u16::try_from(v) {
            self.0.push(0xcd);
            self.0.extend_from_slice(&v.to_be_bytes());
        } else if let Ok(v) = u32::try_from(v) {
            self.0.push(0xce);
            self.0.extend_from_slice(&v.to_be_bytes());
        } else {
            self.0.push(0xcf);
            self.0.extend_from_slice(&v.to_be_bytes());
        }
    }

    /// Non-negative values are written as unsigned, as msgspec does.
    pub(crate) fn sint(&mut self, v: i64) {
        if let Ok(u) = u64::try_from(v) {
            return self.uint(u);
        }
        if v >= -32 {
            self.0.push(v as u8);
        } else if let Ok(v) = i8::try_from(v) {
            self.0.push(0xd0);
            self.0.extend_from_slice(&v.to_be_bytes());
        } else if let Ok(v) = i16::try_from(v) {
            self.0.push(0xd1);
            self.0.extend_from_slice(&v.to_be_bytes());
        } else if let Ok(v) = i32::try_from(v) {
            self.0.push(0xd2);
            self.0.extend_from_slice(&v.to_be_bytes());
        } else {
            self.0.push(0xd3);
            self.0.extend_from_slice(&v.to_be_bytes());
        }
    }

    pub(crate) fn f64(&mut self, v: f64) {
        self.0.push(0xcb);
        self.0.extend_from_slice(&v.to_be_bytes());
    }

    fn len_header(
        &mut self,
        len: usize,
        fix: Option<(u8, usize)>,
        m8: Option<u8>,
        m16: u8,
        m32: u8,
    ) {
        if let Some((base, max)) = fix {
            if len < max {
                self.0.push(base | len as u8);
                return;
            }
        }
        if let (Some(m8), Ok(l)) = (m8, u8::try_from(len)) {
            self.0.extend_from_slice(&[m8, l]);
        } else if let Ok(l) = u16::try_from(len) {
            self.0.push(m16);
            self.0.extend_from_slice(&l.to_be_bytes());
        } else {
            // Lengths past u32 cannot be represented in msgpack; nothing here comes near.
            self.0.push(m32);
            self.0
                .extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes());
        }
    }

    pub(crate) fn str(&mut self, s: &str) {
        self.len_header(s.len(), Some((0xa0, 32)), Some(0xd9), 0xda, 0xdb);
        self.0.extend_from_slice(s.as_bytes());
    }

    pub(crate) fn bin(&mut self, b: &[u8]) {
        self.len_header(b.len(), None, Some(0xc4), 0xc5, 0xc6);
        self.0.extend_from_slice(b);
    }

    pub(crate) fn array(&mut self, len: usize) {
        self.len_header(len, Some((0x90, 16)), None, 0xdc, 0xdd);
    }

    pub(crate) fn map(&mut self, len: usize) {
        self.len_header(len, Some((0x80, 16)), None, 0xde, 0xdf);
    }
}
