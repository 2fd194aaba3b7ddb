"""The pure fold of a session's resources and the release rules (services/resources.py)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from schemas import events as ev
from schemas.events import EffectClass, ResourceKind
from services.checkpoint import state_digest, state_from_json, state_to_json
from services.marks import needs_work
from services.resources import (
    BACKOFF_CAP_MS,
    Reason,
    ResourceStatus,
    attempt_of,
    backoff_ms,
    releases,
    resource_id,
)
from services.session import SessionState, fold
from tests.unit.services.helpers import T0, envelope

pytestmark = pytest.mark.unit


def started_session() -> list[ev.Event]:
    return [
        ev.SessionStarted(program="script", args_json="{}"),
        ev.ToolCallProposed(
            call_id="tool-0",
            tool="sandbox",
            arguments_json="{}",
            effect_class=EffectClass.IDEMPOTENT,
            idempotency_key="s/tool-0",
        ),
        ev.ToolCallCommitted(call_id="tool-0", votes=[], policy="unanimous"),
        ev.ToolCallStarted(call_id="tool-0", tool="sandbox", idempotency_key="s/tool-0", attempt=1),
    ]


def acquire(rid: str, kind: ResourceKind, location: str = "/x", call_id: str = "tool-0") -> list[ev.Event]:
    return [
        ev.ResourceAcquiring(resource_id=rid, call_id=call_id, tool="sandbox", kind=kind, location=location),
        ev.ResourceAcquired(resource_id=rid, handle=location),
    ]


def completed(call_id: str = "tool-0") -> ev.Event:
    return ev.ToolCallCompleted(call_id=call_id, result_json="{}", result_tokens=1, duration_ms=1.0)


def state_of(bodies: list[ev.Event], at_s: float = 0.0) -> SessionState:
    return fold("s", [envelope(b, at_s=at_s) for b in bodies])


NOW = T0 + timedelta(seconds=10)


def test_ids_name_the_call_and_its_attempt() -> None:
    rid = resource_id("r1.tool-3", 2, 0)
    assert rid == "r1.tool-3/2/0"
    assert attempt_of(rid) == ("r1.tool-3", 2)


def test_acquiring_then_acquired_is_held_with_its_handle() -> None:
    s = state_of([*started_session(), ev.ResourceAcquiring(
        resource_id="tool-0/1/0", call_id="tool-0", tool="sandbox", kind=ResourceKind.PROCESS,
        location="AGENTLOG_RESOURCE=rabc")])  # fmt: skip
    r = s.resources["tool-0/1/0"]
    assert (r.status, r.handle, r.live) == (ResourceStatus.ACQUIRING, None, True)
    s.apply(envelope(ev.ResourceAcquired(resource_id="tool-0/1/0", handle="4242")))
    assert (r.status, r.handle, r.attempt) == (ResourceStatus.HELD, "4242", 1)


def test_a_running_session_keeps_what_it_holds() -> None:
    s = state_of([*started_session(), *acquire("tool-0/1/0", ResourceKind.DIRECTORY), completed()])
    assert releases(s, now=NOW) == []


@pytest.mark.parametrize(
    ("end", "reason"),
    [
        (ev.SessionFinished(output_json="{}", num_llm_calls=0, num_tool_calls=1), Reason.FINISHED),
        (ev.SessionFailed(reason="boom", error_type="ProgramError"), Reason.FAILED),
        (ev.SessionFailed(reason="cancelled by an operator", error_type="Cancelled"), Reason.CANCELLED),
    ],
)
def test_every_resource_of_an_ended_session_is_released(end: ev.Event, reason: str) -> None:
    s = state_of([
        *started_session(), *acquire("tool-0/1/0", ResourceKind.DIRECTORY),
        *acquire("tool-0/1/1", ResourceKind.PORT, ""), completed(), end,
    ])  # fmt: skip
    assert [(o.resource.resource_id, o.reason) for o in releases(s, now=NOW)] == [
        ("tool-0/1/0", reason),
        ("tool-0/1/1", reason),
    ]


def test_an_intent_without_confirmation_is_released_too() -> None:
    """The executor died between logging the intent and logging the handle: it may exist."""
    s = state_of([
        *started_session(),
        ev.ResourceAcquiring(resource_id="tool-0/1/0", call_id="tool-0", tool="sandbox",
                             kind=ResourceKind.DIRECTORY, location="/r/x"),
        ev.SessionFailed(reason="boom", error_type="ProgramError"),
    ])  # fmt: skip
    assert [o.resource.status for o in releases(s, now=NOW)] == [ResourceStatus.ACQUIRING]


def test_released_is_final_and_a_second_release_is_ignored() -> None:
    released = ev.ResourceReleased(resource_id="tool-0/1/0", reason=Reason.FINISHED, detail="removed")
    late = ev.ResourceReleaseFailed(
        resource_id="tool-0/1/0", attempt=1, reason=Reason.FINISHED, error="x", retry_in_ms=500
    )
    s = state_of([*started_session(), *acquire("tool-0/1/0", ResourceKind.FILE), released, released, late])
    r = s.resources["tool-0/1/0"]
    assert (r.status, r.live, r.detail) == (ResourceStatus.RELEASED, False, "removed")
    s.apply(envelope(ev.ResourceAcquired(resource_id="tool-0/1/0", handle="again")))
    assert r.status is ResourceStatus.RELEASED
    assert releases(s, now=NOW) == []


def test_events_for_an_unknown_resource_change_nothing() -> None:
    s = state_of([*started_session(), ev.ResourceAcquired(resource_id="nope/1/0", handle="1")])
    assert s.resources == {}


def test_reclaim_releases_the_resources_of_an_attempt_that_never_finished() -> None:
    s = state_of([*started_session(), *acquire("tool-0/1/0", ResourceKind.PROCESS)])
    assert releases(s, now=NOW) == []  # a live executor: the tool is still running
    assert [o.reason for o in releases(s, now=NOW, reclaim=True)] == [Reason.DEAD_ATTEMPT]


def test_reclaim_keeps_what_a_finished_attempt_left_to_its_session_but_not_ports() -> None:
    s = state_of([
        *started_session(), *acquire("tool-0/1/0", ResourceKind.DIRECTORY),
        *acquire("tool-0/1/1", ResourceKind.PORT, ""), completed(),
    ])  # fmt: skip
    assert [(o.resource.resource_id, o.reason) for o in releases(s, now=NOW, reclaim=True)] == [
        ("tool-0/1/1", Reason.DEAD_HOLDER)
    ]


def test_a_retried_attempt_reclaims_the_dead_attempts_resources_only() -> None:
    retry = ev.ToolCallStarted(call_id="tool-0", tool="sandbox", idempotency_key="s/tool-0", attempt=2)
    s = state_of([
        *started_session(), *acquire("tool-0/1/0", ResourceKind.DIRECTORY), retry,
        *acquire("tool-0/2/0", ResourceKind.DIRECTORY), completed(),
    ])  # fmt: skip
    assert [o.resource.resource_id for o in releases(s, now=NOW, reclaim=True)] == ["tool-0/1/0"]


def test_a_restore_releases_the_abandoned_calls_resources() -> None:
    checkpoint = ev.CheckpointTaken(checkpoint_id="ckpt-0", cut={}, state_digest="d", effects=[], num_events=1)
    proposed = ev.ToolCallProposed(
        call_id="tool-1", tool="sandbox", arguments_json="{}", effect_class=EffectClass.IDEMPOTENT,
        idempotency_key="s/tool-1",
    )  # fmt: skip
    bodies = [
        ev.SessionStarted(program="script", args_json="{}"), checkpoint, proposed,
        ev.ToolCallCommitted(call_id="tool-1", votes=[], policy="unanimous"),
        ev.ToolCallStarted(call_id="tool-1", tool="sandbox", idempotency_key="s/tool-1", attempt=1),
        *acquire("tool-1/1/0", ResourceKind.DIRECTORY, call_id="tool-1"), completed("tool-1"),
    ]  # fmt: skip
    s = state_of(bodies)
    assert releases(s, now=NOW) == []
    s.apply(envelope(ev.RestoreApplied(checkpoint_id="ckpt-0", num_abandoned=5, compensated_call_ids=[])))
    assert "tool-1" in s.abandoned
    assert [o.reason for o in releases(s, now=NOW)] == [Reason.ABANDONED]


def test_a_stuck_resource_waits_for_its_backoff_and_keeps_its_reason() -> None:
    failed = ev.ResourceReleaseFailed(
        resource_id="tool-0/1/0", attempt=1, reason=Reason.FINISHED, error="PermissionError", retry_in_ms=500
    )
    s = state_of([*started_session(), *acquire("tool-0/1/0", ResourceKind.DIRECTORY), completed()])
    s.apply(envelope(ev.SessionFinished(output_json="{}", num_llm_calls=0, num_tool_calls=1), at_s=1))
    s.apply(envelope(failed, at_s=2))
    r = s.resources["tool-0/1/0"]
    assert (r.status, r.num_failures, r.error) == (ResourceStatus.STUCK, 1, "PermissionError")
    assert r.retry_at == T0 + timedelta(seconds=2.5)
    assert releases(s, now=T0 + timedelta(seconds=2.4)) == []
    assert [o.reason for o in releases(s, now=T0 + timedelta(seconds=2.5))] == [Reason.FINISHED]
    assert needs_work(s)  # a finished session with a stuck resource is never forgotten
    s.apply(envelope(ev.ResourceReleased(resource_id="tool-0/1/0", reason=Reason.FINISHED, detail="ok"), at_s=3))
    assert not needs_work(s)


def test_backoff_doubles_up_to_its_cap() -> None:
    assert [backoff_ms(n) for n in (1, 2, 3, 4)] == [500, 1000, 2000, 4000]
    assert backoff_ms(30) == BACKOFF_CAP_MS


def test_resources_survive_a_snapshot_and_states_without_them_keep_their_digest() -> None:
    plain = state_of(started_session())
    assert "resources" not in state_to_json(plain)  # the digests of older logs do not change
    assert state_digest(state_from_json(json.loads(json.dumps(state_to_json(plain))))) == state_digest(plain)
    failed = ev.ResourceReleaseFailed(
        resource_id="tool-0/1/0", attempt=1, reason=Reason.FINISHED, error="e", retry_in_ms=500
    )
    s = state_of([*started_session(), *acquire("tool-0/1/0", ResourceKind.CONTAINER, "agentlog-r1"), failed])
    again = state_from_json(json.loads(json.dumps(state_to_json(s))))
    assert again.resources == s.resources
    assert state_digest(again) == state_digest(s)
