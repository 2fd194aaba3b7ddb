"""Decoding vLLM's KV event batches (its msgpack wire format) into log events, without vllm."""

from __future__ import annotations

import collections

import msgspec
import pytest

from schemas.events import KVAllBlocksCleared, KVBlocksRemoved, KVBlocksStored, KVTier
from workers.engine_bridge.vllm import SessionMap, VllmKVSource, _Raw, decode_batch, parse_topic

pytestmark = pytest.mark.unit


def stored(hashes: list[int], session: str | None, parent: int | None = None) -> dict[str, object]:
    # The shape vLLM 0.32 sends (msgspec tagged struct: a map with "type"), extra fields included.
    return {
        "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
        "token_ids": list(range(32 * len(hashes))), "block_size": 32, "lora_id": None, "medium": "GPU",
        "lora_name": None, "extra_keys": [None] * len(hashes), "group_idx": 0, "session_id": session,
    }  # fmt: skip


def batch(*events: object) -> bytes:
    return msgspec.msgpack.encode([1795962302.5, list(events), 0])


def test_stored_removed_and_cleared_become_log_events_of_their_sessions() -> None:
    sessions = SessionMap({})
    at, events = decode_batch(
        "vllm-0", batch(stored([1, 2], "a"), stored([1], "b"), stored([3], "b", parent=2), stored([9], None)), sessions
    )
    assert at == 1795962302.5
    assert [e.session_id for e in events] == ["a", "b", "b", "engine/vllm-0"]
    first = events[0].body
    assert isinstance(first, KVBlocksStored)
    assert first.block_hashes == ["0000000000000001", "0000000000000002"] and first.num_tokens == 64
    assert first.block_size == 32 and first.tier is KVTier.GPU and first.parent_block_hash is None
    assert isinstance(events[2].body, KVBlocksStored) and events[2].body.parent_block_hash == "0000000000000002"

    # Block 1 is held by a and b (b reused it): its removal is reported to both, in session order.
    _, removed = decode_batch(
        "vllm-0", batch({"type": "BlockRemoved", "block_hashes": [1, 3, 77], "medium": "GPU"}), sessions
    )
    assert [(e.session_id, e.body.block_hashes) for e in removed if isinstance(e.body, KVBlocksRemoved)] == [
        ("a", ["0000000000000001"]),
        ("b", ["0000000000000001", "0000000000000003"]),
        ("engine/vllm-0", ["000000000000004d"]),  # stored before the bridge could see it
    ]
    assert sessions.holders == {"0000000000000002": {"a"}}

    _, cleared = decode_batch("vllm-0", batch({"type": "AllBlocksCleared"}), sessions)
    assert [(e.session_id, type(e.body)) for e in cleared] == [("engine/vllm-0", KVAllBlocksCleared)]
    assert sessions.holders == {}


def test_bytes_hashes_are_hex_and_bad_payloads_are_refused() -> None:
    _, events = decode_batch("v", batch(stored([], "a") | {"block_hashes": [b"\x01\xff"]}), SessionMap({}))
    assert isinstance(events[0].body, KVBlocksStored) and events[0].body.block_hashes == ["01ff"]
    with pytest.raises(ValueError, match="not a vLLM KV event batch"):
        decode_batch("v", msgspec.msgpack.encode({"ts": 1}), SessionMap({}))


def test_the_epoch_rides_on_the_topic() -> None:
    assert parse_topic(b"kv@3f2a9c") == "3f2a9c"
    assert parse_topic(b"kv") == "-"  # a vLLM without agentlog's scheduler: one epoch


def test_unknown_event_types_are_counted_and_skipped() -> None:
    unknown: collections.Counter[str] = collections.Counter()
    sessions = SessionMap({})
    payload = batch({"type": "BlockPinned", "block_hashes": [5]}, stored([4], "a"), {"type": "BlockPinned"}, "junk")
    at, events = decode_batch("vllm-0", payload, sessions, unknown)
    assert at == 1795962302.5
    assert [(e.session_id, type(e.body)) for e in events] == [("a", KVBlocksStored)]
    assert unknown == {"BlockPinned": 2, "None": 1}
    assert sessions.holders == {"0000000000000004": {"a"}}


def test_a_batch_of_only_unknown_events_keeps_its_seq() -> None:
    source = VllmKVSource("vllm-0", "inproc://unused-events", "inproc://unused-replay")
    first = source._emit(_Raw("e1", 0, batch(stored([4], "a"))))
    skipped = source._emit(_Raw("e1", 1, batch({"type": "Mystery"})))
    after = source._emit(_Raw("e1", 2, batch(stored([6], "a"))))
    assert [(b.seq, len(b.events)) for b in (first, skipped, after)] == [(0, 1), (1, 0), (2, 1)]
    assert source.unknown_events == {"Mystery": 1}
