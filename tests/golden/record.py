"""Record the golden logs from real runs of the stack, or recompute what they replay into.

    python -m tests.golden.record [NAME ...]              # run the scenarios, record, replay
    python -m tests.golden.record --expected-only [NAME]  # replay the checked-in logs again

A scenario starts the real processes (sim engine, planner, decider, executor;
the engine bridge and cache manager for ``cache_managed``) on a Postgres log
(``AGENTLOG_PG_URL``) in a fresh namespace, drives them like an operator
(approving held payments, resolving in-doubt calls, restarting what a crash
point killed), waits until the log is quiet, then writes every record of the
namespace to ``tests/golden/NAME.jsonl`` and what it replays into to
``NAME.expected.json`` (``tests/golden/replay.py``). Re-record only when the
log's contents are meant to change; when folding is meant to change, replay
with ``--expected-only`` and review the diff of the expected files.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from cli.common import ensure_topics
from cli.main import app
from cli.stack import Stack, free_port
from log import TOPICS, SharedLog, open_log
from schemas import events as ev
from services.session import SessionState, fold
from tests.golden.replay import FORMAT, HERE, dumps, golden_names, load, record_line, replay

LLM: dict[str, Any] = {"llm": {"prompt_tokens": 64, "output_tokens": 8}}
CACHE = {"gpu_blocks": 96, "host_blocks": 128, "block_size": 16, "engine_id": "sim-0"}
"""The engine's KV capacity in ``cache_managed``, small enough that three sessions' pins press on
it; the engine and the cache manager run with it, and the header keeps it for the replay."""


@dataclass
class Scenario:
    """Sessions to request (session id -> script steps), crash points to arm, and operator steps."""

    sessions: dict[str, list[dict[str, Any]]]
    time_scale: float = 0.05
    crash_at: dict[str, str] = field(default_factory=dict)
    cache_manager: bool = False
    after: Callable[[Driver], None] | None = None
    """Operator commands once the sessions have finished (fork, merge)."""


def fork_and_merge(driver: Driver) -> None:
    """An operator forks ``fan`` at its checkpoint twice and merges both forks back into it."""
    for child in ("fan-a", "fan-b"):
        driver.logctl("fork", "fan", "--at", "ckpt-1", "--as", child)
    for child in ("fan-a", "fan-b"):
        driver.wait(child)
    driver.logctl("merge", "fan", "--from", "fan-a", "--from", "fan-b")


SCENARIOS = {
    # Both kinds of recovery in one session: the planner dies after appending its second
    # LLMCallStarted (the restart asks the engine again under the same request id), the
    # executor dies after ToolCallStarted of the payment (the restart makes it in doubt,
    # and the operator, seeing no payment in the ledger, has it retried).
    "crash_recovered": Scenario(
        sessions={
            "crash-1": [
                {"llm": {"prompt_tokens": 120, "output_tokens": 8}},
                {"tool": "sleep", "arguments": {"seconds": 0.05}},
                {"llm": {"prompt_tokens": 40, "output_tokens": 8}},
                {"tool": "payment", "arguments": {"account": "acct-1", "amount_cents": 250}},
                {"llm": {"prompt_tokens": 30, "output_tokens": 4}},
            ]
        },
        time_scale=1.0,
        crash_at={"planner-0": "planner.after_llm_started:2", "executor": "executor.after_started.payment:1"},
    ),
    # A program that forks itself and merges its branches, one whose branches book the same
    # resource (a merge conflict), and operator forks of a checkpoint merged back.
    "fork_merge": Scenario(
        sessions={
            "fan": [
                {"llm": {"prompt_tokens": 128, "output_tokens": 8}},
                {"checkpoint": True},
                {
                    "fork": [
                        {"steps": [{"tool": "echo", "arguments": {"text": "plan a"}}, LLM]},
                        {"steps": [{"tool": "echo", "arguments": {"text": "plan b"}}, LLM]},
                    ]
                },
                LLM,
            ],
            "booker": [
                LLM,
                {
                    "fork": [
                        {"steps": [{"tool": "book", "arguments": {"resource": "hall-1"}}]},
                        {"steps": [{"tool": "book", "arguments": {"resource": "hall-1"}}]},
                    ]
                },
                LLM,
            ],
        },
        after=fork_and_merge,
    ),
    # Three sessions with tool gaps under the cache manager, on an engine too small to keep
    # all of them: its decisions go to kv.decisions, the engine bridge carries them out and
    # logs the engine's KV events.
    "cache_managed": Scenario(
        sessions={
            f"cache-{i}": [
                {"llm": {"prompt_tokens": 400 + 100 * i, "output_tokens": 16}},
                {"tool": "sleep", "arguments": {"seconds": 1.0 + 0.5 * i}},
                {"llm": {"prompt_tokens": 60, "output_tokens": 8}},
                {"tool": "sleep", "arguments": {"seconds": 0.5}},
                {"llm": {"prompt_tokens": 40, "output_tokens": 8}},
            ]
            for i in range(3)
        },
        time_scale=1.0,
        cache_manager=True,
    ),
}


class Driver:
    """One scenario's stack and namespace, driven like an operator."""

    def __init__(self, pg_url: str, namespace: str, stack: Stack) -> None:
        self.pg_url = pg_url
        self.namespace = namespace
        self.stack = stack
        self.runner = CliRunner()

    def logctl(self, *argv: str) -> str:
        result = self.runner.invoke(app, [*argv, "--log-url", self.pg_url], env={"AGENTLOG_NAMESPACE": self.namespace})
        if result.exit_code not in (0, 1):  # 1: a refusal or a conflict, which the log records too
            raise RuntimeError(f"logctl {' '.join(argv)} failed ({result.exit_code}): {result.output}")
        return result.output

    def open(self, actor: str) -> SharedLog:
        return open_log(self.pg_url, actor=actor, namespace=self.namespace)

    def state(self, session: str) -> SessionState:
        async def go() -> SessionState:
            async with self.open("auditor") as log:
                return fold(session, [e.envelope for e in await log.history(session)])

        return asyncio.run(go())

    def wait(self, session: str, timeout_s: float = 120) -> SessionState:
        """Until ``session`` finished, approving held payments, resolving in-doubt calls and
        restarting crashed processes (without their crash point) on the way."""
        deadline = time.monotonic() + timeout_s
        done: set[str] = set()
        while time.monotonic() < deadline:
            for name, process in list(self.stack.processes.items()):
                if not process.alive():
                    self.stack.start_process(name, {"AGENTLOG_CRASH_AT": ""})
                    if name == "engine":
                        self.stack.wait_for_engine(30)
            state = self.state(session)
            if state.finished:
                return state
            for call_id, tool in state.tool_calls.items():
                if tool.proposed.tool == "payment" and tool.status.value == "proposed" and call_id not in done:
                    self.logctl("approve", session, call_id, "--reason", "golden")
                    done.add(call_id)
                if tool.status.value == "in_doubt" and f"doubt/{call_id}" not in done:
                    # The crash point is after ToolCallStarted and before the tool runs: no payment happened.
                    self.logctl("approve", session, call_id, "--retry", "--reason", "not in the ledger")
                    done.add(f"doubt/{call_id}")
            time.sleep(0.3)
        logs = "\n".join(f"--- {n}\n{p.log_tail(30)}" for n, p in self.stack.processes.items())
        raise TimeoutError(f"{session} did not finish in {timeout_s:g} s: {self.state(session)}\n{logs}")

    def wait_quiet(self, quiet_s: float = 3.0, timeout_s: float = 60) -> None:
        """Until no topic has grown for ``quiet_s`` (the last decisions and KV events are in)."""

        async def ends() -> dict[str, dict[int, int]]:
            async with self.open("auditor") as log:
                return {t.name: await log.end_offsets(t.name) for t in TOPICS}

        deadline = time.monotonic() + timeout_s
        last, since = asyncio.run(ends()), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.5)
            now = asyncio.run(ends())
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return
        raise TimeoutError(f"the log did not go quiet in {timeout_s:g} s")

    def request(self, sessions: dict[str, list[dict[str, Any]]]) -> None:
        async def go() -> None:
            async with self.open("operator") as log:
                for session, steps in sessions.items():
                    args = json.dumps({"steps": steps})
                    await log.append(session, ev.SessionRequested(program="script", args_json=args, author="golden"))

        asyncio.run(go())

    def dump(self) -> tuple[int, list[dict[str, Any]]]:
        async def go() -> tuple[int, list[dict[str, Any]]]:
            async with self.open("auditor") as log:
                lines = [
                    record_line(t.name, p, r.position.offset, r.key, r.value)
                    for t in TOPICS
                    for p in range(log.num_partitions)
                    async for r in log.scan(t.name, p)
                ]
                return log.num_partitions, lines

        return asyncio.run(go())


def record(name: str, pg_url: str) -> Path:
    scenario = SCENARIOS[name]
    namespace = f"golden{uuid.uuid4().hex[:8]}"
    work = Path(tempfile.mkdtemp(prefix=f"agentlog-golden-{name}-"))
    ensure_topics(pg_url, namespace=namespace)
    extra = {"AGENTLOG_NAMESPACE": namespace, "AGENTLOG_LEDGER_URL": pg_url}
    memory = ["--gpu-blocks", str(CACHE["gpu_blocks"]), "--host-blocks", str(CACHE["host_blocks"])]
    stack = Stack(
        pg_url,
        work,
        time_scale=scenario.time_scale,
        extra_env=extra,
        cache_manager=scenario.cache_manager,
        engine_args=memory if scenario.cache_manager else [],
        cache_manager_args=memory if scenario.cache_manager else [],
    )
    driver = Driver(pg_url, namespace, stack)
    try:
        start(stack, scenario.crash_at)
        driver.request(scenario.sessions)
        for session in scenario.sessions:
            driver.wait(session)
        if scenario.after is not None:
            scenario.after(driver)
        driver.wait_quiet()
        num_partitions, lines = driver.dump()
    finally:
        stack.stop()
    header: dict[str, Any] = {
        "golden": FORMAT,
        "scenario": name,
        "num_partitions": num_partitions,
        "time_scale": scenario.time_scale,
    }
    if scenario.cache_manager:
        header["cache"] = CACHE
    path = HERE / f"{name}.jsonl"
    with path.open("w") as f:
        f.write(json.dumps(header) + "\n")
        for line in lines:
            f.write(json.dumps(line) + "\n")
    return path


def start(stack: Stack, crash_at: dict[str, str]) -> None:
    """``Stack.start`` with crash points armed in the processes ``crash_at`` names."""
    stack.work_dir.mkdir(parents=True, exist_ok=True)
    stack.engine_port = free_port()
    names = ["engine", "decider", "executor", *(f"planner-{i}" for i in range(stack.num_planners))]
    if stack.cache_manager:
        names += ["engine-bridge", "cache-manager"]
    for name in names:
        env = {"AGENTLOG_CRASH_AT": crash_at[name]} if name in crash_at else None
        stack.start_process(name, env)
        if name == "engine":
            stack.wait_for_engine(60)


def write_expected(name: str) -> Path:
    header, store = load(HERE / f"{name}.jsonl")
    expected = asyncio.run(replay(header, store))
    path = HERE / f"{name}.expected.json"
    path.write_text(dumps(expected))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"scenarios (default: all of {', '.join(SCENARIOS)})")
    parser.add_argument("--expected-only", action="store_true", help="replay the recorded logs only")
    args = parser.parse_args(argv)
    names = args.names or (golden_names() if args.expected_only else list(SCENARIOS))
    pg_url = os.environ.get("AGENTLOG_PG_URL")
    for name in names:
        if not args.expected_only:
            if not pg_url:
                print("set AGENTLOG_PG_URL to a Postgres the stack may use", file=sys.stderr)
                return 2
            print(f"{name}: recorded {record(name, pg_url)}")
        print(f"{name}: expected {write_expected(name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
