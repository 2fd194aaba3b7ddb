"""Build envelopes for pure tests of services (no log, no codec)."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

from schemas.envelope import Envelope
from schemas.events import Event

_ids = itertools.count()
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def envelope(body: Event, *, session: str = "s", actor: str = "planner", at_s: float = 0.0) -> Envelope:
    n = next(_ids)
    return Envelope(
        event_id=f"e{n}",
        session_id=session,
        seq=n,
        actor=actor,
        occurred_at=T0 + timedelta(seconds=at_s),
        causation_id=None,
        prev_hash=bytes(32),
        body=body,
        hash=bytes(32),
    )
