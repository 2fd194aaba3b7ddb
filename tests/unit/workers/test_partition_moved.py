"""Work under way when its session's partition moves away is not appended by the old owner.

The chaos bench (200 sessions, 100 faults) ended with one session stuck: planner-1 was
retrying an engine call for it when the partition moved to planner-0, which replayed it
and went on; planner-1's call then returned and it appended the LLM call's completion
into a chain planner-0 was writing. Two writers gave the chain a seq twice, and every
reader set aside planner-0's later records (its tool proposal): the session never moved
again. The old owner's append must be refused instead.
"""

from __future__ import annotations

import asyncio

import pytest

from log import SharedLog
from log.backend import Membership
from log.memory_backend import MemoryBackend, MemoryStore
from schemas import events as ev
from workers.runtime import MEMBERSHIP_POLL_S, SessionWorker
from workers.worker import PartitionMoved

pytestmark = pytest.mark.unit

STARTED = ev.SessionStarted(program="script", args_json="{}")


def test_an_append_for_a_session_whose_partition_moved_away_is_refused_until_it_is_back() -> None:
    async def scenario() -> None:
        store = MemoryStore()
        admin = MemoryBackend(store)
        await admin.start()
        await admin.create_topics(2)
        async with (
            SharedLog(MemoryBackend(store), actor="planner") as log,
            SharedLog(MemoryBackend(store), actor="planner") as other_log,
        ):
            session = next(s for s in (f"s{i}" for i in range(100)) if log.partition_for(s) == 1)
            worker = SessionWorker(log, group="planner")
            worker.topics = ("agent.actions",)
            worker.consumer = consumer = await worker.open_consumer()
            await worker.handle(await consumer.poll(0.0))
            other = await other_log.consumer("planner", ["agent.actions"], from_beginning=True).start()
            await worker.handle(await consumer.poll(0.0))  # the memory group gives partition 1 to the other
            await other.poll(0.0)
            assert (("agent.actions", 1)) in other.assignment()
            ends = await log.end_offsets("agent.actions")
            with pytest.raises(PartitionMoved, match=f"partition 1 of session {session}"):
                await worker.append(session, STARTED, kind="start")
            assert await log.end_offsets("agent.actions") == ends  # nothing written
            assert session not in worker.sessions  # nor folded
            await other.close()
            await worker.handle(await consumer.poll(0.0))  # partition 1 is back
            await worker.append(session, STARTED, kind="start")
            assert (await log.end_offsets("agent.actions"))[1] == ends[1] + 1
            await consumer.close()

    asyncio.run(asyncio.wait_for(scenario(), timeout=10))


def test_an_append_waits_while_the_group_has_not_confirmed_this_member_and_is_refused_once_it_must_rejoin() -> None:
    """A member whose membership is in doubt (no heartbeat answered: a broker outage) may have
    been dropped, its partitions given to another member that writes their chains: its append
    waits for the group's word; a member that must rejoin gives the work up (the rejoin hands
    every partition over again, and their owner replays the session and does it)."""

    async def scenario() -> None:
        store = MemoryStore()
        admin = MemoryBackend(store)
        await admin.start()
        await admin.create_topics(2)
        async with SharedLog(MemoryBackend(store), actor="planner") as log:
            session = next(s for s in (f"s{i}" for i in range(100)) if log.partition_for(s) == 1)
            worker = SessionWorker(log, group="planner")
            worker.topics = ("agent.actions",)
            worker.consumer = consumer = await worker.open_consumer()
            await worker.handle(await consumer.poll(0.0))
            membership = [Membership.IN_DOUBT]
            consumer.membership = lambda: membership[0]  # type: ignore[method-assign]
            ends = await log.end_offsets("agent.actions")

            appending = asyncio.create_task(worker.append(session, STARTED, kind="start"))
            for _ in range(5):
                await asyncio.sleep(MEMBERSHIP_POLL_S)
            assert not appending.done() and await log.end_offsets("agent.actions") == ends
            membership[0] = Membership.CONFIRMED  # the heartbeat was answered: still ours
            await appending
            assert (await log.end_offsets("agent.actions"))[1] == ends[1] + 1

            membership[0] = Membership.IN_DOUBT
            appending = asyncio.create_task(worker.append(session, STARTED, kind="again"))
            await asyncio.sleep(2 * MEMBERSHIP_POLL_S)
            membership[0] = Membership.LOST  # the group dropped this member meanwhile
            with pytest.raises(PartitionMoved, match="must rejoin"):
                await appending
            assert (await log.end_offsets("agent.actions"))[1] == ends[1] + 1  # nothing more written
            await consumer.close()

    asyncio.run(asyncio.wait_for(scenario(), timeout=10))
