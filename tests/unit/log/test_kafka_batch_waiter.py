"""_BatchWaiter: N kafka-python send futures become one asyncio future of positions, in record order."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import pytest
from kafka.future import Future
from kafka.producer.future import RecordMetadata

from log.errors import BackendUnavailable
from log.kafka_backend import _BatchWaiter
from log.types import Position

pytestmark = pytest.mark.unit


def metadata(partition: int, offset: int) -> RecordMetadata:
    return RecordMetadata("ns.agent.actions", partition, None, offset, 0, None, 1, 1, -1)


def complete_from_sender_thread(sends: Sequence[Future], outcomes: Sequence[RecordMetadata | Exception]) -> None:
    """Complete the futures in reverse order on another thread, as kafka-python's sender might."""

    def sender() -> None:
        for send, outcome in reversed(list(zip(sends, outcomes, strict=True))):
            if isinstance(outcome, Exception):
                send.failure(outcome)
            else:
                send.success(outcome)

    thread = threading.Thread(target=sender)
    thread.start()
    thread.join()


def test_positions_come_in_record_order_whoever_completes_them() -> None:
    async def scenario() -> list[Position]:
        n = 200
        waiter = _BatchWaiter(asyncio.get_running_loop(), "agent.actions", n)
        sends = [Future() for _ in range(n)]
        outcomes = [metadata(i % 4, 1000 + i) for i in range(n)]
        for send, outcome in list(zip(sends, outcomes, strict=True))[:50]:
            send.success(outcome)  # done before its callback is added: it runs on this thread
        for send in sends:
            waiter.add(send)
        complete_from_sender_thread(sends[50:], outcomes[50:])
        return await asyncio.wait_for(waiter.future, 5)

    positions = asyncio.run(scenario())
    assert positions == [Position("agent.actions", i % 4, 1000 + i) for i in range(200)]


def test_a_failed_send_fails_the_batch_with_the_first_error() -> None:
    async def scenario() -> None:
        waiter = _BatchWaiter(asyncio.get_running_loop(), "agent.actions", 3)
        sends = [Future() for _ in range(3)]
        for send in sends:
            waiter.add(send)
        # Reverse order: the record at index 2 fails first.
        complete_from_sender_thread(sends, [metadata(0, 0), RuntimeError("second"), RuntimeError("first")])
        with pytest.raises(BackendUnavailable, match="producing to agent.actions failed: first"):
            await asyncio.wait_for(waiter.future, 5)

    asyncio.run(scenario())


def test_the_batch_resolves_once_all_sends_are_done() -> None:
    async def scenario() -> None:
        waiter = _BatchWaiter(asyncio.get_running_loop(), "agent.actions", 2)
        sends = [Future(), Future()]
        for send in sends:
            waiter.add(send)
        sends[0].success(metadata(1, 7))
        await asyncio.sleep(0.01)
        assert not waiter.future.done()
        sends[1].success(metadata(2, 9))
        assert await asyncio.wait_for(waiter.future, 5) == [
            Position("agent.actions", 1, 7),
            Position("agent.actions", 2, 9),
        ]

    asyncio.run(scenario())
