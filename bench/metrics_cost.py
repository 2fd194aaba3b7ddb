"""What Prometheus metrics cost a worker: the cache manager worker with and without them, side by side.

Run::

    python -m bench.metrics_cost [--events 100000] [--sessions 2000] [--rounds 3] [--bootstrap HOST:PORT]

Without ``--bootstrap`` (or ``KAFKA_BOOTSTRAP_SERVERS``) it starts a local broker (``bench.broker``).

Each round fills two fresh Kafka namespaces with the same events (bench/cache_manager_scale.py's
trace-like workload) and runs ``CacheManagerWorker`` over each backlog, once as
``python -m workers.cache_manager`` runs without ``--metrics-port`` and once with it (a
``WorkerMetrics`` fed by the loop and by ``SharedLog.on_appended``, exactly as ``workers.main``
wires them; no scrape during the row, as Prometheus scrapes every few seconds). The order
alternates between rounds so that drift on a shared machine falls on both sides. The table gives
events per second of wall time and of the process's CPU time, and the ratio with/without per
round; the verdict uses the median ratio of CPU rates (preemption by other work inflates wall
time on both sides but not the CPU time each side used). Goal: metrics on costs under 3 %.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import uuid

from bench.broker import broker_address
from bench.cache_manager_scale import (
    Row,
    config_for,
    delete_namespace,
    fill_kafka,
    run_worker,
    workload,
)
from log.gc_tuning import tune_gc

GOAL = 0.97


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


async def main_async(args: argparse.Namespace) -> int:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{os.cpu_count()} CPUs, load average {load}")
    tune_gc()
    events, mean_blocks = workload(args.events, args.sessions, args.seed)
    config = config_for(args.sessions, mean_blocks)
    rounds: list[tuple[Row, Row]] = []
    namespaces: list[str] = []
    try:
        for r in range(args.rounds):
            results: dict[bool, Row] = {}
            for metrics in (False, True) if r % 2 == 0 else (True, False):
                namespace = f"metrics{uuid.uuid4().hex[:8]}"
                namespaces.append(namespace)
                await fill_kafka(args.bootstrap, namespace, events, args.partitions)
                row = await run_worker(
                    "python", args.bootstrap, namespace, config, len(events), args.max_records, metrics=metrics
                )
                results[metrics] = row
                print(f"  round {r + 1}, metrics {'on ' if metrics else 'off'}: {row.rate:,.0f} events/s", flush=True)
            rounds.append((results[False], results[True]))
    finally:
        for namespace in namespaces:
            delete_namespace(args.bootstrap, namespace)
    print()
    print("| round | off events/s | on events/s | on/off | off events/cpu-s | on events/cpu-s | on/off (cpu) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    cpu_ratios: list[float] = []
    wall_ratios: list[float] = []
    for i, (off, on) in enumerate(rounds, 1):
        wall, cpu = ratio(on.rate, off.rate), ratio(on.cpu_rate, off.cpu_rate)
        if wall is not None:
            wall_ratios.append(wall)
        if cpu is not None:
            cpu_ratios.append(cpu)
        print(
            f"| {i} | {off.rate:,.0f} | {on.rate:,.0f} | {wall or 0:.3f} | {off.cpu_rate or 0:,.0f} | "
            f"{on.cpu_rate or 0:,.0f} | {cpu or 0:.3f} |"
        )
    wall_median = statistics.median(wall_ratios) if wall_ratios else 0.0
    cpu_median = statistics.median(cpu_ratios) if cpu_ratios else 0.0
    print(f"| median | | | {wall_median:.3f} | | | {cpu_median:.3f} |")
    print()
    verdict = "met" if cpu_median >= GOAL else "NOT met"
    print(
        f"goal: metrics cost under 3 % (on/off >= {GOAL}): median CPU ratio {cpu_median:.3f} -> {verdict} "
        f"(wall ratio {wall_median:.3f})"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.metrics_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--sessions", type=int, default=2_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--max-records", type=int, default=500)
    parser.add_argument("--bootstrap", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS"))
    args = parser.parse_args(argv)
    with broker_address(args.bootstrap) as bootstrap:  # a local broker of its own when none is given
        args.bootstrap = bootstrap
        return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
