"""Several engines behind one planner: their configuration, clients, health and load.

``AGENTLOG_ENGINES`` (or repeated ``--engine`` flags) lists them, one ``ID=URL[,key=value...]``
each, separated by ``;``::

    AGENTLOG_ENGINES="sim-0=http://127.0.0.1:8100;sim-1=http://127.0.0.1:8101,size=small"

Keys: ``size`` (``small`` or ``large``, default ``large``), ``model`` (what the engine serves,
default its id), ``kind`` (``sim``, ``vllm``, ``openai``; default ``--engine-kind``),
``prefill`` (prefill tokens per second, relative: how the router weighs a queue, default 1).
Without it the planner has the one engine of ``--engine-url`` and routes nothing (the
single-engine stack, unchanged).

The OpenAI-compatible gateway (``workers/gateway.py``) reads the same list and routes with the
same pool (``choose``); it forwards OpenAI bodies itself, so its pool has no clients (``url``).

``EnginePool`` holds one client per engine and what the router needs to know about each that the
log does not say: whether it answered lately (a call that could not reach it marks it down for
``down_s``; it is tried again after that) and the prompt tokens of this planner's calls in
flight on it (its queue, as far as this planner knows).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from services.routing import SIZES, CallRequest, EngineInfo, Route, Router
from workers.engines.base import Engine
from workers.engines.factory import ENGINE_KINDS, create_engine

__all__ = ["EnginePool", "EngineSpec", "parse_engines"]


@dataclass(frozen=True)
class EngineSpec:
    engine_id: str
    url: str
    size: str = "large"
    model: str = ""
    kind: str | None = None
    prefill_tokens_per_s: float = 1.0


def parse_engines(text: str | Sequence[str]) -> list[EngineSpec]:
    """``ID=URL[,size=..][,model=..][,kind=..][,prefill=..]`` entries, ``;``-separated (or a list of
    them: repeated ``--engine``). Raises ``ValueError`` with one line naming the bad entry."""
    entries = [e.strip() for e in (text.split(";") if isinstance(text, str) else text) if e.strip()]
    specs: list[EngineSpec] = []
    for entry in entries:
        head, *options = [p.strip() for p in entry.split(",")]
        engine_id, eq, url = head.partition("=")
        if not eq or not engine_id or not url.startswith(("http://", "https://")):
            raise ValueError(f"engine {entry!r}: expected ID=http://HOST:PORT[,size=small|large][,model=M]")
        values: dict[str, str] = {}
        for option in options:
            key, eq, value = option.partition("=")
            if not eq or key not in ("size", "model", "kind", "prefill"):
                raise ValueError(f"engine {engine_id}: unknown option {option!r} (size, model, kind, prefill)")
            values[key] = value
        size = values.get("size", "large")
        if size not in SIZES:
            raise ValueError(f"engine {engine_id}: size must be small or large, got {size!r}")
        kind = values.get("kind")
        if kind is not None and kind not in ENGINE_KINDS:
            raise ValueError(f"engine {engine_id}: kind must be one of {', '.join(ENGINE_KINDS)}, got {kind!r}")
        try:
            prefill = float(values.get("prefill", "1"))
        except ValueError:
            raise ValueError(f"engine {engine_id}: prefill must be a number, got {values['prefill']!r}") from None
        if prefill <= 0:
            raise ValueError(f"engine {engine_id}: prefill must be > 0, got {prefill}")
        specs.append(EngineSpec(engine_id, url.rstrip("/"), size, values.get("model", engine_id), kind, prefill))
    ids = [s.engine_id for s in specs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"engine ids must be unique, got {', '.join(ids)}")
    return specs


@dataclass
class EnginePool:
    """One client per engine, their health and this planner's load on each."""

    specs: list[EngineSpec]
    clients: dict[str, Engine]
    down_s: float = 10.0
    """How long an engine that could not be reached is left out (then it is tried again)."""
    down_until: dict[str, float] = field(default_factory=dict)
    queued: dict[str, int] = field(default_factory=dict)

    @classmethod
    def create(
        cls, specs: list[EngineSpec], *, kind: str | None = None, factory: Callable[..., Engine] = create_engine
    ) -> EnginePool:
        if not specs:
            raise ValueError("no engines configured")
        clients = {s.engine_id: factory(s.url, engine_id=s.engine_id, kind=s.kind or kind) for s in specs}
        return cls(specs, clients)

    def client(self, engine_id: str) -> Engine:
        return self.clients[engine_id]

    def knows(self, engine_id: str) -> bool:
        return any(s.engine_id == engine_id for s in self.specs)

    def url(self, engine_id: str) -> str:
        return next(s.url for s in self.specs if s.engine_id == engine_id)

    def healthy(self, engine_id: str, now: float) -> bool:
        return self.down_until.get(engine_id, 0.0) <= now

    def mark_down(self, engine_id: str, now: float) -> None:
        self.down_until[engine_id] = now + self.down_s

    def mark_up(self, engine_id: str) -> None:
        self.down_until.pop(engine_id, None)

    def sizes(self, now: float) -> tuple[str, ...]:
        """The model sizes a healthy engine serves (all configured ones when none is healthy)."""
        healthy = {s.size for s in self.specs if self.healthy(s.engine_id, now)}
        return tuple(size for size in SIZES if size in (healthy or {s.size for s in self.specs}))

    def infos(self, now: float, *, size: str | None = None, exclude: Sequence[str] = ()) -> list[Any]:
        """``services.routing.EngineInfo`` of every engine (of ``size``, when one serves it), but
        ``exclude``."""

        specs = [s for s in self.specs if s.engine_id not in exclude]
        if size is not None and any(s.size == size for s in specs):
            specs = [s for s in specs if s.size == size]
        return [
            EngineInfo(
                s.engine_id,
                s.model,
                size=s.size,
                healthy=self.healthy(s.engine_id, now),
                queued_tokens=self.queued.get(s.engine_id, 0),
                prefill_tokens_per_s=s.prefill_tokens_per_s,
            )
            for s in specs
        ]

    def choose(
        self, router: Router, call: CallRequest, now: float, *, failed: str | None = None
    ) -> tuple[Route, str | None]:
        """Route ``call`` over every engine, and the engine it leaves (``failed``, or else the engine
        holding more of its prefix than the chosen one when that one is marked down: moving off it
        is a failover).

        Every engine is passed, the ones marked down as unhealthy: the router keeps to the call's
        size, falls back to the other one, and sees a down engine that held the prefix. When every
        engine is marked down the marks are only guesses: all are tried as if up (but ``failed``,
        the one that just failed, while there is another)."""
        engines = self.infos(now)
        if not any(e.healthy for e in engines):
            engines = [replace(e, healthy=True) for e in engines if e.engine_id != failed] or [
                replace(e, healthy=True) for e in engines
            ]
        chosen = router.route(call, engines)
        if not failed:
            # Only an engine holding more of the prefix than the chosen one: a down engine that
            # kv.events say still holds an older, shorter prefix is no failover to move off.
            here = call.cached_on(chosen.engine_id)
            failed = next(
                (
                    e
                    for e in call.cached_tokens
                    if e != chosen.engine_id and call.cached_on(e) > here and not self.healthy(e, now)
                ),
                None,
            )
        return chosen, failed

    def begin(self, engine_id: str, tokens: int) -> None:
        self.queued[engine_id] = self.queued.get(engine_id, 0) + tokens

    def end(self, engine_id: str, tokens: int) -> None:
        self.queued[engine_id] = max(0, self.queued.get(engine_id, 0) - tokens)

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()
