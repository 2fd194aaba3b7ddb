"""Which engine still holds how much of a session's prefix, folded from ``kv.events`` (pure).

The router sends a session's call to the engine holding its prefix (``services.routing``). The
log says where its last call ran; the engines' ``kv.events`` say what each engine did with the
blocks since: evicted them under pressure (LRU), swapped them to the host, kept them, or still
holds an older prefix of a session that moved. ``KVHoldings.apply(session_id, body)`` folds one
``kv.events`` body; ``held_tokens(engine, session)`` answers how many tokens of the session's
context that engine can serve from its cache.

**What is kept, per engine.**

- ``present``: the block hashes the engine holds, on any tier (a block on the host tier is
  swapped back in, not recomputed, so it counts as held). ``KVBlocksStored`` adds its tier,
  ``KVBlocksRemoved`` takes it away, ``KVAllBlocksCleared`` empties the engine. Blocks are
  per engine, not per session: whichever session an event names (the sim engine names the
  session that last held an evicted block, which may be a fork sharing it), a removed hash
  is gone for every session whose context contains it.
- a **chain** per session: its context's block hashes in prefix order, as far as its own
  ``KVBlocksStored`` tell. A store whose ``parent_block_hash`` is in the session's chain
  continues it there (a store repeating blocks the chain already has, e.g. a swap's host
  copy, leaves it as it is; a different continuation replaces what followed: the context
  was rewound); a store whose parent is not in it starts a new chain on that parent (its
  *base*): the session's first call reused a prefix that another session stored (a fork's
  parent, a shared system prompt: the sim engine reports a reused block once, for the
  session that stored it). The base is resolved when asked, through the session that
  stored it (``stored_by``), so the order in which partitions are read does not matter.
- the call id of the session's latest ``KVCacheHit`` on the engine: every call reports one
  after its other events, so once it names a call, the engine's events of that call are in.

**Held tokens** are the longest run of the resolved chain, from its first block, that the
engine still holds, times the block size: prefix caching serves a prefix, so a block past
the first missing one is of no use. A base that cannot be resolved (its storer's chain was
rewritten or forgotten) counts as not held: an underestimate sends a call to recompute,
never to a cache that is not there.

**Memory** follows the engines' caches: a hash is kept while an engine holds it, and when an
engine has twice as many chains as after its last sweep, the chains holding none of their own
blocks any more are forgotten (amortised O(1) per event). What stays per session ever
reported is one small entry per engine, its latest reported call id, so that a session whose
blocks are all gone (swept, or the engine cleared) is known to hold nothing there rather than
taken for one the events never named.

No I/O, no clock: the same events in the same order give the same answers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.events import KVAllBlocksCleared, KVBlocksRemoved, KVBlocksStored, KVCacheHit, KVTier, Model

__all__ = ["KVHoldings"]

_MAX_DEPTH = 64  # bases resolved through at most this many sessions (a cycle of bases is a bad log)
_MIN_SWEEP = 64  # chains an engine keeps before its first sweep


@dataclass(slots=True)
class _Chain:
    base: str | None
    """The block before ``blocks``, stored by another session; None: ``blocks`` start the context."""
    blocks: list[str]
    pos: dict[str, int]

    @classmethod
    def of(cls, base: str | None, blocks: list[str]) -> _Chain:
        return cls(base, blocks, {h: i for i, h in enumerate(blocks)})

    def continue_at(self, index: int, run: list[str]) -> None:
        """``run`` follows ``blocks[index]``: keep what matches, replace what differs."""
        start = index + 1
        if self.blocks[start : start + len(run)] == run:
            return
        for h in self.blocks[start:]:
            del self.pos[h]
        del self.blocks[start:]
        for h in run:
            self.pos[h] = len(self.blocks)
            self.blocks.append(h)


@dataclass(slots=True)
class _Engine:
    block_size: int = 0
    present: dict[str, set[KVTier]] = field(default_factory=dict)
    stored_by: dict[str, str] = field(default_factory=dict)  # hash -> the session whose store listed it last
    chains: dict[str, _Chain] = field(default_factory=dict)
    reported: dict[str, str] = field(default_factory=dict)  # session -> call id of its latest KVCacheHit
    swept_at: int = 0  # chains left by the last sweep


class KVHoldings:
    """What each engine holds of each session's prefix, by ``kv.events`` (module docstring)."""

    def __init__(self) -> None:
        self._engines: dict[str, _Engine] = {}

    def apply(self, session_id: str, body: Model) -> None:
        """Fold one ``kv.events`` body of ``session_id`` (any other body is ignored)."""
        if isinstance(body, KVBlocksStored):
            self._stored(self._engine(body.engine_id), session_id, body)
        elif isinstance(body, KVBlocksRemoved):
            engine = self._engine(body.engine_id)
            for h in body.block_hashes:
                tiers = engine.present.get(h)
                if tiers is not None:
                    tiers.discard(body.tier)
                    if not tiers:
                        del engine.present[h]
                        engine.stored_by.pop(h, None)
        elif isinstance(body, KVAllBlocksCleared):
            engine = self._engine(body.engine_id)
            engine.present.clear()
            engine.stored_by.clear()
            engine.chains.clear()  # the calls it reported stay: they now hold nothing there
            engine.swept_at = 0
        elif isinstance(body, KVCacheHit):
            self._engine(body.engine_id).reported[session_id] = body.call_id

    def _engine(self, engine_id: str) -> _Engine:
        engine = self._engines.get(engine_id)
        if engine is None:
            engine = self._engines[engine_id] = _Engine()
        return engine

    def _stored(self, engine: _Engine, session_id: str, body: KVBlocksStored) -> None:
        engine.block_size = body.block_size
        run = list(body.block_hashes)
        for h in run:
            engine.present.setdefault(h, set()).add(body.tier)
            engine.stored_by[h] = session_id
        if not run:
            return
        chain = engine.chains.get(session_id)
        parent = body.parent_block_hash
        if chain is not None and parent is not None and parent in chain.pos:
            chain.continue_at(chain.pos[parent], run)
        elif chain is not None and parent == chain.base:
            chain.continue_at(-1, run)
        else:
            engine.chains[session_id] = _Chain.of(parent, run)
            if len(engine.chains) >= max(2 * engine.swept_at, _MIN_SWEEP):
                self._sweep(engine)

    @staticmethod
    def _sweep(engine: _Engine) -> None:
        """Forget the chains none of whose own blocks the engine holds any more."""
        present = engine.present
        for sid in [s for s, c in engine.chains.items() if not any(h in present for h in c.blocks)]:
            del engine.chains[sid]  # its reported call stays: the session is known to hold nothing here
        engine.swept_at = len(engine.chains)

    # ------------------------------------------------------------------ reading

    def knows(self, engine_id: str, session_id: str) -> bool:
        """Whether the engine's events have named the session (a context stored, or a call reported)."""
        engine = self._engines.get(engine_id)
        return engine is not None and (session_id in engine.chains or session_id in engine.reported)

    def reported(self, engine_id: str, session_id: str) -> str | None:
        """The call id of the session's latest ``KVCacheHit`` on the engine (None: none seen)."""
        engine = self._engines.get(engine_id)
        return None if engine is None else engine.reported.get(session_id)

    def held_blocks(self, engine_id: str, session_id: str) -> tuple[int, int]:
        """(blocks of the session's context the engine holds from its start, blocks of its context known)."""
        engine = self._engines.get(engine_id)
        if engine is None or session_id not in engine.chains:
            return 0, 0
        chain = self._resolve(engine, session_id)
        held = 0
        for h in chain:
            if h is None or h not in engine.present:
                break
            held += 1
        return held, len(chain)

    def held_tokens(self, engine_id: str, session_id: str) -> int:
        """Tokens of the session's context the engine can serve from its cache (0: none, or unknown)."""
        engine = self._engines.get(engine_id)
        return 0 if engine is None else self.held_blocks(engine_id, session_id)[0] * engine.block_size

    def engines(self) -> list[str]:
        """Every engine the events named, sorted."""
        return sorted(self._engines)

    def _resolve(self, engine: _Engine, session_id: str) -> list[str | None]:
        """The session's whole context on the engine, its base's prefix first; None where unresolved."""
        parts: list[list[str | None]] = []
        sid, upto, seen = session_id, None, set()
        for _ in range(_MAX_DEPTH):
            chain = engine.chains.get(sid)
            if chain is None or sid in seen or (upto is not None and upto not in chain.pos):
                parts.append([None])  # its start is not known: nothing before here counts as held
                break
            seen.add(sid)
            end = len(chain.blocks) if upto is None else chain.pos[upto] + 1
            parts.append(list(chain.blocks[:end]))
            if chain.base is None:
                break
            upto = chain.base
            owner = engine.stored_by.get(upto)
            if owner is None:
                parts.append([None])
                break
            sid = owner
        else:
            parts.append([None])
        out: list[str | None] = []
        for part in reversed(parts):
            out.extend(part)
        return out
