"""A librdkafka group member knows when the group may have given its partitions away.

The write fence (docs/reliability.md, "The write fence") on librdkafka, as
``tests/integration/test_kafka_membership.py`` checks it on kafka-python: a revocation waits
for a writer's records to land and makes the member LOST; a member whose group coordinator
stops answering (here: the test's own broker, SIGSTOPped) is IN_DOUBT, and stays so until
the coordinator answers again. librdkafka exposes no heartbeat: the member reads the group's
state from librdkafka's statistics (``log.rdkafka_backend.group_word``). Every wait is for a
state, never a time.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import Callable

import pytest

from cli.common import ensure_topics
from log.backend import Membership, OutRecord
from log.local_kafka import LocalKafkaBroker
from log.rdkafka_backend import STATS_INTERVAL_MS, RdKafkaBackend, RdKafkaSubscription
from log.topics import AGENT_ACTIONS

pytestmark = pytest.mark.integration

STATE_WAIT_S = 60.0


async def until(what: str, done: Callable[[], bool], *members: RdKafkaSubscription) -> None:
    """Poll the members (librdkafka serves rebalances and statistics inside polls) until ``done``."""
    deadline = time.monotonic() + STATE_WAIT_S
    while not done():
        assert time.monotonic() < deadline, f"{what}: not after {STATE_WAIT_S:g} s"
        for member in members:
            await member.poll(0.1, 10)
        await asyncio.sleep(0.05)


def test_records_handed_over_land_before_the_member_gives_its_partitions_up(
    kafka_bootstrap: str, namespace: str
) -> None:
    ensure_topics(f"kafka://{kafka_bootstrap}", namespace=namespace)

    async def scenario() -> None:
        # A record waits up to 500 ms in the producer for its batch to fill: in flight for long.
        backend = RdKafkaBackend(kafka_bootstrap, namespace=namespace, linger_ms=500, bounded_delivery=True)
        await backend.start()
        member = await backend.subscribe(f"fence-{uuid.uuid4().hex[:6]}", [AGENT_ACTIONS.name], from_beginning=True)
        assert isinstance(member, RdKafkaSubscription)
        try:
            num_partitions = await backend.num_partitions()
            await until("the member owns every partition", lambda: len(member.assignment()) == num_partitions, member)
            await until("its membership is confirmed", lambda: member.membership() is Membership.CONFIRMED, member)
            before = await backend.end_offsets(AGENT_ACTIONS.name)
            with member.writing():  # a writer handing a record over
                produced = await backend.produce(AGENT_ACTIONS.name, [OutRecord(0, b"fence", b"in flight")])
                # The group takes the partitions back (librdkafka calls this inside a poll).
                revoke = asyncio.ensure_future(asyncio.to_thread(member._on_revoke, member._consumer, []))
                await asyncio.sleep(0.05)
                assert not revoke.done()  # it waits for the writer
            await revoke
            assert member.membership() is Membership.LOST  # no writer hands a record over now
            after = await backend.end_offsets(AGENT_ACTIONS.name)
            assert after[0] == before[0] + 1  # landed before the partitions went
            await produced
        finally:
            await member.close()
            await backend.close()

    asyncio.run(scenario())


def test_a_member_not_polled_for_long_hears_the_group_with_a_refresh_and_loses_no_record(
    kafka_bootstrap: str, namespace: str
) -> None:
    """librdkafka hands its reports over inside a poll only: a writer waiting for CONFIRMED while
    its worker's loop is held up (by that very writer) would wait for good. ``refresh`` serves
    them; what it reads meanwhile comes with the next poll, in order."""
    ensure_topics(f"kafka://{kafka_bootstrap}", namespace=namespace)

    async def scenario() -> None:
        backend = RdKafkaBackend(kafka_bootstrap, namespace=namespace)
        await backend.start()
        member = await backend.subscribe(f"refresh-{uuid.uuid4().hex[:6]}", [AGENT_ACTIONS.name], from_beginning=True)
        assert isinstance(member, RdKafkaSubscription)
        try:
            num_partitions = await backend.num_partitions()
            await until("it owns every partition", lambda: len(member.assignment()) == num_partitions, member)
            await until("confirmed", lambda: member.membership() is Membership.CONFIRMED, member)
            records = [OutRecord(0, b"refresh", f"{i}".encode()) for i in range(20)]
            await (await backend.produce(AGENT_ACTIONS.name, records))
            deadline = time.monotonic() + STATE_WAIT_S
            while member.membership() is not Membership.IN_DOUBT:  # no poll: the reports stay unread
                assert time.monotonic() < deadline, "never in doubt without polls"
                await asyncio.sleep(0.1)
            while member.membership() is not Membership.CONFIRMED:
                assert time.monotonic() < deadline, "a refresh never heard the group"
                await member.refresh()
                await asyncio.sleep(0.05)
            got: list[bytes] = []
            while len(got) < len(records):
                assert time.monotonic() < deadline, f"{len(got)} of {len(records)} records read"
                got += [r.value for r in await member.poll(0.1, 7) if r.position.partition == 0]
            assert got == [r.value for r in records]  # none lost, none twice, in order
        finally:
            await member.close()
            await backend.close()

    asyncio.run(scenario())


@pytest.mark.slow
def test_a_member_whose_coordinator_stops_answering_is_in_doubt_until_it_answers() -> None:
    with LocalKafkaBroker() as broker:
        ensure_topics(f"kafka://{broker.bootstrap_servers}", namespace="doubt")
        pid = broker.pid
        assert pid is not None

        async def scenario() -> None:
            backend = RdKafkaBackend(broker.bootstrap_servers, namespace="doubt")
            await backend.start()
            member = await backend.subscribe("fence", [AGENT_ACTIONS.name], from_beginning=True)
            assert isinstance(member, RdKafkaSubscription)
            try:
                num_partitions = await backend.num_partitions()
                await until("it owns every partition", lambda: len(member.assignment()) == num_partitions, member)
                await until("confirmed", lambda: member.membership() is Membership.CONFIRMED, member)
                os.kill(pid, signal.SIGSTOP)  # what a broker outage does: no answer
                try:
                    await until("in doubt", lambda: member.membership() is Membership.IN_DOUBT, member)
                    # More reports come (librdkafka makes them itself), none with a newer answer.
                    reports = member._word
                    await until("a newer report", lambda: member._word is not reports, member)
                    await asyncio.sleep(2 * STATS_INTERVAL_MS / 1000)
                    await member.poll(0.1, 10)
                    assert member.membership() is Membership.IN_DOUBT
                    assert len(member.assignment()) == num_partitions  # it still believes them its own
                finally:
                    os.kill(pid, signal.SIGCONT)
                # Answered again (after a rejoin if the group dropped it meanwhile).
                await until("confirmed again", lambda: member.membership() is Membership.CONFIRMED, member)
                assert len(member.assignment()) == num_partitions
            finally:
                await member.close()
                await backend.close()

        asyncio.run(scenario())
