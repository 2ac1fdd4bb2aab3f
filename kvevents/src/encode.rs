//! Encoding an [`EventBatch`] the way vLLM's msgspec encoder does (the simulator's side).

use crate::msgpack::Writer;
use crate::{BlockHash, EventBatch, KvEvent};

/// Which of vLLM's two event forms to produce.
///
/// In both, the batch is vLLM's positional `EventBatch` (msgspec `array_like=True`):
/// `[ts, events, data_parallel_rank]`, the rank `nil` when `None` (msgspec ignores
/// `omit_defaults` for array-like structs and writes every field).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WireForm {
    /// Current vLLM (events without `array_like`): each event is a map whose first key is
    /// `"type"`, then vLLM's fields in declaration order; fields holding their default
    /// (`group_idx: None`) are left out (`omit_defaults`).
    #[default]
    Map,
    /// Older vLLM (events with `array_like=True`): `["BlockStored", block_hashes,
    /// parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys,
    /// group_idx]` and `["BlockRemoved", block_hashes, medium, group_idx]`, every field written
    /// (`extra_keys` always `nil`, `group_idx` `nil` when `None`).
    Array,
}

/// Encodes a batch into a new buffer.
pub fn encode_batch(batch: &EventBatch, form: WireForm) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    encode_batch_into(batch, form, &mut out);
    out
}

/// Appends a batch's encoding to `out` (reuse one buffer across batches).
///
/// Values follow msgspec's choices byte for byte: the smallest integer representation
/// (non-negative values unsigned), `ts` as float64, the smallest string, binary, array and map
/// headers. Block hashes that fit a `u64` are written as integers, wider ones as 32-byte
/// binaries (see [`BlockHash`]). A `medium` is always written as its name.
pub fn encode_batch_into(batch: &EventBatch, form: WireForm, out: &mut Vec<u8>) {
    let mut w = Writer(out);
    w.array(3);
    w.f64(batch.ts);
    w.array(batch.events.len());
    for event in &batch.events {
        encode_event(&mut w, event, form);
    }
    opt_sint(&mut w, batch.data_parallel_rank);
}

/// Writes a field: its key first in map form.
fn key(w: &mut Writer<'_>, form: WireForm, name: &str) {
    if form == WireForm::Map {
        w.str(name);
    }
}

fn header(w: &mut Writer<'_>, form: WireForm, fields: usize, tag: &str) {
    match form {
        WireForm::Map => w.map(fields + 1),
        WireForm::Array => w.array(fields + 1),
    }
    key(w, form, "type");
    w.str(tag);
}

/// An event's field count (its tag aside): `map` named fields, plus `group_idx` when set (the
/// map form omits it when `None`), or every one of the `array` positional fields.
fn fields(form: WireForm, map: usize, array: usize, group_idx: Option<i64>) -> usize {
    match form {
        WireForm::Map => map + usize::from(group_idx.is_some()),
        WireForm::Array => array,
    }
}

/// `group_idx`, an event's last field: `nil` when `None` in the array form, left out in the
/// map form.
fn group_idx_last(w: &mut Writer<'_>, form: WireForm, group_idx: Option<i64>) {
    match (form, group_idx) {
        (WireForm::Array, g) => opt_sint(w, g),
        (WireForm::Map, Some(g)) => {
            key(w, form, "group_idx");
            w.sint(g);
        }
        (WireForm::Map, None) => {}
    }
}

fn hash(w: &mut Writer<'_>, h: &BlockHash) {
    match h.as_u64() {
        Some(v) => w.uint(v),
        None => w.bin(h.as_bytes()),
    }
}

fn opt_sint(w: &mut Writer<'_>, v: Option<i64>) {
    match v {
        Some(v) => w.sint(v),
        None => w.nil(),
    }
}

fn hashes(w: &mut Writer<'_>, hs: &[BlockHash]) {
    w.array(hs.len());
    hs.iter().for_each(|h| hash(w, h));
}

fn encode_event(w: &mut Writer<'_>, event: &KvEvent, form: WireForm) {
    match event {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id,
            medium,
            lora_name,
            group_idx,
        } => {
            header(w, form, fields(form, 7, 9, *group_idx), "BlockStored");
            key(w, form, "block_hashes");
            hashes(w, block_hashes);
            key(w, form, "parent_block_hash");
            match parent_block_hash {
                Some(h) => hash(w, h),
                None => w.nil(),
            }
            key(w, form, "token_ids");
            w.array(token_ids.len());
            token_ids.iter().for_each(|t| w.uint(u64::from(*t)));
            key(w, form, "block_size");
            w.uint(u64::from(*block_size));
            key(w, form, "lora_id");
            opt_sint(w, *lora_id);
            key(w, form, "medium");
            w.str(medium.as_str());
            key(w, form, "lora_name");
            match lora_name {
                Some(name) => w.str(name),
                None => w.nil(),
            }
            if form == WireForm::Array {
                w.nil(); // extra_keys
            }
            group_idx_last(w, form, *group_idx);
        }
        KvEvent::BlockRemoved {
            block_hashes,
            medium,
            group_idx,
        } => {
            header(w, form, fields(form, 2, 3, *group_idx), "BlockRemoved");
            key(w, form, "block_hashes");
            hashes(w, block_hashes);
            key(w, form, "medium");
            w.str(medium.as_str());
            group_idx_last(w, form, *group_idx);
        }
        KvEvent::AllBlocksCleared => header(w, form, 0, "AllBlocksCleared"),
        KvEvent::Unknown { type_name } => header(w, form, 0, type_name),
    }
}
