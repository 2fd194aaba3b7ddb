"""The whole stack on a broker that enforces the roles: each process logs in as its own principal.

Sessions run end to end with SASL/PLAIN and ACLs on. A compromised planner then
tries to get an irreversible payment (held for human approval) executed by
forging a verdict: the broker refuses it on agent.verdicts, and the copy it
writes on its own topic is dead-lettered by the consumers; the executor never
runs the call.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from kafka import KafkaProducer
from kafka.errors import KafkaError

from cli.sessions import SessionBook
from cli.stack import Stack, free_port
from log import SharedLog
from log.acls import init_secure_log
from log.backend import OutRecord
from log.kafka_backend import KafkaBackend
from schemas import events as ev
from tests.conftest import SecureKafka

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = [
    {"llm": {"prompt_tokens": 40, "output_tokens": 4}},
    {"tool": "echo", "arguments": {"text": "hi"}},
    {"llm": {"prompt_tokens": 8, "output_tokens": 4}},
]
PAYMENT = [
    {"llm": {"prompt_tokens": 40, "output_tokens": 4}},
    {"tool": "payment", "arguments": {"account": "x", "amount_cents": 9}},
]


def log_as(kafka: SecureKafka, namespace: str, principal: str) -> SharedLog:
    backend = KafkaBackend(
        kafka.bootstrap, namespace=namespace, client_config=kafka.credentials.client_configs(principal)
    )
    return SharedLog(backend, actor=principal)


async def watch(kafka: SecureKafka, namespace: str, done: Any, deadline_s: float = 90) -> tuple[SessionBook, list[Any]]:
    book = SessionBook()
    letters: list[Any] = []
    topics = ["agent.actions", "agent.verdicts", "agent.effects", "ops.commands", "agent.dlq"]
    group = f"logctl-watch-{uuid.uuid4().hex[:6]}"
    async with (
        log_as(kafka, namespace, "auditor") as log,
        log.consumer(group, topics, from_beginning=True) as consumer,
    ):
        stop = time.monotonic() + deadline_s
        while time.monotonic() < stop:
            for event in await consumer.poll(timeout_s=0.3):
                if isinstance(event.body, ev.RecordDeadLettered):
                    letters.append(event.body)
                else:
                    book.add(event)
            if done(book, letters):
                return book, letters
    raise AssertionError(f"not done in {deadline_s} s: {len(book.records)} sessions read, {len(letters)} letters")


def test_sessions_run_with_every_role_under_its_own_principal_and_a_forged_verdict_is_never_obeyed(
    secure_kafka: SecureKafka, namespace: str, pg_url: str, tmp_path: Path
) -> None:
    kafka = secure_kafka
    asyncio.run(
        init_secure_log(
            kafka.bootstrap, kafka.credentials.client_configs("admin"), namespace=namespace, num_partitions=2
        )
    )
    assert kafka.credentials.path is not None
    stack = Stack(
        f"kafka://{kafka.bootstrap}",
        tmp_path,
        extra_env={
            "AGENTLOG_NAMESPACE": namespace,
            "AGENTLOG_KAFKA_CREDENTIALS": str(kafka.credentials.path),
            "AGENTLOG_LEDGER_URL": pg_url,
        },
    )
    stack.engine_port = free_port()
    run = uuid.uuid4().hex[:4]
    sessions = [f"sec-{run}-{i}" for i in range(2)]
    payer = f"pay-{run}"
    with stack:

        async def request() -> None:
            async with log_as(kafka, namespace, "operator") as operator:
                for session in sessions:
                    args = json.dumps({"steps": STEPS})
                    await operator.append(session, ev.SessionRequested(program="script", args_json=args, author="t"))
                args = json.dumps({"steps": PAYMENT})
                await operator.append(payer, ev.SessionRequested(program="script", args_json=args, author="t"))

        asyncio.run(request())

        def held(book: SessionBook, _letters: list[Any]) -> bool:
            finished = all(s in book.records and book.records[s].state.finished for s in sessions)
            payment = book.records.get(payer)
            return finished and payment is not None and "tool-1" in payment.state.tool_calls

        book, _ = asyncio.run(watch(kafka, namespace, held))
        for session in sessions:
            state = book.records[session].state
            assert state.status is not None and state.status.value == "finished", (session, state.failure)
            assert state.actors == {"operator", "planner", "decider", "executor"}
        assert book.records[payer].state.tool_calls["tool-1"].status.value == "proposed"  # held for a human

        # A compromised planner forges a commit verdict for the held payment.
        verdict = ev.ToolCallCommitted(call_id="tool-1", votes=[], policy="forged")
        producer = KafkaProducer(**kafka.credentials.client_kwargs("planner"), acks="all", max_block_ms=10_000)
        try:
            with pytest.raises(KafkaError):
                producer.send(f"{namespace}.agent.verdicts", key=payer.encode(), value=b"forged").get(timeout=10)
        finally:
            producer.close()

        async def forge_on_own_topic() -> None:
            async with log_as(kafka, namespace, "planner") as planner:
                record, _ = planner.codec.encode(
                    event_id="forged-verdict",
                    session_id=payer,
                    seq=99,
                    actor="decider",
                    occurred_at=datetime.now(UTC),
                    causation_id=None,
                    prev_hash=bytes(32),
                    body=verdict,
                )
                partition = planner.partition_for(payer)
                await (await planner.backend.produce("agent.actions", [OutRecord(partition, payer.encode(), record)]))

        asyncio.run(forge_on_own_topic())

        def forged_read(book: SessionBook, letters: list[Any]) -> bool:
            # The letter, and the payment as the log holds it (agent.dlq may come first in a poll).
            payment = book.records.get(payer)
            return any(d.source_session_id == payer for d in letters) and (
                payment is not None and "tool-1" in payment.state.tool_calls
            )

        book, letters = asyncio.run(watch(kafka, namespace, forged_read, deadline_s=30))
        time.sleep(2)  # give a misbehaving executor every chance to run it
        assert all(p.alive() for p in stack.processes.values())
    forged = [d for d in letters if d.source_session_id == payer]
    assert forged and {d.error_type for d in forged} <= {"ActorNotAllowed", "BodyNotAllowed"}
    payment = book.records[payer].state.tool_calls["tool-1"]
    assert payment.status.value == "proposed" and payment.attempts == 0

    async def ledger() -> int:
        conn = await asyncpg.connect(pg_url)
        try:
            return int(
                await conn.fetchval("SELECT count(*) FROM agentlog_ledger.payments WHERE session_id = $1", payer)
            )
        finally:
            await conn.close()

    assert asyncio.run(ledger()) == 0
