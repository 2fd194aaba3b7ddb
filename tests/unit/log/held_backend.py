"""The in-memory backend with the broker's acknowledgement in the test's hands.

With ``hold`` set, a produce() returns a future that resolves (and its records
land) only when the test calls ``release()``: the window between sending a
batch and its acknowledgement becomes a step of the test. With ``refuse`` set,
produce() raises it (a full queue, a broker gone).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from log.backend import OutRecord
from log.memory_backend import MemoryBackend
from log.types import Position, RawRecord


class HeldBackend(MemoryBackend):
    def __init__(self) -> None:
        super().__init__()
        self.hold = False
        self.refuse: BaseException | None = None
        self.held: list[tuple[asyncio.Future[list[Position]], str, Sequence[OutRecord]]] = []
        self.most_held = 0
        self.batches: list[list[OutRecord]] = []  # every produce call's records
        self.held_more = asyncio.Event()

    @property
    def produce_calls(self) -> int:
        return len(self.batches)

    async def produce(self, topic: str, records: Sequence[OutRecord]) -> asyncio.Future[list[Position]]:
        self.batches.append(list(records))
        if self.refuse is not None:
            raise self.refuse
        if not self.hold:
            return await super().produce(topic, records)
        future: asyncio.Future[list[Position]] = asyncio.get_running_loop().create_future()
        self.held.append((future, topic, list(records)))
        self.most_held = max(self.most_held, len(self.held))
        self.held_more.set()
        return future

    def release(self, error: BaseException | None = None) -> None:
        """Land every held batch, in the order produced (or fail each with ``error``)."""
        for future, topic, records in self.held:
            if error is None:
                future.set_result(self.store.append(topic, records))
            else:
                future.set_exception(error)
        self.held.clear()

    def event_ids(self) -> list[list[str | None]]:
        """The event ids of each produce call."""
        return [[r.event_id for r in batch] for batch in self.batches]

    def records(self, topic: str) -> list[RawRecord]:
        """Every record of ``topic`` that landed, partition by partition."""
        store = self.store
        return [r for p in range(store.partitions()) for r in store.records(topic, p)]
