"""Resources owned by sessions: the pure fold of what tools acquired, and what to release when (pure).

A tool acquires a resource (a directory, a file, a process, a port, a container)
through the executor, which logs it on agent.effects in two steps:

1. ``ResourceAcquiring`` *before* the resource exists, with a location derived
   from its id (a path, a container name, a marker in a process's environment):
   a crash between creating it and logging it leaves a record that says where
   to look, so nothing is created that the log cannot find again;
2. ``ResourceAcquired`` once it exists, with its handle (pid, port, ...).

Then ``ResourceReleased`` when it is gone, or ``ResourceReleaseFailed`` for an
attempt that did not manage it (a process that will not die, a file the
executor may not delete): the resource stays ``stuck``, is retried after an
exponential backoff (``backoff_ms``) and is never forgotten.

Who releases what and when (``releases``), for the executor to carry out:

- every resource of a session that ended (finished, failed, cancelled);
- every resource of a tool call that a restore abandoned;
- at recovery (``reclaim=True``, the executor's first look at a session after
  it started): every resource of an attempt that did not finish (the tool was
  running in the dead executor), and every port (its socket died with it);
- a stuck resource again once its backoff has passed.

Resource ids are ``<call_id>/<attempt>/<n>`` (the n-th acquisition of that
attempt), so a retried attempt never reuses the ids of the one before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import TYPE_CHECKING

from schemas import events as ev
from schemas.events import ResourceKind

if TYPE_CHECKING:
    from services.session import SessionState

__all__ = [
    "BACKOFF_BASE_MS",
    "BACKOFF_CAP_MS",
    "Release",
    "Resource",
    "ResourceStatus",
    "backoff_ms",
    "evolve",
    "releases",
    "resource_id",
]

BACKOFF_BASE_MS = 500.0
BACKOFF_CAP_MS = 60_000.0


class ResourceStatus(StrEnum):
    ACQUIRING = "acquiring"
    """Logged, maybe created, never confirmed: it may exist, at its location."""
    HELD = "held"
    RELEASED = "released"
    STUCK = "stuck"
    """A release attempt failed; retried after ``retry_at``."""


class Reason(StrEnum):
    """Why a resource is released (``ResourceReleased.reason``)."""

    FINISHED = "session finished"
    FAILED = "session failed"
    CANCELLED = "session cancelled"
    ABANDONED = "restore abandoned its call"
    DEAD_ATTEMPT = "its tool call's attempt died with the executor"
    DEAD_HOLDER = "its holder (the executor) died"
    BY_TOOL = "released by the tool"


def resource_id(call_id: str, attempt: int, index: int) -> str:
    return f"{call_id}/{attempt}/{index}"


def attempt_of(rid: str) -> tuple[str, int]:
    """``tool-3/2/0`` -> (``tool-3``, 2)."""
    call_id, attempt, _ = rid.rsplit("/", 2)
    return call_id, int(attempt)


@dataclass
class Resource:
    """One resource of a session as the log tells it."""

    resource_id: str
    call_id: str
    tool: str
    kind: ResourceKind
    location: str
    acquiring_at: datetime
    handle: str | None = None
    acquired_at: datetime | None = None
    status: ResourceStatus = ResourceStatus.ACQUIRING
    released_at: datetime | None = None
    reason: str | None = None
    """Why it was released, or why the failed release was asked for."""
    detail: str | None = None
    num_failures: int = 0
    error: str | None = None
    retry_at: datetime | None = None

    @property
    def attempt(self) -> int:
        return attempt_of(self.resource_id)[1]

    @property
    def live(self) -> bool:
        """It may still exist: acquiring, held or stuck."""
        return self.status is not ResourceStatus.RELEASED


def backoff_ms(num_failures: int) -> float:
    """Wait before the next attempt after ``num_failures`` failed ones: 0.5 s, 1 s, 2 s, ... up to 60 s."""
    return min(BACKOFF_BASE_MS * 2.0 ** max(0, num_failures - 1), BACKOFF_CAP_MS)


def evolve(resources: dict[str, Resource], body: ev.Event, occurred_at: datetime) -> None:
    """Apply one resource event (other bodies are ignored). Late or repeated events never revive a
    released resource: released is final."""
    match body:
        case ev.ResourceAcquiring():
            resources.setdefault(
                body.resource_id,
                Resource(body.resource_id, body.call_id, body.tool, body.kind, body.location, occurred_at),
            )
        case ev.ResourceAcquired():
            if (r := resources.get(body.resource_id)) is not None:
                r.handle, r.acquired_at = body.handle, occurred_at
                if r.status is ResourceStatus.ACQUIRING:
                    r.status = ResourceStatus.HELD
        case ev.ResourceReleased():
            if (r := resources.get(body.resource_id)) is not None:
                r.status, r.released_at = ResourceStatus.RELEASED, occurred_at
                r.reason, r.detail, r.retry_at = body.reason, body.detail, None
        case ev.ResourceReleaseFailed():
            if (r := resources.get(body.resource_id)) is not None and r.live:
                r.status = ResourceStatus.STUCK
                r.num_failures = max(r.num_failures, body.attempt)
                r.reason, r.error = body.reason, body.error
                r.retry_at = occurred_at + timedelta(milliseconds=body.retry_in_ms)
        case _:
            pass


@dataclass(frozen=True)
class Release:
    """A decision: release this resource, for this reason."""

    resource: Resource
    reason: str


def _end_reason(state: SessionState) -> str | None:
    from services.session import SessionStatus  # here: services.session imports this module

    ends = {
        SessionStatus.FINISHED: Reason.FINISHED,
        SessionStatus.FAILED: Reason.FAILED,
        SessionStatus.CANCELLED: Reason.CANCELLED,
    }
    return ends.get(state.status) if state.status is not None else None


def releases(state: SessionState, *, now: datetime, reclaim: bool = False) -> list[Release]:
    """What to release now, in acquisition order (the rules are in the module docstring).

    A stuck resource is released again only once its ``retry_at`` has passed, whatever the reason;
    ``reclaim``: the executor's first look after a start, when no tool of the session is running.
    """
    out: list[Release] = []
    end = _end_reason(state)
    for r in state.resources.values():
        if not r.live:
            continue
        if r.status is ResourceStatus.STUCK and r.retry_at is not None and now < r.retry_at:
            continue
        reason = _release_reason(state, r, end, reclaim)
        if reason is not None:
            out.append(Release(r, reason))
    return out


def _release_reason(state: SessionState, r: Resource, end: str | None, reclaim: bool) -> str | None:
    if r.status is ResourceStatus.STUCK and r.reason:
        return r.reason
    if r.call_id in state.abandoned:
        return Reason.ABANDONED
    if end is not None:
        return end
    if not reclaim:
        return None
    if r.kind is ResourceKind.PORT:
        return Reason.DEAD_HOLDER
    tool = state.tool_calls.get(r.call_id)
    # The attempt that acquired it ended with an outcome: the session keeps it. Otherwise the tool
    # was running when the executor died (and a retry makes new resources under a new attempt).
    finished_attempt = tool is not None and tool.done and tool.attempts == r.attempt
    return None if finished_attempt else Reason.DEAD_ATTEMPT
