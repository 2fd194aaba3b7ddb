"""The worker skeleton's lifecycle on a real log (Postgres): ``run()`` returns only when
drained and committed, ``shutdown()`` is idempotent, ``async with`` runs and stops a
worker, and a task running alongside the loop stops it (its error raised by ``run()``)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest

from cli.common import init_log
from log import LoggedEvent, SharedLog, open_log
from schemas import events as ev
from workers.worker import Worker

pytestmark = pytest.mark.integration

TOPICS = ("agent.actions",)


class Holding(Worker):
    """Spawns one task per event that finishes only when ``release`` is set."""

    role = "planner"
    topics = TOPICS

    def __init__(self, log: SharedLog) -> None:
        super().__init__(log, group=f"skeleton-{uuid.uuid4().hex[:6]}", poll_timeout_s=0.1)
        self.release = asyncio.Event()
        self.num_seen = 0
        self.num_done = 0

    async def handle(self, events: list[LoggedEvent]) -> None:
        for _ in events:
            self.num_seen += 1
            self.spawn(self._work())

    async def _work(self) -> None:
        await self.release.wait()
        self.num_done += 1


async def until(check: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def opened(pg_url: str, namespace: str, num_events: int) -> AsyncIterator[SharedLog]:
    await init_log(pg_url, 2, namespace=namespace)
    async with open_log(pg_url, actor="planner", namespace=namespace) as log:
        for i in range(num_events):
            await log.append(f"s-{i}", ev.SessionStarted(program="script", args_json="{}"))
        yield log


async def unread(log: SharedLog, group: str) -> int:
    """Records a member of ``group`` that resumes from its committed offsets still gets."""
    async with log.consumer(group, list(TOPICS)) as consumer:
        got = 0
        for _ in range(5):
            got += len(await consumer.poll(timeout_s=0.2))
        return got


def test_run_returns_only_when_drained_and_committed(pg_url: str, namespace: str) -> None:
    async def scenario() -> None:
        async with opened(pg_url, namespace, 6) as log:
            worker = Holding(log)
            running = asyncio.create_task(worker.run())
            await until(lambda: worker.num_seen == 6, "every event handled")
            worker.shutdown()
            worker.shutdown()  # idempotent
            await asyncio.sleep(0.3)
            assert not running.done()  # six tasks still in flight
            worker.release.set()
            await running
            assert worker.num_done == 6
            assert await unread(log, worker.group) == 0  # committed when it stopped
            with pytest.raises(RuntimeError, match="called already"):
                await worker.run()

    asyncio.run(scenario())


def test_async_with_runs_the_worker_and_stops_it_drained(pg_url: str, namespace: str) -> None:
    async def scenario() -> None:
        async with opened(pg_url, namespace, 3) as log:
            worker = Holding(log)
            worker.release.set()
            async with worker:
                await until(lambda: worker.num_done == 3, "every event's task done")
            assert worker.stopping and not worker._tasks
            assert await unread(log, worker.group) == 0

    asyncio.run(scenario())


class WithSideInput(Holding):
    def __init__(self, log: SharedLog, side: Callable[[], Coroutine[Any, Any, None]]) -> None:
        super().__init__(log)
        self.side = side

    async def prepare(self) -> None:
        self.alongside(self.side(), name="side")


def test_a_task_alongside_that_fails_stops_the_worker_with_its_error(pg_url: str, namespace: str) -> None:
    async def fails() -> None:
        await asyncio.sleep(0.3)
        raise ConnectionError("engine gone")

    async def scenario() -> None:
        async with opened(pg_url, namespace, 1) as log:
            worker = WithSideInput(log, fails)
            with pytest.raises(ConnectionError, match="engine gone"):
                await asyncio.wait_for(worker.run(), timeout=30)

    asyncio.run(scenario())


def test_a_task_alongside_that_ends_shuts_the_worker_down(pg_url: str, namespace: str) -> None:
    async def ends() -> None:
        await asyncio.sleep(0.3)

    async def scenario() -> None:
        async with opened(pg_url, namespace, 2) as log:
            worker = WithSideInput(log, ends)
            worker.release.set()
            await asyncio.wait_for(worker.run(), timeout=30)
            assert worker.stopping

    asyncio.run(scenario())
