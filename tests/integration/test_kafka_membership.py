"""A Kafka group member knows when the group may have given its partitions away, on both clients.

Kafka fences no producer: a member that the group dropped without its knowing (a broker outage
swallowed its heartbeats, then another member took its partitions) would go on appending to the
chains its successor now writes. The 1,000-session chaos run showed it: after a broker kill a
planner kept writing partition 3 while the restarted planner, alone in the group's next
generation, wrote it too (docs/reliability.md). ``Subscription.membership`` is what a writer
asks before it appends: CONFIRMED while heartbeats are answered, IN_DOUBT once none has been for
a third of the session timeout, LOST once the group says it must rejoin.

On kafka-python the member's heartbeat is stopped (as a broker outage stops it), a second member
joins and gets every partition once the first one's session expires, and the first one's
heartbeat comes back: the group's answer (unknown member) makes it LOST. librdkafka exposes no
heartbeat: its member reads the group's state from librdkafka's statistics
(``log.rdkafka_backend.group_word``); there the test's own broker is SIGSTOPped. On both, a
revocation waits for a writer's records to land. Every wait is for a state, never a time.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
import uuid
from collections.abc import Callable

import pytest
from confluent_kafka import TopicPartition
from kafka.structs import TopicPartition as KafkaTopicPartition

from cli.common import ensure_topics
from log.backend import Membership, OutRecord, Subscription
from log.kafka_backend import KafkaBackend, KafkaCluster, KafkaSubscription
from log.local_kafka import LocalKafkaBroker, free_ports
from log.rdkafka_backend import STATS_INTERVAL_MS, RdKafkaBackend, RdKafkaSubscription
from log.topics import AGENT_ACTIONS

pytestmark = pytest.mark.integration

STATE_WAIT_S = 60.0


async def until(what: str, done: Callable[[], bool], *members: Subscription) -> None:
    """Poll the members (their polls run the group protocol; librdkafka's also hand its reports
    over) until ``done``."""
    deadline = time.monotonic() + STATE_WAIT_S
    while not done():
        assert time.monotonic() < deadline, f"{what}: not after {STATE_WAIT_S:g} s"
        for member in members:
            await member.poll(0.1, 10)
        await asyncio.sleep(0.05)


async def started_member(bootstrap: str, namespace: str, group: str) -> tuple[RdKafkaBackend, RdKafkaSubscription]:
    """A started librdkafka backend, and a from-beginning member of ``group`` reading agent.actions."""
    backend = RdKafkaBackend(bootstrap, namespace=namespace)
    await backend.start()
    member = await backend.subscribe(group, [AGENT_ACTIONS.name], from_beginning=True)
    assert isinstance(member, RdKafkaSubscription)
    return backend, member


async def read_keys(member: Subscription, seen: set[bytes], keys: list[bytes]) -> None:
    """Poll ``member`` until every one of ``keys`` is in ``seen``, which the polls add to."""
    deadline = time.monotonic() + STATE_WAIT_S
    while not set(keys) <= seen:
        assert time.monotonic() < deadline, f"read {len(seen & set(keys))} of {len(keys)}"
        seen.update(record.key or b"" for record in await member.poll(0.2, 100))


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


def revoke(member: Subscription) -> None:
    """What the group's taking the partitions back runs in the member (inside a poll)."""
    if isinstance(member, KafkaSubscription):
        member.on_partitions_revoked([])
    else:
        assert isinstance(member, RdKafkaSubscription)
        member._on_revoke(member._consumer, [])


@pytest.mark.parametrize("backend_class", [KafkaBackend, RdKafkaBackend], ids=["kafka-python", "librdkafka"])
def test_records_handed_over_land_before_the_member_gives_its_partitions_up(
    backend_class: type[KafkaCluster], kafka_bootstrap: str, namespace: str
) -> None:
    """The group hands a member's partitions to another only once the member rejoined (or was
    dropped). A record of its own still in the producer would land after the successor read
    the partition's tails: a second writer of a chain. So the member takes its partitions back
    from its writers first (a writer holding ``writing()`` is waited for; after, membership is
    LOST and no writer hands a record over), and its records land or fail before it rejoins."""
    ensure_topics(f"kafka://{kafka_bootstrap}", namespace=namespace)

    async def scenario() -> None:
        # A record waits up to 500 ms in the producer for its batch to fill: in flight for long.
        backend = backend_class(kafka_bootstrap, namespace=namespace, linger_ms=500, bounded_delivery=True)
        await backend.start()
        member = await backend.subscribe(f"fence-{uuid.uuid4().hex[:6]}", [AGENT_ACTIONS.name], from_beginning=True)
        try:
            num_partitions = await backend.num_partitions()
            await until("the member owns every partition", lambda: len(member.assignment()) == num_partitions, member)
            await until("its membership is confirmed", lambda: member.membership() is Membership.CONFIRMED, member)
            before = await backend.end_offsets(AGENT_ACTIONS.name)
            with member.writing():  # a writer handing a record over
                produced = await backend.produce(AGENT_ACTIONS.name, [OutRecord(0, b"fence", b"in flight")])
                revoking = asyncio.ensure_future(asyncio.to_thread(revoke, member))
                await asyncio.sleep(0.05)
                assert not revoking.done()  # it waits for the writer
            await revoking
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
        backend, member = await started_member(kafka_bootstrap, namespace, f"refresh-{uuid.uuid4().hex[:6]}")
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


def test_a_commit_the_broker_does_not_answer_holds_up_neither_the_member_nor_the_offsets_after_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """librdkafka bounds no commit (log.rdkafka_backend.COMMIT_WAIT_S): with the test's own broker
    SIGSTOPped, a commit returns unanswered and the member polls on; the offsets committed meanwhile
    are held, and land with the first commit after the broker answers again."""
    monkeypatch.setattr("log.rdkafka_backend.COMMIT_WAIT_S", 1.0)  # the test waits it out twice
    with LocalKafkaBroker() as broker:
        ensure_topics(f"kafka://{broker.bootstrap_servers}", namespace="commit")
        pid = broker.pid
        assert pid is not None

        async def scenario() -> None:
            backend, member = await started_member(broker.bootstrap_servers, "commit", "commit")
            physical = backend.physical(AGENT_ACTIONS.name)
            try:
                keys = [f"k-{i}".encode() for i in range(10)]
                await (await backend.produce(AGENT_ACTIONS.name, [OutRecord(0, key, b"x") for key in keys]))
                await read_keys(member, set(), keys)
                await member.commit({(AGENT_ACTIONS.name, 0): 4})  # answered
                os.kill(pid, signal.SIGSTOP)
                try:
                    with caplog.at_level(logging.WARNING, logger="agentlog.rdkafka"):
                        await member.commit({(AGENT_ACTIONS.name, 0): 7})
                        assert "a commit has had no answer" in caplog.text
                    assert await member.poll(0.1, 10) == []  # the member polls on
                    await member.commit({(AGENT_ACTIONS.name, 0): 10})  # held while the first waits
                finally:
                    os.kill(pid, signal.SIGCONT)
                await until("the first commit answered", lambda: member._commit is None, member)
                await until("confirmed", lambda: member.membership() is Membership.CONFIRMED, member)
                await member.commit({})  # what the member commits next carries the held offsets
                reader = backend._consumer(**{"group.id": backend.physical("commit")})
                try:
                    (committed,) = await asyncio.to_thread(reader.committed, [TopicPartition(physical, 0)], 30)
                finally:
                    await asyncio.to_thread(reader.close)
                assert committed.offset == 10
            finally:
                await member.close()
                await backend.close()

        asyncio.run(scenario())


def test_on_kafka_python_too_a_commit_the_broker_does_not_answer_returns_and_its_offsets_go_with_the_next(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """kafka-python bounds a commit only by its request timeout (305 s), then raises into the worker:
    with the test's own broker SIGSTOPped, a commit returns after COMMIT_WAIT_S with a warning, the
    member polls on, and the offsets land with the first commit after the broker answers again."""
    monkeypatch.setattr("log.kafka_backend.COMMIT_WAIT_S", 1.0)  # the test waits it out twice
    with LocalKafkaBroker() as broker:
        ensure_topics(f"kafka://{broker.bootstrap_servers}", namespace="kpcommit")
        pid = broker.pid
        assert pid is not None

        async def scenario() -> None:
            backend = KafkaBackend(broker.bootstrap_servers, namespace="kpcommit")
            await backend.start()
            member = await backend.subscribe("commit", [AGENT_ACTIONS.name], from_beginning=True)
            assert isinstance(member, KafkaSubscription)
            try:
                keys = [f"k-{i}".encode() for i in range(10)]
                await (await backend.produce(AGENT_ACTIONS.name, [OutRecord(0, key, b"x") for key in keys]))
                await read_keys(member, set(), keys)
                await member.commit({(AGENT_ACTIONS.name, 0): 4})  # answered
                os.kill(pid, signal.SIGSTOP)
                try:
                    with caplog.at_level(logging.WARNING, logger="log.kafka_backend"):
                        await member.commit({(AGENT_ACTIONS.name, 0): 7})
                        assert "a commit had no answer in 1 s" in caplog.text
                    assert await member.poll(0.1, 10) == []  # the member polls on
                    await member.commit({(AGENT_ACTIONS.name, 0): 10})  # unanswered too: held
                    assert member._unsent == {(AGENT_ACTIONS.name, 0): 10}
                finally:
                    os.kill(pid, signal.SIGCONT)
                await until("confirmed", lambda: member.membership() is Membership.CONFIRMED, member)
                await member.commit({})  # what the member commits next carries the held offsets
                assert member._unsent == {}
                reader = backend._consumer(group_id=backend.physical("commit"))
                try:
                    physical = backend.physical(AGENT_ACTIONS.name)
                    committed = await asyncio.to_thread(reader.committed, KafkaTopicPartition(physical, 0))
                finally:
                    await asyncio.to_thread(reader.close)
                assert committed == 10
            finally:
                await member.close()
                await backend.close()

        asyncio.run(scenario())


@pytest.mark.slow
def test_a_member_whose_broker_is_killed_and_restarted_reads_on() -> None:
    """The test's own broker is SIGKILLed under a reading member, long enough for the group to
    revoke its partitions, and restarted on the same port and data: the member joins again and
    reads on, the records appended before and after. While the broker is down the member's
    probe of the cluster fails, so it keeps its consumer (``ORPHANED_AFTER_S``)."""
    with LocalKafkaBroker() as broker:
        ensure_topics(f"kafka://{broker.bootstrap_servers}", namespace="rejoin")

        async def append(keys: list[bytes]) -> None:
            backend = RdKafkaBackend(broker.bootstrap_servers, namespace="rejoin")  # a fresh one after the restart
            await backend.start()
            try:
                await (await backend.produce(AGENT_ACTIONS.name, [OutRecord(0, key, b"x") for key in keys]))
            finally:
                await backend.close()

        async def scenario() -> None:
            backend, member = await started_member(broker.bootstrap_servers, "rejoin", "rejoin")
            seen: set[bytes] = set()
            try:
                before = [f"before-{i}".encode() for i in range(10)]
                await append(before)
                await read_keys(member, seen, before)
                broker.kill()
                await until("its partitions revoked", lambda: member.membership() is Membership.LOST, member)
                await asyncio.to_thread(broker.start)
                after = [f"after-{i}".encode() for i in range(10)]
                await append(after)
                await read_keys(member, seen, after)
                assert len(member.assignment()) > 0
            finally:
                await member.close()
                await backend.close()

        asyncio.run(scenario())


def test_a_member_that_joins_again_with_a_new_consumer_reads_on(kafka_bootstrap: str, namespace: str) -> None:
    """What a member does once librdkafka has dropped every broker it knew
    (``log.rdkafka_backend.ORPHANED_AFTER_S``), on a real broker: the stuck consumer closed, a
    new one joins, is assigned every partition and reads them from the beginning (a
    from-beginning member), the records appended before and after. The state itself comes of a
    race in the broker's restart (a Metadata answer that lists no broker) and is not made on
    demand here: the unit tests drive the member into it, ``bench/rdkafka_orphans.py`` soaks it."""
    ensure_topics(f"kafka://{kafka_bootstrap}", namespace=namespace)

    async def scenario() -> None:
        backend, member = await started_member(kafka_bootstrap, namespace, f"rejoin-{uuid.uuid4().hex[:6]}")
        seen: set[bytes] = set()
        try:
            num_partitions = await backend.num_partitions()
            before = [f"before-{i}".encode() for i in range(10)]
            await (
                await backend.produce(
                    AGENT_ACTIONS.name, [OutRecord(i % num_partitions, k, b"x") for i, k in enumerate(before)]
                )
            )
            await read_keys(member, seen, before)
            stuck = member._consumer
            assert await asyncio.to_thread(backend.cluster_answers)
            await asyncio.to_thread(member._rejoin)
            assert member.rejoins == 1 and member._consumer is not stuck
            assert member.membership() is Membership.LOST and member.assignment() == set()
            seen.clear()
            after = [f"after-{i}".encode() for i in range(10)]
            await (
                await backend.produce(
                    AGENT_ACTIONS.name, [OutRecord(i % num_partitions, k, b"x") for i, k in enumerate(after)]
                )
            )
            await read_keys(member, seen, before + after)  # from the beginning again, as a new member of the group
            assert len(member.assignment()) == num_partitions
            await until("confirmed", lambda: member.membership() is Membership.CONFIRMED, member)
        finally:
            await member.close()
            await backend.close()

    asyncio.run(scenario())


def test_a_probe_of_a_cluster_that_is_not_there_says_so() -> None:
    (port,) = free_ports(1)
    assert not RdKafkaBackend(f"127.0.0.1:{port}").cluster_answers(timeout_s=1.0)
