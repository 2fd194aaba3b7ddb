"""``ours`` in the cache-policy benchmark: the shipped cache manager, fed the log it would read.

``Ours`` drives ``services.cache.manager.CacheManager``, the object the cache manager
worker (``workers/cache_manager.py``) runs, with its default ``CachePolicy`` (the bench's
cost model), the engine's block counts as its configuration, and nothing else: no queue
length, no engine state, no future knowledge. At each hook of the engine model
(``services.engine.serial``) it folds the events the log would carry at that moment, in the
order the stack appends them, each at the simulated time:

- a session's call is ready (its tool ended): ``ToolCallCompleted`` (the executor's: result
  tokens, duration), then ``LLMCallStarted`` (the planner's: prompt tokens, output tokens);
- a call ended: ``LLMCallCompleted`` (queue time, prompt tokens not prefilled), then
  ``ToolCallProposed`` and ``ToolCallStarted`` (a verdict that takes no time), or
  ``SessionFinished``;
- then, and at every other hook (a TTL's end, an idle engine, a call that needs room), the
  engine's KV events since the previous hook, translated by the engine bridge's own decoder
  (``workers.engine_bridge.sim.decode_event`` of the sim server's JSON), and after a call
  its ``KVCacheHit``, which the sim server publishes after the call's block events.

Every decision the manager returns is turned into its log event (``Decided.to_event``:
``ttl_ms`` rounded as the log has it) and carried out at once by ``Sim.carry_out``, the sim
server's ``/kv_control`` mapping (``CacheControl.apply``), its transfer charged to the engine.
A call that does not fit gets the sim server's **pressure valve**
(``CacheControl.relieve``: the pin the manager scored lowest goes to the host tier when it
fits there, else it is released; the engine pays the transfer), one pin per ``make_room``.
The manager re-decides at TTL ends and SWAP re-looks when the log's time passes them, i.e.
at the first event after them, as the worker does.
"""

from __future__ import annotations

from schemas.events import (
    EffectClass,
    KVCacheHit,
    KVTier,
    LLMCallCompleted,
    LLMCallStarted,
    Model,
    SessionFinished,
    SessionId,
    ToolCallCompleted,
    ToolCallProposed,
    ToolCallStarted,
)
from services.cache import CachePolicy
from services.cache.manager import CacheManager, ManagerConfig
from services.engine.batching import BatchSim
from services.engine.serial import Sess, SimManager
from services.scheduling import PROGRAM_ORDER, ProgressBook, SchedulingConfig
from workers.engine_bridge.sim import decode_event
from workers.engines.sim_server import kv_event_json

__all__ = ["ENGINE_ID", "Ours", "OursPlas", "VllmPlas"]

ENGINE_ID = "sim-0"
_MS = 1000.0


class Ours(SimManager):
    """The shipped ``CacheManager`` on the engine model (see the module docstring)."""

    name = "ours"

    def __init__(self) -> None:
        self._manager: CacheManager | None = None
        self.num_events = 0  # events folded
        self.num_decisions = 0  # decisions carried out (refused ones included: ``Metrics.refused``)

    def logged(self, sid: SessionId, body: Model, now: float) -> None:
        """An event the log now holds (folded or decided): what a reader of the log sees."""

    @property
    def manager(self) -> CacheManager:
        if self._manager is None:
            cache = self.sim.cache
            config = ManagerConfig(
                gpu_total_blocks=cache.num_gpu_blocks,
                host_total_blocks=cache.num_host_blocks,
                block_size=cache.block_size,
                engine_id=ENGINE_ID,
                ranked_pins=self.ranked_pins,
            )
            self._manager = CacheManager(config, CachePolicy(cost=self.sim.cost))
        return self._manager

    # ------------------------------------------------------------------ the log

    def _fold(self, sid: SessionId, body: Model, now: float) -> None:
        self.num_events += 1
        self.logged(sid, body, now)
        for decided in self.manager.apply(f"e{self.num_events}", sid, body, now):
            self.num_decisions += 1
            decision = decided.to_event(ENGINE_ID)
            self.logged(decided.session_id, decision, now)
            self.sim.carry_out(decision, decided.session_id, now)

    def _kv_events(self, now: float) -> None:
        """The engine's KV events since the last look, as the engine bridge appends them."""
        block_size = self.sim.cache.block_size
        for event in self.sim.cache.drain_events():
            kv = decode_event(ENGINE_ID, {**kv_event_json(event), "block_size": block_size})
            self._fold(kv.session_id, kv.body, now)

    def _call_completed(self, s: Sess, now: float) -> None:
        turn = s.trace.turns[s.turn - 1]
        prompt = len(s.tokens) - turn.output_tokens
        body = LLMCallCompleted(
            call_id=f"c{s.turn - 1}",
            engine_id=ENGINE_ID,
            prompt_tokens=prompt,
            cached_tokens=prompt - s.call_computed_tokens,
            output_tokens=turn.output_tokens,
            output_text="",
            finish_reason="length",
            queue_ms=(s.started_at - s.ready_at) * _MS,
            prefill_ms=0.0,  # the call's engine time, not split (the manager reads only the sum)
            decode_ms=(now - s.started_at) * _MS,
        )
        self._fold(s.sid, body, now)

    def _call_reported(self, s: Sess, now: float) -> None:
        """The engine's events of the call just ended, its hit last (as the sim server publishes)."""
        self._kv_events(now)
        prompt = len(s.tokens) - s.trace.turns[s.turn - 1].output_tokens
        hit = KVCacheHit(
            engine_id=ENGINE_ID,
            call_id=f"c{s.turn - 1}",
            cached_tokens=prompt - s.call_computed_tokens,
            prompt_tokens=prompt,
            tier=KVTier.GPU,
        )
        self._fold(s.sid, hit, now)

    # ------------------------------------------------------------------ engine hooks

    def on_ready(self, s: Sess, now: float) -> None:
        if s.turn > 0:
            prev = s.trace.turns[s.turn - 1]
            assert prev.tool_duration_s is not None
            done = ToolCallCompleted(
                call_id=f"t{s.turn - 1}",
                result_json="{}",
                result_tokens=prev.tool_result_tokens or 0,
                duration_ms=prev.tool_duration_s * _MS,
            )
            self._fold(s.sid, done, now)
        started = LLMCallStarted(
            call_id=f"c{s.turn}",
            turn=s.turn,
            engine_id=ENGINE_ID,
            prompt_tokens=len(s.tokens),
            max_output_tokens=s.trace.turns[s.turn].output_tokens,
            prompt_digest="",
        )
        self._fold(s.sid, started, now)
        self._kv_events(now)

    def on_gap(self, s: Sess, now: float) -> None:
        self._call_completed(s, now)
        assert s.tool is not None
        call_id = f"t{s.turn - 1}"
        key = f"{s.sid}/{call_id}"
        proposed = ToolCallProposed(
            call_id=call_id, tool=s.tool, arguments_json="{}", effect_class=EffectClass.PURE, idempotency_key=key
        )
        self._fold(s.sid, proposed, now)
        self._fold(s.sid, ToolCallStarted(call_id=call_id, tool=s.tool, idempotency_key=key, attempt=1), now)
        self._call_reported(s, now)

    def on_finish(self, s: Sess, now: float) -> None:
        self._call_completed(s, now)
        finished = SessionFinished(output_json="{}", num_llm_calls=s.turn, num_tool_calls=s.turn - 1)
        self._fold(s.sid, finished, now)
        self._call_reported(s, now)

    def on_leave(self, s: Sess, now: float, target: str) -> None:
        """What ``EngineCacheManagers`` does when a session's call starts on another engine: the manager
        of the engine it left folds the move as the session's end there (and DISCARDs it)."""
        moved = SessionFinished(output_json=f'{{"moved_to": "{target}"}}', num_llm_calls=0, num_tool_calls=0)
        self._fold(s.sid, moved, now)
        self._kv_events(now)

    def on_expire(self, sids: list[SessionId], now: float) -> None:
        self._kv_events(now)

    def on_idle(self, now: float) -> None:
        self._kv_events(now)

    def make_room(self, needed: int, now: float, requester: Sess) -> bool:
        self._kv_events(now)
        control = self.sim.control
        # On ranked pins a waiting call takes no pin of a program ranked ahead; a running call's growth takes any.
        growing = isinstance(self.sim, BatchSim) and requester.sid in self.sim.running
        rank = None if growing or not control.ranked else control.ranks[requester.sid]
        relieved = control.relieve(requester.sid, rank=rank)
        if relieved is None:
            return False
        self.sim.moved_to_host(relieved.session_id, relieved.swapped_blocks, now)  # as the sim server: charged
        return True

    def waits(self, requester: Sess, now: float) -> bool:
        control = self.sim.control
        return control.ranked and control.held_ahead(requester.sid, control.ranks[requester.sid])


class OursPlas(Ours):
    """``ours`` plus program-level scheduling (``services.scheduling``) on an engine with ranked
    pins: every call is queued at the priority the planner would send, computed from the same
    log: its session's progress (the ``LLMCallCompleted`` records' engine and queueing time and
    the ``ToolCallCompleted`` durations; trace sessions have no parallel branches, so the critical
    path is the session) and whether the cache manager's last decision for it still preserves its
    KV (``CacheDecisionMade``). The engine model serves by priority, and its pins rank by it
    (``CacheControl(ranked=True)``, as a vLLM server with ``--ranked-pins``): a call that does not
    fit takes no pin of a program ranked ahead of it, the valve moves or releases the pin of the
    program ranked last first, and the manager leaves memory pressure to that valve
    (``ManagerConfig.ranked_pins``). The priorities are ``PROGRAM_ORDER``'s, as a ranked-pins
    server asks the planner for (ranks that stay put: with the attained-service term two programs
    take each other's context in turn)."""

    name = "ours+plas"
    ranked_pins = True

    def __init__(self, config: SchedulingConfig | None = None) -> None:
        super().__init__()
        self.book = ProgressBook(config or PROGRAM_ORDER)

    def logged(self, sid: SessionId, body: Model, now: float) -> None:
        self.book.logged(sid, body, now)

    def priority(self, s: Sess, now: float) -> float | None:
        value = self.book.priority(s.sid, now)
        if value is not None:
            self.sim.control.rank(s.sid, value)
        return value

    def on_finish(self, s: Sess, now: float) -> None:
        super().on_finish(s, now)
        self.sim.control.forget(s.sid)


class VllmPlas(OursPlas):
    """Stock vLLM's cache with program-level scheduling: ``ours+plas`` without the cache manager.
    It follows the same log (the same priorities; no warm credit, since nothing preserves a
    session's KV) but decides nothing, so its blocks go to the LRU after each call as ``vllm``'s
    do. Beside ``vllm`` and ``ours+plas`` it tells the scheduling's share of a gain from the
    manager's."""

    name = "vllm+plas"
    ranked_pins = False  # stock vLLM's scheduler: priorities, no ranked pins

    def __init__(self, config: SchedulingConfig | None = None) -> None:
        super().__init__(config or SchedulingConfig())

    def _fold(self, sid: SessionId, body: Model, now: float) -> None:
        self.num_events += 1
        self.logged(sid, body, now)


class VllmPlasHold(VllmPlas):
    """``vllm+plas`` on an engine with ranked pins (``workers.engines.vllm.scheduler``): every call
    holds its session's blocks until the session's next call, and a call takes no blocks held by a
    program that outranks it (it waits instead, the engine idle if nothing else runs); a finished
    session's hold is released. A session's rank is the priority of its newest call, as the
    engine's is the priority of its newest request, computed without the attained-service term
    (``PROGRAM_ORDER``: with it, two programs holding contexts pass each other in turn and take
    each other's context at every call)."""

    name = "vllm+plas+hold"
    ranked_pins = True  # the engine model's valve and waiting are the ranked ones (``Ours.make_room``, ``waits``)

    def __init__(self) -> None:
        super().__init__(PROGRAM_ORDER)  # ranks that stay put, as a ranked-pins server asks the planner

    def on_gap(self, s: Sess, now: float) -> None:
        super().on_gap(s, now)
        self.sim.cache.pin(s.sid)

    def on_finish(self, s: Sess, now: float) -> None:
        super().on_finish(s, now)
        self.sim.cache.release(s.sid)
