"""log.gc_tuning: a poll's decoded events are freed before the collector ever walks them."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from log import GC_THRESHOLDS, tune_gc
from log.codec import ZERO_HASH, Codec

pytestmark = pytest.mark.unit

POLL = 2000  # records per poll of bench.log_throughput's consumers


@pytest.fixture(autouse=True)
def _restore_thresholds() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


def one_poll(codec: Codec) -> list[bytes]:
    from bench.log_throughput import build_drafts

    at = datetime(2026, 12, 6, tzinfo=UTC)
    records, prev = [], ZERO_HASH
    for seq, draft in enumerate(build_drafts(POLL, num_sessions=1)):
        record, prev = codec.encode(
            event_id=draft.event_id or f"e-{seq}",
            session_id=draft.session_id,
            seq=seq,
            actor="planner",
            occurred_at=at,
            causation_id=None,
            prev_hash=prev,
            body=draft.body,
        )
        records.append(record)
    return records


def collections_while_decoding(codec: Codec, records: list[bytes]) -> list[int]:
    """Collections per generation while a poll is decoded and held, as a consumer holds it."""
    counts = [0, 0, 0]

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            counts[info["generation"]] += 1

    gc.collect()  # every generation's count starts at 0
    gc.callbacks.append(count)
    try:
        held = [codec.decode(record) for record in records]
    finally:
        gc.callbacks.remove(count)
    assert len(held) == len(records)
    return counts


def test_tune_gc_sets_the_thresholds() -> None:
    tune_gc()
    assert gc.get_threshold() == GC_THRESHOLDS


def test_a_polls_events_fit_in_the_young_generation() -> None:
    codec = Codec()
    records = one_poll(codec)
    gc.set_threshold(700, 10, 10)  # CPython's default
    default = collections_while_decoding(codec, records)
    tune_gc()
    tuned = collections_while_decoding(codec, records)
    # With the default, a poll's events are walked while it is decoded; tuned, none is: each
    # record's objects must stay well under 50,000 / 2,000 = 25 tracked ones.
    assert default[0] > 0
    assert tuned == [0, 0, 0]
