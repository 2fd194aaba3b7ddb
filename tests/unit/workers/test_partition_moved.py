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
import logging
from collections.abc import Sequence

import pytest

from log import SharedLog
from log.backend import Membership, OutRecord
from log.consumer import EventConsumer
from log.errors import BackendUnavailable
from log.memory_backend import MemoryBackend, MemoryStore
from log.types import Position
from schemas import events as ev
from workers import runtime
from workers.runtime import MEMBERSHIP_POLL_S, SessionWorker
from workers.worker import PartitionMoved

pytestmark = pytest.mark.unit

STARTED = ev.SessionStarted(program="script", args_json="{}")


async def _store_with_topics() -> MemoryStore:
    """A memory log of two partitions per topic (sessions of partition 1 are tested)."""
    store = MemoryStore()
    admin = MemoryBackend(store)
    await admin.start()
    await admin.create_topics(2)
    return store


def test_an_append_for_a_session_whose_partition_moved_away_is_refused_until_it_is_back() -> None:
    async def scenario() -> None:
        store = await _store_with_topics()
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
        store = await _store_with_topics()
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


def test_an_append_waiting_for_the_groups_word_asks_to_hear_it() -> None:
    """librdkafka hands a member its group's reports inside a poll only, and an append waiting
    for CONFIRMED may be what holds the worker's next poll up: the wait asks the consumer to
    hear the group (``EventConsumer.refresh_membership``) instead of only looking again."""

    async def scenario() -> None:
        store = await _store_with_topics()
        async with SharedLog(MemoryBackend(store), actor="planner") as log:
            worker, consumer, session = await _worker_on_partition_1(log)
            refreshed: list[int] = []

            async def refresh() -> None:
                refreshed.append(1)

            # The group's word arrives only with a refresh (as librdkafka's with a poll).
            consumer.membership = lambda: Membership.CONFIRMED if refreshed else Membership.IN_DOUBT  # type: ignore[method-assign]
            consumer.refresh_membership = refresh  # type: ignore[method-assign]
            ends = await log.end_offsets("agent.actions")
            await worker.append(session, STARTED, kind="start")
            assert refreshed and (await log.end_offsets("agent.actions"))[1] == ends[1] + 1
            await consumer.close()

    asyncio.run(asyncio.wait_for(scenario(), timeout=10))


async def _worker_on_partition_1(log: SharedLog) -> tuple[SessionWorker, EventConsumer, str]:
    session = next(s for s in (f"s{i}" for i in range(100)) if log.partition_for(s) == 1)
    worker = SessionWorker(log, group="planner")
    worker.topics = ("agent.actions",)
    worker.consumer = consumer = await worker.open_consumer()
    await worker.handle(await consumer.poll(0.0))
    return worker, consumer, session


def test_the_group_is_asked_again_when_the_records_are_handed_over() -> None:
    """The look before an append can be a partition load old (a re-read of the partition comes
    between it and the hand-over): the fence looks again while the log hands the records over.
    Whatever the group said meanwhile decides: LOST refuses the append (nothing written),
    IN_DOUBT sends it back to wait for the group's word."""

    async def scenario() -> None:
        store = await _store_with_topics()
        async with SharedLog(MemoryBackend(store), actor="planner") as log:
            worker, consumer, session = await _worker_on_partition_1(log)
            ends = await log.end_offsets("agent.actions")
            # What each look at the membership answers, in order (then CONFIRMED).
            answers = [Membership.CONFIRMED, Membership.LOST]
            consumer.membership = lambda: answers.pop(0) if answers else Membership.CONFIRMED  # type: ignore[method-assign]
            with pytest.raises(PartitionMoved, match="must rejoin"):
                await worker.append(session, STARTED, kind="start")
            assert await log.end_offsets("agent.actions") == ends  # nothing written
            assert session not in worker.sessions

            answers[:] = [Membership.CONFIRMED, Membership.IN_DOUBT, Membership.IN_DOUBT, Membership.CONFIRMED]
            await worker.append(session, STARTED, kind="start")
            assert not answers  # looked again before and while handing it over
            assert (await log.end_offsets("agent.actions"))[1] == ends[1] + 1  # once
            await consumer.close()

    asyncio.run(asyncio.wait_for(scenario(), timeout=10))


def test_an_append_not_delivered_is_tried_again_and_lands_once() -> None:
    """A fenced writer's producer gives a record up after 1.5 s (a broker away); it may or may
    not have landed. The append asks the group again, the log re-reads the partition, and the
    record is sent again unless it is there (same event id): one record either way."""

    class Flaky(MemoryBackend):
        def __init__(self, store: MemoryStore) -> None:
            super().__init__(store)
            self.outcomes: list[str] = []  # of the next produce calls: "landed" or "lost", both reported failed

        async def produce(self, topic: str, records: Sequence[OutRecord]) -> asyncio.Future[list[Position]]:
            outcome = self.outcomes.pop(0) if self.outcomes else "ok"
            if outcome == "ok":
                return await super().produce(topic, records)
            if outcome == "landed":
                await (await super().produce(topic, records))
            failed: asyncio.Future[list[Position]] = asyncio.get_running_loop().create_future()
            failed.set_exception(BackendUnavailable(f"producing to {topic} failed: KafkaTimeoutError"))
            return failed

    async def scenario() -> None:
        store = await _store_with_topics()
        backend = Flaky(store)
        async with SharedLog(backend, actor="planner") as log:
            worker, consumer, session = await _worker_on_partition_1(log)
            ends = await log.end_offsets("agent.actions")
            backend.outcomes = ["lost", "landed"]
            await worker.append(session, STARTED, kind="start")
            assert not backend.outcomes  # tried three times
            assert (await log.end_offsets("agent.actions"))[1] == ends[1] + 1  # landed once
            history = await log.history(session, ["agent.actions"])
            assert [e.seq for e in history] == [0]
            await consumer.close()

    asyncio.run(asyncio.wait_for(scenario(), timeout=10))


def test_an_append_waits_until_a_new_assignment_has_reached_the_log() -> None:
    """A rebalance completes inside the subscription's poll (on its thread); until that poll
    returns, the log has not been told that the partitions moved (another member may have
    written their chains meanwhile) and the worker's view of its partitions is stale. The fence
    holds the append back until the consumer has seen the new assignment."""

    async def scenario() -> None:
        store = await _store_with_topics()
        async with SharedLog(MemoryBackend(store), actor="planner") as log:
            worker, consumer, session = await _worker_on_partition_1(log)
            subscription = consumer._subscription
            assert subscription is not None
            ends = await log.end_offsets("agent.actions")
            subscription.assignments += 1  # a rebalance gave the same partitions back, unseen
            assert not consumer.assignment_seen()
            appending = asyncio.create_task(worker.append(session, STARTED, kind="start"))
            for _ in range(5):
                await asyncio.sleep(MEMBERSHIP_POLL_S)
            assert not appending.done() and await log.end_offsets("agent.actions") == ends
            await worker.handle(await consumer.poll(0.0))  # the poll tells the log
            assert consumer.assignment_seen()
            await appending
            assert (await log.end_offsets("agent.actions"))[1] == ends[1] + 1
            await consumer.close()

    asyncio.run(asyncio.wait_for(scenario(), timeout=10))


def test_an_append_that_waits_long_for_the_groups_word_says_so_and_what_it_waits_for(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The wait for the group's word has no bound of its own, and a chaos run ended with two
    sessions whose planner logged nothing for ten minutes (docs/reliability.md, "Open: two
    sessions never started on a new seed"): a wait that goes on says so, once per
    ``GROUP_WAIT_WARN_S``, with what it waits for (a membership not confirmed, or a new
    assignment the log has not seen), and the append lands once the wait is over."""
    monkeypatch.setattr(runtime, "GROUP_WAIT_WARN_S", 0.1)

    async def scenario() -> None:
        store = await _store_with_topics()
        async with SharedLog(MemoryBackend(store), actor="planner") as log:
            worker, consumer, session = await _worker_on_partition_1(log)
            ends = await log.end_offsets("agent.actions")
            membership = [Membership.IN_DOUBT]
            consumer.membership = lambda: membership[0]  # type: ignore[method-assign]
            seen = [True]
            consumer.assignment_seen = lambda: seen[0]  # type: ignore[method-assign]

            async def said(times: int, why: str) -> list[str]:
                """The waiting lines logged so far, once ``why`` is among them ``times`` times."""
                while True:
                    lines = [r.getMessage() for r in caplog.records if r.name == "workers.runtime"]
                    if sum(line.endswith(f"({why})") for line in lines) >= times:
                        return lines
                    await asyncio.sleep(0.01)

            with caplog.at_level(logging.WARNING, logger="workers.runtime"):
                appending = asyncio.create_task(worker.append(session, STARTED, kind="start"))
                in_doubt = await said(2, "the group's membership of it is in_doubt")  # said again, not once
                assert not appending.done() and await log.end_offsets("agent.actions") == ends
                membership[0], seen[0] = Membership.CONFIRMED, False  # confirmed; a rebalance not yet seen
                await said(1, "a new assignment has not reached the log yet")
                seen[0] = True
                await appending

            assert all(f"{worker.role}: an append for session {session} has waited" in m for m in in_doubt)
            assert (await log.end_offsets("agent.actions"))[1] == ends[1] + 1  # landed, once
            await consumer.close()

    asyncio.run(asyncio.wait_for(scenario(), timeout=10))
