"""A member the group dropped reads the partitions it gets back from where it begins them.

A CI-sized chaos run hung with six sessions "requested" and never planned: the broker was
paused past the planners' session timeout, and the run's Postgres restarted at the same
time. The planner the group had dropped saw no partitions for a few polls (its rejoin waited
for the group), then got its two back. Its consumer began them afresh at offset 0 (no mark:
Postgres was down), but kafka-python, which forgets a dropped member's positions, fetched
them from their committed offsets, the end: nothing more came, the partitions' positions
stayed 0, below the replay boundary, and the planner never caught them up.

Here that is on the real broker: a member reads and commits everything, the group drops it
(its heartbeat stopped, as an outage stops it, while a second member takes everything), it
sees no partitions while its rejoin waits for the second member, and it gets every partition
back when the second one leaves. It must read each one again from offset 0, whole.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from cli.common import ensure_topics
from log import open_log
from log.consumer import EventConsumer, StartAt
from log.kafka_backend import KafkaSubscription
from log.topics import AGENT_ACTIONS
from schemas.events import LLMCallStarted
from tests.integration.kafka_groups import one_session_per_partition

pytestmark = pytest.mark.integration

ACTIONS = AGENT_ACTIONS.name
POLLS = 600  # of 0.1 s: a bound on the group's steps, never waited out by a passing run


def started(turn: int) -> LLMCallStarted:
    return LLMCallStarted(
        call_id=f"llm-{turn}", turn=turn, engine_id="e", prompt_tokens=1, max_output_tokens=1, prompt_digest="d"
    )


async def no_mark(topic: str, partition: int) -> StartAt | None:
    return None  # what a worker's hook answers when it finds no mark: read the partition from 0


def test_a_dropped_member_reads_the_partitions_it_gets_back_from_offset_0(
    kafka_bootstrap: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # kafka-python's member: the outage is made by stopping its coordinator's heartbeats.
    monkeypatch.setenv("AGENTLOG_KAFKA_CLIENT", "python")
    url = f"kafka://{kafka_bootstrap}"
    ensure_topics(url, namespace=namespace)
    group = f"planner-{uuid.uuid4().hex[:6]}"

    async def scenario() -> None:
        async with (
            open_log(url, actor="planner", namespace=namespace) as log,
            open_log(url, actor="planner", namespace=namespace) as other,
        ):
            n = log.num_partitions
            sessions = one_session_per_partition(log, namespace)
            for session in sessions.values():
                for turn in range(3):
                    await log.append(session, started(turn))
            everything = sorted((s, turn) for s in sessions.values() for turn in range(3))
            ends = await log.end_offsets(ACTIONS)

            first = EventConsumer(log, group, [ACTIONS], from_beginning=True, start_at=no_mark)
            async with first:
                got: list[tuple[str, int]] = []
                for _ in range(POLLS):
                    got += [(e.session_id, e.seq) for e in await first.poll(0.1)]
                    if len(got) == len(everything):
                        break
                assert sorted(got) == everything
                await first.commit()  # as a worker commits what it handled: the committed offsets are the ends
                subscription = first._subscription
                assert isinstance(subscription, KafkaSubscription)
                coordinator = subscription._consumer._coordinator
                coordinator._disable_heartbeat()  # an outage: its heartbeats go unanswered
                async with other.consumer(group, [ACTIONS], from_beginning=True) as second:
                    for _ in range(POLLS):  # its session expires: the group gives the newcomer everything
                        await second.poll(0.1)
                        if len(second.assignment()) == n:
                            break
                    assert len(second.assignment()) == n
                    coordinator._enable_heartbeat()  # the group answers again: unknown member
                    for _ in range(POLLS):  # it rejoins; the group waits for the second member meanwhile
                        assert await first.poll(0.1) == []
                        if not first.assignment_at_poll():
                            break
                    assert not first.assignment_at_poll()
                # The second member left: the first gets every partition back, and reads each anew.
                again: list[tuple[str, int]] = []
                for _ in range(POLLS):
                    again += [(e.session_id, e.seq) for e in await first.poll(0.1)]
                    if len(again) >= len(everything) and len(first.assignment_at_poll()) == n:
                        break
                assert sorted(again) == everything
                assert {p: first.position(ACTIONS, p) for p in range(n)} == ends
                assert first.stats.num_dead_lettered == 0

    asyncio.run(asyncio.wait_for(scenario(), timeout=180))
