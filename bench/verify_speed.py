"""How fast ``logctl verify`` checks a log: events per second over a log of N events.

Writes N events (default 1,000,000; agent.actions, about 1,000 sessions, sizes as
in an agent run) into a fresh namespace with the SharedLog, then runs the same
code as ``logctl verify`` (``cli.audit.verify_log``: read every partition from
offset 0, decode, check each record's hash, actor, body, key, seq and chain)
and prints the rate. With no ``--log-url`` a local Kafka broker is started.

    python -m bench.verify_speed [--events N] [--log-url kafka://HOST:PORT | postgresql://...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
import uuid
from contextlib import ExitStack

from cli.audit import verify_log
from log import Draft, Position, SharedLog
from log.topics import AGENT_ACTIONS
from log.urls import backend_for
from schemas.events import LLMCallCompleted, LLMCallStarted

WRITE_BATCH = 5000


def body(i: int) -> LLMCallStarted | LLMCallCompleted:
    call = f"llm-{i // 2}"
    if i % 2 == 0:
        return LLMCallStarted(
            call_id=call,
            turn=i // 2,
            engine_id="sim-0",
            prompt_tokens=1000 + i % 977,
            max_output_tokens=256,
            prompt_digest=f"{i:064x}",
        )
    return LLMCallCompleted(
        call_id=call,
        engine_id="sim-0",
        prompt_tokens=1000 + i % 977,
        cached_tokens=900,
        output_tokens=120,
        output_text="x" * 240,
        finish_reason="stop",
        queue_ms=1.0,
        prefill_ms=10.0,
        decode_ms=900.0,
    )


async def run(url: str, num_events: int, num_sessions: int) -> dict[str, float]:
    namespace = f"verify{uuid.uuid4().hex[:8]}"
    admin = backend_for(url, namespace=namespace)
    await admin.start()
    await admin.create_topics(4)
    await admin.close()
    began = time.perf_counter()
    async with SharedLog(backend_for(url, namespace=namespace), actor="planner") as log:
        # Two appends in flight: the next batch is encoded while the broker acknowledges the
        # previous one. SharedLog supports concurrent appends (each takes the topic's lock in
        # turn, in the order they were started, so every session's seq order is kept).
        in_flight: asyncio.Task[list[Position]] | None = None
        batch: list[Draft] = []
        for i in range(num_events):
            batch.append(Draft(f"s{i % num_sessions:05d}", body(i // num_sessions)))
            if len(batch) == WRITE_BATCH or i == num_events - 1:
                started = asyncio.create_task(log.append_many(batch))
                if in_flight is not None:
                    await in_flight
                in_flight = started
                batch = []
                print(f"\r  wrote {i + 1:,} events", end="", flush=True)
        if in_flight is not None:
            await in_flight
    write_s = time.perf_counter() - began
    print()
    async with SharedLog(backend_for(url, namespace=namespace), actor="auditor") as log:
        report = await verify_log(log, topics=[AGENT_ACTIONS.name], session=None)
    assert report.ok, report.problems[:3]
    return {
        "events": report.num_records,
        "sessions": report.num_sessions,
        "write_s": round(write_s, 1),
        "verify_s": round(report.seconds, 1),
        "verify_events_per_s": round(report.num_records / report.seconds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--log-url", default=None, help="default: a local Kafka broker started here")
    parser.add_argument("--json", default=None, help="also write the numbers to this file")
    args = parser.parse_args()
    with ExitStack() as stack:
        url = args.log_url
        if url is None:
            from log.local_kafka import LocalKafkaBroker

            broker = stack.enter_context(LocalKafkaBroker())
            url = f"kafka://{broker.bootstrap_servers}"
        result = asyncio.run(run(url, args.events, args.sessions))
    print(f"machine: {os.cpu_count()} cores, Python {platform.python_version()}; log {url.split('://')[0]}")
    print(f"{'events':>10} {'sessions':>9} {'write s':>8} {'verify s':>9} {'verify events/s':>16}")
    print(
        f"{result['events']:>10,} {result['sessions']:>9,} {result['write_s']:>8} {result['verify_s']:>9} "
        f"{result['verify_events_per_s']:>16,}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
