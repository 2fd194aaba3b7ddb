"""What a log or a Kafka client opened is closed when starting fails or is given up on.

A chaos run's operator gives each append 30 s (``wait_for``) while the broker may be paused:
a kafka-python client built in a thread then outlived its cancelled caller, never closed
(its socket pair and I/O thread leaked: pytest's unraisable-exception check failed the run).
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from log import SharedLog
from log.backend import OutRecord
from log.errors import BackendUnavailable
from log.kafka_backend import built_in_thread
from log.memory_backend import MemoryBackend, MemoryStore

pytestmark = pytest.mark.unit


class Client:
    def __init__(self) -> None:
        self.closed = threading.Event()

    def close(self) -> None:
        self.closed.set()


def test_a_client_built_for_a_caller_that_gave_up_is_closed_once_built() -> None:
    release = threading.Event()
    client = Client()

    def build() -> Client:
        release.wait(5)
        return client

    async def main() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(built_in_thread(build, Client.close), 0.05)
        release.set()  # the thread finishes building after its caller left
        assert await asyncio.to_thread(client.closed.wait, 5)

    asyncio.run(main())


def test_a_client_built_in_time_is_handed_over_open() -> None:
    async def main() -> None:
        client = await built_in_thread(Client, Client.close)
        await asyncio.sleep(0.05)
        assert not client.closed.is_set()

    asyncio.run(main())


def test_a_log_that_fails_to_start_closes_its_backend() -> None:
    async def main() -> None:
        backend = MemoryBackend(MemoryStore())  # no topics: num_partitions() fails after start()
        with pytest.raises(BackendUnavailable, match="logctl init"):
            await SharedLog(backend, actor="planner").start()
        with pytest.raises(RuntimeError, match="not started"):
            await backend.produce("agent.actions", [OutRecord(0, b"k", b"v")])

    asyncio.run(main())
