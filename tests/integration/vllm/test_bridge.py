"""The engine bridge on a real vLLM server: KV events into ``kv.events``, decisions into vLLM.

The bridge runs as its own process (``python -m workers.engine_bridge --engine vllm``) on the
real Postgres log. While sessions run on vLLM (with churn, so blocks are also removed), the
bridge is SIGKILLed and started again. Then the log is compared with vLLM's replay buffer,
decoded independently here: every buffered batch's events are in ``kv.events`` under their
deterministic ids (nothing lost), each exactly once (nothing duplicated), and each session's
stored blocks are its own (the right session ids). A PRESERVE decision appended to
``kv.decisions`` becomes a pin inside vLLM's scheduler.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from cli.common import ensure_topics
from log import LoggedEvent, open_log
from schemas import events as ev
from tests.integration.vllm.conftest import (
    NUM_GPU_BLOCKS,
    TINY_MODEL,
    Vllm,
    VllmClient,
    _unavailable,
    vllm_client,
)
from workers.engine_bridge.core import kv_event_id
from workers.engine_bridge.vllm import SessionMap, VllmKVSource, decode_batch
from workers.engines.vllm.server import VllmServer, VllmServerConfig

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ENGINE_ID = "vllm-0"


def start_bridge(vllm: Vllm, pg_url: str, namespace: str, log_path: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "AGENTLOG_LOG_URL": pg_url, "AGENTLOG_NAMESPACE": namespace}
    argv = [sys.executable, "-m", "workers.engine_bridge", "--engine", "vllm", "--engine-id", ENGINE_ID]
    argv += ["--kv-events", vllm.kv_events, "--kv-replay", vllm.kv_replay, "--control", vllm.control]
    with log_path.open("ab") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)


def stop_bridge(bridge: subprocess.Popen[bytes]) -> None:
    """SIGTERM, and SIGKILL if it has not exited in 20 s: never leave a bridge behind."""
    try:
        bridge.send_signal(signal.SIGTERM)
        bridge.wait(timeout=20)
    finally:
        if bridge.poll() is None:
            bridge.kill()
            bridge.wait()


async def expected_from_replay_buffer(vllm: Vllm) -> dict[str, tuple[str, ev.Event]]:
    """event id -> (session, body) for every batch vLLM still buffers, decoded as a bridge would.

    vLLM's ``publish`` only queues a batch for its publisher thread, so a replay asked for right
    after a call or a discard could miss the last batches (which the bridge then logs: "extra"
    events). The scheduler's status says when the queue is empty."""
    async with vllm_client(vllm) as c:
        await c.until("vLLM published every KV batch", lambda status: status["kv_batches_unpublished"] == 0)
    source = VllmKVSource(ENGINE_ID, vllm.kv_events, vllm.kv_replay)
    try:
        raws = await source._replay(0)
    finally:
        await source.aclose()
    sessions = SessionMap({})
    expected: dict[str, tuple[str, ev.Event]] = {}
    for raw in raws:
        _, events = decode_batch(ENGINE_ID, raw.payload, sessions)
        for index, event in enumerate(events):
            expected[kv_event_id(ENGINE_ID, raw.epoch, raw.seq, index)] = (event.session_id, event.body)
    return expected


async def traffic(c: VllmClient, sessions: list[str], turns: int) -> dict[str, list[int]]:
    contexts = {s: c.tokens(3 * c.block_size + 8) for s in sessions}
    for _ in range(turns):
        for s in sessions:
            await c.complete(contexts[s], s)
            contexts[s] += c.tokens(c.block_size)
        await c.churn(0.5)  # evictions: BlockRemoved
    return contexts


def test_kv_events_reach_the_log_exactly_once_across_a_bridge_crash(
    vllm: Vllm, pg_url: str, namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTLOG_NAMESPACE", namespace)
    ensure_topics(pg_url)
    run = uuid.uuid4().hex[:6]
    sessions = [f"s{i}-{run}" for i in range(3)]
    log_path = tmp_path / "bridge.log"

    async def scenario() -> tuple[dict[str, tuple[str, ev.Event]], list[LoggedEvent], dict[str, object]]:
        bridge = start_bridge(vllm, pg_url, namespace, log_path)
        try:
            async with vllm_client(vllm) as c:
                await traffic(c, sessions, turns=2)
                await asyncio.sleep(0.5)
                bridge.send_signal(signal.SIGKILL)  # a crash: nothing flushed, nothing committed
                bridge.wait()
                await traffic(c, sessions, turns=2)  # batches the bridge misses while it is down
                bridge = start_bridge(vllm, pg_url, namespace, log_path)
                await traffic(c, sessions, turns=1)
                expected = await expected_from_replay_buffer(vllm)
                logged = await read_until(pg_url, set(expected), bridge, log_path)
                # Decisions out: a PRESERVE for a session that has just finished a call.
                await c.complete(c.tokens(4 * c.block_size + 8), f"keep-{run}")
                async with open_log(pg_url, actor="cache-manager") as manager:
                    decision = ev.CacheDecisionMade(
                        engine_id=ENGINE_ID, action=ev.CacheAction.PRESERVE, ttl_ms=60_000, score=2.5,
                        next_reference_ms=1000.0, num_blocks=4, reason="test",
                    )  # fmt: skip
                    await manager.append(f"keep-{run}", decision)
                pins: dict[str, object] = {}
                for _ in range(200):
                    pins = (await c.status())["pins"]
                    if f"keep-{run}" in pins:
                        break
                    await asyncio.sleep(0.05)
                return expected, logged, pins
        finally:
            stop_bridge(bridge)

    expected, logged, pins = asyncio.run(scenario())

    ids = [e.envelope.event_id for e in logged]
    duplicates = [i for i, n in collections.Counter(ids).items() if n > 1]
    assert not duplicates, f"{len(duplicates)} events appended twice"
    missing = set(expected) - set(ids)
    assert not missing, f"{len(missing)} of {len(expected)} buffered events never reached the log"
    for event in logged:
        if event.envelope.event_id in expected:
            session, body = expected[event.envelope.event_id]
            assert (event.session_id, event.body) == (session, body)

    by_session = collections.defaultdict(list)
    for event in logged:
        by_session[event.session_id].append(event.body)
    for s in sessions:
        stored = [b for b in by_session[s] if isinstance(b, ev.KVBlocksStored)]
        removed = [b for b in by_session[s] if isinstance(b, ev.KVBlocksRemoved)]
        assert stored and all(b.engine_id == ENGINE_ID and b.block_size == 32 for b in stored)
        assert removed, f"{s}: churn evicted its blocks, the log must say so"
        assert {h for b in removed for h in b.block_hashes} <= {h for b in stored for h in b.block_hashes}
    assert f"keep-{run}" in pins and pins[f"keep-{run}"]["score"] == 2.5  # type: ignore[index]


def bridge_alive(bridge: subprocess.Popen[bytes], log_path: Path) -> None:
    assert bridge.poll() is None, log_path.read_text()[-3000:]


async def read_until(
    pg_url: str, wanted: set[str], bridge: subprocess.Popen[bytes], log_path: Path
) -> list[LoggedEvent]:
    """Every kv.events record, once the log holds all of ``wanted`` (and a little after)."""
    logged: list[LoggedEvent] = []
    group = f"check-{uuid.uuid4().hex[:6]}"
    async with (
        open_log(pg_url, actor="operator") as log,
        log.consumer(group, ["kv.events"], from_beginning=True) as consumer,
    ):
        deadline = time.monotonic() + 90
        quiet_polls = 0
        while time.monotonic() < deadline and quiet_polls < 3:
            batch = await consumer.poll(timeout_s=0.5)
            logged += batch
            have = wanted <= {e.envelope.event_id for e in logged}
            quiet_polls = quiet_polls + 1 if have and not batch else 0
            bridge_alive(bridge, log_path)
    return logged


@pytest.mark.timeout(600)  # starts a vLLM server twice (about 35 s each on 2 cores, more on a busy machine)
def test_a_restarted_vllm_is_a_new_epoch_and_the_bridge_follows_it(
    vllm: Vllm, pg_url: str, namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM restarts under a running bridge: the new run's batches (numbered from 0 again) reach
    the log under the new epoch, none of the old run's is appended twice."""
    monkeypatch.setenv("AGENTLOG_NAMESPACE", namespace)
    ensure_topics(pg_url)
    run_dir = Path(tempfile.mkdtemp(prefix="agentlog-vllm-restart-"))
    config = VllmServerConfig(model=str(TINY_MODEL), run_dir=run_dir, num_gpu_blocks=NUM_GPU_BLOCKS)
    if not Path(config.python).exists() or not (TINY_MODEL / "model.safetensors").exists():
        _unavailable("needs the vLLM venv and the tiny model to start a second server")
    log_path = tmp_path / "bridge.log"

    async def epoch_of(c: VllmClient) -> str:
        return str((await c.control.call("hello"))["epoch"])

    async def scenario(server: VllmServer) -> tuple[list[str], dict[str, tuple[str, ev.Event]], list[LoggedEvent]]:
        # Built once the server has started: start() picks the port (kept across the restart).
        own = Vllm(config.url, config.served_model_name, config.kv_events, config.kv_replay, config.control)
        bridge = start_bridge(own, pg_url, namespace, log_path)
        try:
            async with vllm_client(own) as c:
                first = await epoch_of(c)
                await traffic(c, ["a"], turns=1)
            before = await expected_from_replay_buffer(own)  # the whole first run (its discards too)
            await read_until(pg_url, set(before), bridge, log_path)
            server.stop()
            server.start()
            async with vllm_client(own) as c:
                second = await epoch_of(c)
                await traffic(c, ["b"], turns=1)
            after = await expected_from_replay_buffer(own)
            logged = await read_until(pg_url, set(before) | set(after), bridge, log_path)
            return [first, second], before | after, logged
        finally:
            stop_bridge(bridge)

    server = VllmServer(config)
    try:
        server.start()
        epochs, expected, logged = asyncio.run(scenario(server))
    finally:
        server.stop()  # also when the bridge would not stop, or vLLM failed to start
    assert epochs[0] != epochs[1]
    ids = [e.envelope.event_id for e in logged]
    assert len(ids) == len(set(ids)), "an event appended twice"
    assert set(ids) == set(expected), "the log differs from what the two runs' replay buffers hold"
    assert {e.session_id for e in logged if isinstance(e.body, ev.KVBlocksStored)} >= {"a", "b"}
