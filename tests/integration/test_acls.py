"""The broker, not only ``SharedLog``, enforces who writes and reads what (DESIGN.md sections 3-4).

A secure broker (SASL/PLAIN, StandardAuthorizer, deny by default) with the ACLs of
``log.acls``. ``SharedLog`` refuses a foreign topic client-side already; to show the
*broker* refuses, these tests produce with kafka-python directly or through
``KafkaBackend.produce``, and read end offsets as admin to see that nothing landed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import stat
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaConsumer, KafkaProducer
from kafka.errors import (
    ClusterAuthorizationFailedError,
    GroupAuthorizationFailedError,
    KafkaError,
    KafkaTimeoutError,
    TopicAuthorizationFailedError,
    TransactionalIdAuthorizationFailedError,
)
from kafka.net.compat import KafkaNetClient
from kafka.structs import TopicPartition

from log import SharedLog, topics
from log.acls import (
    ADMIN,
    ALL_TOPICS,
    BY_PRINCIPAL,
    PRINCIPALS,
    ROLES,
    admin_client,
    apply_acls,
    describe_acls,
    desired_acls,
    init_secure_log,
    missing_acls,
)
from log.backend import OutRecord
from log.errors import BackendUnavailable
from log.kafka_backend import KafkaBackend, security_config
from log.rdkafka_backend import RdKafkaBackend
from schemas import events as ev
from tests.conftest import SecureKafka
from tests.integration.produce_retry import produce_retrying
from tests.samples import sample

pytestmark = pytest.mark.integration

PARTITIONS = 2


@pytest.fixture
def ns(secure_kafka: SecureKafka, namespace: str) -> str:
    """A fresh namespace on the secure broker: its topics (created as admin) and its ACLs."""
    asyncio.run(
        init_secure_log(
            secure_kafka.bootstrap,
            secure_kafka.credentials.client_configs(ADMIN),
            namespace=namespace,
            num_partitions=PARTITIONS,
        )
    )
    return namespace


def backend(secure_kafka: SecureKafka, ns: str, principal: str) -> KafkaBackend:
    return KafkaBackend(
        secure_kafka.bootstrap, namespace=ns, client_config=secure_kafka.credentials.client_configs(principal)
    )


def produce_raw(
    secure_kafka: SecureKafka, principal: str, physical_topics: list[str], *, idempotent: bool = True
) -> dict[str, BaseException | None]:
    """Send one record to each topic as ``principal`` with plain kafka-python: topic -> error or None.

    A producer per topic: kafka-python's idempotent producer takes an authorization error
    as fatal and refuses every later send, to any topic.
    """
    outcome: dict[str, BaseException | None] = {}
    for t in physical_topics:
        producer = KafkaProducer(
            **secure_kafka.credentials.client_kwargs(principal),
            acks="all",
            enable_idempotence=idempotent,
            max_block_ms=10_000,
        )
        try:
            producer.send(t, key=b"s-1", value=b"forged").get(timeout=15)
        except KafkaError as e:
            outcome[t] = e
        else:
            outcome[t] = None
        finally:
            producer.close(timeout=5)
    return outcome


def end_offsets(secure_kafka: SecureKafka, ns: str) -> dict[str, int]:
    """Records per logical topic, read as admin."""
    consumer = KafkaConsumer(**secure_kafka.credentials.client_kwargs(ADMIN))
    try:
        tps = [TopicPartition(f"{ns}.{t}", p) for t in ALL_TOPICS for p in range(PARTITIONS)]
        ends = consumer.end_offsets(tps)
    finally:
        consumer.close()
    totals = dict.fromkeys(ALL_TOPICS, 0)
    for tp, offset in ends.items():
        totals[tp.topic.removeprefix(f"{ns}.")] += offset
    return totals


@pytest.fixture
def admin(secure_kafka: SecureKafka) -> Iterator[Any]:
    client = admin_client(secure_kafka.bootstrap, secure_kafka.credentials.client_configs(ADMIN))
    try:
        yield client
    finally:
        client.close()


# ---------------------------------------------------------------------------- the table


def test_write_acls_follow_topic_owners_and_reads_follow_the_workers() -> None:
    grants = desired_acls("ns")
    for g in grants:
        assert g.principal != ADMIN  # the super user needs none
        if g.resource_type == "TOPIC" and g.operation == "WRITE":
            owner = topics.topic(g.name.removeprefix("ns.")).owner
            assert owner in (g.principal, topics.ANY_ACTOR), g
        if g.resource_type == "GROUP" and g.pattern == "LITERAL" and g.operation == "READ":
            assert g.name == f"ns.{g.principal}", g  # its own group; librdkafka's scan group: DESCRIBE only
        if g.resource_type == "GROUP" and g.operation == "DESCRIBE":
            assert (g.name, g.pattern) == ("ns.agentlog-scan", "LITERAL"), g
    assert {t.owner for t in topics.TOPICS} - {topics.ANY_ACTOR} <= set(BY_PRINCIPAL)
    assert not [g for g in grants if g.principal == "auditor" and g.operation == "WRITE"]
    assert set(PRINCIPALS) == {ADMIN, *BY_PRINCIPAL}
    # Nothing that ends in a cluster-wide or wildcard grant.
    assert all(g.resource_type != "CLUSTER" and "*" not in g.name for g in grants)

    from workers.decider import DeciderWorker
    from workers.executor import ExecutorWorker
    from workers.gateway import GatewayWorker
    from workers.planner import PlannerWorker

    for worker in (PlannerWorker, DeciderWorker, ExecutorWorker, GatewayWorker):
        role = BY_PRINCIPAL[worker.role]
        assert set(worker.topics) <= set(role.reads), worker.role
        assert worker.role in role.groups
    # Both routers scan the engines' kv.events and the cache manager's kv.decisions (workers/cache_view.py).
    for principal in ("planner", "gateway"):
        assert {"kv.events", "kv.decisions"} <= set(BY_PRINCIPAL[principal].reads), principal


def test_acls_on_the_broker_are_the_desired_ones_and_apply_is_idempotent(ns: str, admin: Any) -> None:
    assert describe_acls(admin, ns) == desired_acls(ns)
    apply_acls(admin, ns)
    assert describe_acls(admin, ns) == desired_acls(ns)
    assert missing_acls(admin, ns) == []


# ---------------------------------------------------------------------------- writes


@pytest.mark.parametrize(
    ("principal", "topic"),
    [
        ("planner", "agent.effects"),
        ("planner", "agent.verdicts"),
        ("executor", "agent.verdicts"),
        ("decider", "agent.effects"),
        ("engine-bridge", "kv.decisions"),
        ("cache-manager", "kv.events"),
        ("projector", "agent.actions"),
        ("operator", "agent.verdicts"),
    ],
)
def test_the_broker_refuses_a_foreign_topic(secure_kafka: SecureKafka, ns: str, principal: str, topic: str) -> None:
    outcome = produce_raw(secure_kafka, principal, [f"{ns}.{topic}"])
    assert isinstance(outcome[f"{ns}.{topic}"], TopicAuthorizationFailedError)
    assert end_offsets(secure_kafka, ns) == dict.fromkeys(ALL_TOPICS, 0)


def test_planner_forging_effects_and_verdicts_through_the_backend_lands_nothing(
    secure_kafka: SecureKafka, ns: str
) -> None:
    async def main() -> None:
        for offset, topic in enumerate(("agent.effects", "agent.verdicts")):
            planner = backend(secure_kafka, ns, "planner")
            await planner.start()
            try:
                with pytest.raises(BackendUnavailable, match="TopicAuthorizationFailedError"):
                    await (await planner.produce(topic, [OutRecord(0, b"s-1", b"forged")]))
                # kafka-python's idempotent producer treats the refusal as fatal (it would refuse
                # the planner's own topic too): the backend replaces it, and its own topic works.
                position = await produce_retrying(planner, "agent.actions", OutRecord(0, b"s-1", b"ok"))
                assert position.offset == offset
            finally:
                await planner.close()

    asyncio.run(main())
    assert end_offsets(secure_kafka, ns) == {**dict.fromkeys(ALL_TOPICS, 0), "agent.actions": 2}


def test_every_principal_writes_exactly_its_own_topics(secure_kafka: SecureKafka, ns: str) -> None:
    expected_counts = dict.fromkeys(ALL_TOPICS, 0)
    physical = [f"{ns}.{t}" for t in ALL_TOPICS]
    with ThreadPoolExecutor(len(ROLES)) as pool:
        outcomes = list(pool.map(lambda role: produce_raw(secure_kafka, role.principal, physical), ROLES))
    for role, outcome in zip(ROLES, outcomes, strict=True):
        for t in ALL_TOPICS:
            error = outcome[f"{ns}.{t}"]
            if t in role.writes:
                assert error is None, (role.principal, t, error)
                expected_counts[t] += 1
            elif role.read_only:
                # No WRITE anywhere: the broker refuses even a producer id (InitProducerId).
                assert isinstance(error, KafkaError) and "ClusterAuthorizationFailedError" in str(error)
            else:
                assert isinstance(error, TopicAuthorizationFailedError), (role.principal, t, error)
    assert end_offsets(secure_kafka, ns) == expected_counts
    assert expected_counts["agent.dlq"] == len(ROLES) - 1  # everyone but the auditor


def test_writers_use_transactional_ids_of_their_own_prefix_only(secure_kafka: SecureKafka, ns: str) -> None:
    def init(principal: str, transactional_id: str) -> None:
        producer = KafkaProducer(
            **secure_kafka.credentials.client_kwargs(principal), transactional_id=transactional_id, max_block_ms=10_000
        )
        try:
            producer.init_transactions()
        finally:
            producer.close(timeout=5)

    init("planner", f"{ns}.planner-0")
    with pytest.raises(TransactionalIdAuthorizationFailedError):
        init("planner", f"{ns}.decider-0")


# ---------------------------------------------------------------------------- reads


async def _seed_one_event_per_topic(secure_kafka: SecureKafka, ns: str) -> None:
    """Each topic's owner appends one valid event through SharedLog (the DLQ: the projector)."""
    for t in topics.TOPICS:
        owner = "projector" if t.owner == topics.ANY_ACTOR else t.owner
        async with SharedLog(backend(secure_kafka, ns, owner), actor=owner) as log:
            await log.append(f"s-{t.name}", sample(t.bodies[0]))


def test_auditor_reads_every_topic_and_writes_none(secure_kafka: SecureKafka, ns: str) -> None:
    async def read_all() -> list[str]:
        await _seed_one_event_per_topic(secure_kafka, ns)
        seen: list[str] = []
        async with (
            SharedLog(backend(secure_kafka, ns, "auditor"), actor="auditor") as log,
            log.consumer(f"logctl-audit-{uuid.uuid4().hex[:8]}", ALL_TOPICS, from_beginning=True) as consumer,
        ):
            for _ in range(30):
                seen += [e.position.topic for e in await consumer.poll(1.0)]
                if len(seen) >= len(ALL_TOPICS):
                    break
            await consumer.commit()
            assert consumer.stats.num_dead_lettered == 0
        return seen

    assert sorted(asyncio.run(read_all())) == sorted(ALL_TOPICS)
    before = end_offsets(secure_kafka, ns)
    assert before == dict.fromkeys(ALL_TOPICS, 1)

    physical = [f"{ns}.{t}" for t in ALL_TOPICS]
    refused = produce_raw(secure_kafka, "auditor", physical, idempotent=False)
    assert all(isinstance(refused[t], TopicAuthorizationFailedError) for t in physical), refused
    refused = produce_raw(secure_kafka, "auditor", physical)  # as KafkaBackend produces: idempotent
    assert all(isinstance(e, KafkaError) and "ClusterAuthorizationFailedError" in str(e) for e in refused.values())
    assert end_offsets(secure_kafka, ns) == before


def test_the_gateway_reads_kv_events_and_decisions_as_the_planners_views_do(secure_kafka: SecureKafka, ns: str) -> None:
    """The gateway routes by the planner's views (workers/cache_view.py: scans, no group): its principal
    reads both topics; one without the READ (the decider) reads nothing, and no error comes out of the view."""
    from workers.cache_view import CacheDecisions, KVEvents

    async def main() -> None:
        await _seed_one_event_per_topic(secure_kafka, ns)
        async with SharedLog(backend(secure_kafka, ns, "gateway"), actor="gateway") as log:
            kv, decisions = KVEvents(log), CacheDecisions(log)
            await kv.wait_caught_up()
            assert kv.caught_up and kv.num_events == 1
            await decisions.refresh(log.partition_for("s-kv.decisions"))
            assert len(decisions._latest) == 1
        async with SharedLog(backend(secure_kafka, ns, "decider"), actor="decider") as log:
            kv = KVEvents(log)
            await kv.wait_caught_up()  # refused: logged, not raised
            await kv.refresh()
            assert kv.num_events == 0 and kv.holding("s-kv.events", ["sim-0"]) == {}

    asyncio.run(main())


def test_planner_appends_to_actions_and_consumes_as_its_group(secure_kafka: SecureKafka, ns: str, admin: Any) -> None:
    async def main() -> None:
        async with SharedLog(backend(secure_kafka, ns, "planner"), actor="planner") as log:
            position = await log.append("s-1", ev.SessionStarted(program="trace", args_json="{}"))
            assert position.topic == "agent.actions"
            # A static member (the workers' instance id), like workers/runtime.py.
            topics_read = ("agent.actions", "agent.verdicts", "agent.effects", "ops.commands")
            async with log.consumer("planner", topics_read, from_beginning=True, instance_id="planner-1") as consumer:
                events = []
                for _ in range(20):
                    events += await consumer.poll(1.0)
                    if events:
                        break
                assert [e.position for e in events] == [position]
                await consumer.commit()

    asyncio.run(main())
    committed = admin.list_group_offsets(f"{ns}.planner")[f"{ns}.planner"]
    assert sum(o.offset for tp, o in committed.items() if tp.topic == f"{ns}.agent.actions") == 1


@pytest.mark.parametrize(
    ("principal", "group", "topic", "error"),
    [
        ("planner", "decider", "agent.actions", GroupAuthorizationFailedError),  # another role's group
        ("decider", "planner", "agent.actions", GroupAuthorizationFailedError),
        ("engine-bridge", "logctl-tail-x", "kv.events", GroupAuthorizationFailedError),  # logctl's prefix
        ("planner", "planner", "agent.dlq", TopicAuthorizationFailedError),  # its group, a topic it may not read
        ("engine-bridge", "engine-bridge", "agent.actions", TopicAuthorizationFailedError),
    ],
)
def test_the_broker_refuses_foreign_groups_and_topics_to_consumers(
    secure_kafka: SecureKafka, ns: str, principal: str, group: str, topic: str, error: type[Exception]
) -> None:
    async def main() -> None:
        b = backend(secure_kafka, ns, principal)
        subscription = await b.subscribe(group, [topic], from_beginning=True)
        try:
            with pytest.raises(error):
                for _ in range(10):
                    await subscription.poll(1.0, 10)
        finally:
            await subscription.close()
            await b.close()

    asyncio.run(main())


# ---------------------------------------------------------------------------- authentication


@contextlib.contextmanager
def _closing_failed_clients() -> Iterator[dict[str, Any]]:
    """A ``kafka_client`` factory that closes what it made at exit.

    A kafka-python client that fails to bootstrap raises from its constructor without
    closing its network client (and that client's socket pair), which would surface as a
    ResourceWarning in some later test.
    """
    made: list[Any] = []

    def factory(**config: Any) -> Any:
        made.append(KafkaNetClient(**config))
        return made[-1]

    try:
        yield {"kafka_client": factory}
    finally:
        for client in made:
            client.close()


@pytest.mark.parametrize("user", ["planner", "nobody"])
def test_a_wrong_password_is_refused_at_connect(secure_kafka: SecureKafka, user: str) -> None:
    good = {**secure_kafka.credentials.client_configs("planner"), "bootstrap_timeout_ms": 2000}
    bad = {**good, "sasl_plain_username": user, "sasl_plain_password": "not-" + good["sasl_plain_password"]}
    KafkaProducer(bootstrap_servers=secure_kafka.bootstrap, **good).close()  # the same settings connect
    # The broker refuses the SaslAuthenticate request (it answers "Invalid username or
    # password" or, racing its delayed close of connection.failed.authentication.delay.ms,
    # just closes the connection); kafka-python retries until its bootstrap timeout.
    with _closing_failed_clients() as closing, pytest.raises(KafkaTimeoutError, match="Unable to bootstrap"):
        KafkaProducer(bootstrap_servers=secure_kafka.bootstrap, **bad, **closing)

    async def via_backend() -> None:
        with _closing_failed_clients() as closing:
            b = KafkaBackend(secure_kafka.bootstrap, client_config={**bad, **closing})
            with pytest.raises(BackendUnavailable, match="Unable to bootstrap"):
                await b.start()

    asyncio.run(via_backend())


def test_no_principal_but_admin_may_create_topics_or_acls(secure_kafka: SecureKafka, ns: str) -> None:
    client = admin_client(secure_kafka.bootstrap, secure_kafka.credentials.client_configs("planner"))
    try:
        with pytest.raises(ClusterAuthorizationFailedError):
            apply_acls(client, f"{ns}x")
        with pytest.raises(TopicAuthorizationFailedError):
            client.create_topics({f"{ns}.evil": {"num_partitions": 1, "replication_factor": 1}})
    finally:
        client.close()


# ---------------------------------------------------------------------------- secrets


def test_passwords_are_private_and_reach_clients_through_the_environment(
    secure_kafka: SecureKafka, monkeypatch: pytest.MonkeyPatch
) -> None:
    creds = secure_kafka.credentials
    broker = secure_kafka.broker
    assert creds.path is not None
    private = [creds.path, broker.data_dir / "server.properties", *(creds.password_file(p) for p in PRINCIPALS)]
    for path in private:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE(creds.password_file(ADMIN).parent.stat().st_mode) == 0o700
    assert all(pw not in repr(creds) + repr(broker.credentials) for pw in creds.passwords.values())

    passwords = [pw.encode() for pw in creds.passwords.values()]
    assert len(set(passwords)) == len(PRINCIPALS)
    assert broker.pid is not None
    proc = Path(f"/proc/{broker.pid}/cmdline")
    cmdline = proc.read_bytes() if proc.exists() else b""
    log_text = broker.log_file.read_bytes()
    assert not [pw for pw in passwords if pw in cmdline or pw in log_text]

    for key, value in creds.env("executor").items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AGENTLOG_KAFKA_PASSWORD", raising=False)
    assert security_config() == creds.client_configs("executor")


# ---------------------------------------------------------------------------- the librdkafka client
# The same grants seen through log.rdkafka_backend: the broker refuses what a role does not own,
# and the backend says so instead of retrying forever (librdkafka retries most errors itself).


def rd_backend(secure_kafka: SecureKafka, ns: str, principal: str) -> RdKafkaBackend:
    return RdKafkaBackend(
        secure_kafka.bootstrap, namespace=ns, client_config=secure_kafka.credentials.client_configs(principal)
    )


def test_rdkafka_planner_forging_effects_and_verdicts_is_refused_and_lands_nothing(
    secure_kafka: SecureKafka,
    ns: str,
) -> None:
    async def main() -> None:
        for topic in ("agent.effects", "agent.verdicts"):
            planner = rd_backend(secure_kafka, ns, "planner")
            await planner.start()
            try:
                with pytest.raises(BackendUnavailable, match="TOPIC_AUTHORIZATION_FAILED"):
                    await (await planner.produce(topic, [OutRecord(0, b"s-1", b"forged")]))
            finally:
                await planner.close()
        planner = rd_backend(secure_kafka, ns, "planner")
        await planner.start()
        try:
            (position,) = await (await planner.produce("agent.actions", [OutRecord(0, b"s-1", b"ok")]))
            assert position.offset == 0
        finally:
            await planner.close()

    asyncio.run(main())
    assert end_offsets(secure_kafka, ns) == {**dict.fromkeys(ALL_TOPICS, 0), "agent.actions": 1}


@pytest.mark.parametrize(
    ("principal", "group", "topic", "error"),
    [
        ("planner", "decider", "agent.actions", "GROUP_AUTHORIZATION_FAILED"),  # another role's group
        ("planner", "planner", "agent.dlq", "TOPIC_AUTHORIZATION_FAILED"),  # its group, a topic it may not read
    ],
)
def test_rdkafka_consumer_of_a_foreign_group_or_topic_is_refused(
    secure_kafka: SecureKafka,
    ns: str,
    principal: str,
    group: str,
    topic: str,
    error: str,
) -> None:
    async def main() -> None:
        b = rd_backend(secure_kafka, ns, principal)
        subscription = await b.subscribe(group, [topic], from_beginning=True)
        try:
            with pytest.raises(BackendUnavailable, match=error):
                for _ in range(10):
                    await subscription.poll(1.0, 10)
        finally:
            await subscription.close()
            await b.close()

    asyncio.run(main())


def test_rdkafka_wrong_password_is_refused_at_start(secure_kafka: SecureKafka) -> None:
    config = {**secure_kafka.credentials.client_configs("planner"), "sasl_plain_password": "wrong"}
    b = RdKafkaBackend(secure_kafka.bootstrap, client_config=config)
    with pytest.raises(BackendUnavailable, match="cannot reach Kafka"):
        asyncio.run(b.start())


@pytest.mark.parametrize("principal", ["planner", "operator"])
def test_rdkafka_scanners_may_look_up_their_groups_coordinator(
    secure_kafka: SecureKafka, ns: str, principal: str
) -> None:
    """librdkafka's scanners name a group (the client requires one) and look its coordinator up,
    which needs DESCRIBE on it: without the grant a scan failed whenever that answer came first
    (the compose stack's ``logctl run``). Asked here directly, as the scanner's client asks it,
    and a whole scan through the backend."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient  # type: ignore[attr-defined]

    from log.kafka_backend import SCAN_GROUP
    from log.rdkafka_backend import rdkafka_config

    config = {
        "bootstrap.servers": secure_kafka.bootstrap,
        **rdkafka_config(secure_kafka.credentials.client_configs(principal)),
    }
    admin = AdminClient(config)
    coordinator_moving = {
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError.NOT_COORDINATOR,
    }

    def describe(group: str) -> Any:
        """The group's description, asked again while its coordinator is still loading."""
        deadline = time.monotonic() + 60
        while True:
            (answer,) = admin.describe_consumer_groups([group]).values()
            try:
                return answer.result(timeout=30)
            except KafkaException as e:
                if e.args[0].code() not in coordinator_moving or time.monotonic() > deadline:
                    raise

    assert describe(f"{ns}.{SCAN_GROUP}").group_id == f"{ns}.{SCAN_GROUP}"  # no GROUP_AUTHORIZATION_FAILED
    with pytest.raises(KafkaException, match="GROUP_AUTHORIZATION_FAILED"):
        describe(f"{ns}.decider")  # the ACLs still refuse what they do not grant

    async def scan() -> list[bytes]:
        await _seed_one_event_per_topic(secure_kafka, ns)
        b = rd_backend(secure_kafka, ns, principal)
        await b.start()
        try:
            return [r.value for p in range(PARTITIONS) async for r in b.scan("agent.actions", p)]
        finally:
            await b.close()

    assert len(asyncio.run(scan())) == 1


def test_rdkafka_auditor_reads_every_topic_and_its_one_append_is_refused(
    secure_kafka: SecureKafka, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A read-only role on librdkafka: reading logs nothing above INFO (the idempotent producer,
    which the auditor may not have, is made at the first append, not at start), and that
    append fails with the broker's refusal instead of hanging."""

    async def main() -> list[str]:
        await _seed_one_event_per_topic(secure_kafka, ns)
        seen: list[str] = []
        async with SharedLog(rd_backend(secure_kafka, ns, "auditor"), actor="auditor") as log:
            async with log.consumer(
                f"logctl-audit-{uuid.uuid4().hex[:8]}", ALL_TOPICS, from_beginning=True
            ) as consumer:
                for _ in range(30):
                    seen += [e.position.topic for e in await consumer.poll(1.0)]
                    if len(seen) >= len(ALL_TOPICS):
                        break
                await consumer.commit()
            assert [r for r in caplog.records if r.name.startswith("agentlog") and r.levelno > logging.INFO] == []
            backend = log.backend
            with pytest.raises(BackendUnavailable, match="AUTHORIZATION_FAILED"):
                await asyncio.wait_for(await backend.produce("agent.dlq", [OutRecord(0, b"s-1", b"x")]), 60)
        return seen

    caplog.set_level(logging.INFO, logger="agentlog")
    assert sorted(asyncio.run(main())) == sorted(ALL_TOPICS)
    assert end_offsets(secure_kafka, ns) == dict.fromkeys(ALL_TOPICS, 1)
