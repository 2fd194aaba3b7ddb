"""How many events per second the projector keeps up with, side by side with a plain consumer.

    python -m bench.projector_lag [--log-url URL] [--model-url POSTGRES] [--events 20000] [--rounds 2]

Appends ``--events`` realistic agent events (``bench.log_throughput.build_drafts``: sessions,
LLM calls, tool proposals, interleaved) to a fresh namespace, then, in each round and in
alternating order, reads them all from offset 0 with:

- a plain ``EventConsumer`` (decode and verify every record, nothing else), and
- the projector (``workers.projector.Projector``, ``--until-caught-up``, into a freshly
  dropped read model): the same reading plus each poll's rows and offsets in one Postgres
  transaction.

The rate a reader catches up at is the highest append rate it keeps up with. Defaults: the
log is ``AGENTLOG_PG_URL`` (else the embedded Postgres), the model is ``--model-url``, else
``AGENTLOG_READ_MODEL_URL``, else ``AGENTLOG_PG_URL``. It prints a table; it is never a test.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid

from bench.log_throughput import WRITER, batches, build_drafts
from cli.common import init_log
from log import open_log
from log.embedded import start_embedded
from workers.projector import PROJECTED_TOPICS, Projector, ReadModel, model_url


async def _write(url: str, namespace: str, num_events: int) -> None:
    await init_log(url, 4, namespace=namespace)
    async with open_log(url, actor=WRITER, namespace=namespace) as log:
        for chunk in batches(build_drafts(num_events, num_sessions=max(1, num_events // 40)), 1000):
            await log.append_many(chunk)


async def _plain(url: str, namespace: str, num_events: int, max_records: int) -> float:
    async with open_log(url, actor="auditor", namespace=namespace) as log:
        began = time.perf_counter()
        seen = 0
        async with log.consumer(f"auditor-bench-{uuid.uuid4().hex[:6]}", PROJECTED_TOPICS, from_beginning=True) as c:
            while seen < num_events:
                seen += len(await c.poll(timeout_s=0.5, max_records=max_records))
        return time.perf_counter() - began


async def _projector(url: str, model: str, namespace: str, max_records: int) -> tuple[float, int]:
    async with open_log(url, actor="projector", namespace=namespace) as log:
        read_model = await ReadModel(model, namespace).start()
        try:
            await read_model.drop()
            await read_model.create()
            projector = Projector(
                log, read_model, until_caught_up=True, group=f"projector-bench-{uuid.uuid4().hex[:6]}",
                max_records=max_records,
            )  # fmt: skip
            began = time.perf_counter()
            await projector.run()
            return time.perf_counter() - began, projector.num_projected
        finally:
            await read_model.close()


async def main(args: argparse.Namespace) -> None:
    url = args.log_url or os.environ.get("AGENTLOG_PG_URL") or start_embedded()
    model = model_url(args.model_url, url)
    if model is None:
        raise SystemExit("no Postgres for the read model: pass --model-url")
    namespace = f"bench{uuid.uuid4().hex[:8]}"
    began = time.perf_counter()
    await _write(url, namespace, args.events)
    print(f"appended {args.events:,} events in {time.perf_counter() - began:.1f} s (namespace {namespace})")
    print(f"{'round':>5} {'reader':<10} {'seconds':>8} {'events/s':>10}")
    rates: dict[str, list[float]] = {"plain": [], "projector": []}
    for round_ in range(args.rounds):
        order = ("plain", "projector") if round_ % 2 == 0 else ("projector", "plain")
        for reader in order:
            if reader == "plain":
                seconds = await _plain(url, namespace, args.events, args.max_records)
            else:
                seconds, projected = await _projector(url, model, namespace, args.max_records)
                if projected != args.events:
                    raise SystemExit(f"the projector projected {projected} of {args.events} events")
            rates[reader].append(args.events / seconds)
            print(f"{round_ + 1:>5} {reader:<10} {seconds:>8.2f} {args.events / seconds:>10,.0f}")
    plain, projector = (sum(v) / len(v) for v in (rates["plain"], rates["projector"]))
    print(f"mean: plain {plain:,.0f} events/s, projector {projector:,.0f} events/s ({projector / plain:.2f}x)")
    read_model = await ReadModel(model, namespace).start()
    await read_model.drop()
    await read_model.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-url", default=None)
    parser.add_argument("--model-url", default=None)
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-records", type=int, default=500)
    asyncio.run(main(parser.parse_args()))
