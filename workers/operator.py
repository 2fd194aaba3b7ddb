"""An operator's decisions, appended to the log: the one way ``logctl approve`` and the web console
(``workers.console``) approve, deny, retry or mark done a tool call.

Both refuse, before anything is appended, a session the log has never seen: an answer for it
would stay in the log forever and mean nothing.
"""

from __future__ import annotations

from log import LoggedEvent, SharedLog
from log.types import Position
from schemas import events as ev
from services.session import SessionState, fold

__all__ = ["UnknownSession", "decide", "known_session"]


class UnknownSession(LookupError):
    """No session of that id was ever requested or started."""

    def __init__(self, session_id: str) -> None:
        super().__init__(f"no session {session_id!r} in the log; nothing was appended")
        self.session_id = session_id


async def known_session(log: SharedLog, session_id: str) -> tuple[SessionState, list[LoggedEvent]]:
    """The session's folded state and history, or ``UnknownSession``."""
    history = await log.history(session_id)
    state = fold(session_id, [e.envelope for e in history])
    if state.status is None:
        raise UnknownSession(session_id)
    return state, history


async def decide(
    log: SharedLog, session_id: str, call_id: str, decision: ev.ApprovalDecision, *, author: str, reason: str = ""
) -> tuple[ev.ApprovalGiven, Position]:
    """Append the operator's ``decision`` on ``call_id`` (the decider and the executor act on it)."""
    await known_session(log, session_id)
    body = ev.ApprovalGiven(call_id=call_id, decision=decision, author=author, reason=reason)
    return body, await log.append(session_id, body)
