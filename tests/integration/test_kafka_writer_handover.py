"""On Kafka, a partition that moved to another member and back is re-read before its owner appends.

The chaos bench (100 sessions, 50 faults) ended with ``logctl verify`` reporting
"agent.actions[2]@4: session c0-... repeats seq 2, expected 4": a planner had appended
seq 0 and 1 of a session, its partition moved to the other planner (which appended seq 2
and 3), and came back when that one was killed; the first planner still held the chain's
tail of before and appended a second seq 2. Kafka refuses nothing, so the chain held a
duplicate, and every reader set aside (dead-lettered) that record and each one the writer
linked to it after: a session whose later events no reader sees never ends (the hang of
an earlier CI-sized chaos run). This test is that handover, with two writers in one group
on the real broker, and a reader.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from cli.common import ensure_topics
from log import open_log
from log.chain import ChainVerifier
from log.consumer import EventConsumer
from log.shared_log import SharedLog
from log.topics import AGENT_ACTIONS
from schemas.events import LLMCallStarted
from tests.integration.kafka_groups import one_session_per_partition

pytestmark = pytest.mark.integration

ACTIONS = AGENT_ACTIONS.name


def started(turn: int) -> LLMCallStarted:
    return LLMCallStarted(
        call_id=f"llm-{turn}", turn=turn, engine_id="e", prompt_tokens=1, max_output_tokens=1, prompt_digest="d"
    )


async def until_assigned(members: list[EventConsumer], wanted: int, polls: int = 200) -> None:
    """Poll every member (each takes part in the rebalance only when it polls) until the group
    has handed out ``wanted`` partitions, each to one member."""
    for _ in range(polls):
        for member in members:
            await member.poll(0.1)
        held = [tp for member in members for tp in member.assignment()]
        if len(held) == wanted and len(set(held)) == wanted and all(m.assignment() for m in members):
            return
    raise AssertionError(f"the group did not settle: {[sorted(m.assignment()) for m in members]}")


async def seqs(log: SharedLog, session: str) -> list[int]:
    """The seqs of the session's chain, each checked against the records before it."""
    verifier = ChainVerifier()
    found = []
    async for record in log.scan(ACTIONS, log.partition_for(session)):
        envelope = log.decode(record)
        if envelope.session_id == session:
            verifier.verify(AGENT_ACTIONS, record.key, envelope, record.position)  # SeqRepeat before the fix
            found.append(envelope.seq)
    return found


def test_a_partition_back_from_the_other_planner_is_re_read_before_appending(
    kafka_bootstrap: str, namespace: str
) -> None:
    url = f"kafka://{kafka_bootstrap}"
    ensure_topics(url, namespace=namespace)
    group = f"planner-{uuid.uuid4().hex[:6]}"

    async def scenario() -> None:
        async with (
            open_log(url, actor="planner", namespace=namespace) as a,
            open_log(url, actor="planner", namespace=namespace) as b,
        ):
            n = a.num_partitions
            sessions = one_session_per_partition(a, namespace)
            async with a.consumer(group, [ACTIONS], from_beginning=True) as one:
                await until_assigned([one], n)
                for session in sessions.values():
                    await a.append(session, started(0))  # a writes seq 0 of every chain
                async with b.consumer(group, [ACTIONS], from_beginning=True) as two:
                    await until_assigned([one, two], n)
                    moved = sorted({p for _, p in two.assignment()})
                    for p in moved:
                        await b.append(sessions[p], started(1))  # the new owner writes seq 1
                # b is gone: its partitions come back to a
                await until_assigned([one], n)
                for p in moved:
                    await a.append(sessions[p], started(2))
                    await a.append(sessions[p], started(3))
        # A reader of the log (a decider, the operator) gets every one of them, none set aside.
        async with (
            open_log(url, actor="auditor", namespace=namespace) as reader,
            reader.consumer(f"read-{uuid.uuid4().hex[:6]}", [ACTIONS], from_beginning=True) as events,
        ):
            got: list[tuple[str, int]] = []
            for _ in range(100):
                got += [(e.session_id, e.seq) for e in await events.poll(0.2)]
                if len(got) >= n + 3 * len(moved):
                    break
            assert events.stats.num_dead_lettered == 0
            assert sorted(got) == sorted(
                [(s, 0) for s in sessions.values()] + [(sessions[p], q) for p in moved for q in (1, 2, 3)]
            )
            for p in moved:
                assert await seqs(reader, sessions[p]) == [0, 1, 2, 3]

    asyncio.run(asyncio.wait_for(scenario(), timeout=120))
