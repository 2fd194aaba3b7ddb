"""The SharedLog contract on the Kafka backend's librdkafka client (a real broker)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from log.backend import Backend, OutRecord
from log.rdkafka_backend import RdKafkaBackend
from tests.contract.shared_log_contract import ReadOnlyAuditorContract, SharedLogContract

pytestmark = [pytest.mark.contract, pytest.mark.integration]


class TestRdKafkaSharedLog(SharedLogContract, ReadOnlyAuditorContract):
    @pytest.fixture
    def make_backend(self, kafka_bootstrap: str, namespace: str) -> Callable[[], Backend]:
        return lambda: RdKafkaBackend(kafka_bootstrap, namespace=namespace)


def test_a_full_local_queue_delays_sends_and_keeps_each_call_in_one_run(kafka_bootstrap: str, namespace: str) -> None:
    """With room for 4 records in librdkafka's queue, a call of 40 records waits for room
    (some ms each time); a call made while it waits lands after all of it, even when the
    queue has room at that moment."""

    async def main() -> tuple[list[int], list[int], list[bytes]]:
        backend = RdKafkaBackend(
            kafka_bootstrap, namespace=namespace, client_config={"queue.buffering.max.messages": 4}
        )
        await backend.start()
        try:
            await backend.create_topics(2)
            first = asyncio.create_task(
                backend.produce("agent.actions", [OutRecord(0, b"a", b"a%d" % i) for i in range(40)])
            )
            await asyncio.sleep(0.005)  # the first call is waiting for room by now
            second = await backend.produce("agent.actions", [OutRecord(0, b"b", b"b")])
            landed = await asyncio.gather(await first, second)
            values = [r.value async for r in backend.scan("agent.actions", 0)]
        finally:
            await backend.close()
        return [p.offset for p in landed[0]], [p.offset for p in landed[1]], values

    first, second, values = asyncio.run(main())
    assert values == [b"a%d" % i for i in range(40)] + [b"b"]
    assert first == list(range(40)) and second == [40]
