"""The rules every record must keep, checked against the records before it.

``ChainVerifier`` is pure: feed it decoded envelopes in log order and it says
whether each one may be trusted. A rejected record does not advance the
chain, so the next genuine record still links to the last accepted one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from log.codec import ZERO_HASH
from log.errors import ActorNotAllowed, BodyNotAllowed, BrokenChain, KeyMismatch, SeqGap, SeqRepeat
from log.topics import Topic
from log.types import Position
from schemas.envelope import Envelope


class ChainTail(NamedTuple):
    """The last accepted record of one (topic, session)."""

    seq: int
    hash: bytes


class ChainVerifier:
    """Tracks the tail of every (topic, session) chain and checks new records against it."""

    def __init__(self) -> None:
        # (seq, hash) of each chain's tail: a plain pair, as one is made per record (a named
        # tuple is built through a Python-level __new__, several times slower).
        self._tails: dict[tuple[str, str], tuple[int, bytes]] = {}

    def forget(self, topic: str, in_partition: Callable[[str], bool]) -> None:
        """Drop the tails of ``topic`` whose session satisfies ``in_partition`` (before a rebuild)."""
        for key in [k for k in self._tails if k[0] == topic and in_partition(k[1])]:
            del self._tails[key]

    def tail(self, topic: str, session_id: str) -> ChainTail | None:
        tail = self._tails.get((topic, session_id))
        return None if tail is None else ChainTail(*tail)

    def accept(self, topic: Topic, envelope: Envelope) -> None:
        """Make ``envelope`` the new tail of its chain, unchecked (a seed the caller vouches for)."""
        self._tails[(topic.name, envelope.session_id)] = (envelope.seq, envelope.hash)

    def verify(self, topic: Topic, key: bytes | None, envelope: Envelope, position: Position) -> None:
        """Raise an IntegrityError if ``envelope`` may not follow what was accepted so far; else
        make it the new tail of its chain. What a consumer does with every record, so in one frame."""
        session_id = envelope.session_id
        seq = envelope.seq
        actor = envelope.actor
        # The owner may always write its topic (no topic is owned by a read-only actor: Topic).
        if actor != topic.owner and not topic.allows_actor(actor):
            raise ActorNotAllowed(f"{position}: actor {actor!r} may not write {topic.name} (only {topic.owner!r} may)")
        if type(envelope.body) not in topic.body_types and not isinstance(envelope.body, topic.bodies):
            raise BodyNotAllowed(f"{position}: a {type(envelope.body).__name__} does not belong on {topic.name}")
        if key is not None and key != session_id.encode():
            raise KeyMismatch(f"{position}: key {key!r} is not the session id {session_id!r}")
        chain = (topic.name, session_id)
        tail = self._tails.get(chain)
        if tail is None:
            expected_seq, expected_prev = 0, ZERO_HASH
        else:
            expected_seq, expected_prev = tail[0] + 1, tail[1]
        if seq != expected_seq:
            if seq > expected_seq:
                raise SeqGap(f"{position}: session {session_id} jumps to seq {seq}, expected {expected_seq}")
            raise SeqRepeat(f"{position}: session {session_id} repeats seq {seq}, expected {expected_seq}")
        if envelope.prev_hash != expected_prev:
            raise BrokenChain(
                f"{position}: session {session_id} seq {seq} has prev_hash "
                f"{envelope.prev_hash.hex()[:12]}..., expected {expected_prev.hex()[:12]}...; run logctl verify"
            )
        self._tails[chain] = (seq, envelope.hash)
