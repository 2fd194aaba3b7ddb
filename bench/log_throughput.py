"""Throughput of agentlog on Kafka, side by side with plain kafka-python on the same bytes.

Run::

    python -m bench.log_throughput [--events N] [--bootstrap HOST:PORT] [--partitions 4] [--json FILE]
                                   [--rounds K] [--secure-compare | --no-secure-compare]
                                   [--clients python rdkafka] [--poll-records 2000]

Without ``--bootstrap`` (and without ``KAFKA_BOOTSTRAP_SERVERS``) a local
single-node broker is started for the run and stopped afterwards.

Secure mode (``--secure-compare``, on by default when the bench starts its own
broker): the same rounds run a second time against a local *secure* broker
(SASL/PLAIN, StandardAuthorizer with the ACLs of ``log.acls``), and the table
gets secure columns and the secure/plaintext ratios. There the admin principal
creates each namespace's topics and applies its ACLs; the appending SharedLog
and the raw producer log in as ``planner``, the consuming ones as ``auditor``
in a group of the ``auditor`` prefix (``log.acls``: the only groups it may use).

What is measured, and why
-------------------------
agentlog adds typing, Avro encoding, SHA-256 hash chains and verification on
top of a Kafka client. The question is what that costs relative to the client
alone, so every agentlog number has a raw kafka-python counterpart that moves
*exactly the same record bytes* (same keys, same partitions, same producer
settings) and does nothing else:

- **append**: ``SharedLog.append_many`` of N pre-built drafts in batches of one
  topic (``agent.actions``), from the first call to the last acknowledgement;
  versus a ``KafkaProducer`` sending the record values that SharedLog wrote
  (read back from the log, so no encoding on the raw side), until ``flush()``.
- **consume**: an ``EventConsumer`` from the beginning, until N decoded and
  chain-verified events were delivered; versus a ``KafkaConsumer`` in a group
  of its own, until N raw records were polled (no decoding).
- **decode+verify**: ``Codec.decode`` and ``ChainVerifier.verify`` of the N
  record values in memory, with no I/O: the CPU ceiling of any consumer.

Events look like an agent session's ``agent.actions`` traffic: per turn an
``LLMCallStarted``, an ``LLMCallCompleted`` with a few hundred bytes of output
text and usually a ``ToolCallProposed`` with JSON arguments, interleaved over
about 1000 sessions. Every run uses fresh namespaces (topic prefixes), so runs
never see each other's data; its topics are deleted at the end.

Clients (``--clients``): agentlog's side runs once per Kafka client it can use
(``python``: kafka-python, ``log.kafka_backend``; ``rdkafka``: librdkafka,
``log.rdkafka_backend``, the default client of ``kafka://`` logs; both by default), each in a
namespace of its own, rows side by side (``append [rdkafka]``); the raw side is always kafka-python, once per round, on
the bytes the first client's SharedLog wrote. So every ratio is "agentlog on
that client / raw kafka-python on the same bytes", in one run.

Rounds and the goal (``--rounds K``, default 3): the measured round runs K times in a row, in
fresh namespaces each time, and the goal line (issue 16: append and consume each at least
``GOAL_RATIO`` of raw kafka-python) is decided on the *median* of the rounds' ratios per CPU
second, the wall-clock median printed beside it. One round's ratio moves by a tenth or more
with other work on the machine (raw kafka-python's own rate moves by a third between
rounds); a verdict on one round would be a coin toss near the line. The table above the
rounds is the first round's.

Fairness: a small warm-up round of every phase on both sides runs first, in
namespaces of its own (JVM JIT, page cache, the group coordinator, Python
imports). In each measured round agentlog appends first (raw needs its bytes)
and raw consumes first, so each side goes first once. The inputs are built
before any clock starts and frozen out of the garbage collector (``gc.freeze``)
so that the benchmark's own data does not slow collections down. The process runs
with the collector thresholds every worker process sets (``log.gc_tuning.tune_gc``),
and both sides share it.

Read the ratios with the CRC-32C line of the header: kafka-python checksums
every record batch, in pure Python unless the ``crc32c`` package is installed
(a dependency of agentlog since the cache manager's throughput work). Without
it that checksum dominates the raw side's cost on both paths and the ratios are
near 1; with it the raw client is about 3x faster and agentlog's own per-event
Python work (Avro, SHA-256, verification) sets the ratios (docs/benchmarks.md, "Log
throughput", for the latest numbers on each client).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import json
import math
import os
import platform
import random
import statistics
import sys
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import kafka
from kafka import KafkaConsumer, KafkaProducer
from kafka.admin import KafkaAdminClient
from kafka.errors import KafkaError
from kafka.record import util as kafka_record_util

from bench.broker import broker_address, given_address
from log import Draft, RawRecord, SharedLog, tune_gc
from log.acls import ADMIN, init_secure_log
from log.chain import ChainVerifier
from log.codec import Codec
from log.kafka_backend import KafkaBackend
from log.local_kafka import LocalKafkaBroker
from log.rdkafka_backend import RdKafkaBackend
from log.topics import AGENT_ACTIONS
from schemas.events import (
    EffectClass,
    Event,
    LLMCallCompleted,
    LLMCallStarted,
    SessionFinished,
    SessionStarted,
    ToolCallProposed,
)

DEFAULT_EVENTS = 200_000
DEFAULT_PARTITIONS = 4
DEFAULT_WARMUP = 10_000
DEFAULT_ROUNDS = 3
GOAL_RATIO = 0.8
"""Issue 16: agentlog appends and consumes (decode and verify included) at least this much of raw
kafka-python's rate on the same bytes, per CPU second (``Phase.cpu_ratio``), median of the rounds."""
NUM_SESSIONS = 1000
APPEND_BATCH = 2000
POLL_RECORDS = 2000
STALL_TIMEOUT_S = 60.0
TOPIC = AGENT_ACTIONS.name
# Principals of a secure broker (log.acls): planner owns agent.actions; the auditor reads
# everything, with consumer groups whose names start with "auditor".
WRITER = "planner"
READER = "auditor"
GROUP = "auditor-bench"
"""Logical consumer group of both consumers; physical ``<namespace>.auditor-bench``, as KafkaBackend names groups."""
CLIENTS = ("python", "rdkafka")
"""agentlog's Kafka clients (``log.urls.KAFKA_CLIENTS``): kafka-python and librdkafka."""
# Producer settings copied from the agentlog producer, so raw sends the way agentlog does.
PRODUCER_KEYS = ("acks", "enable_idempotence", "linger_ms", "batch_size", "compression_type")

_SAMPLE_TEXT = (
    "the model reads the file and then calls a tool to search for the function that parses "
    "arguments before it writes a patch with tests for each edge case it found in the log of "
    "previous runs where a retry failed because the cache was cold and the prompt grew past limit"
)
_WORDS = _SAMPLE_TEXT.split()
_TOOLS = (
    ("read_file", EffectClass.PURE),
    ("search_code", EffectClass.PURE),
    ("run_tests", EffectClass.IDEMPOTENT),
    ("write_file", EffectClass.COMPENSATABLE),
    ("send_email", EffectClass.IRREVERSIBLE),
)


# ---------------------------------------------------------------------- inputs


def _text(rng: random.Random, min_chars: int, max_chars: int) -> str:
    target = rng.randint(min_chars, max_chars)
    words: list[str] = []
    size = 0
    while size < target:
        word = rng.choice(_WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


def _turn(rng: random.Random, session: str, turn: int) -> Iterator[Event]:
    """One planner turn: an LLM call and, most of the time, the tool call it asked for."""
    call_id = f"llm-{turn}"
    prompt_tokens = 800 + 350 * turn
    yield LLMCallStarted(
        call_id=call_id,
        turn=turn,
        engine_id="vllm-0",
        prompt_tokens=prompt_tokens,
        max_output_tokens=512,
        prompt_digest=f"{rng.getrandbits(256):064x}",
    )
    output = _text(rng, 200, 600)
    yield LLMCallCompleted(
        call_id=call_id,
        engine_id="vllm-0",
        prompt_tokens=prompt_tokens,
        cached_tokens=prompt_tokens - 350,
        output_tokens=len(output) // 4,
        output_text=output,
        finish_reason="stop",
        queue_ms=rng.uniform(0, 20),
        prefill_ms=rng.uniform(5, 80),
        decode_ms=rng.uniform(100, 2000),
    )
    if rng.random() < 0.7:
        tool, effect = rng.choice(_TOOLS)
        tool_call = f"tool-{turn}"
        arguments = {"path": f"src/module_{rng.randrange(100)}.py", "query": _text(rng, 20, 60), "limit": 20}
        yield ToolCallProposed(
            call_id=tool_call,
            tool=tool,
            arguments_json=json.dumps(arguments),
            effect_class=effect,
            idempotency_key=f"{session}:{tool_call}",
            compensation_tool="revert_file" if effect is EffectClass.COMPENSATABLE else None,
            resource=arguments["path"] if effect is not EffectClass.PURE else None,
        )


def _session_events(rng: random.Random, session: str, count: int) -> list[Event]:
    """Exactly ``count`` events of one session: started, turns, finished."""
    events: list[Event] = [SessionStarted(program="react", args_json=json.dumps({"task": _text(rng, 40, 120)}))]
    turn = 0
    while len(events) < count - 1:
        events.extend(_turn(rng, session, turn))
        turn += 1
    del events[max(count - 1, 1) :]
    if count > 1:
        events.append(
            SessionFinished(
                output_json=json.dumps({"answer": _text(rng, 20, 80)}),
                num_llm_calls=turn,
                num_tool_calls=sum(isinstance(e, ToolCallProposed) for e in events),
            )
        )
    return events


def build_drafts(num_events: int, num_sessions: int = NUM_SESSIONS, seed: int = 0) -> list[Draft]:
    """``num_events`` drafts of ``agent.actions``, sessions interleaved as if they ran concurrently."""
    rng = random.Random(seed)
    num_sessions = max(1, min(num_sessions, num_events))
    sessions = [str(uuid.UUID(int=rng.getrandbits(128))) for _ in range(num_sessions)]
    quota = [num_events // num_sessions + (i < num_events % num_sessions) for i in range(num_sessions)]
    scripts = [deque(_session_events(rng, s, q)) for s, q in zip(sessions, quota, strict=True)]
    slots = [i for i, q in enumerate(quota) for _ in range(q)]
    rng.shuffle(slots)  # which session speaks next; each session's own events stay in order
    counters = [0] * num_sessions
    drafts = []
    for i in slots:
        # A deterministic event id per (session, index), as Draft recommends for retry-safe appends.
        drafts.append(Draft(sessions[i], scripts[i].popleft(), event_id=f"{sessions[i]}/{counters[i]}"))
        counters[i] += 1
    return drafts


def batches(items: Sequence[Draft], size: int) -> list[Sequence[Draft]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def send_order(drafts: Sequence[Draft], records: Sequence[RawRecord]) -> list[RawRecord]:
    """The records SharedLog wrote, in the order their drafts were appended.

    Within a session, offset order is seq order is draft order; so handing each
    draft the next record of its session reproduces the order of the sends.
    """
    by_session: defaultdict[bytes | None, deque[RawRecord]] = defaultdict(deque)
    for record in records:
        by_session[record.key].append(record)
    return [by_session[draft.session_id.encode()].popleft() for draft in drafts]


def freeze_heap() -> None:
    """Collect, then move every live object out of the GC's reach (the pre-built inputs)."""
    gc.collect()
    gc.freeze()


# ---------------------------------------------------------------------- timing


@dataclass
class Timing:
    """``events`` records of ``bytes`` value bytes in ``seconds``.

    ``first_s``: for consumers, seconds until the first records arrived (the group
    join and the first fetch), included in ``seconds``.
    """

    seconds: float
    events: int
    bytes: int
    first_s: float | None = None
    cpu_s: float = 0.0
    """CPU time of the whole process meanwhile (every thread: the clients' own included)."""

    @property
    def events_per_s(self) -> float:
        return self.events / self.seconds

    @property
    def events_per_cpu_s(self) -> float:
        return self.events / self.cpu_s if self.cpu_s > 0 else math.inf

    @property
    def mb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e6


@dataclass
class Phase:
    """One operation measured on both sides (``raw`` is None for in-memory phases)."""

    name: str
    agentlog: Timing
    raw: Timing | None = None

    @property
    def ratio(self) -> float | None:
        return None if self.raw is None else self.agentlog.events_per_s / self.raw.events_per_s

    @property
    def cpu_ratio(self) -> float | None:
        """The same in events per CPU second: what each side's client costs the process, less
        sensitive than the wall clock to other work on the machine (the broker's included)."""
        return None if self.raw is None else self.agentlog.events_per_cpu_s / self.raw.events_per_cpu_s


class Profiler:
    """cProfile around chosen phases, one ``.pstats`` file each (no-op without a directory)."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.directory is None:
            yield
            return
        profile = cProfile.Profile()
        profile.enable()
        try:
            yield
        finally:
            profile.disable()
            profile.dump_stats(self.directory / f"{name}.pstats")


# --------------------------------------------------------------------- kafka


@dataclass(frozen=True)
class Namespaces:
    """Fresh topic prefixes of one round: agentlog's on each client, and raw's."""

    run: str
    raw: str

    @classmethod
    def fresh(cls, label: str) -> Namespaces:
        run = f"bench-{uuid.uuid4().hex[:10]}-{label}"
        return cls(run, f"{run}-raw")

    def agentlog(self, client: str) -> str:
        return f"{self.run}-agentlog{_suffix(client)}"


@dataclass(frozen=True)
class Cluster:
    """A broker and the kafka-python client settings of each role the bench plays on it.

    ``admin`` creates and deletes topics (and, when ``secure``, applies ACLs);
    ``writer`` appends, ``reader`` consumes. On a plaintext broker all three are
    the same settings (``$AGENTLOG_KAFKA_*``, usually none).
    """

    mode: str
    bootstrap: str
    admin: dict[str, Any]
    writer: dict[str, Any]
    reader: dict[str, Any]
    secure: bool = False

    @classmethod
    def plaintext(cls, bootstrap: str) -> Cluster:
        config = KafkaBackend(bootstrap).client_config
        return cls("plaintext", bootstrap, config, config, config)

    @classmethod
    def of_secure_broker(cls, broker: LocalKafkaBroker) -> Cluster:
        credentials = broker.credentials
        return cls(
            "secure",
            broker.bootstrap_servers,
            admin=credentials.client_configs(ADMIN),
            writer=credentials.client_configs(WRITER),
            reader=credentials.client_configs(READER),
            secure=True,
        )

    def backend(
        self, namespace: str, client_config: dict[str, Any], client: str = "python"
    ) -> KafkaBackend | RdKafkaBackend:
        """agentlog's backend on ``client`` (``CLIENTS``)."""
        if client == "rdkafka":
            return RdKafkaBackend(self.bootstrap, namespace=namespace, client_config=client_config)
        return KafkaBackend(self.bootstrap, namespace=namespace, client_config=client_config)


def physical_group(namespace: str) -> str:
    return f"{namespace}.{GROUP}"


async def create_namespace(cluster: Cluster, namespace: str, partitions: int) -> str:
    """Create every log topic under ``namespace`` (and its ACLs, if secure); return the physical agent.actions topic."""
    backend = cluster.backend(namespace, cluster.admin)
    if cluster.secure:
        await init_secure_log(cluster.bootstrap, cluster.admin, namespace=namespace, num_partitions=partitions)
    else:
        await backend.create_topics(partitions)
    return backend.physical(TOPIC)


def delete_namespaces(cluster: Cluster, namespaces: Sequence[str]) -> None:
    """Best effort: drop the run's topics and consumer groups so the broker does not fill up."""
    admin = KafkaAdminClient(bootstrap_servers=cluster.bootstrap, **cluster.admin)
    try:
        prefixes = tuple(f"{ns}." for ns in namespaces)
        admin.delete_groups([physical_group(ns) for ns in namespaces])  # returns per-group errors; none matter
        topics = [t for t in admin.list_topics() if t.startswith(prefixes)]
        if topics:
            admin.delete_topics(topics)
    except KafkaError as e:
        print(f"could not delete the bench topics of {', '.join(namespaces)}: {e}", file=sys.stderr)
    finally:
        admin.close()


async def producer_settings(cluster: Cluster, namespace: str) -> dict[str, Any]:
    """agentlog's kafka-python producer settings (reads the private producer of a started
    KafkaBackend: a bench may), for the raw producer to send as agentlog does."""
    backend = KafkaBackend(cluster.bootstrap, namespace=namespace, client_config=cluster.writer)
    await backend.start()
    try:
        config = backend._producer.config
        return {key: config[key] for key in PRODUCER_KEYS} | backend.client_config
    finally:
        await backend.close()


async def _append_all(log: SharedLog, drafts: Sequence[Draft], batch: int) -> None:
    for chunk in batches(drafts, batch):
        await log.append_many(chunk)


async def _read_back(log: SharedLog) -> list[RawRecord]:
    return [record for p in range(log.num_partitions) async for record in log.scan(TOPIC, p)]


async def agentlog_append(
    cluster: Cluster, namespace: str, drafts: Sequence[Draft], profiler: Profiler, client: str = "python"
) -> tuple[Timing, list[RawRecord]]:
    """Append all drafts on ``client``; returns the timing and the records as written."""
    async with SharedLog(cluster.backend(namespace, cluster.writer, client), actor=WRITER) as log:
        freeze_heap()
        with profiler.phase(f"agentlog_append{_suffix(client)}"):
            start, cpu = time.perf_counter(), time.process_time()
            await _append_all(log, drafts, APPEND_BATCH)
            seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        records = await _read_back(log)
    if len(records) != len(drafts):
        raise RuntimeError(f"appended {len(drafts)} events but read back {len(records)}")
    return Timing(seconds, len(records), sum(len(r.value) for r in records), cpu_s=cpu), records


def _suffix(client: str) -> str:
    """What names a client's phase (none for kafka-python, the raw side's client)."""
    return "" if client == "python" else f"_{client}"


def _label(name: str, client: str) -> str:
    return name if client == "python" else f"{name} [{client}]"


def raw_append(
    bootstrap: str, topic: str, records: Sequence[RawRecord], settings: dict[str, Any], profiler: Profiler
) -> Timing:
    """Send the same keys and values to the same partitions; wait until all are acknowledged."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, **settings)
    try:
        freeze_heap()
        with profiler.phase("raw_append"):
            start, cpu = time.perf_counter(), time.process_time()
            for record in records:
                producer.send(topic, value=record.value, key=record.key, partition=record.position.partition)
            producer.flush()
            seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    finally:
        producer.close()
    return Timing(seconds, len(records), sum(len(r.value) for r in records), cpu_s=cpu)


async def agentlog_consume(
    cluster: Cluster,
    namespace: str,
    num_events: int,
    num_bytes: int,
    profiler: Profiler,
    client: str = "python",
    poll_records: int = POLL_RECORDS,
) -> Timing:
    """An EventConsumer on ``client`` in a new group, from the beginning, until ``num_events``
    verified events. The events are the records appended before, so their size is ``num_bytes``.
    """
    async with (
        SharedLog(cluster.backend(namespace, cluster.reader, client), actor=READER) as log,
        log.consumer(GROUP, [TOPIC], from_beginning=True) as consumer,
    ):
        freeze_heap()
        progress = Progress(num_events)
        with profiler.phase(f"agentlog_consume{_suffix(client)}"):
            while not progress.done:
                events = await consumer.poll(timeout_s=1.0, max_records=poll_records)
                progress.add(len(events))
        if consumer.stats.num_dead_lettered:
            raise RuntimeError(f"{consumer.stats.num_dead_lettered} records were dead-lettered")
    return progress.timing(num_bytes)


def raw_consume(
    cluster: Cluster, topic: str, group: str, num_events: int, profiler: Profiler, poll_records: int = POLL_RECORDS
) -> Timing:
    """A KafkaConsumer in a new group, from the beginning, until ``num_events`` raw records."""
    consumer = KafkaConsumer(
        bootstrap_servers=cluster.bootstrap,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        **cluster.reader,
    )
    try:
        consumer.subscribe([topic])
        freeze_heap()
        progress = Progress(num_events)
        size = 0
        with profiler.phase("raw_consume"):
            while not progress.done:
                batch = consumer.poll(timeout_ms=1000, max_records=poll_records)
                for messages in batch.values():
                    size += sum(len(m.value) for m in messages)  # touch every record, decode nothing
                    progress.add(len(messages))
                if not batch:
                    progress.add(0)
    finally:
        consumer.close()
    return progress.timing(size)


class Progress:
    """Counts consumed records against the clock; fails when none come for STALL_TIMEOUT_S."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.count = 0
        self.start = self.last = time.perf_counter()
        self.cpu_start = time.process_time()
        self.cpu_s = 0.0
        self.first_s: float | None = None
        self.seconds = 0.0

    @property
    def done(self) -> bool:
        return self.count >= self.expected

    def add(self, records: int) -> None:
        now = time.perf_counter()
        if records:
            self.count += records
            self.last = now
            if self.first_s is None:
                self.first_s = now - self.start
            if self.done:
                self.seconds = now - self.start
                self.cpu_s = time.process_time() - self.cpu_start
        elif now - self.last > STALL_TIMEOUT_S:
            raise RuntimeError(f"no records for {STALL_TIMEOUT_S:.0f}s after {self.count} of {self.expected}")

    def timing(self, num_bytes: int) -> Timing:
        if self.count != self.expected:
            raise RuntimeError(f"consumed {self.count} records, expected {self.expected}")
        return Timing(self.seconds, self.count, num_bytes, self.first_s, self.cpu_s)


def decode_verify(records: Sequence[RawRecord]) -> Timing:
    """Codec.decode + ChainVerifier.verify of every record, in memory (records in log order per partition)."""
    codec = Codec()
    verifier = ChainVerifier()
    freeze_heap()
    start, cpu = time.perf_counter(), time.process_time()
    for record in records:
        verifier.verify(AGENT_ACTIONS, record.key, codec.decode(record.value), record.position)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return Timing(seconds, len(records), sum(len(r.value) for r in records), cpu_s=cpu)


# ----------------------------------------------------------------------- run


def run_round(
    cluster: Cluster,
    drafts: Sequence[Draft],
    partitions: int,
    label: str,
    profiler: Profiler,
    *,
    clients: Sequence[str] = ("python",),
    in_memory: bool = True,
    poll_records: int = POLL_RECORDS,
) -> list[Phase]:
    """Every phase once on both sides (agentlog's once per client), in fresh namespaces
    (deleted afterwards).

    ``in_memory``: also measure decode+verify (no I/O, so once per run is enough).
    """
    ns = Namespaces.fresh(f"{label}-{cluster.mode}")
    namespaces = [ns.agentlog(c) for c in clients]
    try:
        for namespace in namespaces:
            asyncio.run(create_namespace(cluster, namespace, partitions))
        raw_topic = asyncio.run(create_namespace(cluster, ns.raw, partitions))
        settings = asyncio.run(producer_settings(cluster, ns.raw))
        # Order: agentlog appends first (raw sends the bytes the first client wrote), raw consumes first.
        appended = [asyncio.run(agentlog_append(cluster, ns.agentlog(c), drafts, profiler, c)) for c in clients]
        records = appended[0][1]
        raw_add = raw_append(cluster.bootstrap, raw_topic, send_order(drafts, records), settings, profiler)
        raw_read = raw_consume(cluster, raw_topic, physical_group(ns.raw), len(drafts), profiler, poll_records)
        reads = [
            asyncio.run(agentlog_consume(cluster, ns.agentlog(c), len(drafts), add.bytes, profiler, c, poll_records))
            for c, (add, _) in zip(clients, appended, strict=True)
        ]
        phases = [Phase(_label("append", c), add, raw_add) for c, (add, _) in zip(clients, appended, strict=True)]
        phases += [Phase(_label("consume", c), read, raw_read) for c, read in zip(clients, reads, strict=True)]
        if in_memory:
            phases.append(Phase("decode+verify", decode_verify(records)))
    finally:
        gc.unfreeze()
        delete_namespaces(cluster, [*namespaces, ns.raw])
    return phases


def machine() -> dict[str, Any]:
    # kafka-python checksums every record batch (CRC-32C) when producing and consuming; without the
    # `crc32c` package (a dependency, but an environment may lack it) it does so in pure Python,
    # which dominates the raw client's cost.
    native_crc = getattr(kafka_record_util, "crc32c_c", None) is not None
    return {
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "kafka_python": kafka.__version__,
        "crc32c": "native (crc32c package)" if native_crc else "pure Python",
        "gc_thresholds": gc.get_threshold(),
        "readers": "compiled" if Codec().compiled else "interpreted",
        "platform": platform.platform(),
    }


def goal_lines(rounds: Sequence[Sequence[Phase]]) -> list[str]:
    """Each phase measured on both sides, its ratio per CPU second in every round, and the goal's
    verdict on their median (``GOAL_RATIO``); the wall-clock median beside it."""
    by_name: dict[str, list[Phase]] = defaultdict(list)
    for phases in rounds:
        for p in phases:
            if p.raw is not None:
                by_name[p.name].append(p)
    if not by_name:
        return [f"goal >= {GOAL_RATIO:g}x raw kafka-python: not measured (no phase ran on both sides)"]
    lines = [f"per round, agentlog/raw per CPU s ({len(rounds)} round{'s' if len(rounds) != 1 else ''}):"]
    verdicts = []
    for name, phases in by_name.items():
        cpu = [p.cpu_ratio for p in phases if p.cpu_ratio is not None]
        wall = [p.ratio for p in phases if p.ratio is not None]
        lines.append(f"  {name:<18} " + " ".join(f"{r:.2f}" for r in cpu))
        median_cpu, median_wall = statistics.median(cpu), statistics.median(wall)
        verdict = "met" if median_cpu >= GOAL_RATIO else "NOT met"
        verdicts.append(f"{name} {median_cpu:.2f} -> {verdict} (wall clock {median_wall:.2f})")
    lines.append(
        f"goal >= {GOAL_RATIO:g}x raw kafka-python, median per CPU s over {len(rounds)} "
        f"round{'s' if len(rounds) != 1 else ''}: " + "; ".join(verdicts)
    )
    return lines


def _rate(timing: Timing | None) -> str:
    return "-" if timing is None else f"{timing.events_per_s:,.0f}"


def _ratio(num: Timing | None, den: Timing | None) -> str:
    return "-" if num is None or den is None else f"{num.events_per_s / den.events_per_s:.2f}"


def _first_fetch(phases: Sequence[Phase]) -> str | None:
    consumes = [p for p in phases if p.name.startswith("consume") and p.raw is not None]
    if not consumes:
        return None
    agentlog = ", ".join(f"{p.agentlog.first_s or 0:.2f}s {p.name.replace('consume', 'agentlog')}" for p in consumes)
    return f"{agentlog}, {consumes[0].raw.first_s or 0:.2f}s raw"  # type: ignore[union-attr]


def format_table(
    phases: Sequence[Phase],
    num_events: int,
    partitions: int,
    info: dict[str, Any],
    secure: Sequence[Phase] | None = None,
) -> str:
    """The plaintext columns; with ``secure``, the secure broker's and the secure/plaintext ratios beside them."""
    total = phases[0].agentlog.bytes
    # (title, number of columns) over the header: only printed with the secure columns.
    groups = [("", 1), ("plaintext", 6)]
    header = ["", "agentlog ev/s", "agentlog MB/s", "raw ev/s", "raw MB/s", "agentlog/raw", "per CPU s"]
    if secure is not None:
        groups += [("secure (SASL/PLAIN + ACLs)", 3), ("secure/plaintext", 2)]
        header += ["agentlog ev/s", "raw ev/s", "agentlog/raw", "agentlog", "raw"]
    secure_by_name = {p.name: p for p in secure or ()}
    rows = [header]
    for p in phases:
        raw = ("-", "-") if p.raw is None else (_rate(p.raw), f"{p.raw.mb_per_s:.1f}")
        ratio = "-" if p.ratio is None else f"{p.ratio:.2f}"
        cpu_ratio = "-" if p.cpu_ratio is None else f"{p.cpu_ratio:.2f}"
        row = [p.name, _rate(p.agentlog), f"{p.agentlog.mb_per_s:.1f}", *raw, ratio, cpu_ratio]
        if secure is not None:
            s = secure_by_name.get(p.name)
            s_agentlog, s_raw = (None, None) if s is None else (s.agentlog, s.raw)
            row += [
                _rate(s_agentlog),
                _rate(s_raw),
                _ratio(s_agentlog, s_raw),
                _ratio(s_agentlog, p.agentlog),
                _ratio(s_raw, p.raw),
            ]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    # A group title wider than its columns widens its last column.
    first = 0
    for title, span in groups:
        last = first + span - 1
        spanned = sum(widths[first : last + 1]) + 2 * (span - 1)
        widths[last] += max(0, len(title) - spanned)
        first += span
    lines = [
        f"N = {num_events:,} events on {TOPIC}, {partitions} partitions, {total / 1e6:.1f} MB of record values "
        f"({total / num_events:.0f} B/event); MB = 10^6 B of values; "
        f"consume polls of {info.get('poll_records', POLL_RECORDS):,} records on both sides",
        f"machine: {info['cores']} cores, Python {info['python']}, kafka-python {info['kafka_python']} "
        f"(CRC-32C: {info['crc32c']}), {info['platform']}",
        f"agentlog's record readers {info['readers']}; collector thresholds {info['gc_thresholds']} on both sides",
        f"load average (1 min) at start and end: {info['load_average']}",
        "",
    ]
    if secure is not None:
        titles = []
        first = 0
        for title, span in groups:
            titles.append(title.ljust(sum(widths[first : first + span]) + 2 * (span - 1)))
            first += span
        lines.append("  ".join(titles).rstrip())
    for row in rows:
        cells = [row[0].ljust(widths[0]), *(cell.rjust(w) for cell, w in zip(row[1:], widths[1:], strict=True))]
        lines.append("  ".join(cells))
    lines.append("decode+verify: Codec.decode + ChainVerifier.verify in memory, no I/O")
    lines.append(
        "per CPU s: agentlog/raw in events per second of this process's CPU time (all its threads; "
        "not the broker's): the clients' cost, less moved by other work on the machine"
    )
    plain_first = _first_fetch(phases)
    if plain_first is not None:
        lines.append(f"consume includes the group join and first fetch: {plain_first}")
    if secure is not None:
        secure_first = _first_fetch(secure)
        if secure_first is not None:
            lines.append(f"  secure: {secure_first}")
        lines.append(
            f"secure: SASL/PLAIN (no TLS) + StandardAuthorizer ACLs; appends as {WRITER}, "
            f"consumes as {READER} (group {GROUP}); secure/plaintext > 1 means secure is faster"
        )
    return "\n".join(lines)


def to_json(
    phases: Sequence[Phase],
    num_events: int,
    partitions: int,
    info: dict[str, Any],
    secure: Sequence[Phase] | None = None,
    rounds: Sequence[Sequence[Phase]] = (),
) -> dict[str, Any]:
    """The numbers of the first round (``phases``), the secure round's, and the ratios of every
    round with the goal's verdict (``goal_lines``)."""

    def timing(t: Timing | None) -> dict[str, Any] | None:
        if t is None:
            return None
        rates = {"events_per_s": t.events_per_s, "mb_per_s": t.mb_per_s, "events_per_cpu_s": t.events_per_cpu_s}
        return {**asdict(t), **rates}

    def table(ps: Sequence[Phase]) -> dict[str, Any]:
        return {
            p.name: {"agentlog": timing(p.agentlog), "raw": timing(p.raw), "ratio": p.ratio, "cpu_ratio": p.cpu_ratio}
            for p in ps
        }

    out = {"events": num_events, "partitions": partitions, "machine": info, "phases": table(phases)}
    if rounds:
        out["rounds"] = [
            {p.name: {"ratio": p.ratio, "cpu_ratio": p.cpu_ratio} for p in r if p.raw is not None} for r in rounds
        ]
        out["goal"] = {"ratio": GOAL_RATIO, "lines": goal_lines(rounds)}
    if secure is not None:
        plain = {p.name: p for p in phases}

        def vs_plain(s: Timing | None, p: Timing | None) -> float | None:
            return None if s is None or p is None else s.events_per_s / p.events_per_s

        out["secure"] = {
            "principals": {"writer": WRITER, "reader": READER, "group": GROUP},
            "phases": table(secure),
            "secure_over_plaintext": {
                s.name: {
                    "agentlog": vs_plain(s.agentlog, plain[s.name].agentlog),
                    "raw": vs_plain(s.raw, plain[s.name].raw),
                }
                for s in secure
                if s.name in plain
            },
        }
    return out


@contextlib.contextmanager
def secure_cluster(enabled: bool) -> Iterator[Cluster | None]:
    """A local secure broker (SASL/PLAIN + ACLs) for the duration, or None."""
    if not enabled:
        yield None
        return
    print("starting a local secure Kafka broker (SASL/PLAIN + ACLs) ...", file=sys.stderr)
    with LocalKafkaBroker(secure=True) as broker:
        yield Cluster.of_secure_broker(broker)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.log_throughput", description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=DEFAULT_EVENTS, help="events per side (default %(default)s)")
    parser.add_argument("--bootstrap", help="HOST:PORT of a broker (default: $KAFKA_BOOTSTRAP_SERVERS or a local one)")
    parser.add_argument("--partitions", type=int, default=DEFAULT_PARTITIONS, help="default %(default)s")
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, help="warm-up events (0: none)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=DEFAULT_ROUNDS,
        help="measured plaintext rounds; the goal is decided on their median (default %(default)s)",
    )
    parser.add_argument(
        "--poll-records",
        type=int,
        default=POLL_RECORDS,
        help="records a consume poll asks for, on both sides (default %(default)s; the workers poll 500)",
    )
    parser.add_argument("--json", type=Path, help="also write the numbers to this file")
    parser.add_argument(
        "--clients",
        nargs="+",
        choices=CLIENTS,
        default=["python", "rdkafka"],
        help="agentlog's Kafka clients, one row each beside raw kafka-python (default: both)",
    )
    parser.add_argument(
        "--secure-compare",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run against a local secure broker (SASL/PLAIN + ACLs) and print both side by side "
        "(default: on when the bench starts its own broker, off with --bootstrap/$KAFKA_BOOTSTRAP_SERVERS)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        help="write cProfile stats of each measured I/O phase to this directory (main thread only: "
        "kafka-python's sender thread and EventConsumer's poll thread are not seen; use py-spy for those)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    tune_gc()  # as a worker process runs (log/gc_tuning.py); the raw side shares the process
    load_before = os.getloadavg()[0]
    if args.events < 1:
        raise SystemExit("--events must be positive")
    if args.rounds < 1:
        raise SystemExit("--rounds must be positive")
    if args.poll_records < 1:
        raise SystemExit("--poll-records must be positive")
    drafts = build_drafts(args.events)
    warmup = build_drafts(min(args.warmup, args.events), seed=1) if args.warmup > 0 else []
    compare = args.secure_compare if args.secure_compare is not None else given_address(args.bootstrap) is None
    secure_phases: list[Phase] | None = None
    with broker_address(args.bootstrap) as bootstrap, secure_cluster(compare) as secure:
        clusters = [Cluster.plaintext(bootstrap), *([secure] if secure is not None else [])]
        if warmup:
            for cluster in clusters:  # each broker is a JVM of its own, with its own JIT
                print(f"warm-up round, {cluster.mode} ({len(warmup):,} events) ...", file=sys.stderr)
                run_round(
                    cluster,
                    warmup,
                    args.partitions,
                    "warmup",
                    Profiler(None),
                    clients=args.clients,
                    in_memory=False,
                    poll_records=args.poll_records,
                )
        rounds: list[list[Phase]] = []
        for i in range(args.rounds):
            print(f"measured round {i + 1} of {args.rounds}, plaintext ({len(drafts):,} events) ...", file=sys.stderr)
            profiler = Profiler(args.profile if i == 0 else None)  # the first round's profile only
            rounds.append(
                run_round(
                    clusters[0],
                    drafts,
                    args.partitions,
                    f"run{i}",
                    profiler,
                    clients=args.clients,
                    in_memory=i == 0,
                    poll_records=args.poll_records,
                )
            )
        phases = rounds[0]
        if secure is not None:
            print(f"measured round, secure ({len(drafts):,} events) ...", file=sys.stderr)
            profiler = Profiler(None if args.profile is None else args.profile / "secure")
            secure_phases = run_round(
                secure,
                drafts,
                args.partitions,
                "run",
                profiler,
                clients=args.clients,
                in_memory=False,
                poll_records=args.poll_records,
            )
    # Other processes share the machine (the ratios in one run are what compare): say how busy it was.
    info = machine() | {
        "load_average": f"{load_before:.1f} -> {os.getloadavg()[0]:.1f}",
        "poll_records": args.poll_records,
    }
    print(format_table(phases, args.events, args.partitions, info, secure_phases))
    print("\n".join(goal_lines(rounds)))
    if args.json is not None:
        numbers = to_json(phases, args.events, args.partitions, info, secure_phases, rounds)
        args.json.write_text(json.dumps(numbers, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
