"""Starting a partition late (``EventConsumer`` with ``start_at``): one suite, run on both backends.

A role worker with a mark reads a partition from an offset other than 0, with
some chains seeded (docs/branches.md, "Worker recovery"). What must hold:
nothing below the start is decoded, a session the caller does not list is
skipped below ``known_to``, a seeded session's records below its seed are
skipped and its next one is checked against the seed, a chain that began below
the start is rebuilt (only that chain, only when met) instead of dead-lettered,
a wrong seed costs a rebuild and never a false dead-letter, and a forged record
is still dead-lettered.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from log import LoggedEvent, SharedLog
from log.backend import OutRecord
from log.codec import Codec
from log.consumer import ChainSeed, EventConsumer, StartAt
from tests.contract.shared_log_contract import llm_started, poll_until


def same_partition(log: SharedLog, names: list[str]) -> list[str]:
    """Session ids, one per name, all in the partition of the first."""
    partition = log.partition_for(f"{names[0]}-0")
    found = []
    for name in names:
        i = 0
        while log.partition_for(f"{name}-{i}") != partition:
            i += 1
        found.append(f"{name}-{i}")
    return found


async def write(log: SharedLog, session: str, seqs: range) -> list[LoggedEvent]:
    written = []
    for turn in seqs:
        await log.append(session, llm_started(turn))
    for event in await log.history(session, ["agent.actions"]):
        if event.seq in seqs:
            written.append(event)
    return written


class StartAtContract:
    def test_start_late_with_seeds_skips_and_rebuilds_one_chain(self, run: Any) -> None:
        async def scenario(open_log: Any) -> None:
            log = await open_log("planner")
            a, b, c = same_partition(log, ["a", "b", "c"])
            partition = log.partition_for(a)
            a_low = await write(log, a, range(5))
            await write(log, b, range(3))
            start = (await log.end_offsets("agent.actions"))[partition]
            await write(log, a, range(5, 8))
            await write(log, b, range(3, 4))  # b needed nothing: skipped below known_to
            known_to = (await log.end_offsets("agent.actions"))[partition]
            await write(log, c, range(3))
            await write(log, b, range(4, 5))  # b again, after known_to: its chain is rebuilt then
            await write(log, a, range(8, 9))
            seed = ChainSeed(start, a_low[-1].seq, a_low[-1].envelope.hash)
            asked: list[tuple[str, int]] = []

            async def start_at(topic: str, part: int) -> StartAt | None:
                asked.append((topic, part))
                if part != partition:
                    return None
                return StartAt(start, known_to, frozenset({a}), {a: seed})

            consumer = EventConsumer(log, "late", ["agent.actions"], from_beginning=True, start_at=start_at)
            async with consumer:
                events = await poll_until(consumer, 8, settle_s=1.0)
            got = sorted((e.session_id, e.seq) for e in events)
            assert got == sorted([(a, s) for s in range(5, 9)] + [(b, 4)] + [(c, s) for s in range(3)])
            assert consumer.stats.num_dead_lettered == 0
            assert consumer.rebuilt == {("agent.actions", b)}, "only b's chain, only when met"
            assert consumer.reads.decoded == 8
            assert consumer.reads.skipped == 1  # b's seq 3
            assert consumer.reads.rebuilt == 4  # b's records before its seq 4
            assert asked.count(("agent.actions", partition)) == 1
            assert consumer.position("agent.actions", partition) == (await log.end_offsets("agent.actions"))[partition]

        run(scenario)

    def test_a_wrong_seed_costs_a_rebuild_and_a_forged_record_is_still_dead_lettered(self, run: Any) -> None:
        async def scenario(open_log: Any) -> None:
            log = await open_log("planner")
            a, c = same_partition(log, ["a", "c"])
            partition = log.partition_for(a)
            a_low = await write(log, a, range(3))
            start = (await log.end_offsets("agent.actions"))[partition]
            await write(log, a, range(3, 5))
            c_low = await write(log, c, range(2))
            codec = Codec()
            forged, _ = codec.encode(
                event_id=str(uuid.uuid4()),
                session_id=c,
                seq=2,
                actor="planner",
                occurred_at=datetime(2026, 1, 1, tzinfo=UTC),
                causation_id=None,
                prev_hash=b"\x07" * 32,
                body=llm_started(2),
            )
            await (await log.backend.produce("agent.actions", [OutRecord(partition, c.encode(), forged)]))
            await write(log, c, range(2, 3))
            wrong = ChainSeed(start, a_low[-1].seq, b"\x01" * 32)  # a forged seed row: not the real tail

            async def start_at(topic: str, part: int) -> StartAt | None:
                return StartAt(start, start, frozenset({a}), {a: wrong}) if part == partition else None

            consumer = EventConsumer(log, "late2", ["agent.actions"], from_beginning=True, start_at=start_at)
            async with consumer:
                events = await poll_until(consumer, 5, settle_s=1.0)
            assert sorted((e.session_id, e.seq) for e in events) == sorted(
                [(a, 3), (a, 4)] + [(c, e.seq) for e in c_low] + [(c, 2)]
            )
            assert consumer.rebuilt == {("agent.actions", a)}, "the wrong seed was replaced by a's real chain"
            assert consumer.stats.dead_lettered_by_error == {"BrokenChain": 1}, "the forged record, only"

        run(scenario)
