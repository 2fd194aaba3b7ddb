"""Role workers recover from partition marks and snapshots instead of replaying from offset 0.

Real workers (planner, decider, executor, in this process) on a real log (Kafka, and
Postgres) with the snapshot store in Postgres and the simulated engine as a process.
Many short sessions finish; a few long ones take automatic checkpoints and stop at a
payment held for an operator's approval. Then:

- each role's group is read again by a passive reader (a worker that acts on nothing)
  from its marks, and by one from offset 0: the first reads far fewer records, and its
  fold of every unfinished session equals the from-0 fold (and, for the roles that read
  every session topic, the fold of the session's whole history);
- the real workers restart from their marks, the payments are approved, and the
  sessions finish having done the residual work exactly once (no LLM call, tool call or
  payment run again; counted on the log, the engine and the ledger);
- marks that lie (a start above records still needed, a checkpoint without a snapshot)
  and a tampered snapshot never give a wrong fold: those sessions are loaded from the log;
- a session that finished before the restart (so below the marks) and is restored by an
  operator after it is loaded by each role when the restore's events reach it, and runs again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from cli.common import ensure_topics
from cli.stack import Stack
from log import SharedLog, open_log
from log.snapshots import SnapshotStore
from log.types import PartitionMark
from schemas import events as ev
from services.checkpoint import fold_events, state_to_json
from services.marks import needs_work
from services.replay import cut_events
from services.session import SessionState
from workers.decider import DeciderWorker
from workers.engines.factory import create_engine
from workers.executor import ExecutorWorker
from workers.planner import PlannerWorker
from workers.runtime import SessionWorker
from workers.tools import Ledger

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NUM_SHORT = 24
NUM_LONG = 2
LONG_TURNS = 24  # LLM call + echo per turn, before the payment
LLM: dict[str, Any] = {"llm": {"prompt_tokens": 32, "output_tokens": 4}}
ROLES: tuple[type[SessionWorker], ...] = (PlannerWorker, DeciderWorker, ExecutorWorker)
EVERY_TOPIC = {"agent.actions", "agent.verdicts", "agent.effects", "ops.commands"}


def short_steps(i: int) -> list[dict[str, Any]]:
    return [LLM, {"tool": "echo", "arguments": {"text": f"short {i}"}}, LLM]


def long_steps(i: int) -> list[dict[str, Any]]:
    turns = [s for t in range(LONG_TURNS) for s in (LLM, {"tool": "echo", "arguments": {"text": f"{i}/{t}"}})]
    payment = {"tool": "payment", "arguments": {"account": f"marks-{i}", "amount_cents": 500 + i}}
    return [*turns, payment, LLM, LLM]


class Reader(SessionWorker):
    """A worker that folds and never acts: what a role's recovery rebuilds, without the acting."""


async def recover(log: SharedLog, store: SnapshotStore | None, role: type[SessionWorker], group: str) -> Reader:
    reader = Reader(log, group=group, snapshots=store)
    reader.topics = role.topics
    reader.role = role.role
    reader.acts_on = role.acts_on  # the marks it saves on stopping are the role's
    running = asyncio.create_task(reader.run())
    await until(lambda: reader.caught_up, f"{group} caught up")
    reader.shutdown()
    await running
    return reader


async def until(check: Any, what: str, timeout_s: float = 120) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        await asyncio.sleep(0.1)


def records_read(worker: SessionWorker) -> int:
    """Records decoded during the replay: by the consumer, to rebuild chains, and to load sessions."""
    assert worker.consumer is not None
    reads = worker.consumer.reads
    return reads.decoded + reads.rebuilt + worker.recovery.loaded_records


@dataclass
class World:
    log_url: str
    pg_url: str
    namespace: str
    engine_url: str
    tmp: Path

    def open(self, actor: str) -> SharedLog:
        return open_log(self.log_url, actor=actor, namespace=self.namespace)

    async def fold(self, log: SharedLog, session: str) -> SessionState:
        return fold_events(session, cut_events(await log.history(session)))

    async def workers(self, store: SnapshotStore, logs: dict[str, SharedLog], ledger: Ledger) -> list[SessionWorker]:
        engine = create_engine(self.engine_url, engine_id="sim-0", kind="sim")
        return [
            PlannerWorker(logs["planner"], engine=engine, checkpoint_every=30, snapshots=store, mark_every=50),
            DeciderWorker(logs["decider"], snapshots=store, mark_every=50),
            ExecutorWorker(
                logs["executor"], ledger=ledger, sandbox=self.tmp / "sandbox", time_scale=0.05, snapshots=store,
                mark_every=50,
            ),
        ]  # fmt: skip


async def scenario(world: World, *, kill: bool) -> dict[str, Any]:
    """``kill``: phase 1 ends like a SIGKILL (no last mark: the marks are the periodic ones)."""
    run = uuid.uuid4().hex[:6]
    shorts = [f"short-{run}-{i}" for i in range(NUM_SHORT)]
    longs = [f"long-{run}-{i}" for i in range(NUM_LONG)]
    logs = {role: await world.open(role).start() for role in ("planner", "decider", "executor", "operator")}
    store = await SnapshotStore(world.pg_url, world.namespace).start()
    ledger = await Ledger(world.pg_url).start()
    operator = logs["operator"]
    report: dict[str, Any] = {}
    try:
        # ---- phase 1: the work up to the held payments, then a clean stop (marks saved)
        workers = await world.workers(store, logs, ledger)
        tasks = [asyncio.create_task(w.run()) for w in workers]
        for i, session in enumerate(longs):
            args = json.dumps({"steps": long_steps(i)})
            await operator.append(session, ev.SessionRequested(program="script", args_json=args, author="t"))
        for i, session in enumerate(shorts):
            args = json.dumps({"steps": short_steps(i)})
            await operator.append(session, ev.SessionRequested(program="script", args_json=args, author="t"))
        states: dict[str, SessionState] = {}

        async def settled() -> bool:
            for s in shorts + longs:
                states[s] = await world.fold(operator, s)
            held = all("tool-48" in states[s].tool_calls for s in longs)
            return held and all(states[s].finished for s in shorts)

        loop = asyncio.get_running_loop()
        deadline = loop.time() + 180
        while not await settled():
            assert loop.time() < deadline, {s: states[s].status for s in states}
            await asyncio.sleep(0.3)
        if kill:
            for task in [*tasks, *(t for w in workers for t in w._tasks)]:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        else:
            for worker in workers:
                worker.shutdown()
            await asyncio.gather(*tasks)
        await workers[0].engine.close()  # type: ignore[attr-defined]  # (close() would close the shared store)
        engine_calls_before = workers[0].num_engine_calls  # type: ignore[attr-defined]
        for s in longs:
            assert len(states[s].checkpoints) >= 2, "automatic checkpoints along the long sessions"
            assert states[s].tool_calls["tool-48"].status.value == "proposed"
        honest = {
            role.role: [m for p in range(4) if (m := await store.load_mark(role.role, p)) is not None] for role in ROLES
        }
        assert all(len(marks) == 4 for marks in honest.values()), "every partition is marked once caught up"

        # ---- phase 2: the same recovery from the marks and from offset 0, side by side
        for role in ROLES:
            log = logs[role.role]
            marked = await recover(log, store, role, role.role)
            zero = await recover(log, None, role, f"{role.role}-zero-{run}")
            assert marked.recovery.marks_used == 4 and zero.recovery.marks_used == 0
            assert zero.consumer is not None and zero.consumer.reads.rebuilt == 0
            unfinished = sorted(s for s, st in zero.sessions.items() if needs_work(st, role.acts_on))
            assert set(longs) <= set(unfinished)
            for session in unfinished:
                got = marked.sessions[session]
                if set(role.topics) >= EVERY_TOPIC:
                    assert state_to_json(got) == state_to_json(zero.sessions[session]), (role.role, session)
                    assert state_to_json(got) == state_to_json(await world.fold(log, session)), (role.role, session)
                else:  # the decider reads no effects; a snapshot holds them: the same calls, the same proposals
                    calls = zero.sessions[session].tool_calls
                    assert set(got.tool_calls) == set(calls)
                    proposed = {c for c, t in calls.items() if t.status.value == "proposed"}
                    assert proposed == {c for c, t in got.tool_calls.items() if t.status.value == "proposed"}
            assert marked.recovery.distrusted == 0
            assert marked.consumer is not None and marked.consumer.stats.num_dead_lettered == 0
            report[role.role] = (records_read(zero), records_read(marked), marked.recovery)
            if kill:  # the newest periodic mark may be older than the newest checkpoints: less gain
                assert records_read(marked) < records_read(zero), report[role.role]
            else:
                assert marked.recovery.from_snapshot >= NUM_LONG, marked.recovery
                assert records_read(marked) * 3 < records_read(zero), report[role.role]

        # ---- phase 3: the real workers restart from their marks and finish the residual work once
        workers = await world.workers(store, logs, ledger)
        tasks = [asyncio.create_task(w.run()) for w in workers]
        await until(lambda: all(w.caught_up for w in workers), "restarted workers caught up")
        for worker in workers:
            assert worker.recovery.marks_used == 4, (worker.role, worker.recovery)
            assert records_read(worker) * 3 < report[worker.role][0], (worker.role, records_read(worker))
        for s in longs:
            approval = ev.ApprovalGiven(
                call_id="tool-48", decision=ev.ApprovalDecision.APPROVE, author="t", reason="marks test"
            )
            await operator.append(s, approval)
        deadline = loop.time() + 120
        while not all([(await world.fold(operator, s)).finished for s in longs]):
            assert loop.time() < deadline
            await asyncio.sleep(0.3)
        for worker in workers:
            worker.shutdown()
        await asyncio.gather(*tasks)
        await workers[0].engine.close()  # type: ignore[attr-defined]
        planner, _decider, executor = workers
        assert planner.num_engine_calls == 2 * NUM_LONG, "the two LLM calls after each payment, nothing again"  # type: ignore[attr-defined]
        assert executor.num_executed == NUM_LONG, "the payments, and no tool call again"  # type: ignore[attr-defined]
        assert engine_calls_before == NUM_SHORT * 2 + NUM_LONG * LONG_TURNS
        for s in shorts + longs:
            history = await operator.history(s)
            counts = Counter(
                (type(e.body).__name__, getattr(e.body, "call_id", getattr(e.body, "checkpoint_id", "")))
                for e in history
            )
            twice = {k: n for k, n in counts.items() if n > 1}
            assert not twice, (s, twice)
            assert (await world.fold(operator, s)).status is not None and (await world.fold(operator, s)).finished
        conn = await asyncpg.connect(world.pg_url)
        try:
            rows = await conn.fetch(
                "SELECT session_id FROM agentlog_ledger.payments WHERE session_id = ANY($1::text[])", longs
            )
        finally:
            await conn.close()
        assert sorted(r["session_id"] for r in rows) == sorted(longs), "one payment per long session"

        # ---- lying marks and a tampered snapshot: slower, never wrong
        await lying_marks(world, logs["executor"], store, honest["executor"], longs, run)
        return report
    finally:
        await ledger.close()
        await store.close()
        for log in logs.values():
            await log.close()


async def lying_marks(
    world: World, log: SharedLog, store: SnapshotStore, honest: list[PartitionMark], longs: list[str], run: str
) -> None:
    """Marks copied from the executor's honest ones (made while the long sessions were held),
    read by passive executors of other groups, against the fold of each session's whole log."""
    ends = {t: await log.end_offsets(t) for t in ExecutorWorker.topics}

    async def check(name: str, marks: list[PartitionMark]) -> Reader:
        group = f"executor-{name}-{run}"
        for mark in marks:
            await store.save_mark(group, mark)
        reader = await recover(log, store, ExecutorWorker, group)
        for session in longs:
            assert state_to_json(reader.sessions[session]) == state_to_json(await world.fold(log, session)), name
        assert reader.consumer is not None and reader.consumer.stats.num_dead_lettered == 0
        return reader

    # A start far above the long sessions' records, claiming they begin there (no snapshot): their
    # records after it do not begin their chains (seq > 0), so they are loaded from the log.
    high = [
        PartitionMark(
            m.partition,
            {t: ends[t][m.partition] - 3 if ends[t][m.partition] > 3 else 0 for t in m.start},
            m.read_to,
            {s: None for s in m.sessions},
        )
        for m in honest
    ]
    reader = await check("high", high)
    assert reader.recovery.loaded >= NUM_LONG and reader.recovery.from_snapshot == 0
    # A checkpoint that has no snapshot: the session is skipped while reading, loaded at catch-up.
    ghost = [PartitionMark(m.partition, m.start, m.read_to, dict.fromkeys(m.sessions, "no-such")) for m in honest]
    reader = await check("ghost", ghost)
    assert reader.recovery.loaded >= NUM_LONG
    # The honest marks, with the long sessions' snapshots rewritten: not trusted, loaded from the log.
    conn = await asyncpg.connect(world.pg_url)
    try:
        await conn.execute(
            "UPDATE agentlog_snapshots.snapshots SET state = jsonb_set(state, '{output_json}', '\"forged\"') "
            "WHERE namespace = $1 AND session_id = ANY($2::text[])",
            world.namespace,
            longs,
        )
    finally:
        await conn.close()
    reader = await check("tampered", honest)
    assert reader.recovery.distrusted >= NUM_LONG and reader.recovery.from_snapshot == 0


@contextlib.contextmanager
def world_with_engine(
    log_url: str, pg_url: str, namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[World]:
    """A fresh namespace of the log and a sim engine process (the workers run in this process)."""
    monkeypatch.setenv("AGENTLOG_NAMESPACE", namespace)
    ensure_topics(log_url, namespace=namespace)
    stack = Stack(log_url, tmp_path, time_scale=0.05)
    stack.work_dir.mkdir(parents=True, exist_ok=True)
    from cli.stack import free_port

    stack.engine_port = free_port()
    stack.start_process("engine")
    try:
        stack.wait_for_engine(30)
        yield World(log_url, pg_url, namespace, stack.engine_url, tmp_path)
    finally:
        stack.stop()


def run_world(
    log_url: str, pg_url: str, namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, kill: bool
) -> None:
    with world_with_engine(log_url, pg_url, namespace, tmp_path, monkeypatch) as world:
        report = asyncio.run(scenario(world, kill=kill))
        for role, (zero, marked, recovery) in report.items():
            print(f"{role}: {zero} records from offset 0, {marked} from marks ({recovery})")


@pytest.mark.parametrize("stop", ["clean", "kill"])
def test_workers_recover_from_marks_on_kafka(
    stop: str, kafka_bootstrap: str, pg_url: str, namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_world(f"kafka://{kafka_bootstrap}", pg_url, namespace, tmp_path, monkeypatch, kill=stop == "kill")


@pytest.mark.parametrize("stop", ["clean", "kill"])
def test_workers_recover_from_marks_on_postgres(
    stop: str, pg_url: str, namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_world(pg_url, pg_url, namespace, tmp_path, monkeypatch, kill=stop == "kill")


async def restore_after_restart(world: World) -> None:
    """A session that finished before the workers stopped is not in their marks; an operator's
    restore of it after the restart makes each role load it from the log, and the restore runs."""
    session = f"restored-{uuid.uuid4().hex[:6]}"
    steps = [LLM, {"checkpoint": True}, {"tool": "echo", "arguments": {"text": "again"}}, LLM]
    logs = {role: await world.open(role).start() for role in ("planner", "decider", "executor", "operator")}
    store = await SnapshotStore(world.pg_url, world.namespace).start()
    ledger = await Ledger(world.pg_url).start()
    operator = logs["operator"]
    try:
        workers = await world.workers(store, logs, ledger)
        tasks = [asyncio.create_task(w.run()) for w in workers]
        args = json.dumps({"steps": steps})
        await operator.append(session, ev.SessionRequested(program="script", args_json=args, author="t"))
        await until_folded(world, operator, session, lambda s: s.finished)
        for worker in workers:
            worker.shutdown()
        await asyncio.gather(*tasks)
        await workers[0].engine.close()  # type: ignore[attr-defined]
        partition = operator.partition_for(session)
        for role in ROLES:
            mark = await store.load_mark(role.role, partition)
            assert mark is not None and session not in mark.sessions, "finished: not in the mark"

        workers = await world.workers(store, logs, ledger)
        tasks = [asyncio.create_task(w.run()) for w in workers]
        await until(lambda: all(w.caught_up for w in workers), "restarted workers caught up")
        assert all(session not in w.sessions for w in workers), "below the marks: never read"
        await operator.append(session, ev.RestoreRequested(author="t", checkpoint_id="ckpt-1", dry_run=False))
        state = await until_folded(world, operator, session, lambda s: s.generation == 1 and s.finished)
        for worker in workers:
            worker.shutdown()
        await asyncio.gather(*tasks)
        await workers[0].engine.close()  # type: ignore[attr-defined]
        assert {"r1.tool-2", "r1.llm-3"} <= set(state.tool_calls) | set(state.llm_calls)
        assert state.tool_calls["r1.tool-2"].status.value == "completed"
        planner, decider, executor = workers
        assert planner.recovery.loaded == 1 and decider.recovery.loaded == 1 and executor.recovery.loaded == 1
        assert planner.num_engine_calls == 1 and executor.num_executed == 1  # type: ignore[attr-defined]
        # The executor's fold (its own appends folded at once carry no time of their own that matters)
        # is the log's; the planner's own appends carry their local time until read back.
        assert state_to_json(executor.sessions[session]) == state_to_json(await world.fold(logs["executor"], session))
    finally:
        await ledger.close()
        await store.close()
        for log in logs.values():
            await log.close()


async def until_folded(world: World, log: SharedLog, session: str, check: Any, timeout_s: float = 60) -> SessionState:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not check(state := await world.fold(log, session)):
        assert loop.time() < deadline, state
        await asyncio.sleep(0.2)
    return state


def test_a_finished_session_restored_after_a_restart_is_loaded_when_its_restore_arrives(
    pg_url: str, namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with world_with_engine(pg_url, pg_url, namespace, tmp_path, monkeypatch) as world:
        asyncio.run(restore_after_restart(world))
