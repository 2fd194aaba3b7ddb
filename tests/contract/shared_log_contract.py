"""The SharedLog contract: one suite, subclassed once per backend.

Every test runs against a real server (see tests/conftest.py) in a namespace of
its own. Bad records are injected below the SharedLog, straight into the
backend, as a forger with write access to the broker or database would.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from log import Draft, LoggedEvent, NotTopicOwner, SharedLog
from log.backend import Backend, OutRecord
from log.codec import MAGIC, ZERO_HASH, Codec
from log.types import Position
from schemas import registry
from schemas.events import (
    EffectClass,
    LLMCallStarted,
    RecordDeadLettered,
    SessionFinished,
    SessionStarted,
    ToolCallCommitted,
    ToolCallCompleted,
    ToolCallProposed,
    ToolCallStarted,
)

NUM_PARTITIONS = 4


class FakeClock:
    """A clock that ticks one millisecond per reading (deterministic order across writers)."""

    def __init__(self) -> None:
        self.now = datetime(2026, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        self.now += timedelta(milliseconds=1)
        return self.now


def llm_started(turn: int) -> LLMCallStarted:
    return LLMCallStarted(
        call_id=f"llm-{turn}",
        turn=turn,
        engine_id="sim",
        prompt_tokens=100 * turn,
        max_output_tokens=64,
        prompt_digest="0" * 64,
    )


class SharedLogContract:
    """Subclasses set ``backend_factory`` to build a backend in a namespace."""

    @pytest.fixture
    def make_backend(self) -> Callable[[], Backend]:  # overridden per backend
        raise NotImplementedError

    @pytest.fixture
    def run(self, make_backend: Callable[[], Backend]) -> Callable[[Callable[..., Awaitable[Any]]], Any]:
        """Run an async scenario; it receives ``open_log(actor)`` and the topic-initialized namespace."""

        def runner(scenario: Callable[..., Awaitable[Any]]) -> Any:
            async def main() -> Any:
                init = make_backend()
                await init.start()
                await init.create_topics(NUM_PARTITIONS)
                await init.close()
                clock = FakeClock()
                opened: list[SharedLog] = []

                async def open_log(actor: str) -> SharedLog:
                    log = SharedLog(make_backend(), actor=actor, clock=clock)
                    opened.append(log)
                    return await log.start()

                try:
                    return await asyncio.wait_for(scenario(open_log), timeout=120)
                finally:
                    for log in opened:
                        await log.close()

            return asyncio.run(main())

        return runner

    # ------------------------------------------------------------------ tests

    def test_per_session_order_without_gaps(self, run: Any) -> None:
        async def scenario(open_log: Any) -> None:
            log = await open_log("planner")
            sessions = [f"s-{i}" for i in range(6)]
            for turn in range(5):
                for session in sessions:
                    await log.append(session, llm_started(turn))
            for session in sessions:
                history = await log.history(session)
                assert [e.seq for e in history] == list(range(5))
                assert [e.body.turn for e in history] == list(range(5))  # type: ignore[union-attr]
                assert len({e.position.partition for e in history}) == 1
                assert all(e.position.partition == log.partition_for(session) for e in history)
                offsets = [e.position.offset for e in history]
                assert offsets == sorted(offsets)
                # The chain: each record's prev_hash is the previous record's hash.
                assert history[0].envelope.prev_hash == ZERO_HASH
                for before, after in itertools.pairwise(history):
                    assert after.envelope.prev_hash == before.envelope.hash

        run(scenario)

    def test_append_same_event_id_twice_is_idempotent(self, run: Any) -> None:
        async def scenario(open_log: Any) -> None:
            log = await open_log("planner")
            first = await log.append("s-1", SessionStarted(program="p", args_json="{}"), event_id="ev-1")
            again = await log.append("s-1", SessionStarted(program="p", args_json="{}"), event_id="ev-1")
            assert again == first
            # A restarted writer still knows it.
            restarted = await open_log("planner")
            assert await restarted.append("s-1", SessionStarted(program="p", args_json="{}"), event_id="ev-1") == first
            # Also inside one batch.
            batch = await restarted.append_many(
                [Draft("s-1", llm_started(0), event_id="ev-2"), Draft("s-1", llm_started(0), event_id="ev-2")]
            )
            assert batch[0] == batch[1]
            history = await restarted.history("s-1")
            assert [e.envelope.event_id for e in history] == ["ev-1", "ev-2"]
            ends = await restarted.end_offsets("agent.actions")
            assert sum(ends.values()) == 2

        run(scenario)

    def test_writer_recovers_seq_and_chain_after_restart(self, run: Any) -> None:
        async def scenario(open_log: Any) -> None:
            log = await open_log("planner")
            for turn in range(3):
                await log.append("s-1", llm_started(turn))
            restarted = await open_log("planner")
            await restarted.append("s-1", llm_started(3))
            history = await restarted.history("s-1")
            assert [e.seq for e in history] == [0, 1, 2, 3]
            reader = await open_log("auditor")
            async with reader.consumer("check", ["agent.actions"], from_beginning=True) as consumer:
                events = await poll_until(consumer, 4)
                assert [e.seq for e in events] == [0, 1, 2, 3]
                assert consumer.stats.num_dead_lettered == 0

        run(scenario)

    def test_concurrent_writers_on_different_sessions(self, run: Any) -> None:
        async def scenario(open_log: Any) -> None:
            writers = [await open_log("planner") for _ in range(3)]

            async def write(writer: SharedLog, session: str) -> None:
                for turn in range(20):
                    await writer.append(session, llm_started(turn))

            await asyncio.gather(*(write(w, f"s-{i}") for i, w in enumerate(writers)))
            reader = await open_log("auditor")
            async with reader.consumer("check", ["agent.actions"], from_beginning=True) as consumer:
                events = await poll_until(consumer, 60)
            assert consumer.stats.num_dead_lettered == 0
            for i in range(3):
                assert [e.seq for e in events if e.session_id == f"s-{i}"] == list(range(20))

        run(scenario)

    def test_consumer_group_resumes_from_committed_offset(self, run: Any) -> None:
        async def scenario(open_log: Any) -> None:
            log = await open_log("planner")
            for turn in range(5):
                await log.append("s-1", llm_started(turn))
            async with log.consumer("resumer", ["agent.actions"]) as consumer:
                first = await poll_until(consumer, 5)
                await consumer.commit(first[2])  # processed only three of them
            for turn in range(5, 8):
                await log.append("s-1", llm_started(turn))
            restarted = await open_log("planner")
            async with restarted.consumer("resumer", ["agent.actions"]) as consumer:
                resumed = await poll_until(consumer, 5)
                assert [e.seq for e in resumed] == [3, 4, 5, 6, 7]
                assert consumer.stats.num_dead_lettered == 0  # the chain was re-derived, not trusted
                await consumer.commit()
            async with restarted.consumer("resumer", ["agent.actions"]) as consumer:
                assert await consumer.poll(timeout_s=1.0) == []
            async with restarted.consumer("resumer", ["agent.actions"], from_beginning=True) as consumer:
                assert len(await poll_until(consumer, 8)) == 8

        run(scenario)

    def test_history_across_topics_in_order(self, run: Any) -> None:
        async def scenario(open_log: Any) -> None:
            planner, decider, executor = [await open_log(a) for a in ("planner", "decider", "executor")]
            started = await planner.append("s-1", SessionStarted(program="p", args_json="{}"))
            assert started.topic == "agent.actions"
            await planner.append(
                "s-1",
                ToolCallProposed(
                    call_id="t-1",
                    tool="echo",
                    arguments_json="{}",
                    effect_class=EffectClass.PURE,
                    idempotency_key="s-1/t-1",
                ),
            )
            await decider.append("s-1", ToolCallCommitted(call_id="t-1", votes=[], policy="all"))
            await executor.append("s-1", ToolCallStarted(call_id="t-1", tool="echo", idempotency_key="k", attempt=1))
            await executor.append(
                "s-1", ToolCallCompleted(call_id="t-1", result_json="{}", result_tokens=3, duration_ms=1.0)
            )
            await planner.append("s-1", SessionFinished(output_json="{}", num_llm_calls=0, num_tool_calls=1))
            history = await planner.history("s-1")
            assert [type(e.body).__name__ for e in history] == [
                "SessionStarted",
                "ToolCallProposed",
                "ToolCallCommitted",
                "ToolCallStarted",
                "ToolCallCompleted",
                "SessionFinished",
            ]
            assert [e.topic for e in history] == ["agent.actions"] * 2 + ["agent.verdicts"] + ["agent.effects"] * 2 + [
                "agent.actions"
            ]

        run(scenario)

    def test_a_writer_cannot_append_to_a_topic_it_does_not_own(self, run: Any) -> None:
        async def scenario(open_log: Any) -> None:
            planner = await open_log("planner")
            with pytest.raises(NotTopicOwner, match="only 'executor' may"):
                await planner.append(
                    "s-1", ToolCallCompleted(call_id="t", result_json="{}", result_tokens=0, duration_ms=0)
                )
            assert sum((await planner.end_offsets("agent.effects")).values()) == 0

        run(scenario)

    def test_bad_records_go_to_the_dlq_and_consumption_continues(self, run: Any) -> None:
        async def scenario(open_log: Any) -> None:
            planner = await open_log("planner")
            session = "s-bad"
            partition = planner.partition_for(session)
            codec = Codec()
            await planner.append(session, llm_started(0))  # seq 0, good
            tail = (await planner.history(session))[-1].envelope

            def forge(**overrides: Any) -> bytes:
                fields: dict[str, Any] = {
                    "event_id": str(uuid.uuid4()),
                    "session_id": session,
                    "seq": 1,
                    "actor": "planner",
                    "occurred_at": datetime(2026, 1, 1, tzinfo=UTC),
                    "causation_id": None,
                    "prev_hash": tail.hash,
                    "body": llm_started(1),
                }
                fields.update(overrides)
                return codec.encode(**fields)[0]

            good, _ = codec.encode(
                event_id="dup",
                session_id=session,
                seq=1,
                actor="planner",
                occurred_at=datetime(2026, 1, 1, tzinfo=UTC),
                causation_id=None,
                prev_hash=tail.hash,
                body=llm_started(1),
            )
            tampered = forge().replace(b"0000", b"1111", 1)  # a byte of the prompt digest, inside the hashed bytes
            bad = {
                "BadMagic": b"\x00\x00" + forge()[2:],
                "UnknownFingerprint": MAGIC + b"\x01" * 8 + forge()[10:],
                "TruncatedRecord": forge()[:6],
                "SchemaMismatch": MAGIC + registry.current_fingerprint() + b"\xff" * 30,
                "HashMismatch": tampered,
                "BrokenChain": forge(prev_hash=b"\x07" * 32),
                "SeqGap": forge(seq=5),
                "ActorNotAllowed": forge(actor="executor"),
                "BodyNotAllowed": forge(
                    body=ToolCallCompleted(call_id="t", result_json="{}", result_tokens=0, duration_ms=0)
                ),
            }
            backend = planner.backend
            for value in bad.values():
                await (await backend.produce("agent.actions", [OutRecord(partition, session.encode(), value)]))
            # A key that is not the session id.
            await (await backend.produce("agent.actions", [OutRecord(partition, b"someone-else", forge())]))
            # The genuine seq 1, then the same record again (a duplicate) and a stale seq 0 (a replay).
            await (await backend.produce("agent.actions", [OutRecord(partition, session.encode(), good)]))
            await (await backend.produce("agent.actions", [OutRecord(partition, session.encode(), good)]))
            # Consumption goes on: a later good record through the normal path.
            restarted = await open_log("planner")
            after = await restarted.append(session, llm_started(2))
            assert after.offset == 13

            # A reader that may write the DLQ (the auditor is read-only: it would only count them).
            auditor = await open_log("projector")
            async with auditor.consumer("audit", ["agent.actions"], from_beginning=True) as consumer:
                events = await poll_until(consumer, 3, settle_s=1.0)
                assert [e.seq for e in events] == [0, 1, 2]
                assert [e.envelope.event_id for e in events][1] == "dup"
                expected_errors = {name: 1 for name in bad} | {"KeyMismatch": 1, "SeqRepeat": 1}
                assert consumer.stats.dead_lettered_by_error == expected_errors
                assert consumer.stats.num_dead_lettered == 11
                await consumer.commit()
            async with auditor.consumer("dlq-reader", ["agent.dlq"], from_beginning=True) as dlq:
                letters = await poll_until(dlq, 11)
            bodies = [e.body for e in letters]
            assert all(isinstance(b, RecordDeadLettered) for b in bodies)
            by_error = {b.error_type: b for b in bodies}  # type: ignore[union-attr]
            assert set(by_error) == set(expected_errors)
            assert by_error["BadMagic"].raw_value == bad["BadMagic"]  # type: ignore[union-attr]
            assert by_error["SeqGap"].source_offset == 7  # type: ignore[union-attr]
            assert "jumps to seq 5, expected 1" in by_error["SeqGap"].reason  # type: ignore[union-attr]
            assert "may not write agent.actions" in by_error["ActorNotAllowed"].reason  # type: ignore[union-attr]
            assert by_error["SeqRepeat"].source_offset == 12  # type: ignore[union-attr]
            assert all(b.consumer_group == "audit" for b in by_error.values())  # type: ignore[union-attr]

        run(scenario)

    def test_group_members_split_partitions(self, run: Any) -> None:
        async def scenario(open_log: Any) -> None:
            log = await open_log("planner")
            for i in range(16):
                await log.append(f"s-{i}", llm_started(0))
            a = await (await open_log("planner")).consumer("split", ["agent.actions"]).start()
            b = await (await open_log("planner")).consumer("split", ["agent.actions"]).start()
            try:
                seen: dict[str, list[LoggedEvent]] = {"a": [], "b": []}
                for _ in range(60):
                    seen["a"] += await a.poll(timeout_s=0.2)
                    seen["b"] += await b.poll(timeout_s=0.2)
                    owned_a, owned_b = a.assignment(), b.assignment()
                    split = owned_a and owned_b and len(owned_a | owned_b) == NUM_PARTITIONS and not owned_a & owned_b
                    # Every session seen, not 16 records: a partition that moved from a to b is read
                    # again from the start (nothing committed yet), so records can repeat while a
                    # partition a keeps is still unread.
                    if split and {e.session_id for e in seen["a"] + seen["b"]} == {f"s-{i}" for i in range(16)}:
                        break
                assert a.assignment() and b.assignment()
                assert not a.assignment() & b.assignment()
                sessions_a = {e.session_id for e in seen["a"]}
                sessions_b = {e.session_id for e in seen["b"]}
                assert sessions_a | sessions_b == {f"s-{i}" for i in range(16)}
                await a.commit()
                await b.commit()
                # When one member leaves, the other takes over its partitions.
                await b.close()
                for _ in range(60):
                    await a.poll(timeout_s=0.2)
                    if len(a.assignment()) == NUM_PARTITIONS:
                        break
                assert len(a.assignment()) == NUM_PARTITIONS
            finally:
                await a.close()
                await b.close()

        run(scenario)

    def test_a_partition_back_from_another_member_is_read_anew_whole(self, run: Any) -> None:
        """A member reading from the beginning that gets a partition back reads it again from
        offset 0, each record once, none set aside: the chains it held of that partition are
        read anew, not continued (every record would repeat a seq).

        A partition it kept may be read anew too, whole: on librdkafka a rebalance revokes
        every partition before it assigns the new set (eager), and a poll that returns in
        between sees this member without it. Its position here is then forgotten and it goes
        on from the backend's, 0 for this member, which committed nothing (seen in CI, and
        every time with polls of 1 ms)."""

        async def scenario(open_log: Any) -> None:
            log = await open_log("planner")
            for i in range(16):
                await log.append(f"s-{i}", llm_started(0))
                await log.append(f"s-{i}", llm_started(1))
            a = await (await open_log("planner")).consumer("back", ["agent.actions"], from_beginning=True).start()
            b = None
            try:
                assert len(await poll_until(a, 32)) == 32
                b = await (await open_log("planner")).consumer("back", ["agent.actions"], from_beginning=True).start()
                for _ in range(100):
                    await a.poll(timeout_s=0.1)
                    await b.poll(timeout_s=0.1)
                    if a.assignment() and b.assignment() and len(a.assignment() | b.assignment()) == NUM_PARTITIONS:
                        break
                moved = {p for _, p in b.assignment()}
                assert moved and len(a.assignment()) < NUM_PARTITIONS
                await b.close()
                whole: dict[int, list[tuple[str, int]]] = {}  # each partition's records
                for i in range(16):
                    whole.setdefault(log.partition_for(f"s-{i}"), []).extend((f"s-{i}", turn) for turn in (0, 1))
                again: dict[int, list[tuple[str, int]]] = {}  # what was read again, by partition
                for _ in range(100):
                    for e in await a.poll(timeout_s=0.1):
                        again.setdefault(e.position.partition, []).append((e.session_id, e.seq))
                    # Every record of the partitions read again, not two a partition: a partition
                    # holds several sessions, and a poll may hand over part of them.
                    if len(a.assignment_at_poll()) == NUM_PARTITIONS and all(
                        len(again.get(p, [])) >= len(whole[p]) for p in moved | again.keys()
                    ):
                        break
                for e in await a.poll(timeout_s=0.5):  # nothing more
                    again.setdefault(e.position.partition, []).append((e.session_id, e.seq))
                assert moved <= again.keys()
                assert {p: sorted(records) for p, records in again.items()} == {p: sorted(whole[p]) for p in again}
                assert a.stats.num_dead_lettered == 0
            finally:
                await a.close()
                if b is not None:
                    await b.close()

        run(scenario)


async def poll_until(
    consumer: Any, count: int, *, settle_s: float = 0.0, deadline_s: float = 60.0
) -> list[LoggedEvent]:
    """Poll until ``count`` events arrived (then ``settle_s`` more, to catch extras)."""
    events: list[LoggedEvent] = []
    loop = asyncio.get_running_loop()
    stop = loop.time() + deadline_s
    while len(events) < count and loop.time() < stop:
        events += await consumer.poll(timeout_s=0.5)
    settle_until = loop.time() + settle_s
    while loop.time() < settle_until:
        events += await consumer.poll(timeout_s=0.2)
    return events


__all__ = ["Position", "SharedLogContract", "poll_until"]


class ReadOnlyAuditorContract:
    """Mixed into the backend suites: the auditor counts bad records but writes nothing."""

    def test_the_read_only_auditor_counts_bad_records_and_writes_nothing(self, run: Any) -> None:
        async def scenario(open_log: Any) -> None:
            planner = await open_log("planner")
            await planner.append("s-ro", llm_started(0))
            partition = planner.partition_for("s-ro")
            await (await planner.backend.produce("agent.actions", [OutRecord(partition, b"s-ro", b"garbage")]))
            auditor = await open_log("auditor")
            async with auditor.consumer("ro", ["agent.actions"], from_beginning=True) as consumer:
                events = await poll_until(consumer, 1, settle_s=1.0)
                assert [e.seq for e in events] == [0]
                assert consumer.stats.dead_lettered_by_error == {"BadMagic": 1}
            assert sum((await auditor.end_offsets("agent.dlq")).values()) == 0
            with pytest.raises(NotTopicOwner):
                await auditor.append("s-ro", llm_started(1))

        run(scenario)
