"""A real vLLM server (CPU build, tiny random model) for the integration tests.

``AGENTLOG_VLLM_URL`` and friends (``.ci/run`` starts one server with
``workers.engines.vllm.server`` and exports them) when set; else one started here for the
session, when ``scripts/install_vllm.sh`` and ``scripts/make_tiny_model.py`` have run (about
35 s on 2 cores); else the tests are skipped, or fail when ``AGENTLOG_REQUIRE_VLLM=1`` (CI).

Tests share the server: each uses its own random token prompts (no prefix in common with
another test) and discards its sessions' blocks when done.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from workers.engines.vllm.control import ControlClient
from workers.engines.vllm.server import VllmServer, VllmServerConfig, default_python, repo_root

TINY_MODEL = repo_root() / ".cache" / "tiny-llama"
NUM_GPU_BLOCKS = 48
STATE_WAIT_S = 60.0  # the longest a state change may take to show (vLLM on 2 loaded cores)


@dataclass(frozen=True)
class Vllm:
    url: str
    model: str
    kv_events: str
    kv_replay: str
    control: str


def _unavailable(reason: str) -> None:
    if os.environ.get("AGENTLOG_REQUIRE_VLLM") == "1":
        pytest.fail(f"AGENTLOG_REQUIRE_VLLM=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def vllm() -> Iterator[Vllm]:
    if url := os.environ.get("AGENTLOG_VLLM_URL"):
        yield Vllm(
            url,
            os.environ.get("AGENTLOG_VLLM_MODEL", "tiny"),
            os.environ["AGENTLOG_VLLM_KV_EVENTS"],
            os.environ["AGENTLOG_VLLM_KV_REPLAY"],
            os.environ["AGENTLOG_VLLM_CONTROL"],
        )
        return
    if not Path(default_python()).exists():
        _unavailable("no vLLM virtualenv: run scripts/install_vllm.sh")
    if not (TINY_MODEL / "model.safetensors").exists():
        _unavailable(f"no tiny model: run {default_python()} scripts/make_tiny_model.py")
    run_dir = Path(tempfile.mkdtemp(prefix="agentlog-vllm-"))
    config = VllmServerConfig(model=str(TINY_MODEL), run_dir=run_dir, num_gpu_blocks=NUM_GPU_BLOCKS)
    with VllmServer(config).start() as server:
        cfg = server.config
        yield Vllm(cfg.url, cfg.served_model_name, cfg.kv_events, cfg.kv_replay, cfg.control)


@pytest.fixture(scope="session")
def dev_vllm() -> Iterator[Vllm]:
    """A second server, the tests' own, for tests that must hold the engine still: vLLM's
    development endpoints (``VLLM_SERVER_DEV_MODE=1``: ``/pause?mode=keep`` schedules nothing until
    ``/resume``, and requests sent meanwhile wait in its queue), ``--scheduling-policy priority``
    and ``--max-num-seqs 1`` (one request runs at a time: the order queued requests complete in is
    the order vLLM admitted them). Holding the engine is what makes a test independent of the
    machine's load: a call that is held cannot end before the test has done what it races."""
    yield from _own_server(
        "agentlog-vllm-dev-",
        scheduling_policy="priority",
        extra_args=["--max-num-seqs", "1"],
        extra_env={"VLLM_SERVER_DEV_MODE": "1"},
    )


@pytest.fixture(scope="session")
def ranked_vllm() -> Iterator[Vllm]:
    """A server with ``--scheduling-policy priority`` and ranked pins (``--ranked-pins``: a waiting
    call takes no pin of a program that outranks it), the tests' own."""
    yield from _own_server("agentlog-vllm-ranked-", scheduling_policy="priority", ranked_pins=True)


def _own_server(prefix: str, **config: Any) -> Iterator[Vllm]:
    """A tiny-model server of the tests' own (pool: ``NUM_GPU_BLOCKS``), with ``config``'s options."""
    if not Path(default_python()).exists():
        _unavailable("no vLLM virtualenv: run scripts/install_vllm.sh")
    if not (TINY_MODEL / "model.safetensors").exists():
        _unavailable(f"no tiny model: run {default_python()} scripts/make_tiny_model.py")
    run_dir = Path(tempfile.mkdtemp(prefix=prefix))
    server_config = VllmServerConfig(model=str(TINY_MODEL), run_dir=run_dir, num_gpu_blocks=NUM_GPU_BLOCKS, **config)
    with VllmServer(server_config).start() as server:
        cfg = server.config
        yield Vllm(cfg.url, cfg.served_model_name, cfg.kv_events, cfg.kv_replay, cfg.control)


class VllmClient:
    """Completions with token prompts, and the scheduler's control channel."""

    def __init__(self, vllm: Vllm, http: aiohttp.ClientSession, control: ControlClient) -> None:
        self.vllm = vllm
        self.http = http
        self.control = control
        self.rng = random.Random()
        self.sessions: set[str] = set()
        self.block_size = 0
        self.num_gpu_blocks = 0

    def tokens(self, n: int) -> list[int]:
        """Random token ids: a prefix no other prompt shares."""
        return [self.rng.randrange(3, 4000) for _ in range(n)]

    async def complete(
        self,
        prompt: list[int] | str,
        session: str,
        max_tokens: int = 4,
        ignore_eos: bool = False,
        priority: int | None = None,
        **xargs: Any,
    ) -> Any:
        self.sessions.add(session)
        body: dict[str, Any] = {
            "model": self.vllm.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "session_id": session,
            "ignore_eos": ignore_eos,
        }
        if priority is not None:
            body["priority"] = priority
        if xargs:
            body["vllm_xargs"] = xargs
        async with self.http.post(f"{self.vllm.url}/v1/completions", json=body) as response:
            answer = await response.json()
            assert response.status == 200, answer
            return answer

    async def cached(self, prompt: list[int], session: str, **xargs: Any) -> int:
        answer = await self.complete(prompt, session, **xargs)
        return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])

    async def status(self) -> dict[str, Any]:
        return await self.control.call("status")

    async def until(self, what: str, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """Poll the scheduler's status until ``done`` says so (a state decides, never a sleep)."""
        deadline = time.monotonic() + STATE_WAIT_S
        while True:
            status = await self.status()
            if done(status):
                return status
            assert time.monotonic() < deadline, f"{what}: not after {STATE_WAIT_S:g} s; vLLM's state: {status}"
            await asyncio.sleep(0.02)

    async def pause(self) -> None:
        """``dev_vllm`` only: vLLM schedules nothing until ``resume`` and requests sent meanwhile wait
        in its queue. (A request running when it pauses goes back to the waiting queue, so a running
        "blocker" would hold nothing: the pause is what holds the engine.)"""
        await self._dev("/pause?mode=keep")

    async def resume(self) -> None:
        await self._dev("/resume")

    async def _dev(self, path: str) -> None:
        async with self.http.post(f"{self.vllm.url}{path}") as response:
            assert response.status == 200, await response.text()

    async def churn(self, rounds: float = 2.0) -> None:
        """Other sessions' calls that cycle the whole KV pool ``rounds`` times (LRU evicts all unpinned)."""
        length = (self.num_gpu_blocks // 2) * self.block_size
        for i in range(int(rounds * self.num_gpu_blocks * self.block_size / length) + 1):
            await self.complete(self.tokens(length), f"churn-{self.rng.getrandbits(32):x}-{i}")


@contextlib.asynccontextmanager
async def vllm_client(vllm: Vllm) -> AsyncIterator[VllmClient]:
    """A client for one test; discards the blocks of every session it used when done."""
    control = ControlClient(vllm.control)
    try:
        async with aiohttp.ClientSession() as http:
            c = VllmClient(vllm, http, control)
            hello = await control.call("hello")
            c.block_size, c.num_gpu_blocks = int(hello["block_size"]), int(hello["num_gpu_blocks"])
            try:
                yield c
            finally:
                for session in c.sessions:
                    await control.call("discard", session=session)
    finally:  # also when hello or a discard fails: an unclosed socket is a ResourceWarning (an error) later
        await control.aclose()


def run(vllm: Vllm, scenario: Callable[[VllmClient], Awaitable[None]]) -> None:
    """``scenario`` with a fresh client (``vllm_client``) on ``vllm``."""

    async def main() -> None:
        async with vllm_client(vllm) as client:
            await scenario(client)

    asyncio.run(main())


def context_len(client: VllmClient, num_blocks: int) -> int:
    """A prompt length with ``num_blocks`` full blocks and room for 4 output tokens in the next."""
    return num_blocks * client.block_size + client.block_size // 4
