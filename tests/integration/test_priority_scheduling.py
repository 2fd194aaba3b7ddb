"""Program-level scheduling end to end: the simulated engine (a real process) serves waiting
requests by priority, and the planner, on a real Postgres log, sends every call the priority
``services.scheduling`` gives its program's history in that log."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from cli.common import ensure_topics
from cli.stack import Process, Stack, free_port
from log import LoggedEvent, open_log
from log.snapshots import SnapshotStore
from schemas import events as ev
from services.checkpoint import fold_events
from services.replay import cut_events
from services.scheduling import DEFAULT_SCHEDULING
from workers.config import scheduling_config
from workers.decider import DeciderWorker
from workers.engines.factory import create_engine
from workers.executor import ExecutorWorker
from workers.planner import PlannerWorker
from workers.tools import Ledger

pytestmark = [pytest.mark.integration]


class SimEngine:
    """The sim server as a process, at real time (``--time-scale 1``): a 100-token call takes about
    a second, so requests sent meanwhile really queue."""

    def __init__(self, work: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.state_dir = work / "engine"
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        self.process = Process(
            "engine",
            [sys.executable, "-m", "workers.engines.sim_server", "--port", str(self.port),
             "--state-dir", str(self.state_dir), "--block-size", "4", "--gpu-blocks", "4096", "--time-scale", "1"],
            env, work / "engine.log",
        )  # fmt: skip

    def start(self) -> SimEngine:
        self.process.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                self.stats()
                return self
            except OSError:
                assert self.process.alive(), self.process.log_tail()
                time.sleep(0.1)
        raise TimeoutError("the sim engine did not start")

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.url}/stats", timeout=10) as response:
            stats: dict[str, Any] = json.loads(response.read())
            return stats


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[SimEngine]:
    engine = SimEngine(tmp_path).start()
    try:
        yield engine
    finally:
        engine.process.stop()


def completion(request_id: str, max_tokens: int, priority: object = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "sim", "request_id": request_id, "session_id": request_id,
                            "prompt_runs": [[request_id, 16]], "max_tokens": max_tokens}  # fmt: skip
    if priority is not None:
        body["priority"] = priority
    return body


def test_the_sim_engine_serves_waiting_requests_lowest_priority_first(sim: SimEngine) -> None:
    asyncio.run(serve_by_priority(sim))


async def serve_by_priority(sim: SimEngine) -> None:
    finished: list[str] = []
    async with aiohttp.ClientSession() as http:

        async def call(body: dict[str, Any]) -> dict[str, Any]:
            async with http.post(f"{sim.url}/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()
                answer: dict[str, Any] = await response.json()
                finished.append(body["request_id"])
                return answer

        # The engine is busy with "running" (about 1 s); four requests queue behind it, sent in an
        # order that is not their priorities' (one has none: vLLM's default, 0, the lowest here).
        running = asyncio.create_task(call(completion("running", 100)))
        for _ in range(2000):  # until it holds the engine (for about a second)
            if sim.stats()["engine_held"]:
                break
            await asyncio.sleep(0.005)
        else:
            raise AssertionError("the first call never reached the engine")
        queued = [("late", 900), ("early", 100), ("none", None), ("middle", 500)]
        tasks = []
        for name, priority in queued:
            tasks.append(asyncio.create_task(call(completion(name, 4, priority))))
            for _ in range(2000):  # wait until it is queued, so that they queue in this order
                if sim.stats()["num_waiting"] >= len(tasks):
                    break
                await asyncio.sleep(0.005)
            else:
                raise AssertionError(f"{name} never queued: {sim.stats()}")
        assert not running.done(), "the first call ended before the others queued: the engine is too fast"
        answers = await asyncio.gather(running, *tasks)
    assert finished == ["running", "none", "early", "middle", "late"]
    served_at = {a["id"]: a["agentlog"]["priority"] for a in answers}
    assert served_at == {"running": 0, "late": 900, "early": 100, "none": 0, "middle": 500}


@pytest.mark.parametrize("priority", ["high", 1.5, True, [1]])
def test_a_priority_that_is_not_an_integer_is_refused_on_both_endpoints(sim: SimEngine, priority: object) -> None:
    asyncio.run(refused(sim, priority))


async def refused(sim: SimEngine, priority: object) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{sim.url}/v1/completions", json=completion("bad", 4, priority)) as response:
            assert response.status == 400
            assert "priority must be an integer" in (await response.json())["error"]
        chat = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "priority": priority}
        async with http.post(f"{sim.url}/v1/chat/completions", json=chat) as response:
            assert response.status == 400
            error = (await response.json())["error"]
            assert error["param"] == "priority" and "priority must be an integer" in error["message"]
    assert sim.stats()["num_served"] == 0


TOOL_S = 1.5
SCRIPT = [
    {"llm": {"prompt_tokens": 32, "output_tokens": 4}},
    {"tool": "sleep", "arguments": {"seconds": TOOL_S}},
    {"llm": {"prompt_tokens": 32, "output_tokens": 4}},
]


@pytest.mark.parametrize("preserved", [False, True], ids=["cold", "preserved"])
def test_the_planner_sends_each_call_its_programs_priority_from_the_log(
    pg_url: str, namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, preserved: bool
) -> None:
    """Each call's priority is recorded on its LLMCallStarted, with what it was computed from, and
    is the one the engine request carried. ``preserved``: the cache manager decided to preserve the
    session's KV (a PRESERVE on kv.decisions, as its worker appends one) before the session ran, so
    the planner, which reads kv.decisions, gives both calls the warm credit."""
    monkeypatch.setenv("AGENTLOG_NAMESPACE", namespace)
    monkeypatch.delenv("AGENTLOG_SCHEDULING", raising=False)
    ensure_topics(pg_url, namespace=namespace)
    stack = Stack(pg_url, tmp_path, time_scale=1.0)
    stack.work_dir.mkdir(parents=True, exist_ok=True)
    stack.engine_port = free_port()
    stack.start_process("engine")
    try:
        stack.wait_for_engine(30)
        history = asyncio.run(run_script(pg_url, namespace, stack.engine_url, tmp_path, preserved=preserved))
    finally:
        stack.stop()
    check_priorities(history, stack.work_dir / "engine" / "served.jsonl", warm=preserved)


PRESERVE = ev.CacheDecisionMade(
    engine_id="sim-0", action=ev.CacheAction.PRESERVE, ttl_ms=600_000, score=1.0, num_blocks=8, reason="test"
)


async def run_script(
    pg_url: str, namespace: str, engine_url: str, tmp_path: Path, *, preserved: bool = False
) -> list[LoggedEvent]:
    """A script session (LLM call, tool, LLM call) through a real planner, decider and executor
    (``preserved``: after a PRESERVE decision for it on kv.decisions)."""
    roles = ("planner", "decider", "executor", "operator", "cache-manager")
    logs = {r: await open_log(pg_url, actor=r, namespace=namespace).start() for r in roles}
    store = await SnapshotStore(pg_url, namespace).start()
    ledger = await Ledger(pg_url).start()
    try:
        engine = create_engine(engine_url, engine_id="sim-0", kind="sim")
        planner = PlannerWorker(logs["planner"], engine=engine, snapshots=store)
        planner.scheduling = scheduling_config(None, default="plas")  # --scheduling plas: the sim engine's default
        workers = [
            planner,
            DeciderWorker(logs["decider"], snapshots=store),
            ExecutorWorker(logs["executor"], ledger=ledger, sandbox=tmp_path / "sandbox", snapshots=store),
        ]
        tasks = [asyncio.create_task(w.run()) for w in workers]
        session = f"plas-{uuid.uuid4().hex[:6]}"
        args = json.dumps({"steps": SCRIPT})
        if preserved:
            await logs["cache-manager"].append(session, PRESERVE)
        await logs["operator"].append(session, ev.SessionRequested(program="script", args_json=args, author="t"))
        deadline = time.monotonic() + 120
        while True:
            history = await logs["operator"].history(session)
            if fold_events(session, cut_events(history)).finished:
                break
            assert time.monotonic() < deadline, [type(e.body).__name__ for e in history]
            await asyncio.sleep(0.2)
        for worker in workers:
            worker.shutdown()
        await asyncio.gather(*tasks)
        await engine.close()
    finally:
        await store.close()
        await ledger.close()
        for log in logs.values():
            await log.close()
    return history


def check_priorities(history: list[LoggedEvent], served: Path, *, warm: bool = False) -> None:
    started = {e.body.call_id: e for e in history if isinstance(e.body, ev.LLMCallStarted)}
    at = {call_id: e.envelope.occurred_at.timestamp() * 1000 for call_id, e in started.items()}
    tool = next(e.body for e in history if isinstance(e.body, ev.ToolCallCompleted))
    first = next(e.body for e in history if isinstance(e.body, ev.LLMCallCompleted))
    record = [json.loads(line) for line in served.read_text().splitlines()]
    priority = {r["request_id"].rsplit("/", 1)[-1]: r["response"]["agentlog"]["priority"] for r in record}
    assert sorted(priority) == sorted(started) and len(priority) == 2
    call0, call1 = sorted(started, key=at.__getitem__)
    bodies = {call_id: e.body for call_id, e in started.items() if isinstance(e.body, ev.LLMCallStarted)}
    credit = DEFAULT_SCHEDULING.warm_credit_ms if warm else 0.0
    for call_id, body in bodies.items():
        # The log records the priority the engine request carried, and what it was computed from.
        assert body.priority == priority[call_id]
        assert body.priority_warm is warm
        assert body.priority_attained_ms is not None and body.priority_age_ms is not None
        # Its ready time (the priority without its terms, to the millisecond it is rounded to):
        # just before its LLMCallStarted was appended, on the same clock.
        ready = body.priority + body.priority_age_ms - body.priority_attained_ms + credit
        assert -1 < at[call_id] - ready < 5_000
    # The first call: the program has no history. The second: anchored back by the program's
    # recorded age (the first call's engine and queue time and the tool's duration), later by the
    # service the first call attained.
    assert bodies[call0].priority_attained_ms == 0 and bodies[call0].priority_age_ms == 0
    service = first.prefill_ms + first.decode_ms
    assert bodies[call1].priority_attained_ms == pytest.approx(service)
    assert bodies[call1].priority_age_ms == pytest.approx(service + first.queue_ms + tool.duration_ms)
    assert tool.duration_ms >= TOOL_S * 1000
    # So the program kept (close to) its place: its second call ranks near its first, not behind
    # every call that became ready while its tool ran.
    assert priority[call1] - priority[call0] < at[call1] - at[call0] - TOOL_S * 1000 + service + 1
