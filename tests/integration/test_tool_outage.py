"""A tool whose service is down, or whose answer is lost, on a real Postgres log and ledger.

The chaos run (bench/chaos.py) restarts the ledger's Postgres while sessions pay: a payment
made then was recorded as failed ("connection refused"), telling the agent "not paid" for a
payment that was never tried, and a connection lost during the INSERT was just as much a
failure, though the row may have committed. Now (workers/tools.py, workers/executor.py):

- the ledger is down: the payment raises ``ToolUnavailable``; the executor runs it again with
  backoff and it is made once the ledger is back, exactly once;
- the connection is lost during the INSERT (here: its backend terminated while it waits on a
  lock): ``OutcomeUnknown``, so the payment goes in doubt; the operator reads the ledger and
  answers ``--retry``, and it is made once;
- a retry-safe tool whose answer is lost runs again; a tool that stays unavailable fails,
  marked retryable, after ``unavailable_retry_s``.

The ledger is an embedded Postgres of the test's own (it is stopped and started), outside
pytest's base temp dir (see tests/e2e/test_chaos.py's ``work_dir``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from cli.common import ensure_topics
from log import SharedLog, open_log
from schemas import events as ev
from services.checkpoint import fold_events
from services.replay import cut_events
from services.session import SessionState, ToolStatus
from services.voters import default_allowed, default_decider
from workers.decider import DeciderWorker
from workers.engines.factory import create_engine
from workers.executor import ExecutorWorker
from workers.planner import PlannerWorker
from workers.plugins import load_registry
from workers.tools import Ledger

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

PLUGIN = "tests.integration.outage_tools"


def embedded(command: str, pgdata: Path) -> str:
    argv = [sys.executable, "-m", "log.embedded", command, "--pgdata", str(pgdata)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().removeprefix("AGENTLOG_PG_URL=")


@pytest.fixture
def ledger_pg() -> Iterator[tuple[str, Path]]:
    work = Path(tempfile.mkdtemp(prefix="agentlog-ledger-"))
    pgdata = work / "pg"
    url = embedded("start", pgdata)
    try:
        yield url, pgdata
    finally:
        with contextlib.suppress(AssertionError):
            embedded("stop", pgdata)
        shutil.rmtree(work, ignore_errors=True)


def pay(cents: int) -> dict[str, Any]:
    return {"tool": "payment", "arguments": {"account": "acct-1", "amount_cents": cents}}


class World:
    def __init__(self, log_url: str, namespace: str, ledger_url: str, tmp: Path) -> None:
        self.log_url, self.namespace, self.ledger_url, self.tmp = log_url, namespace, ledger_url, tmp
        self.registry = load_registry(PLUGIN, entry_points=False)

    def open(self, actor: str) -> SharedLog:
        return open_log(self.log_url, actor=actor, namespace=self.namespace)

    async def fold(self, session: str) -> SessionState:
        async with self.open("auditor") as log:
            return fold_events(session, cut_events(await log.history(session)))

    async def bodies(self, session: str) -> list[ev.Event]:
        async with self.open("auditor") as log:
            return [e.body for e in await log.history(session)]

    async def operator(self, session: str, body: ev.Event) -> None:
        async with self.open("operator") as log:
            await log.append(session, body)

    async def request(self, session: str, *steps: dict[str, Any]) -> None:
        args = json.dumps({"steps": list(steps)})
        await self.operator(session, ev.SessionRequested(program="script", args_json=args, author="test"))

    async def decide(self, session: str, call_id: str, decision: ev.ApprovalDecision) -> None:
        await self.operator(session, ev.ApprovalGiven(call_id=call_id, decision=decision, author="test", reason="t"))

    async def until(self, session: str, check: Callable[[SessionState], bool], what: str) -> SessionState:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while True:
            state = await self.fold(session)
            if check(state):
                return state
            if loop.time() > deadline:
                tools = {t.call_id: t.status.value for t in state.tool_calls.values()}
                raise AssertionError(f"{session}: timed out waiting for {what}: {state.status} {tools}")
            await asyncio.sleep(0.2)

    async def ledger_query(self, query: str, *args: Any) -> Any:
        conn = await asyncpg.connect(self.ledger_url)
        try:
            return await conn.fetchval(query, *args)
        finally:
            await conn.close()

    async def payments(self, session: str) -> int:
        query = "SELECT count(*) FROM agentlog_ledger.payments WHERE session_id = $1"
        return int(await self.ledger_query(query, session))

    @contextlib.asynccontextmanager
    async def roles(self, *, unavailable_retry_s: float = 60.0) -> AsyncIterator[ExecutorWorker]:
        logs = [await self.open(role).start() for role in ("planner", "decider", "executor")]
        ledger = await Ledger(self.ledger_url).start()
        engine = create_engine("http://127.0.0.1:9", engine_id="sim-0", kind="sim")  # the scripts make no LLM call
        executor = ExecutorWorker(
            logs[2], registry=self.registry, ledger=ledger, sandbox=self.tmp / "sandbox",
            unavailable_retry_s=unavailable_retry_s,
        )  # fmt: skip
        workers: list[Any] = [
            PlannerWorker(logs[0], engine=engine, registry=self.registry),
            DeciderWorker(
                logs[1], registry=self.registry, decider=default_decider(default_allowed(self.registry.tool_specs))
            ),
            executor,
        ]
        tasks = [asyncio.create_task(w.run()) for w in workers]
        try:
            yield executor
        finally:
            for w in workers:
                w.shutdown()
            await asyncio.gather(*tasks)
            await ledger.close()
            for log in logs:
                await log.close()


@pytest.fixture
def world(pg_url: str, namespace: str, ledger_pg: tuple[str, Path], tmp_path: Path) -> World:
    ensure_topics(pg_url, namespace=namespace)
    return World(pg_url, namespace, ledger_pg[0], tmp_path)


async def _value(value: Any) -> Any:
    return value


async def eventually(fetch: Callable[[], Awaitable[Any]], what: str, timeout_s: float = 60) -> Any:
    """``fetch()``'s first value that is not None or False."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        value = await fetch()
        if value not in (None, False):
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def status(call_id: str, wanted: ToolStatus) -> Callable[[SessionState], bool]:
    return lambda s: call_id in s.tool_calls and s.tool_calls[call_id].status is wanted


def test_a_payment_while_the_ledger_is_down_is_made_once_it_is_back(world: World, ledger_pg: tuple[str, Path]) -> None:
    async def go() -> tuple[SessionState, list[ev.Event], int, int]:
        async with world.roles() as executor:
            await world.request("down", pay(700))
            await world.until("down", status("tool-0", ToolStatus.PROPOSED), "the payment held for approval")
            embedded("stop", ledger_pg[1])
            await world.decide("down", "tool-0", ev.ApprovalDecision.APPROVE)
            await world.until("down", status("tool-0", ToolStatus.STARTED), "the payment started")
            # It was tried, found the ledger down, and waits to try again.
            await eventually(lambda: _value(executor.num_unavailable >= 2), "two runs finding the ledger down")
            tries_while_down = executor.num_unavailable
            embedded("start", ledger_pg[1])
            state = await world.until("down", lambda s: s.finished, "the session finished")
            return state, await world.bodies("down"), tries_while_down, await world.payments("down")

    state, bodies, tries, payments = asyncio.run(go())
    assert state.tool_calls["tool-0"].status is ToolStatus.COMPLETED
    assert tries >= 2
    assert payments == 1, "made exactly once, after the ledger came back"
    assert [type(b).__name__ for b in bodies if isinstance(b, ev.ToolCallStarted | ev.ToolCallFailed)] == [
        "ToolCallStarted"
    ], "one attempt, never recorded as failed"


def test_a_payment_whose_connection_is_lost_during_the_insert_goes_in_doubt(world: World) -> None:
    async def go() -> tuple[ev.ToolCallInDoubt, int, int, SessionState]:
        lock = await asyncpg.connect(world.ledger_url)
        async with world.roles():
            await world.request("lost", pay(900))
            await world.until("lost", status("tool-0", ToolStatus.PROPOSED), "the payment held for approval")
            async with lock.transaction():
                await lock.execute("LOCK TABLE agentlog_ledger.payments IN ACCESS EXCLUSIVE MODE")
                await world.decide("lost", "tool-0", ev.ApprovalDecision.APPROVE)
                waiting = "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE 'INSERT%'"
                # (Asked on its own connection: a transaction sees one snapshot of pg_stat_activity.)
                pid = await eventually(lambda: world.ledger_query(waiting), "the INSERT waiting on the lock")
                assert await lock.fetchval("SELECT pg_terminate_backend($1)", pid)
                state = await world.until("lost", status("tool-0", ToolStatus.IN_DOUBT), "the payment in doubt")
            doubt = state.tool_calls["tool-0"].in_doubt
            assert doubt is not None
            made_before = await world.payments("lost")  # the operator reads the ledger: not made
            await world.decide("lost", "tool-0", ev.ApprovalDecision.RETRY)
            state = await world.until("lost", lambda s: s.finished, "the session finished")
        await lock.close()
        return doubt, made_before, await world.payments("lost"), state

    doubt, before, after, state = asyncio.run(go())
    assert "lost its outcome" in doubt.reason and "OutcomeUnknown" not in doubt.reason, doubt.reason
    assert "connection was lost during the write" in doubt.reason
    assert (before, after) == (0, 1)
    assert state.tool_calls["tool-0"].attempts == 2


def test_a_lost_answer_reruns_a_retry_safe_tool_and_a_service_down_for_good_fails_retryable(world: World) -> None:
    async def go() -> tuple[SessionState, list[ev.Event], SessionState, list[ev.Event]]:
        async with world.roles(unavailable_retry_s=1.0):
            await world.request("lossy", {"tool": "lossy_lookup", "arguments": {}})
            await world.request("dead", {"tool": "always_down", "arguments": {}})
            await world.until("dead", status("tool-0", ToolStatus.PROPOSED), "held for approval")
            await world.decide("dead", "tool-0", ev.ApprovalDecision.APPROVE)
            lossy = await world.until("lossy", lambda s: s.status.value != "running", "lossy ended")
            dead = await world.until("dead", lambda s: s.status.value != "running", "dead ended")
            return lossy, await world.bodies("lossy"), dead, await world.bodies("dead")

    lossy, lossy_bodies, dead, dead_bodies = asyncio.run(go())
    assert lossy.finished and json.loads(lossy.tool_calls["tool-0"].completed.result_json) == {"runs": 2}  # type: ignore[union-attr]
    assert not any(isinstance(b, ev.ToolCallInDoubt | ev.ToolCallFailed) for b in lossy_bodies)
    failed = [b for b in dead_bodies if isinstance(b, ev.ToolCallFailed)]
    assert len(failed) == 1 and failed[0].retryable and failed[0].error_type == "ToolUnavailable", failed
    runs = (world.tmp / "sandbox" / "always_down.dead.runs").read_text()
    assert int(runs) >= 3, "tried again with backoff before it failed"
    assert dead.tool_calls["tool-0"].status is ToolStatus.FAILED
