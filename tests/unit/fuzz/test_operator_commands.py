"""Arbitrary operator commands to the planner's fold: never an inconsistent state.

The base histories are real ones (the sessions of the golden log
``tests/golden/crash_recovered.jsonl``: LLM calls, tools, a payment, a crash). Into
one, at arbitrary places, go arbitrary operator commands (approvals of calls that
exist or not, with any decision; cancels; checkpoint, restore, fork and merge
requests with arbitrary ids) and replays of events already applied. The invariants,
checked after every event:

- ``SessionState.apply`` and the planner's ``next_move`` never raise;
- applying an event again is a no-op (False, nothing counted);
- commands never invent work: the LLM and tool calls are those of the history alone
  at the same point, and every tool call has its proposal;
- a finished, failed or cancelled session stays ended.
"""

from __future__ import annotations

import base64
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from log import Codec
from schemas import events as ev
from schemas.envelope import Envelope
from services.planning import next_move
from services.programs import PROGRAMS
from services.session import SessionState
from tests.golden.replay import read_golden
from tests.unit.fuzz.profile import FUZZ

pytestmark = pytest.mark.unit

GOLDEN = Path(__file__).parents[2] / "golden" / "crash_recovered.jsonl"


def _histories() -> dict[str, list[Envelope]]:
    codec = Codec()
    _, lines = read_golden(GOLDEN)
    envelopes = [codec.decode(base64.b64decode(line["value"])) for line in lines]
    by_session: dict[str, list[Envelope]] = {}
    for envelope in sorted(envelopes, key=lambda e: e.occurred_at):
        by_session.setdefault(envelope.session_id, []).append(envelope)
    return by_session


HISTORIES = _histories()
CALL_IDS = sorted({b.call_id for h in HISTORIES.values() for e in h if isinstance(b := e.body, ev.ToolCallProposed)})
TEXT = st.text(max_size=12)
IDS = st.sampled_from(["ck-1", "auto-g0-s0", "", "../x"]) | TEXT

COMMANDS = st.one_of(
    st.builds(
        ev.ApprovalGiven,
        call_id=st.sampled_from([*CALL_IDS, "tool-99", "llm-0", ""]) | TEXT,
        decision=st.sampled_from(list(ev.ApprovalDecision)),
        author=TEXT,
        reason=TEXT,
    ),
    st.builds(ev.CancelRequested, author=TEXT, reason=TEXT),
    st.builds(ev.CheckpointRequested, author=TEXT, checkpoint_id=IDS),
    st.builds(ev.RestoreRequested, author=TEXT, checkpoint_id=IDS, dry_run=st.booleans()),
    st.builds(ev.ForkRequested, author=TEXT, checkpoint_id=IDS, fork_session_id=IDS),
    st.builds(ev.MergeRequested, author=TEXT, branch_session_ids=st.lists(IDS, max_size=3)),
)


def _command(session: str, body: ev.Event, after: Envelope, n: int) -> Envelope:
    return Envelope.model_construct(
        event_id=f"fuzz-op-{n}",
        session_id=session,
        seq=0,
        actor="operator",
        occurred_at=after.occurred_at + timedelta(microseconds=1),
        causation_id=None,
        prev_hash=b"",
        body=body,
        hash=b"",
    )


@st.composite
def _scenarios(draw: st.DrawFn) -> tuple[str, list[tuple[Envelope, bool]]]:
    """A session and what its fold gets: (envelope, is it the history's own) in order."""
    session = draw(st.sampled_from(sorted(HISTORIES)))
    history = HISTORIES[session]
    stream: list[tuple[Envelope, bool]] = []
    for envelope in history:
        stream.append((envelope, True))
        for _ in range(draw(st.integers(0, 2))):
            if draw(st.booleans()):
                stream.append((_command(session, draw(COMMANDS), envelope, len(stream)), False))
            else:
                stream.append((draw(st.sampled_from([e for e, _ in stream])), False))  # a replay
    return session, stream


def _calls(state: SessionState) -> tuple[set[str], set[str]]:
    return set(state.llm_calls), set(state.tool_calls)


@FUZZ
@given(_scenarios())
def test_operator_commands_never_make_the_fold_inconsistent(scenario: tuple[str, list[tuple[Envelope, bool]]]) -> None:
    session, stream = scenario
    state = SessionState(session)
    plain = SessionState(session)  # the history alone
    applied: set[str] = set()
    ended = False
    for envelope, own in stream:
        before = state.num_events
        fresh = state.apply(envelope)
        assert fresh == (envelope.event_id not in applied), "an event is applied once, and only once"
        if not fresh:
            assert state.num_events == before
        applied.add(envelope.event_id)
        if own and envelope.event_id not in plain.applied:
            plain.apply(envelope)
        assert _calls(state) == _calls(plain), "operator commands never invent LLM or tool calls"
        assert all(call.proposed is not None for call in state.tool_calls.values())
        ended = ended or state.finished
        assert state.finished or not ended, f"an ended session came back: {state.status}"
        next_move(state, PROGRAMS.get(state.program))  # never raises, whatever the commands
