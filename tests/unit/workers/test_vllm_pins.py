"""The pin table's release order and expiry (pure; the scheduler inside vLLM uses it)."""

from __future__ import annotations

import pytest

from workers.engines.vllm.pins import Pin, PinTable

pytestmark = pytest.mark.unit


def table(*pins: Pin[int]) -> PinTable[int]:
    t: PinTable[int] = PinTable()
    for pin in pins:
        assert t.put(pin) is None
    return t


def test_victims_go_lowest_score_first_then_soonest_expiry_then_session_id() -> None:
    t = table(
        Pin("c", [1], expires_at=10, score=2.0),
        Pin("b", [2], expires_at=20, score=1.0),
        Pin("a", [3], expires_at=20, score=1.0),
        Pin("d", [4], expires_at=5, score=1.0),
        Pin("grace", [5], expires_at=99),  # not scored by the cache manager yet: 0
    )
    assert [p.session_id for p in t.victims()] == ["grace", "d", "a", "b", "c"]
    assert [p.session_id for p in t.victims(exclude=["grace", "a"])] == ["d", "b", "c"]


def test_put_returns_the_replaced_pin_and_renew_changes_ttl_and_score() -> None:
    t = table(Pin("a", [1, 2], expires_at=10, score=1.0))
    old = t.put(Pin("a", [1, 2, 3], expires_at=20, score=1.0))
    assert old is not None and old.blocks == [1, 2]
    assert t.num_blocks == 3
    assert t.renew("a", expires_at=50, score=7.0) is not None
    assert (t.pins["a"].expires_at, t.pins["a"].score) == (50, 7.0)
    assert t.renew("nobody", expires_at=1, score=1) is None


def test_pop_expired_takes_exactly_the_pins_at_or_past_their_ttl() -> None:
    t = table(Pin("a", [1], expires_at=10), Pin("b", [2], expires_at=11), Pin("c", [3], expires_at=12))
    assert [p.session_id for p in t.pop_expired(11)] == ["a", "b"]
    assert list(t.pins) == ["c"] and len(t) == 1
    assert t.pop_expired(11) == []


def test_victims_below_a_rank_leave_the_pins_of_programs_that_outrank_it() -> None:
    t = table(
        Pin("early", [1], expires_at=10, score=0.0, rank=100),
        Pin("late", [2], expires_at=10, score=5.0, rank=300),
        Pin("same", [3], expires_at=10, score=1.0, rank=200),
        Pin("unranked", [4], expires_at=10, score=9.0),
    )
    # A request of priority 200 may take what ranks after it or with it, and unranked pins; never
    # "early", whose program is ahead of it.
    assert [p.session_id for p in t.victims(below=200)] == ["same", "late", "unranked"]
    assert [p.session_id for p in t.victims()] == ["early", "same", "late", "unranked"]


def test_victims_by_rank_go_in_the_programs_order_the_program_ranked_last_first() -> None:
    t = table(
        Pin("early", [1], expires_at=10, score=0.0, rank=100),
        Pin("late", [2], expires_at=10, score=5.0, rank=300),
        Pin("same", [3], expires_at=10, score=1.0, rank=200),
        Pin("also-late", [5], expires_at=9, score=7.0, rank=300),
        Pin("unranked", [4], expires_at=10, score=9.0),
    )
    # Unranked pins first (no program claims them), then the latest program's; the score and the
    # expiry break ties between pins of the same rank.
    order = ["unranked", "late", "also-late", "same", "early"]
    assert [p.session_id for p in t.victims(by_rank=True)] == order
    assert [p.session_id for p in t.victims(below=200, by_rank=True)] == order[:-1]
