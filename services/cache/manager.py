"""The cache manager's incremental state: events in, decisions out, O(log n) per event.

``CacheManager.apply(event_id, session_id, body, at)`` folds one log event (``at``: its
time in seconds on the log's clock; the manager never reads a clock) and returns the
decisions it causes, each with a deterministic event id. Pure: no I/O, no randomness;
the same events in the same order always give the same decisions and ids.

**Memory model** (from the log alone, never from the engine). ``gpu_total_blocks`` and
``host_total_blocks`` come from configuration. A session's GPU blocks are the blocks
``kv.events`` says it holds on the GPU; a session with no KV event at all (no engine
bridge) is assumed to hold ``ceil(context_tokens / block_size)``. Right after an LLM
call a session holds its whole context on the GPU (``ceil((prompt + output) /
block_size)``, the *floor*), including prefix blocks it reused from other sessions,
which its own ``KVBlocksStored`` never list; the session's count is the larger of the floor
and its own blocks. When the engine has reported that call (its ``KVCacheHit`` comes last)
the session's own blocks are exact, and the floor less them, at most the blocks the call
reused (``cached_tokens``), is a prefix other sessions stored: the session's ``shared``
count, which leaves the floor and its next call's ``need``. Those blocks are charged to the
session that stored them, not again to each session that reuses them (charged per session,
a system prompt every session shares counted once per pinned session, and the manager
evicted for memory that was free). What is left of the floor stands until the engine
removes blocks of the session after reporting the call. The bridge polls the
engine, so a call's KV events often reach the log after the planner's
``LLMCallCompleted`` and ``ToolCallProposed``: without the floor the gap decision would
see the blocks held before the call (none, after a swap-out). A session is *charged*
(its blocks are not free) while

- in an LLM call (``LLMCallStarted`` .. ``LLMCallCompleted``): ``max(need, held)``
  with ``need = ceil((prompt_tokens + max_output_tokens) / block_size) - shared``;
- pinned by a PRESERVE decision whose TTL has not ended: its GPU blocks.

Everything else is free or evictable (the engine's LRU, as vLLM frees blocks at the
end of each call). ``used = sum(charged)``, ``gpu_free = max(0, total - used)``. The
host tier is charged, per session, its host blocks from kv.events, and at least the
blocks its SWAP decision reserved while the session is swapped.

**Triggers** (each decision's ``trigger_id`` is the event that caused it; its event id
is ``uuid5(NAMESPACE, f"{trigger_id}/{kind}/{session_id}")``, so re-deciding the same
events after a restart appends nothing twice):

- ``gap``: ``ToolCallProposed`` (the LLM call is done, a tool or a human is next) and
  ``end``: ``SessionFinished`` / ``SessionFailed``: the policy decides for that one
  session (``CachePolicy.decide_session``: what ``decide([view])`` does) with the memory
  state of the moment and no deficit: PRESERVE (pinned, TTL), SWAP, RELEASE or DISCARD.
  A session holding no blocks gets no decision.
- ``pressure``: ``LLMCallStarted`` charges the call; if ``used > total`` the manager
  evicts pinned sessions, lowest survival score first (ties by session id), until the
  deficit is covered, each by the policy's one eviction rule (``CachePolicy.evict``, rule 2
  of ``decide``): SWAP when host room is worth the round trip, displacing (DISCARD, first)
  swapped sessions whose host score is lower when the host is full, else RELEASE (the
  engine frees what it needs, LRU). The swapped sessions are its host residents, with the
  host blocks the host is charged for them.
  **Headroom**: after any PRESERVE, pins must leave ``headroom`` blocks free (default:
  the largest call seen so far on an engine without a host tier, none with one: see
  ``ManagerConfig.headroom_blocks``), else the same eviction runs until they do (the new pin
  competes like the others; its eviction is a second decision of the same trigger, kind
  ``pressure``). Decisions reach the engine through the log, after the planner has sent
  the call: room has to be kept ahead of the call, not made when it starts.
  **Ranked pins** (``ManagerConfig.ranked_pins``): no headroom, and pressure only moves pins
  to the host (SWAP); a pin it would RELEASE stays, and the engine's valve gives it up when a
  call needs the room, in the programs' order. A pin then makes later programs' calls wait, so
  a PRESERVE pins only a session that returns within ``ranked_wait_factor`` times its context's
  recompute; one that returns later is sent as a RELEASE and held *loose* (counted, a candidate
  for pressure SWAPs, re-decided at its TTL end, as a pin, but making no call wait).
- ``ttl``: when the log's time passes a PRESERVE's (or a PREFETCH's) TTL end, that
  session is decided again, as of the time of the event that passed it (the trigger is
  the PRESERVE decision's event id).
- ``relook``: a SWAP carries the time to look again (``ttl_s``, see ``CachePolicy.relook_s``);
  when the log's time passes it and the session is still swapped, the policy decides
  for it as a host resident (its host blocks: what the host is charged for it), leaving
  ``headroom`` free: PREFETCH (the trigger is the SWAP decision's event id) or nothing;
  while its call is still beyond the prefetch lead, it asks for the next look
  (``relook_s`` of that moment). A PREFETCH pins like a PRESERVE with its TTL; the
  session is charged the prefetched blocks until kv.events show them on the GPU.
  The manager passes no queue length (``queued_calls = 0``, as for offloads).

**Time** is the largest event time seen (a watermark): TTL ends fire, in order of (end,
session id), before the first event at or after them is folded. Without events, no
TTL fires (the engine's own pin ends at the TTL anyway; the re-score comes late).

**Candidate heap, lazily updated.** Each PRESERVE pushes ``(score, session id,
version)``; every change of a session's hold bumps its version, so an entry of an
earlier hold is skipped when popped instead of being searched for and removed. The
order is the score at the last (re)scoring (gap or TTL end), not re-computed at every
event: a TTL is at most ``ttl_factor`` times the next-reference distance, which bounds
how stale a score gets. Heaps are compacted when stale entries outnumber live ones,
so each event costs O(log n) amortized.

**Finished sessions are forgotten** once nothing can refer to them again, so a
long-running manager's memory follows the live sessions, not every session it ever saw:
after the event that leaves a session finished (``SessionFinished`` / ``SessionFailed``
folded, its ``end`` decision returned), charging nothing on either tier, holding no
blocks by kv.events on either tier (the engine reports their removal after the
DISCARD) and running no tool call, its ``_Session`` and its view are dropped and a
tombstone (its id and the time) is kept for ``forget_after_s``. Late events that can
still arrive for it, and what they do then:

- ``KVBlocksStored`` (a tier's store reported after the other's removal, e.g. a swap):
  the session comes back *finished* (view phase FINISHED, hold DISCARDED), so the blocks
  are counted on their tier (the host is charged) until their removal forgets it again;
- other kv.events (removals of what it no longer holds, a late ``KVCacheHit``, ...) and
  agent.effects (a tool call started after the end: its duration is not observed, the
  tool's name being forgotten): ignored, as they change nothing a decision reads;
- ``LLMCallStarted`` / ``LLMCallCompleted`` / ``ToolCallProposed`` (a finished session
  rewound by a restore and running again): the tombstone goes and the session starts
  afresh (turns and attained service counted from there).

Forgetting is a function of the events folded, in order, like everything else here, so
a replay forgets the same sessions at the same points and decides the same. An event
later than ``forget_after_s`` (manager time) after its session was forgotten is taken as
a new session's.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import uuid
from dataclasses import dataclass, field, replace
from enum import StrEnum

from mypy_extensions import mypyc_attr

from schemas.events import (
    CacheAction,
    CacheDecisionMade,
    KVBlocksRemoved,
    KVBlocksStored,
    KVCacheHit,
    LLMCallCompleted,
    LLMCallStarted,
    Model,
    SessionFailed,
    SessionFinished,
    SessionId,
    ToolCallProposed,
)
from services.cache.policy import CacheDecision, CachePolicy, Delays, MemoryState, RankedResidents
from services.cache.residents import HostResidentIndex
from services.cache.view import CacheViewBuilder, Phase, SessionView

__all__ = ["NAMESPACE", "CacheManager", "Decided", "Hold", "ManagerConfig", "decision_event_id"]

NAMESPACE = uuid.UUID("3b0e7f52-51a4-4c55-9d6e-2f6a8c1d9e47")
"""uuid5 namespace of decision event ids."""

_MS_PER_S = 1000.0
_FINISHING = (SessionFinished, SessionFailed)
_RUNNING_AGAIN = (LLMCallStarted, LLMCallCompleted, ToolCallProposed)  # a forgotten session lives again


_NAMESPACE_BYTES = NAMESPACE.bytes


def decision_event_id(trigger_id: str, kind: str, session_id: str) -> str:
    """The event id of the decision ``kind`` for ``session_id`` caused by ``trigger_id``.

    ``str(uuid.uuid5(NAMESPACE, f"{trigger_id}/{kind}/{session_id}"))``, computed without
    building a ``UUID`` (a third of the cost; one id per decision)."""
    digest = hashlib.sha1(_NAMESPACE_BYTES + f"{trigger_id}/{kind}/{session_id}".encode()).digest()
    # RFC 4122 version 5: the version in the high nibble of byte 6, the variant in byte 8.
    h = (digest[:6] + bytes(((digest[6] & 0x0F) | 0x50, digest[7], (digest[8] & 0x3F) | 0x80)) + digest[9:16]).hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


@dataclass(frozen=True, slots=True)
class ManagerConfig:
    """The engine's capacity (blocks) and how to name it in decisions."""

    gpu_total_blocks: int
    host_total_blocks: int = 0
    block_size: int = 16
    engine_id: str = "sim-0"
    headroom_blocks: int | None = None
    """GPU blocks a PRESERVE must leave free of pins for the next call. None: the largest call
    seen so far (``need`` of an ``LLMCallStarted``) on an engine without a host tier, whose
    pressure valve can only release a pin (its KV is then recomputed); none with a host tier,
    whose valve moves the lowest-ranked pin there when a call needs the room
    (``services.engine.control``): room kept ahead would move pins that no call needs moved;
    none with ``ranked_pins``."""
    ranked_pins: bool = False
    """The engine ranks pins by program (vLLM's ``--ranked-pins``, ``services.engine.control``'s
    ``ranked``): its valve gives up a context when a call needs the room, the program served
    last first, and a call waits rather than take the context of a program ranked ahead. The
    manager then keeps no room ahead, and under pressure it only moves pins to the host tier
    (SWAP, off the calls' critical path); it releases none: by score it would give up contexts
    of the programs the engine serves first. It pins a context only for a session that returns
    soon enough to be waited for (``ranked_wait_factor``)."""
    ranked_wait_factor: float = 10.0
    """On ranked pins, how long a waiting call may be kept waiting for a program ranked ahead, in
    units of that program's recompute: a PRESERVE of a context whose session returns later than
    ``ranked_wait_factor`` times the recompute of its blocks is sent as a RELEASE, and the manager
    holds it *loose* (``Hold.LOOSE``): its blocks stay cached and counted until the engine's LRU
    takes them, its pressure SWAPs may still move them to the host, and the PRESERVE's TTL end
    decides it again. A rank makes every later call wait for the pin, so a pin is worth its rank
    only while waiting for its owner costs less than the owner's recompute would (the factor: one
    recompute delays one call, a wait can hold up the whole batch behind it). Without it, at lower
    load with heavy-tailed tool gaps, contexts of programs in long gaps left the engine half idle
    (docs/benchmarks.md)."""
    forget_after_s: float = 3600.0
    """How long (manager seconds) a forgotten session's tombstone stays: its late events are
    recognised as such until then (see the module docstring)."""

    def __post_init__(self) -> None:
        if self.headroom_blocks is not None and self.headroom_blocks < 0:
            raise ValueError(f"headroom_blocks must be >= 0 or None, got {self.headroom_blocks}")
        if self.forget_after_s < 0:
            raise ValueError(f"forget_after_s must be >= 0, got {self.forget_after_s}")
        if not 0 < self.ranked_wait_factor < math.inf:
            raise ValueError(f"ranked_wait_factor must be a finite number > 0, got {self.ranked_wait_factor}")
        if self.gpu_total_blocks <= 0 or self.host_total_blocks < 0 or self.block_size <= 0:
            raise ValueError(
                "need gpu_total_blocks > 0, host_total_blocks >= 0 and block_size > 0, got "
                f"{self.gpu_total_blocks}, {self.host_total_blocks}, {self.block_size}"
            )


class Hold(StrEnum):
    """What the manager believes the engine does with a session's blocks."""

    NONE = "none"  # nothing decided: LRU-evictable
    ACTIVE = "active"  # in an LLM call
    PINNED = "pinned"  # PRESERVE, TTL running
    LOOSE = "loose"  # ranked pins: RELEASEd rather than pinned, still counted and evicted as a pin (TTL running)
    SWAPPED = "swapped"
    RELEASED = "released"
    DISCARDED = "discarded"


RANKED_SCAN = 16
"""On ranked pins, how many pins a pressure eviction looks at that it may not swap, before it stops.
Nothing it leaves is lost (the engine's valve makes a call's room), and on those engines the
manager's count stays above capacity until the engine's kv.events report what the valve gave up:
a search to the end would read every pin at every call and pin in the meantime (at 10,000
sessions, about 700 pins an eviction: 317 events/s in memory against 52,870 without ranked pins,
docs/benchmarks.md). Of the swaps a search to the end made there, three in four were among the
first 16 pins it read (the lowest scores)."""

_HELD = frozenset((Hold.PINNED, Hold.LOOSE))  # counted on GPU, pressure candidates, re-decided at a TTL end

_HOLD_OF: dict[CacheAction, Hold] = {
    CacheAction.PRESERVE: Hold.PINNED,
    CacheAction.SWAP: Hold.SWAPPED,
    CacheAction.RELEASE: Hold.RELEASED,
    CacheAction.DISCARD: Hold.DISCARDED,
    CacheAction.PREFETCH: Hold.PINNED,  # held with its TTL until its call, like a PRESERVE
}


@dataclass(frozen=True, slots=True)
class Decided:
    """One decision, what caused it, and its deterministic event id."""

    event_id: str
    trigger_id: str
    kind: str  # gap, end, pressure, ttl, relook
    at: float
    decision: CacheDecision
    engine_id: str = ""
    """The engine whose memory it is about (``services.cache.engines``); empty: the configured one."""

    @property
    def session_id(self) -> SessionId:
        return self.decision.session_id

    def to_event(self, engine_id: str, time_scale: float = 1.0) -> CacheDecisionMade:
        """The log event. ``time_scale``: log seconds per manager second (TTLs and
        distances go back to the log's clock)."""
        d = self.decision
        return CacheDecisionMade(
            engine_id=engine_id,
            action=d.action,
            ttl_ms=None if d.ttl_s is None else round(d.ttl_s * time_scale * _MS_PER_S),
            score=d.score,
            next_reference_ms=None if math.isinf(d.next_reference_s) else d.next_reference_s * time_scale * _MS_PER_S,
            num_blocks=d.num_blocks,
            reason=d.reason,
        )


@dataclass(slots=True)
class _Session:
    hold: Hold = Hold.NONE
    version: int = 0  # bumped at every hold change: heap entries of an older version are stale
    need: int = 0  # blocks the running LLM call needs
    charged: int = 0  # GPU blocks counted as used
    host_reserved: int = 0  # host blocks its SWAP decision took
    host_charged: int = 0
    kv_seen: bool = False  # kv.events told us about it (else blocks are estimated from tokens)
    completed_call: str = ""  # the last LLM call the planner reported done
    reported_call: str = ""  # the last LLM call the engine's KV events reported (KVCacheHit)
    floor: int = 0  # blocks of the context its last call left on the GPU, until the engine reports the call
    shared: int = 0  # blocks of its context other sessions stored (a shared prefix): not charged to it
    pin_id: str = ""  # event id of the PRESERVE decision (the trigger of its TTL end)
    swap_id: str = ""  # event id of the SWAP decision (the trigger of its re-looks)
    prefetched: int = 0  # blocks its PREFETCH brings back: charged until kv.events show them


# A subclass may override it where compiled too: tests check the index against a full listing.
@mypyc_attr(allow_interpreted_subclasses=True)
@dataclass(slots=True)
class CacheManager:
    """Folds events, keeps candidates and memory, decides per event (see the module docstring)."""

    config: ManagerConfig
    policy: CachePolicy = field(default_factory=CachePolicy)
    builder: CacheViewBuilder = field(init=False)
    _residents: HostResidentIndex = field(init=False)  # the swapped sessions, for pressure evictions
    now: float = 0.0
    gpu_used: int = 0
    host_used: int = 0
    num_events: int = 0
    num_decisions: int = 0
    _sessions: dict[SessionId, _Session] = field(default_factory=dict)
    _candidates: list[tuple[float, SessionId, int]] = field(default_factory=list)  # (score, sid, version)
    _expiries: list[tuple[float, SessionId, int]] = field(default_factory=list)  # (ttl end, sid, version)
    _relooks: list[tuple[float, SessionId, int]] = field(default_factory=list)  # (re-look time, sid, version)
    _num_held: int = 0
    _max_need: int = 0
    # Forgotten sessions -> the manager time they were forgotten at (insertion order is time order).
    _forgotten: dict[SessionId, float] = field(default_factory=dict)
    num_forgotten: int = 0

    def __post_init__(self) -> None:
        if self.policy.cost.block_size != self.config.block_size:
            # The policy prices blocks as tokens (a recompute of b blocks is b * block_size tokens):
            # blocks of another size would price every decision wrong by their ratio.
            raise ValueError(
                f"the policy's cost model has blocks of {self.policy.cost.block_size} tokens, the engine "
                f"{self.config.block_size}: give the policy CostModel(block_size={self.config.block_size})"
            )
        # One latency model: what the builder learns from effects is what the policy predicts with.
        self.builder = CacheViewBuilder(latency=self.policy.latency)
        self._residents = HostResidentIndex(self.policy)

    # ------------------------------------------------------------------ reading

    def hold(self, session_id: SessionId) -> Hold:
        s = self._sessions.get(session_id)
        if s is None:
            return Hold.DISCARDED if session_id in self._forgotten else Hold.NONE
        return s.hold

    @property
    def num_sessions(self) -> int:
        """Sessions the manager keeps state for (forgotten ones not counted)."""
        return len(self._sessions)

    def forgotten(self, session_id: SessionId) -> bool:
        return session_id in self._forgotten

    def view(self, session_id: SessionId) -> SessionView:
        """The session's view as the policy sees it (GPU blocks estimated without kv.events)."""
        v = self.builder.view(session_id)
        s = self._sessions.get(session_id)
        if s is not None:
            if not s.kv_seen:
                gpu = -(-v.context_tokens // self.config.block_size)
            elif s.floor > v.gpu_blocks:
                gpu = s.floor
            else:
                return v
            return SessionView(
                v.session_id, v.phase, v.since, v.tool, v.tool_started_at, v.context_tokens, gpu, v.host_blocks,
                v.turns, v.attained_service_s,
            )  # fmt: skip
        if session_id in self._forgotten:
            return SessionView(session_id, Phase.FINISHED)
        return v

    def memory(self, needed_blocks: int = 0) -> MemoryState:
        c = self.config
        return MemoryState(
            gpu_total_blocks=c.gpu_total_blocks,
            gpu_free_blocks=max(0, c.gpu_total_blocks - self.gpu_used),
            host_free_blocks=max(0, c.host_total_blocks - self.host_used),
            needed_blocks=needed_blocks,
        )

    def delays(self) -> Delays:
        return Delays(queue_s=self.builder.queue_delay_s, verdict_s=self.builder.verdict_delay_s)

    # ------------------------------------------------------------------ folding

    def apply(self, event_id: str, session_id: SessionId, body: Model, at: float) -> list[Decided]:
        """Fold one event; the decisions it causes (TTL ends it passes first), in order."""
        self.num_events += 1
        out: list[Decided] = []
        if at > self.now:
            self._expire(at, out)
            self.now = at
        now = self.now
        s = self._sessions.get(session_id)
        if s is None:
            if self._forgotten:
                self._drop_tombstones(now)
                if session_id in self._forgotten:
                    if not self._revive(session_id, body, at):
                        return out  # a late event of a forgotten session that changes nothing
                    s = self._sessions[session_id]
            if s is None:
                s = self._sessions[session_id] = _Session()
        self.builder.apply(session_id, body, at)
        self._index(session_id, s)  # its view changed
        if isinstance(body, KVBlocksStored | KVBlocksRemoved):
            s.kv_seen = True
            if isinstance(body, KVBlocksRemoved) and s.reported_call == s.completed_call:
                s.floor = 0  # the engine is taking the context apart (LRU, a swap): count what is left
            self._recharge(session_id, s)
        elif isinstance(body, LLMCallStarted):
            need = -(-(body.prompt_tokens + body.max_output_tokens) // self.config.block_size)
            self._max_need = max(self._max_need, need)
            s.need = max(0, need - s.shared)  # the shared prefix is charged to the session that stored it
            s.host_reserved = 0  # the call brings swapped blocks back
            self._set_hold(session_id, s, Hold.ACTIVE)
            if self.gpu_used > self.config.gpu_total_blocks:
                self._evict(event_id, now, out, reserve=0)
        elif isinstance(body, LLMCallCompleted):
            s.completed_call = body.call_id
            s.floor = -(-(body.prompt_tokens + body.output_tokens) // self.config.block_size)
            self._set_hold(session_id, s, Hold.NONE)  # vLLM frees the call's blocks (cached, LRU)
        elif isinstance(body, KVCacheHit):
            s.reported_call = body.call_id  # the engine's events of that call are all in (the hit comes last)
            if s.kv_seen and s.floor and s.reported_call == s.completed_call:
                # Its own blocks are exact now; the rest of the floor, up to what the call reused,
                # is a prefix others stored.
                own = self.builder.view(session_id).gpu_blocks
                s.shared = max(0, min(s.floor - own, body.cached_tokens // self.config.block_size))
                s.floor -= s.shared
            self._recharge(session_id, s)
        elif isinstance(body, ToolCallProposed):
            self._decide(event_id, "gap", session_id, s, now, out)
        elif isinstance(body, _FINISHING):
            self._decide(event_id, "end", session_id, s, now, out)
            if s.hold is not Hold.DISCARDED:
                s.host_reserved = 0
                self._set_hold(session_id, s, Hold.DISCARDED)
        if s.hold is Hold.DISCARDED and s.charged == 0 and s.host_charged == 0 and self.builder.forgettable(session_id):
            self._forget(session_id)
        self.num_decisions += len(out)
        return out

    def advance(self, at: float) -> list[Decided]:
        """Let the log's time pass without an event of this manager's (another engine's event):
        the TTL ends and re-looks it passes, decided as ``apply`` would before its event."""
        out: list[Decided] = []
        if at > self.now:
            self._expire(at, out)
            self.now = at
        self.num_decisions += len(out)
        return out

    def adopt(self, decided: Decided) -> None:
        """Take ``decided`` as what happened instead of what this run decided under the same
        event id (a restarted worker re-deciding events in another order than before: the
        log's decision is the one the engine carried out)."""
        sid = decided.session_id
        s = self._sessions.get(sid)
        if s is None:
            if sid in self._forgotten:
                if decided.decision.action in (CacheAction.RELEASE, CacheAction.DISCARD):
                    return  # it holds nothing either way
                del self._forgotten[sid]
            s = self._sessions[sid] = _Session()
        self._record(decided, s, [])

    # ---------------------------------------------------------------- forgetting

    def _forget(self, sid: SessionId) -> None:
        """Drop a finished session that holds nothing (module docstring); heap entries that
        still name it are stale (its ``_Session`` is gone) and skipped when popped."""
        del self._sessions[sid]
        self._residents.discard(sid)
        self.builder.forget(sid)
        self._forgotten[sid] = self.now
        self.num_forgotten += 1

    def _revive(self, sid: SessionId, body: Model, at: float) -> bool:
        """Whether an event of forgotten ``sid`` brings it back (then with a ``_Session``)."""
        if isinstance(body, KVBlocksStored):
            # Blocks of a finished session: counted on their tier until removed (module docstring).
            del self._forgotten[sid]
            self._sessions[sid] = _Session(hold=Hold.DISCARDED, kv_seen=True)
            self.builder.finished(sid, at)
            return True
        if isinstance(body, _RUNNING_AGAIN):
            del self._forgotten[sid]
            self._sessions[sid] = _Session()
            return True
        return False

    def _drop_tombstones(self, now: float) -> None:
        horizon = now - self.config.forget_after_s
        forgotten = self._forgotten
        while forgotten:
            sid = next(iter(forgotten))
            if forgotten[sid] >= horizon:
                break
            del forgotten[sid]

    # ----------------------------------------------------------------- deciding

    def _decide_one(self, view: SessionView, now: float) -> CacheDecision | None:
        return self.policy.decide_session(view, now, self.memory(), self.delays())

    @property
    def headroom(self) -> int:
        """Blocks a PRESERVE leaves free of pins for the next call."""
        h = self.config.headroom_blocks
        if h is not None:
            return h
        if self.config.ranked_pins or self.config.host_total_blocks > 0:
            return 0  # the engine's valve makes a call's room when it needs it
        return self._max_need

    def _decide(self, trigger_id: str, kind: str, sid: SessionId, s: _Session, now: float, out: list[Decided]) -> None:
        if s.hold is Hold.ACTIVE:
            return  # blocks in use (an event of the next call was read first)
        decision = self._decide_one(self.view(sid), now)
        if decision is not None:
            self._record(Decided(decision_event_id(trigger_id, kind, sid), trigger_id, kind, now, decision), s, out)
            self._keep_headroom(trigger_id, now, out)

    def _too_far_for_a_rank(self, decision: CacheDecision) -> CacheDecision | None:
        """On ranked pins, a PRESERVE of a session that returns too late to be waited for
        (``ManagerConfig.ranked_wait_factor``): the RELEASE the engine gets instead; else None."""
        if not self.config.ranked_pins or decision.action is not CacheAction.PRESERVE:
            return None
        cost = self.policy.cost  # its blocks are the engine's (``__post_init__``)
        recompute_s = cost.recompute_ms(decision.num_blocks * cost.block_size) / _MS_PER_S
        limit_s = self.config.ranked_wait_factor * recompute_s
        if decision.next_reference_s <= limit_s:
            return None
        return replace(
            decision,
            action=CacheAction.RELEASE,  # with the PRESERVE's TTL: when the manager decides it again
            reason=f"ranked pins: next call in {decision.next_reference_s:.1f}s, beyond the {limit_s:.1f}s "
            "a waiting call waits for it; released, held loose",
        )

    def _keep_headroom(self, trigger_id: str, now: float, out: list[Decided]) -> None:
        """After a PRESERVE: pins must leave the next call room, else the lowest scores go
        (the new pin included: it competes like any other)."""
        if self.gpu_used + self.headroom > self.config.gpu_total_blocks:
            self._evict(trigger_id, now, out, reserve=self.headroom)

    def _record(self, decided: Decided, s: _Session, out: list[Decided]) -> None:
        released = self._too_far_for_a_rank(decided.decision)
        if released is not None:
            # The engine unpins it (the pin would make later programs' calls wait); the manager
            # holds it loose: its blocks stay counted until the engine's LRU takes them, its
            # pressure may still move them to the host, and its TTL end decides it again.
            decided = replace(decided, decision=released)
        d = decided.decision
        sid = d.session_id
        # A RELEASE with a TTL is a loose hold: made just now, or the log's one adopted after a
        # restart (the TTL is in the event, so a replay holds it as the live run did).
        loose = d.action is CacheAction.RELEASE and d.ttl_s is not None
        if d.action is CacheAction.SWAP:
            s.host_reserved = d.num_blocks
        elif d.action is CacheAction.PREFETCH:
            s.host_reserved = 0
        s.prefetched = d.num_blocks if d.action is CacheAction.PREFETCH else 0
        self._set_hold(sid, s, Hold.LOOSE if loose else _HOLD_OF[d.action])
        if d.action is CacheAction.SWAP and d.ttl_s is not None:
            s.swap_id = decided.event_id
            heapq.heappush(self._relooks, (decided.at + d.ttl_s, sid, s.version))
            self._compact()
        if d.action in (CacheAction.PRESERVE, CacheAction.PREFETCH) or loose:
            assert d.ttl_s is not None  # the policy gives every PRESERVE and PREFETCH a TTL
            s.pin_id = decided.event_id
            heapq.heappush(self._candidates, (d.score, sid, s.version))
            heapq.heappush(self._expiries, (decided.at + d.ttl_s, sid, s.version))
            self._compact()
        out.append(decided)

    def _evict(self, trigger_id: str, now: float, out: list[Decided], *, reserve: int) -> None:
        """Evict pinned sessions, lowest score first, until ``reserve`` blocks are free, each by
        the policy's one eviction rule (``CachePolicy.evict``): SWAP, displacing host residents
        worth less when the host is full (their DISCARDs first), or RELEASE. On an engine with
        ranked pins only the SWAPs: a pin the rule would release stays, for the engine's valve,
        and the search ends after ``RANKED_SCAN`` such pins."""
        if self.config.ranked_pins and self.config.host_total_blocks == 0:
            return  # nothing can be swapped: every pin stays for the valve (and none is scanned)
        delays = self.delays()
        kept: list[tuple[float, SessionId, int]] = []  # candidates left to the engine's valve (ranked pins)
        residents: RankedResidents | None = None

        def host_residents() -> RankedResidents:
            nonlocal residents  # as of the first time the host lacks room in this run, searched on demand
            if residents is None:
                residents = self._host_residents(now, delays)  # the index is frozen until thawed below
            return residents

        try:
            while self.gpu_used + reserve > self.config.gpu_total_blocks and self._candidates:
                entry = heapq.heappop(self._candidates)
                _, sid, version = entry
                s = self._sessions.get(sid)
                if s is None or s.version != version or s.hold not in _HELD:
                    continue  # stale: the session's hold changed since it was pushed
                view = self.view(sid)
                host_free = max(0, self.config.host_total_blocks - self.host_used)
                # The eviction rule (``CachePolicy.evict``) in its two steps: a pin it would release
                # is kept on ranked pins, and then nothing more of it is worked out.
                room = self.policy.swap_room(view, now, host_free, delays, host_residents)
                if self.config.ranked_pins and room is None:
                    # Given up by score, it could be the context of the program served next; the
                    # engine's valve gives contexts up when a call needs the room, in the programs' order.
                    kept.append(entry)
                    if len(kept) >= RANKED_SCAN:
                        break
                    continue
                score = self.policy.score(view, now, host_free, delays)
                made = self.policy.evictions(view, score, now, delays, room)
                for decision in made:
                    target = s if decision.session_id == sid else self._sessions[decision.session_id]
                    self._record(
                        Decided(decision_event_id(trigger_id, "pressure", decision.session_id), trigger_id,
                                "pressure", now, decision), target, out,
                    )  # fmt: skip
        finally:
            for entry in kept:
                heapq.heappush(self._candidates, entry)
            if residents is not None:
                self._residents.thaw()

    def _host_residents(self, now: float, delays: Delays) -> RankedResidents:
        """The swapped sessions as host residents in ascending (host score, session id) order,
        searched only as far as the eviction rule reads (``services.cache.residents``)."""
        return self._residents.ascending(now, delays)

    def _index(self, sid: SessionId, s: _Session) -> None:
        """Keep the index of host residents in step: a swapped session, charged host blocks, whose
        view is neither in a call nor finished, is one (no GPU blocks; its host blocks: what the
        host is charged for it, as ``_relook`` sees it)."""
        if s.hold is Hold.SWAPPED and s.host_charged > 0:
            v = self.builder.view(sid)
            if v.phase is not Phase.LLM and v.phase is not Phase.FINISHED:
                self._residents.put(v, s.host_charged)
                return
        self._residents.discard(sid)

    def _expire(self, until: float, out: list[Decided]) -> None:
        """Decide again for every pinned session whose TTL ends at or before ``until``, and for
        every swapped one whose re-look time has come (in time order; TTLs first on a tie)."""
        while True:
            ttl_end = self._expiries[0][0] if self._expiries else math.inf
            relook = self._relooks[0][0] if self._relooks else math.inf
            if min(ttl_end, relook) > until:
                return
            if relook < ttl_end:
                self._relook(until, out)
                continue
            _, sid, version = heapq.heappop(self._expiries)
            s = self._sessions.get(sid)
            if s is None or s.version != version or s.hold not in _HELD:
                continue
            self._set_hold(sid, s, Hold.NONE)  # the engine's pin ended (or the loose hold's look came)
            # Decided as of ``until``, not ``end``: the new TTL ends after ``until``, so a jump of
            # the log's time (a backlog, a restart) re-decides a session once, not once per TTL.
            decision = self._decide_one(self.view(sid), until)
            if decision is not None:
                trigger = s.pin_id
                self._record(Decided(decision_event_id(trigger, "ttl", sid), trigger, "ttl", until, decision), s, out)
                self._keep_headroom(trigger, until, out)

    def _relook(self, until: float, out: list[Decided]) -> None:
        """The earliest re-look of a SWAP: PREFETCH the session, or ask for the next look."""
        _, sid, version = heapq.heappop(self._relooks)
        s = self._sessions.get(sid)
        if s is None or s.version != version or s.hold is not Hold.SWAPPED or s.host_charged <= 0:
            return
        v = self.view(sid)
        # As a host resident, whatever kv.events have reported of the move so far.
        resident = SessionView(sid, v.phase, v.since, v.tool, v.tool_started_at, v.context_tokens, 0,
                               s.host_charged, v.turns, v.attained_service_s)  # fmt: skip
        memory = self.memory(needed_blocks=self.headroom)
        delays = self.delays()
        decision = self.policy.decide_session(resident, until, memory, delays)
        if decision is not None:
            trigger = s.swap_id
            self._record(Decided(decision_event_id(trigger, "relook", sid), trigger, "relook", until, decision), s, out)
            return
        distance = self.policy.next_reference_s(resident, until, delays)
        again = self.policy.relook_s(resident.host_blocks, distance)
        if again is not None and distance > self.policy.lead_s(resident.host_blocks):
            heapq.heappush(self._relooks, (until + again, sid, version))

    # ------------------------------------------------------------------ memory

    def _set_hold(self, sid: SessionId, s: _Session, hold: Hold) -> None:
        if (s.hold in _HELD) != (hold in _HELD):
            self._num_held += 1 if hold in _HELD else -1
        s.hold = hold
        s.version += 1
        self._recharge(sid, s)

    def _recharge(self, sid: SessionId, s: _Session) -> None:
        """Recount what the session holds after its hold or its blocks changed."""
        hold = s.hold
        if hold is Hold.ACTIVE:
            charged = max(s.need, self.view(sid).gpu_blocks)
        elif hold in _HELD:
            charged = max(s.prefetched, self.view(sid).gpu_blocks)
        else:
            charged = 0
        self.gpu_used += charged - s.charged
        s.charged = charged
        # The host holds what kv.events says (whatever we decided since), and at least what a
        # SWAP of ours reserved until its blocks show up there.
        host_blocks = self.builder.view(sid).host_blocks if s.kv_seen else 0
        host_charged = max(s.host_reserved if hold is Hold.SWAPPED else 0, host_blocks)
        self.host_used += host_charged - s.host_charged
        s.host_charged = host_charged
        self._index(sid, s)

    def _compact(self) -> None:
        """Drop stale heap entries once they outnumber live ones (amortized O(1) per push)."""
        limit = 2 * self._num_held + 64
        for heap in (self._candidates, self._expiries):
            if len(heap) > limit:
                live = [e for e in heap if self._is_live(e)]
                heapq.heapify(live)
                heap[:] = live
        if len(self._relooks) > 2 * len(self._sessions) + 64:
            looks = [e for e in self._relooks if self._is_live(e, Hold.SWAPPED)]
            heapq.heapify(looks)
            self._relooks[:] = looks

    def _is_live(self, entry: tuple[float, SessionId, int], hold: Hold | None = None) -> bool:
        """The heap entry is the session's current one and its hold is ``hold`` (None: held)."""
        s = self._sessions.get(entry[1])
        return s is not None and s.version == entry[2] and (s.hold in _HELD if hold is None else s.hold is hold)
