"""The executor's resource mechanism (workers/resources.py) on this machine, without a log: the
events it would append are collected in a list (the executor's append is the only other party)."""

from __future__ import annotations

import asyncio
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from schemas import events as ev
from schemas.events import ResourceKind
from services.resources import Resource
from workers.resources import ResourceManager, kill_marked, marked_pids, token

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
)


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, ev.Event, str, str]] = []

    async def __call__(self, session_id: str, body: ev.Event, kind: str, key: str) -> None:
        self.events.append((session_id, body, kind, key))


def manager(tmp_path: Path, grace_s: float = 0.2) -> tuple[ResourceManager, Recorder]:
    recorder = Recorder()
    return ResourceManager(tmp_path / "resources", recorder, grace_s=grace_s), recorder


def resource(kind: ResourceKind, location: str, rid: str = "tool-0/1/0") -> Resource:
    return Resource(rid, "tool-0", "t", kind, location, datetime.now(UTC))


def test_tokens_are_deterministic_and_differ_per_session_and_resource() -> None:
    assert token("s", "tool-0/1/0") == token("s", "tool-0/1/0")
    assert len({token("s", "tool-0/1/0"), token("s", "tool-0/1/1"), token("t", "tool-0/1/0")}) == 3


def test_the_intent_is_logged_before_the_resource_exists(tmp_path: Path) -> None:
    m, recorder = manager(tmp_path)
    seen: list[bool] = []

    async def go() -> None:
        scope = m.scope("s", "tool-0", "t", 1)
        original = m.append

        async def check(session_id: str, body: ev.Event, kind: str, key: str) -> None:
            if isinstance(body, ev.ResourceAcquiring):
                seen.append(Path(body.location).exists())  # noqa: ASYNC240 (a test's probe)
            await original(session_id, body, kind, key)

        m.append = check
        lease = await scope.directory()
        assert lease.path is not None and lease.path.is_dir()

    asyncio.run(go())
    assert seen == [False]
    assert [k for _, _, k, _ in recorder.events] == ["resource-acquiring", "resource-acquired"]


def test_a_release_is_idempotent(tmp_path: Path) -> None:
    m, _ = manager(tmp_path)

    async def go() -> tuple[str, str]:
        lease = await m.scope("s", "tool-0", "t", 1).temp_file(".json")
        assert lease.path is not None
        r = resource(ResourceKind.FILE, str(lease.path))
        return await m.release("s", r), await m.release("s", r)

    first, second = asyncio.run(go())
    assert first.startswith("removed") and second == "already gone"


def test_a_process_that_ignores_sigterm_is_killed_with_its_children(tmp_path: Path) -> None:
    m, _ = manager(tmp_path)

    async def go() -> str:
        scope = m.scope("s", "tool-0", "t", 1)
        code = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {STUBBORN!r}]); exec({STUBBORN!r})"
        lease = await scope.process([sys.executable, "-c", code], stdout=asyncio.subprocess.PIPE)
        assert lease.process is not None and lease.process.stdout is not None
        await asyncio.to_thread(lease.process.stdout.readline)
        marker = token("s", lease.resource_id)
        for _ in range(200):  # the child is started by the parent: wait until both carry the marker
            if len(marked_pids(marker)) == 2:
                break
            await asyncio.sleep(0.05)
        assert len(marked_pids(marker)) == 2
        r = resource(ResourceKind.PROCESS, f"AGENTLOG_RESOURCE={marker}", lease.resource_id)
        detail = await m.release("s", r)
        assert marked_pids(marker) == []
        assert lease.process.returncode is not None  # reaped, not a zombie
        lease.process.stdout.close()
        return detail

    assert "SIGKILL after SIGTERM was ignored" in asyncio.run(go())
    assert kill_marked("rnothing", 0.1) == "no process left"


@pytest.mark.parametrize(
    ("call", "message"),
    [("temp_file_bad", "must be a dot"), ("process_empty", "argv is empty")],
)
def test_bad_requests_fail_before_anything_is_logged(tmp_path: Path, call: str, message: str) -> None:
    m, recorder = manager(tmp_path)

    async def go() -> None:
        scope = m.scope("s", "tool-0", "t", 1)
        if call == "temp_file_bad":
            await scope.temp_file("/../../etc")
        else:
            await scope.process([])

    with pytest.raises(ValueError, match=message):
        asyncio.run(go())
    assert recorder.events == []


def test_a_failed_acquisition_is_released_and_logged_and_the_tool_sees_the_error(tmp_path: Path) -> None:
    m, recorder = manager(tmp_path)

    async def go() -> None:
        await m.scope("s", "tool-0", "t", 1).process(["/nonexistent/binary"])

    with pytest.raises(FileNotFoundError):
        asyncio.run(go())
    kinds = [(k, key) for _, _, k, key in recorder.events]
    assert kinds == [("resource-acquiring", "tool-0/1/0"), ("resource-released", "tool-0/1/0")]
    released = recorder.events[-1][1]
    assert isinstance(released, ev.ResourceReleased) and released.reason.startswith("acquisition failed")


def test_ports_are_held_until_released(tmp_path: Path) -> None:
    import socket

    m, _ = manager(tmp_path)

    async def go() -> int:
        lease = await m.scope("s", "tool-0", "t", 1).port()
        assert lease.port is not None
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", lease.port)) == 0
        r = resource(ResourceKind.PORT, "", lease.resource_id)
        assert (await m.release("s", r)).startswith("closed the socket")
        assert await m.release("s", r) == "its socket died with the executor that held it"
        return lease.port

    port = asyncio.run(go())
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0
