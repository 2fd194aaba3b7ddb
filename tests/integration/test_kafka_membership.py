"""A kafka-python group member knows when the group may have given its partitions away.

Kafka fences no producer: a member that the group dropped without its knowing (a broker outage
swallowed its heartbeats, then another member took its partitions) would go on appending to the
chains its successor now writes. The 1,000-session chaos run showed it: after a broker kill a
planner kept writing partition 3 while the restarted planner, alone in the group's next
generation, wrote it too (docs/reliability.md). ``Subscription.membership`` is what a writer
asks before it appends: CONFIRMED while heartbeats are answered, IN_DOUBT once none has been for
half the session timeout, LOST once the group says it must rejoin.

Here the member's heartbeat is stopped (as a broker outage stops it), a second member joins and
gets every partition once the first one's session expires, and the first one's heartbeat comes
back: the group's answer (unknown member) makes it LOST. Every wait is for a state, never a time.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

import pytest

from cli.common import ensure_topics
from log.backend import Membership, OutRecord
from log.kafka_backend import KafkaBackend, KafkaSubscription
from log.topics import AGENT_ACTIONS

pytestmark = pytest.mark.integration

STATE_WAIT_S = 60.0


async def until(what: str, done: Callable[[], bool], *members: KafkaSubscription) -> None:
    """Poll the members (their polls run the group protocol) until ``done``."""
    deadline = time.monotonic() + STATE_WAIT_S
    while not done():
        assert time.monotonic() < deadline, f"{what}: not after {STATE_WAIT_S:g} s"
        for member in members:
            await member.poll(0.1, 10)
        await asyncio.sleep(0.05)


def test_a_member_whose_heartbeats_go_unanswered_is_in_doubt_then_lost(kafka_bootstrap: str, namespace: str) -> None:
    ensure_topics(f"kafka://{kafka_bootstrap}", namespace=namespace)

    async def scenario() -> None:
        backend = KafkaBackend(kafka_bootstrap, namespace=namespace)
        await backend.start()
        group = f"fence-{uuid.uuid4().hex[:6]}"
        first = await backend.subscribe(group, [AGENT_ACTIONS.name], from_beginning=True)
        second = None
        assert isinstance(first, KafkaSubscription)
        try:
            num_partitions = await backend.num_partitions()
            await until(
                "the first member owns every partition", lambda: len(first.assignment()) == num_partitions, first
            )
            await until("its membership is confirmed", lambda: first.membership() is Membership.CONFIRMED, first)
            coordinator = first._consumer._coordinator
            coordinator._disable_heartbeat()  # what a broker outage does to it: no answer
            await until("in doubt", lambda: first.membership() is Membership.IN_DOUBT)
            # Meanwhile the group drops it (its session expires) and gives a newcomer everything;
            # the first member has not polled since, so it still believes it owns its partitions.
            second = await backend.subscribe(group, [AGENT_ACTIONS.name], from_beginning=True)
            await until(
                "the second member owns every partition", lambda: len(second.assignment()) == num_partitions, second
            )
            assert len(first.assignment()) == num_partitions
            assert first.membership() is Membership.IN_DOUBT
            coordinator._enable_heartbeat()  # the broker answers again: unknown member
            await until("lost", lambda: first.membership() is Membership.LOST)
            assert len(first.assignment()) == num_partitions  # still unknown to its own view
        finally:
            await first.close()
            if second is not None:
                await second.close()
            await backend.close()

    asyncio.run(scenario())


def test_records_handed_over_land_before_the_member_gives_its_partitions_up(
    kafka_bootstrap: str, namespace: str
) -> None:
    """The group hands a member's partitions to another only once the member rejoined (or was
    dropped). A record of its own still in the producer would land after the successor read
    the partition's tails: a second writer of a chain. So the member takes its partitions back
    from its writers first (a writer holding ``writing()`` is waited for; after, membership is
    LOST and no writer hands a record over), and its records land or fail before it rejoins."""
    ensure_topics(f"kafka://{kafka_bootstrap}", namespace=namespace)

    async def scenario() -> None:
        # A record waits up to 500 ms in the producer for its batch to fill: in flight for long.
        backend = KafkaBackend(kafka_bootstrap, namespace=namespace, linger_ms=500, bounded_delivery=True)
        await backend.start()
        member = await backend.subscribe(f"fence-{uuid.uuid4().hex[:6]}", [AGENT_ACTIONS.name], from_beginning=True)
        assert isinstance(member, KafkaSubscription)
        try:
            num_partitions = await backend.num_partitions()
            await until("the member owns every partition", lambda: len(member.assignment()) == num_partitions, member)
            before = await backend.end_offsets(AGENT_ACTIONS.name)
            with member.writing():  # a writer handing a record over
                produced = await backend.produce(AGENT_ACTIONS.name, [OutRecord(0, b"fence", b"in flight")])
                # The group takes the partitions back (kafka-python calls this inside a poll).
                revoke = asyncio.ensure_future(asyncio.to_thread(member.on_partitions_revoked, []))
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
