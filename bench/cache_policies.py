"""KV cache policies side by side: a trace-driven discrete-event simulation.

Run::

    python -m bench.cache_policies [--quick] [--engine batch|serial] [--csv FILE] [--png FILE]
                                   [--txt FILE] [--md FILE] [--seed S] [--workloads a,b]
                                   [--policies a,b] [--from-csv FILE]

(``--quick``: fewer sessions per workload, about 3 minutes on one core.) Results and
the honest comparison: ``docs/cache-policies.md``.

What runs
---------
Simulated time, no sleeps. One engine serves the LLM calls against a ``PagedKVCache``
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
- ``ours``: ``services.cache.CachePolicy`` (survival score, host-tier eviction,
  deferred offloads; see its docstring), fed only what a log-driven manager knows:
  phases, tool durations learned from completed tools, the measured queueing delay,
  free blocks, host room and the number of queued calls. It decides at every tool
  gap, at TTL ends, whenever the engine goes idle (deferred offloads and prefetches),
  at the re-look time each SWAP carries (one prefetch lead before the predicted call),
  and when a call needs room. A PREFETCH swaps the host blocks back in
  (``PagedKVCache.swap_in``, charged like every transfer) and pins them with its TTL.
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
Every trace in ``/work/shared/traces`` that is present, then the synthetic generator:

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
import heapq
import json
import math
import random
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TextIO

from schemas.events import CacheAction, SessionId
from services.cache import CachePolicy, Delays, MemoryState, Phase, SessionView, ToolLatencyModel
from services.engine.blocks import BlockHash, hash_blocks
from services.engine.cost import CostModel
from services.engine.kv_cache import OutOfBlocks, PagedKVCache
from services.programs.base import TokenRun
from services.traces.arrivals import poisson_arrivals
from services.traces.continuum import from_continuum
from services.traces.infercept import from_infercept
from services.traces.model import Trace, TraceSession, TraceTurn, head
from services.traces.mooncake import from_mooncake
from services.traces.stats import percentile
from services.traces.synthetic import synthetic

TRACES_DIR = Path("/work/shared/traces")
MAX_CONTEXT_TOKENS = 32_768  # the model's context window: longer sessions end early
LOADS = (0.5, 0.8)
CAPACITIES = (0.25, 0.5, 0.75, 1.0)
HUMAN_TOOLS = frozenset({"human"})
_MS = 1000.0
_GB = 1e9
POLICIES = ("vllm", "infercept", "continuum", "continuum-2s", "kvflow", "ours", "oracle")


# ------------------------------------------------------------------ simulation state


@dataclass(slots=True)
class Sess:
    trace: TraceSession
    sid: SessionId
    turn: int = 0
    tokens: list[int] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)
    phase: Phase = Phase.IDLE
    tool: str | None = None
    gap_started_at: float = 0.0
    next_ready_at: float = 0.0  # true time of the next call's readiness (inf when finished)
    ready_at: float = 0.0
    finished_at: float | None = None

    def append(self, run: TokenRun, block_size: int) -> None:
        if run.count <= 0:
            return
        self.tokens.extend(run.token_ids())
        done = len(self.hashes) * block_size
        parent = self.hashes[-1] if self.hashes else None
        self.hashes.extend(hash_blocks(self.tokens[done:], block_size, parent=parent))


@dataclass(slots=True)
class Metrics:
    jct: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    computed_tokens: int = 0
    swapped_in_blocks: int = 0
    swapped_out_blocks: int = 0
    idle_block_s: float = 0.0
    transfer_s: float = 0.0  # engine time spent swapping (out and in)
    forced: int = 0
    peak_live_blocks: int = 0
    max_call_blocks: int = 0
    preemptions: int = 0  # batch engine: running calls preempted (recompute) for lack of blocks
    preempt_recomputed_tokens: int = 0  # of computed_tokens: recomputed on resuming a preempted call
    steps: int = 0  # batch engine: decode steps run
    batch_s: float = 0.0  # batch engine: running calls integrated over time (mean batch = batch_s / busy_s)
    busy_s: float = 0.0  # batch engine: time spent running steps
    prefetches: int = 0  # host residents brought back to GPU before their call (PREFETCH)
    prefetched_blocks: int = 0  # of swapped_in_blocks: moved by prefetches


class Sim:
    """One run of one policy on one workload."""

    def __init__(self, trace: Trace, manager: Manager, gpu_blocks: int, host_blocks: int, cost: CostModel) -> None:
        self.cost = cost
        self.bs = cost.block_size
        self.cache = PagedKVCache(self.bs, gpu_blocks, host_blocks)
        self.manager = manager
        self.latency = ToolLatencyModel(prior_mean_s=5.0)
        self.sessions = {SessionId(s.session_id): Sess(s, SessionId(s.session_id)) for s in trace}
        self.queue: deque[SessionId] = deque()
        self.busy_until = 0.0
        self.queue_delay_s = 0.0
        self.m = Metrics()
        self._events: list[tuple[float, int, str, SessionId]] = []
        self._seq = 0
        self._last_t = 0.0
        self._live: set[SessionId] = set()
        self.on_host: dict[SessionId, int] = {}  # sessions swapped out -> host blocks
        self._in_call_start = False
        self._start_extra_ms = 0.0  # transfers made while a call starts (its make_room): on its critical path
        self._running_blocks = 0
        manager.sim = self

    def push(self, t: float, kind: str, sid: SessionId) -> None:
        heapq.heappush(self._events, (t, self._seq, kind, sid))
        self._seq += 1

    def _arrivals(self) -> None:
        for s in self.sessions.values():
            s.ready_at = s.trace.arrival_s
            self.push(s.trace.arrival_s, "ready", s.sid)

    def _advance(self, t: float) -> None:
        """Move the clock to ``t``: charge the idle sessions' memory-time, end the TTLs due."""
        self.m.idle_block_s += self._idle_blocks() * (t - self._last_t)
        self._last_t = t
        expired = self.cache.expire(t)
        if expired:
            self._pins_ended(expired)
            self.manager.on_expire(expired, t)

    def _pins_ended(self, sids: list[SessionId]) -> None:
        """The running call's pin can end (its TTL) before the call does. This engine freed the
        call's own blocks at its start, so the pinned ones it counted are free now, not the call's."""
        if any(self.sessions[sid].phase is Phase.LLM for sid in sids):
            self._running_blocks = 0

    def _idle_blocks(self) -> int:
        """GPU memory held by idle sessions: neither free nor the running calls'. Clamped at 0 on
        both engines: the batching engine counts a prefix that running calls share once per call,
        so its ``_running_blocks`` can exceed the blocks in use."""
        return max(0, self.cache.num_gpu_blocks - self.cache.num_free_blocks - self._running_blocks)

    def run(self) -> Metrics:
        self._arrivals()
        while self._events:
            t, _, kind, sid = heapq.heappop(self._events)
            self._advance(t)
            if kind == "ready":
                self._ready(self.sessions[sid], t)
            elif kind == "done":
                self._running_blocks = 0
                self._done(self.sessions[sid], t)
            elif kind == "relook":
                self.manager.on_relook(sid, t)
            if self.busy_until <= t:
                if self.queue:
                    self._start(self.sessions[self.queue.popleft()], t)
                elif kind == "done":
                    self.manager.on_idle(t)
        self.m.swapped_out_blocks = self.cache.stats.num_swapped_out_blocks
        return self.m

    def transfer(self, num_blocks: int, now: float) -> None:
        """Charge a swap of ``num_blocks`` to the engine: transfers are serialized with compute (as vLLM v0
        swaps blocks in the scheduler step), so whoever waits for the engine waits for them too."""
        ms = self.cost.swap_ms(num_blocks)
        self.m.transfer_s += ms / _MS
        if self._in_call_start:
            self._start_extra_ms += ms
            return
        self.busy_until = max(self.busy_until, now) + ms / _MS
        self.push(self.busy_until, "wake", SessionId(""))

    def swap_out(self, sid: SessionId, now: float) -> int:
        """Swap the session out; when the host lacks room after all (a manager's view of shared
        blocks can be off), release it to the LRU instead."""
        try:
            moved = self.cache.swap_out(sid)
        except OutOfBlocks:
            self.cache.release(sid)
            return 0
        if moved:
            self.on_host[sid] = self.on_host.get(sid, 0) + moved
            self.transfer(moved, now)
        return moved

    def discard(self, sid: SessionId) -> None:
        self.cache.discard(sid)
        self.on_host.pop(sid, None)

    def prefetch(self, sid: SessionId, now: float) -> int:
        """Bring the session's host blocks back to GPU before its call (``PagedKVCache.swap_in``),
        charged to the engine like any transfer; 0 when they do not fit after all."""
        try:
            moved = self.cache.swap_in(sid, now)
        except OutOfBlocks:
            return 0
        self.on_host.pop(sid, None)
        if moved:
            self.m.prefetches += 1
            self.m.prefetched_blocks += moved
            self.m.swapped_in_blocks += moved
            self.transfer(moved, now)
        return moved

    def _ready(self, s: Sess, t: float) -> None:
        if s.turn == 0:
            self._live.add(s.sid)
        else:
            prev = s.trace.turns[s.turn - 1]
            assert prev.tool is not None and prev.tool_duration_s is not None
            s.append(TokenRun(f"{s.sid}:r{s.turn - 1}", prev.tool_result_tokens or 0), self.bs)
            self.latency.observe(prev.tool, prev.tool_duration_s)
        s.phase, s.tool, s.ready_at = Phase.IDLE, None, t
        turn = s.trace.turns[s.turn]
        prefix = turn.shared_prefix if s.turn == 0 else None
        own = turn.prompt_tokens
        if prefix is not None:
            s.append(TokenRun(prefix.context_id, prefix.tokens), self.bs)
            own -= prefix.tokens
        s.append(TokenRun(f"{s.sid}:p{s.turn}", own), self.bs)
        self.queue.append(s.sid)
        self.manager.on_ready(s, t)

    def _start(self, s: Sess, t: float) -> None:
        turn = s.trace.turns[s.turn]
        n_prompt = len(s.tokens)
        n_decode = turn.output_tokens - 1
        prompt_hashes = s.hashes[: n_prompt // self.bs]
        need = -(-(n_prompt + n_decode) // self.bs)
        self.m.max_call_blocks = max(self.m.max_call_blocks, need)
        live = sum(-(-len(self.sessions[x].tokens) // self.bs) for x in self._live if x != s.sid)
        self.m.peak_live_blocks = max(self.m.peak_live_blocks, live + need)
        self.queue_delay_s = 0.8 * self.queue_delay_s + 0.2 * (t - s.ready_at)
        s.phase = Phase.LLM
        self._in_call_start, self._start_extra_ms = True, 0.0
        while True:
            try:
                alloc = self.cache.begin_call(
                    s.sid, prompt_hashes, num_prompt_tokens=n_prompt, num_decode_tokens=n_decode, now=t
                )
                break
            except OutOfBlocks as error:
                if error.session_id != s.sid or error.tier.value != "GPU":
                    raise
                if not self.manager.make_room(error.num_needed - error.num_available, t, s):
                    if not self._release_all():
                        raise
                    self.m.forced += 1
        s.append(TokenRun(f"{s.sid}:o{s.turn}", turn.output_tokens), self.bs)
        n_computed = (n_prompt + n_decode) // self.bs
        if n_computed > len(prompt_hashes):
            self.cache.cache_blocks(s.sid, s.hashes[:n_computed])
        self._in_call_start = False
        self.on_host.pop(s.sid, None)
        self.m.transfer_s += self.cost.swap_ms(alloc.num_swapped_in_blocks) / _MS
        ms = (
            self._start_extra_ms
            + self.cost.swap_ms(alloc.num_swapped_in_blocks)
            + self.cost.prefill_ms(alloc.num_computed_tokens, alloc.num_reused_tokens)
            + self.cost.decode_ms(turn.output_tokens, n_prompt)
        )
        finished = t + ms / _MS
        self.cache.end_call(s.sid, finished)
        # The cache model frees the call's blocks now (nothing else runs until it ends); only its
        # pinned blocks stay out of the free queue, and they are in use, not idle, until it ends.
        mine = self.cache.blocks_of(s.sid)
        self._running_blocks = len(mine.gpu_block_ids) if mine.pinned else 0
        self.m.prompt_tokens += n_prompt
        self.m.computed_tokens += alloc.num_computed_tokens
        self.m.swapped_in_blocks += alloc.num_swapped_in_blocks
        self.busy_until = finished
        self.push(finished, "done", s.sid)

    def _release_all(self) -> bool:
        released = 0
        for sid in self.cache.session_ids():
            released += self.cache.release(sid)
        return released > 0

    def _done(self, s: Sess, t: float) -> None:
        turn = s.trace.turns[s.turn]
        s.turn += 1
        if turn.tool is None:
            s.phase, s.finished_at, s.next_ready_at = Phase.FINISHED, t, math.inf
            self._live.discard(s.sid)
            self.m.jct.append(t - s.trace.arrival_s)
            self.manager.on_finish(s, t)
            return
        assert turn.tool_duration_s is not None
        s.phase = Phase.HUMAN if turn.tool in HUMAN_TOOLS else Phase.TOOL
        s.tool, s.gap_started_at = turn.tool, t
        s.next_ready_at = t + turn.tool_duration_s
        self.push(s.next_ready_at, "ready", s.sid)
        self.manager.on_gap(s, t)

    # helpers for managers
    def delayed_by_transfer(self) -> int:
        """Running calls that a transfer made now would delay: none on the serial engine (it
        queues the transfer after the running call, so only calls that arrive meanwhile wait)."""
        return 0

    def gpu_blocks_of(self, sid: SessionId) -> int:
        return len(self.cache.blocks_of(sid).gpu_block_ids)

    def pinned(self) -> list[SessionId]:
        """Pinned sessions not in a call (a running call's blocks cannot be evicted)."""
        return [
            sid
            for sid in self.cache.session_ids()
            if self.cache.blocks_of(sid).pinned and self.sessions[sid].phase is not Phase.LLM
        ]

    def evict(self, sid: SessionId, now: float) -> None:
        """Swap out if the host has room and swap-in is cheaper than recompute, else release to the LRU
        (a lazy discard: the engine evicts only the blocks it needs, the context's tail first)."""
        blocks = self.gpu_blocks_of(sid)
        if 0 < blocks <= self.cache.num_free_host_blocks and self.cost.recompute_vs_swap(blocks) == "swap":
            self.swap_out(sid, now)
        else:
            self.cache.release(sid)


@dataclass(slots=True, eq=False)
class Call:
    """One admission of an LLM call to the batch (a call preempted and resumed is admitted again)."""

    sess: Sess
    seq: int  # admission order: the newest running call is preempted first
    start: int  # global index of its first step (its prefill, which also samples its first token)
    prompt: int  # tokens prefilled (or hit) at admission: the turn's prompt plus what earlier admissions generated
    steps: int  # steps to its last token (tokens it still generates)
    slots: int  # token slots reserved (whole blocks)
    blocks: int  # blocks in its block table
    active: bool = True

    @property
    def end(self) -> int:
        """Index of its last step."""
        return self.start + self.steps - 1

    @property
    def grow_at(self) -> int:
        """First step that needs more slots than reserved (step ``start + j`` needs ``prompt + j``)."""
        return self.start + self.slots - self.prompt + 1


class BatchSim(Sim):
    """The continuous-batching engine model (iteration-level scheduling, as vLLM's).

    Every step, each running call decodes one token; a call admitted at a step also prefills its
    prompt in that step. A step costs ``CostModel.batch_step_ms`` (the weight read once, per-sequence
    compute, every sequence's KV) plus the prefill work, swap-ins and transfers of the calls and
    managers that joined or acted since the previous step; a call alone takes exactly the serial
    model's time. Scheduling at a step boundary, like vLLM's scheduler: first the running calls
    that need a block get one (``extend_call``); if there is none the manager's ``make_room`` is
    asked, and if it frees nothing the newest running call is preempted (its blocks freed, cached
    ones kept in the LRU; it goes back to the head of the queue and recomputes its prompt and what
    it generated, vLLM's default ``recompute`` preemption). Then waiting calls are admitted in FIFO
    order while the call's whole reservation (prompt plus every decode slot, less GPU prefix hits)
    fits in the free blocks (``make_room`` is asked when it does not; if it frees nothing the queue
    waits: head-of-line, as vLLM's FCFS) and fewer than ``max_num_seqs`` calls run. A call's blocks
    are allocated as it grows, one per ``block_size`` tokens, so preemption can still happen.

    For speed, steps run in chunks while the batch is unchanged (no call ends, nothing can be
    admitted): a chunk ends at the step boundary at or after the next event (an arrival or a tool's
    end) and at most ``block_size`` steps later; the blocks a call needs within the chunk are
    allocated at its start (at most ``block_size - 1`` steps early). Step times are exact.
    """

    def __init__(self, trace: Trace, manager: Manager, gpu_blocks: int, host_blocks: int, cost: CostModel,
                 max_num_seqs: int = 256) -> None:  # fmt: skip
        super().__init__(trace, manager, gpu_blocks, host_blocks, cost)
        self.max_num_seqs = max_num_seqs
        self.step = 0  # index of the next step
        self.running: dict[SessionId, Call] = {}
        self._finish: list[tuple[int, int, Call]] = []  # (end, seq, call)
        self._grow: list[tuple[int, int, Call]] = []  # (grow_at, seq, call), calls that need a block before their end
        self._call_seq = 0
        self._ctx_base = 0  # sum over running calls of prompt - start: their contexts at step k total this + B * k
        self._debt_ms = 0.0  # work the next step pays first: prefills, swap-ins, transfers
        self._stepping = False
        self._chunk_steps = 0
        self._chunk_started = 0.0
        self._chunk_batch = 0
        self._resume: dict[SessionId, int] = {}  # preempted session -> tokens its call generated so far

    def _pins_ended(self, sids: list[SessionId]) -> None:
        """Nothing to do: a running call holds its blocks in its block table whatever its pin does."""

    def run(self) -> Metrics:
        self._arrivals()
        ran = False  # a chunk with calls ended at this time (then an engine left idle calls on_idle)
        while self._events:
            t, _, kind, sid = heapq.heappop(self._events)
            self._advance(t)
            if kind == "ready":
                self._ready(self.sessions[sid], t)
            elif kind == "step":
                ran |= self._step_end(t)
            elif kind == "relook":
                self.manager.on_relook(sid, t)
            if self._events and self._events[0][0] <= t:
                continue  # everything that happens at t happens before the engine schedules
            if not self._stepping:
                self._plan(t)
                if ran and not self._stepping and not self.queue:
                    self.manager.on_idle(t)
                    self._plan(t)
            ran = False
        self.m.swapped_out_blocks = self.cache.stats.num_swapped_out_blocks
        self.m.steps = self.step
        return self.m

    def delayed_by_transfer(self) -> int:
        """Every running call: the next step pays for a transfer, so the whole batch waits for it."""
        return len(self.running)

    def transfer(self, num_blocks: int, now: float) -> None:
        """Transfers are serialized with compute: the next step pays for them (an idle engine runs them at once)."""
        ms = self.cost.swap_ms(num_blocks)
        self.m.transfer_s += ms / _MS
        self._debt_ms += ms

    # -------------------------------------------------------------- scheduling

    def _plan(self, t: float) -> None:
        """At a step boundary with the engine free: grow, preempt, admit, then start the next chunk."""
        self._grow_now(t)
        while True:
            self._admit(t)
            if self.running or not self.queue:
                break
            # Nothing runs, yet the head of the queue does not fit and the manager made no room.
            if not self._release_all():
                raise RuntimeError(f"call of {self.queue[0]} does not fit in {self.cache.num_gpu_blocks} blocks")
            self.m.forced += 1
        limit = self._grow_ahead()
        if not self.running:
            if self._debt_ms > 0:  # a transfer with nothing to run: the engine is busy with it
                self._start_chunk(t, 0, self._debt_ms / _MS)
            return
        while not self._finish[0][2].active:
            heapq.heappop(self._finish)
        b = len(self.running)
        k_max = min(self._finish[0][0] - self.step + 1, limit, self.bs)
        context = self._ctx_base + b * self.step
        horizon = self._events[0][0] - t if self._events else math.inf
        k, ms = 1, self._debt_ms + self.cost.batch_step_ms(b, context)
        while k < k_max and ms / _MS < horizon:
            ms += self.cost.batch_step_ms(b, context + b * k)
            k += 1
        self._start_chunk(t, k, ms / _MS)

    def _start_chunk(self, t: float, steps: int, duration_s: float) -> None:
        self._debt_ms = 0.0
        self._stepping = True
        self._chunk_steps, self._chunk_started, self._chunk_batch = steps, t, len(self.running)
        self.push(t + duration_s, "step", SessionId(""))

    def _step_end(self, t: float) -> bool:
        """The chunk ended: calls whose last step it ran finish. True if any call ran."""
        self._stepping = False
        self.step += self._chunk_steps
        self.m.batch_s += self._chunk_batch * (t - self._chunk_started)
        self.m.busy_s += (t - self._chunk_started) if self._chunk_steps else 0.0
        done: list[Call] = []
        while self._finish and self._finish[0][0] < self.step:
            _, _, call = heapq.heappop(self._finish)
            if call.active:
                done.append(call)
        for call in done:
            self._finish_call(call, t)
        return self._chunk_steps > 0

    def _finish_call(self, call: Call, t: float) -> None:
        s = call.sess
        self._remove(call)
        n_computed = (call.prompt + call.steps - 1) // self.bs  # full blocks whose KV the call computed
        if n_computed > (call.prompt // self.bs):
            self.cache.cache_blocks(s.sid, s.hashes[:n_computed])
        self.cache.end_call(s.sid, t)
        self._done(s, t)

    def _remove(self, call: Call) -> None:
        call.active = False
        del self.running[call.sess.sid]
        self._ctx_base -= call.prompt - call.start
        self._running_blocks -= call.blocks

    def _grow_now(self, t: float) -> None:
        """Give a block to every running call that needs one at this step; make room or preempt."""
        while self._grow and self._grow[0][0] <= self.step:
            grow_at, _, call = self._grow[0]
            if not call.active or grow_at != call.grow_at:
                heapq.heappop(self._grow)
                continue
            if self._extend(call):
                continue
            if self.manager.make_room(1, t, call.sess):
                continue
            self._preempt(max(self.running.values(), key=lambda c: c.seq), t)

    def _grow_ahead(self) -> int:
        """Allocate the blocks running calls need within the next ``block_size`` steps, soonest
        first; returns how many steps can run before a call needs a block it could not get."""
        while self._grow and self._grow[0][0] < self.step + self.bs:
            grow_at, _, call = self._grow[0]
            if not call.active or grow_at != call.grow_at:
                heapq.heappop(self._grow)
                continue
            if not self._extend(call):
                return grow_at - self.step
        return self.bs

    def _extend(self, call: Call) -> bool:
        """One more block for the call (True), or False (nothing changed) when none is free."""
        try:
            self.cache.extend_call(call.sess.sid, self.bs)
        except OutOfBlocks:
            return False
        heapq.heappop(self._grow)
        call.slots += self.bs
        call.blocks += 1
        self._running_blocks += 1
        if call.grow_at <= call.end:
            heapq.heappush(self._grow, (call.grow_at, call.seq, call))
        return True

    def _preempt(self, call: Call, t: float) -> None:
        """Recompute preemption: the call's blocks go (its computed full blocks stay cached in the
        LRU, so what survives is a prefix hit on resume); it waits at the head of the queue."""
        s = call.sess
        ran = self.step - call.start  # steps this admission ran: tokens it generated
        assert ran >= 1, "a call is preempted only after its first step"
        computed = (call.prompt + ran - 1) // self.bs
        if computed > call.prompt // self.bs:
            self.cache.cache_blocks(s.sid, s.hashes[:computed])
        self._remove(call)
        self.cache.end_call(s.sid, t)
        generated = call.prompt - self._turn_prompt(s) + ran
        self._resume[s.sid] = generated
        self.queue.appendleft(s.sid)
        self.m.preemptions += 1

    def _turn_prompt(self, s: Sess) -> int:
        """The turn's prompt: the session's tokens less the call's output (appended at its first admission)."""
        return len(s.tokens) - s.trace.turns[s.turn].output_tokens

    def _admit(self, t: float) -> None:
        while self.queue and len(self.running) < self.max_num_seqs:
            s = self.sessions[self.queue[0]]
            turn = s.trace.turns[s.turn]
            generated = self._resume.get(s.sid)
            first = generated is None
            n_turn_prompt = len(s.tokens) if first else self._turn_prompt(s)
            n_prompt = n_turn_prompt + (generated or 0)
            steps = turn.output_tokens - (generated or 0)
            prompt_hashes = s.hashes[: n_prompt // self.bs]
            need, available = self.cache.blocks_to_begin(
                prompt_hashes, num_prompt_tokens=n_prompt, num_decode_tokens=steps - 1
            )
            if need > available:
                if self.manager.make_room(need - available, t, s):
                    continue
                return
            self.queue.popleft()
            alloc = self.cache.begin_call(s.sid, prompt_hashes, num_prompt_tokens=n_prompt, now=t)
            slots = -(-n_prompt // self.bs) * self.bs
            self.cache.extend_call(s.sid, slots - n_prompt)  # the rest of its last block: no new block
            if first:
                self.m.max_call_blocks = max(self.m.max_call_blocks, -(-(n_prompt + steps - 1) // self.bs))
                s.append(TokenRun(f"{s.sid}:o{s.turn}", turn.output_tokens), self.bs)
                live = sum(-(-len(self.sessions[x].tokens) // self.bs) for x in self._live)
                self.m.peak_live_blocks = max(self.m.peak_live_blocks, live)
                self.queue_delay_s = 0.8 * self.queue_delay_s + 0.2 * (t - s.ready_at)
                s.phase = Phase.LLM
            else:
                del self._resume[s.sid]
                self.m.preempt_recomputed_tokens += alloc.num_computed_tokens
            self.on_host.pop(s.sid, None)
            self.m.prompt_tokens += n_prompt
            self.m.computed_tokens += alloc.num_computed_tokens
            self.m.swapped_in_blocks += alloc.num_swapped_in_blocks
            swap_in = self.cost.swap_ms(alloc.num_swapped_in_blocks)
            self.m.transfer_s += swap_in / _MS
            self._debt_ms += swap_in + self.cost.prefill_ms(alloc.num_computed_tokens, alloc.num_reused_tokens)
            call = Call(s, self._call_seq, self.step, n_prompt, steps, slots, len(alloc.block_ids))
            self._call_seq += 1
            self.running[s.sid] = call
            self._ctx_base += call.prompt - call.start
            self._running_blocks += call.blocks
            heapq.heappush(self._finish, (call.end, call.seq, call))
            if call.grow_at <= call.end:
                heapq.heappush(self._grow, (call.grow_at, call.seq, call))


# ------------------------------------------------------------------ managers


class Manager:
    name = "base"
    sim: Sim

    def on_ready(self, s: Sess, now: float) -> None:
        pass

    def on_gap(self, s: Sess, now: float) -> None:
        pass

    def on_finish(self, s: Sess, now: float) -> None:
        self.sim.discard(s.sid)

    def on_expire(self, sids: list[SessionId], now: float) -> None:
        pass

    def on_idle(self, now: float) -> None:
        """The engine has nothing to run (a transfer now delays no one)."""

    def on_relook(self, sid: SessionId, now: float) -> None:
        """A time the manager asked for (``Sim.push(t, "relook", sid)``) has come."""

    def make_room(self, needed: int, now: float, requester: Sess) -> bool:
        return False

    def _evict_by(self, key: Callable[[SessionId], float], requester: Sess, needed: int, now: float) -> bool:
        """Evict pinned sessions, largest key first (ties by id), until ``needed`` blocks are freed."""
        victims = sorted((s for s in self.sim.pinned() if s != requester.sid), key=lambda x: (-key(x), x))
        freed = 0
        for sid in victims:
            if freed >= needed:
                break
            freed += self.sim.gpu_blocks_of(sid)
            self.sim.evict(sid, now)
        return freed > 0


class VLLM(Manager):
    name = "vllm"

    def on_finish(self, s: Sess, now: float) -> None:
        pass


class InferCept(Manager):
    name = "infercept"

    def on_gap(self, s: Sess, now: float) -> None:
        sim = self.sim
        c = sim.gpu_blocks_of(s.sid)
        if c == 0:
            return
        duration = s.next_ready_at - now  # the TRUE tool duration, as the paper assumes
        m = sim.cache.num_gpu_blocks - sim.cache.num_free_blocks + c
        preserve = duration * c
        discard = sim.cost.recompute_ms(c * sim.bs) / _MS * m
        swap = 2 * sim.cost.swap_ms(c) / _MS * m if c <= sim.cache.num_free_host_blocks else math.inf
        best = min(preserve, swap, discard)
        if best == preserve:
            sim.cache.pin(s.sid, until=s.next_ready_at)
        elif best == swap:
            sim.swap_out(s.sid, now)
        # discard: blocks stay in the LRU (freed, still cached)

    def make_room(self, needed: int, now: float, requester: Sess) -> bool:
        return self._evict_by(lambda sid: self.sim.sessions[sid].next_ready_at, requester, needed, now)


class Continuum(Manager):
    name = "continuum"
    GRID = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)

    def __init__(self, fixed_ttl_s: float | None = None, eta: float = 1.0) -> None:
        self.fixed_ttl_s = fixed_ttl_s
        self.eta = eta
        if fixed_ttl_s is not None:
            self.name = f"continuum-{fixed_ttl_s:g}s"

    def ttl(self, s: Sess) -> float:
        if self.fixed_ttl_s is not None:
            return self.fixed_ttl_s
        assert s.tool is not None
        sim = self.sim
        reload_s = sim.cost.recompute_ms(len(s.tokens)) / _MS
        gain = self.eta * sim.queue_delay_s + reload_s
        best, best_value = 0.0, 0.0
        for tau in (*self.GRID, *sim.latency.quantiles(s.tool)):
            value = sim.latency.cdf(s.tool, tau) * gain - tau
            if value > best_value:
                best, best_value = tau, value
        return best

    def on_gap(self, s: Sess, now: float) -> None:
        tau = self.ttl(s)
        if tau > 0:
            self.sim.cache.pin(s.sid, until=now + tau)

    def make_room(self, needed: int, now: float, requester: Sess) -> bool:
        pinned = [sid for sid in self.sim.pinned() if sid != requester.sid]
        pinned.sort(key=lambda sid: (-(self.sim.cache.blocks_of(sid).pin_until or math.inf), sid))
        freed = 0
        for sid in pinned:
            if freed >= needed:
                break
            freed += self.sim.cache.release(sid)
        return freed > 0


class KVFlow(Manager):
    name = "kvflow"

    def on_gap(self, s: Sess, now: float) -> None:
        self.sim.cache.pin(s.sid)

    def estimate(self, sid: SessionId, now: float) -> float:
        s = self.sim.sessions[sid]
        if s.phase not in (Phase.TOOL, Phase.HUMAN) or s.tool is None:
            return 0.0
        return max(0.0, self.sim.latency.mean(s.tool) - (now - s.gap_started_at))

    def make_room(self, needed: int, now: float, requester: Sess) -> bool:
        return self._evict_by(lambda sid: self.estimate(sid, now), requester, needed, now)


class Oracle(Manager):
    name = "oracle"

    def on_gap(self, s: Sess, now: float) -> None:
        self.sim.cache.pin(s.sid)

    def make_room(self, needed: int, now: float, requester: Sess) -> bool:
        def next_reference(sid: SessionId) -> float:
            s = self.sim.sessions[sid]
            return s.next_ready_at if s.phase in (Phase.TOOL, Phase.HUMAN) else now

        return self._evict_by(next_reference, requester, needed, now)


class Ours(Manager):
    """``services.cache.CachePolicy`` fed what a log-driven manager sees: phases, learned tool
    durations, measured queueing delay, the engine's free blocks, host room and queue length."""

    name = "ours"

    def __init__(self) -> None:
        self.policy: CachePolicy | None = None

    def _policy(self) -> CachePolicy:
        if self.policy is None:
            self.policy = CachePolicy(cost=self.sim.cost, latency=self.sim.latency)
        return self.policy

    def _view(self, sid: SessionId) -> SessionView:
        s = self.sim.sessions[sid]
        started = s.gap_started_at if s.phase in (Phase.TOOL, Phase.HUMAN) else None
        host = self.sim.on_host.get(sid, 0)
        return SessionView(
            sid,
            s.phase,
            since=s.gap_started_at,
            tool=s.tool,
            tool_started_at=started,
            context_tokens=len(s.tokens),
            gpu_blocks=0 if host else self.sim.gpu_blocks_of(sid),
            host_blocks=host,
            turns=s.turn,
        )

    def _apply(self, sids: list[SessionId], now: float, needed: int, evict_only: bool) -> bool:
        sim = self.sim
        cache = sim.cache
        views = [self._view(sid) for sid in sids]
        reclaimable = {v.session_id: v.gpu_blocks for v in views} if evict_only else None
        memory = MemoryState(
            gpu_total_blocks=cache.num_gpu_blocks,
            gpu_free_blocks=cache.num_free_blocks,
            host_free_blocks=cache.num_free_host_blocks,
            needed_blocks=needed,
            reclaimable=reclaimable,
            queued_calls=len(sim.queue) + sim.delayed_by_transfer(),
        )
        free_before = cache.num_free_blocks
        for d in self._policy().decide(views, now, memory, Delays(queue_s=sim.queue_delay_s)):
            if d.action is CacheAction.PRESERVE and not evict_only:
                assert d.ttl_s is not None
                cache.pin(d.session_id, until=now + d.ttl_s)
            elif d.action is CacheAction.RELEASE:
                cache.release(d.session_id)
            elif d.action is CacheAction.SWAP:
                if sim.swap_out(d.session_id, now) and d.ttl_s is not None:
                    sim.push(now + d.ttl_s, "relook", d.session_id)  # when to consider a prefetch
            elif d.action is CacheAction.DISCARD:
                sim.discard(d.session_id)
            elif d.action is CacheAction.PREFETCH:
                assert d.ttl_s is not None
                if sim.prefetch(d.session_id, now):
                    cache.pin(d.session_id, until=now + d.ttl_s)  # held like a PRESERVE until its call
        return cache.num_free_blocks > free_before

    def _waiting(self, sids: list[SessionId]) -> list[SessionId]:
        return [sid for sid in sids if self.sim.sessions[sid].phase in (Phase.TOOL, Phase.HUMAN, Phase.IDLE)]

    def on_gap(self, s: Sess, now: float) -> None:
        self._apply([s.sid], now, 0, evict_only=False)

    def on_expire(self, sids: list[SessionId], now: float) -> None:
        self._apply(self._waiting(sids), now, 0, evict_only=False)

    def on_idle(self, now: float) -> None:
        # Offloads deferred while calls waited can run now, when they delay no one; so can prefetches.
        residents = self._waiting(sorted(self.sim.on_host))
        self._apply(self._waiting(self.sim.pinned()) + residents, now, 0, evict_only=False)

    def on_relook(self, sid: SessionId, now: float) -> None:
        # The time its SWAP asked for: inside its prefetch lead, if the prediction holds.
        if sid not in self.sim.on_host or not self._waiting([sid]):
            return
        self._apply([sid], now, 0, evict_only=False)
        if sid in self.sim.on_host:  # not prefetched: look again while its call is beyond the lead
            policy, view = self._policy(), self._view(sid)
            distance = policy.next_reference_s(view, now, Delays(queue_s=self.sim.queue_delay_s))
            relook = policy.relook_s(view.host_blocks, distance)
            if relook is not None and distance > policy.lead_s(view.host_blocks):
                self.sim.push(now + relook, "relook", sid)

    def make_room(self, needed: int, now: float, requester: Sess) -> bool:
        pinned = [sid for sid in self.sim.pinned() if sid != requester.sid]
        residents = [sid for sid in self.sim.on_host if sid != requester.sid]
        return self._apply(pinned + residents, now, needed + self.sim.cache.num_free_blocks, evict_only=True)


def make_manager(name: str) -> Manager:
    factories: dict[str, Callable[[], Manager]] = {
        "vllm": VLLM,
        "infercept": InferCept,
        "continuum": Continuum,
        "continuum-2s": lambda: Continuum(fixed_ttl_s=2.0),
        "kvflow": KVFlow,
        "ours": Ours,
        "oracle": Oracle,
    }
    return factories[name]()


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
    return out


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


ENGINES = ("batch", "serial")
MAX_NUM_SEQS = 256  # vLLM's default max_num_seqs


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


def sweep(
    quick: bool,
    seed: int,
    policies: tuple[str, ...],
    loads: tuple[float, ...] = LOADS,
    only: str | None = None,
    engine: str = "batch",
) -> list[Row]:
    cost = CostModel()
    rows: list[Row] = []
    for w in workloads(quick, seed):
        if only is not None and w.name not in only.split(","):
            continue
        per_session = engine_s_per_session(w.build(1.0), cost, engine)
        for load in loads:
            rate = load / per_session
            trace = w.build(rate)
            total = sum(-(-s.final_context_tokens // cost.block_size) for s in trace) + 1
            probe = run_one(trace, "vllm", total, cost, engine)
            peak = probe.peak_live_blocks
            floor = floor_jct(trace, cost)
            for fraction in CAPACITIES:
                blocks = max(round(fraction * peak), probe.max_call_blocks + 1)
                for policy in policies:
                    m = run_one(trace, policy, blocks, cost, engine)
                    rows.append(row(w.name, load, rate, fraction, blocks, peak, policy, m, cost, floor))
            print(f"  {w.name} load {load:g}: {len(trace)} sessions, peak {peak} blocks", file=sys.stderr)
    return rows


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
        others = {p: r.mean_jct for p, r in cell.items() if p not in ("ours", "oracle")}
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
            others = {p: r.mean_jct for p, r in cell.items() if p not in ("ours", "oracle")}
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
        others = {p: r.mean_jct for p, r in cell.items() if p not in ("ours", "oracle")}
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


def write_markdown(rows: list[Row], path: Path) -> None:
    """Ours against the best baseline per cell, then per workload, mean and p95 JCT (s), recomputed
    prompt tokens and preemptions per policy as Markdown tables."""
    policies = list(dict.fromkeys(r.policy for r in rows))
    lines: list[str] = ["#### Ours against the best non-oracle baseline, per cell", "", *goals_markdown(rows), ""]
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sessions (about 2 minutes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--csv", type=Path, help="write every row to this CSV file")
    parser.add_argument("--png", type=Path, help="plot mean JCT vs memory pressure (needs matplotlib)")
    parser.add_argument("--txt", type=Path, help="also write the tables to this file")
    parser.add_argument("--md", type=Path, help="write Markdown tables (mean/p95 JCT, recomputed tokens)")
    parser.add_argument("--workloads", help="comma-separated subset of the workloads (default: all)")
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
    policies = tuple(p for p in args.policies.split(",") if p)
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        parser.error(f"unknown policies {unknown}")
    started = time.perf_counter()
    if args.from_csv:
        rows = [r for r in read_csv(args.from_csv) if r.policy in policies]
    else:
        rows = sweep(args.quick, args.seed, policies, only=args.workloads, engine=args.engine)
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
