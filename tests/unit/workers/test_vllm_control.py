"""The control channel answers every request, and the vLLM actuator's mapping of decisions.

In-process (``inproc://`` on one ZMQ context): the real ``ControlServer`` / ``ControlClient``
with a handler standing in for the scheduler's ``_on_control``, which needs a running vLLM
(covered by ``tests/integration/vllm``).
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
import zmq.asyncio

from schemas.events import CacheAction, CacheDecisionMade, SessionId
from workers.engine_bridge.base import ActuationRefused
from workers.engine_bridge.vllm import VllmActuator
from workers.engines.vllm.control import ControlClient, ControlError, ControlServer

pytestmark = pytest.mark.unit


class Scheduler:
    """Records requests; ``fail`` makes the next ones raise (a bug inside the scheduler)."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.fail: Exception | None = None

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        self.requests.append(request)
        if self.fail is not None:
            raise self.fail
        return {"num_blocks": 3}


@pytest.fixture
def served() -> Iterator[tuple[str, Scheduler]]:
    endpoint = f"inproc://control-{uuid.uuid4().hex}"
    # The client uses the asyncio context singleton; inproc needs the server on the same context.
    context: zmq.Context[Any] = zmq.Context.shadow(zmq.asyncio.Context.instance().underlying)
    scheduler = Scheduler()
    server = ControlServer(endpoint, scheduler.handle, lambda: None, tick_s=0.01, context=context)
    try:
        yield endpoint, scheduler
    finally:
        server.close()


def decision(action: CacheAction, ttl_ms: int | None) -> CacheDecisionMade:
    return CacheDecisionMade(engine_id="vllm-0", action=action, ttl_ms=ttl_ms, score=1.5, num_blocks=3, reason="test")


def test_a_handler_that_crashes_still_gets_an_error_reply(served: tuple[str, Scheduler]) -> None:
    endpoint, scheduler = served
    scheduler.fail = KeyError("block 7")

    async def call() -> None:
        client = ControlClient(endpoint, timeout_s=5)
        try:
            with pytest.raises(ControlError, match="KeyError"):
                await client.call("release", session="s")
            scheduler.fail = None  # the server lives on and answers the next request
            assert (await client.call("release", session="s"))["num_blocks"] == 3
        finally:
            await client.aclose()

    asyncio.run(call())
    assert len(scheduler.requests) == 2


def test_the_actuator_turns_a_refusal_into_actuation_refused_without_retrying(served: tuple[str, Scheduler]) -> None:
    endpoint, scheduler = served
    scheduler.fail = RuntimeError("boom")

    async def apply() -> None:
        actuator = VllmActuator("vllm-0", endpoint)
        try:
            with pytest.raises(ActuationRefused, match="boom"):
                await actuator.apply(SessionId("s"), decision(CacheAction.PRESERVE, 5000))
        finally:
            await actuator.aclose()

    asyncio.run(apply())
    assert len(scheduler.requests) == 1


def test_preserve_ttls_map_to_pins_without_expiry_and_zero_to_release(served: tuple[str, Scheduler]) -> None:
    endpoint, scheduler = served

    async def apply() -> None:
        actuator = VllmActuator("vllm-0", endpoint)
        try:
            for ttl_ms in (2500, None, 0):
                await actuator.apply(SessionId("s"), decision(CacheAction.PRESERVE, ttl_ms))
        finally:
            await actuator.aclose()

    asyncio.run(apply())
    sent = [(r["op"], r.get("ttl_s"), r.get("score")) for r in scheduler.requests]
    assert sent[0] == ("pin", 2.5, 1.5)  # log time, unconverted
    assert sent[1][0] == "pin" and sent[1][1] == math.inf and sent[1][2] == 1.5  # no expiry
    assert sent[2] == ("release", None, None)
