"""logctl verify finds every broken link; logctl audit shows who did what."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from typer.testing import CliRunner

from cli.common import ensure_topics
from cli.main import app
from log import open_log
from log.backend import OutRecord
from schemas import events as ev

pytestmark = pytest.mark.integration

PROPOSAL = ev.ToolCallProposed(
    call_id="tool-1",
    tool="payment",
    arguments_json='{"account": "acme", "amount_cents": 500}',
    effect_class=ev.EffectClass.IRREVERSIBLE,
    idempotency_key="s/tool-1",
)


def llm(turn: int) -> ev.LLMCallStarted:
    return ev.LLMCallStarted(
        call_id=f"llm-{turn}", turn=turn, engine_id="sim", prompt_tokens=10, max_output_tokens=4, prompt_digest="0" * 64
    )


async def write_history(url: str) -> None:
    async with (
        open_log(url, actor="planner") as planner,
        open_log(url, actor="decider") as decider,
        open_log(url, actor="executor") as executor,
        open_log(url, actor="operator") as operator,
    ):
        await operator.append("pay", ev.SessionRequested(program="script", args_json="{}", author="ana"))
        await planner.append("pay", ev.SessionStarted(program="script", args_json="{}"))
        await planner.append("pay", PROPOSAL)
        await operator.append(
            "pay", ev.ApprovalGiven(call_id="tool-1", decision=ev.ApprovalDecision.APPROVE, author="ana", reason="ok")
        )
        vote = ev.Vote(voter="human_approval", decision=ev.VoteDecision.APPROVE, reason="approved by ana")
        await decider.append("pay", ev.ToolCallCommitted(call_id="tool-1", votes=[vote], policy="unanimous"))
        await executor.append(
            "pay", ev.ToolCallStarted(call_id="tool-1", tool="payment", idempotency_key="k", attempt=1)
        )
        await executor.append(
            "pay", ev.ToolCallCompleted(call_id="tool-1", result_json="{}", result_tokens=1, duration_ms=12.5)
        )
        for turn in range(4):
            await planner.append("victim", llm(turn))


async def forge(url: str) -> None:
    """Four ways to break the log, each with raw write access below the SharedLog."""
    async with open_log(url, actor="planner") as log:
        partition = log.partition_for("victim")
        history = await log.history("victim", ["agent.actions"])
        raw = [r async for r in log.scan("agent.actions", partition) if r.key == b"victim"]
        codec = log.codec
        last = history[-1].envelope
        forged, _ = codec.encode(
            event_id="forged",
            session_id="victim",
            seq=last.seq + 1,
            actor="executor",
            occurred_at=datetime.now(UTC),
            causation_id=None,
            prev_hash=last.hash,
            body=llm(9),
        )
        tampered = raw[1].value.replace(b"llm-1", b"llm-X", 1)
        produce = log.backend.produce
        for value in (forged, tampered, raw[2].value):  # forged actor, tampered body, duplicate of seq 2
            await (await produce("agent.actions", [OutRecord(partition, b"victim", value)]))
        # A reordered pair: seq n+1 before seq n (written directly, as a misbehaving broker client could).
        n = last.seq + 1
        first, h1 = codec.encode(
            event_id="r1",
            session_id="victim",
            seq=n,
            actor="planner",
            occurred_at=datetime.now(UTC),
            causation_id=None,
            prev_hash=last.hash,
            body=llm(10),
        )
        second, _ = codec.encode(
            event_id="r2",
            session_id="victim",
            seq=n + 1,
            actor="planner",
            occurred_at=datetime.now(UTC),
            causation_id=None,
            prev_hash=h1,
            body=llm(11),
        )
        await (await produce("agent.actions", [OutRecord(partition, b"victim", second)]))
        await (await produce("agent.actions", [OutRecord(partition, b"victim", first)]))


@pytest.fixture
def url(pg_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("AGENTLOG_NAMESPACE", namespace)
    ensure_topics(pg_url)
    asyncio.run(write_history(pg_url))
    return pg_url


def invoke(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def test_verify_passes_an_intact_log(url: str) -> None:
    result = invoke("verify", "--log-url", url, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["ok"] and report["records"] == 11 and report["sessions"] == 2


def test_verify_names_every_broken_link(url: str) -> None:
    asyncio.run(forge(url))
    result = invoke("verify", "--log-url", url, "--json")
    assert result.exit_code == 1
    problems = json.loads(result.output)["problems"]
    found = [(p["error"], p["offset"]) for p in problems]
    start = problems[0]["offset"]  # the forged record is the first record after the genuine history
    # The reordered pair: seq n+1 arrives first (a gap); then seq n links to the tail and is accepted.
    assert found == [
        ("ActorNotAllowed", start),
        ("HashMismatch", start + 1),
        ("SeqRepeat", start + 2),
        ("SeqGap", start + 3),
    ]
    assert all(p["topic"] == "agent.actions" and p["session_id"] == "victim" for p in problems)
    table = invoke("verify", "--log-url", url, "--session", "victim")
    assert table.exit_code == 1
    assert f"BROKEN agent.actions[{problems[0]['partition']}]@{start}  ActorNotAllowed" in table.output
    # The other session's chains are intact.
    assert invoke("verify", "--log-url", url, "--session", "pay").exit_code == 0


def test_audit_shows_proposal_votes_verdict_and_execution(url: str) -> None:
    result = invoke("audit", "--log-url", url, "--json")
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.output)
    assert row["tool"] == "payment" and row["effect_class"] == "IRREVERSIBLE"
    assert row["votes"] == [{"voter": "human_approval", "decision": "APPROVE", "reason": "approved by ana"}]
    assert row["verdict"] == "committed" and row["status"] == "completed" and row["duration_ms"] == 12.5
    assert row["approvals"] == [{"author": "ana", "decision": "APPROVE", "reason": "ok"}]

    def count(*filters: str) -> int:
        out = invoke("audit", "--log-url", url, "--json", *filters)
        assert out.exit_code == 0, out.output
        return len(json.loads(out.output))

    matches: list[Callable[[], int]] = [
        lambda: count("--tool", "payment"),
        lambda: count("--effect-class", "irreversible"),
        lambda: count("--verdict", "committed"),
        lambda: count("--actor", "operator"),
        lambda: count("--session", "pay"),
        lambda: count("--since", "2000-01-01T00:00:00"),
    ]
    misses: list[Callable[[], int]] = [
        lambda: count("--tool", "echo"),
        lambda: count("--effect-class", "pure"),
        lambda: count("--verdict", "aborted"),
        lambda: count("--actor", "cache-manager"),
        lambda: count("--until", "2000-01-01T00:00:00"),
    ]
    assert [m() for m in matches] == [1] * len(matches)
    assert [m() for m in misses] == [0] * len(misses)
    table = invoke("audit", "--log-url", url)
    assert "payment" in table.output and "approve by ana" in table.output and "1 tool calls" in table.output
