#!/usr/bin/env python3
"""Generates the KV-event msgpack fixtures in this folder with msgspec, the encoder vLLM uses.

    pip install msgspec      # tested with msgspec 0.23.0
    python3 testdata/kvevents/gen_fixtures.py

The struct definitions below mirror vllm/distributed/kv_events.py: same class names (the msgspec
tag), same field names, field order, defaults and struct options (`tag=True`,
`omit_defaults=True`, and `array_like=True` for the older array form). Fields that newer servers
add (vLLM 0.33: locality, ownership, session_id, lookahead_token_ids) are declared after vLLM's
own fields so that the decoder must skip them. Each fixture is described in README.md; the Rust
test `kvevents/tests/fixtures.rs` asserts the exact decoded values.
"""

from __future__ import annotations

import pathlib
from typing import Any

import msgspec

OUT = pathlib.Path(__file__).resolve().parent

BlockHash = bytes | int


def struct_family(array_like: bool, extra: bool, map_batch: bool = False):
    """vLLM's event classes: events as arrays (`array_like`, older servers) or maps (current).

    The batch is positional (`array_like=True`, as in vLLM 0.28 and later) unless `map_batch`
    (vLLM's main branch at one point dropped `array_like` from the batch as well). msgspec
    ignores `omit_defaults` for array-like structs: every field is written, defaults as nil.
    """
    opts = dict(omit_defaults=True, gc=False)

    class EventBatch(msgspec.Struct, array_like=not map_batch, **opts):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, tag=True, array_like=array_like, **opts):
        pass

    if extra:

        class BlockStored(KVCacheEvent):
            block_hashes: list[BlockHash]
            parent_block_hash: BlockHash | None
            token_ids: list[int]
            block_size: int
            lora_id: int | None
            medium: str | None
            lora_name: str | None
            extra_keys: list[tuple[Any, ...] | None] | None = None
            group_idx: int | None = None
            kv_cache_spec_kind: str | None = None
            kv_cache_spec_sliding_window: int | None = None
            locality: str | None = None
            ownership: str | None = None
            session_id: str | None = None
            lookahead_token_ids: list[int] | None = None

        class BlockRemoved(KVCacheEvent):
            block_hashes: list[BlockHash]
            medium: str | None
            group_idx: int | None = None
            locality: str | None = None
            ownership: str | None = None

    else:
        # The layout kvoy's encoder reproduces byte for byte.

        class BlockStored(KVCacheEvent):
            block_hashes: list[BlockHash]
            parent_block_hash: BlockHash | None
            token_ids: list[int]
            block_size: int
            lora_id: int | None
            medium: str | None
            lora_name: str | None
            extra_keys: list[tuple[Any, ...] | None] | None = None
            group_idx: int | None = None

        class BlockRemoved(KVCacheEvent):
            block_hashes: list[BlockHash]
            medium: str | None
            group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class BlockPinned(KVCacheEvent):
        """An event type no decoder knows."""

        block_hashes: list[BlockHash]
        reason: str

    return EventBatch, BlockStored, BlockRemoved, AllBlocksCleared, BlockPinned


def oldest_family():
    """The first vLLM KV-event release: array-like, no medium, no data_parallel_rank."""
    opts = dict(omit_defaults=True, gc=False, array_like=True)

    class EventBatch(msgspec.Struct, **opts):
        ts: float
        events: list[Any]

    class KVCacheEvent(msgspec.Struct, tag=True, **opts):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]

    class AllBlocksCleared(KVCacheEvent):
        pass

    return EventBatch, BlockStored, BlockRemoved, AllBlocksCleared


def sha(n: int) -> bytes:
    """A deterministic 32-byte 'sha256' hash: bytes n, n+1, ... (mod 256)."""
    return bytes((n + i) % 256 for i in range(32))


TS = 1_700_000_000.5
TOKENS = list(range(1000, 1032))  # two blocks of 16
BIG = [2**64 - 1, 2**63, 12345]  # u64 beyond i64::MAX, and a small one


def write(name: str, obj: Any) -> None:
    data = msgspec.msgpack.encode(obj)
    (OUT / name).write_bytes(data)
    print(f"{name}: {len(data)} bytes")


def main() -> None:
    for form, array_like in (("map", False), ("array", True)):
        Batch, Stored, Removed, Cleared, Pinned = struct_family(array_like, extra=False)
        # Current vLLM defaults: 32-byte sha256 hashes as bin, medium GPU, rank 0.
        write(
            f"{form}_vllm_current.bin",
            Batch(
                ts=TS,
                events=[
                    Stored([sha(1), sha(2)], None, TOKENS, 16, None, "GPU", None),
                    Removed([sha(1)], "GPU"),
                    Cleared(),
                ],
                data_parallel_rank=0,
            ),
        )
        # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: u64 hashes (some above i64::MAX), LoRA, groups.
        write(
            f"{form}_u64_hashes.bin",
            Batch(
                ts=TS,
                events=[
                    Stored(BIG, 2**64 - 2, TOKENS[:16] * 3, 16, 3, "GPU", "adapter-a", group_idx=1),
                    Removed(BIG[:2], "CPU", group_idx=0),
                ],
                data_parallel_rank=2,
            ),
        )
        # An event type that no decoder knows, between known ones.
        write(
            f"{form}_unknown_event_type.bin",
            Batch(
                ts=TS,
                events=[
                    Removed([7], "GPU"),
                    Pinned([7, 8], "prefetch"),
                    Cleared(),
                ],
                data_parallel_rank=0,
            ),
        )

    # SGLang: signed 64-bit hashes (negative), array form, no data_parallel_rank.
    Batch, Stored, Removed, Cleared, _ = struct_family(True, extra=False)
    write(
        "array_sglang_i64.bin",
        Batch(
            ts=TS,
            events=[
                Stored([-1, -(2**63), 5], -42, TOKENS[:16] * 3, 16, None, "GPU", None),
                Removed([-1], "GPU"),
            ],
        ),
    )

    # Newer servers: fields the decoder does not know (kv_cache_spec_*, vLLM 0.33's locality,
    # ownership, session_id, lookahead_token_ids, extra_keys), in both forms.
    for form, array_like in (("map", False), ("array", True)):
        Batch, Stored, Removed, Cleared, _ = struct_family(array_like, extra=True)
        write(
            f"{form}_extra_fields.bin",
            Batch(
                ts=TS,
                events=[
                    Stored(
                        [sha(9)],
                        sha(8),
                        TOKENS[:16],
                        16,
                        None,
                        "STORAGE",
                        None,
                        extra_keys=[("lora-x", 7)],
                        group_idx=0,
                        kv_cache_spec_kind="full_attention",
                        kv_cache_spec_sliding_window=4096,
                        locality="local",
                        ownership="owner",
                        session_id="sess-1",
                        lookahead_token_ids=[1, 2, 3],
                    ),
                ],
                data_parallel_rank=1,
            ),
        )

    # The first release: trailing fields (medium, lora_name, ..., data_parallel_rank) absent.
    Batch, Stored, Removed, Cleared = oldest_family()
    write(
        "array_oldest.bin",
        Batch(
            ts=TS,
            events=[Stored([11, 12], 10, TOKENS, 16, None), Removed([11]), Cleared()],
        ),
    )

    # A map batch (no array_like on the batch either) without data_parallel_rank: msgspec
    # omits the default None from maps.
    Batch, Stored, Removed, Cleared, _ = struct_family(False, extra=False, map_batch=True)
    write("map_batch_no_dp_rank.bin", Batch(ts=TS, events=[Cleared()]))
    write(
        "map_batch.bin",
        Batch(ts=TS, events=[Removed([sha(3)], "GPU"), Cleared()], data_parallel_rank=3),
    )

    # Hand-ordered maps (plain dicts keep insertion order): "type" after the fields, and an
    # unknown batch-level key; the batch keys out of order too.
    write(
        "map_type_not_first.bin",
        {
            "events": [
                {
                    "block_hashes": [21],
                    "parent_block_hash": None,
                    "token_ids": TOKENS[:16],
                    "block_size": 16,
                    "medium": "GPU",
                    "type": "BlockStored",
                },
                {"medium": None, "block_hashes": [21], "type": "BlockRemoved"},
            ],
            "producer": "hand-built",
            "ts": TS,
        },
    )


if __name__ == "__main__":
    main()
