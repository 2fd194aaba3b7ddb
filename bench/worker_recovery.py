"""Role worker restart from offset 0 vs from its partition marks, side by side.

For each size, writes into a fresh namespace of the log ``--finished`` finished
sessions (``--finished-steps`` steps each: an LLM call and a tool call, six
events, written by the planner, decider and executor principals) interleaved
with ``--long`` long sessions that are still running: half of their steps
before the finished ones, half after, then a checkpoint taken the way the
planner takes one (``workers.replay.take_checkpoint``: cut, fold, snapshot in
Postgres, ``CheckpointTaken``) and ``--tail-steps`` more steps. A passive
worker with the planner's topics (it folds, never acts) catches up once from 0
and stops cleanly, saving its marks, as a role worker does. Then, ``--repeats``
times, interleaved: one passive worker restarts in that group from the marks,
one in a fresh group from offset 0 (no snapshot store); each is timed from
``run()`` to every partition caught up. The table shows the medians, the
records each decoded (the consumer's, chains rebuilt, sessions loaded), the
records the marks path skipped or dropped undecoded, and whether both folded
every unfinished session to the same state.

    python -m bench.worker_recovery [--finished 200,1000] [--long 4] [--long-steps 400]
        [--repeats 3] [--log-url postgresql://... | kafka://...] [--snapshot-url postgresql://...]

Postgres defaults: ``AGENTLOG_PG_URL``, else the embedded server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from typing import Any

from cli.common import init_log
from log import Draft, SharedLog, open_log
from log.snapshots import SnapshotStore
from schemas import events as ev
from services.checkpoint import state_to_json
from services.marks import needs_work
from workers.planner import PlannerWorker
from workers.replay import take_checkpoint
from workers.runtime import SessionWorker

from .replay_snapshots import default_pg, step_drafts

ROLES = ("planner", "decider", "executor")


class Reader(SessionWorker):
    """Folds the planner's topics and acts on nothing: a role worker's recovery, without the acting."""

    role = "planner"
    topics = PlannerWorker.topics


async def write(logs: dict[str, SharedLog], steps: dict[str, range]) -> None:
    """Steps of many sessions, one batch per role (the order within a session is the role's)."""
    batches: dict[str, list[Draft]] = {role: [] for role in ROLES}
    for session, span in steps.items():
        for step in span:
            for role, drafts in step_drafts(session, step).items():
                batches[role].extend(drafts)
    for role in ROLES:
        for i in range(0, len(batches[role]), 2000):
            await logs[role].append_many(batches[role][i : i + 2000])


async def restart(log: SharedLog, store: SnapshotStore | None, group: str) -> tuple[float, Reader]:
    reader = Reader(log, group=group, snapshots=store)
    began = time.perf_counter()
    running = asyncio.create_task(reader.run())
    await reader.wait_caught_up()
    elapsed = time.perf_counter() - began
    reader.shutdown()
    await running
    return elapsed, reader


def decoded(reader: Reader) -> int:
    assert reader.consumer is not None
    reads = reader.consumer.reads
    return reads.decoded + reads.rebuilt + reader.recovery.loaded_records


async def measure(log_url: str, snapshot_url: str, args: argparse.Namespace, finished: int) -> dict[str, Any]:
    namespace = f"wrbench{uuid.uuid4().hex[:8]}"
    await init_log(log_url, namespace=namespace)
    logs = {role: await open_log(log_url, actor=role, namespace=namespace).start() for role in ROLES}
    store = await SnapshotStore(snapshot_url, namespace).start()
    try:
        longs = [f"long-{i}" for i in range(args.long)]
        shorts = [f"short-{i}" for i in range(finished)]
        for session in longs + shorts:
            await logs["planner"].append(session, ev.SessionStarted(program="script", args_json="{}"))
        half = args.long_steps // 2
        await write(logs, {s: range(half) for s in longs})
        await write(logs, {s: range(args.finished_steps) for s in shorts})
        for session in shorts:
            body = ev.SessionFinished(output_json="{}", num_llm_calls=args.finished_steps, num_tool_calls=0)
            await logs["planner"].append(session, body)
        await write(logs, {s: range(half, args.long_steps - args.tail_steps) for s in longs})
        for session in longs:
            await logs["planner"].append(session, await take_checkpoint(logs["planner"], store, session, "bench"))
        await write(logs, {s: range(args.long_steps - args.tail_steps, args.long_steps) for s in longs})
        total = 0
        for topic in Reader.topics:
            total += sum((await logs["planner"].end_offsets(topic)).values())

        await restart(logs["planner"], store, "planner")  # caught up once, stopped cleanly: marks saved
        times: dict[str, list[float]] = {"zero": [], "marks": []}
        last: dict[str, Reader] = {}
        for i in range(args.repeats):
            for way in ("zero", "marks"):  # interleaved: both see the same machine load
                group = f"zero-{i}" if way == "zero" else "planner"
                elapsed, last[way] = await restart(logs["planner"], store if way == "marks" else None, group)
                times[way].append(elapsed)
        zero, marks = last["zero"], last["marks"]
        unfinished = [s for s, st in zero.sessions.items() if needs_work(st)]
        same = sorted(unfinished) == sorted(longs) and all(
            state_to_json(zero.sessions[s]) == state_to_json(marks.sessions[s]) for s in unfinished
        )
        assert marks.consumer is not None
        return {
            "finished": finished,
            "records": total,
            "zero_s": statistics.median(times["zero"]),
            "marks_s": statistics.median(times["marks"]),
            "zero_decoded": decoded(zero),
            "marks_decoded": decoded(marks),
            "marks_skipped": marks.consumer.reads.skipped,
            "marks_dropped": marks.consumer.reads.dropped,
            "from_snapshot": marks.recovery.from_snapshot,
            "same_state": same,
        }
    finally:
        await store.close()
        for log in logs.values():
            await log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--finished", default="200,1000", help="finished sessions per run (comma-separated sizes)")
    parser.add_argument("--finished-steps", type=int, default=5, help="steps of each finished session")
    parser.add_argument("--long", type=int, default=4, help="long sessions still running")
    parser.add_argument("--long-steps", type=int, default=400, help="steps of each long session")
    parser.add_argument("--tail-steps", type=int, default=10, help="steps written after the checkpoint")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--log-url", default=None, help="default: AGENTLOG_PG_URL or the embedded Postgres")
    parser.add_argument("--snapshot-url", default=None, help="default: the Postgres of the log")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    pg = default_pg() if not (args.log_url and args.snapshot_url) else args.snapshot_url
    log_url = args.log_url or pg
    snapshot_url = args.snapshot_url or pg
    rows = [asyncio.run(measure(log_url, snapshot_url, args, int(n))) for n in args.finished.split(",")]
    print(
        f"log: {log_url.split('@')[-1]}, {args.long} running sessions of {args.long_steps} steps "
        f"(checkpoint {args.tail_steps} steps before the end), median of {args.repeats}"
    )
    print(
        f"{'finished':>8} {'records':>8} {'from 0 s':>9} {'decoded':>8} {'from marks s':>13} {'decoded':>8} "
        f"{'skipped':>8} {'dropped':>8} {'time':>6} {'decoded':>8} {'same state':>11}"
    )
    for r in rows:
        print(
            f"{r['finished']:>8,} {r['records']:>8,} {r['zero_s']:>9.3f} {r['zero_decoded']:>8,} "
            f"{r['marks_s']:>13.3f} {r['marks_decoded']:>8,} {r['marks_skipped']:>8,} {r['marks_dropped']:>8,} "
            f"{r['zero_s'] / r['marks_s']:>5.1f}x {r['zero_decoded'] / max(1, r['marks_decoded']):>7.1f}x "
            f"{'yes' if r['same_state'] else 'NO':>11}"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=2)


if __name__ == "__main__":
    main()
