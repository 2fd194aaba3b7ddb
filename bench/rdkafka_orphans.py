"""librdkafka members under broker pauses and kills: does any stop reading for good?

Run::

    python -m bench.rdkafka_orphans [--minutes 20] [--seed 1] [--faults stop|mixed] [--json FILE]

A broker of its own (``log.local_kafka``), a writer appending one record every 50 ms, and two
from-beginning members of different groups reading them, each through ``RdKafkaBackend``:

- **shipped**: a member as every worker has it, which joins again with a new consumer once
  librdkafka has dropped every broker it knew (``log.rdkafka_backend.ORPHANED_AFTER_S``);
- **control**: the same member with that turned off (``orphaned_after_s = inf``), to show in
  the same run how often librdkafka strands a member.

Faults every 2-10 s: ``stop`` SIGSTOPs the broker for 9.5-13 s (longer than its 9 s broker
session, so it comes back fenced: the window in which a Metadata answer lists no broker,
librdkafka's issue #5301); ``mixed`` SIGKILLs it (restarted 0-3 s later) or SIGSTOPs it for
2-15 s. A member counts as stranded once it has read nothing for 90 s while the writer's
records land; the run ends early if the shipped one is. The table gives, per member, the
records read, the longest gap between reads, whether it was stranded, and its rejoins; the
exit code is 1 if the shipped member was stranded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from cli.common import ensure_topics
from log.backend import OutRecord
from log.local_kafka import LocalKafkaBroker
from log.rdkafka_backend import RdKafkaBackend, RdKafkaSubscription
from log.topics import AGENT_ACTIONS

STRANDED_S = 90.0
"""A member that has read nothing for this long while records land is stranded: every fault
here is over within 15 s, and a member that can find its coordinator does within seconds."""


@dataclass
class Reader:
    name: str
    read: int = 0
    longest_gap_s: float = 0.0
    stranded_at_fault: int | None = None
    rejoins: int = 0


async def soak(minutes: float, seed: int, faults: str) -> tuple[list[Reader], dict[str, float]]:
    rng = random.Random(seed)
    broker = LocalKafkaBroker()
    await asyncio.to_thread(broker.start)
    try:
        await asyncio.to_thread(ensure_topics, f"kafka://{broker.bootstrap_servers}", namespace="soak")
        writer = RdKafkaBackend(broker.bootstrap_servers, namespace="soak", bounded_delivery=True)
        await writer.start()
        readers: dict[str, tuple[Reader, RdKafkaSubscription, RdKafkaBackend]] = {}
        for name in ("shipped", "control"):
            backend = RdKafkaBackend(broker.bootstrap_servers, namespace="soak")
            await backend.start()
            member = await backend.subscribe(name, [AGENT_ACTIONS.name], from_beginning=True)
            assert isinstance(member, RdKafkaSubscription)
            if name == "control":
                member.orphaned_after_s = math.inf
            readers[name] = (Reader(name), member, backend)
        end = time.monotonic() + minutes * 60
        stats = {"written": 0.0, "faults": 0.0, "longest_write_gap_s": 0.0}

        async def write() -> None:
            last = time.monotonic()
            i = 0
            while time.monotonic() < end:
                i += 1
                try:
                    await (await writer.produce(AGENT_ACTIONS.name, [OutRecord(i % 4, f"k{i}".encode(), b"x")]))
                    now = time.monotonic()
                    stats["written"] += 1
                    stats["longest_write_gap_s"] = max(stats["longest_write_gap_s"], now - last)
                    last = now
                except Exception:  # the broker is away: the next record tries again
                    pass
                await asyncio.sleep(0.05)

        async def fault() -> None:
            while time.monotonic() < end:
                await asyncio.sleep(rng.uniform(2, 10))
                pid = broker.pid
                assert pid is not None
                stats["faults"] += 1
                if faults == "mixed" and rng.random() < 0.5:
                    broker.kill()
                    await asyncio.sleep(rng.uniform(0, 3))
                    await asyncio.to_thread(broker.start)
                    continue
                os.kill(pid, signal.SIGSTOP)
                await asyncio.sleep(rng.uniform(9.5, 13) if faults == "stop" else rng.uniform(2, 15))
                os.kill(pid, signal.SIGCONT)

        async def read(reader: Reader, member: RdKafkaSubscription) -> None:
            last = time.monotonic()
            while time.monotonic() < end:
                records = await member.poll(0.5, 500)
                now = time.monotonic()
                reader.rejoins = member.rejoins
                if records:
                    reader.read += len(records)
                    reader.longest_gap_s = max(reader.longest_gap_s, now - last)
                    last = now
                elif now - last > STRANDED_S and reader.stranded_at_fault is None:
                    reader.stranded_at_fault = int(stats["faults"])
                    if reader.name == "shipped":
                        return
            reader.longest_gap_s = max(reader.longest_gap_s, time.monotonic() - last)

        tasks = [asyncio.create_task(write()), asyncio.create_task(fault())]
        try:
            await asyncio.gather(*(read(r, m) for r, m, _ in readers.values()))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        os.kill(broker.pid or 0, signal.SIGCONT)
        for _, member, backend in readers.values():
            await member.close()
            await backend.close()
        await writer.close()
        return [r for r, _, _ in readers.values()], stats
    finally:
        broker.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--faults", choices=["stop", "mixed"], default="stop")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    readers, stats = asyncio.run(soak(args.minutes, args.seed, args.faults))
    print(
        f"{args.minutes:g} min, seed {args.seed}, faults {args.faults}: {int(stats['faults'])} faults, "
        f"{int(stats['written'])} records written, longest write gap {stats['longest_write_gap_s']:.1f} s"
    )
    print(f"{'member':<8} {'read':>8} {'longest gap s':>14} {'stranded at fault':>18} {'rejoins':>8}")
    for r in readers:
        stranded = "-" if r.stranded_at_fault is None else str(r.stranded_at_fault)
        print(f"{r.name:<8} {r.read:>8} {r.longest_gap_s:>14.1f} {stranded:>18} {r.rejoins:>8}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": vars(args) | {"json": str(args.json)},
                    "stats": stats,
                    "readers": [asdict(r) for r in readers],
                },
                indent=2,
            )
        )
    raise SystemExit(1 if readers[0].stranded_at_fault is not None else 0)


if __name__ == "__main__":
    main()
