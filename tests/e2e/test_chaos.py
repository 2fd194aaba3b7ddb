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


def test_every_invariant_holds_through_a_seeded_run_of_faults(tmp_path: Path) -> None:
    run = chaos_run(tmp_path)
    report = run.run()
    table = report.table()
    print(table)
    assert report.ok, f"{table}\n{report.fault_errors}\nnot ended: {report.unended}\nlogs under {tmp_path}"
    assert sum(report.faults.values()) == len(run.schedule())
    assert report.sessions == 17  # and the canary requested after the last fault finished
