"""Replay time of long sessions, from the first event vs from the latest snapshot, side by side.

For each session length, writes one session into a fresh namespace of the log
(LLM call and tool call steps, six events each, written by the planner, the
decider and the executor principals), takes a checkpoint the way the planner
does (``workers.replay.take_checkpoint``: cut, fold, digest, snapshot in
Postgres, ``CheckpointTaken``), writes a short tail after it, then replays the
session both ways (``workers.replay.replay_session``): from the log (read and
verify every record, fold them all) and from the snapshot (load it, read and
verify only the records after its cut, fold those). Both must give the same
state digest; the table shows the median of ``--repeats`` runs of each.

    python -m bench.replay_snapshots [--steps 200,1000,5000] [--tail-steps 10] [--repeats 3]
        [--log-url postgresql://... | kafka://...] [--snapshot-url postgresql://...]

Postgres defaults: ``AGENTLOG_PG_URL``, else the embedded server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import uuid
from typing import Any

from cli.common import init_log
from log import Draft, SharedLog, open_log
from log.snapshots import SnapshotStore
from schemas import events as ev
from services.checkpoint import state_digest
from workers.replay import replay_session, take_checkpoint

CHUNK_STEPS = 500


def step_drafts(session: str, step: int) -> dict[str, list[Draft]]:
    """One LLM call and one tool call: the six events of a turn, by writing role."""
    llm, tool = f"llm-{2 * step}", f"tool-{2 * step + 1}"
    return {
        "planner": [
            Draft(session, ev.LLMCallStarted(call_id=llm, turn=step, engine_id="sim-0", prompt_tokens=1000 + step,
                                             max_output_tokens=64, prompt_digest=f"{step:064x}")),
            Draft(session, ev.LLMCallCompleted(call_id=llm, engine_id="sim-0", prompt_tokens=1000 + step,
                                               cached_tokens=990, output_tokens=64, output_text="x" * 200,
                                               finish_reason="stop", queue_ms=1, prefill_ms=5, decode_ms=40)),
            Draft(session, ev.ToolCallProposed(call_id=tool, tool="echo", arguments_json='{"text": "hello"}',
                                               effect_class=ev.EffectClass.PURE,
                                               idempotency_key=f"{session}/{tool}")),
        ],
        "decider": [Draft(session, ev.ToolCallCommitted(call_id=tool, votes=[], policy="unanimous"))],
        "executor": [
            Draft(session, ev.ToolCallStarted(call_id=tool, tool="echo", idempotency_key=f"{session}/{tool}",
                                              attempt=1)),
            Draft(session, ev.ToolCallCompleted(call_id=tool, result_json='{"text": "hello"}', result_tokens=2,
                                                duration_ms=1.0)),
        ],
    }  # fmt: skip


async def write_steps(logs: dict[str, SharedLog], session: str, start: int, stop: int) -> None:
    for chunk in range(start, stop, CHUNK_STEPS):
        batches: dict[str, list[Draft]] = {role: [] for role in logs}
        for step in range(chunk, min(stop, chunk + CHUNK_STEPS)):
            for role, drafts in step_drafts(session, step).items():
                batches[role].extend(drafts)
        for role in ("planner", "decider", "executor"):
            await logs[role].append_many(batches[role])


async def measure(log_url: str, snapshot_url: str, steps: int, tail_steps: int, repeats: int) -> dict[str, Any]:
    namespace = f"bench{uuid.uuid4().hex[:8]}"
    await init_log(log_url, namespace=namespace)
    session = f"long-{steps}"
    roles = ("planner", "decider", "executor")
    logs = {role: await open_log(log_url, actor=role, namespace=namespace).start() for role in roles}
    store = await SnapshotStore(snapshot_url, namespace).start()
    try:
        await logs["planner"].append(session, ev.SessionStarted(program="script", args_json="{}"))
        await write_steps(logs, session, 0, steps - tail_steps)
        taken = await take_checkpoint(logs["planner"], store, session, "bench")
        await logs["planner"].append(session, taken)
        await write_steps(logs, session, steps - tail_steps, steps)
        reader = logs["planner"]
        times: dict[bool, list[float]] = {False: [], True: []}
        replayed = {}
        for _ in range(repeats):
            for use_snapshot in (False, True):  # interleaved: both see the same machine load
                began = time.perf_counter()
                replayed[use_snapshot] = await replay_session(reader, store, session, use_snapshot=use_snapshot)
                times[use_snapshot].append(time.perf_counter() - began)
        full, fast = replayed[False], replayed[True]
        return {
            "steps": steps,
            "events": full.state.num_events,
            "log_s": statistics.median(times[False]),
            "snapshot_s": statistics.median(times[True]),
            "log_records": full.num_records,
            "snapshot_records": fast.num_records,
            "same_digest": state_digest(full.state) == state_digest(fast.state),
        }
    finally:
        await store.close()
        for log in logs.values():
            await log.close()


def default_pg() -> str:
    if url := os.environ.get("AGENTLOG_PG_URL"):
        return url
    from log.embedded import start_embedded

    return start_embedded()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", default="200,1000,5000", help="session lengths in steps (6 events each)")
    parser.add_argument("--tail-steps", type=int, default=10, help="steps written after the checkpoint")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--log-url", default=None, help="default: AGENTLOG_PG_URL or the embedded Postgres")
    parser.add_argument("--snapshot-url", default=None, help="default: the Postgres of the log")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    pg = default_pg() if not (args.log_url and args.snapshot_url) else args.snapshot_url
    log_url = args.log_url or pg
    snapshot_url = args.snapshot_url or pg
    rows = [
        asyncio.run(measure(log_url, snapshot_url, int(n), args.tail_steps, args.repeats))
        for n in args.steps.split(",")
    ]
    print(f"log: {log_url.split('@')[-1]}, {args.tail_steps} steps after the checkpoint, median of {args.repeats}")
    print(
        f"{'events':>8} {'from log s':>11} {'records':>8} {'from snapshot s':>16} {'records':>8} "
        f"{'log/snapshot':>13} {'same state':>11}"
    )
    for r in rows:
        print(
            f"{r['events']:>8,} {r['log_s']:>11.3f} {r['log_records']:>8,} {r['snapshot_s']:>16.3f} "
            f"{r['snapshot_records']:>8,} {r['log_s'] / r['snapshot_s']:>12.1f}x "
            f"{'yes' if r['same_digest'] else 'NO':>11}"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=2)


if __name__ == "__main__":
    main()
