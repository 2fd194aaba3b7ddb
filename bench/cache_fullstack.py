"""Full-stack check: the cache manager worker among the real processes, against an in-process replay.

Run::

    python -m bench.cache_fullstack [--sessions 30] [--time-scale 0.01] [--capacity 0.5]
                                    [--bootstrap HOST:PORT] [--no-baseline] [--json FILE]

One configuration runs through the real processes on a Kafka log (``cli.stack.Stack``:
the sim engine ``workers.engines.sim_server``, the engine bridge, the planner, decider,
executor and the cache manager worker, each its own process, time compressed by
``--time-scale``): InferCept trace sessions (``traces/``) requested with Poisson
arrivals. The engine's GPU holds ``--capacity`` of the workload's estimated peak
working set (sessions' final contexts over their live intervals), the host as much.

Then, from the log alone:

- **agreement**: every event of ``agent.actions``, ``agent.effects`` and ``kv.events``
  is replayed through ``services.cache.manager.CacheManager`` in-process (same
  configuration, same time scale), in time order (``occurred_at``, then topic, then
  offset). A decision's event id is ``uuid5(trigger, kind, session)``, so the worker's
  decisions and the replay's are matched by id: *agree* (same action), *differ*
  (another action), *worker only*, *replay only*. Agreement = agree / all ids. The
  worker reads the topics as Kafka hands them (each partition in order, partitions
  interleaved as they come), so its order differs from the replay's; where an event
  of one topic overtakes one of another (a ``KVBlocksStored`` read after the proposal
  it precedes, a tool duration learned later), decisions can differ. A second replay
  in topic-major order (all of one topic, then the next) shows how much order alone moves,
  and a third in the order the records entered Kafka (their CreateTime, ms; ties by
  ``occurred_at``) approximates the order the worker read them in: it separates what
  the order changes from what the worker's plumbing (decoding, time scale, replay
  rules) might. Last, ``worker_order`` replays the exact order the worker folded the
  events in (it writes it with ``--order-log``): it must agree fully, or the worker
  and the in-process manager are not the same function of the same input.
- **effect**, side by side: the same sessions with the same processes whose decisions
  name no engine (``observed``: the bridge ignores them, so the engine is its vLLM-like
  baseline: blocks freed at the end of each call, LRU reuse), and with ``--bare-baseline``
  also without the bridge and the manager: mean and p95 job time (trace time), prompt
  tokens served from the cache. On a small machine, time compression makes every
  process's CPU show up as job time, hence the ``observed`` baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cli.common import ensure_topics
from cli.data import INFERCEPT, trace_file
from cli.sessions import summarize
from cli.stack import Stack
from log import SharedLog, open_log
from log import topics as topic_table
from schemas.envelope import Envelope
from schemas.events import CacheDecisionMade, SessionId
from services.cache.manager import CacheManager, Decided, ManagerConfig
from services.cache.policy import CachePolicy
from services.engine.cost import CostModel
from services.traces.infercept import from_infercept
from services.traces.model import TraceSession
from workers.cache_manager import INPUT_TOPICS, scaled


def load_sessions(num: int, arrival_rate: float, seed: int) -> list[TraceSession]:
    path = trace_file(INFERCEPT)
    trace = from_infercept(json.loads(path.read_text()), arrival_rate_per_s=arrival_rate, rng=random.Random(seed))
    rng = random.Random(seed)
    chosen = sorted(rng.sample(range(len(trace.sessions)), min(num, len(trace.sessions))))
    return [trace.sessions[i] for i in chosen]


def peak_blocks(sessions: list[TraceSession], cost: CostModel) -> int:
    """Most blocks held at once if every session kept its final context from arrival to its end
    (tool time plus roofline LLM time): an upper estimate of the working set."""
    edges: list[tuple[float, int]] = []
    for s in sessions:
        llm_s = sum(cost.prefill_ms(t.prompt_tokens) + cost.decode_ms(t.output_tokens, 0) for t in s.turns) / 1000
        tools_s = sum(t.tool_duration_s or 0.0 for t in s.turns)
        blocks = -(-s.final_context_tokens // cost.block_size)
        edges += [(s.arrival_s, blocks), (s.arrival_s + llm_s + tools_s, -blocks)]
    held = peak = 0
    for _, delta in sorted(edges):
        held += delta
        peak = max(peak, held)
    return peak


@dataclass
class RunResult:
    name: str
    wall_s: float
    summary: Any
    engine: dict[str, Any]
    logs: dict[str, str] = field(default_factory=dict)


async def request_and_wait(log_url: str, requests: list[tuple[str, str, dict[str, Any]]], arrivals: list[float],
                           timeout_s: float) -> Any:  # fmt: skip
    from cli.agents import _run

    return await _run(log_url, requests, True, timeout_s, quiet=True, arrivals=arrivals)


def run_stack(name: str, log_url: str, namespace: str, sessions: list[TraceSession], args: argparse.Namespace,
              config: ManagerConfig, with_cache_manager: bool, work: Path,
              decisions_for: str | None = None) -> RunResult:  # fmt: skip
    os.environ["AGENTLOG_NAMESPACE"] = namespace  # read by open_log here and by every child process
    ensure_topics(log_url, namespace=namespace)
    engine_args = ["--gpu-blocks", str(config.gpu_total_blocks), "--host-blocks", str(config.host_total_blocks)]
    stack = Stack(
        log_url,
        work / name,
        time_scale=args.time_scale,
        cache_manager=with_cache_manager,
        engine_args=engine_args,
        cache_manager_args=[
            *engine_args,
            "--engine-id",
            decisions_for or config.engine_id,
            "--order-log",
            str(work / name / "order.log"),
        ],
        extra_env={"AGENTLOG_NAMESPACE": namespace},
    )
    run_id = uuid.uuid4().hex[:6]
    requests = [(f"fs-{run_id}-{s.session_id[:8]}", "trace", {"session": s.to_dict()}) for s in sessions]
    first = sessions[0].arrival_s
    arrivals = [(s.arrival_s - first) * args.time_scale for s in sessions]
    began = time.monotonic()
    with stack:
        book = asyncio.run(request_and_wait(log_url, requests, arrivals, args.timeout))
        wall = time.monotonic() - began
        with urllib.request.urlopen(f"{stack.engine_url}/stats", timeout=5) as response:
            engine = json.loads(response.read())
        if with_cache_manager:
            time.sleep(args.settle)  # the last events reach the bridge and the cache manager
        dead = {n: p.log_tail() for n, p in stack.processes.items() if not p.alive()}
        if dead:
            print(f"processes died: {json.dumps(dead, indent=1)}", file=sys.stderr)
    logs = {n: p.log_tail(5) for n, p in stack.processes.items()}
    return RunResult(name, wall, summarize(book.records.values()), engine, logs)


# ----------------------------------------------------------------------- agreement


async def read_topic(log: SharedLog, topic: str) -> list[tuple[Envelope, int, int]]:
    """(envelope, partition, offset) of every record of ``topic``."""
    out = []
    for partition, end in (await log.end_offsets(topic)).items():
        async for record in log.scan(topic, partition, 0, end):
            out.append((log.decode(record), partition, record.position.offset))
    return out


def replay(
    events: list[tuple[str, Envelope, int, int]], config: ManagerConfig, time_scale: float
) -> dict[str, Decided]:
    manager = CacheManager(config, CachePolicy())
    decided: dict[str, Decided] = {}
    for _, envelope, _, _ in events:
        at = envelope.occurred_at.timestamp() / time_scale
        body = scaled(envelope.body, time_scale)
        for d in manager.apply(envelope.event_id, SessionId(envelope.session_id), body, at):
            decided[d.event_id] = d
    return decided


def compare(worker: dict[str, CacheDecisionMade], replayed: dict[str, Decided], time_scale: float) -> dict[str, Any]:
    ids = set(worker) | set(replayed)
    agree = differ = 0
    ttl_close = ttl_both = 0
    by_kind: Counter[str] = Counter()
    by_kind_agree: Counter[str] = Counter()
    differ_pairs: Counter[str] = Counter()
    for i in ids:
        w, r = worker.get(i), replayed.get(i)
        kind = r.kind if r is not None else "?"
        by_kind[kind] += 1
        if w is None or r is None:
            continue
        if w.action is r.decision.action:
            agree += 1
            by_kind_agree[kind] += 1
            if w.ttl_ms is not None:
                ttl_both += 1
                replay_ttl = r.to_event("", time_scale).ttl_ms
                ttl_close += replay_ttl is not None and abs(w.ttl_ms - replay_ttl) <= 0.1 * max(1, replay_ttl)
        else:
            differ += 1
            differ_pairs[f"{w.action.value}->{r.decision.action.value}"] += 1
    return {
        "ids": len(ids),
        "agree": agree,
        "differ": differ,
        "worker_only": len(set(worker) - set(replayed)),
        "replay_only": len(set(replayed) - set(worker)),
        "agreement": agree / len(ids) if ids else math.nan,
        "ttl_within_10pct": f"{ttl_close}/{ttl_both}",
        "by_kind": {k: f"{by_kind_agree[k]}/{n}" for k, n in sorted(by_kind.items())},
        "differ_pairs": dict(differ_pairs),
        "worker_actions": dict(Counter(w.action.value for w in worker.values())),
    }


def append_times(bootstrap: str, namespace: str, topics: list[str]) -> dict[tuple[str, int, int], int]:
    """Each record's Kafka timestamp (the producer's CreateTime, ms): when it entered the log,
    which is about when a caught-up consumer could first read it."""
    from kafka import KafkaConsumer, TopicPartition  # type: ignore[import-untyped,unused-ignore]

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    try:
        tps = [
            TopicPartition(f"{namespace}.{t}", p)
            for t in topics
            for p in consumer.partitions_for_topic(f"{namespace}.{t}") or ()
        ]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)
        out: dict[tuple[str, int, int], int] = {}
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            for tp, messages in consumer.poll(timeout_ms=1000).items():
                for m in messages:
                    out[(tp.topic.removeprefix(f"{namespace}."), tp.partition, m.offset)] = m.timestamp
        return out
    finally:
        consumer.close()


def read_order(path: Path) -> list[tuple[str, int, int]]:
    """The positions the worker folded, in its order (``--order-log``)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        topic, partition, offset = line.split()
        out.append((topic, int(partition), int(offset)))
    return out


async def agreement(
    log_url: str, namespace: str, config: ManagerConfig, time_scale: float, order_log: Path | None = None
) -> dict[str, Any]:
    async with open_log(log_url, actor="auditor", namespace=namespace) as log:
        events: list[tuple[str, Envelope, int, int]] = []
        for topic in INPUT_TOPICS:
            events += [(topic, e, p, o) for e, p, o in await read_topic(log, topic)]
        decisions = {e.event_id: e.body for e, _, _ in await read_topic(log, topic_table.KV_DECISIONS.name)}
    worker = {i: b for i, b in decisions.items() if isinstance(b, CacheDecisionMade)}
    order = topic_table.TOPIC_ORDER
    by_time = sorted(events, key=lambda x: (x[1].occurred_at, order[x[0]], x[2], x[3]))
    by_topic = sorted(events, key=lambda x: (order[x[0]], x[2], x[3]))
    appended = append_times(log_url.removeprefix("kafka://"), namespace, list(INPUT_TOPICS))
    by_append = sorted(events, key=lambda x: (appended[(x[0], x[2], x[3])], x[1].occurred_at, order[x[0]], x[3]))
    at = {(t, p, o): i for i, (t, p, o) in enumerate(read_order(order_log))} if order_log else {}
    by_worker = sorted(events, key=lambda x: (at.get((x[0], x[2], x[3]), len(at)), x[1].occurred_at))
    kinds = Counter(type(e.body).__name__ for _, e, _, _ in events)
    return {
        "events": len(events),
        "event_mix": dict(kinds),
        "time_order": compare(worker, replay(by_time, config, time_scale), time_scale),
        "topic_major": compare(worker, replay(by_topic, config, time_scale), time_scale),
        "append_order": compare(worker, replay(by_append, config, time_scale), time_scale),
        "worker_order": compare(worker, replay(by_worker, config, time_scale), time_scale),
        "worker_order_events": len(at),
    }


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cache_fullstack", description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=30)
    parser.add_argument("--time-scale", type=float, default=0.01)
    parser.add_argument("--arrival-rate", type=float, default=0.2, help="sessions per second of trace time")
    parser.add_argument("--capacity", type=float, default=0.5, help="GPU blocks as a fraction of the peak estimate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bootstrap", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS"))
    parser.add_argument("--no-baseline", action="store_true", help="skip the run whose decisions are not applied")
    parser.add_argument("--bare-baseline", action="store_true", help="also run without the bridge and the manager")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--settle", type=float, default=5.0, help="seconds to let the last events through")
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not args.bootstrap:
        parser.error("needs a Kafka broker: --bootstrap HOST:PORT or KAFKA_BOOTSTRAP_SERVERS")
    log_url = f"kafka://{args.bootstrap}"
    cost = CostModel()
    sessions = load_sessions(args.sessions, args.arrival_rate, args.seed)
    peak = peak_blocks(sessions, cost)
    biggest_call = max(-(-s.final_context_tokens // cost.block_size) for s in sessions)
    gpu = max(round(args.capacity * peak), biggest_call + 1)
    config = ManagerConfig(gpu_total_blocks=gpu, host_total_blocks=gpu)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="agentlog-fullstack-"))
    turns = sum(len(s.turns) for s in sessions)
    print(f"{len(sessions)} InferCept sessions ({turns} turns), time x{args.time_scale:g}; "
          f"peak estimate {peak:,} blocks, GPU {gpu:,} ({args.capacity:.0%}), host {gpu:,}; work {work}")  # fmt: skip

    results: list[RunResult] = []
    namespace = f"fs{uuid.uuid4().hex[:8]}"
    results.append(run_stack("cache-manager", log_url, namespace, sessions, args, config, True, work))
    print(f"  with the cache manager: {results[-1].wall_s:.1f} s wall", flush=True)
    agreed = asyncio.run(agreement(log_url, namespace, config, args.time_scale, work / "cache-manager" / "order.log"))
    if not args.no_baseline:
        # The same processes, but the decisions name no engine: the bridge ignores them. On a
        # small machine the cache manager's own CPU slows the compressed-time stack; this
        # baseline pays it too, so only the decisions differ.
        ns = f"fs{uuid.uuid4().hex[:8]}"
        results.append(run_stack("observed", log_url, ns, sessions, args, config, True, work, "no-engine"))
        print(f"  observed (decisions not applied): {results[-1].wall_s:.1f} s wall", flush=True)
    if args.bare_baseline:
        results.append(run_stack("bare", log_url, f"fs{uuid.uuid4().hex[:8]}", sessions, args, config, False, work))
        print(f"  bare (no bridge, no cache manager): {results[-1].wall_s:.1f} s wall", flush=True)

    print()
    print(f"events replayed: {agreed['events']:,} {json.dumps(agreed['event_mix'])}")
    header = (
        f"{'replay order':<14} {'ids':>6} {'agree':>6} {'differ':>6} {'worker only':>11} {'replay only':>11}"
        f" {'agreement':>9}"
    )
    print(header)
    print("-" * len(header))
    for name in ("worker_order", "time_order", "append_order", "topic_major"):
        c = agreed[name]
        print(f"{name:<14} {c['ids']:>6} {c['agree']:>6} {c['differ']:>6} {c['worker_only']:>11} "
              f"{c['replay_only']:>11} {c['agreement']:>9.1%}")  # fmt: skip
    t = agreed["time_order"]
    print(f"time order, agreeing ids per kind: {t['by_kind']}; action changes {t['differ_pairs']}; "
          f"TTL within 10 %: {t['ttl_within_10pct']}; worker actions {t['worker_actions']}")  # fmt: skip
    print()
    header = (
        f"{'run':<14} {'finished':>8} {'mean job s':>10} {'p95 job s':>9} {'prompt tok':>10} {'from cache':>10}"
        f" {'wall s':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        s = r.summary
        scale = args.time_scale
        hit = s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0
        print(f"{r.name:<14} {s.finished:>4}/{s.sessions:<3} {s.mean_job_s / scale:>10.1f} {s.p95_job_s / scale:>9.1f} "
              f"{s.prompt_tokens:>10,} {hit:>10.1%} {r.wall_s:>7.1f}")  # fmt: skip
    if args.json:
        out = {
            "sessions": len(sessions),
            "gpu_blocks": gpu,
            "peak_estimate": peak,
            "time_scale": args.time_scale,
            "agreement": agreed,
            "runs": [
                {"name": r.name, "wall_s": r.wall_s, "summary": r.summary.__dict__, "engine": r.engine} for r in results
            ],
        }
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    bad = [r.name for r in results if r.summary.finished != r.summary.sessions]
    if bad:
        print(f"unfinished sessions in {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
