"""Replaying a session from the log: the pure rules (the I/O is ``workers/replay.py``).

- ``cut_events``: a session's records as the checkpoint rules see them (topic,
  offset, envelope);
- ``history_order``: the order ``SharedLog.history`` returns records in, the one
  ``fold_events`` is proven on;
- ``distrust``: whether a snapshot may stand in for the records below its cut
  (see "Trusting a snapshot" in ``workers/replay.py``);
- ``without_parent_history``: a fork's own fold, from a snapshot that holds its
  parent's steps too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from log.topics import TOPIC_ORDER
from log.types import LoggedEvent
from schemas import events as ev
from services.checkpoint import CutEvent, json_digest
from services.session import SessionState


def cut_events(history: Iterable[LoggedEvent]) -> list[CutEvent]:
    return [CutEvent(e.topic, e.position.offset, e.envelope) for e in history]


def history_order(events: Iterable[LoggedEvent]) -> list[LoggedEvent]:
    """``SharedLog.history``'s order, the one ``fold_events`` is proven on (``read_tail`` sorts so too)."""
    return sorted(events, key=lambda e: (e.envelope.occurred_at, TOPIC_ORDER[e.topic], e.seq))


def distrust(
    checkpoint_id: str, cut: Mapping[str, int], state: Mapping[str, Any], tail: Iterable[LoggedEvent]
) -> str | None:
    """Why the snapshot of ``checkpoint_id`` (its ``cut`` and ``state``) is not trusted, given the
    session's verified records after its cut (chains seeded from the snapshot's tails); None when
    its ``CheckpointTaken`` vouches for it."""
    taken = next(
        (e.body for e in tail if isinstance(e.body, ev.CheckpointTaken) and e.body.checkpoint_id == checkpoint_id),
        None,
    )
    if taken is None:
        return "its CheckpointTaken is not on the log after its cut"
    if taken.state_digest != json_digest(state):
        return "its state does not have the digest its CheckpointTaken carries"
    if taken.cut != cut:
        return "its cut is not its CheckpointTaken's"
    if len(set(state.get("applied", []))) != state.get("num_events"):
        # The digest leaves the applied ids out; each folded event adds one, so at least the count must hold.
        return "its applied event ids do not number its events"
    return None


def without_parent_history(state: SessionState) -> SessionState:
    """A fork's fold of its own events only, from a snapshot that had its parent's history added.

    A fork's snapshot holds ``inherit``'s steps (``take_checkpoint`` adds them); a role worker's
    fold never does (the planner adds them itself, when it needs them: ``NeedBase``), so a
    worker recovering from a snapshot takes them out again: they are the steps with an origin,
    and the context the inheritance set.
    """
    if not state.inherited:
        return state
    state.llm_calls = {c: s for c, s in state.llm_calls.items() if s.origin is None}
    state.tool_calls = {c: s for c, s in state.tool_calls.items() if s.origin is None}
    state.planner_steps = {c: s for c, s in state.planner_steps.items() if s.origin is None}
    state.context_id = state.session_id
    state.inherited = False
    return state
