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
from log.backend import Membership
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
