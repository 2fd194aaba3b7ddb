"""Hostile JSON to the sim engine's HTTP endpoints: a 4xx with a message, never a 500.

A real sim server (aiohttp, in-process, on a loopback port) gets arbitrary JSON bodies,
bodies shaped like a request with arbitrary values in its fields, and bytes that are not
JSON at all. Whatever it gets, it answers; an error is a 4xx whose JSON says what was wrong.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given
from hypothesis import strategies as st

from services.engine.cost import CostModel
from services.engine.kv_cache import PagedKVCache
from services.engine.sim import SimEngine
from tests.unit.fuzz.profile import FUZZ
from workers.engines.sim_server import SimServer

pytestmark = pytest.mark.integration

BLOCK = 16

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
# Values that look almost right: the fields' own types at their edges, and the wrong types.
VALUES = (
    JSON
    | st.integers(-(2**70), 2**70)
    | st.sampled_from(["", "s-1", "pin", "unpin", "swap", "prefetch", "drop", "1e309", "NaN"])
    | st.lists(st.tuples(st.text(max_size=4), st.integers(-5, 2**40)), max_size=3)
)
COMPLETION = st.fixed_dictionaries(
    {},
    optional={
        "request_id": VALUES,
        "session_id": VALUES,
        "max_tokens": VALUES,
        "prompt": VALUES,
        "prompt_runs": VALUES,
    },
)
MESSAGES = st.lists(
    st.fixed_dictionaries({}, optional={"role": VALUES, "content": VALUES, "tool_calls": VALUES, "name": VALUES}),
    max_size=3,
)
CHAT = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["fuzz-0", "sim", ""]) | VALUES,
        "messages": MESSAGES | VALUES,
        "max_tokens": VALUES,
        "tools": VALUES,
        "tool_choice": VALUES,
        "request_id": VALUES,
        "session_id": VALUES,
        "stream": VALUES,
    },
)
CONTROL = st.fixed_dictionaries(
    {}, optional={"session_id": VALUES, "action": VALUES, "ttl_ms": VALUES, "score": VALUES}
)


class Served:
    """One sim server and a client, on an event loop of their own (Hypothesis calls are sync)."""

    def __init__(self, state_dir: Path) -> None:
        self.loop = asyncio.new_event_loop()
        server = SimServer(
            SimEngine(PagedKVCache(BLOCK, 64, 16), CostModel(block_size=BLOCK)),
            state_dir,
            engine_id="fuzz-0",
            time_scale=0.0,
        )

        async def start() -> TestClient[Any, Any]:
            client: TestClient[Any, Any] = TestClient(TestServer(server.app()))
            await client.start_server()
            return client

        self.client = self.loop.run_until_complete(start())

    def request(self, method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
        async def call() -> tuple[int, Any]:
            async with self.client.request(method, path, **kwargs) as response:
                text = await response.text()
                assert response.status < 500, text
                return response.status, json.loads(text)

        return self.loop.run_until_complete(call())

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    served = Served(tmp_path_factory.mktemp("sim"))
    yield served
    served.close()


def _check(status: int, answer: Any) -> None:
    assert status < 500, answer
    if status >= 400:
        assert isinstance(answer, dict) and (answer.get("error") or answer.get("reason")), answer


@FUZZ
@given(body=JSON | COMPLETION)
def test_completions_answer_any_json_with_a_result_or_a_4xx(served: Served, body: Any) -> None:
    _check(*served.request("POST", "/v1/completions", json=body))


@FUZZ
@given(body=JSON | CHAT)
def test_chat_completions_answer_any_json_with_a_result_or_a_4xx(served: Served, body: Any) -> None:
    status, answer = served.request("POST", "/v1/chat/completions", json=body)
    assert status < 500, answer
    if status >= 400:
        assert isinstance(answer, dict) and answer.get("error"), answer  # OpenAI's {"error": {"message", ...}}


@FUZZ
@given(body=JSON | CONTROL)
def test_kv_control_answers_any_json_with_a_result_or_a_4xx(served: Served, body: Any) -> None:
    _check(*served.request("POST", "/kv_control", json=body))


@FUZZ
@given(data=st.binary(max_size=64), path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/kv_control"]))
def test_a_body_that_is_not_json_is_a_400(served: Served, data: bytes, path: str) -> None:
    status, answer = served.request("POST", path, data=data, headers={"Content-Type": "application/json"})
    _check(status, answer)


@FUZZ
@given(query=st.dictionaries(st.sampled_from(["after", "limit", "x"]), st.text(max_size=24), max_size=3))
def test_kv_events_answer_any_query_with_a_result_or_a_400(served: Served, query: dict[str, str]) -> None:
    _check(*served.request("GET", "/kv_events", params=query))
