"""Residual completion with real processes on a real Kafka broker: kill any worker anywhere.

Each scenario starts the stack (sim engine, planner, decider, executor) as OS
processes, arms one crash point (a SIGKILL at a chosen place: before or after
an append, before or after a tool runs), runs sessions that call the LLM, run
tools and make irreversible payments, restarts whatever died, and checks:

- every session finishes;
- the engine computed exactly the distinct LLM calls the programs needed
  (a retried request id is answered from the engine's record, never recomputed);
- the payments ledger holds no duplicate, and every payment that a session
  completed is in it exactly once;
- an irreversible call caught mid-flight is reported in doubt and resolved by
  the operator command.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest

from bench.chaos_lib import Operator
from cli.common import ensure_topics
from cli.sessions import SessionBook
from cli.stack import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NUM_SESSIONS = 4


class Scenario(Operator):
    """The operator loop of bench/chaos_lib.py on a stack of this test's own, on the shared broker."""

    def __init__(self, kafka: str, namespace: str, pg_url: str, work: Path) -> None:
        log_url = f"kafka://{kafka}"
        env = {"AGENTLOG_NAMESPACE": namespace, "AGENTLOG_LEDGER_URL": pg_url, "AGENTLOG_LOG_LEVEL": "INFO"}
        stack = Stack(log_url, work, time_scale=1.0, extra_env=env)
        super().__init__(
            log_url, namespace, pg_url, stack, [f"s{i}-{uuid.uuid4().hex[:4]}" for i in range(NUM_SESSIONS)]
        )

    def drive(self, deadline_s: float = 150) -> tuple[SessionBook, list[str]]:
        """Watch the log like an operator: approve held payments, resolve in-doubt calls, restart the dead."""
        return asyncio.run(self.operate(deadline_s))


CRASH_POINTS = [
    ("engine", "engine.before_record:3"),
    ("engine", "engine.after_record:5"),
    ("planner-0", "planner.after_llm_started:2"),
    ("planner-0", "planner.after_engine:3"),
    ("planner-0", "planner.after_llm_completed:4"),
    ("planner-0", "planner.after_proposed:2"),
    ("decider", "decider.before_verdict:3"),
    ("decider", "decider.after_verdict:2"),
    ("executor", "executor.before_started:2"),
    ("executor", "executor.after_started.sleep:2"),
    ("executor", "executor.after_tool.sleep:1"),
    ("executor", "executor.after_started.payment:1"),
    ("executor", "executor.after_tool.payment:2"),
    ("executor", "executor.after_completed:3"),
]


@pytest.mark.parametrize(("victim", "crash_at"), CRASH_POINTS, ids=[c for _, c in CRASH_POINTS])
def test_kill_anywhere_and_complete_exactly_once(
    victim: str, crash_at: str, kafka_bootstrap: str, namespace: str, pg_url: str, tmp_path: Path
) -> None:
    scenario = Scenario(kafka_bootstrap, namespace, pg_url, tmp_path)
    _ensure_topics_in(scenario)
    stack = scenario.stack
    stack.engine_port = 0
    stack.work_dir.mkdir(parents=True, exist_ok=True)
    from cli.stack import free_port

    stack.engine_port = free_port()
    stack.start_process("engine")
    stack.wait_for_engine(30)
    if victim == "engine":
        stack.processes["engine"].stop()
        stack.start_process("engine", {"AGENTLOG_CRASH_AT": crash_at})
        stack.wait_for_engine(30)
    for name in ("decider", "executor", "planner-0"):
        stack.start_process(name, {"AGENTLOG_CRASH_AT": crash_at} if name == victim else None)
    try:
        asyncio.run(scenario.request_all())
        book, resolved = scenario.drive()
        crashed_log = stack.processes[victim].log_path.read_text(errors="replace")
        assert f"crash point {crash_at.split(':')[0]} reached" in crashed_log, "the crash point was never reached"
        for session in scenario.sessions:
            state = book.records[session].state
            assert state.status is not None and state.status.value == "finished", (session, state.status, state.failure)
            assert not state.anomalies, state.anomalies
        distinct_llm_calls = sum(len(book.records[s].state.llm_calls) for s in scenario.sessions)
        assert distinct_llm_calls == NUM_SESSIONS * 3
        assert scenario.engine_stats()["num_served"] == distinct_llm_calls
        payments = asyncio.run(scenario.payments())
        assert all(count == 1 for _, count in payments), f"duplicate payments: {payments}"
        assert len(payments) == NUM_SESSIONS
        if crash_at.startswith(("executor.after_started.payment", "executor.after_tool.payment")):
            assert resolved, "an irreversible call caught mid-flight must be reported in doubt"
    finally:
        stack.stop()


def _ensure_topics_in(scenario: Scenario) -> None:
    ensure_topics(scenario.log_url, namespace=scenario.namespace)


def test_two_planners_split_partitions_and_a_dead_ones_sessions_move(
    kafka_bootstrap: str, namespace: str, pg_url: str, tmp_path: Path
) -> None:
    scenario = Scenario(kafka_bootstrap, namespace, pg_url, tmp_path)
    scenario.sessions = [f"split{i}-{uuid.uuid4().hex[:4]}" for i in range(8)]
    _ensure_topics_in(scenario)
    stack = scenario.stack
    from cli.stack import free_port

    stack.engine_port = free_port()
    stack.work_dir.mkdir(parents=True, exist_ok=True)
    stack.start_process("engine")
    stack.wait_for_engine(30)
    for name in ("decider", "executor", "planner-0", "planner-1"):
        stack.start_process(name)
    try:
        # Both planners own partitions before any session starts.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            logs = [stack.processes[p].log_path.read_text(errors="replace") for p in ("planner-0", "planner-1")]
            if all("caught up" in text for text in logs):
                break
            time.sleep(0.3)
        else:
            raise AssertionError("the two planners did not both get partitions")
        asyncio.run(scenario.request_all())
        time.sleep(2.0)
        stack.processes["planner-1"].kill()  # its partitions must move to planner-0
        del stack.processes["planner-1"]  # and it is not restarted
        book, _ = scenario.drive()
        assert all(book.records[s].state.status.value == "finished" for s in scenario.sessions)
        taken = stack.processes["planner-0"].log_path.read_text(errors="replace")
        assert {f"partition {p} caught up" in taken for p in range(4)} == {True}
        assert scenario.engine_stats()["num_served"] == sum(
            len(book.records[s].state.llm_calls) for s in scenario.sessions
        )
    finally:
        stack.stop()


# ---------------------------------------------------------------------------- the kafka-python client
# The same scenarios with every process (and this test's own log clients) on kafka-python
# (log/kafka_backend.py, AGENTLOG_KAFKA_CLIENT=python; the tests above run on the default,
# librdkafka): a crash after each role's append, an irreversible call caught mid-flight, and a
# group rebalance after a member dies.

KAFKA_PYTHON_CRASH_POINTS = [
    ("planner-0", "planner.after_llm_completed:4"),
    ("decider", "decider.after_verdict:2"),
    ("executor", "executor.after_started.payment:1"),
]


@pytest.mark.parametrize(
    ("victim", "crash_at"), KAFKA_PYTHON_CRASH_POINTS, ids=[c for _, c in KAFKA_PYTHON_CRASH_POINTS]
)
def test_kill_anywhere_and_complete_exactly_once_on_kafka_python(
    victim: str,
    crash_at: str,
    kafka_bootstrap: str,
    namespace: str,
    pg_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AGENTLOG_KAFKA_CLIENT", "python")  # inherited by every process of the stack
    test_kill_anywhere_and_complete_exactly_once(victim, crash_at, kafka_bootstrap, namespace, pg_url, tmp_path)
    for name in ("decider", "executor", "planner-0"):
        assert "with kafka-python" in (tmp_path / "logs" / f"{name}.log").read_text(errors="replace"), name


def test_two_planners_split_partitions_and_a_dead_ones_sessions_move_on_kafka_python(
    kafka_bootstrap: str, namespace: str, pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTLOG_KAFKA_CLIENT", "python")
    test_two_planners_split_partitions_and_a_dead_ones_sessions_move(kafka_bootstrap, namespace, pg_url, tmp_path)
    assert "with kafka-python" in (tmp_path / "logs" / "planner-0.log").read_text(errors="replace")
