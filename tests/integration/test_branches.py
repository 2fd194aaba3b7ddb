"""Checkpoint, restore, fork and merge with real workers on a real Postgres log, ledger and snapshot store."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from typer.testing import CliRunner

from cli.common import ensure_topics
from cli.main import app
from cli.stack import Stack
from log import LoggedEvent, open_log
from log.backend import OutRecord
from log.snapshots import SnapshotStore
from schemas import events as ev
from services.checkpoint import json_digest, state_digest, state_to_json
from services.session import SessionState, fold
from workers.replay import Replayed, replay_session

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LLM: dict[str, Any] = {"llm": {"prompt_tokens": 64, "output_tokens": 8}}


class Env:
    """The stack, the log and the ledger of one test (the log is Postgres unless ``log_url`` says Kafka)."""

    def __init__(self, pg_url: str, namespace: str, stack: Stack, log_url: str | None = None) -> None:
        self.pg_url = pg_url
        self.log_url = log_url or pg_url
        self.namespace = namespace
        self.stack = stack
        self.runner = CliRunner()

    def logctl(self, *argv: str) -> Any:
        env = {"AGENTLOG_NAMESPACE": self.namespace}
        return self.runner.invoke(app, [*argv, "--log-url", self.log_url], env=env)

    def request(self, session: str, steps: list[dict[str, Any]]) -> None:
        async def go() -> None:
            async with open_log(self.log_url, actor="operator", namespace=self.namespace) as log:
                args = json.dumps({"steps": steps})
                await log.append(session, ev.SessionRequested(program="script", args_json=args, author="test"))

        asyncio.run(go())

    def history(self, session: str) -> list[LoggedEvent]:
        async def go() -> list[LoggedEvent]:
            async with open_log(self.log_url, actor="auditor", namespace=self.namespace) as log:
                return await log.history(session)

        return asyncio.run(go())

    def state(self, session: str) -> SessionState:
        return fold(session, [e.envelope for e in self.history(session)])

    def wait(self, session: str, until: Any, timeout_s: float = 60, approve: bool = True) -> SessionState:
        """Wait until ``until(state)``, approving held payments like an operator."""
        deadline = time.monotonic() + timeout_s
        approved: set[str] = set()
        while time.monotonic() < deadline:
            state = self.state(session)
            if until(state):
                return state
            for call_id, tool in state.tool_calls.items():
                held = tool.proposed.tool == "payment" and tool.status.value == "proposed"
                if approve and held and call_id not in approved:
                    result = self.logctl("approve", session, call_id, "--reason", "test")
                    assert result.exit_code == 0, result.output
                    approved.add(call_id)
            time.sleep(0.3)
        logs = "\n".join(f"--- {n}\n{p.log_tail(30)}" for n, p in self.stack.processes.items())
        raise AssertionError(f"{session} never got there: {self.state(session)}\n{logs}")

    def ledger(self, table: str, session: str) -> list[asyncpg.Record]:
        async def go() -> list[asyncpg.Record]:
            conn = await asyncpg.connect(self.pg_url)
            try:
                query = f"SELECT * FROM agentlog_ledger.{table} WHERE session_id = $1 ORDER BY id"
                return list(await conn.fetch(query, session))
            finally:
                await conn.close()

        return asyncio.run(go())


def finished(state: SessionState) -> bool:
    return state.finished


@pytest.fixture
def env(pg_url: str, namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Env]:
    monkeypatch.setenv("AGENTLOG_NAMESPACE", namespace)
    ensure_topics(pg_url, namespace=namespace)
    stack = Stack(pg_url, tmp_path, time_scale=0.05, extra_env={"AGENTLOG_LEDGER_URL": pg_url})
    stack.start()
    try:
        yield Env(pg_url, namespace, stack)
    finally:
        stack.stop()


@pytest.fixture
def kafka_env(
    kafka_bootstrap: str, pg_url: str, namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Env]:
    """The same on the Kafka log (snapshots and the ledger stay in Postgres)."""
    monkeypatch.setenv("AGENTLOG_NAMESPACE", namespace)
    log_url = f"kafka://{kafka_bootstrap}"
    ensure_topics(log_url, namespace=namespace)
    stack = Stack(log_url, tmp_path, time_scale=0.05, extra_env={"AGENTLOG_LEDGER_URL": pg_url})
    stack.start()
    try:
        yield Env(pg_url, namespace, stack, log_url)
    finally:
        stack.stop()


def started_calls(history: list[LoggedEvent], tool: str) -> list[ev.ToolCallStarted]:
    return [e.body for e in history if isinstance(e.body, ev.ToolCallStarted) and e.body.tool == tool]


def test_restore_across_a_payment_is_refused_and_the_ledger_is_unchanged(env: Env) -> None:
    session = f"pay-{uuid.uuid4().hex[:6]}"
    payment = {"tool": "payment", "arguments": {"account": "acct-1", "amount_cents": 500}}
    env.request(session, [LLM, {"checkpoint": True}, payment, LLM])
    env.wait(session, finished)
    assert len(env.ledger("payments", session)) == 1

    dry = env.logctl("restore", session, "--to", "ckpt-1", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert "would be refused" in dry.output and "tool-2 (payment) is irreversible" in dry.output

    refused = env.logctl("restore", session, "--to", "ckpt-1", "--json")
    assert refused.exit_code == 1, refused.output
    answer = json.loads(refused.output.strip().splitlines()[-1])
    assert answer["blocking_call_ids"] == ["tool-2"] and "payment" in answer["reason"]

    state = env.state(session)
    assert state.status is not None and state.status.value == "finished" and state.generation == 0
    assert len(env.ledger("payments", session)) == 1, "a refused restore touches nothing"
    assert [type(e.body).__name__ for e in env.history(session)].count("RestoreApplied") == 0


def test_restore_across_a_booking_cancels_it_once_then_rewinds(env: Env) -> None:
    session = f"book-{uuid.uuid4().hex[:6]}"
    book = {"tool": "book", "arguments": {"resource": "room-7", "nights": 2}}
    env.request(session, [LLM, {"checkpoint": True}, book, LLM])
    env.wait(session, finished)

    dry = env.logctl("restore", session, "--to", "ckpt-1", "--dry-run")
    assert "would run cancel_booking for tool-2, then rewind" in dry.output, dry.output
    restored = env.logctl("restore", session, "--to", "ckpt-1", "--json")
    assert restored.exit_code == 0, restored.output
    assert json.loads(restored.output.strip().splitlines()[-1])["compensated_call_ids"] == ["tool-2"]

    # The rewound session runs again from after the checkpoint, in generation 1.
    state = env.wait(session, lambda s: s.finished and s.generation == 1)
    assert {"tool-2", "llm-3", "undo.tool-2"} <= set(state.abandoned)
    assert set(state.tool_calls) == {"r1.tool-2"} and state.tool_calls["r1.tool-2"].status.value == "completed"
    history = env.history(session)
    assert len(started_calls(history, "cancel_booking")) == 1, "the cancellation ran once"
    bookings = env.ledger("bookings", session)
    assert [b["status"] for b in bookings] == ["cancelled", "booked"]
    # Restoring it again to the same checkpoint now has the new booking to undo; the old one is history.
    again = env.logctl("restore", session, "--to", "ckpt-1", "--dry-run")
    assert "cancel_booking for r1.tool-2" in again.output, again.output


def test_checkpoint_snapshot_and_replay_agree(env: Env) -> None:
    session = f"snap-{uuid.uuid4().hex[:6]}"
    env.request(session, [LLM, {"tool": "echo", "arguments": {"text": "a"}}, LLM, LLM])
    env.wait(session, finished)
    taken = env.logctl("checkpoint", session, "--id", "after-finish", "--json")
    assert taken.exit_code == 0, taken.output
    body = json.loads(taken.output.strip().splitlines()[-1])
    bad = env.logctl("checkpoint", "no-such-session")
    assert bad.exit_code != 0 and "no session 'no-such-session'" in bad.output

    async def replay() -> tuple[Replayed, Replayed, str]:
        async with (
            open_log(env.pg_url, actor="auditor", namespace=env.namespace) as log,
            SnapshotStore(env.pg_url, env.namespace) as store,
        ):
            snapshot = await store.get(session, "after-finish")
            assert snapshot is not None
            many = await store.get_many({session: "after-finish", "no-such-session": "after-finish"})
            assert list(many) == [session] and many[session].digest == snapshot.digest
            assert await store.get_many({session: "no-such-checkpoint"}) == {}
            from_snapshot = await replay_session(log, store, session)
            full = await replay_session(log, store, session, use_snapshot=False)
            return from_snapshot, full, snapshot.digest

    from_snapshot, full, digest = asyncio.run(replay())
    assert digest == body["state_digest"]
    assert from_snapshot.source == "snapshot after-finish" and full.source == "log"
    assert from_snapshot.num_records < full.num_records
    assert state_to_json(from_snapshot.state) == state_to_json(full.state)
    assert "after-finish" in full.state.checkpoints
    shown = [json.loads(env.logctl("state", session, *flag, "--json").output) for flag in ((), ("--from-start",))]
    assert shown[0]["digest"] == shown[1]["digest"] == state_digest(full.state)
    assert shown[0]["source"] == "snapshot after-finish" and shown[1]["source"] == "log"


def test_replay_from_a_snapshot_trusts_no_record_after_the_cut(env: Env) -> None:
    """A record after the cut that does not chain to the snapshot's tail is left out, as history() does."""
    session = f"tamper-{uuid.uuid4().hex[:6]}"
    env.request(session, [LLM, {"checkpoint": True}, {"tool": "echo", "arguments": {"text": "a"}}, LLM])
    env.wait(session, finished)
    history = env.history(session)
    effects = [e for e in history if e.topic == "agent.effects"]
    checkpoint = env.state(session).checkpoints["ckpt-1"].taken
    after_cut = [e for e in history if e.position.offset >= checkpoint.cut[e.topic]]
    # The forged record would be the next in the effects chain, after genuine records that chain to the snapshot.
    assert any(e.topic == "agent.effects" for e in after_cut)
    next_seq = max(e.seq for e in effects) + 1

    async def forge_and_replay() -> tuple[Replayed, Replayed]:
        async with (
            open_log(env.pg_url, actor="executor", namespace=env.namespace) as log,
            SnapshotStore(env.pg_url, env.namespace) as store,
        ):
            # A completion for a call that never ran: the right next seq, a prev_hash that is not the last record's.
            forged = ev.ToolCallCompleted(call_id="tool-9", result_json="{}", result_tokens=1, duration_ms=0)
            record, _ = log.codec.encode(
                event_id="forged",
                session_id=session,
                seq=next_seq,
                actor="executor",
                occurred_at=datetime.now(UTC),
                causation_id=None,
                prev_hash=bytes(32),
                body=forged,
            )
            out = [OutRecord(log.partition_for(session), session.encode(), record)]
            await (await log.backend.produce("agent.effects", out))
            return await replay_session(log, store, session), await replay_session(
                log, store, session, use_snapshot=False
            )

    from_snapshot, full = asyncio.run(forge_and_replay())
    assert from_snapshot.source == "snapshot ckpt-1"
    assert "tool-9" not in from_snapshot.state.early and "tool-9" not in full.state.early
    assert "forged" not in from_snapshot.state.applied
    assert from_snapshot.num_records == len(after_cut), "every genuine record after the cut, and not the forged one"
    assert state_to_json(from_snapshot.state) == state_to_json(full.state)


def _snapshot_sql(env: Env, sql: str, *args: Any) -> list[asyncpg.Record]:
    async def go() -> list[asyncpg.Record]:
        conn = await asyncpg.connect(env.pg_url)
        try:
            return list(await conn.fetch(sql, *args))
        finally:
            await conn.close()

    return asyncio.run(go())


def _replay_both_ways(env: Env, session: str) -> tuple[Replayed, Replayed]:
    async def go() -> tuple[Replayed, Replayed]:
        async with (
            open_log(env.pg_url, actor="auditor", namespace=env.namespace) as log,
            SnapshotStore(env.pg_url, env.namespace) as store,
        ):
            return await replay_session(log, store, session), await replay_session(
                log, store, session, use_snapshot=False
            )

    return asyncio.run(go())


def test_a_snapshot_that_lost_its_digest_is_not_trusted(env: Env) -> None:
    session = f"bad-{uuid.uuid4().hex[:6]}"
    env.request(session, [LLM, {"checkpoint": True}, LLM])
    env.wait(session, finished)
    _snapshot_sql(
        env,
        "UPDATE agentlog_snapshots.snapshots SET state = jsonb_set(state, '{output_json}', '\"forged\"') "
        "WHERE namespace = $1 AND session_id = $2",
        env.namespace,
        session,
    )
    replayed, full = _replay_both_ways(env, session)
    assert replayed.source == "log", "a snapshot whose state no longer has its digest is ignored"
    assert full.state.output_json is not None and replayed.state.output_json == full.state.output_json
    assert state_to_json(replayed.state) == state_to_json(full.state)


def test_a_snapshot_rewritten_with_a_matching_digest_is_not_trusted(env: Env) -> None:
    """The row's own digest column vouches for nothing: the CheckpointTaken on the log does."""
    session = f"rw-{uuid.uuid4().hex[:6]}"
    env.request(session, [LLM, {"checkpoint": True}, LLM])
    env.wait(session, finished)
    where = "WHERE namespace = $1 AND session_id = $2"
    (row,) = _snapshot_sql(env, f"SELECT state FROM agentlog_snapshots.snapshots {where}", env.namespace, session)
    # Marked cancel-requested at the checkpoint: nothing after the cut clears it, so trusting it shows.
    state = {**json.loads(row["state"]), "cancel_requested": True}
    _snapshot_sql(
        env,
        f"UPDATE agentlog_snapshots.snapshots SET state = $3, digest = $4 {where}",
        env.namespace,
        session,
        json.dumps(state),
        json_digest(state),
    )
    (row,) = _snapshot_sql(
        env, f"SELECT state, digest FROM agentlog_snapshots.snapshots {where}", env.namespace, session
    )
    assert json_digest(json.loads(row["state"])) == row["digest"], "the row is consistent with itself"
    replayed, full = _replay_both_ways(env, session)
    assert replayed.source == "log", "a snapshot whose digest is not its CheckpointTaken's is ignored"
    assert not full.state.cancel_requested and not replayed.state.cancel_requested
    assert state_to_json(replayed.state) == state_to_json(full.state)


def test_automatic_checkpoints_every_n_events(pg_url: str, namespace: str, tmp_path: Path) -> None:
    ensure_topics(pg_url, namespace=namespace)
    extra = {"AGENTLOG_LEDGER_URL": pg_url, "AGENTLOG_NAMESPACE": namespace, "AGENTLOG_CHECKPOINT_EVERY": "10"}
    with Stack(pg_url, tmp_path, time_scale=0.05, extra_env=extra) as stack:
        env = Env(pg_url, namespace, stack)
        session = f"auto-{uuid.uuid4().hex[:6]}"
        env.request(session, [LLM, {"tool": "echo", "arguments": {"text": "a"}}] * 4 + [LLM])
        state = env.wait(session, finished)

        async def count() -> int:
            async with SnapshotStore(pg_url, namespace) as store:
                return await store.count(session)

        automatic = [c for c in state.checkpoints if c.startswith("auto-")]
        assert len(automatic) >= 2, state.checkpoints
        assert asyncio.run(count()) == len(state.checkpoints)
        shown = [json.loads(env.logctl("state", session, *flag, "--json").output) for flag in ((), ("--from-start",))]
        assert shown[0]["digest"] == shown[1]["digest"] and shown[0]["source"].startswith("snapshot auto-")


def test_fork_reuses_the_parent_prefix_and_never_reruns_its_effects(env: Env) -> None:
    parent = f"par-{uuid.uuid4().hex[:6]}"
    steps: list[dict[str, Any]] = [
        {"llm": {"prompt_tokens": 256, "output_tokens": 8}},
        {"tool": "book", "arguments": {"resource": "suite-1"}},
        {"checkpoint": True},
        {"llm": {"prompt_tokens": 32, "output_tokens": 4}},
    ]
    env.request(parent, steps)
    env.wait(parent, finished)
    child = f"{parent}-child"
    bad = env.logctl("fork", parent, "--at", "nope", "--as", child)
    assert bad.exit_code != 0 and "has no checkpoint 'nope'" in bad.output
    forked = env.logctl("fork", parent, "--at", "ckpt-2", "--as", child)
    assert forked.exit_code == 0, forked.output
    state = env.wait(child, finished)
    assert state.parent_session_id == parent and state.fork is not None and state.fork.checkpoint_id == "ckpt-2"
    history = env.history(child)
    assert not started_calls(history, "book"), "the fork never runs its parent's effects"
    assert len(env.ledger("bookings", parent)) == 1 and not env.ledger("bookings", child)
    first = next(e.body for e in history if isinstance(e.body, ev.LLMCallCompleted))
    assert first.call_id == "llm-3"
    assert first.cached_tokens >= 256, f"the fork's first call recomputed its parent's prefix: {first}"
    assert json.loads(state.output_json or "{}")["tools"][0]["tool"] == "book"  # inherited, as history
    # Re-running the fork's program needs its parent's history up to the fork point too.
    checked = env.logctl("replay", child, "--check")
    assert checked.exit_code == 0 and "deterministic, matches the log" in checked.output, checked.output


def test_a_program_forks_itself_and_merges_its_branches(env: Env) -> None:
    parent = f"fan-{uuid.uuid4().hex[:6]}"
    branches = [
        {"steps": [{"tool": "echo", "arguments": {"text": "plan a"}}, LLM]},
        {"steps": [{"tool": "echo", "arguments": {"text": "plan b"}}, LLM]},
        {"steps": [LLM]},
    ]
    env.request(parent, [{"llm": {"prompt_tokens": 128, "output_tokens": 8}}, {"fork": branches}, LLM])
    state = env.wait(parent, finished, timeout_s=90)
    ids = [f"{parent}.fork-1.{i}" for i in range(3)]
    assert state.planner_steps["fork-1"].result is not None
    assert sorted(state.planner_steps["fork-1"].result) == ids
    merged = [e.body for e in env.history(parent) if isinstance(e.body, ev.MergeApplied)]
    assert len(merged) == 1 and merged[0].branch_session_ids == ids
    output = json.loads(state.output_json or "{}")
    assert output["tools"][0]["tool"] == "merge" and output["tools"][0]["ok"]
    for branch in ids:
        history = env.history(branch)
        first = next(e.body for e in history if isinstance(e.body, ev.LLMCallCompleted))
        assert first.cached_tokens >= 128, f"{branch} did not reuse the parent's prefix"


def test_merge_conflicts_on_a_shared_resource_and_merges_cleanly_otherwise(env: Env) -> None:
    parent = f"mp-{uuid.uuid4().hex[:6]}"
    env.request(parent, [LLM, {"checkpoint": True}, LLM])
    env.wait(parent, finished)
    a, b, c = (f"{parent}-{x}" for x in "abc")
    for child in (a, b, c):
        assert env.logctl("fork", parent, "--at", "ckpt-1", "--as", child, "--no-wait").exit_code == 0
    # Each fork runs the same script: to make them differ, they book on their own.
    for child in (a, b, c):
        env.wait(child, finished)
    merged = env.logctl("merge", parent, "--from", a, "--from", b, "--json")
    assert merged.exit_code == 0, merged.output
    results = json.loads(merged.output.strip().splitlines()[-1])["results"]
    assert set(results) == {a, b}

    booker = f"bk-{uuid.uuid4().hex[:6]}"
    book = {"tool": "book", "arguments": {"resource": "hall-1"}}
    env.request(booker, [LLM, {"fork": [{"steps": [book]}, {"steps": [book]}]}, LLM])
    state = env.wait(booker, finished, timeout_s=90)
    step = state.planner_steps["fork-1"]
    assert step.error is not None and "book:hall-1" in step.error
    (conflict,) = [e.body for e in env.history(booker) if isinstance(e.body, ev.MergeConflict)]
    assert conflict.resources == ["book:hall-1"]
    assert all(f"{booker}.fork-1.{i}" in conflict.conflicts[0] for i in range(2))
    unknown = env.logctl("merge", parent, "--from", "ghost-branch")
    assert unknown.exit_code != 0 and "no branch session 'ghost-branch'" in unknown.output


def test_two_sessions_merging_each_other_get_a_merge_conflict_instead_of_waiting_forever(env: Env) -> None:
    a, b = (f"cy-{uuid.uuid4().hex[:6]}-{x}" for x in "ab")
    for session in (a, b):
        payment = {"tool": "payment", "arguments": {"account": f"acct-{session}", "amount_cents": 5}}
        env.request(session, [LLM, payment, LLM])  # held at the payment until approved: both stay unfinished
        env.wait(session, lambda s: "tool-1" in s.tool_calls, approve=False)
    for parent, branch in ((a, b), (b, a)):
        assert env.logctl("merge", parent, "--from", branch, "--no-wait").exit_code == 0
    states = {s: env.wait(s, finished, timeout_s=90) for s in (a, b)}  # approves the payments
    conflicts = [c for s in states.values() for c in s.merge_conflicts]
    merges = [m for s in states.values() for m in s.merges]
    # Whichever merge the planner looks at first sees the other waiting for it: that one is refused,
    # the other waits for its branch to finish and applies.
    assert len(conflicts) == 1 and len(merges) == 1, (conflicts, merges)
    assert conflicts[0].conflicts[0].startswith("merge cycle: ")
    assert {conflicts[0].branch_session_ids[0], merges[0].branch_session_ids[0]} == {a, b}


def test_on_kafka_a_fork_reuses_the_prefix_and_its_restore_compensates_its_own_booking(kafka_env: Env) -> None:
    env = kafka_env
    parent = f"kp-{uuid.uuid4().hex[:6]}"
    steps: list[dict[str, Any]] = [
        {"llm": {"prompt_tokens": 160, "output_tokens": 8}},
        {"checkpoint": True},
        {"tool": "book", "arguments": {"resource": "k-1"}},
        LLM,
    ]
    env.request(parent, steps)
    env.wait(parent, finished, timeout_s=90)
    child = f"{parent}-f"
    assert env.logctl("fork", parent, "--at", "ckpt-1", "--as", child).exit_code == 0
    state = env.wait(child, finished, timeout_s=90)
    first = next(e.body for e in env.history(child) if isinstance(e.body, ev.LLMCallCompleted))
    assert first.cached_tokens >= 160 and first.call_id == "llm-3"
    assert "llm-0" not in state.llm_calls, "the fork's log holds its own events only: its history is by reference"
    # The fork booked on its own (its step 2 is after the fork point); restoring it undoes only that.
    assert env.logctl("checkpoint", child, "--id", "end").exit_code == 0
    restored = env.logctl("restore", child, "--to", "ckpt-1", "--json")
    assert restored.exit_code == 0, restored.output
    assert json.loads(restored.output.strip().splitlines()[-1])["compensated_call_ids"] == ["tool-2"]
    env.wait(child, lambda s: s.finished and s.generation == 1, timeout_s=90)
    assert [b["status"] for b in env.ledger("bookings", child)] == ["cancelled", "booked"]
    assert [b["status"] for b in env.ledger("bookings", parent)] == ["booked"], "the parent's booking is untouched"
