"""Which KV blocks the scheduler holds for sessions between their calls, and which to let go first.

A *pin* holds one reference on each full (hashed) block of a session's context after its
call ended, so vLLM's LRU cannot evict them and the session's next call hits its whole
prefix. A pin ends at its TTL, on an explicit release or discard, when the session's next
call ends (that call's own hold, if any, replaces it), or under memory pressure.

**Release order under pressure** (``victims``): ascending ``(score, expires_at, session)``.
``score`` is the cache manager's survival score from its PRESERVE decision (expected
benefit per byte-second: lowest is worth least), so pins go in the order the manager ranked
them; ties go to the pin that would expire first, then by session id (deterministic).
A grace hold that no decision has scored yet has score 0 and goes first. On an engine with
ranked pins a pin also carries its session's rank (its newest request's priority), a request
of priority ``p`` may take only the unranked pins and those ranked ``p`` or later, and pins go
in the programs' order (``by_rank``: the program ranked last first; the score breaks ties).

Pure: no vLLM, no clock (``now`` is a parameter); generic over the block type so unit tests
use plain objects.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["Pin", "PinTable"]

B = TypeVar("B")


@dataclass(slots=True)
class Pin(Generic[B]):
    session_id: str
    blocks: list[B]
    """Full blocks in prefix order; the pin holds one reference on each."""
    expires_at: float
    score: float = 0.0
    rank: int | None = None
    """The priority of the session's last request (lower is served first), on an engine that
    ranks pins (``victims``' ``below``); None: releasable to any request."""

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


@dataclass
class PinTable(Generic[B]):
    pins: dict[str, Pin[B]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.pins)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self.pins

    def __iter__(self) -> Iterator[Pin[B]]:
        return iter(list(self.pins.values()))

    def get(self, session_id: str) -> Pin[B] | None:
        return self.pins.get(session_id)

    def put(self, pin: Pin[B]) -> Pin[B] | None:
        """Add ``pin``; returns the pin it replaces (whose references the caller must drop)."""
        old = self.pins.pop(pin.session_id, None)
        self.pins[pin.session_id] = pin
        return old

    def pop(self, session_id: str) -> Pin[B] | None:
        return self.pins.pop(session_id, None)

    def renew(self, session_id: str, *, expires_at: float, score: float) -> Pin[B] | None:
        """A new TTL and score for an existing pin (a later PRESERVE decision)."""
        pin = self.pins.get(session_id)
        if pin is not None:
            pin.expires_at = expires_at
            pin.score = score
        return pin

    def pop_expired(self, now: float) -> list[Pin[B]]:
        expired = [p for p in self.pins.values() if p.expires_at <= now]
        for pin in expired:
            del self.pins[pin.session_id]
        return expired

    def victims(self, *, exclude: Iterable[str] = (), below: int | None = None, by_rank: bool = False) -> list[Pin[B]]:
        """Pins in the order to release them under pressure (see module docstring); with ``below``,
        only the pins a request of that priority may take: unranked, or not ranked before it (a pin
        of the same rank is taken, as with no ranks: all-default priorities change nothing). With
        ``by_rank``, the programs' order first: unranked pins, then the one ranked last."""
        skip = set(exclude)
        pins = [
            p
            for p in self.pins.values()
            if p.session_id not in skip and (below is None or p.rank is None or p.rank >= below)
        ]
        if by_rank:
            return sorted(pins, key=lambda p: (p.rank is not None, -(p.rank or 0), p.score, p.expires_at, p.session_id))
        return sorted(pins, key=lambda p: (p.score, p.expires_at, p.session_id))

    @property
    def num_blocks(self) -> int:
        return sum(p.num_blocks for p in self.pins.values())
