"""vLLM's side of the bridge: its ZMQ KV event stream in, cache decisions out to its scheduler.

**Wire format** (vLLM ``distributed/kv_events.py``, read here without importing vllm). The
publisher sends ``[topic, seq (8 bytes big-endian), payload]`` on a PUB socket; the payload is
msgpack ``[ts, [event, ...], dp_rank]`` and each event a map tagged by ``type``:
``BlockStored`` (``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``,
``medium``, ``session_id``), ``BlockRemoved`` (``block_hashes``, ``medium``) or
``AllBlocksCleared``. Block hashes are 64-bit ints or bytes; the log gets them as hex. A
ROUTER replay socket answers ``[b"", start_seq]`` with every buffered batch from ``start_seq``
as ``[b"", topic, seq, payload]``, then ``[b"", b"", -1, b""]``.

**Epochs.** ``seq`` restarts at 0 when vLLM restarts. ``AgentlogScheduler`` suffixes the topic
with ``@<epoch>`` (one id per engine run), so the epoch travels with every batch; a plain
vLLM (no suffix) is one epoch, ``"-"``.

**Gapless.** The source first drains the replay buffer from where the bridge is (the SUB
socket, already connected, queues live batches meanwhile), then follows the live stream;
a live ``seq`` beyond the next expected one is a gap, filled from the replay socket; what
the buffer no longer has is reported as ``KVEventsLost``. Batches at or below the cursor
(read twice: replayed, then live) are skipped.

**Sessions.** ``BlockStored`` carries the session (the request's ``session_id``; vLLM also
emits it for blocks a request *reuses* from the prefix cache). ``BlockRemoved`` does not:
the source keeps ``hash -> sessions`` from the stored events and reports a removal to every
session that held the block (one ``KVBlocksRemoved`` per session, sessions in sorted order,
so the events of a batch and their ids are the same on every read of the buffer). Blocks no
session is known for, and ``AllBlocksCleared``, go to the engine's own session
(``engine/<engine id>``). The bridge reads the buffer from its oldest batch after a restart,
which rebuilds the same map **only while the buffer still holds the ``BlockStored`` of every
block still cached**: vLLM's replay buffer is a ring (``buffer_steps`` batches) in its memory,
so once it has wrapped, a restarted bridge does not know the sessions of blocks stored before
its oldest batch, and their later removals go to the engine's session, not to the sessions
that held them (the log's earlier ``KVBlocksStored`` still name those sessions; the map is not
seeded from ``kv.events``).

**Unknown event types** (a newer vLLM) are logged once per type, counted in
``VllmKVSource.unknown_events`` and skipped; their batch is still yielded under its ``seq``, so
numbering stays gapless.

**Actuator.** Decisions go to the scheduler's control channel (``workers.engines.vllm.control``):
PRESERVE -> ``pin`` (TTL, with the decision's score: the rank for releases under pressure),
RELEASE -> ``release``, DISCARD -> ``discard``. A PRESERVE's ``ttl_ms`` is in the log's
time and goes to vLLM unconverted (the scheduler counts it on its monotonic clock; there is no
time scale on a real engine); ``ttl_ms=None`` pins with no expiry (until a release, a discard
or pressure), ``ttl_ms <= 0`` holds nothing (sent as ``release``). SWAP and PREFETCH are
refused: vLLM's CPU platform has no host tier (its KV cache is already in host memory and the
offloading connectors refuse the platform), and the GPU offloading connectors offer no
per-session swap; the simulator keeps swap.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import math
import os
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from schemas.events import (
    CacheAction,
    CacheDecisionMade,
    KVAllBlocksCleared,
    KVBlocksRemoved,
    KVBlocksStored,
    KVTier,
    SessionId,
)
from workers.engine_bridge.base import ActuationRefused, EngineBatch, EngineKVEvent, KVEventsLost, engine_session_id
from workers.engines.vllm.control import ControlClient, ControlError, ControlUnavailable

__all__ = ["VllmActuator", "VllmKVSource", "add_arguments", "create", "decode_batch", "parse_topic"]

_log = logging.getLogger(__name__)

END_SEQ = -1
NO_EPOCH = "-"
_RETRY_S = 0.5
_TIERS = {"GPU": KVTier.GPU, "CPU": KVTier.CPU, "STORAGE": KVTier.DISK, "DISK": KVTier.DISK}


def parse_topic(topic: bytes) -> str:
    """The epoch in a topic ``<name>@<epoch>`` (``AgentlogScheduler``), else ``"-"``."""
    _, sep, epoch = topic.decode("utf-8", "replace").partition("@")
    return epoch if sep and epoch else NO_EPOCH


def hash_hex(value: int | bytes) -> str:
    if isinstance(value, bytes):
        return value.hex()
    return f"{value & (1 << 64) - 1:016x}"


def _tier(medium: Any) -> KVTier:
    return _TIERS.get(str(medium or "GPU").upper(), KVTier.GPU)


@dataclass
class SessionMap:
    """Which sessions hold each block (from ``BlockStored``), for ``BlockRemoved``."""

    holders: dict[str, set[str]]

    def stored(self, hashes: Iterable[str], session: str) -> None:
        for h in hashes:
            self.holders.setdefault(h, set()).add(session)

    def removed(self, hashes: Iterable[str]) -> dict[str, list[str]]:
        """session -> its removed hashes (``""``: nobody known), removing them from the map."""
        by_session: dict[str, list[str]] = {}
        for h in hashes:
            for session in sorted(self.holders.pop(h, set()) or {""}):
                by_session.setdefault(session, []).append(h)
        return by_session

    def cleared(self) -> None:
        self.holders.clear()


def decode_batch(
    engine_id: str, payload: bytes, sessions: SessionMap, unknown: collections.Counter[str] | None = None
) -> tuple[float, tuple[EngineKVEvent, ...]]:
    """One vLLM ``KVEventBatch`` as log events, each attributed to its session. Events of an
    unknown type are skipped (logged the first time, counted in ``unknown`` by type)."""
    decoded = msgspec.msgpack.decode(payload)
    if not isinstance(decoded, list) or len(decoded) < 2 or not isinstance(decoded[1], list):
        raise ValueError(f"not a vLLM KV event batch: {str(decoded)[:200]}")
    at, raw_events = float(decoded[0]), decoded[1]
    engine_session = engine_session_id(engine_id)
    events: list[EngineKVEvent] = []
    for raw in raw_events:
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind == "BlockStored":
            hashes = [hash_hex(h) for h in raw["block_hashes"]]
            parent = raw.get("parent_block_hash")
            session = raw.get("session_id") or ""
            if session:
                sessions.stored(hashes, session)
            body = KVBlocksStored(
                engine_id=engine_id,
                block_hashes=hashes,
                parent_block_hash=hash_hex(parent) if parent is not None else None,
                num_tokens=len(raw.get("token_ids") or ()),
                block_size=int(raw["block_size"]),
                tier=_tier(raw.get("medium")),
            )
            events.append(EngineKVEvent(SessionId(session) if session else engine_session, body))
        elif kind == "BlockRemoved":
            tier = _tier(raw.get("medium"))
            for session, hashes in sessions.removed(hash_hex(h) for h in raw["block_hashes"]).items():
                removed = KVBlocksRemoved(engine_id=engine_id, block_hashes=hashes, tier=tier)
                events.append(EngineKVEvent(SessionId(session) if session else engine_session, removed))
        elif kind == "AllBlocksCleared":
            sessions.cleared()
            events.append(EngineKVEvent(engine_session, KVAllBlocksCleared(engine_id=engine_id)))
        else:  # a newer vLLM's event: skipping it beats a bridge that crashes on every restart
            name = str(kind)
            if unknown is None or not unknown[name]:
                _log.warning("vLLM %s: skipping KV events of unknown type %r", engine_id, name)
            if unknown is not None:
                unknown[name] += 1
    return at, tuple(events)


@dataclass(frozen=True, slots=True)
class _Raw:
    epoch: str
    seq: int
    payload: bytes


class VllmKVSource:
    """The ``KVSource`` of one vLLM server (see the module docstring)."""

    def __init__(
        self, engine_id: str, events_endpoint: str, replay_endpoint: str, *, topic: str = "kv", timeout_s: float = 5.0
    ) -> None:
        self.engine_id = engine_id
        self.events_endpoint = events_endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.timeout_ms = int(timeout_s * 1000)
        self._ctx = zmq.asyncio.Context.instance()
        self._sub: zmq.asyncio.Socket | None = None
        self._sessions = SessionMap({})
        self._epoch: str | None = None
        self._next = 0  # the next seq to yield in self._epoch
        self.num_replayed = 0
        self.unknown_events: collections.Counter[str] = collections.Counter()  # type -> events skipped

    def _subscribe(self) -> zmq.asyncio.Socket:
        if self._sub is None:
            self._sub = self._ctx.socket(zmq.SUB)
            self._sub.setsockopt(zmq.LINGER, 0)
            self._sub.setsockopt(zmq.RCVHWM, 0)  # never drop a batch on our side
            self._sub.setsockopt(zmq.SUBSCRIBE, self.topic)
            self._sub.connect(self.events_endpoint)
        return self._sub

    async def _replay(self, start: int) -> list[_Raw]:
        """Every batch the engine still buffers from ``start`` (waits while vLLM is down)."""
        while True:
            socket = self._ctx.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(self.replay_endpoint)
            try:
                await socket.send_multipart([b"", start.to_bytes(8, "big")])
                batches: list[_Raw] = []
                while await socket.poll(self.timeout_ms):
                    frames = await socket.recv_multipart()
                    seq = int.from_bytes(frames[2], "big", signed=True)
                    if seq == END_SEQ:
                        self.num_replayed += len(batches)
                        return batches
                    batches.append(_Raw(parse_topic(frames[1]), seq, frames[3]))
            finally:
                socket.close(linger=0)
            _log.info("vLLM %s: no answer on its replay socket; retrying", self.engine_id)
            await asyncio.sleep(_RETRY_S)

    def _emit(self, raw: _Raw) -> EngineBatch:
        at, events = decode_batch(self.engine_id, raw.payload, self._sessions, self.unknown_events)
        self._epoch, self._next = raw.epoch, raw.seq + 1
        return EngineBatch(epoch=raw.epoch, seq=raw.seq, at=at, events=events)

    async def _accept(self, raw: _Raw, *, may_fill: bool = True) -> list[EngineBatch]:
        """The batches ``raw`` makes ready, in order (none when it was read already)."""
        if self._epoch is None:  # the first batch of a bridge that starts from the oldest one
            return [self._emit(raw)]
        if raw.epoch != self._epoch:
            _log.warning("vLLM %s restarted (epoch %s -> %s)", self.engine_id, self._epoch, raw.epoch)
            self._epoch, self._next = raw.epoch, 0
            self._sessions.cleared()  # a new engine run starts with an empty cache
        if raw.seq < self._next:
            return []
        if raw.seq == self._next:
            return [self._emit(raw)]
        if not may_fill:
            raise KVEventsLost(self._epoch, self._next, raw.seq)
        ready: list[EngineBatch] = []
        for missed in await self._replay(self._next):  # a gap in the live stream
            if missed.epoch == self._epoch and missed.seq <= raw.seq:
                ready += await self._accept(missed, may_fill=False)
        if self._next <= raw.seq:
            raise KVEventsLost(self._epoch, self._next, raw.seq)
        return ready

    async def batches(self, after: tuple[str, int] | None) -> AsyncIterator[EngineBatch]:
        sub = self._subscribe()
        self._epoch, self._next = (after[0], after[1] + 1) if after is not None else (None, 0)
        if self._epoch is not None and self._next == 0:
            self._sessions.cleared()
        # Catch up from the replay buffer; live batches queue on the SUB socket meanwhile.
        replayed = await self._replay(self._next)
        if replayed and self._epoch is not None and replayed[0].epoch != self._epoch:
            replayed = await self._replay(0)  # vLLM restarted since: the new run from its start
        if replayed and self._epoch is not None and replayed[0].epoch == self._epoch and replayed[0].seq > self._next:
            raise KVEventsLost(self._epoch, self._next, replayed[0].seq)
        for raw in replayed:
            for batch in await self._accept(raw, may_fill=False):
                yield batch
        while True:
            frames = await sub.recv_multipart()
            raw = _Raw(parse_topic(frames[0]), int.from_bytes(frames[1], "big"), frames[2])
            for batch in await self._accept(raw):
                yield batch

    async def aclose(self) -> None:
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None


class VllmActuator:
    """Carries out decisions through ``AgentlogScheduler``'s control channel.

    PRESERVE's ``ttl_ms`` is log time, sent as is (``ttl_s = ttl_ms / 1000`` on the scheduler's
    monotonic clock: no time-scale conversion on a real engine). ``None``: no expiry
    (``ttl_s = inf``; the pin lasts until a release, a discard or pressure). ``<= 0``: no pin
    (an immediate ``release``). Retries while the scheduler does not answer; a refusal
    (``{"ok": false}``) is ``ActuationRefused``, never retried.
    """

    def __init__(self, engine_id: str, control_endpoint: str) -> None:
        self.engine_id = engine_id
        self.control = ControlClient(control_endpoint)

    async def apply(self, session_id: SessionId, decision: CacheDecisionMade) -> None:
        action = decision.action
        request: dict[str, Any]
        if action is CacheAction.PRESERVE and (decision.ttl_ms is None or decision.ttl_ms > 0):
            ttl_s = math.inf if decision.ttl_ms is None else decision.ttl_ms / 1000
            request = {"op": "pin", "session": session_id, "ttl_s": ttl_s, "score": decision.score}
        elif action in (CacheAction.PRESERVE, CacheAction.RELEASE):  # PRESERVE here: a zero TTL, keep nothing
            request = {"op": "release", "session": session_id}
        elif action is CacheAction.DISCARD:
            request = {"op": "discard", "session": session_id}
        else:
            raise ActuationRefused(
                f"{action} is not available on vLLM here: no per-session host tier (vLLM's CPU platform keeps the KV "
                "cache in host memory and its offloading connectors refuse the platform); swap stays in the simulator"
            )
        op = request.pop("op")
        while True:
            try:
                await self.control.call(op, **request)
                return
            except ControlUnavailable as e:
                _log.info("vLLM %s: %s; retrying", self.engine_id, e)
                await asyncio.sleep(_RETRY_S)
            except ControlError as e:
                raise ActuationRefused(str(e)) from e

    async def aclose(self) -> None:
        await self.control.aclose()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument("--kv-events", default=env("AGENTLOG_VLLM_KV_EVENTS"), help="vLLM's KV events PUB endpoint")
    parser.add_argument("--kv-replay", default=env("AGENTLOG_VLLM_KV_REPLAY"), help="vLLM's KV events replay endpoint")
    parser.add_argument("--control", default=env("AGENTLOG_VLLM_CONTROL"), help="AgentlogScheduler's control socket")
    parser.add_argument("--kv-topic", default="kv", help="the KV events topic (before @epoch)")


def create(args: argparse.Namespace) -> tuple[VllmKVSource, VllmActuator]:
    missing = [name for name in ("kv_events", "kv_replay", "control") if not getattr(args, name)]
    if missing:
        flags = ", ".join("--" + name.replace("_", "-") for name in missing)
        raise SystemExit(f"vLLM bridge needs {flags} (or AGENTLOG_VLLM_* from workers.engines.vllm.server)")
    source = VllmKVSource(args.engine_id, args.kv_events, args.kv_replay, topic=args.kv_topic)
    return source, VllmActuator(args.engine_id, args.control)
