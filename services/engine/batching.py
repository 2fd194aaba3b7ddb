"""The continuous-batching engine model: iteration-level scheduling, as vLLM's (``BatchSim``,
whose docstring has the rules), on the serial model's sessions, cache, costs and manager hooks
(``services.engine.serial``)."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from schemas.events import SessionId
from services.cache.view import Phase
from services.engine.cost import CostModel
from services.engine.kv_cache import OutOfBlocks
from services.engine.serial import Metrics, Sess, Sim, SimManager
from services.programs.base import TokenRun
from services.traces.model import Trace

__all__ = ["MAX_NUM_SEQS", "BatchSim", "Call"]

MAX_NUM_SEQS = 256  # vLLM's default max_num_seqs
_MS = 1000.0


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
    order (by priority, lowest first, when the manager gives priorities, as vLLM's ``priority``
    scheduling policy: then the running call preempted is the lowest-ranked one) while the call's
    whole reservation (prompt plus every decode slot, less GPU prefix hits)
    fits in the free blocks (``make_room`` is asked when it does not; if it frees nothing the queue
    waits: head-of-line, as vLLM's FCFS) and fewer than ``max_num_seqs`` calls run. A call's blocks
    are allocated as it grows, one per ``block_size`` tokens, so preemption can still happen.

    For speed, steps run in chunks while the batch is unchanged (no call ends, nothing can be
    admitted): a chunk ends at the step boundary at or after the next event (an arrival or a tool's
    end) and at most ``block_size`` steps later; the blocks a call needs within the chunk are
    allocated at its start (at most ``block_size - 1`` steps early). Step times are exact.
    """

    def __init__(self, trace: Trace, manager: SimManager, gpu_blocks: int, host_blocks: int, cost: CostModel,
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
        self._ran = False  # a chunk with calls ended at this time (then an engine left idle calls on_idle)

    def _pins_ended(self, sids: list[SessionId]) -> None:
        """Nothing to do: a running call holds its blocks in its block table whatever its pin does."""

    def run(self) -> Metrics:
        self._arrivals()
        while self._events:
            self.process_next()
        return self.finish()

    def process_next(self) -> None:
        """Handle the next event of this engine's heap (one step of ``run``'s loop). A driver of several
        engines on one clock (``services.engine.multi``) calls it on the engine whose next event is
        earliest; ``enqueue`` is its event: a routed call joins this engine's queue."""
        t, _, kind, sid = heapq.heappop(self._events)
        self._advance(t)
        if kind == "ready":
            self._ready(self.sessions[sid], t)
        elif kind == "enqueue":
            self._enqueue(self.sessions[sid], t)
        elif kind == "step":
            self._ran |= self._step_end(t)
        elif kind == "relook":
            self.manager.on_relook(sid, t)
        if self._events and self._events[0][0] <= t:
            return  # everything that happens at t happens before the engine schedules
        if not self._stepping:
            self._plan(t)
            if self._ran and not self._stepping and not self.queue:
                self.manager.on_idle(t)
                self._plan(t)
        self._ran = False

    def next_event_s(self) -> float:
        """When the next event that could change the batch happens (a chunk of steps ends at or after it)."""
        return self._events[0][0] if self._events else math.inf

    def finish(self) -> Metrics:
        """The run's metrics, once its events are done."""
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
            if self.manager.waits(self.sessions[self.queue[0]], t):
                break  # it waits for the sessions ahead of it; their calls wake the engine
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
        horizon = self.next_event_s() - t
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
            self._preempt(max(self.running.values(), key=self._preempt_order), t)

    def _preempt_order(self, call: Call) -> tuple[float, int]:
        """Which running call goes first when one must be preempted (the largest): the newest under
        FCFS (vLLM's), the lowest-ranked (highest priority value), then the newest, with priorities
        (vLLM's priority policy)."""
        return (self.queue.priority.get(call.sess.sid, 0.0), call.seq)

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
                s.started_at = t
            else:
                del self._resume[s.sid]
                self.m.preempt_recomputed_tokens += alloc.num_computed_tokens
            self.on_host.pop(s.sid, None)
            s.call_computed_tokens = alloc.num_computed_tokens
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
