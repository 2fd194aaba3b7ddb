"""The envelope every record on the log carries (DESIGN.md section 3).

Field order matters: ``hash`` is the last field, so the Avro encoding of the
envelope without it (the bytes the hash covers) is a prefix of the encoding
with it. ``log.codec`` relies on that to hash and verify without encoding
twice.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from schemas.events import Event, Model


class Envelope(Model):
    """One record of the log: identity, position in its chain, and a typed body."""

    event_id: str = Field(description="UUID of the event; appending the same event_id twice is a no-op.")
    session_id: str = Field(description="The session the event belongs to; also the record key.")
    seq: int = Field(description="Position in the (topic, session) chain, gapless from 0.")
    actor: str = Field(description="The principal that wrote the record; must own the topic.")
    occurred_at: datetime = Field(description="When the event happened, from the writer's injected clock (UTC).")
    causation_id: str | None = Field(default=None, description="event_id of the event that caused this one, or null.")
    prev_hash: bytes = Field(description="hash of the previous record in the chain; 32 zero bytes for seq 0.")
    body: Event = Field(description="The event itself.")
    hash: bytes = Field(description="SHA-256 over the Avro encoding of all fields above (prev_hash included).")
