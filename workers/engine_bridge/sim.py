"""The simulated engine's side of the bridge: its ``/kv_events`` and ``/kv_control``.

The source polls ``GET /kv_events?after=N`` (see ``workers.engines.sim_server``); the
actuator posts each decision to ``POST /kv_control``. While the engine is unreachable
(restarting) both wait and retry; a new epoch means the engine restarted and its
numbering starts again at 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from schemas.events import (
    CacheDecisionMade,
    KVAllBlocksCleared,
    KVBlocksRemoved,
    KVBlocksStored,
    KVCacheHit,
    KVSwapCompleted,
    KVTier,
    SessionId,
)
from workers.engine_bridge.base import (
    ActuationRefused,
    EngineBatch,
    EngineKVEvent,
    KVBody,
    KVEventsLost,
    engine_session_id,
)

__all__ = ["SimActuator", "SimKVSource", "add_arguments", "create", "decode_event"]

_log = logging.getLogger(__name__)

_RETRY_S = 0.5


def decode_event(engine_id: str, raw: dict[str, Any]) -> EngineKVEvent:
    """One event of the sim server's JSON as a log event body with its session."""
    tier = KVTier(raw.get("tier", "GPU"))
    session = SessionId(raw["session_id"]) if raw.get("session_id") else engine_session_id(engine_id)
    hashes = [str(h) for h in raw.get("block_hashes", ())]
    body: KVBody
    if raw["kind"] == "stored":
        body = KVBlocksStored(
            engine_id=engine_id,
            block_hashes=hashes,
            parent_block_hash=raw.get("parent_block_hash"),
            num_tokens=int(raw["num_tokens"]),
            block_size=int(raw["block_size"]),
            tier=tier,
        )
    elif raw["kind"] == "removed":
        body = KVBlocksRemoved(engine_id=engine_id, block_hashes=hashes, tier=tier)
    elif raw["kind"] == "hit":
        body = KVCacheHit(
            engine_id=engine_id, call_id=str(raw["call_id"]), cached_tokens=int(raw["cached_tokens"]),
            prompt_tokens=int(raw["prompt_tokens"]), tier=tier,
        )  # fmt: skip
    elif raw["kind"] == "swapped":
        body = KVSwapCompleted(
            engine_id=engine_id, from_tier=KVTier(raw["from_tier"]), to_tier=KVTier(raw["to_tier"]),
            num_blocks=int(raw["num_blocks"]), duration_ms=float(raw["duration_ms"]),
        )  # fmt: skip
    elif raw["kind"] == "cleared":
        body = KVAllBlocksCleared(engine_id=engine_id)
        session = engine_session_id(engine_id)
    else:
        raise ValueError(f"unknown KV event kind {raw['kind']!r}")
    return EngineKVEvent(session, body)


class SimKVSource:
    def __init__(self, url: str, engine_id: str, *, poll_s: float = 0.05, limit: int = 1000) -> None:
        self.url = url.rstrip("/")
        self.engine_id = engine_id
        self.poll_s = poll_s
        self.limit = limit
        self._http = aiohttp.ClientSession()
        self.caught_up = asyncio.Event()  # set once it has handed out every batch the engine had buffered

    async def _fetch(self, after: int) -> dict[str, Any]:
        while True:
            try:
                async with self._http.get(
                    f"{self.url}/kv_events", params={"after": after, "limit": self.limit}
                ) as response:
                    response.raise_for_status()
                    result: dict[str, Any] = await response.json()
                    return result
            except (aiohttp.ClientError, OSError) as e:
                _log.info("engine %s not reachable (%s); retrying", self.engine_id, e)
                await asyncio.sleep(_RETRY_S)

    async def batches(self, after: tuple[str, int] | None) -> AsyncIterator[EngineBatch]:
        epoch, seq = after if after is not None else (None, 0)
        while True:
            page = await self._fetch(seq)
            if epoch is None:  # start from the oldest batch the engine still has
                epoch, seq = page["epoch"], page["first_seq"] - 1
            elif page["epoch"] != epoch:
                _log.warning("engine %s restarted (epoch %s -> %s)", self.engine_id, epoch, page["epoch"])
                epoch, seq = page["epoch"], 0  # a new run numbers its batches from 1
                continue
            if page["first_seq"] > seq + 1:
                raise KVEventsLost(epoch, seq + 1, page["first_seq"])
            for raw in page["batches"]:
                if raw["seq"] != seq + 1:
                    break  # the buffer moved between reads: ask again
                seq = raw["seq"]
                events = tuple(decode_event(self.engine_id, e) for e in raw["events"])
                yield EngineBatch(epoch=epoch, seq=seq, at=float(raw["at"]), events=events)
            if page["last_seq"] <= seq:
                self.caught_up.set()
                await asyncio.sleep(self.poll_s)

    async def aclose(self) -> None:
        await self._http.close()


class SimActuator:
    def __init__(self, url: str, engine_id: str) -> None:
        self.url = url.rstrip("/")
        self.engine_id = engine_id
        self._http = aiohttp.ClientSession()

    async def apply(self, session_id: SessionId, decision: CacheDecisionMade) -> None:
        payload = {
            "session_id": session_id,
            "action": str(decision.action),
            "ttl_ms": decision.ttl_ms,
            "score": decision.score,
        }
        while True:
            try:
                async with self._http.post(f"{self.url}/kv_control", json=payload) as response:
                    if response.status == 200:
                        return
                    # 409: the cache refused; anything else (a bad request, a server error) is
                    # refused too: retrying it forever would block every later decision.
                    text = await response.text()
                    try:
                        reason = json.loads(text).get("reason") or json.loads(text).get("error") or text
                    except (ValueError, AttributeError):
                        reason = text
                    raise ActuationRefused(f"HTTP {response.status}: {reason}")
            except (aiohttp.ClientConnectionError, OSError) as e:
                _log.info("engine %s not reachable (%s); retrying", self.engine_id, e)
                await asyncio.sleep(_RETRY_S)

    async def aclose(self) -> None:
        await self._http.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine-url", default="http://127.0.0.1:8100", help="the sim server's base URL")


def create(args: argparse.Namespace) -> tuple[SimKVSource, SimActuator]:
    return SimKVSource(args.engine_url, args.engine_id), SimActuator(args.engine_url, args.engine_id)
