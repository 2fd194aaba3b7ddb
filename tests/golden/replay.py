"""Golden logs: load one into the in-memory backend, and replay it into states and decisions.

A golden log (``<name>.jsonl``) is a log recorded from a real run of the stack
(``tests/golden/record.py``): a header line, then one line per record, every
topic and partition in offset order, with the raw record as it was stored::

    {"golden": 1, "scenario": "...", "num_partitions": 4, "time_scale": 0.05, "cache": {...}}
    {"topic": "agent.actions", "partition": 0, "offset": 0, "key": "s1", "value": "<base64>"}

The value is the record's bytes: the Avro single-object encoding of its
envelope, which any Avro library decodes with ``schemas/``. ``replay`` folds it
with today's code into what the roles derive from it: each session's state (the
planner's fold, a fork's parent history included), each checkpoint's state at its
cut, each merge's plan, and the cache manager's decisions; ``<name>.expected.json``
holds what that gave when it was recorded. Beside it, ``logged`` pairs each value
the workers wrote into the log (a checkpoint's digest, a merge's results, a cache
decision) with the replayed one.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from log import LoggedEvent, SharedLog
from log.backend import OutRecord
from log.memory_backend import MemoryBackend, MemoryStore
from schemas import events as ev
from services.cache.manager import ManagerConfig
from services.checkpoint import SESSION_TOPICS, merge_plan, state_digest, state_to_json
from workers.cache_manager import DECISIONS_TOPIC, INPUT_TOPICS, CacheManagerWorker, in_time_order
from workers.replay import replay_session, session_at

HERE = Path(__file__).parent
FORMAT = 1


def golden_names() -> list[str]:
    return sorted(p.name.removesuffix(".jsonl") for p in HERE.glob("*.jsonl"))


def read_golden(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The header and the record lines of a golden log."""
    with path.open() as f:
        header = json.loads(f.readline())
        if header.get("golden") != FORMAT:
            raise ValueError(f"{path}: not a golden log of format {FORMAT}")
        return header, [json.loads(line) for line in f if line.strip()]


def record_line(topic: str, partition: int, offset: int, key: bytes | None, value: bytes) -> dict[str, Any]:
    return {
        "topic": topic,
        "partition": partition,
        "offset": offset,
        "key": key.decode() if key is not None else None,
        "value": base64.b64encode(value).decode(),
    }


def load(path: Path) -> tuple[dict[str, Any], MemoryStore]:
    """A store holding the golden log, each record at the offset it was recorded at."""
    header, lines = read_golden(path)
    store = MemoryStore()
    store.create_topics(header["num_partitions"])
    for line in lines:
        key = line["key"].encode() if line["key"] is not None else None  # a record not of ours may have none
        record = OutRecord(line["partition"], key, base64.b64decode(line["value"]))  # type: ignore[arg-type]
        (position,) = store.append(line["topic"], [record])
        if position.offset != line["offset"]:
            raise ValueError(f"{path}: {position} recorded at offset {line['offset']}: records missing before it")
    return header, store


def _sessions(store: MemoryStore, num_partitions: int) -> list[str]:
    found = set()
    for topic in SESSION_TOPICS:
        for partition in range(num_partitions):
            found.update(r.key.decode() for r in store.records(topic, partition) if r.key is not None)
    return sorted(found)


async def _events(log: SharedLog, topics: tuple[str, ...] | list[str]) -> list[LoggedEvent]:
    """Every record of ``topics``, decoded (a golden log holds no bad records), topic by topic."""
    events = []
    for topic in topics:
        for partition in range(log.num_partitions):
            async for record in log.scan(topic, partition):
                events.append(LoggedEvent(record.position, log.decode(record)))
    return events


async def replay(header: dict[str, Any], store: MemoryStore) -> dict[str, Any]:
    """What today's code derives from the log (module docstring); JSON-able."""
    log = await SharedLog(MemoryBackend(store), actor="auditor").start()
    try:
        sessions: dict[str, Any] = {}
        checkpoints: dict[str, Any] = {}
        merges: dict[str, Any] = {}
        states = {}
        for session in _sessions(store, log.num_partitions):
            replayed = await replay_session(log, None, session, use_snapshot=False)
            states[session] = replayed.state
            sessions[session] = {"digest": state_digest(replayed.state), "state": state_to_json(replayed.state)}
        for session in states:
            for event in await log.history(session, ["agent.actions"]):
                body = event.body
                if isinstance(body, ev.CheckpointTaken):
                    at_cut = await session_at(log, None, session, body.checkpoint_id, body.cut)
                    checkpoints[f"{session}/{body.checkpoint_id}"] = {
                        "digest": state_digest(at_cut),
                        "logged": body.state_digest,
                    }
                elif isinstance(body, ev.MergeApplied | ev.MergeConflict):
                    plan = merge_plan({b: states[b] for b in body.branch_session_ids}, session)
                    logged = (
                        {"results": json.loads(body.results_json)}
                        if isinstance(body, ev.MergeApplied)
                        else {"conflicts": list(body.conflicts)}
                    )
                    merges[f"{session}/{event.seq}"] = {
                        "plan": {"conflicts": list(plan.conflicts), "results": plan.results},
                        "logged": logged,
                    }
        return {
            "sessions": sessions,
            "checkpoints": checkpoints,
            "merges": merges,
            "cache_decisions": await _cache_decisions(header, log),
        }
    finally:
        await log.close()


async def _cache_decisions(header: dict[str, Any], log: SharedLog) -> dict[str, Any]:
    """The cache manager's decisions from the log's inputs, folded in time order, and how many
    of them are the ones the recorded cache manager logged (same event id and decision)."""
    cache = header.get("cache")
    if cache is None:
        return {}
    worker = CacheManagerWorker(
        log,
        config=ManagerConfig(
            gpu_total_blocks=cache["gpu_blocks"],
            host_total_blocks=cache["host_blocks"],
            block_size=cache["block_size"],
            engine_id=cache["engine_id"],
        ),
        time_scale=header["time_scale"],
        recover=False,
    )
    drafts, _ = worker.process(list(in_time_order(await _events(log, INPUT_TOPICS))), received=0.0)
    logged = {e.envelope.event_id: e.body for e in await _events(log, [DECISIONS_TOPIC])}
    decisions = []
    for draft in drafts:
        body = draft.body
        assert isinstance(body, ev.CacheDecisionMade)
        decisions.append(
            {
                "session": draft.session_id,
                "event_id": draft.event_id,
                "action": body.action.value,
                "ttl_ms": body.ttl_ms,
                "num_blocks": body.num_blocks,
                "reason": body.reason,
                "as_logged": logged.get(str(draft.event_id)) == body,
            }
        )
    return {"decisions": decisions, "num_logged": len(logged)}


def dumps(expected: dict[str, Any]) -> str:
    return json.dumps(expected, indent=1, sort_keys=True) + "\n"
