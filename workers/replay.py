"""Folding sessions from the log, from the first event or from a snapshot, and taking checkpoints.

Shared by the planner (checkpoints, a fork's parent history), the role workers
(loading a session met late: ``load_session``), ``logctl state`` and
``bench/replay_snapshots.py``, so that all of them cut, fold and snapshot the
same way (rules in ``services/checkpoint.py`` and ``services/replay.py``,
storage in ``log/snapshots.py``).

- ``take_checkpoint``: end offsets of the session's partition, then its
  history; the cut is past both; the fold of that history (plus, for a fork,
  its parent's history up to the fork's cut) is the state at the checkpoint;
  its snapshot is saved before ``CheckpointTaken`` is appended, so a
  checkpoint on the log always has its snapshot (when there is a store);
- ``session_at``: a session up to one of its checkpoints, from the snapshot
  when its cut matches, else from the log;
- ``replay_session``: a session's current state, from its newest snapshot
  plus the records after its cut, or from its first event.

**Trusting a snapshot.** The snapshot row is not trusted on its own (its state
and its digest column can be rewritten together). Its checkpoint's
``CheckpointTaken`` is appended after the snapshot is saved, so it lies after
the cut: the tail (read from the cut, chains seeded from the snapshot's tails)
must hold it, and the snapshot is used only if ``json_digest(snapshot.state)``
equals that record's ``state_digest`` and the snapshot's cut equals its cut
(``services.replay.distrust``).
The digest covers every field of the state except the set of applied event ids
(``services/checkpoint.py``); of that set, only its size is checked (it must
equal ``num_events``, which the digest covers). Otherwise (no such record on
the log, another digest or cut) the log is folded from the first event.
``session_at`` pays for this with a read of the tail too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from log import LoggedEvent, SharedLog
from log.snapshots import ChainTailAt, Snapshot, SnapshotStore, read_tail, tails_below
from log.topics import SESSION_TOPICS
from schemas import events as ev
from services.checkpoint import (
    before_cut,
    cut_of,
    effects_of,
    fold_events,
    state_digest,
    state_from_json,
    state_to_json,
)
from services.replay import cut_events, distrust, without_parent_history
from services.session import SessionState

_log = logging.getLogger(__name__)


async def session_at(
    log: SharedLog, snapshots: SnapshotStore | None, session_id: str, checkpoint_id: str, cut: dict[str, int]
) -> SessionState:
    """A session folded up to one of its checkpoints (a fork's parent history added, recursively)."""
    if snapshots is not None:
        snapshot = await snapshots.get(session_id, checkpoint_id)
        if snapshot is not None and snapshot.cut == cut and (trusted := await _trusted(log, snapshot)) is not None:
            return trusted[0]
    state = fold_events(session_id, before_cut(cut_events(await log.history(session_id)), cut))
    await add_parent_history(log, snapshots, state)
    return state


async def add_parent_history(log: SharedLog, snapshots: SnapshotStore | None, state: SessionState) -> None:
    if state.fork is not None and not state.inherited:
        fork = state.fork
        state.inherit(await session_at(log, snapshots, fork.parent_session_id, fork.checkpoint_id, fork.cut))


async def take_checkpoint(
    log: SharedLog, snapshots: SnapshotStore | None, session_id: str, checkpoint_id: str
) -> ev.CheckpointTaken:
    """Cut the session's log now, fold it, save the snapshot; returns the event to append."""
    partition = log.partition_for(session_id)
    ends = {t: (await log.end_offsets(t)).get(partition, 0) for t in SESSION_TOPICS}
    history = await log.history(session_id, SESSION_TOPICS)
    events = cut_events(history)
    cut = cut_of(events, ends)
    at_cut = fold_events(session_id, events)
    await add_parent_history(log, snapshots, at_cut)
    digest = state_digest(at_cut)
    if snapshots is not None:
        snapshot = Snapshot(
            session_id,
            checkpoint_id,
            cut,
            tails_below(history, cut),
            state_to_json(at_cut),
            digest,
            at_cut.num_events,
        )
        await snapshots.save(snapshot)
    return ev.CheckpointTaken(
        checkpoint_id=checkpoint_id,
        cut=cut,
        state_digest=digest,
        effects=effects_of(at_cut),
        num_events=at_cut.num_events,
    )


@dataclass(frozen=True)
class Replayed:
    state: SessionState
    source: str
    """``log`` or ``snapshot <checkpoint id>``."""
    num_records: int
    """Records read and verified from the log."""


async def replay_session(
    log: SharedLog, snapshots: SnapshotStore | None, session_id: str, *, use_snapshot: bool = True
) -> Replayed:
    """The session's state now: from its newest snapshot and the records after it, or from the first event."""
    snapshot = await snapshots.latest(session_id) if snapshots is not None and use_snapshot else None
    trusted = await _trusted(log, snapshot) if snapshot is not None else None
    if snapshot is None or trusted is None:
        history = await log.history(session_id, SESSION_TOPICS)
        state = fold_events(session_id, cut_events(history))
        await add_parent_history(log, snapshots, state)
        return Replayed(state, "log", len(history))
    start, tail = trusted
    state = fold_events(session_id, cut_events(tail), start)
    await add_parent_history(log, snapshots, state)
    return Replayed(state, f"snapshot {snapshot.checkpoint_id}", len(tail))


async def _trusted(log: SharedLog, snapshot: Snapshot) -> tuple[SessionState, list[LoggedEvent]] | None:
    """The snapshot's state and the session's verified records after its cut, if the
    ``CheckpointTaken`` among those records vouches for the state; else None: the
    caller folds the log instead."""
    tail = await read_tail(log, snapshot.session_id, snapshot.cut, snapshot.tails)
    reason = distrust(snapshot.checkpoint_id, snapshot.cut, snapshot.state, tail)
    if reason is None:
        return state_from_json(snapshot.state), tail
    _log.warning(
        "snapshot %s of %s is not trusted (%s); folding the log instead",
        snapshot.checkpoint_id,
        snapshot.session_id,
        reason,
    )
    return None


# ------------------------------------------------- for role workers (marks)


@dataclass(frozen=True)
class Loaded:
    """A session loaded by a worker that met it late (``load_session``)."""

    state: SessionState
    low: dict[str, int]
    """Per topic, the lowest offset a later mark needs for it (the snapshot's cut, or its first record)."""
    read_to: dict[str, int]
    """Per topic, the offset after the last record of it read (the cut when none after it); 0: none."""
    tails: dict[str, ChainTailAt]
    """Per topic, its last record read (to seed the consumer's chains)."""
    num_records: int
    source: str


async def load_session(
    log: SharedLog,
    snapshots: SnapshotStore | None,
    session_id: str,
    topics: Sequence[str],
    before: tuple[str, int] | None = None,
) -> Loaded:
    """The session folded from its records in ``topics`` now, except, with ``before`` (topic,
    offset), that topic's records from that offset on: what a reader of those topics holds just
    before it folds the record at ``before`` (no parent history: ``without_parent_history``).

    From its newest trusted snapshot when its cut is below ``before``, else from its first event.
    """

    def wanted(e: LoggedEvent) -> bool:
        return e.topic in topics and (before is None or e.topic != before[0] or e.position.offset < before[1])

    snapshot = await snapshots.latest(session_id) if snapshots is not None else None
    if snapshot is not None and (before is None or snapshot.cut.get(before[0], 0) <= before[1]):
        trusted = await _trusted(log, snapshot)
        if trusted is not None:
            start, tail = trusted
            tail = [e for e in tail if wanted(e)]
            state = fold_events(session_id, cut_events(tail), without_parent_history(start))
            tails = {t: c for t, c in snapshot.tails.items() if t in topics}
            read_to = {t: snapshot.cut.get(t, 0) for t in topics}
            for event in tail:
                tails[event.topic] = ChainTailAt(event.seq, event.envelope.hash.hex())
                read_to[event.topic] = event.position.offset + 1
            low = {t: snapshot.cut.get(t, 0) for t in topics}
            return Loaded(state, low, read_to, tails, len(tail), f"snapshot {snapshot.checkpoint_id}")
    history = [e for e in await log.history(session_id, topics) if wanted(e)]
    state = fold_events(session_id, cut_events(history))
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    tails = {}
    for event in history:
        first.setdefault(event.topic, event.position.offset)
        last[event.topic] = event.position.offset + 1
        tails[event.topic] = ChainTailAt(event.seq, event.envelope.hash.hex())
    return Loaded(state, first, last, tails, len(history), "log")
