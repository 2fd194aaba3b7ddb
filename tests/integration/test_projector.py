"""The projector's contract: its read model is a pure function of the log.

On the Postgres log and on Kafka (the model in Postgres), a log with sessions, LLM and tool
calls, votes, retries, approvals, KV decisions, cache hits and checkpoints (and one record
Postgres refuses) is projected live by a projector process that is SIGKILLed mid-transaction
and after commits and restarted; the model it ends with must equal a rebuild from offset 0
(``logctl projector rebuild``), row for row, and hold exactly the rows the log implies:
nothing counted twice, nothing skipped.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from cli.common import init_log
from log import open_log
from schemas import events as ev
from tests.unit.services.analysis_samples import workload
from workers.projector import ReadModel

pytestmark = pytest.mark.integration

CHECKOUT = Path(__file__).resolve().parents[2]
NUM_SESSIONS = 6

_ACTOR = {
    ev.SessionRequested: "operator",
    ev.ApprovalGiven: "operator",
    ev.ToolCallCommitted: "decider",
    ev.ToolCallStarted: "executor",
    ev.ToolCallCompleted: "executor",
    ev.CacheDecisionMade: "cache-manager",
    ev.KVCacheHit: "engine-bridge",
}


def _extra(session: str) -> list[BaseModel]:
    votes = [
        ev.Vote(voter="allow_list", decision=ev.VoteDecision.APPROVE, reason="allowed"),
        ev.Vote(voter="human_approval", decision=ev.VoteDecision.APPROVE, reason="approved by ops"),
    ]
    return [
        ev.ToolCallCommitted(call_id="tool-1", votes=votes, policy="unanimous"),
        ev.ToolCallStarted(call_id="tool-1", tool="search", idempotency_key="k", attempt=1),
        ev.ToolCallStarted(call_id="tool-1", tool="search", idempotency_key="k", attempt=2),
        ev.ApprovalGiven(call_id="tool-1", decision=ev.ApprovalDecision.APPROVE, author="ops", reason="fine"),
        ev.CacheDecisionMade(
            engine_id="sim-0", action=ev.CacheAction.PRESERVE, ttl_ms=500, score=1.5, num_blocks=4, reason="tool gap"
        ),
        ev.KVCacheHit(engine_id="sim-0", call_id="llm-2", cached_tokens=512, prompt_tokens=1536, tier=ev.KVTier.GPU),
        ev.CheckpointTaken(checkpoint_id="c1", cut={"agent.actions": 3}, state_digest="ab", effects=[], num_events=5),
    ]


async def _write_log(url: str, namespace: str) -> None:
    actors = {"operator", "planner", "decider", "executor", "cache-manager", "engine-bridge"}
    await init_log(url, 2, namespace=namespace)
    logs = {a: open_log(url, actor=a, namespace=namespace) for a in actors}
    for log in logs.values():
        await log.start()
    try:
        for i in range(NUM_SESSIONS):
            for session, _, body, _ in workload():
                await logs[_ACTOR.get(type(body), "planner")].append(f"{session}{i}", body)  # type: ignore[arg-type]
            for body in _extra(f"a{i}"):
                await logs[_ACTOR.get(type(body), "planner")].append(f"a{i}", body)  # type: ignore[arg-type]
        # Postgres refuses a NUL character in text: this approval cannot be projected.
        bad = ev.ApprovalGiven(call_id="tool-1", decision=ev.ApprovalDecision.DENY, author="ops", reason="nul\x00here")
        await logs["operator"].append("a0", bad)
    finally:
        for log in logs.values():
            await log.close()


def _projector(env: dict[str, str], crash_at: str | None) -> subprocess.CompletedProcess[str]:
    run_env = {**env, "AGENTLOG_CRASH_AT": crash_at} if crash_at else env
    return subprocess.run(
        [sys.executable, "-m", "workers.projector", "--until-caught-up", "--max-records", "7"],
        cwd=CHECKOUT, env=run_env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


async def _dump(url: str, namespace: str) -> dict[str, list[tuple[Any, ...]]]:
    model = await ReadModel(url, namespace).start()
    try:
        return await model.dump()
    finally:
        await model.close()


async def _dead_letters(url: str, namespace: str, error_type: str, count: int) -> list[ev.RecordDeadLettered]:
    """The DLQ's letters of ``error_type``, read until there are ``count`` (a fresh group's join
    and first fetch can take seconds on a loaded machine), then one more poll for any beyond."""
    async with open_log(url, actor="auditor", namespace=namespace) as log:
        found: list[ev.RecordDeadLettered] = []
        async with log.consumer("auditor-dlq", ["agent.dlq"], from_beginning=True) as consumer:
            for _ in range(200):
                found += [
                    e.body
                    for e in await consumer.poll(timeout_s=0.3)
                    if isinstance(e.body, ev.RecordDeadLettered) and e.body.error_type == error_type
                ]
                if len(found) >= count:
                    break
            found += [
                e.body
                for e in await consumer.poll(timeout_s=0.3)
                if isinstance(e.body, ev.RecordDeadLettered) and e.body.error_type == error_type
            ]
        return found


@pytest.fixture(params=["postgres", "kafka"])
def log_url(request: pytest.FixtureRequest, pg_url: str) -> str:
    if request.param == "postgres":
        return pg_url
    return f"kafka://{request.getfixturevalue('kafka_bootstrap')}"


def test_the_read_model_after_crashes_equals_a_rebuild_from_offset_0(log_url: str, pg_url: str, namespace: str) -> None:
    asyncio.run(_write_log(log_url, namespace))
    env = {
        **os.environ,
        "AGENTLOG_LOG_URL": log_url,
        "AGENTLOG_NAMESPACE": namespace,
        "AGENTLOG_READ_MODEL_URL": pg_url,
    }
    env.pop("AGENTLOG_CRASH_AT", None)
    for crash_at in ("projector.mid_transaction:3", "projector.after_commit:2", "projector.mid_transaction:4"):
        killed = _projector(env, crash_at)
        assert killed.returncode == -9, killed.stderr[-2000:]
        assert f"crash point {crash_at.split(':')[0]} reached" in killed.stderr
    done = _projector(env, None)
    assert done.returncode == 0, done.stderr[-2000:]
    live = asyncio.run(_dump(pg_url, namespace))

    # Exactly the rows the log implies.
    assert len(live["sessions"]) == 2 * NUM_SESSIONS and len(live["llm_calls"]) == 4 * NUM_SESSIONS
    assert len(live["tool_calls"]) == 2 * NUM_SESSIONS and len(live["votes"]) == 2 * NUM_SESSIONS
    assert len(live["approvals"]) == NUM_SESSIONS  # the NUL one is not there
    assert len(live["kv_decisions"]) == len(live["cache_hits"]) == len(live["checkpoints"]) == NUM_SESSIONS
    attempts = {row[1]: row for row in live["tool_calls"] if row[0] == "a0"}["tool-1"][10]
    assert attempts == 2  # the retry's attempt, not the first one

    # Rebuilt from offset 0, by the operator's command: the same model, row for row.
    rebuilt = subprocess.run(
        [sys.executable, "-m", "cli.main", "projector", "rebuild", "--json"],
        cwd=CHECKOUT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert rebuilt.returncode == 0, rebuilt.stderr[-2000:]
    assert json.loads(rebuilt.stdout)["dead_lettered"] == 1
    assert asyncio.run(_dump(pg_url, namespace)) == live

    # The record it could not project is in the DLQ with Postgres's reason (once per projection
    # that met it: the live run's and the rebuild's).
    letters = asyncio.run(_dead_letters(log_url, namespace, "Unprojectable", 2))
    assert len(letters) >= 2 and all(d.source_topic == "ops.commands" for d in letters)
    assert all("0x00" in d.reason or "\\u0000" in d.reason or "NUL" in d.reason.upper() for d in letters), letters
