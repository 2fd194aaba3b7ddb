"""An append tried again while the Kafka backend replaces a producer that failed a record.

``KafkaBackend`` never sends with a producer that failed a record (kafka-python's idempotent
producer may be left unable to send); until the new one is built, ``produce`` raises
BackendUnavailable, which the session workers retry. The tests do the same, shortened.
"""

from __future__ import annotations

import asyncio

from log.backend import Backend, OutRecord
from log.errors import BackendUnavailable
from log.types import Position

TRIES = 40
PAUSE_S = 0.5
WAIT_S = 30.0
"""How long one try waits for its verdict (a bounded producer settles within 1.5 s)."""


async def produce_retrying(backend: Backend, topic: str, record: OutRecord) -> Position:
    for _ in range(TRIES):
        try:
            (position,) = await asyncio.wait_for(await backend.produce(topic, [record]), WAIT_S)
            return position
        except BackendUnavailable:
            await asyncio.sleep(PAUSE_S)
    raise AssertionError(f"{topic}: not delivered in {TRIES} tries")
