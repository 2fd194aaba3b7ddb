"""The cache manager worker: reads the log, keeps ``services.cache.manager`` state, appends decisions.

Reads ``agent.actions`` (LLM calls, tool proposals, session ends), ``agent.effects``
(tool starts and durations: the latency model) and ``kv.events`` (blocks per session
and tier), as its own principal ``cache-manager``; appends ``CacheDecisionMade`` to
``kv.decisions`` (keyed by the decided session, ``causation_id`` = the trigger) and
nothing else. It never talks to the engine: the engine bridge applies the decisions.

Memory is global to an engine, so **one cache manager owns every partition** (a static
``--instance-id`` takes them back at once after a restart). With several engines
(``--engines sim-0,sim-1``, default: the ids of ``AGENTLOG_ENGINES``, else ``--engine-id``) it
keeps one memory model per engine (``services.cache.engines``: each with ``--gpu-blocks`` /
``--host-blocks``, one latency model) and every decision names its engine, whose bridge alone
carries it out.

**Time.** The manager's clock is the log's: an event's time is its ``occurred_at``
divided by ``--time-scale`` (log seconds per simulated second, as for the engine and the
executor), tool durations likewise; TTLs and distances are multiplied back when
written, so ``ttl_ms`` is in log time, as the engine expects.

**Each poll**: fold every event (``CacheManager.apply``), partitions merged by
``occurred_at`` (each in offset order; see ``in_time_order``), and queue the poll's
decisions for appending. At most one ``append_many`` is in flight, so decisions land in
order; it runs while the next polls are read and folded, and when it has landed the next
one takes everything queued meanwhile (the loop waits for it only when more than
``MAX_QUEUED_DECISIONS`` are queued). Offsets are committed about once a second
(``commit_every_s``, the skeleton's cadence: ``workers/worker.py``), after the appends
before them landed; they serve monitoring (consumer lag), since recovery reads from 0.
A decision's event id is ``uuid5(trigger event id, kind, session)`` in the cache
manager's namespace (``event_ids``; computed by ``services.cache.manager``, which
decides): appending it again is a no-op.

**Recovery: re-read from the beginning, with kv.decisions as the record of what was
decided.** State (views, pins, TTLs, memory, the latency model) is a fold of the whole
log, so a restart re-reads the input topics from offset 0 (committed offsets are kept
for monitoring only). It first reads every ``CacheDecisionMade`` already in the log.
Up to the end offsets seen at start (the replay), each decision is sorted by the
kv.decisions partition it goes to (its *output* partition: the decided session's, which
for pressure and TTL decisions is not the triggering event's). Kafka keeps the order of
one partition, and the previous run appended in decision order (one ``append_many`` in
flight), so what it left in an output partition is a prefix of what it meant to append
there; an ``append_many`` that dies half-way may leave any subset *across* partitions.
So a replayed decision is

- *in the log* (same id): not appended again; if the logged one differs (the events
  were read in another order before), the manager adopts the logged one, which is what
  the engine carried out (``num_adopted``);
- *not in the log*, decided after the last decision of its output partition that is in
  the log: the previous run decided it and died before it landed; held until the replay
  ends and then appended (``num_recovered``), whatever landed in other partitions;
- *not in the log*, decided before a logged decision of its output partition: that
  partition's order says the previous run did not decide it (another order of events);
  not appended, so an old event never gets a second, late decision (``num_diverged``).

Every decision is thus appended at most once (ids are checked against the log) and
every one missing after its partition's last logged decision is appended. This assumes
the replay decides in the order the previous run did (``in_time_order``; a different
order shows up as adopted or diverged decisions). Known gap: decisions of events past
the replay's end are appended at once while the held ones wait for the replay to end;
a crash in between leaves a later decision logged before the held ones in a partition,
and the next restart counts those as diverged.

Why not resume from committed offsets plus a rebuild: the rebuild needs the events
before the committed offsets in any case, and the ``SharedLog`` interface does not
expose committed offsets; reading from 0 is one code path for first start and
restart, and the decisions in the log tell what was done.

Crash points (workers/crash.py): ``cache-manager.before_append`` (decided, not
appended) and ``cache-manager.after_append`` (appended, offsets not committed).

Run: ``python -m workers.cache_manager [--log-url URL] --gpu-blocks N [--host-blocks N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import logging
import math
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TextIO

from log import Draft, LoggedEvent, SharedLog
from log.consumer import EventConsumer
from log.topics import AGENT_ACTIONS, AGENT_EFFECTS, KV_DECISIONS, KV_EVENTS
from schemas import events as ev
from schemas.events import CacheDecisionMade, Model, SessionId
from services.cache.engines import EngineCacheManagers
from services.cache.manager import NAMESPACE, Decided, ManagerConfig
from services.cache.policy import CachePolicy
from services.engine.cost import CostModel
from workers.crash import crash_point
from workers.worker import EventIds, Worker

_log = logging.getLogger(__name__)

INPUT_TOPICS = (AGENT_ACTIONS.name, AGENT_EFFECTS.name, KV_EVENTS.name)
DECISIONS_TOPIC = KV_DECISIONS.name
MAX_QUEUED_DECISIONS = 5000
"""Decisions that may wait behind the append in flight before the loop waits for it."""


@dataclass
class WorkerStats:
    """Counters, and per-event latencies when ``record_latency`` is on (benchmarks)."""

    num_events: int = 0
    num_decisions: int = 0  # decided by this run, appended or found in the log
    num_appended: int = 0  # handed to append_many (already-logged ids are no-ops there)
    num_replayed: int = 0  # found in the log during the replay
    num_adopted: int = 0
    num_recovered: int = 0
    num_diverged: int = 0
    num_skipped: int = 0  # events read a second time (a partition that came back): not folded again
    record_latency: bool = False
    decide_s: list[float] = field(default_factory=list)  # fold+decide of one triggering event
    ready_s: list[float] = field(default_factory=list)  # poll return -> its decisions ready
    appended_s: list[float] = field(default_factory=list)  # poll return -> append acknowledged

    def summary(self) -> str:
        names = ("events", "decisions", "appended", "replayed", "adopted", "recovered", "diverged", "skipped")
        return " ".join(f"{n}={getattr(self, 'num_' + n)}" for n in names)


def scaled(body: Model, time_scale: float) -> Model:
    """The body in manager time: tool durations are measured on the log's (compressed) clock."""
    if time_scale != 1.0 and isinstance(body, ev.ToolCallCompleted | ev.ToolCallFailed):
        return body.model_copy(update={"duration_ms": body.duration_ms / time_scale})
    return body


def in_time_order(events: Sequence[LoggedEvent]) -> Iterable[LoggedEvent]:
    """One poll's events merged by ``occurred_at`` across partitions, each partition in offset
    order. A poll hands out runs of one partition after another (topic by topic): folding
    them in time order instead keeps a backlog's order (a restart's replay, a lagging
    worker) close to the order things happened in, which is what the decisions depend on."""
    runs: dict[tuple[str, int], list[LoggedEvent]] = {}
    for event in events:
        runs.setdefault((event.position.topic, event.position.partition), []).append(event)
    if len(runs) <= 1:
        return events
    return heapq.merge(*runs.values(), key=lambda e: e.envelope.occurred_at)


def logged_as_decided(previous: Decided, logged: CacheDecisionMade, time_scale: float) -> Decided:
    """The decision the log holds under ``previous``'s id, in manager terms."""
    ttl = None if logged.ttl_ms is None else logged.ttl_ms / 1000.0 / time_scale
    decision = replace(
        previous.decision, action=logged.action, ttl_s=ttl, score=logged.score, num_blocks=logged.num_blocks
    )
    return replace(previous, decision=decision)


class CacheManagerWorker(Worker):
    role = "cache-manager"
    topics: Sequence[str] = INPUT_TOPICS
    event_ids = EventIds(NAMESPACE)
    """``(trigger event id, kind, decided session)``: ``services.cache.manager.decision_event_id``."""

    def __init__(
        self,
        log: SharedLog,
        *,
        config: ManagerConfig,
        policy: CachePolicy | None = None,
        group: str | None = None,
        instance_id: str | None = None,
        time_scale: float = 1.0,
        poll_timeout_s: float = 0.5,
        max_records: int = 500,
        stats: WorkerStats | None = None,
        recover: bool = True,
        commit_every_s: float = 1.0,
        order_log: Path | None = None,
        engines: Sequence[str] = (),
    ) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        super().__init__(log, group=group, instance_id=instance_id, poll_timeout_s=poll_timeout_s)
        self.config = config
        configs = [replace(config, engine_id=e) for e in engines] or [config]
        if policy is None:
            policy = CachePolicy(cost=CostModel(block_size=config.block_size))  # its blocks are the engine's
        self.manager = EngineCacheManagers(configs, policy)
        self.time_scale = time_scale
        self.max_records = max_records
        self.stats = stats if stats is not None else WorkerStats()
        self.recover = recover
        self.commit_every_s = commit_every_s
        # "topic partition offset" of every event folded, in order (checks replay the same order).
        self._order_log: TextIO | None = order_log.open("a") if order_log is not None else None
        """False: every event read is new (no replay rules); benchmarks reading a backlog."""
        self.caught_up = asyncio.Event()
        self._logged: dict[str, CacheDecisionMade] = {}
        # Replayed decisions not in the log, per kv.decisions partition, in decision order,
        # since the last one of that partition found in the log (appended when the replay ends).
        self._pending: dict[int, list[Decided]] = {}
        # Decisions waiting for the append in flight (see _pump), and their triggers' receive times.
        self._queued: list[Draft] = []
        self._queued_ready: list[float] = []
        self._inflight: asyncio.Task[None] | None = None
        # Next offset to fold per (topic, partition): a partition that comes back after a
        # rebalance is read again from 0 (from_beginning), and must not be folded twice.
        self._next_offset: dict[tuple[str, int], int] = {}

    # ------------------------------------------------------ process plumbing

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        env = os.environ.get
        parser.add_argument("--gpu-blocks", type=int, default=int(env("AGENTLOG_CACHE_GPU_BLOCKS", "4096")))
        parser.add_argument(
            "--host-blocks",
            type=int,
            default=int(env("AGENTLOG_CACHE_HOST_BLOCKS", "0")),
            help="the engine's host tier (its --host-blocks; 0: none, as vLLM's here)",
        )
        parser.add_argument("--block-size", type=int, default=16)
        parser.add_argument(
            "--headroom-blocks",
            type=int,
            default=None,
            help="blocks pins leave free (default: the largest call seen without a host tier, 0 with one)",
        )
        parser.add_argument(
            "--ranked-pins",
            action=argparse.BooleanOptionalAction,
            default=env("AGENTLOG_CACHE_RANKED_PINS", "0") == "1",
            help="the engine ranks pins by program (vLLM's --ranked-pins): keep no room ahead and, under "
            "pressure, only swap; the engine's valve gives contexts up (default: AGENTLOG_CACHE_RANKED_PINS, "
            "which the vLLM launcher announces)",
        )
        parser.add_argument(
            "--ranked-wait-factor",
            type=wait_factor,
            default=env("AGENTLOG_CACHE_RANKED_WAIT_FACTOR", "10"),
            help="with --ranked-pins, pin only a session that returns within this many recomputes of its "
            "context; a later one is released and held loose (default: AGENTLOG_CACHE_RANKED_WAIT_FACTOR, else 10)",
        )
        parser.add_argument("--engine-id", default=env("AGENTLOG_ENGINE_ID", "sim-0"))
        parser.add_argument(
            "--engines",
            default=env("AGENTLOG_CACHE_ENGINES", ""),
            help="comma-separated engine ids, each with its own memory of --gpu-blocks/--host-blocks (default: "
            "the ids of AGENTLOG_ENGINES, else --engine-id alone)",
        )
        parser.add_argument(
            "--time-scale",
            type=float,
            default=float(env("AGENTLOG_TIME_SCALE", "1")),
            help="log seconds per simulated second (as for the engine and the executor)",
        )
        parser.add_argument("--max-records", type=int, default=500, help="events per poll (one append per poll)")
        parser.add_argument(
            "--order-log", type=Path, default=None, help="write the position of every event folded, in order"
        )

    @classmethod
    async def create(cls, log: SharedLog, args: argparse.Namespace) -> CacheManagerWorker:
        config = ManagerConfig(
            gpu_total_blocks=args.gpu_blocks,
            host_total_blocks=args.host_blocks,
            block_size=args.block_size,
            engine_id=args.engine_id,
            headroom_blocks=args.headroom_blocks,
            ranked_pins=args.ranked_pins,
            ranked_wait_factor=args.ranked_wait_factor,
        )
        return cls(
            log,
            config=config,
            group=args.group,
            instance_id=args.instance_id,
            time_scale=args.time_scale,
            max_records=args.max_records,
            order_log=args.order_log,
            engines=engine_ids(args.engines, args.engine_id),
        )

    async def close(self) -> None:
        if self._order_log is not None:
            self._order_log.close()
            self._order_log = None

    # -------------------------------------------------------------------- loop

    async def prepare(self) -> None:
        """Read every decision already logged, and where the replay of each input partition ends."""
        if self.recover:
            if self.log.num_partitions < 1:
                raise RuntimeError("start the log before the cache manager (recovery needs its partition count)")
            self._logged = await self.read_decisions()
            self.set_boundaries({topic: await self.log.end_offsets(topic) for topic in self.topics})
        _log.info(
            "cache manager: %d decisions in the log; replaying %d events",
            len(self._logged),
            sum(self._boundary.values()),
        )

    async def handle(self, events: list[LoggedEvent]) -> None:
        consumer = self.consumer
        assert consumer is not None
        received = time.perf_counter()
        drafts, ready = self.process(events, received)
        if not self.caught_up.is_set() and self._replay_done(consumer):
            drafts.extend(self._flush_pending())
            self._logged = {}  # only the replay reads it
            self.caught_up.set()
            _log.info("cache manager caught up: %s", self.stats.summary())
        if drafts:
            crash_point("cache-manager.before_append")
            self._queued.extend(drafts)
            self._queued_ready.extend(ready)
        await self._pump()

    async def flush(self, *, final: bool) -> None:
        # Offsets are for monitoring (recovery reads from 0): commit what is appended.
        await self._flush_appends()

    async def closed(self) -> None:
        if self._inflight is not None and not self._inflight.done():
            self._inflight.cancel()
        self._inflight = None
        _log.info("cache manager stopped: %s", self.stats.summary())

    async def _pump(self) -> None:
        """Start the next append if none is in flight; wait for the one in flight only when
        it has landed (to see its error) or when too many decisions are queued behind it.

        At most one ``append_many`` is in flight and each takes everything queued when it
        starts, so decisions land in decision order. Queuing instead of waiting for the
        append before the next poll keeps the loop folding while the producer waits for
        its acknowledgement (tens of ms with acks=all while this process is busy).
        """
        inflight = self._inflight
        if inflight is not None and (inflight.done() or len(self._queued) >= MAX_QUEUED_DECISIONS):
            self._inflight = None
            await inflight  # raises the append's error
        if self._inflight is None and self._queued:
            drafts, ready = self._queued, self._queued_ready
            self._queued, self._queued_ready = [], []
            self._inflight = asyncio.create_task(self._append(drafts, ready))

    async def _flush_appends(self) -> None:
        """Until every decision queued so far has landed."""
        while self._inflight is not None or self._queued:
            if self._inflight is not None:
                inflight, self._inflight = self._inflight, None
                await inflight
            await self._pump()

    async def _append(self, drafts: list[Draft], ready: list[float]) -> None:
        await self.log.append_many(drafts)
        self.stats.num_appended += len(drafts)
        crash_point("cache-manager.after_append")
        if self.stats.record_latency:
            done = time.perf_counter()
            self.stats.appended_s.extend(done - r for r in ready)

    async def read_decisions(self) -> dict[str, CacheDecisionMade]:
        """Every decision already in the log, by event id."""
        logged: dict[str, CacheDecisionMade] = {}
        for partition, end in (await self.log.end_offsets(DECISIONS_TOPIC)).items():
            async for record in self.log.scan(DECISIONS_TOPIC, partition, 0, end):
                try:
                    envelope = self.log.decode(record)
                except Exception:  # a bad record is the consumers' business (DLQ), not ours
                    continue
                if isinstance(envelope.body, CacheDecisionMade):
                    logged[envelope.event_id] = envelope.body
        return logged

    def process(self, events: Sequence[LoggedEvent], received: float) -> tuple[list[Draft], list[float]]:
        """Fold events; the drafts to append now and the receive times of their triggers."""
        drafts: list[Draft] = []
        ready: list[float] = []
        stats = self.stats
        if self._order_log is not None and events:
            self._order_log.flush()
        apply = self.manager.apply
        scale = self.time_scale
        seen = self._next_offset
        record_latency = stats.record_latency
        began = 0.0
        for event in in_time_order(events):
            position = event.position
            tp = (position.topic, position.partition)
            if position.offset < seen.get(tp, 0):
                stats.num_skipped += 1  # read again after a rebalance: already folded
                continue
            seen[tp] = position.offset + 1
            if self._order_log is not None:
                self._order_log.write(f"{position.topic} {position.partition} {position.offset}\n")
            envelope = event.envelope
            if record_latency:
                began = time.perf_counter()  # wall clock only: a CPU clock is a system call, twice an event
            body: Model = envelope.body
            if scale != 1.0:
                body = scaled(body, scale)
            decided = apply(
                envelope.event_id, SessionId(envelope.session_id), body, envelope.occurred_at.timestamp() / scale
            )
            stats.num_events += 1
            if not decided:
                continue
            if record_latency:
                now = time.perf_counter()
                stats.decide_s.append(now - began)
                stats.ready_s.append(now - received)
            stats.num_decisions += len(decided)
            if self.is_replay(event):
                self._replayed(decided)
                continue
            drafts.extend(self._draft(d) for d in decided)
            ready.extend(received for _ in decided)
        return drafts, ready

    def _replayed(self, decided: list[Decided]) -> None:
        """Sort one replayed event's decisions by their output partition (see the module
        docstring): held until the replay ends unless a later one of their partition is logged."""
        logged = self._logged
        stats = self.stats
        partition_for = self.log.partition_for
        for d in decided:
            partition = partition_for(d.session_id)
            body = logged.get(d.event_id)
            if body is None:
                self._pending.setdefault(partition, []).append(d)
                continue
            # Kafka kept this partition's order: what was decided before and is missing never landed.
            stats.num_diverged += len(self._pending.pop(partition, []))
            stats.num_replayed += 1
            if body.action is not d.decision.action or body.ttl_ms != d.to_event("", self.time_scale).ttl_ms:
                stats.num_adopted += 1
                self.manager.adopt(logged_as_decided(d, body, self.time_scale))

    def _flush_pending(self) -> list[Draft]:
        drafts: list[Draft] = []
        for partition in sorted(self._pending):
            for d in self._pending[partition]:
                drafts.append(self._draft(d))
                self.stats.num_recovered += 1
        self._pending.clear()
        return drafts

    def _replay_done(self, consumer: EventConsumer) -> bool:
        assignment = consumer.assignment_at_poll()
        return bool(assignment) and self.replay_done(consumer, assignment)

    def _draft(self, d: Decided) -> Draft:
        engine_id = d.engine_id or self.config.engine_id
        return Draft(d.session_id, d.to_event(engine_id, self.time_scale), d.event_id, d.trigger_id)


def wait_factor(text: str) -> float:
    """``--ranked-wait-factor``: a finite number > 0 (``ManagerConfig.ranked_wait_factor``); argparse
    turns the ``ValueError`` into its one-line usage error."""
    value = float(text)
    if not 0 < value < math.inf:
        raise ValueError(text)
    return value


def engine_ids(listed: str, engine_id: str) -> list[str]:
    """``--engines`` as a list; without it, the ids of ``AGENTLOG_ENGINES`` (as the planner routes
    to them), else ``[engine_id]``."""
    if ids := [e.strip() for e in listed.split(",") if e.strip()]:
        return ids
    if configured := os.environ.get("AGENTLOG_ENGINES", ""):
        from workers.engines.pool import parse_engines

        return [spec.engine_id for spec in parse_engines(configured)]
    return [engine_id]


if __name__ == "__main__":
    from workers.main import run_worker

    run_worker(CacheManagerWorker)
