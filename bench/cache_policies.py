"""KV cache policies side by side: a trace-driven discrete-event simulation.

Run::

    python -m bench.cache_policies [--quick] [--engine batch|serial] [--csv FILE] [--png FILE]
                                   [--txt FILE] [--md FILE] [--seeds 0,1,2] [--workloads a,b]
                                   [--policies a,b] [--from-csv FILE] [--traces-dir DIR]
                                   [--loads 0.5,0.8] [--capacities 0.25,0.5,0.75,1] [--jobs N]

(``--quick``: fewer sessions per workload, about 3 minutes on one core.) Results and
the honest comparison: ``docs/cache-policies.md``.

``--seeds``: each seed builds each workload anew (the synthetic sessions, every workload's
arrivals), and a cell's row pools the sessions of every seed's run (``pooled``): a p95 over
one seed's 200 synthetic sessions is its 10th-slowest session, which one long program moves by
more than the 1% the issue-16 goal allows (even the oracle's). ``--jobs``: that many processes
run the (workload, seed, load) units; simulated time is exact, so the rows do not change.

What runs
---------
Simulated time, no sleeps. The engine models are ``services.engine.serial.Sim`` and
``services.engine.batching.BatchSim``; the baselines are in ``bench/baselines.py``, ``ours``
in ``bench/ours.py``; this module builds the workloads, runs the sweep and prints the tables.
One engine serves the LLM calls against a ``PagedKVCache``
(GPU tier plus a host tier of the same size) charged by the default ``CostModel``
(Llama-3-8B on an A100; see ``services/engine/cost.py``). Two engine models:

- ``--engine batch`` (the default): continuous batching, iteration-level scheduling as
  in vLLM (``BatchSim``, whose docstring has the rules): every step each running call
  decodes a token, calls are admitted FIFO while their whole reservation fits in the
  free blocks (what pins and running calls leave), grow a block per ``block_size``
  tokens, and are preempted (newest first, recomputed later) when growth finds no
  block the manager can free. A step costs ``CostModel.batch_step_ms`` (the weight
  read once per step, compute and KV reads per sequence) plus the prefills, swap-ins
  and transfers since the previous step, so memory held by idle sessions shrinks the
  batch and a recompute or transfer stalls every running call.
- ``--engine serial``: one call at a time from a FIFO queue (the project's
  ``SimEngine`` model; ``Sim``), the earlier results' model.

Every policy gets the same engine, cache sizes, cost model and workload; only the
cache manager differs. A session's context is synthetic
token ids (``TokenRun``: shared system prompts share ids, so they share blocks); each
turn appends its prompt, the call generates its output, the tool (true trace
duration) runs, and its result is appended before the next call. A call that does
not fit (``OutOfBlocks``) asks the manager to make room; if it cannot, every pin is
released (counted as ``forced``) and the call retried.

**Transfers are charged both ways.** A call pays ``swap_ms`` for the blocks it swaps
in; every swap-out pays ``swap_ms`` of engine time too: transfers are serialized with
compute (as vLLM v0 swaps blocks in its scheduler step, and as InferCept's waste
model assumes: a swap stalls everyone). Serial: a swap-out made while a call starts
(its ``make_room``) lengthens that call; one made at another time occupies the engine
from then on, so calls that arrive meanwhile wait for it. Batch: the next step pays
it (every running call waits); an idle engine runs it at once.

Policies
--------
- ``vllm``: no cache manager; blocks go back to the LRU at the end of every call
  (finished sessions included).
- ``infercept``: at each tool gap, with the TRUE duration ``T`` (the paper assumes it
  known), the least waste of preserve (``T * C``, block-seconds), swap (``2 *
  swap_s(C) * M``) and discard (``recompute_s(C) * M``), ``C`` the session's blocks
  and ``M`` the GPU blocks held (pinned plus ``C``). Preserve pins until ``now + T``;
  swap moves to the host; discard frees the blocks to the LRU (on a prefix-caching
  engine the freed blocks stay reusable until evicted: the charitable reading).
  Under pressure the pin that returns last (true) is evicted first.
- ``continuum``: pin for the TTL ``tau`` maximizing ``F(tau) * (eta * T_queue +
  reload_s) - tau`` (``F`` the learned tool-duration CDF, ``T_queue`` the measured
  mean queueing delay, ``eta = 1``, ``reload_s`` the recompute time of the context;
  candidates 0, a grid and the observed durations). ``continuum-2s``: a fixed 2 s
  TTL. Under pressure the pin that expires last is released to the LRU first.
- ``kvflow``: pin every waiting session; under pressure evict (swap if the host has
  room, else release to the LRU) the one with the largest estimated time to its next
  call, ``max(0, mean_T - elapsed)`` with ``mean_T`` the learned mean (no future
  knowledge). KVFlow's overlapped prefetch is not modelled (transfers are serial here).
- ``ours``: the shipped cache manager, ``services.cache.manager.CacheManager`` (what
  ``workers/cache_manager.py`` runs, with its default policy), fed the events the log would
  carry (``bench/ours.py``: the planner's LLM calls and tool proposals, the executor's tool
  starts and completions, the engine's KV events as the engine bridge appends them, session
  ends) and nothing else: no queue length, no engine state. Its decisions are carried out as
  the sim server does (``CacheControl.apply``, charged like every transfer); a call that does
  not fit gets the sim server's pressure valve (the pin the manager scored lowest goes to
  the host tier, or is released when the host has no room). It decides at tool gaps, session
  ends, under pressure at each ``LLMCallStarted`` (no headroom kept ahead: the engine has a
  host tier), and at TTL ends and SWAP re-looks once the
  log's time passes them (the first event after them); a PREFETCH brings host blocks back
  and pins them with its TTL.
- ``ours+plas``: ``ours`` plus program-level scheduling (``bench/ours.py``, ``OursPlas``): each
  call is queued at the priority the planner sends (``services.scheduling``), computed from the
  same log events (each session's recorded engine, queue and tool time, and whether the manager's
  last decision still preserves its KV), and the engine models serve by it (``WaitQueue``: lowest
  first; the batch model preempts the lowest-ranked running call, as vLLM's ``priority`` policy),
  on an engine with ranked pins (``CacheControl(ranked=True)``, vLLM's ``--ranked-pins``): a
  waiting call takes no context of a program ranked ahead of it, the valve moves or releases the
  program ranked last first, and the manager, told so (``ManagerConfig.ranked_pins``), only swaps
  under pressure. The priorities are ``PROGRAM_ORDER``'s, as such a server asks the planner for.
  Every other policy is served first come first served, as before. Its goal table: load 0.8,
  capacity <= 50%, against the best non-oracle baseline (``ours`` is not a baseline there).
- ``oracle``: Belady: pin every waiting session; under pressure evict the one whose
  TRUE next call is farthest (swap if room, else release). The bound for
  whole-session eviction (not for every cost: it ignores sizes and transfer time).

"Release to the LRU" is how every manager evicts without host room: the session is
unpinned and the engine evicts only the blocks it needs, the context's tail first, so
the prefix survives (a lazy discard; discarding whole sessions did worse for all).
Every manager but ``vllm`` learns tool durations online (from completed tools only)
and discards a finished session's blocks at once.

Workloads
---------
Every trace in ``--traces-dir`` (default: ``traces/`` at the repository root) that is present,
then the synthetic generator:

- ``infercept``: InferCept's six-augmentation workload (ICML 2024), Poisson arrivals
  (as the paper); 397 sessions (100 with ``--quick``).
- ``continuum-swe``: the 5 SWE-bench trajectories of Continuum's sample trace, 12
  jobs of each (4 with ``--quick``) at Poisson arrivals (ids ``<id>#<k>``; the shared
  system prompt shares blocks, nothing else does).
- ``mooncake``: the first 120 (40) multi-turn sessions recovered from Mooncake's
  conversation trace (its gaps are human think time), arrival offsets rescaled to the
  rate (order and relative spacing kept).
- ``synthetic-lognormal`` and ``synthetic-pareto``: 200 (40) sessions from
  ``services.traces.synthetic`` with log-normal or Pareto tool durations (capped at
  600 s) and mixed session lengths, 50-token median outputs (tool-calling turns are
  short, so that more sessions are alive at once); other settings are its defaults.

Held out, run only when named in ``--workloads`` (``HELD_OUT``): three synthetic shapes made
after the policy was tuned, and never tuned on, to check that its ranking holds on agent
workloads it has not seen (200 sessions each, 40 with ``--quick``, the same generator with
other tools and session lengths):

- ``heldout-swe``: SWE-agent-like work, short tool gaps and long contexts (reads 0.3 s, edits
  0.2 s, test runs 4 s, log-normal; 25 turns on average, 1,500-token tasks, large results);
- ``heldout-human``: few turns waiting mostly on a person (median 20 s, Pareto tail) or a
  quick lookup;
- ``heldout-bimodal``: quick tools (0.1 s) and one slow batch tool (60 s), nothing between.

Every workload is cut at a context window of ``MAX_CONTEXT_TOKENS`` (32k): a session
ends before a call that would exceed it (without the cut, one very long Pareto
session is larger than a quarter of the whole working set and every capacity
collapses to the same size).

Metrics
-------
``jct``: job completion time (session arrival to its last token), mean and p95;
``recomp``: prompt tokens prefilled (not found on GPU or host); ``hit``: prompt
tokens reused (GPU hits plus swapped in) over prompt tokens; ``swapGB``: bytes swapped
out plus in; ``xfer_s``: engine seconds spent on those transfers; ``idleGBs``: GPU
memory-time held by pinned idle sessions (GB-s); ``forced``: times every pin had to
be dropped. ``floor``: the mean JCT with no queueing and a perfect cache (tool time
plus ``service_s``): no policy can do better, which bounds every speedup.

Capacity is a fraction (25/50/75/100%) of the workload's peak working set: the
largest, over call starts in an unconstrained run, of the blocks of every live
session's context plus the call's reservation (never below the largest call, so on a
workload whose largest call is above 25% of the peak, 25% and 50% can coincide: the
``blocks`` column says). Arrival rates are offered loads (50% and 80%) of the
engine's throughput with a perfect cache (only appended tokens prefilled): serial, of
a session's engine time alone; batch, of its engine time in full batches of
``MAX_NUM_SEQS`` (``engine_s_per_session``). What is lost to recomputation, transfers
and smaller batches pushes the real load above that, and queueing shows it.
``preempt``: calls preempted (batch engine); ``batch``: running calls averaged over
the time the engine computes; ``prefetch``: PREFETCHes carried out (``ours`` only; their
blocks count in ``swapGB`` and their time in ``xfer_s``).
"""

from __future__ import annotations

import argparse
import csv
import json
import multiprocessing
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

from bench.baselines import make_baseline
from bench.ours import Ours, OursPlas, VllmPlas, VllmPlasHold
from services.engine.batching import MAX_NUM_SEQS, BatchSim
from services.engine.cost import CostModel
from services.engine.serial import Metrics, Sim, SimManager
from services.traces.arrivals import poisson_arrivals
from services.traces.continuum import from_continuum
from services.traces.infercept import from_infercept
from services.traces.model import Trace, TraceSession, TraceTurn, head
from services.traces.mooncake import from_mooncake
from services.traces.stats import percentile
from services.traces.synthetic import ToolProfile, synthetic

TRACES_DIR = Path(__file__).resolve().parents[1] / "traces"  # the repository's traces/ (--traces-dir)
MAX_CONTEXT_TOKENS = 32_768  # the model's context window: longer sessions end early
LOADS = (0.5, 0.8)
CAPACITIES = (0.25, 0.5, 0.75, 1.0)
_MS = 1000.0
_GB = 1e9
NOT_BASELINES = frozenset({"ours", "ours+plas", "oracle"})  # what "the best non-oracle baseline" excludes
PLAS_LOAD, PLAS_MAX_CAPACITY = 0.8, 0.5  # issue 16's cells for program-level scheduling
PLAS_SPEEDUP_GOAL, PLAS_WORKLOADS_GOAL, PLAS_SLACK = 1.25, 3, 0.01
POLICIES = ("vllm", "infercept", "continuum", "continuum-2s", "kvflow", "ours", "ours+plas", "oracle")


def make_manager(name: str) -> SimManager:
    """A fresh manager of the policy ``name`` (one of ``POLICIES``)."""
    if name == "ours":
        return Ours()
    if name == "ours+plas":
        return OursPlas()
    if name == "vllm+plas":  # not in the sweep: bench.vllm_agents' plas mode
        return VllmPlas()
    if name == "vllm+plas+hold":  # not in the sweep: bench.vllm_agents' plas+hold mode
        return VllmPlasHold()
    return make_baseline(name)


# ------------------------------------------------------------------ workloads and sweep


def service_s(trace: Trace, cost: CostModel, batch: int = 1) -> float:
    """Engine seconds per session with a perfect cache (each call prefills only what was
    appended since the previous one: the tool result and the new prompt), its calls decoding
    in batches of ``batch`` sequences that share each step's weight read (its share: 1 / batch)."""
    shared = cost.decode_step_fixed_ms * (1.0 - 1.0 / batch)
    total = 0.0
    for s in trace:
        context = 0
        pending = 0
        for turn in s.turns:
            new = pending + turn.prompt_tokens
            decode = cost.decode_ms(turn.output_tokens, context + new) - turn.output_tokens * shared
            total += cost.prefill_ms(new, context) + decode
            context += new + turn.output_tokens
            pending = turn.tool_result_tokens or 0
    return total / _MS / max(1, len(trace))


def cap_context(trace: Trace, max_tokens: int) -> Trace:
    """End every session before the call whose context would exceed ``max_tokens`` (the model's
    window); sessions whose first call alone exceeds it are dropped."""
    sessions: list[TraceSession] = []
    for s in trace:
        context = 0
        kept: list[TraceTurn] = []
        for turn in s.turns:
            if context + turn.prompt_tokens + turn.output_tokens > max_tokens:
                break
            kept.append(turn)
            context += turn.appended_tokens
        if not kept:
            continue
        if len(kept) < len(s.turns):
            last = kept[-1]
            kept[-1] = TraceTurn(last.prompt_tokens, last.output_tokens, shared_prefix=last.shared_prefix)
        sessions.append(replace(s, turns=tuple(kept)))
    return Trace(tuple(sessions), notes=(*trace.notes, f"contexts capped at {max_tokens} tokens"))


def respace(trace: Trace, rate_per_s: float) -> Trace:
    """Scale the arrival offsets (order and relative spacing kept) to a mean rate of ``rate_per_s``."""
    if len(trace) < 2:
        return trace
    first, last = trace.sessions[0].arrival_s, trace.sessions[-1].arrival_s
    factor = (len(trace) - 1) / rate_per_s / (last - first) if last > first else 0.0
    sessions = tuple(replace(s, arrival_s=(s.arrival_s - first) * factor) for s in trace)
    return Trace(sessions, notes=(*trace.notes, f"arrivals respaced to {rate_per_s:.3g}/s"))


def replicate(trace: Trace, copies: int, rate_per_s: float, rng: random.Random) -> Trace:
    """``copies`` jobs of every session (ids ``<id>#<k>``), at Poisson arrivals of ``rate_per_s``."""
    jobs = [replace(s, session_id=f"{s.session_id}#{k}") for k in range(copies) for s in trace]
    rng.shuffle(jobs)
    arrivals = poisson_arrivals(len(jobs), rate_per_s, rng)
    sessions = tuple(replace(s, arrival_s=a) for s, a in zip(jobs, arrivals, strict=True))
    return Trace(sessions, notes=(*trace.notes, f"{copies} copies of each session"))


HELD_OUT: dict[str, dict[str, Any]] = {
    "heldout-swe": {
        "tools": (
            ToolProfile("read", weight=0.45, median_s=0.3, sigma=0.8, alpha=1.8, median_result_tokens=900),
            ToolProfile("edit", weight=0.30, median_s=0.2, sigma=0.6, alpha=2.0, median_result_tokens=200),
            ToolProfile("test", weight=0.25, median_s=4.0, sigma=1.0, alpha=1.5, median_result_tokens=1200),
        ),
        "mean_turns": 25.0, "median_task_tokens": 1500, "median_output_tokens": 150, "tool_duration": "lognormal",
    },
    "heldout-human": {
        "tools": (
            ToolProfile("ask", weight=0.7, median_s=20.0, sigma=1.5, alpha=1.2, median_result_tokens=80),
            ToolProfile("lookup", weight=0.3, median_s=1.0, sigma=0.8, alpha=1.8, median_result_tokens=400),
        ),
        "mean_turns": 4.0, "median_output_tokens": 120, "tool_duration": "pareto",
    },
    "heldout-bimodal": {
        "tools": (
            ToolProfile("quick", weight=0.8, median_s=0.1, sigma=0.5, alpha=2.0, median_result_tokens=300),
            ToolProfile("batch", weight=0.2, median_s=60.0, sigma=0.5, alpha=1.5, median_result_tokens=600),
        ),
        "mean_turns": 10.0, "median_output_tokens": 80, "tool_duration": "lognormal",
    },
}  # fmt: skip
"""The held-out shapes (module docstring): ``synthetic``'s settings for each, run only when named."""


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    build: Callable[[float], Trace]  # arrival rate (sessions/s) -> trace


def workloads(quick: bool, seed: int, traces_dir: Path = TRACES_DIR) -> list[Workload]:
    """Every trace in ``traces_dir`` that is present, then the synthetic generator (log-normal, Pareto)."""
    out: list[Workload] = []
    infercept = traces_dir / "infercept_merged_exp_uniform.json"
    if infercept.exists():
        raw = json.loads(infercept.read_text())
        n = 100 if quick else 397
        out.append(
            Workload(
                "infercept",
                lambda rate: head(from_infercept(raw, arrival_rate_per_s=rate, rng=random.Random(seed)), n),
            )
        )
    else:
        print(f"skipping the InferCept workload: {infercept} not found", file=sys.stderr)
    continuum = traces_dir / "continuum_swe_test5_with_timings.json"
    if continuum.exists():
        base = from_continuum(json.loads(continuum.read_text()), arrival_rate_per_s=1.0, rng=random.Random(seed))
        copies = 4 if quick else 12
        out.append(
            Workload(
                "continuum-swe",
                lambda rate: replicate(cap_context(base, MAX_CONTEXT_TOKENS), copies, rate, random.Random(seed)),
            )
        )
    else:
        print(f"skipping the Continuum workload: {continuum} not found", file=sys.stderr)
    mooncake = traces_dir / "mooncake_conversation_trace.jsonl"
    if mooncake.exists():
        whole = cap_context(from_mooncake(mooncake.read_text().splitlines()), MAX_CONTEXT_TOKENS)
        multi = Trace(tuple(s for s in whole if len(s.turns) > 1)[: 40 if quick else 120])
        out.append(Workload("mooncake", lambda rate: respace(multi, rate)))
    else:
        print(f"skipping the Mooncake workload: {mooncake} not found", file=sys.stderr)
    n_synthetic = 40 if quick else 200
    for kind in ("lognormal", "pareto"):
        out.append(
            Workload(
                f"synthetic-{kind}",
                lambda rate, kind=kind: cap_context(  # type: ignore[misc]
                    synthetic(
                        n_synthetic,
                        rng=random.Random(seed),
                        tool_duration=kind,
                        arrival_rate_per_s=rate,
                        median_output_tokens=50,
                        max_tool_duration_s=600.0,
                    ),
                    MAX_CONTEXT_TOKENS,
                ),
            )
        )
    return out + held_out(n_synthetic, seed)  # run only when named (``sweep``)


def held_out(num_sessions: int, seed: int) -> list[Workload]:
    """The held-out shapes (``HELD_OUT``), each ``num_sessions`` sessions of ``synthetic``."""
    return [
        Workload(
            name,
            lambda rate, settings=settings: cap_context(  # type: ignore[misc]
                synthetic(num_sessions, rng=random.Random(seed), arrival_rate_per_s=rate, max_tool_duration_s=600.0,
                          **settings),
                MAX_CONTEXT_TOKENS,
            ),
        )
        for name, settings in HELD_OUT.items()
    ]  # fmt: skip


@dataclass(frozen=True, slots=True)
class Row:
    workload: str
    load: float
    rate: float
    capacity: float
    gpu_blocks: int
    peak_blocks: int
    policy: str
    floor_jct: float
    mean_jct: float
    p95_jct: float
    recomputed: int
    hit_rate: float
    swap_gb: float
    transfer_s: float
    idle_gb_s: float
    forced: int
    preemptions: int = 0
    mean_batch: float = 1.0  # running calls, averaged over the time the engine computes
    prefetches: int = 0  # host residents brought back before their call (ours only)
    seeds: str = "0"  # the seeds whose sessions the row pools (``pooled``)


ENGINES = ("batch", "serial")


def run_one(trace: Trace, policy: str, gpu_blocks: int, cost: CostModel, engine: str = "batch") -> Metrics:
    """One policy on one trace; the host tier is as large as the GPU tier."""
    if engine == "serial":
        return Sim(trace, make_manager(policy), gpu_blocks, gpu_blocks, cost).run()
    if engine == "batch":
        return BatchSim(trace, make_manager(policy), gpu_blocks, gpu_blocks, cost, MAX_NUM_SEQS).run()
    raise ValueError(f"unknown engine {engine!r}: one of {ENGINES}")


def floor_jct(trace: Trace, cost: CostModel) -> float:
    """Mean job time with no queueing and a perfect cache: tool time plus ``service_s``."""
    tools = sum(t.tool_duration_s or 0.0 for s in trace for t in s.turns)
    return (tools / max(1, len(trace))) + service_s(trace, cost)


def row(workload: str, load: float, rate: float, capacity: float, blocks: int, peak: int, policy: str,
        m: Metrics, cost: CostModel, floor: float) -> Row:  # fmt: skip
    return Row(
        workload=workload,
        load=load,
        rate=rate,
        capacity=capacity,
        gpu_blocks=blocks,
        peak_blocks=peak,
        policy=policy,
        floor_jct=floor,
        mean_jct=sum(m.jct) / len(m.jct),
        p95_jct=percentile(m.jct, 0.95),
        recomputed=m.computed_tokens,
        hit_rate=1 - m.computed_tokens / m.prompt_tokens if m.prompt_tokens else 0.0,
        swap_gb=(m.swapped_in_blocks + m.swapped_out_blocks) * cost.block_bytes / _GB,
        transfer_s=m.transfer_s,
        idle_gb_s=m.idle_block_s * cost.block_bytes / _GB,
        forced=m.forced,
        preemptions=m.preemptions,
        mean_batch=m.batch_s / m.busy_s if m.busy_s else 1.0,
        prefetches=m.prefetches,
    )


def engine_s_per_session(trace: Trace, cost: CostModel, engine: str) -> float:
    """What a load is a fraction of: the engine seconds one session takes at the engine's
    throughput with a perfect cache. Serial: the session's calls one at a time. Batch: in full
    batches (``MAX_NUM_SEQS`` sequences share each decode step's weight read), the most
    sessions per second the engine can serve."""
    return service_s(trace, cost, batch=MAX_NUM_SEQS if engine == "batch" else 1)


def selected(names: list[str], only: str | None) -> list[str]:
    """The workloads a sweep runs: those ``only`` names (comma-separated), else all but the held out."""
    if only is None:
        return [n for n in names if n not in HELD_OUT]
    wanted = only.split(",")
    return [n for n in names if n in wanted]


def sweep(
    quick: bool,
    seeds: tuple[int, ...],
    policies: tuple[str, ...],
    loads: tuple[float, ...] = LOADS,
    only: str | None = None,
    engine: str = "batch",
    traces_dir: Path = TRACES_DIR,
    capacities: tuple[float, ...] = CAPACITIES,
    jobs: int = 1,
) -> list[Row]:
    """One row per (workload, load, capacity, policy): the sessions of every seed's trace pooled
    (``pooled``). Each (workload, seed, load) is one ``_unit``, run by ``jobs`` processes."""
    names = selected([w.name for w in workloads(quick, seeds[0], traces_dir)], only)
    units = [(quick, seed, name, load, policies, engine, traces_dir, capacities) for name in names for load in loads
             for seed in seeds]  # fmt: skip
    if jobs > 1:
        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            results = pool.starmap(_unit, units, chunksize=1)
    else:
        results = [_unit(*unit) for unit in units]
    rows: list[Row] = []
    for at in range(0, len(results), len(seeds)):  # one seed after another per (workload, load)
        per_seed = results[at : at + len(seeds)]
        (_, _, name, load, *_) = units[at]
        for i, (capacity, policy) in enumerate((c, p) for c in capacities for p in policies):
            rows.append(pooled(name, load, capacity, policy, [r[i] for r in per_seed], seeds))
    return rows


RunResult = tuple[float, int, int, float, Metrics]
"""One run of a ``_unit``: the arrival rate, the GPU blocks, the peak blocks, the floor and the metrics."""


def _unit(
    quick: bool,
    seed: int,
    name: str,
    load: float,
    policies: tuple[str, ...],
    engine: str,
    traces_dir: Path,
    capacities: tuple[float, ...],
) -> list[RunResult]:
    """Every (capacity, policy) of one workload's trace for ``seed`` at ``load``, in that order."""
    cost = CostModel()
    (w,) = [w for w in workloads(quick, seed, traces_dir) if w.name == name]
    per_session = engine_s_per_session(w.build(1.0), cost, engine)
    rate = load / per_session
    trace = w.build(rate)
    total = sum(-(-s.final_context_tokens // cost.block_size) for s in trace) + 1
    probe = run_one(trace, "vllm", total, cost, engine)
    peak = probe.peak_live_blocks
    floor = floor_jct(trace, cost)
    out: list[RunResult] = []
    for fraction in capacities:
        blocks = max(round(fraction * peak), probe.max_call_blocks + 1)
        for policy in policies:
            out.append((rate, blocks, peak, floor, run_one(trace, policy, blocks, cost, engine)))
    print(f"  {name} seed {seed} load {load:g}: {len(trace)} sessions, peak {peak} blocks", file=sys.stderr)
    return out


def pooled(
    workload: str, load: float, capacity: float, policy: str, runs: list[RunResult], seeds: tuple[int, ...]
) -> Row:
    """One row of the runs of one cell on every seed: their sessions pooled (job times, tokens,
    transfers added up; the floor, rate and block counts averaged over the seeds, weighted by sessions
    for the floor). A p95 over 200 sessions is the 10th-slowest session, which one long program moves
    by several percent (docs/benchmarks.md#program-level-scheduling): seeds pooled, it is the 30th of 600."""
    cost = CostModel()
    m = Metrics()
    floor = 0.0
    for _, _, _, run_floor, run in runs:
        m.jct.extend(run.jct)
        floor += run_floor * len(run.jct)
        for name in ("prompt_tokens", "computed_tokens", "swapped_in_blocks", "swapped_out_blocks", "idle_block_s",
                     "transfer_s", "forced", "preemptions", "batch_s", "busy_s", "prefetches"):  # fmt: skip
            setattr(m, name, getattr(m, name) + getattr(run, name))
    if len(runs) == 1:  # one seed: its own numbers, exactly
        rate, blocks, peak, floor, _ = runs[0]
    else:
        n = len(runs)
        rate, blocks, peak = (
            sum(r[0] for r in runs) / n,
            round(sum(r[1] for r in runs) / n),
            round(sum(r[2] for r in runs) / n),
        )
        floor /= len(m.jct)
    return replace(
        row(workload, load, rate, capacity, blocks, peak, policy, m, cost, floor),
        seeds=",".join(map(str, seeds)),
    )


def print_tables(rows: list[Row], out: TextIO | None = None) -> None:
    out = sys.stdout if out is None else out
    header = (
        f"{'load':>4} {'cap':>4} {'blocks':>6} {'policy':<13} {'meanJCT':>8} {'p95JCT':>8} "
        f"{'recomp':>9} {'hit':>5} {'swapGB':>7} {'xfer_s':>7} {'idleGBs':>8} {'forced':>6} {'preempt':>7} "
        f"{'batch':>5} {'prefetch':>8}"
    )
    for workload in dict.fromkeys(r.workload for r in rows):
        floor = next(r.floor_jct for r in rows if r.workload == workload)
        print(f"\n== {workload} == (mean JCT without queueing or reloads at the first load: {floor:.2f} s)", file=out)
        print(header, file=out)
        for r in (r for r in rows if r.workload == workload):
            print(
                f"{r.load:>4.1f} {r.capacity:>4.0%} {r.gpu_blocks:>6} {r.policy:<13} {r.mean_jct:>8.2f} "
                f"{r.p95_jct:>8.2f} {r.recomputed:>9} {r.hit_rate:>5.1%} {r.swap_gb:>7.2f} {r.transfer_s:>7.2f} "
                f"{r.idle_gb_s:>8.1f} {r.forced:>6} {r.preemptions:>7} {r.mean_batch:>5.1f} {r.prefetches:>8}",
                file=out,
            )
    print_goals(rows, out)
    print_plas_goals(rows, out)


def _groups(rows: list[Row]) -> dict[tuple[str, float, float], dict[str, Row]]:
    groups: dict[tuple[str, float, float], dict[str, Row]] = {}
    for r in rows:
        groups.setdefault((r.workload, r.load, r.capacity), {})[r.policy] = r
    return groups


def print_goals(rows: list[Row], out: TextIO | None = None) -> None:
    """Ours against the best non-oracle baseline per cell, and the issue's goals."""
    out = sys.stdout if out is None else out
    print("\n== ours vs the best non-oracle baseline (mean JCT, s); recomputed tokens vs the oracle ==", file=out)
    wins = ties = losses = 0
    recompute_ratios: list[float] = []
    for (workload, load, capacity), cell in _groups(rows).items():
        if "ours" not in cell:
            continue
        ours = cell["ours"]
        others = {p: r.mean_jct for p, r in cell.items() if p not in NOT_BASELINES}
        text = f"{workload:<18} load {load:.1f} cap {capacity:>4.0%}: ours {ours.mean_jct:8.2f}"
        if others:
            best = min(others, key=lambda p: (others[p], p))
            speedup = others[best] / ours.mean_jct
            if abs(speedup - 1) <= 1e-3:
                verdict, ties = "tie", ties + 1
            elif speedup > 1:
                verdict, wins = "WINS", wins + 1
            else:
                verdict, losses = "loses", losses + 1
            text += f"  best baseline {best:<12} {others[best]:8.2f}  {speedup:.3f}x {verdict}"
        if "oracle" in cell and cell["oracle"].recomputed:
            ratio = ours.recomputed / cell["oracle"].recomputed
            recompute_ratios.append(ratio)
            text += f"  recomp/oracle {ratio:.3f}"
        text += f"  prefetches {ours.prefetches}"
        print(text, file=out)
    print("\n== goals ==", file=out)
    print(
        f"lowest mean JCT of the non-oracle policies: wins {wins}, ties (within 0.1%) {ties}, losses {losses} "
        f"of {wins + ties + losses} cells; ours prefetched {sum(r.prefetches for r in rows if r.policy == 'ours')} "
        "times in all",
        file=out,
    )
    for (workload, load, capacity), cell in _groups(rows).items():
        if workload == "infercept" and capacity == 0.5 and "ours" in cell:
            others = {p: r.mean_jct for p, r in cell.items() if p not in NOT_BASELINES}
            if others:
                best = min(others, key=lambda p: (others[p], p))
                floor = cell["ours"].floor_jct
                text = (
                    f"InferCept trace, 50% capacity, load {load:g}: best baseline ({best}) / ours = "
                    f"{others[best] / cell['ours'].mean_jct:.3f}x (goal >= 1.15x); no policy can beat "
                    f"{others[best] / floor:.3f}x (mean JCT without queueing or reloads: {floor:.2f} s)"
                )
                ample = _groups(rows).get((workload, load, 1.0))
                if ample:
                    best_ample = min(r.mean_jct for r in ample.values())
                    text += (
                        f"; with the whole working set in memory the best mean JCT is {best_ample:.2f} s, "
                        f"a {others[best] / best_ample:.3f}x bound on what memory policy alone can gain"
                    )
                print(text, file=out)
    if recompute_ratios:
        within = sum(1 for r in recompute_ratios if r <= 1.15)
        print(
            f"recomputed prefill vs the oracle: within 15% in {within} of {len(recompute_ratios)} cells; "
            f"worst {max(recompute_ratios):.3f}x, median {percentile(recompute_ratios, 0.5):.3f}x",
            file=out,
        )


def plas_cells(rows: list[Row]) -> list[tuple[str, float, float, Row, Row, Row]]:
    """Issue 16's cells (load 0.8, capacity at or below 50%) that ran ``ours+plas``: ``(workload, load,
    capacity, ours+plas, best baseline by mean JCT, best baseline by p95 JCT)``, baselines being the
    non-oracle policies other than ours."""
    out = []
    for (workload, load, capacity), cell in _groups(rows).items():
        others = [r for p, r in cell.items() if p not in NOT_BASELINES]
        if "ours+plas" not in cell or not others or load != PLAS_LOAD or capacity > PLAS_MAX_CAPACITY:
            continue
        best_mean = min(others, key=lambda r: (r.mean_jct, r.policy))
        best_p95 = min(others, key=lambda r: (r.p95_jct, r.policy))
        out.append((workload, load, capacity, cell["ours+plas"], best_mean, best_p95))
    return out


def print_plas_goals(rows: list[Row], out: TextIO | None = None) -> None:
    """ours+plas against the best non-oracle baseline at load 0.8, capacity <= 50% (issue 16's goal:
    mean JCT >= 1.25x better on >= 3 workloads, no cell worse than the best baseline by > 1%, mean or p95).
    A workload counts when every one of its cells reaches 1.25x. Each line also says the most any policy
    could gain there: the best baseline's mean JCT over the floor (no queueing, a perfect cache)."""
    cells = plas_cells(rows)
    if not cells:
        return
    out = sys.stdout if out is None else out
    print("\n== ours+plas vs the best non-oracle baseline (load 0.8, capacity <= 50%) ==", file=out)
    reached: dict[str, bool] = {}
    worst = 0.0
    for workload, load, capacity, plas, best_mean, best_p95 in cells:
        mean_x = best_mean.mean_jct / plas.mean_jct
        p95_x = best_p95.p95_jct / plas.p95_jct
        worst = max(worst, plas.mean_jct / best_mean.mean_jct - 1, plas.p95_jct / best_p95.p95_jct - 1)
        reached[workload] = reached.get(workload, True) and mean_x >= PLAS_SPEEDUP_GOAL
        print(
            f"{workload:<18} load {load:.1f} cap {capacity:>4.0%}: ours+plas mean {plas.mean_jct:8.2f} p95 "
            f"{plas.p95_jct:8.2f}  best mean {best_mean.policy:<12} {best_mean.mean_jct:8.2f} ({mean_x:.3f}x)  "
            f"best p95 {best_p95.policy:<12} {best_p95.p95_jct:8.2f} ({p95_x:.3f}x)  "
            f"most any policy can gain (best mean / floor): {best_mean.mean_jct / plas.floor_jct:.3f}x",
            file=out,
        )
    wins = sum(reached.values())
    met = wins >= PLAS_WORKLOADS_GOAL and worst <= PLAS_SLACK
    print(
        f"workloads with every cell >= {PLAS_SPEEDUP_GOAL}x: {wins} of {len(reached)} (goal {PLAS_WORKLOADS_GOAL}); "
        f"worst cell vs the best baseline (mean or p95): {worst:+.1%} (goal <= +{PLAS_SLACK:.0%}); "
        f"goal {'met' if met else 'NOT met'}",
        file=out,
    )
    # Where even a policy that reached the floor would gain less than the goal, the goal is out of reach.
    bound = {(w, c): best_mean.mean_jct / plas.floor_jct for w, _, c, plas, best_mean, _ in cells}
    out_of_reach = [f"{w} {c:.0%} ({b:.3f}x)" for (w, c), b in bound.items() if b < PLAS_SPEEDUP_GOAL]
    reachable = {w for w, _ in bound} - {w for (w, _), b in bound.items() if b < PLAS_SPEEDUP_GOAL}
    print(
        f"cells where {PLAS_SPEEDUP_GOAL}x is reachable at all (best mean / floor >= {PLAS_SPEEDUP_GOAL}x): "
        f"{len(bound) - len(out_of_reach)} of {len(bound)}; out of reach: {', '.join(out_of_reach) or 'none'}; "
        f"workloads whose every cell can reach it: {len(reachable)} (goal {PLAS_WORKLOADS_GOAL})",
        file=out,
    )
    ours_worst = [
        max(ours.mean_jct / best_mean.mean_jct - 1, ours.p95_jct / best_p95.p95_jct - 1)
        for w, load, c, _, best_mean, best_p95 in cells
        for ours in rows
        if (ours.workload, ours.load, ours.capacity, ours.policy) == (w, load, c, "ours")
    ]
    if ours_worst:
        print(
            f"ours (no program-level scheduling) in the same cells: worst vs the best baseline (mean or p95) "
            f"{max(ours_worst):+.1%}; cells within +{PLAS_SLACK:.0%}: "
            f"{sum(x <= PLAS_SLACK for x in ours_worst)} of {len(ours_worst)}",
            file=out,
        )


def write_csv(rows: list[Row], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(Row.__slots__)
        for r in rows:
            writer.writerow([getattr(r, name) for name in Row.__slots__])


def read_csv(path: Path) -> list[Row]:
    """The rows ``write_csv`` wrote (columns it lacks, from older files, take their defaults)."""
    rows: list[Row] = []
    with path.open(newline="") as f:
        for record in csv.DictReader(f):
            values: dict[str, object] = {}
            for name, text in record.items():
                kind = Row.__annotations__[name]
                values[name] = int(text) if kind == "int" else float(text) if kind == "float" else text
            rows.append(Row(**values))  # type: ignore[arg-type]
    return rows


def goals_markdown(rows: list[Row]) -> list[str]:
    """One line per cell: ours against the best non-oracle baseline, vLLM and the oracle's recompute."""
    lines = [
        "| workload | load | capacity | ours mean JCT (s) | best baseline | its mean JCT (s) | best baseline / ours "
        "| vllm / ours | ours / oracle recomputed tokens | ours preemptions | ours prefetches |",
        "|---" * 11 + "|",
    ]
    for (workload, load, capacity), cell in _groups(rows).items():
        if "ours" not in cell:
            continue
        ours = cell["ours"]
        others = {p: r.mean_jct for p, r in cell.items() if p not in NOT_BASELINES}
        best = min(others, key=lambda p: (others[p], p)) if others else ""
        vs_best = f"{others[best] / ours.mean_jct:.3f}x" if others else ""
        vs_vllm = f"{cell['vllm'].mean_jct / ours.mean_jct:.3f}x" if "vllm" in cell else ""
        oracle = cell.get("oracle")
        recomputed = f"{ours.recomputed / oracle.recomputed:.3f}" if oracle and oracle.recomputed else ""
        best_jct = f"{others[best]:.2f}" if others else ""
        lines.append(
            f"| {workload} | {load:g} | {capacity:.0%} | {ours.mean_jct:.2f} | {best} | {best_jct} | {vs_best} "
            f"| {vs_vllm} | {recomputed} | {ours.preemptions} | {ours.prefetches} |"
        )
    return lines


def plas_markdown(rows: list[Row]) -> list[str]:
    """Issue 16's cells: ours+plas against the best non-oracle baseline (mean and p95 JCT), and the
    most any policy could gain there (the best baseline over the floor)."""
    cells = plas_cells(rows)
    if not cells:
        return []
    lines = [
        "| workload | load | capacity | ours+plas mean JCT (s) | best baseline (mean) | its mean JCT (s) | speedup "
        "| ours+plas p95 JCT (s) | best baseline (p95) | its p95 JCT (s) | p95 ratio | ours mean JCT (s) "
        "| bound: best mean / floor |",
        "|---" * 13 + "|",
    ]
    for workload, load, capacity, plas, best_mean, best_p95 in cells:
        ours = next((r for r in rows if (r.workload, r.load, r.capacity, r.policy) ==
                     (workload, load, capacity, "ours")), None)  # fmt: skip
        lines.append(
            f"| {workload} | {load:g} | {capacity:.0%} | {plas.mean_jct:.2f} | {best_mean.policy} "
            f"| {best_mean.mean_jct:.2f} | {best_mean.mean_jct / plas.mean_jct:.3f}x | {plas.p95_jct:.1f} "
            f"| {best_p95.policy} | {best_p95.p95_jct:.1f} | {best_p95.p95_jct / plas.p95_jct:.3f}x "
            f"| {'' if ours is None else f'{ours.mean_jct:.2f}'} | {best_mean.mean_jct / plas.floor_jct:.3f}x |"
        )
    return lines


def write_markdown(rows: list[Row], path: Path) -> None:
    """Ours against the best baseline per cell, then per workload, mean and p95 JCT (s), recomputed
    prompt tokens and preemptions per policy as Markdown tables."""
    policies = list(dict.fromkeys(r.policy for r in rows))
    lines: list[str] = ["#### Ours against the best non-oracle baseline, per cell", "", *goals_markdown(rows), ""]
    if plas := plas_markdown(rows):
        lines = ["#### ours+plas against the best non-oracle baseline (load 0.8, capacity <= 50%)", "", *plas, "",
                 *lines]  # fmt: skip
    for workload in dict.fromkeys(r.workload for r in rows):
        mine = [r for r in rows if r.workload == workload]
        lines += [f"#### {workload} (mean JCT without queueing or reloads: {mine[0].floor_jct:.2f} s)", ""]
        columns: tuple[tuple[str, Callable[[Row], str]], ...] = (
            ("mean JCT (s)", lambda r: f"{r.mean_jct:.2f}"),
            ("p95 JCT (s)", lambda r: f"{r.p95_jct:.1f}"),
            ("prompt tokens recomputed", lambda r: str(r.recomputed)),
            ("preemptions (batch engine)", lambda r: str(r.preemptions)),
        )
        for title, value in columns:
            lines += [f"{title}:", ""]
            lines.append(f"| load | capacity | blocks | {' | '.join(policies)} |")
            lines.append("|---" * (3 + len(policies)) + "|")
            for (_, load, capacity), cell in _groups(mine).items():
                first = next(iter(cell.values()))
                values = " | ".join(value(cell[p]) if p in cell else "" for p in policies)
                lines.append(f"| {load:g} | {capacity:.0%} | {first.gpu_blocks} | {values} |")
            lines.append("")
    path.write_text("\n".join(lines) + "\n")


def write_png(rows: list[Row], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: skipping the plot {path}", file=sys.stderr)
        return
    names = list(dict.fromkeys(r.workload for r in rows))
    loads = list(dict.fromkeys(r.load for r in rows))
    fig, axes = plt.subplots(len(names), len(loads), figsize=(4.5 * len(loads), 3.2 * len(names)), squeeze=False)
    for i, workload in enumerate(names):
        for j, load in enumerate(loads):
            ax = axes[i][j]
            for policy in dict.fromkeys(r.policy for r in rows):
                pts = sorted(
                    (1 - r.capacity, r.mean_jct)
                    for r in rows
                    if (r.workload, r.load, r.policy) == (workload, load, policy)
                )
                style = "--" if policy == "oracle" else "-"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", markersize=3, label=policy)
            ax.set_title(f"{workload}, load {load:g}", fontsize=9)
            ax.set_xlabel("memory pressure (1 - capacity / peak)", fontsize=8)
            ax.set_ylabel("mean JCT (s)", fontsize=8)
            ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fractions(text: str) -> tuple[float, ...]:
    """``--loads`` / ``--capacities``: comma-separated numbers in (0, 1]."""
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not values or not all(0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be in (0, 1]")
    return values


def _seeds(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated integers: {text!r}") from None
    if len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"a seed twice: {text!r}")
    return seeds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sessions (about 2 minutes)")
    seeds = parser.add_mutually_exclusive_group()
    seeds.add_argument(
        "--seeds",
        type=_seeds,
        default=(0,),
        help="comma-separated seeds: each cell pools the sessions of every seed's workload (default 0)",
    )
    seeds.add_argument("--seed", type=int, help="one seed (the same as --seeds S)")
    parser.add_argument("--jobs", type=int, default=1, help="processes running the sweep (default 1)")
    parser.add_argument("--csv", type=Path, help="write every row to this CSV file")
    parser.add_argument("--png", type=Path, help="plot mean JCT vs memory pressure (needs matplotlib)")
    parser.add_argument("--txt", type=Path, help="also write the tables to this file")
    parser.add_argument("--md", type=Path, help="write Markdown tables (mean/p95 JCT, recomputed tokens)")
    parser.add_argument("--workloads", help="comma-separated subset of the workloads (default: all)")
    parser.add_argument("--loads", type=_fractions, default=LOADS, help="comma-separated offered loads (0.5,0.8)")
    parser.add_argument(
        "--capacities", type=_fractions, default=CAPACITIES, help="comma-separated capacities (0.25,0.5,0.75,1)"
    )
    parser.add_argument(
        "--traces-dir",
        type=Path,
        default=TRACES_DIR,
        help="where the recorded traces are (default: the repo's traces/)",
    )
    parser.add_argument("--from-csv", type=Path, help="print and write the tables of an earlier run's CSV, run nothing")
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="batch",
        help="batch: continuous batching limited by free KV blocks (default); serial: one call at a time",
    )
    parser.add_argument(
        "--policies", default=",".join(POLICIES), help="comma-separated subset of " + ",".join(POLICIES)
    )
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    policies = tuple(p for p in args.policies.split(",") if p)
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        parser.error(f"unknown policies {unknown}")
    if args.workloads and not args.from_csv:
        known = [w.name for w in workloads(args.quick, 0, args.traces_dir)]
        unknown = sorted(set(args.workloads.split(",")) - set(known))
        if unknown:
            parser.error(f"unknown workloads {unknown}; known: {', '.join(known)}")
    started = time.perf_counter()
    if args.from_csv:
        rows = [r for r in read_csv(args.from_csv) if r.policy in policies]
    else:
        rows = sweep(
            args.quick,
            (args.seed,) if args.seed is not None else args.seeds,
            policies,
            loads=args.loads,
            only=args.workloads,
            engine=args.engine,
            traces_dir=args.traces_dir,
            capacities=args.capacities,
            jobs=args.jobs,
        )
    print_tables(rows)
    if args.txt:
        with args.txt.open("w") as f:
            print_tables(rows, f)
    if args.csv:
        write_csv(rows, args.csv)
    if args.png:
        write_png(rows, args.png)
    if args.md:
        write_markdown(rows, args.md)
    print(f"\n{len(rows)} runs in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
