"""Routing across engines: round robin, least loaded and agentlog's cache-locality router, side by side.

Run::

    python -m bench.routing [--full] [--engines 2,4] [--workloads a,b] [--load 0.8] [--capacity 0.5]
                            [--queue recompute|prompt] [--seed S] [--txt FILE]

(the default is the quick size: the cache bench's ``--quick`` workloads, a few minutes on one
core; ``--full``: its full workloads.) Issue 18, point 2's numbers.

What runs
---------
``services.engine.multi.MultiSim``: N copies of the cache bench's engine model (``BatchSim``,
continuous batching) on one clock, each with its own GPU and host blocks and its own instance of
the shipped cache manager (``bench/ours.py``, ``Ours``), and the router of ``services/routing.py``
choosing the engine of every call. The workloads are the cache bench's
(``bench.cache_policies.workloads``), offered at ``--load`` (0.8) of N engines' throughput with a
perfect cache; each engine's GPU holds ``--capacity`` (50%) of its share (1/N) of the workload's
peak working set, the host tier as much again (as in the cache bench). Every router gets the same
engines, trace and managers; only the router differs.

Metrics: ``meanJCT`` / ``p95JCT`` (s): session arrival to its last token; ``recomp``: prompt tokens
prefilled (not found on the chosen engine's GPU or host); ``moves``: calls sent to another engine
than the session's previous call; ratios are against round robin in the same cell. The router's
``queued_tokens`` per engine is what the planner counts (``--queue recompute``: the tokens each call
in flight there was expected to compute; ``--queue prompt``: whole prompts, for comparison).

Where the recomputed tokens come from (``MultiMetrics.recompute_*``, split at each routing from
what every engine holds then): ``first`` (a first call's tokens no engine holds), ``new`` (tokens no
engine ever computed: tool results, new prompts), ``lost`` (computed before, held by no engine when
routed: evicted, released or discarded), ``elsewhere`` (held by another engine more than by the
chosen one), ``after`` (evicted from the chosen engine while queued, or preempted). ``first + new``
is the floor no router can go below, so ``round robin / floor`` is the most "fewer recomputed than
round robin" any router could reach in that cell; the goal's table prints it.

Model size
----------
Two engines, one small and one large (``SMALL_COST``: a 1B-class model, 4x faster prefill and
decode, a quarter of the KV bytes per token; the same block count), against two large ones
(all-large), both routed by locality. Each call's size is ``services.routing.choose_size``'s, from
what the run has learned (``SizeStats``: trying the small model 3 times per step, then keeping it on
the steps it completed 90% of the time); a step is a turn's tool (``final`` for the last). A small
call on a step it is bad at (half the steps, drawn by the seed) fails with probability 0.7 (0.02 on
the others) and is retried at once on the large engine. Reported: the share of calls the small
model took, the retries and the prompt tokens their failed calls prefilled, mean and p95 JCT of
small+large vs all-large.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from bench.cache_policies import TRACES_DIR, Workload, engine_s_per_session, selected, workloads
from bench.ours import Ours
from services.engine.batching import BatchSim
from services.engine.cost import CostModel
from services.engine.multi import QUEUE_COUNTS, EngineSpec, MultiMetrics, MultiSim, SizePolicy, SmallModelSkill
from services.routing import ROUTERS, make_router
from services.traces.model import Trace
from services.traces.stats import percentile

ROUTER_ORDER = ("round_robin", "least_loaded", "locality")
RECOMPUTE_GOAL = 2.0  # locality recomputes >= 2x fewer prompt tokens than round robin ...
SMALL_COST = CostModel(
    prefill_ms_per_token=0.025,
    prefill_attention_ms_per_token_pair=0.8e-6,
    decode_ms_per_token=2.5,
    decode_ms_per_sequence=0.025,
    kv_bytes_per_token=32_768,
)


@dataclass(frozen=True, slots=True)
class Row:
    workload: str
    engines: int
    router: str
    sessions: int
    blocks: int
    mean_jct: float
    p95_jct: float
    recomputed: int
    moves: int
    calls: int
    first: int
    new: int
    lost: int
    elsewhere: int
    after: int

    @property
    def floor(self) -> int:
        return self.first + self.new


@dataclass(frozen=True, slots=True)
class SizeRow:
    workload: str
    setup: str  # "small+large" or "all-large"
    mean_jct: float
    p95_jct: float
    calls: int
    small_calls: int
    retries: int
    failed_tokens: int
    recomputed: int


def cell(w: Workload, n: int, load: float, capacity: float, cost: CostModel) -> tuple[Trace, int]:
    """The trace at ``load`` of ``n`` engines and each engine's GPU blocks (its share of the peak)."""
    per_session = engine_s_per_session(w.build(1.0), cost, "batch")
    trace = w.build(load * n / per_session)
    total = sum(-(-s.final_context_tokens // cost.block_size) for s in trace) + 1
    probe = BatchSim(trace, Ours(), total, total, cost).run()
    blocks = max(round(capacity * probe.peak_live_blocks / n), probe.max_call_blocks + 1)
    return trace, blocks


def run_routers(trace: Trace, n: int, blocks: int, cost: CostModel, name: str, queue: str) -> list[Row]:
    rows = []
    for router in ROUTER_ORDER:
        specs = [EngineSpec(f"sim-{i}", Ours(), blocks, blocks, cost) for i in range(n)]
        m = MultiSim(trace, specs, make_router(router), queue=queue).run()
        rows.append(_row(name, n, router, len(trace), blocks, m))
    return rows


def _row(name: str, n: int, router: str, sessions: int, blocks: int, m: MultiMetrics) -> Row:
    jct = m.jct
    assert len(jct) == sessions, f"{name}: {len(jct)} of {sessions} sessions finished"
    return Row(name, n, router, sessions, blocks, sum(jct) / len(jct), percentile(jct, 0.95), m.computed_tokens,
               m.moves, m.calls, m.recompute_first, m.recompute_new, m.recompute_lost, m.recompute_elsewhere,
               m.recompute_after_routing)  # fmt: skip


def run_sizes(trace: Trace, blocks: int, cost: CostModel, name: str, seed: int, queue: str) -> list[SizeRow]:
    rows = []
    for setup in ("all-large", "small+large"):
        small = setup == "small+large"
        specs = [
            EngineSpec(
                "sim-0", Ours(), blocks, blocks, SMALL_COST if small else cost, size="small" if small else "large"
            ),
            EngineSpec("sim-1", Ours(), blocks, blocks, cost),
        ]
        policy = SizePolicy(program=name, skill=SmallModelSkill(seed=seed)) if small else None
        m = MultiSim(trace, specs, make_router("locality"), size_policy=policy, queue=queue).run()
        jct = m.jct
        assert len(jct) == len(trace)
        rows.append(SizeRow(name, setup, sum(jct) / len(jct), percentile(jct, 0.95), m.calls, m.small_calls,
                            m.retries, m.failed_computed_tokens, m.computed_tokens))  # fmt: skip
    return rows


def print_tables(rows: list[Row], sizes: list[SizeRow], out: TextIO) -> None:
    print("== routers side by side (ratios: router / round_robin in the same cell) ==", file=out)
    print(
        f"{'workload':<20} {'eng':>3} {'blocks':>6} {'router':<13} {'meanJCT':>8} {'p95JCT':>8} {'recomp':>10} "
        f"{'moves':>6} {'calls':>6} {'mean/rr':>8} {'p95/rr':>7} {'recomp/rr':>9}",
        file=out,
    )
    met = total = 0
    for r in rows:
        rr = next(x for x in rows if (x.workload, x.engines, x.router) == (r.workload, r.engines, "round_robin"))
        print(
            f"{r.workload:<20} {r.engines:>3} {r.blocks:>6} {r.router:<13} {r.mean_jct:>8.2f} {r.p95_jct:>8.2f} "
            f"{r.recomputed:>10} {r.moves:>6} {r.calls:>6} {r.mean_jct / rr.mean_jct:>8.3f} "
            f"{r.p95_jct / rr.p95_jct:>7.3f} {r.recomputed / max(rr.recomputed, 1):>9.3f}",
            file=out,
        )
    print("\n== where the recomputed prompt tokens come from (floor = first + new: no router avoids them) ==", file=out)
    print(
        f"{'workload':<20} {'eng':>3} {'router':<13} {'recomp':>10} {'first':>9} {'new':>9} {'lost':>9} "
        f"{'elsewhere':>9} {'after':>7} {'floor':>9} {'rr/floor':>8}",
        file=out,
    )
    for r in rows:
        rr = next(x for x in rows if (x.workload, x.engines, x.router) == (r.workload, r.engines, "round_robin"))
        print(
            f"{r.workload:<20} {r.engines:>3} {r.router:<13} {r.recomputed:>10} {r.first:>9} {r.new:>9} {r.lost:>9} "
            f"{r.elsewhere:>9} {r.after:>7} {r.floor:>9} {rr.recomputed / max(r.floor, 1):>8.2f}",
            file=out,
        )
    print("\n== goal: locality recomputes >= 2x fewer prompt tokens than round robin at equal or better mean JCT ==",
          file=out)  # fmt: skip
    for r in rows:
        if r.router != "locality":
            continue
        rr = next(x for x in rows if (x.workload, x.engines, x.router) == (r.workload, r.engines, "round_robin"))
        fewer = rr.recomputed / max(r.recomputed, 1)
        ok = fewer >= RECOMPUTE_GOAL and r.mean_jct <= rr.mean_jct
        met, total = met + ok, total + 1
        print(
            f"{r.workload:<20} {r.engines} engines: {fewer:.2f}x fewer recomputed, mean JCT "
            f"{rr.mean_jct / r.mean_jct:.3f}x round robin's speed: {'met' if ok else 'NOT met'} "
            f"(at most {rr.recomputed / max(r.floor, 1):.2f}x possible: round robin / floor)",
            file=out,
        )
    print(f"goal met in {met} of {total} cells", file=out)
    if not sizes:
        return
    print("\n== model size: one small + one large engine vs two large (locality routing, choose_size) ==", file=out)
    print(
        f"{'workload':<20} {'setup':<12} {'meanJCT':>8} {'p95JCT':>8} {'calls':>6} {'small%':>7} {'retries':>7} "
        f"{'retry_tok':>9} {'recomp':>10} {'mean/all-large':>14}",
        file=out,
    )
    for s in sizes:
        base = next(x for x in sizes if (x.workload, x.setup) == (s.workload, "all-large"))
        print(
            f"{s.workload:<20} {s.setup:<12} {s.mean_jct:>8.2f} {s.p95_jct:>8.2f} {s.calls:>6} "
            f"{s.small_calls / s.calls:>7.1%} {s.retries:>7} {s.failed_tokens:>9} {s.recomputed:>10} "
            f"{s.mean_jct / base.mean_jct:>14.3f}",
            file=out,
        )


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every engine count must be >= 1")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="the cache bench's full workloads (default: --quick's)")
    parser.add_argument("--engines", type=_ints, default=(2, 4), help="comma-separated engine counts (2,4)")
    parser.add_argument("--workloads", help="comma-separated subset of the cache bench's workloads (default: all)")
    parser.add_argument("--load", type=float, default=0.8, help="offered load of the N engines (0.8)")
    parser.add_argument("--capacity", type=float, default=0.5, help="each GPU's share of its 1/N of the peak (0.5)")
    parser.add_argument(
        "--queue",
        choices=QUEUE_COUNTS,
        default="recompute",
        help="what an engine's queued_tokens counts per call in flight (recompute: as the planner)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-sizes", action="store_true", help="skip the small/large model-size runs")
    parser.add_argument("--txt", type=Path, help="also write the tables to this file")
    parser.add_argument("--traces-dir", type=Path, default=TRACES_DIR)
    args = parser.parse_args(argv)
    if not 0 < args.load <= 1 or not 0 < args.capacity <= 1:
        parser.error("--load and --capacity must be in (0, 1]")
    assert set(ROUTER_ORDER) == set(ROUTERS)
    started = time.perf_counter()
    cost = CostModel()
    rows: list[Row] = []
    sizes: list[SizeRow] = []
    chosen = workloads(not args.full, args.seed, args.traces_dir)
    if args.workloads:
        unknown = set(args.workloads.split(",")) - {w.name for w in chosen}
        if unknown:
            parser.error(f"unknown workloads {sorted(unknown)}; known: {', '.join(w.name for w in chosen)}")
    chosen = [w for w in chosen if w.name in selected([w.name for w in chosen], args.workloads)]
    for w in chosen:
        for n in args.engines:
            trace, blocks = cell(w, n, args.load, args.capacity, cost)
            rows += run_routers(trace, n, blocks, cost, w.name, args.queue)
            if n == 2 and not args.no_sizes:
                sizes += run_sizes(trace, blocks, cost, w.name, args.seed, args.queue)
            print(f"  {w.name} {n} engines: {len(trace)} sessions, {blocks} blocks each "
                  f"({time.perf_counter() - started:.0f}s)", file=sys.stderr)  # fmt: skip
    print_tables(rows, sizes, sys.stdout)
    if args.txt:
        with args.txt.open("w") as f:
            load1, load5, load15 = os.getloadavg()
            print(f"# python -m bench.routing {' '.join(argv if argv is not None else sys.argv[1:])}", file=f)
            print(f"# load average at the end: {load1:.2f} {load5:.2f} {load15:.2f} ({os.cpu_count()} cores); "
                  f"{time.perf_counter() - started:.0f}s", file=f)  # fmt: skip
            print_tables(rows, sizes, f)
    print(f"\n{len(rows) + len(sizes)} runs in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
