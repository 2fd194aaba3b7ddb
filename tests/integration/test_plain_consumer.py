"""Third parties need nothing of ours: a plain kafka-python consumer with fastavro and the
.avsc files decodes what agentlog wrote, and a plain producer picks the same partitions."""

from __future__ import annotations

import asyncio
import hashlib
import io
import uuid
from pathlib import Path

import pytest
from fastavro import schemaless_reader
from fastavro.schema import fingerprint, load_schema, to_parsing_canonical_form
from kafka import KafkaConsumer, KafkaProducer

from log import SharedLog
from log.kafka_backend import KafkaBackend
from schemas.events import LLMCallCompleted, SessionStarted

pytestmark = pytest.mark.integration

AVRO_DIR = Path(__file__).resolve().parents[2] / "schemas" / "avro"


def test_plain_kafka_python_and_fastavro_decode_agentlog_records(kafka_bootstrap: str, namespace: str) -> None:
    session = f"s-{uuid.uuid4().hex[:6]}"

    async def write() -> None:
        backend = KafkaBackend(kafka_bootstrap, namespace=namespace)
        await backend.start()
        await backend.create_topics(3)
        async with SharedLog(backend, actor="planner") as log:
            await log.append(session, SessionStarted(program="trace", args_json='{"n": 1}'))
            await log.append(
                session,
                LLMCallCompleted(
                    call_id="c0",
                    engine_id="sim",
                    prompt_tokens=120,
                    cached_tokens=64,
                    output_tokens=30,
                    output_text="hello",
                    finish_reason="stop",
                    queue_ms=1.0,
                    prefill_ms=2.0,
                    decode_ms=3.0,
                ),
            )

    asyncio.run(write())

    # --- from here on: only kafka-python, fastavro and the .avsc files -------------------------
    schema = load_schema(str(AVRO_DIR / "agentlog.Envelope.avsc"))
    schema_fp = bytes.fromhex(fingerprint(to_parsing_canonical_form(schema), "CRC-64-AVRO"))
    consumer = KafkaConsumer(
        f"{namespace}.agent.actions",
        bootstrap_servers=kafka_bootstrap,
        group_id=f"third-party-{namespace}",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        consumer_timeout_ms=10_000,
    )
    decoded = []
    try:
        for message in consumer:
            value: bytes = message.value
            assert value[:2] == b"\xc3\x01"
            assert value[2:10] == schema_fp
            record = schemaless_reader(io.BytesIO(value[10:]), schema)
            assert hashlib.sha256(value[10:-33]).digest() == record["hash"]  # the documented hash rule
            assert message.key == record["session_id"].encode()
            decoded.append(record)
            if len(decoded) == 2:
                break
        consumer.commit()
    finally:
        consumer.close()
    assert [r["seq"] for r in decoded] == [0, 1]
    assert decoded[0]["body"]["program"] == "trace"
    assert decoded[1]["body"]["cached_tokens"] == 64
    assert decoded[1]["prev_hash"] == decoded[0]["hash"]


def test_a_plain_producer_picks_the_partition_agentlog_uses(kafka_bootstrap: str, namespace: str) -> None:
    """Our partitioner is Kafka's default one, so any client keyed by session id agrees with us."""

    async def init() -> None:
        backend = KafkaBackend(kafka_bootstrap, namespace=namespace)
        await backend.start()
        await backend.create_topics(5)
        await backend.close()

    asyncio.run(init())
    from log.partitioner import partition_for

    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap)
    try:
        sessions = [f"session-{i}" for i in range(40)]
        futures = {s: producer.send(f"{namespace}.agent.actions", key=s.encode(), value=b"x") for s in sessions}
        producer.flush()
        for session, future in futures.items():
            assert future.get(timeout=10).partition == partition_for(session, 5)
    finally:
        producer.close()
