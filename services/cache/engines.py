"""One cache manager for several engines: the memory model keyed by engine (pure).

Each engine has its own GPU and host memory, so each gets its own ``CacheManager`` (its
capacity, pins, TTLs, candidates); they share one ``CachePolicy``, hence one tool-latency
model (what a tool's gaps teach holds on any engine). ``EngineCacheManagers.apply`` sends
each event to the engine it is about:

- ``kv.events`` and ``LLMCallStarted`` / ``LLMCallCompleted``: the engine they name;
- everything else of a session (its tool proposals, effects, end): the engine its latest
  LLM call named (the one that holds its context), the first engine before any; the map of
  sessions to engines is kept for every session seen (one entry each), so that a late effect
  of a forgotten session still reaches the manager that recognises it;
- an engine id no manager has: the first engine (a single-engine stack names its engine
  whatever its id, as before).

A session whose call starts, or completes (a failover appends no second start), on another
engine than its previous one **leaves** the previous engine: that engine's manager folds the move as the
session's end there (its blocks on the old engine are a stale copy of a context that now
grows elsewhere), so it DISCARDs them (reason ``moved to <engine>: ...``) and forgets the
session once they are gone. Every other manager sees the log's time pass (``advance``) before
an event is folded, so TTL ends fire on every engine in time, not only on the busy one.

Every decision carries its engine (``Decided.engine_id``): the bridge of that engine carries
it out. Deterministic like ``CacheManager``: the same events in the same order give the same
decisions and ids (a move's DISCARD: ``decision_event_id(call started, "end", session)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from schemas.events import (
    KVAllBlocksCleared,
    KVBlocksRemoved,
    KVBlocksStored,
    KVCacheHit,
    KVSwapCompleted,
    LLMCallCompleted,
    LLMCallStarted,
    Model,
    SessionFinished,
    SessionId,
)
from services.cache.manager import CacheManager, Decided, ManagerConfig
from services.cache.policy import CachePolicy

__all__ = ["EngineCacheManagers"]

_KV = (KVBlocksStored, KVBlocksRemoved, KVAllBlocksCleared, KVCacheHit, KVSwapCompleted)
_CALLS = (LLMCallStarted, LLMCallCompleted)


class EngineCacheManagers:
    """``CacheManager`` per engine behind ``CacheManager``'s ``apply`` / ``adopt``."""

    def __init__(self, configs: Sequence[ManagerConfig], policy: CachePolicy | None = None) -> None:
        if not configs:
            raise ValueError("need at least one engine")
        ids = [c.engine_id for c in configs]
        if len(set(ids)) != len(ids):
            raise ValueError(f"engine ids must be unique, got {', '.join(ids)}")
        self.policy = policy if policy is not None else CachePolicy()
        self.managers: dict[str, CacheManager] = {c.engine_id: CacheManager(c, self.policy) for c in configs}
        self.default = ids[0]
        self._where: dict[SessionId, str] = {}  # session -> the engine of its latest LLMCallStarted
        self.num_moves = 0

    @property
    def num_sessions(self) -> int:
        return sum(m.num_sessions for m in self.managers.values())

    @property
    def num_forgotten(self) -> int:
        return sum(m.num_forgotten for m in self.managers.values())

    def __getattr__(self, name: str) -> object:
        # Readers written for one engine (hold, view, gpu_used, ...) read the first engine's manager.
        if name.startswith("__") or name in ("managers", "default"):
            raise AttributeError(name)
        return getattr(self.managers[self.default], name)

    def manager(self, engine_id: str) -> CacheManager:
        return self.managers[self._known(engine_id)]

    def engine_of(self, session_id: SessionId) -> str:
        """The engine that holds the session's context (its latest call's)."""
        return self._where.get(session_id, self.default)

    def _known(self, engine_id: str) -> str:
        return engine_id if engine_id in self.managers else self.default

    def apply(self, event_id: str, session_id: SessionId, body: Model, at: float) -> list[Decided]:
        if len(self.managers) == 1:  # one engine: everything is its (whatever id events name), as before
            return self.managers[self.default].apply(event_id, session_id, body, at)
        out: list[Decided] = []
        if isinstance(body, _CALLS):
            # A completion on another engine than its start: the call failed over (no new start).
            target = self._known(body.engine_id)
            previous = self._where.get(session_id)
            self._where[session_id] = target
            if previous is not None and previous != target:
                out.extend(self._leave(previous, target, event_id, session_id, at))
        elif isinstance(body, _KV):
            target = self._known(body.engine_id)
        else:
            target = self._where.get(session_id, self.default)
        if len(self.managers) > 1:
            for engine_id, manager in self.managers.items():
                if engine_id != target:
                    out.extend(_tag(d, engine_id) for d in manager.advance(at))
        out.extend(_tag(d, target) for d in self.managers[target].apply(event_id, session_id, body, at))
        return out

    def _leave(self, engine_id: str, target: str, event_id: str, session_id: SessionId, at: float) -> list[Decided]:
        """The session's calls go to ``target`` now: its blocks on ``engine_id`` are discarded there."""
        self.num_moves += 1
        moved = SessionFinished(output_json=f'{{"moved_to": "{target}"}}', num_llm_calls=0, num_tool_calls=0)
        out = []
        for d in self.managers[engine_id].apply(event_id, session_id, moved, at):
            if d.session_id == session_id and d.kind == "end":
                d = replace(d, decision=replace(d.decision, reason=f"moved to {target}: {d.decision.reason}"))
            out.append(_tag(d, engine_id))
        return out

    def adopt(self, decided: Decided) -> None:
        self.managers[self._known(decided.engine_id or self.default)].adopt(decided)


def _tag(d: Decided, engine_id: str) -> Decided:
    return d if d.engine_id == engine_id else replace(d, engine_id=engine_id)
