"""vLLM's ``--scheduling-policy priority`` serves agentlog's priorities: what the engine does with them.

On the ``dev_vllm`` server (conftest; not the shared one, which runs ``fcfs``), started with the
priority policy, ``--max-num-seqs 1`` (one request runs at a time, so the order
in which queued requests complete is the order vLLM admitted them) and vLLM's development
endpoints (``VLLM_SERVER_DEV_MODE=1``: ``/pause`` and ``/resume``).

**How the calls queue, whatever the machine's load.** Nothing here is timed. vLLM is paused with
``mode=keep`` (it schedules nothing until ``/resume``: a hold that cannot end on its own, unlike
long "blocker" calls, which at low load ended before the calls meant to queue behind them were
sent). The test's calls are sent one by one, each only after the scheduler's control channel
(``status``: vLLM's running and waiting queues) shows the previous one waiting, so they arrive
in the order sent, which is not their priorities' (first come first served would fail every
test). The test reads vLLM's own waiting queue (the order it will admit them) while nothing
runs, then resumes vLLM: the calls run one at a time (one slot, and a 48-block pool that holds
one 32-block call), so the order they complete in is the order vLLM served them.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import pytest

from log import open_log
from schemas import events as ev
from services.programs.base import Prompt, TokenRun
from services.scheduling import SchedulingConfig
from tests.integration.vllm.conftest import Vllm, VllmClient
from workers.engines.vllm.control import ControlClient
from workers.engines.vllm_http import VllmEngine
from workers.gateway import GatewayWorker

pytestmark = [pytest.mark.integration, pytest.mark.slow]


class Queue(VllmClient):
    """A held engine, calls queued behind it in a known order, and the order vLLM serves them."""

    def __init__(self, vllm: Vllm, http: aiohttp.ClientSession, control: ControlClient) -> None:
        super().__init__(vllm, http, control)
        self.tag = uuid.uuid4().hex[:8]
        self.tasks: list[asyncio.Task[None]] = []
        self.named: dict[str, str] = {}  # call name -> session id
        self.finished: list[str] = []

    def session(self, name: str) -> str:
        session = self.named.setdefault(name, f"prio-{name}-{self.tag}")
        self.sessions.add(session)
        return session

    async def hold(self) -> None:
        await self.pause()
        status = await self.status()
        assert status["running"] == [] and status["waiting"] == [], f"vLLM is not idle: {status}"

    async def send(self, name: str, ask: Callable[[str], Awaitable[Any]]) -> None:
        """Queue one call (``ask(session)``) and wait until vLLM shows it waiting."""
        session = self.session(name)

        async def call() -> None:
            await ask(session)
            self.finished.append(name)

        self.tasks.append(asyncio.create_task(call()))
        await self.until(f"{name} waiting", lambda s: session in [w[0] for w in s["waiting"]])

    async def waiting(self) -> list[tuple[str, int]]:
        """The calls in vLLM's waiting queue and their priorities, in the order it will admit them."""
        names = {s: n for n, s in self.named.items()}
        status = await self.status()
        assert status["running"] == [], f"something ran while vLLM was paused: {status}"
        return [(names[session], priority) for session, priority in status["waiting"]]

    async def release(self) -> list[str]:
        """Resume vLLM; the order the calls complete in."""
        await self.resume()
        await asyncio.gather(*self.tasks)
        return self.finished

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self.resume()  # a failed test must not leave the shared server paused
        for task in self.tasks:
            task.cancel()
        for session in self.sessions:
            await self.control.call("discard", session=session)


def run(vllm: Vllm, scenario: Callable[[Queue], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        control = ControlClient(vllm.control)
        try:
            async with aiohttp.ClientSession() as http:
                queue = Queue(vllm, http, control)
                try:
                    await queue.hold()
                    return await scenario(queue)
                finally:
                    await queue.aclose()
        finally:
            await control.aclose()

    return asyncio.run(main())


def test_queued_requests_are_served_lowest_priority_first(dev_vllm: Vllm) -> None:
    """Through the planner's engine client (``VllmEngine``, which sends vLLM's ``priority`` field)."""
    engine = VllmEngine(dev_vllm.url, engine_id="vllm-prio", model=dev_vllm.model, vocab_size=4096)

    async def ask(session: str, priority: int | None) -> None:
        completion = await engine.complete(
            session_id=session,
            request_id=f"{session}/llm-1",
            prompt=Prompt((TokenRun(session, 31 * 32),)),  # 31 blocks of its own tokens
            max_output_tokens=1,
            priority=priority,
        )
        assert completion.output_tokens == 1

    async def scenario(q: Queue) -> tuple[list[tuple[str, int]], list[str]]:
        try:
            for name, priority in [("p50", 50), ("p40", 40), ("none", None), ("p30", 30), ("p0", 0), ("neg", -5)]:
                await q.send(name, lambda s, p=priority: ask(s, p))  # latest first: fcfs would serve p50 first
            return await q.waiting(), await q.release()
        finally:
            await engine.close()

    queued, served = run(dev_vllm, scenario)
    # No priority is vLLM's default, 0: it ties with p0 and, sent first, goes first.
    assert queued == [("neg", -5), ("none", 0), ("p0", 0), ("p30", 30), ("p40", 40), ("p50", 50)]
    assert served == [name for name, _ in queued]


# The planner's policy with a bounded-wait window (max_wait_ms) of 300 ms, short enough for a test.
WINDOW = SchedulingConfig(max_age_credit_ms=0.0, max_level_ms=300.0, warm_credit_ms=0.0)


class Clock:
    """The log's clock, set by the test (a loaded machine's event loop can oversleep the window)."""

    def __init__(self) -> None:
        self.now = datetime.now(UTC)

    def __call__(self) -> datetime:
        return self.now


def test_the_gateways_priorities_bound_a_heavy_programs_wait_on_vllm(dev_vllm: Vllm) -> None:
    """Bounded wait on the real engine path: the gateway (``GatewayWorker`` with the policy above)
    stamps each engine request's priority from the log's clock and the session's recorded calls
    (``services.scheduling.prioritize``, as the planner does) and sends it to vLLM. A program that
    has attained a lot of service (one recorded 50 s call) ranks ``max_level_ms`` behind its
    call's ready time; a new program's call ranks at its own, so the priority the gateway sends
    rises with the clock: the heavy call is passed by new programs' calls ready within the window
    after it, and by none ready later. Ready times 100 ms apart on the clock (set, not slept)."""
    clock = Clock()
    t0 = clock.now
    ready = {"heavy": t0, **{f"new{i}": t0 + timedelta(milliseconds=50 + 100 * i) for i in range(6)}}

    async def scenario(q: Queue) -> tuple[list[tuple[str, int]], list[str], dict[str, int | None]]:
        log = open_log(f"memory:prio-{q.tag}", actor="gateway", clock=clock)  # the gateway reads only its clock
        gateway = GatewayWorker(log, engine_url=dev_vllm.url, engine_id="vllm-prio", scheduling=WINDOW)
        heavy = ev.GatewayLLMCallServed.model_construct(call_id="llm-0", queue_ms=0.0, prefill_ms=20e3, decode_ms=30e3)
        gateway.session(q.session("heavy")).calls["llm-0"] = heavy  # a recorded call: 50 s attained
        async with aiohttp.ClientSession() as http:
            gateway._http = http  # what GatewayWorker.start opens: its client to the engine

            async def ask(session: str) -> None:
                body = {
                    "model": dev_vllm.model,
                    "messages": [{"role": "user", "content": f"{session} " + " ".join(["word"] * 200)}],
                    "max_tokens": 1,
                    "temperature": 0,
                }
                answer = await gateway._engine_json(gateway.session(session), body, len(gateway.session(session).calls))
                assert answer["usage"]["completion_tokens"] == 1

            for name, at in ready.items():  # in ready order: fcfs would serve the heavy call first
                clock.now = at
                await q.send(name, ask)
            queued, served = await q.waiting(), await q.release()
            sent = {name: gateway.session(q.session(name)).ranked for name in ready}
            return queued, served, {n: r.priority if r else None for n, r in sent.items()}

    queued, served, sent = run(dev_vllm, scenario)
    ms = {name: round(at.timestamp() * 1000) for name, at in ready.items()}
    new = [f"new{i}" for i in range(6)]
    assert sent == {"heavy": ms["heavy"] + 300, **{n: ms[n] for n in new}}  # what the gateway stamped and records
    # Least attained service alone (no bound) would serve the heavy call last.
    assert queued == [(n, sent[n]) for n in ["new0", "new1", "new2", "heavy", "new3", "new4", "new5"]]
    assert served == [name for name, _ in queued]
