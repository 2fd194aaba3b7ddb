"""A session worker's producer settles every record within its bound, and works again after.

The write fence (docs/reliability.md, "The write fence") rests on it: a record handed to the
producer while its member was CONFIRMED lands, if ever, before the group can have given the
partition to another member. kafka-python's default retries a record for 120 s: a record held
through a broker outage then landed after the restarted group had handed its partition to a
successor that had read the partition's tails (the 1,000-session chaos run's c372). The broker
here is the test's own (it is paused), never the shared one.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from cli.common import ensure_topics
from log.backend import OutRecord
from log.errors import BackendUnavailable
from log.kafka_backend import KafkaBackend
from log.local_kafka import LocalKafkaBroker
from log.rdkafka_backend import RdKafkaBackend
from log.topics import AGENT_ACTIONS
from tests.integration.produce_retry import produce_retrying

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SETTLED_WAIT_S = 30.0
"""How long the test waits for each verdict while the broker is paused: kafka-python's default
(120 s of retries) would still be retrying; a bounded producer has long given the record up."""


@pytest.mark.parametrize("backend_class", [KafkaBackend, RdKafkaBackend], ids=["kafka-python", "librdkafka"])
def test_records_are_given_up_while_the_broker_is_paused_and_the_producer_works_after(
    backend_class: type[KafkaBackend | RdKafkaBackend],
) -> None:
    with LocalKafkaBroker() as broker:
        ensure_topics(f"kafka://{broker.bootstrap_servers}", namespace="bounded")
        pid = broker.pid
        assert pid is not None

        async def scenario() -> None:
            backend = backend_class(broker.bootstrap_servers, namespace="bounded", bounded_delivery=True)
            await backend.start()
            try:
                await (await backend.produce(AGENT_ACTIONS.name, [OutRecord(0, b"s", b"before")]))
                os.kill(pid, signal.SIGSTOP)
                try:
                    # Every try fails within the bound, the first one (sent, then expired) and
                    # the ones after it (kafka-python's producer would hold them, unexpired,
                    # until the broker's return: the backend replaced it).
                    for attempt in range(3):
                        with pytest.raises(BackendUnavailable):
                            produced = await backend.produce(AGENT_ACTIONS.name, [OutRecord(0, b"s", b"during")])
                            await asyncio.wait_for(produced, SETTLED_WAIT_S)
                        await asyncio.sleep(attempt)
                finally:
                    os.kill(pid, signal.SIGCONT)
                position = await produce_retrying(backend, AGENT_ACTIONS.name, OutRecord(0, b"s", b"after"))
                values = [r.value async for r in backend.scan(AGENT_ACTIONS.name, 0)]
                # A record given up may still have landed (the broker took it before it paused);
                # never after what was sent once the broker was back.
                assert values[0] == b"before" and values[-1] == b"after"
                assert values.count(b"after") == 1 and values.count(b"during") <= 3
                assert position.offset == len(values) - 1
            finally:
                await asyncio.wait_for(backend.close(), SETTLED_WAIT_S)

        asyncio.run(scenario())
