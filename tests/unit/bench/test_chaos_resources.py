"""The chaos run's resource accounting (from the log and on the machine) and its signal handling.

The accounting reads real folded resources and real processes and sockets of this machine;
the signal tests send this process real signals while ``_Signals.run`` runs a coroutine.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest

from bench.chaos_lib import ChaosReport, _Signals
from bench.chaos_resources import (
    count_log,
    entries_left,
    listener_pids,
    logged_ports,
    run_pids,
    tagged_pids,
)
from schemas import events as ev
from schemas.events import ResourceKind
from services.resources import Reason, evolve
from services.session import SessionState

pytestmark = pytest.mark.unit

AT = datetime(2026, 12, 2, tzinfo=UTC)


def state(session: str, *bodies: ev.Event) -> SessionState:
    folded = SessionState(session)
    for body in bodies:
        evolve(folded.resources, body, AT)
    return folded


def acquired(rid: str, kind: ResourceKind, handle: str) -> list[ev.Event]:
    return [
        ev.ResourceAcquiring(resource_id=rid, call_id=rid.split("/")[0], tool="chaos_hold", kind=kind, location=""),
        ev.ResourceAcquired(resource_id=rid, handle=handle),
    ]


def test_the_log_accounts_for_every_acquisition_by_how_it_was_released() -> None:
    done = state(
        "a",
        *acquired("tool-2/1/0", ResourceKind.DIRECTORY, "/x"),
        *acquired("tool-2/1/1", ResourceKind.PORT, "4242"),
        ev.ResourceReleased(resource_id="tool-2/1/0", reason=Reason.FINISHED, detail="removed"),
        ev.ResourceReleased(resource_id="tool-2/1/1", reason=Reason.DEAD_HOLDER, detail="died"),
    )
    open_one = state(
        "b",
        *acquired("tool-2/1/0", ResourceKind.PROCESS, "77"),
        ev.ResourceAcquiring(resource_id="tool-2/2/0", call_id="tool-2", tool="t", kind=ResourceKind.PORT, location=""),
        ev.ResourceReleased(resource_id="tool-2/2/0", reason=Reason.DEAD_ATTEMPT, detail="gone"),
    )
    count = count_log([done, open_one])
    assert (count.acquired, count.released_at_end, count.reclaimed, count.released_other) == (4, 1, 2, 0)
    assert count.not_released == ["b/tool-2/1/0 (PROCESS, held)"]
    count.dirs_left = count.processes_left = count.ports_left = 0
    assert not count.ok  # one acquisition has no release
    assert logged_ports([done, open_one]) == [4242]  # the port never bound has no handle


def test_nothing_acquired_is_not_a_clean_run() -> None:
    count = count_log([state("a")])
    count.dirs_left = count.processes_left = count.ports_left = 0
    assert not count.ok  # the mix's tool never ran: the invariant would hold vacuously


def test_tagged_processes_and_listening_sockets_are_counted_on_the_machine(tmp_path: Path) -> None:
    tag = uuid.uuid4().hex
    child = subprocess.Popen(["sleep", "60"], env={**os.environ, "AGENTLOG_CHAOS_TOOL": tag})
    server = socket.socket()
    try:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert tagged_pids("AGENTLOG_CHAOS_TOOL", tag) == [child.pid]
        assert listener_pids(port, [child.pid, os.getpid()]) == [os.getpid()]
        server.close()
        assert listener_pids(port, [os.getpid()]) == []
    finally:
        child.kill()
        child.wait()
        server.close()
    assert tagged_pids("AGENTLOG_CHAOS_TOOL", tag) == []  # a reaped child is gone
    (tmp_path / "r1").mkdir()
    (tmp_path / "r2.json").touch()
    assert entries_left(tmp_path) == 2
    assert entries_left(tmp_path / "missing") == 0


def test_a_runs_processes_are_found_by_tag_or_data_dir_but_never_this_one(tmp_path: Path) -> None:
    env = {**os.environ, "AGENTLOG_CHAOS_WORK": str(tmp_path)}
    tagged = subprocess.Popen(["sleep", "60"], env=env)
    broker_like = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(tmp_path / "kafka")])
    try:
        assert run_pids(tmp_path) == sorted([tagged.pid, broker_like.pid])
    finally:
        for p in (tagged, broker_like):
            p.kill()
            p.wait()
    assert run_pids(tmp_path) == []


def test_a_signal_cancels_the_operator_and_the_run_raises_keyboard_interrupt() -> None:
    cleaned: list[str] = []

    async def operator() -> None:
        asyncio.get_running_loop().call_later(0.2, os.kill, os.getpid(), signal.SIGTERM)
        try:
            await asyncio.sleep(30)
        finally:
            cleaned.append("closed")  # an async with's exit runs: the operator was cancelled, not torn

    with _Signals() as signals, pytest.raises(KeyboardInterrupt):
        signals.run(operator())
    assert signals.received == "SIGTERM"
    assert cleaned == ["closed"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored


def test_while_a_run_stops_a_signal_waits(capsys: pytest.CaptureFixture[str]) -> None:
    with _Signals() as signals:
        signals.stopping = True
        signal.raise_signal(signal.SIGINT)  # would be a KeyboardInterrupt
    assert "stopping its stack, broker and Postgres; wait" in capsys.readouterr().err


def test_an_interrupted_runs_table_says_what_it_had_and_checks_nothing() -> None:
    report = ChaosReport(sessions=3, faults={"kill executor": 1}, interrupted="SIGINT")  # type: ignore[arg-type]
    report.finished = 1
    table = report.table()
    assert "interrupted by" in table and "SIGINT" in table
    assert "not checked" in table
    assert "duplicate irreversible effects" not in table  # never checked: not printed as 0
    assert not report.ok
