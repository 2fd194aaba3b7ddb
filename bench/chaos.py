"""Chaos at scale: sessions on a real stack while every role, the engine and the broker are hit.

    python -m bench.chaos [--sessions 200] [--faults 100] [--seed 1] [--time-scale 0.1] [--deadline 600]
        [--pg-url postgresql://...] [--broker-port PORT] [--work-dir DIR]

A Kafka broker of the run's own (its own port and data directory) and the stack's processes
(sim engine, two planners, decider, executor) under ``cli.stack.Supervisor``, as ``logctl up``
runs them; sessions of LLM, tool and payment steps requested spread over the fault window,
an operator loop approving payments and resolving in-doubt calls from the ledger, and the
seeded fault schedule of ``bench/chaos_lib.py`` (same seed, same faults) applied from a thread:
SIGKILL of each role, engine restarts, broker SIGKILL + restart, broker SIGSTOP past the
consumers' session timeout + SIGCONT, and restarts of the ledger's and snapshots' Postgres.
Every session also runs ``chaos_hold`` (``bench/chaos_tools.py``): a directory, a process and a
port acquired through the executor and owned by the session. The invariants are read back
afterwards from the log, the ledger, the engine's /stats and ``logctl verify``, and on the
machine (no resource directory, process or port left, no process of the run after its stop);
the exit code is 1 if any fails.

SIGINT (Ctrl-C) or SIGTERM stops a run early and cleanly: the faults stop, the stack, the
broker and Postgres are stopped, the table shows what the run had (its invariants not
checked), and the exit code is 128 + the signal's number (130, 143).

Postgres (the ledger and snapshots): an embedded server of the run's own under the work
directory, restarted by the schedule; with ``--pg-url``, that server instead, never restarted
(and no Postgres restart in the schedule).
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
from pathlib import Path

from bench.chaos_lib import ChaosRun


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--faults", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--time-scale", type=float, default=0.1, help="the sim engine's and tools' time factor")
    parser.add_argument("--window", type=float, default=0.0, help="seconds to spread faults over (0: from counts)")
    parser.add_argument(
        "--deadline", type=float, default=600.0, help="seconds after the fault window for every session to end"
    )
    parser.add_argument("--pg-url", help="use this Postgres (not restarted) instead of one of the run's own")
    parser.add_argument("--broker-port", type=int, default=0, help="the run's broker port (+1: its controller)")
    parser.add_argument("--work-dir", type=Path, help="default: a fresh temp dir (kept: the processes' logs)")
    args = parser.parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="agentlog-chaos-"))
    run = ChaosRun(
        work,
        args.pg_url,
        args.sessions,
        args.faults,
        args.seed,
        window_s=args.window,
        deadline_s=args.deadline,
        time_scale=args.time_scale,
        broker_port=args.broker_port,
    )
    report = run.run()
    print(f"python -m bench.chaos --sessions {args.sessions} --faults {args.faults} --seed {args.seed}")
    print(report.table(), flush=True)
    problems = [
        *report.fault_errors,
        *report.stop_errors,
        *(f"not ended: {s}" for s in report.unended),
        *(f"not released in the log: {r}" for r in (report.resources.not_released if report.resources else [])),
        *(f"left after the stop (killed): {p}" for p in report.left_after_stop),
    ]
    for problem in problems:
        print(problem, file=sys.stderr)
    if report.dead_processes:
        print(f"dead at the end: {report.dead_processes} (logs under {work})", file=sys.stderr)
    if report.interrupted is not None:
        print(f"interrupted by {report.interrupted}: stopped; logs under {work}", file=sys.stderr)
        return 128 + signal.Signals[report.interrupted].value  # as a shell reports a death by that signal
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
