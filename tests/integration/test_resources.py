"""Resources owned by sessions, on a real Postgres log with the real planner, decider and executor.

Sessions acquire a directory (with a file in it), a temporary file, a process (with a child), a
TCP port, through ``ctx.resources`` (tests/integration/resource_tools.py); afterwards the test
counts what is left on the machine (paths, marked processes, listening ports) and reads from
the log who released what:

- at the end of a session that finishes, fails, is cancelled, and for a restore's abandoned call;
- after the executor is SIGKILLed mid-tool (a separate process, ``workers/crash.py``): the restarted
  executor reclaims what the dead run left behind;
- a process that ignores SIGTERM is killed with SIGKILL;
- a file the executor may not delete (``chattr +i``) makes the release fail: it is logged with the
  reason, retried with backoff, shown by ``logctl audit --resources``, and released once it can be;
- a container, when a Docker engine answers (skipped otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from cli.common import ensure_topics
from cli.main import app
from log import SharedLog, open_log
from schemas import events as ev
from schemas.events import ResourceKind
from services.checkpoint import fold_events
from services.replay import cut_events
from services.resources import Reason, ResourceStatus
from services.session import SessionState
from services.voters import default_allowed, default_decider
from workers.decider import DeciderWorker
from workers.engines.factory import create_engine
from workers.executor import ExecutorWorker
from workers.planner import PlannerWorker
from workers.plugins import load_registry
from workers.resources import docker_available, marked_pids, token

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

PLUGIN = "tests.integration.resource_tools"
ROOT = Path(__file__).resolve().parents[2]


def script(*steps: dict[str, Any]) -> str:
    return json.dumps({"steps": list(steps)})


HOLD = {"tool": "hold_all", "arguments": {}}
NOT_RUN = type("NotRun", (), {"attempts": 0})()


def leftovers(state: SessionState) -> list[str]:
    """What of the session's resources is still on the machine, counted, not read from the log."""
    left = []
    for r in state.resources.values():
        if r.kind in (ResourceKind.DIRECTORY, ResourceKind.FILE) and Path(r.location).exists():
            left.append(f"{r.resource_id}: {r.location} exists")
        if r.kind is ResourceKind.PROCESS and (pids := marked_pids(token(state.session_id, r.resource_id))):
            left.append(f"{r.resource_id}: processes {pids} alive")
        if r.kind is ResourceKind.PORT and r.handle is not None:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", int(r.handle))) == 0:
                    left.append(f"{r.resource_id}: port {r.handle} listening")
    return left


class World:
    def __init__(self, pg_url: str, namespace: str, tmp: Path) -> None:
        self.url, self.namespace, self.tmp = pg_url, namespace, tmp
        self.registry = load_registry(PLUGIN, entry_points=False)

    def open(self, actor: str) -> SharedLog:
        return open_log(self.url, actor=actor, namespace=self.namespace)

    async def fold(self, session: str) -> SessionState:
        async with self.open("auditor") as log:
            return fold_events(session, cut_events(await log.history(session)))

    async def request(self, session: str, args: str, program: str = "script") -> None:
        async with self.open("operator") as log:
            await log.append(session, ev.SessionRequested(program=program, args_json=args, author="test"))

    async def operator(self, session: str, body: ev.Event) -> None:
        async with self.open("operator") as log:
            await log.append(session, body)

    async def until(
        self, session: str, check: Callable[[SessionState], bool], what: str, timeout_s: float = 60
    ) -> SessionState:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            state = await self.fold(session)
            if check(state):
                return state
            if loop.time() > deadline:
                resources = {r.resource_id: (r.status.value, r.error) for r in state.resources.values()}
                raise AssertionError(f"{session}: timed out waiting for {what}: {state.status} {resources}")
            await asyncio.sleep(0.2)

    @contextlib.asynccontextmanager
    async def roles(self, *, executor: bool = True, kill_grace_s: float = 0.5) -> AsyncIterator[ExecutorWorker | None]:
        logs = [await self.open(role).start() for role in ("planner", "decider", "executor")]
        engine = create_engine("http://127.0.0.1:9", engine_id="sim-0", kind="sim")  # the scripts make no LLM call
        workers: list[Any] = [
            PlannerWorker(logs[0], engine=engine, registry=self.registry),
            DeciderWorker(
                logs[1], registry=self.registry, decider=default_decider(default_allowed(self.registry.tool_specs))
            ),
        ]
        runner: ExecutorWorker | None = None
        if executor:
            runner = ExecutorWorker(
                logs[2], registry=self.registry, sandbox=self.tmp / "sandbox", time_scale=0.1,
                resource_dir=self.tmp / "resources", kill_grace_s=kill_grace_s,
            )  # fmt: skip
            workers.append(runner)
        tasks = [asyncio.create_task(w.run()) for w in workers]
        try:
            yield runner
        finally:
            for w in workers:
                w.shutdown()
            await asyncio.gather(*tasks)
            for log in logs:
                await log.close()


@pytest.fixture
def world(pg_url: str, namespace: str, tmp_path: Path) -> World:
    ensure_topics(pg_url, namespace=namespace)
    return World(pg_url, namespace, tmp_path)


def num_held(state: SessionState) -> int:
    return sum(1 for r in state.resources.values() if r.live)


def released(state: SessionState) -> bool:
    return bool(state.resources) and all(r.status is ResourceStatus.RELEASED for r in state.resources.values())


def test_a_finished_sessions_resources_are_released_and_the_log_says_who(world: World) -> None:
    async def go() -> SessionState:
        async with world.roles():
            await world.request("fin", script(HOLD, {"tool": "early_release", "arguments": {}}))
            return await world.until("fin", lambda s: s.finished and released(s), "finished and released")

    state = asyncio.run(go())
    assert state.status.value == "finished"
    kinds = sorted(r.kind.value for r in state.resources.values())
    assert kinds == ["DIRECTORY", "DIRECTORY", "FILE", "PORT", "PROCESS"]
    by_reason = {r.resource_id: r.reason for r in state.resources.values()}
    assert by_reason == {
        "tool-0/1/0": Reason.FINISHED, "tool-0/1/1": Reason.FINISHED, "tool-0/1/2": Reason.FINISHED,
        "tool-0/1/3": Reason.FINISHED, "tool-1/1/0": Reason.BY_TOOL,
    }  # fmt: skip
    assert {r.call_id for r in state.resources.values()} == {"tool-0", "tool-1"}
    assert "executor" in state.actors
    assert leftovers(state) == []


def test_a_failed_sessions_resources_are_released(world: World) -> None:
    async def go() -> SessionState:
        async with world.roles():
            await world.request("failing", script(HOLD, {"bogus": True}))
            return await world.until("failing", lambda s: s.finished and released(s), "failed and released")

    state = asyncio.run(go())
    assert state.status.value == "failed"
    assert {r.reason for r in state.resources.values()} == {Reason.FAILED}
    assert leftovers(state) == []


def test_a_cancelled_sessions_resources_are_released_while_its_next_tool_runs(world: World) -> None:
    async def go() -> SessionState:
        async with world.roles():
            await world.request("cancelled", script(HOLD, {"tool": "sleep", "arguments": {"seconds": 30}}))
            await world.until(
                "cancelled", lambda s: "tool-1" in s.tool_calls and s.tool_calls["tool-1"].attempts, "sleep"
            )
            await world.operator("cancelled", ev.CancelRequested(author="test", reason="enough"))
            return await world.until("cancelled", lambda s: s.finished and released(s), "cancelled and released")

    state = asyncio.run(go())
    assert state.status.value == "cancelled"
    assert {r.reason for r in state.resources.values()} == {Reason.CANCELLED}
    assert leftovers(state) == []


def test_a_process_that_ignores_sigterm_is_killed(world: World) -> None:
    async def go() -> SessionState:
        async with world.roles(kill_grace_s=0.3):
            await world.request("stubborn", script({"tool": "hold_all", "arguments": {"stubborn": True}}))
            return await world.until("stubborn", lambda s: s.finished and released(s), "released")

    state = asyncio.run(go())
    process = next(r for r in state.resources.values() if r.kind is ResourceKind.PROCESS)
    assert process.detail is not None and "SIGKILL after SIGTERM was ignored" in process.detail
    assert leftovers(state) == []


def test_a_restore_releases_the_abandoned_calls_resources(world: World) -> None:
    async def go() -> tuple[SessionState, SessionState]:
        async with world.roles():
            steps = script({"checkpoint": True}, HOLD, {"tool": "sleep", "arguments": {"seconds": 30}})
            await world.request("restored", steps)
            held = await world.until(
                "restored",
                lambda s: len([r for r in s.resources.values() if r.status is ResourceStatus.HELD]) == 4,
                "held",
            )
            await world.operator("restored", ev.RestoreRequested(author="test", checkpoint_id="ckpt-0", dry_run=False))
            after = await world.until("restored", lambda s: bool(s.restores) and num_held(s) == 0, "restored, released")
            await world.operator("restored", ev.CancelRequested(author="test", reason="done"))
            await world.until("restored", lambda s: s.finished and released(s), "cancelled")
            return held, after

    held, after = asyncio.run(go())
    abandoned = [r for r in after.resources.values() if r.call_id == "tool-1"]
    assert len(abandoned) == 4 and {r.reason for r in abandoned} == {Reason.ABANDONED}
    assert leftovers(held) == []


def _executor_process(world: World, crash_at: str) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "AGENTLOG_NAMESPACE": world.namespace,
        "AGENTLOG_PLUGINS": PLUGIN,
        "AGENTLOG_CRASH_AT": crash_at,
        "AGENTLOG_LEDGER_URL": world.url,
    }
    argv = [
        sys.executable, "-m", "workers.executor", "--log-url", world.url, "--sandbox", str(world.tmp / "sandbox"),
        "--resource-dir", str(world.tmp / "resources"), "--kill-grace-s", "0.5", "--time-scale", "0.1",
    ]  # fmt: skip
    with (world.tmp / f"executor-{uuid.uuid4().hex[:4]}.log").open("wb") as log:
        return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.parametrize(
    "crash_at",
    [
        "executor.after_resource_logged.hold_all:3",  # the process's intent is logged, it does not exist yet
        "executor.after_resource_acquired.hold_all:4",  # all four exist and are logged, the tool has not returned
    ],
)
def test_a_sigkilled_executors_resources_are_reclaimed_by_the_next_one(world: World, crash_at: str) -> None:
    async def go() -> tuple[SessionState, SessionState]:
        async with world.roles(executor=False):
            dead = _executor_process(world, crash_at)
            await world.request("crashed", script(HOLD, {"tool": "sleep", "arguments": {"seconds": 1}}))
            assert await asyncio.to_thread(dead.wait, 60) == -9
            before = await world.fold("crashed")
            # The dead run's resources are on the machine: a SIGKILL cleans nothing up.
            assert leftovers(before), "nothing left to reclaim: the crash point did not bite"
            restarted = _executor_process(world, "")
            try:
                after = await world.until("crashed", lambda s: s.finished and released(s), "finished and reclaimed")
            finally:
                restarted.terminate()
                await asyncio.to_thread(restarted.wait, 30)
            return before, after

    before, after = asyncio.run(go())
    dead_attempt = [r for r in after.resources.values() if r.attempt == 1]
    assert dead_attempt and {r.reason for r in dead_attempt if r.kind is not ResourceKind.PORT} == {Reason.DEAD_ATTEMPT}
    assert {r.reason for r in dead_attempt if r.kind is ResourceKind.PORT} <= {Reason.DEAD_HOLDER}
    assert {r.attempt for r in after.resources.values()} == {1, 2}  # the retry acquired its own
    assert leftovers(after) == []
    assert leftovers(before) == []  # counted now: the dead run's resources are gone too


def _chattr_works(tmp: Path) -> bool:
    if shutil.which("chattr") is None:
        return False
    probe = tmp / "chattr-probe"
    probe.write_text("x")
    ok = subprocess.run(["chattr", "+i", str(probe)], capture_output=True, check=False).returncode == 0
    if ok:
        subprocess.run(["chattr", "-i", str(probe)], check=True)
    probe.unlink()
    return ok


def test_an_unreleasable_resource_is_reported_retried_and_shown_by_audit(world: World) -> None:
    if not _chattr_works(world.tmp):
        pytest.skip("chattr +i is not supported here (needs CAP_LINUX_IMMUTABLE and ext4-like fs)")

    async def go() -> tuple[SessionState, SessionState]:
        async with world.roles():
            await world.request("stuck", script({"tool": "immutable", "arguments": {}}))
            stuck = await world.until(
                "stuck", lambda s: s.finished and any(r.num_failures >= 2 for r in s.resources.values()), "retried"
            )
            resource = next(iter(stuck.resources.values()))
            audit = await asyncio.to_thread(
                CliRunner().invoke, app, ["audit", "--resources", "--log-url", world.url],
                env={"AGENTLOG_NAMESPACE": world.namespace},
            )  # fmt: skip
            assert audit.exit_code == 0, audit.output
            assert "stuck" in audit.output and resource.resource_id in audit.output, audit.output
            assert "Operation not permitted" in audit.output, audit.output
            unlock = ["chattr", "-i", str(Path(resource.location) / "locked")]
            await asyncio.to_thread(subprocess.run, unlock, check=True)
            return stuck, await world.until("stuck", released, "released once it can be", timeout_s=30)

    stuck, after = asyncio.run(go())
    r = next(iter(stuck.resources.values()))
    assert r.status is ResourceStatus.STUCK and "PermissionError" in (r.error or "")
    assert r.retry_at is not None
    done = next(iter(after.resources.values()))
    assert done.status is ResourceStatus.RELEASED and done.num_failures >= 2
    assert leftovers(after) == []


@pytest.mark.skipif(not docker_available(), reason="no Docker engine answers (docker info failed)")
def test_a_container_is_removed_at_the_sessions_end(world: World) -> None:
    async def go() -> SessionState:
        async with world.roles():
            await world.request("boxed", script({"tool": "container", "arguments": {}}))
            return await world.until("boxed", lambda s: s.finished and released(s), "released", timeout_s=120)

    state = asyncio.run(go())
    name = next(iter(state.resources.values())).location
    listed = subprocess.run(["docker", "ps", "-aq", "--filter", f"name={name}"], capture_output=True, text=True)
    assert listed.stdout.strip() == ""


@pytest.mark.skipif(docker_available(), reason="a Docker engine answers: the container test above runs instead")
def test_a_container_without_an_engine_fails_its_call_and_leaves_nothing(world: World) -> None:
    async def go() -> SessionState:
        async with world.roles():
            await world.request("boxless", script({"tool": "container", "arguments": {}}))
            return await world.until("boxless", lambda s: s.finished and released(s), "finished")

    state = asyncio.run(go())
    failure = state.tool_calls["tool-0"].failure
    assert failure is not None and "no Docker engine answers" in failure.error
    (r,) = state.resources.values()
    assert r.kind is ResourceKind.CONTAINER and (r.reason or "").startswith("acquisition failed: NotCreated")
    assert r.detail == "never created"
