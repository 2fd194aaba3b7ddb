"""Partition marks: how little of a partition a role worker needs to read again (pure).

A worker that restarts (or takes a partition over) needs, of each session of
the partition, only what is not finished: a session that still needs work
(``needs_work``) from its newest checkpoint's cut when that checkpoint has a
snapshot (the snapshot holds the records below the cut), else from its first
record in each topic. ``make_mark`` takes the minimum per topic (the
low-water mark), or, for a topic no such session needs, how far the worker
has read; it lists the sessions that need work, with the checkpoint each
starts from. Sessions not listed needed nothing when the mark was made: their
records below ``read_to`` are skipped at recovery, and a later record of one
of them makes the worker load it from the log then (``workers/recovery.py``).

The worker gathers the offsets, the states and which checkpoints
have snapshots, and stores the mark (``log.snapshots.SnapshotStore.save_mark``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from log.types import PartitionMark
from services.session import SessionState, ToolStatus

IN_FLIGHT = frozenset({ToolStatus.PROPOSED, ToolStatus.COMMITTED, ToolStatus.STARTED, ToolStatus.IN_DOUBT})


def needs_work(state: SessionState, acts_on: Collection[ToolStatus] = IN_FLIGHT) -> bool:
    """Could this session still make the role act? Not finished, or an operator command
    pending, or a fork request (carried out again on recovery; the newest snapshot bounds
    what it costs), or an own tool call in a state the role acts on even after the end
    (``acts_on``: the decider's proposals, the executor's committed, started or in-doubt calls;
    a role that never reads effects sees committed calls as unsettled forever), or a resource
    not released yet (services/resources.py)."""
    if state.status is None:
        return False  # never requested: nothing to do (the planner dead-letters its events)
    if not state.finished or state.pending_commands or state.fork_requests:
        return True
    if any(r.live for r in state.resources.values()):
        return True  # the executor still has to release them (a stuck one: for as long as it takes)
    return any(t.origin is None and t.status in acts_on for t in state.tool_calls.values())


@dataclass(frozen=True)
class SessionLow:
    """One session as a mark sees it: where its records still needed begin."""

    session_id: str
    first: Mapping[str, int]
    """Per topic, its first record the worker holds in its fold (a loaded session: the cut or
    first record it was loaded from); topics it has no record in yet: absent."""
    checkpoint_cuts: Sequence[tuple[str, Mapping[str, int]]]
    """Its checkpoints that have a snapshot, in log order (id, cut)."""


def session_start(low: SessionLow, topics: Iterable[str]) -> tuple[dict[str, int], str | None]:
    """Per topic, the lowest offset of the session still needed, and the checkpoint it comes from."""
    if low.checkpoint_cuts:
        checkpoint_id, cut = low.checkpoint_cuts[-1]  # the newest: the most of its history in a snapshot
        return {t: cut[t] if t in cut else low.first[t] for t in topics if t in cut or t in low.first}, checkpoint_id
    return {t: low.first[t] for t in topics if t in low.first}, None


def make_mark(partition: int, read_to: Mapping[str, int], needed: Iterable[SessionLow]) -> PartitionMark:
    """The mark of one partition: ``read_to`` per topic, lowered to what each needed session needs."""
    start = dict(read_to)
    sessions: dict[str, str | None] = {}
    for low in needed:
        offsets, checkpoint_id = session_start(low, read_to)
        sessions[low.session_id] = checkpoint_id
        for topic, offset in offsets.items():
            start[topic] = min(start[topic], offset)
    return PartitionMark(partition, start, dict(read_to), sessions)
