"""log.rdkafka_backend: a member's commit the group does not answer holds up neither its caller
nor the member's polls (``COMMIT_WAIT_S``).

librdkafka bounds no commit: it waits for a group coordinator, and a consumer librdkafka left
without brokers never finds one again; a synchronous commit also holds every other call into the
consumer, the poll among them. A planner's loop waited in such a commit for good, and never polled
again, the poll being where the member notices it was stranded (docs/reliability.md, "A commit
that never returned"). A commit is asked asynchronously and its answer served by polls; here the
consumer answers a commit only when the test says so.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import pytest
from confluent_kafka import KafkaError, TopicPartition

from log.errors import BackendUnavailable
from log.rdkafka_backend import COMMIT_HELD_WARN_S, RdKafkaBackend, RdKafkaSubscription
from tests.unit.log.test_rdkafka_poll import Message

pytestmark = pytest.mark.unit

TOPIC = "agent.actions"


class Answering:
    """A consumer as ``join`` makes it, whose commits are answered (by its next poll) only when
    the test says so; a poll may also hand out the messages put in ``messages``."""

    def __init__(self, **config: Any) -> None:
        self.config = config
        self.commits: list[dict[int, int]] = []  # partition -> offset, per commit asked
        self.answers: list[KafkaError | None] = []  # served by the next poll, in order
        self.messages: list[Message] = []
        self.num_answered = 0
        self.answered_late = threading.Event()
        self.closed = False

    def subscribe(self, topics: list[str], *, on_assign: Any, on_revoke: Any) -> None:
        pass

    def commit(self, *, offsets: list[TopicPartition], asynchronous: bool) -> None:
        assert asynchronous, "a synchronous commit holds the consumer's every other call"
        self.commits.append({tp.partition: tp.offset for tp in offsets})

    def answer(self, error: KafkaError | None = None) -> None:
        self.answers.append(error)

    def poll(self, timeout: float) -> Message | None:
        while self.answers:
            self.config["on_commit"](self.answers.pop(0), [])
            self.num_answered += 1
        return self.messages.pop(0) if self.messages else None

    def consume(self, num_messages: int, timeout: float) -> list[Message]:
        taken, self.messages = self.messages[:num_messages], self.messages[num_messages:]
        return taken

    def close(self) -> None:
        # As librdkafka's: it waits for the answer to a commit in flight (here: for ``answered_late``).
        if len(self.commits) > self.num_answered:
            self.answered_late.wait()
        self.closed = True


class Backend(RdKafkaBackend):
    def __init__(self) -> None:
        super().__init__("127.0.0.1:1")
        self.made: list[Answering] = []

    def _consumer(self, **config: Any) -> Answering:
        self.made.append(Answering(**config))
        return self.made[-1]

    def cluster_answers(self, timeout_s: float = 5.0) -> bool:
        return True


def member(*partitions: int) -> tuple[RdKafkaSubscription, Answering]:
    backend = Backend()
    subscription = RdKafkaSubscription(backend, "planner", [TOPIC], from_beginning=True)
    subscription.join()
    subscription._assigned = frozenset((TOPIC, p) for p in partitions)
    return subscription, backend.made[-1]


async def until(what: str, done: Any) -> None:
    """Let the commit's task run until ``done()`` (its polls run in threads)."""
    for _ in range(10_000):
        if done():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"not {what}")


async def asked(consumer: Answering, count: int) -> None:
    await until(f"{count} commits asked", lambda: len(consumer.commits) >= count)


def wait(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    monkeypatch.setattr("log.rdkafka_backend.COMMIT_WAIT_S", seconds)


async def answered_commit(
    subscription: RdKafkaSubscription, consumer: Answering, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the member commits next (no new offsets: the held ones), answered."""
    wait(monkeypatch, 3600.0)  # answered within: never reached
    committing = asyncio.ensure_future(subscription.commit({}))
    await asked(consumer, len(consumer.commits) + 1)
    consumer.answer()
    await committing


def test_an_answered_commit_returns_and_a_failed_one_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    wait(monkeypatch, 3600.0)  # answered within: this test never reaches it
    subscription, consumer = member(0)

    async def scenario() -> None:
        committing = asyncio.ensure_future(subscription.commit({(TOPIC, 0): 5}))
        await asked(consumer, 1)
        consumer.answer()
        await committing
        failing = asyncio.ensure_future(subscription.commit({(TOPIC, 0): 6}))
        await asked(consumer, 2)
        consumer.answer(KafkaError(KafkaError.ILLEGAL_GENERATION, "generation moved on"))
        with pytest.raises(BackendUnavailable, match="commit of planner failed: ILLEGAL_GENERATION"):
            await failing

    asyncio.run(scenario())
    assert consumer.commits == [{0: 5}, {0: 6}]


def test_a_message_a_commit_polled_meanwhile_is_handed_out_by_the_next_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    wait(monkeypatch, 3600.0)
    subscription, consumer = member(0)

    async def scenario() -> None:
        consumer.messages.append(Message(TOPIC, 0, 41))
        committing = asyncio.ensure_future(subscription.commit({(TOPIC, 0): 41}))
        await asked(consumer, 1)
        await until("taken by the commit's polls", lambda: not consumer.messages)
        consumer.answer()
        await committing
        (record,) = await subscription.poll(0.1, 10)
        assert record.position.offset == 41

    asyncio.run(scenario())


def test_a_commit_without_an_answer_returns_and_the_next_offsets_wait_for_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The caller goes on after COMMIT_WAIT_S (and says so); commits meanwhile ask nothing of the
    consumer and keep their offsets, the latest of each partition, for the commit after it."""
    wait(monkeypatch, 0.05)  # the wait itself is tested: nothing answers in it
    subscription, consumer = member(0, 1)

    async def scenario() -> None:
        with caplog.at_level(logging.WARNING, logger="agentlog.rdkafka"):
            await subscription.commit({(TOPIC, 0): 5})  # returns unanswered
            assert "a commit has had no answer" in caplog.text
            await subscription.commit({(TOPIC, 0): 7, (TOPIC, 1): 2})
            assert "offsets held" not in caplog.text
            waiting = subscription._commit
            assert waiting is not None
            waiting.asked_at -= COMMIT_HELD_WARN_S  # a minute without an answer: said once a minute
            await subscription.commit({(TOPIC, 1): 3})
            await subscription.commit({})
            assert caplog.text.count("behind a commit without an answer") == 1  # said once in the minute
            assert consumer.commits == [{0: 5}]
            consumer.answer()
            await subscription.poll(0.1, 10)  # the member's polls serve the answer
            assert "the commit that had no answer was answered: committed" in caplog.text
        await answered_commit(subscription, consumer, monkeypatch)

    asyncio.run(scenario())
    assert consumer.commits == [{0: 5}, {0: 7, 1: 3}]


def test_offsets_of_a_partition_given_up_meanwhile_are_not_committed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Held back while a commit waited, then the partition moved: its new owner commits it."""
    wait(monkeypatch, 0.05)
    subscription, consumer = member(0, 1)

    async def scenario() -> None:
        await subscription.commit({(TOPIC, 0): 5})  # unanswered
        await subscription.commit({(TOPIC, 0): 6, (TOPIC, 1): 4})  # held
        subscription._assigned = frozenset({(TOPIC, 0)})  # a rebalance took partition 1
        consumer.answer()
        await subscription.poll(0.1, 10)
        await answered_commit(subscription, consumer, monkeypatch)

    asyncio.run(scenario())
    assert consumer.commits == [{0: 5}, {0: 6}]


def test_a_member_that_joins_again_does_not_wait_for_its_old_consumers_commit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A member left without brokers joins again with a new consumer (``_rejoin``): the old
    consumer's commit will never be answered, and the new one's commits do not wait for it."""
    wait(monkeypatch, 0.05)
    subscription, stuck = member(0)

    async def scenario() -> None:
        await subscription.commit({(TOPIC, 0): 5})  # unanswered
        await asyncio.to_thread(subscription._rejoin)  # returns: its close would wait for the answer
        assert subscription.rejoins == 1 and not stuck.closed
        fresh = subscription.backend.made[-1]  # type: ignore[attr-defined]
        subscription._assigned = frozenset({(TOPIC, 0)})  # its assignment
        wait(monkeypatch, 3600.0)
        committing = asyncio.ensure_future(subscription.commit({(TOPIC, 0): 9}))
        await asked(fresh, 1)
        fresh.answer()
        await committing
        assert fresh.commits == [{0: 9}]
        stuck.answered_late.set()
        await until("the stuck consumer closed", lambda: stuck.closed)

    asyncio.run(scenario())


def test_a_member_closes_without_waiting_for_a_commit_without_an_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    wait(monkeypatch, 0.05)
    subscription, consumer = member(0)
    answered, other = member(0)

    async def scenario() -> None:
        await subscription.commit({(TOPIC, 0): 5})  # unanswered
        await subscription.close()
        assert subscription._consumer is None and not consumer.closed
        consumer.answered_late.set()
        await until("closed", lambda: consumer.closed)
        wait(monkeypatch, 3600.0)
        committing = asyncio.ensure_future(answered.commit({(TOPIC, 0): 3}))
        await asked(other, 1)
        other.answer()
        await committing
        await answered.close()  # nothing in flight: closed before close returns
        assert other.closed

    asyncio.run(scenario())
