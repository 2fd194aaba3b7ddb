"""The worker's appends: one ``append_many`` in flight, decisions queued behind it in order,
the loop not waiting for an append unless too much is queued, errors not lost."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from log import Draft, Position
from schemas import events as ev
from tests.unit.workers.test_cache_manager_replay import worker
from workers import cache_manager
from workers.cache_manager import CacheManagerWorker

pytestmark = pytest.mark.unit


def drafts(*names: str) -> list[Draft]:
    body = ev.CacheDecisionMade(
        engine_id="e", action=ev.CacheAction.RELEASE, ttl_ms=None, score=0.0, next_reference_ms=None, num_blocks=1,
        reason="r",
    )  # fmt: skip
    return [Draft("s", body, name) for name in names]


class Appends:
    """Stands in for the broker's acknowledgement: each append waits until released."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.release: list[asyncio.Future[None]] = []

    async def append_many(self, batch: Sequence[Draft]) -> list[Position]:
        self.calls.append([str(d.event_id) for d in batch])
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.release.append(done)
        try:
            await done
        finally:
            self.in_flight -= 1
        return []


def queue(w: CacheManagerWorker, names: list[str]) -> None:
    w._queued.extend(drafts(*names))
    w._queued_ready.extend(0.0 for _ in names)


def test_decisions_queue_behind_the_append_in_flight_and_go_in_order() -> None:
    async def scenario() -> Appends:
        w, appends = worker(), Appends()
        w.log.append_many = appends.append_many  # type: ignore[method-assign]
        queue(w, ["a1", "a2"])
        await w._pump()  # starts the first append
        await asyncio.sleep(0)
        for names in (["b1"], ["c1", "c2"]):
            queue(w, names)
            await w._pump()  # the first append has not landed: nothing waits, nothing starts
        assert appends.calls == [["a1", "a2"]]
        appends.release[0].set_result(None)
        await asyncio.sleep(0)
        await w._pump()  # the first landed: the next takes everything queued, in order
        await asyncio.sleep(0)
        assert appends.calls == [["a1", "a2"], ["b1", "c1", "c2"]]
        flushing = asyncio.ensure_future(w._flush_appends())
        await asyncio.sleep(0)
        assert not flushing.done()  # a commit waits for the append in flight
        appends.release[1].set_result(None)
        await flushing
        assert w.stats.num_appended == 5
        return appends

    appends = asyncio.run(scenario())
    assert appends.most_in_flight == 1


def test_the_loop_waits_for_the_append_when_too_much_is_queued(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache_manager, "MAX_QUEUED_DECISIONS", 3)

    async def scenario() -> None:
        w, appends = worker(), Appends()
        w.log.append_many = appends.append_many  # type: ignore[method-assign]
        queue(w, ["a"])
        await w._pump()
        queue(w, ["b", "c", "d"])
        pumping = asyncio.ensure_future(w._pump())
        await asyncio.sleep(0)
        assert not pumping.done()  # 3 queued: it waits for "a" to land
        appends.release[0].set_result(None)
        await pumping
        assert appends.calls[-1] == ["b", "c", "d"]
        appends.release[1].set_result(None)
        await w._flush_appends()

    asyncio.run(scenario())


def test_an_append_that_fails_raises_at_the_next_pump() -> None:
    async def scenario() -> None:
        w = worker()

        async def failing(batch: Sequence[Draft]) -> list[Position]:
            raise RuntimeError("broker gone")

        w.log.append_many = failing  # type: ignore[method-assign]
        queue(w, ["a"])
        await w._pump()
        await asyncio.sleep(0)
        queue(w, ["b"])
        with pytest.raises(RuntimeError, match="broker gone"):
            await w._pump()
        assert [str(d.event_id) for d in w._queued] == ["b"]  # not handed to a dead append

    asyncio.run(scenario())
