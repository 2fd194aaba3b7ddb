"""The serial engine model: a trace-driven discrete-event simulation of one engine that serves
one LLM call at a time, with a cache manager's hooks.

Simulated time, no sleeps, no I/O: time is the event heap's. The engine serves the calls
of a ``Trace`` against a ``PagedKVCache`` (GPU tier plus a host tier) charged by a
``CostModel``, from a FIFO queue (lowest priority first when the manager gives priorities:
``SimManager.priority``), one call at a time (``SimEngine``'s model). A session's
context is synthetic token ids (``TokenRun``: shared system prompts share ids, so they
share blocks); each turn appends its prompt, the call generates its output, the tool (its
trace duration) runs, and its result is appended before the next call. A call that does
not fit (``OutOfBlocks``) asks the manager to make room (``SimManager.make_room``); if it
cannot, every pin is released (counted as ``forced``) and the call retried.

**Transfers are charged both ways.** A call pays ``swap_ms`` for the blocks it swaps in;
every swap-out pays ``swap_ms`` of engine time too: transfers are serialized with compute
(as vLLM v0 swaps blocks in its scheduler step, and as InferCept's waste model assumes: a
swap stalls everyone). A swap-out made while a call starts (its ``make_room``) lengthens
that call; one made at another time occupies the engine from then on, so calls that
arrive meanwhile wait for it.

A cache manager acts through the cache's verbs; a manager that decides as the shipped one
does (``CacheDecisionMade``) has its decisions carried out by ``Sim.carry_out``, the sim
server's own mapping (``services.engine.control.CacheControl``). The continuous-batching
model (``services.engine.batching.BatchSim``) subclasses this one.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from schemas.events import CacheAction, CacheDecisionMade, SessionId
from services.cache.latency import ToolLatencyModel
from services.cache.view import Phase
from services.engine.blocks import BlockHash, hash_blocks
from services.engine.control import CacheControl
from services.engine.cost import CostModel
from services.engine.kv_cache import KVCacheError, OutOfBlocks, PagedKVCache
from services.engine.waiting import WaitQueue
from services.programs.base import TokenRun
from services.traces.model import Trace, TraceSession

__all__ = ["HUMAN_TOOLS", "Metrics", "Sess", "Sim", "SimManager", "extend_context"]

HUMAN_TOOLS = frozenset({"human"})
_MS = 1000.0


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
    started_at: float = 0.0  # when its current call was (last) admitted
    call_computed_tokens: int = 0  # prompt tokens its current call prefilled at that admission
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
    refused: int = 0  # decisions the cache refused (no room, in a call): the sim server's 409


def extend_context(s: Sess, block_size: int) -> None:
    """Append what the session's next call reads: the previous tool's result, then the turn's prompt
    (the first turn's shared system prompt under its own ids, so sessions share its blocks)."""
    if s.turn > 0:
        prev = s.trace.turns[s.turn - 1]
        s.append(TokenRun(f"{s.sid}:r{s.turn - 1}", prev.tool_result_tokens or 0), block_size)
    turn = s.trace.turns[s.turn]
    prefix = turn.shared_prefix if s.turn == 0 else None
    own = turn.prompt_tokens
    if prefix is not None:
        s.append(TokenRun(prefix.context_id, prefix.tokens), block_size)
        own -= prefix.tokens
    s.append(TokenRun(f"{s.sid}:p{s.turn}", own), block_size)


class SimManager:
    """A cache manager of the simulator: the hooks the engine model calls (defaults: do nothing,
    and discard a finished session's blocks). ``sim`` is set by the engine model it is given to."""

    name = "base"
    sim: Sim
    ranked_pins = False
    """The engine ranks its pins by program (``CacheControl(ranked=True)``): the manager tells it
    each call's priority (``priority``) and makes room through its ranked valve."""

    def on_ready(self, s: Sess, now: float) -> None:
        pass

    def on_gap(self, s: Sess, now: float) -> None:
        pass

    def on_finish(self, s: Sess, now: float) -> None:
        self.sim.discard(s.sid)

    def on_leave(self, s: Sess, now: float, target: str) -> None:
        """The session's next call runs on another engine (``target``; several engines behind a router):
        what this engine holds of it is a stale copy of a context that now grows there, so it goes, as
        the shipped managers' ``EngineCacheManagers`` discards a moved session on the engine it left."""
        self.sim.discard(s.sid)

    def on_expire(self, sids: list[SessionId], now: float) -> None:
        pass

    def on_idle(self, now: float) -> None:
        """The engine has nothing to run (a transfer now delays no one)."""

    def on_relook(self, sid: SessionId, now: float) -> None:
        """A time the manager asked for (``Sim.push(t, "relook", sid)``) has come."""

    def make_room(self, needed: int, now: float, requester: Sess) -> bool:
        """A call needs ``needed`` more GPU blocks than are free: True if something was freed."""
        return False

    def waits(self, requester: Sess, now: float) -> bool:
        """The call at the head of the queue does not fit, ``make_room`` freed nothing and nothing
        runs: True if it waits anyway, the engine idle, for sessions that will come back for what
        they hold (an engine with ranked pins); False: every pin is released (``forced``)."""
        return False

    def priority(self, s: Sess, now: float) -> float | None:
        """The priority of the session's call that is ready now (lower is served first, as
        ``services.scheduling``'s), or None: first come first served (the default)."""
        return None


class Sim:
    """The serial engine model: one call at a time from a FIFO queue (``SimEngine``'s rule), one run
    of one cache manager on one trace (see the module docstring)."""

    def __init__(self, trace: Trace, manager: SimManager, gpu_blocks: int, host_blocks: int, cost: CostModel) -> None:
        self.cost = cost
        self.bs = cost.block_size
        self.cache = PagedKVCache(self.bs, gpu_blocks, host_blocks)
        # the sim server's mapping of a decision to the cache's verbs, and its pressure valve
        self.control = CacheControl(self.cache, ranked=manager.ranked_pins)
        self.manager = manager
        self.latency = ToolLatencyModel(prior_mean_s=5.0)
        self.sessions = {SessionId(s.session_id): Sess(s, SessionId(s.session_id)) for s in trace}
        self.queue = WaitQueue()  # FCFS, or lowest priority first when the manager gives priorities
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
        self.moved_to_host(sid, moved, now)
        return moved

    def moved_to_host(self, sid: SessionId, num_blocks: int, now: float) -> None:
        """``num_blocks`` of the session went to the host tier (a swap, a SWAP decision or the
        pressure valve): count them there and charge the transfer to the engine."""
        if num_blocks:
            self.on_host[sid] = self.on_host.get(sid, 0) + num_blocks
            self.transfer(num_blocks, now)

    def discard(self, sid: SessionId) -> None:
        self.cache.discard(sid)
        self.on_host.pop(sid, None)

    def carry_out(self, decision: CacheDecisionMade, sid: SessionId, now: float) -> int:
        """Carry out a logged cache decision as the sim server's ``/kv_control`` does
        (``CacheControl.apply``, the TTL from its ``ttl_ms``), its transfer charged to the engine
        like any swap; 0 when the cache refuses it (the server answers 409: nothing changes)."""
        ttl_s = None if decision.ttl_ms is None else decision.ttl_ms / _MS
        action = decision.action
        try:
            moved = self.control.apply(sid, action, now=now, ttl_s=ttl_s, score=decision.score)
        except KVCacheError:
            self.m.refused += 1
            return 0
        if action is CacheAction.SWAP:
            self.moved_to_host(sid, moved, now)
        elif action is CacheAction.DISCARD:
            self.on_host.pop(sid, None)
        elif action is CacheAction.PREFETCH:
            self.on_host.pop(sid, None)
            if moved:
                self.m.prefetches += 1
                self.m.prefetched_blocks += moved
                self.m.swapped_in_blocks += moved
                self.transfer(moved, now)
        return moved

    def _ready(self, s: Sess, t: float) -> None:
        extend_context(s, self.bs)
        self._enqueue(s, t)

    def _enqueue(self, s: Sess, t: float) -> None:
        """The session's call (its context already extended: ``extend_context``) waits for this engine.
        Split from ``_ready`` so that a router in front of several engines (``services.engine.multi``)
        can read the prompt before it picks the engine."""
        if s.turn == 0:
            self._live.add(s.sid)
        else:
            prev = s.trace.turns[s.turn - 1]
            assert prev.tool is not None and prev.tool_duration_s is not None
            self.latency.observe(prev.tool, prev.tool_duration_s)
        s.phase, s.tool, s.ready_at = Phase.IDLE, None, t
        # The manager folds the tool's completion first: the planner computes a call's priority from
        # a log that already holds it (the program's age includes that tool's time).
        self.manager.on_ready(s, t)
        self.queue.append(s.sid, self.manager.priority(s, t))

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
        s.started_at = t
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
        s.call_computed_tokens = alloc.num_computed_tokens
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
