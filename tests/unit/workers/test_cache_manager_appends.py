"""The worker's appends: one ``append_many`` in flight, decisions queued behind it in order,
the loop not waiting for an append unless too much is queued, errors not lost.

The log is the in-memory one, whose acknowledgements the test releases (``HeldBackend``):
each append goes through the real ``SharedLog`` and lands when released."""

from __future__ import annotations

import asyncio

import pytest

from log import Draft
from schemas import events as ev
from tests.unit.log.held_backend import HeldBackend
from tests.unit.workers.test_cache_manager_replay import worker
from workers import cache_manager
from workers.cache_manager import CacheManagerWorker

pytestmark = pytest.mark.unit

DECISIONS = "kv.decisions"


def drafts(*names: str) -> list[Draft]:
    body = ev.CacheDecisionMade(
        engine_id="e", action=ev.CacheAction.RELEASE, ttl_ms=None, score=0.0, next_reference_ms=None, num_blocks=1,
        reason="r",
    )  # fmt: skip
    return [Draft("s", body, name) for name in names]


def held_worker() -> tuple[CacheManagerWorker, HeldBackend]:
    """A worker whose appends each wait until the test releases them (the broker's acknowledgement)."""
    backend = HeldBackend()
    w = worker(backend=backend)
    backend.hold = True
    return w, backend


def queue(w: CacheManagerWorker, names: list[str]) -> None:
    w._queued.extend(drafts(*names))
    w._queued_ready.extend(0.0 for _ in names)


def test_decisions_queue_behind_the_append_in_flight_and_go_in_order() -> None:
    w, backend = held_worker()

    async def scenario() -> None:
        queue(w, ["a1", "a2"])
        await w._pump()  # starts the first append
        await asyncio.sleep(0)
        for names in (["b1"], ["c1", "c2"]):
            queue(w, names)
            await w._pump()  # the first append has not landed: nothing waits, nothing starts
        assert backend.event_ids() == [["a1", "a2"]]
        backend.release()
        await asyncio.sleep(0)
        await w._pump()  # the first landed: the next takes everything queued, in order
        await asyncio.sleep(0)
        assert backend.event_ids() == [["a1", "a2"], ["b1", "c1", "c2"]]
        flushing = asyncio.ensure_future(w._flush_appends())
        await asyncio.sleep(0)
        assert not flushing.done()  # a commit waits for the append in flight
        backend.release()
        await flushing
        assert w.stats.num_appended == 5

    asyncio.run(scenario())
    assert backend.most_held == 1
    assert [w.log.decode(r).event_id for r in backend.records(DECISIONS)] == ["a1", "a2", "b1", "c1", "c2"]


def test_the_loop_waits_for_the_append_when_too_much_is_queued(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache_manager, "MAX_QUEUED_DECISIONS", 3)
    w, backend = held_worker()

    async def scenario() -> None:
        queue(w, ["a"])
        await w._pump()
        queue(w, ["b", "c", "d"])
        pumping = asyncio.ensure_future(w._pump())
        await asyncio.sleep(0)
        assert not pumping.done()  # 3 queued: it waits for "a" to land
        backend.release()
        await pumping
        assert backend.event_ids()[-1] == ["b", "c", "d"]
        backend.release()
        await w._flush_appends()

    asyncio.run(scenario())


def test_an_append_that_fails_raises_at_the_next_pump() -> None:
    w, backend = held_worker()

    async def scenario() -> None:
        backend.refuse = RuntimeError("broker gone")
        queue(w, ["a"])
        await w._pump()
        await asyncio.sleep(0)
        queue(w, ["b"])
        with pytest.raises(RuntimeError, match="broker gone"):
            await w._pump()
        assert [str(d.event_id) for d in w._queued] == ["b"]  # not handed to a dead append

    asyncio.run(scenario())
