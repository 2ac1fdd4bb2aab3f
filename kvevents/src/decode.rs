//! Decoding a msgpack payload into an [`EventBatch`]: every shape vLLM and SGLang publish.
//!
//! Accepted shapes (each one checked against vLLM's `vllm/distributed/kv_events.py`):
//! - the batch as a positional array `[ts, events, data_parallel_rank?, ...]` (msgspec
//!   `array_like=True`, older servers) or as a map `{"ts", "events", "data_parallel_rank"?}`
//!   (current servers, which dropped `array_like`);
//! - each event as a tagged array `["BlockStored", field, ...]` or a map with key `"type"`
//!   (msgspec `tag=True`; the tag is the class name);
//! - trailing fields absent (msgspec `omit_defaults` drops trailing defaults in array form and
//!   every default field in map form), unknown extra fields (skipped), unknown event types
//!   (decoded as [`KvEvent::Unknown`]).

use crate::msgpack::{Container, Reader, Result};
use crate::{BlockHash, DecodeError, EventBatch, KvEvent, Medium};

/// Decodes one batch payload (the third ZMQ frame).
///
/// Total: any input gives a batch or a [`DecodeError`], never a panic, and the work is linear
/// in the payload's size.
pub fn decode_batch(payload: &[u8]) -> std::result::Result<EventBatch, DecodeError> {
    let mut r = Reader::new(payload);
    let at = r.pos();
    let batch = match r.array_or_map("batch")? {
        Container::Array(n) => positional_batch(&mut r, n, at)?,
        Container::Map(n) => keyed_batch(&mut r, n, at)?,
    };
    match r.remaining() {
        0 => Ok(batch),
        extra => Err(DecodeError::TrailingBytes { extra }),
    }
}

fn missing(at: usize, what: &'static str, field: &'static str) -> DecodeError {
    DecodeError::MissingField { at, what, field }
}

fn positional_batch(r: &mut Reader<'_>, n: usize, at: usize) -> Result<EventBatch> {
    if n < 2 {
        return Err(missing(at, "batch", if n == 0 { "ts" } else { "events" }));
    }
    let ts = r.float("ts")?;
    let events = events(r)?;
    let data_parallel_rank = if n >= 3 {
        opt_i64(r, "data_parallel_rank")?
    } else {
        None
    };
    for _ in 3..n {
        r.skip()?;
    }
    Ok(EventBatch {
        ts,
        events,
        data_parallel_rank,
    })
}

fn keyed_batch(r: &mut Reader<'_>, n: usize, at: usize) -> Result<EventBatch> {
    let (mut ts, mut evs, mut dp) = (None, None, None);
    for _ in 0..n {
        match r.str_bytes("batch key")? {
            b"ts" => ts = Some(r.float("ts")?),
            b"events" => evs = Some(events(r)?),
            b"data_parallel_rank" => dp = opt_i64(r, "data_parallel_rank")?,
            _ => r.skip()?,
        }
    }
    Ok(EventBatch {
        ts: ts.ok_or(missing(at, "batch", "ts"))?,
        events: evs.ok_or(missing(at, "batch", "events"))?,
        data_parallel_rank: dp,
    })
}

/// Capacity hint for a declared length: declared lengths are bounded by the payload already,
/// and this keeps a hostile one from reserving much more than the payload's own size.
fn cap(n: usize) -> usize {
    n.min(1 << 14)
}

/// An array whose items `item` reads.
fn list<'a, T>(
    r: &mut Reader<'a>,
    what: &'static str,
    mut item: impl FnMut(&mut Reader<'a>) -> Result<T>,
) -> Result<Vec<T>> {
    let n = r.array_len(what)?;
    let mut out = Vec::with_capacity(cap(n));
    for _ in 0..n {
        out.push(item(r)?);
    }
    Ok(out)
}

/// A value that `nil` leaves out.
fn nullable<'a, T>(
    r: &mut Reader<'a>,
    read: impl FnOnce(&mut Reader<'a>) -> Result<T>,
) -> Result<Option<T>> {
    if r.eat_nil()? {
        Ok(None)
    } else {
        read(r).map(Some)
    }
}

fn events(r: &mut Reader<'_>) -> Result<Vec<KvEvent>> {
    list(r, "events", event)
}

fn opt_i64(r: &mut Reader<'_>, what: &'static str) -> Result<Option<i64>> {
    nullable(r, |r| r.int_as(what))
}

#[derive(Debug, Clone, PartialEq)]
enum Kind {
    Stored,
    Removed,
    Cleared,
    Unknown(String),
}

impl Kind {
    fn from_tag(tag: &[u8]) -> Self {
        match tag {
            b"BlockStored" => Self::Stored,
            b"BlockRemoved" => Self::Removed,
            b"AllBlocksCleared" => Self::Cleared,
            other => Self::Unknown(String::from_utf8_lossy(other).into_owned()),
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Self::Stored => "BlockStored",
            Self::Removed => "BlockRemoved",
            Self::Cleared => "AllBlocksCleared",
            Self::Unknown(_) => "event",
        }
    }
}

/// The fields this crate reads; anything else is skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    BlockHashes,
    Parent,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    GroupIdx,
    Skip,
}

/// vLLM's `BlockStored` field order (after the tag); `extra_keys` is skipped.
const STORED_ORDER: [Field; 9] = [
    Field::BlockHashes,
    Field::Parent,
    Field::TokenIds,
    Field::BlockSize,
    Field::LoraId,
    Field::Medium,
    Field::LoraName,
    Field::Skip,
    Field::GroupIdx,
];

/// vLLM's `BlockRemoved` field order (after the tag).
const REMOVED_ORDER: [Field; 3] = [Field::BlockHashes, Field::Medium, Field::GroupIdx];

fn field_by_name(name: &[u8]) -> Field {
    match name {
        b"block_hashes" => Field::BlockHashes,
        b"parent_block_hash" => Field::Parent,
        b"token_ids" => Field::TokenIds,
        b"block_size" => Field::BlockSize,
        b"lora_id" => Field::LoraId,
        b"medium" => Field::Medium,
        b"lora_name" => Field::LoraName,
        b"group_idx" => Field::GroupIdx,
        _ => Field::Skip,
    }
}

#[derive(Default)]
struct Fields {
    block_hashes: Option<Vec<BlockHash>>,
    parent: Option<BlockHash>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u32>,
    lora_id: Option<i64>,
    medium: Option<Medium>,
    lora_name: Option<String>,
    group_idx: Option<i64>,
}

impl Fields {
    fn read(&mut self, r: &mut Reader<'_>, field: Field) -> Result<()> {
        match field {
            Field::BlockHashes => {
                self.block_hashes = Some(list(r, "block_hashes", |r| r.hash("block_hashes"))?);
            }
            Field::Parent => self.parent = nullable(r, |r| r.hash("parent_block_hash"))?,
            Field::TokenIds => {
                self.token_ids = Some(list(r, "token_ids", |r| r.int_as("token_ids"))?);
            }
            Field::BlockSize => self.block_size = Some(r.int_as("block_size")?),
            Field::LoraId => self.lora_id = opt_i64(r, "lora_id")?,
            Field::Medium => self.medium = nullable(r, |r| r.str_bytes("medium").map(medium))?,
            Field::LoraName => self.lora_name = nullable(r, |r| r.string("lora_name"))?,
            Field::GroupIdx => self.group_idx = opt_i64(r, "group_idx")?,
            Field::Skip => r.skip()?,
        }
        Ok(())
    }

    fn build(self, kind: Kind, at: usize) -> Result<KvEvent> {
        let what = kind.name();
        Ok(match kind {
            Kind::Stored => KvEvent::BlockStored {
                block_hashes: self.block_hashes.ok_or(missing(at, what, "block_hashes"))?,
                parent_block_hash: self.parent,
                token_ids: self.token_ids.ok_or(missing(at, what, "token_ids"))?,
                block_size: self.block_size.ok_or(missing(at, what, "block_size"))?,
                lora_id: self.lora_id,
                medium: self.medium.unwrap_or(Medium::Gpu),
                lora_name: self.lora_name,
                group_idx: self.group_idx,
            },
            Kind::Removed => KvEvent::BlockRemoved {
                block_hashes: self.block_hashes.ok_or(missing(at, what, "block_hashes"))?,
                medium: self.medium.unwrap_or(Medium::Gpu),
                group_idx: self.group_idx,
            },
            Kind::Cleared => KvEvent::AllBlocksCleared,
            Kind::Unknown(type_name) => KvEvent::Unknown { type_name },
        })
    }
}

fn medium(raw: &[u8]) -> Medium {
    match std::str::from_utf8(raw) {
        Ok(s) => Medium::from_wire(s),
        Err(_) => Medium::Other(String::from_utf8_lossy(raw).into_owned()),
    }
}

fn event(r: &mut Reader<'_>) -> Result<KvEvent> {
    let at = r.pos();
    match r.array_or_map("event")? {
        Container::Array(0) => Err(missing(at, "event", "type")),
        Container::Array(n) => {
            let kind = Kind::from_tag(r.str_bytes("event type")?);
            let order: &[Field] = match kind {
                Kind::Stored => &STORED_ORDER,
                Kind::Removed => &REMOVED_ORDER,
                Kind::Cleared | Kind::Unknown(_) => &[],
            };
            let mut fields = Fields::default();
            for i in 0..n - 1 {
                fields.read(r, order.get(i).copied().unwrap_or(Field::Skip))?;
            }
            fields.build(kind, at)
        }
        Container::Map(n) => keyed_event(r, n, at),
    }
}

fn keyed_event(r: &mut Reader<'_>, n: usize, at: usize) -> Result<KvEvent> {
    let body = r.pos();
    // msgspec writes the tag first; any other position costs one extra scan.
    let kind = match find_tag(r, n)? {
        Some(kind) => kind,
        None => return Err(missing(at, "event", "type")),
    };
    r.rewind(body);
    let mut fields = Fields::default();
    let known = !matches!(kind, Kind::Unknown(_));
    for _ in 0..n {
        let key = r.str_bytes("event key")?;
        let field = if known && key != b"type" {
            field_by_name(key)
        } else {
            Field::Skip
        };
        fields.read(r, field)?;
    }
    fields.build(kind, at)
}

/// Scans a map's entries for the `"type"` tag, leaving the reader after the last entry read.
fn find_tag(r: &mut Reader<'_>, n: usize) -> Result<Option<Kind>> {
    for _ in 0..n {
        if r.str_bytes("event key")? == b"type" {
            return Ok(Some(Kind::from_tag(r.str_bytes("event type")?)));
        }
        r.skip()?;
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_without_panicking() {
        for bad in [
            &[][..],
            &[0xc1],
            &[0x92, 0xcb],
            &[0x91, 0x00],
            &[0xdd, 0xff, 0xff, 0xff, 0xff],
            &[0x92, 0x00, 0x91, 0x90],
            &[0x92, 0x00, 0x90, 0x00],
        ] {
            assert!(decode_batch(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn empty_batch() {
        let batch = decode_batch(&[0x92, 0x01, 0x90]);
        assert_eq!(
            batch,
            Ok(EventBatch {
                ts: 1.0,
                events: vec![],
                data_parallel_rank: None
            })
        );
    }
}
