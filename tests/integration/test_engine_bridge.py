"""The engine bridge with a real sim engine process and a real Kafka broker.

Events in: every KV event batch of the engine lands in ``kv.events`` exactly once, under
the right session, also when the bridge is SIGKILLed and restarted while the engine
keeps working. Decisions out: ``kv.decisions`` written by the cache manager's principal
steer the engine's cache (preserve keeps a prefix through competing load; without a
decision it is evicted; discard drops it; swap moves it to the host tier).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from cli.common import ensure_topics
from cli.stack import Process, free_port
from log import open_log
from log.types import system_clock
from schemas import events as ev
from schemas.events import CacheAction

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BLOCK = 16
ENGINE_ID = "sim-test"

KVKey = tuple[str, str, str, tuple[str, ...]]  # (session, kind, tier, hashes)


class Rig:
    def __init__(self, kafka: str, namespace: str, work: Path) -> None:
        self.log_url = f"kafka://{kafka}"
        self.namespace = namespace
        self.work = work
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**_base_env(), "AGENTLOG_NAMESPACE": namespace, "AGENTLOG_LOG_URL": self.log_url}
        self.engine = Process(
            "engine",
            [sys.executable, "-m", "workers.engines.sim_server", "--port", str(self.port),
             "--state-dir", str(work / "engine"), "--engine-id", ENGINE_ID, "--block-size", str(BLOCK),
             "--gpu-blocks", "16", "--host-blocks", "8", "--time-scale", "0.001"],
            env, work / "engine.log",
        )  # fmt: skip
        self.bridge = Process(
            "bridge",
            [sys.executable, "-m", "workers.engine_bridge", "--engine", "sim", "--engine-id", ENGINE_ID,
             "--engine-url", self.url],
            {**env, "AGENTLOG_INSTANCE_ID": "bridge-0"}, work / "bridge.log",
        )  # fmt: skip

    def wait_for_engine(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                self.get("/health")
                return
            except OSError:
                assert self.engine.alive(), self.engine.log_tail()
                time.sleep(0.1)
        raise TimeoutError("the sim engine did not start")

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=10) as response:
            return json.loads(response.read())

    def call(self, session: str, turn: int, tokens: int, max_tokens: int = 1) -> dict[str, Any]:
        """One LLM call whose prompt is ``tokens`` tokens of the session's own text (its
        turns extend one another, so a later turn can reuse an earlier turn's blocks)."""
        payload = {
            "request_id": f"{session}/{turn}",
            "session_id": session,
            "prompt_runs": [[session, tokens]],
            "max_tokens": max_tokens,
        }
        request = urllib.request.Request(
            f"{self.url}/v1/completions", json.dumps(payload).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            result: dict[str, Any] = json.loads(response.read())
        return result

    def engine_events(self) -> Counter[KVKey]:
        page = self.get("/kv_events?after=0&limit=10000")
        assert page["first_seq"] == 1, "the test's engine must still have all its batches"
        keys: Counter[KVKey] = Counter()
        for batch in page["batches"]:
            for e in batch["events"]:
                session = e["session_id"] or f"engine/{ENGINE_ID}"
                if e["kind"] == "hit":
                    keys[(session, "hit", e["tier"], (e["call_id"], str(e["cached_tokens"])))] += 1
                elif e["kind"] == "swapped":
                    keys[(session, "swapped", e["to_tier"], (e["from_tier"], str(e["num_blocks"])))] += 1
                else:
                    keys[(session, e["kind"], e["tier"], tuple(e["block_hashes"]))] += 1
        return keys

    async def _log_events(self) -> Counter[KVKey]:
        keys: Counter[KVKey] = Counter()
        kinds = {ev.KVBlocksStored: "stored", ev.KVBlocksRemoved: "removed"}
        async with (
            open_log(self.log_url, actor="auditor", namespace=self.namespace) as log,
            log.consumer(f"check-{uuid.uuid4().hex[:6]}", ["kv.events"], from_beginning=True) as consumer,
        ):
            idle = 0
            while idle < 2:
                events = await consumer.poll(timeout_s=0.5)
                idle = 0 if events else idle + 1
                for event in events:
                    body = event.body
                    assert isinstance(body, ev.KVBlocksStored | ev.KVBlocksRemoved | ev.KVCacheHit | ev.KVSwapCompleted)
                    assert body.engine_id == ENGINE_ID
                    if isinstance(body, ev.KVCacheHit):
                        key = (event.session_id, "hit", str(body.tier), (body.call_id, str(body.cached_tokens)))
                    elif isinstance(body, ev.KVSwapCompleted):
                        detail = (str(body.from_tier), str(body.num_blocks))
                        key = (event.session_id, "swapped", str(body.to_tier), detail)
                    else:
                        key = (event.session_id, kinds[type(body)], str(body.tier), tuple(body.block_hashes))
                    keys[key] += 1
        return keys

    def log_events(self) -> Counter[KVKey]:
        return asyncio.run(self._log_events())

    def wait_until_logged(self, timeout_s: float = 60) -> Counter[KVKey]:
        """Poll the log until it holds as many events as the engine published; return both."""
        deadline = time.monotonic() + timeout_s
        expected = self.engine_events()
        while True:
            logged = self.log_events()
            if logged.total() >= expected.total() or time.monotonic() > deadline:
                assert logged == expected, (
                    f"log has {logged.total()} events, engine {expected.total()}\n{self.bridge.log_tail()}"
                )
                return logged
            assert self.bridge.alive(), self.bridge.log_tail()

    def decide(self, session: str, action: CacheAction, ttl_ms: int | None = None, at: datetime | None = None) -> None:
        clock = (lambda: at) if at is not None else system_clock

        async def append() -> None:
            async with open_log(self.log_url, actor="cache-manager", namespace=self.namespace, clock=clock) as log:
                body = ev.CacheDecisionMade(
                    engine_id=ENGINE_ID, action=action, ttl_ms=ttl_ms, score=1.0,
                    next_reference_ms=1000.0, num_blocks=0, reason="test",
                )  # fmt: skip
                await log.append(session, body)

        asyncio.run(append())

    def wait_for(self, predicate: Any, what: str, timeout_s: float = 30, check_alive: bool = True) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert time.monotonic() < deadline, f"timed out waiting for {what}\n{self.bridge.log_tail()}"
            assert not check_alive or self.bridge.alive(), self.bridge.log_tail()
            time.sleep(0.1)


def _base_env() -> dict[str, str]:
    import os

    return dict(os.environ)


@pytest.fixture
def rig(kafka_bootstrap: str, namespace: str, tmp_path: Path) -> Any:
    ensure_topics(f"kafka://{kafka_bootstrap}", namespace=namespace)
    rig = Rig(kafka_bootstrap, namespace, tmp_path)
    rig.engine.start()
    try:
        rig.wait_for_engine()
        yield rig
    finally:
        rig.bridge.stop()
        rig.engine.stop()


@pytest.mark.parametrize("crash_at", ["", "bridge.before_append:2", "bridge.after_append:2"])
def test_every_engine_event_lands_once_across_a_bridge_crash(rig: Rig, crash_at: str) -> None:
    for i in range(3):
        rig.call(f"a{i}", 0, 3 * BLOCK)  # 3 full blocks each
    if crash_at:
        # The bridge kills itself in the middle of its second batch; its replacement goes on.
        rig.bridge.env = {**rig.bridge.env, "AGENTLOG_CRASH_AT": crash_at}
        rig.bridge.start()
        rig.wait_for(lambda: not rig.bridge.alive(), "the crash point", check_alive=False)
        assert "crash point" in rig.bridge.log_tail(5)
        rig.bridge.env = {**rig.bridge.env, "AGENTLOG_CRASH_AT": ""}
    rig.bridge.start()
    first = rig.wait_until_logged()
    assert {key[0] for key in first} == {"a0", "a1", "a2"}

    rig.bridge.kill()  # SIGKILL while idle, and the engine goes on without it
    for i in range(3):
        rig.call(f"b{i}", 0, 5 * BLOCK)  # 15 blocks more than fit: LRU evicts the a-sessions' blocks
    rig.call("a0", 1, 4 * BLOCK)
    rig.bridge.start()  # re-reads the engine's buffer from its first batch
    logged = rig.wait_until_logged()
    assert logged.total() > first.total()
    assert any(kind == "removed" and session.startswith("a") for session, kind, _, _ in logged)
    assert max(logged.values()) == 1, "an event was appended twice"


def test_decisions_steer_the_engine_cache(rig: Rig) -> None:
    rig.bridge.start()

    def compete(tag: str) -> None:
        # Two calls of 12 blocks each: the second needs blocks the first one left cached,
        # so anything not pinned that was freed before them is evicted (LRU).
        rig.call(f"{tag}-x", 0, 12 * BLOCK)
        rig.call(f"{tag}-y", 0, 12 * BLOCK)

    # Baseline: no decision, the prefix is evicted by the competing load.
    rig.call("plain", 0, 4 * BLOCK)
    compete("c1")
    assert rig.call("plain", 1, 5 * BLOCK)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    # Preserve: the pin keeps all 4 blocks of its context through the same load.
    rig.call("kept", 0, 4 * BLOCK)
    rig.decide("kept", CacheAction.PRESERVE, ttl_ms=600_000)
    rig.wait_for(lambda: "kept" in rig.get("/stats")["pinned_sessions"], "the pin")
    compete("c2")
    assert rig.call("kept", 1, 5 * BLOCK)["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * BLOCK

    # Discard: its blocks are dropped at once (removed events in the log), nothing to reuse.
    rig.decide("kept", CacheAction.DISCARD)
    rig.wait_for(lambda: "kept" not in rig.get("/stats")["pinned_sessions"], "the discard")
    assert rig.call("kept", 2, 6 * BLOCK)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    # Swap: its blocks move to the host tier and come back on the next call.
    rig.call("swapped", 0, 4 * BLOCK)
    rig.decide("swapped", CacheAction.SWAP)
    rig.wait_for(lambda: rig.get("/stats")["host_free_blocks"] == 4, "the swap")
    compete("c3")
    reply = rig.call("swapped", 1, 5 * BLOCK)
    assert reply["agentlog"]["swapped_in_blocks"] == 4
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * BLOCK  # not recomputed

    # Prefetch: swapped blocks come back before the call and are held like a PRESERVE, so the
    # competing load does not evict them and the call swaps nothing in.
    rig.call("fetched", 0, 4 * BLOCK)
    rig.decide("fetched", CacheAction.SWAP)
    rig.wait_for(lambda: rig.get("/stats")["host_free_blocks"] == 4, "the swap before the prefetch")
    rig.decide("fetched", CacheAction.PREFETCH, ttl_ms=600_000)
    rig.wait_for(lambda: "fetched" in rig.get("/stats")["pinned_sessions"], "the prefetch")
    assert rig.get("/stats")["host_free_blocks"] == 8
    compete("c4")
    reply = rig.call("fetched", 1, 5 * BLOCK)
    assert reply["agentlog"]["swapped_in_blocks"] == 0
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * BLOCK

    # A swap with no host room is refused and changes nothing; the bridge goes on.
    rig.call("big", 0, 10 * BLOCK)
    rig.decide("big", CacheAction.SWAP)
    rig.decide("big", CacheAction.PRESERVE, ttl_ms=600_000)
    rig.wait_for(lambda: "big" in rig.get("/stats")["pinned_sessions"], "the pin after a refused swap")
    assert "refused SWAP for big" in rig.bridge.log_tail(200)
    assert "released big instead" in rig.bridge.log_tail(200)  # a refused swap falls back to RELEASE

    # A stale decision (made before the session's latest call: that gap is over) is skipped.
    rig.call("late", 0, 4 * BLOCK)
    before_second_call = datetime.now(UTC)
    time.sleep(0.01)
    rig.call("late", 1, 5 * BLOCK)
    rig.wait_for(lambda: ("late", "hit", "GPU", ("1", str(4 * BLOCK))) in rig.log_events(), "the hit in the log")
    rig.decide("late", CacheAction.PRESERVE, ttl_ms=600_000, at=before_second_call)
    rig.wait_for(lambda: "stale PRESERVE for late skipped" in rig.bridge.log_tail(50), "the skip")
    assert "late" not in rig.get("/stats")["pinned_sessions"]

    logged = rig.wait_until_logged()
    assert ("swapped", "swapped", "CPU", ("GPU", "4")) in logged  # out, charged at PCIe bandwidth
    assert ("swapped", "swapped", "GPU", ("CPU", "4")) in logged  # and back in by its next call
    assert ("swapped", "hit", "CPU", ("1", str(4 * BLOCK))) in logged  # served from the host tier
    assert ("kept", "hit", "GPU", ("1", str(4 * BLOCK))) in logged
    assert ("swapped", "stored", "CPU") in {key[:3] for key in logged}  # fmt: skip
    assert any(key[0] == "kept" and key[1] == "removed" for key in logged)


# ---------------------------------------------------------------- the sim source on its own


async def _with_server(state_dir: Path, kv_buffer: int, body: Any, host_blocks: int = 0) -> None:
    """Run ``body(server, url)`` against a real sim server app served in-process (16 GPU blocks)."""
    from aiohttp import web

    from services.engine.cost import CostModel
    from services.engine.kv_cache import PagedKVCache
    from services.engine.sim import SimEngine
    from workers.engines.sim_server import SimServer

    server = SimServer(
        SimEngine(PagedKVCache(BLOCK, 16, host_blocks), CostModel(block_size=BLOCK)),
        state_dir,
        engine_id=ENGINE_ID,
        time_scale=0.0,
        kv_buffer=kv_buffer,
    )
    runner = web.AppRunner(server.app())
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        await body(server, f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()


def _call(server: Any, session: str, tokens: int) -> None:
    from schemas.events import SessionId
    from services.programs.base import TokenRun

    result = server.engine.call(SessionId(session), TokenRun(session, tokens).token_ids(), 1, now=0.0)
    server._publish(result.events)


def test_a_pin_the_pressure_valve_moves_to_the_host_is_logged_like_a_swap(rig: Rig) -> None:
    # Two sessions pinned through the log; a call that does not fit beside them takes the
    # lower-ranked pin (same score: the earlier expiry), whose blocks go to the host tier. The
    # bridge logs that move as it logs a SWAP decision's, and the session's next call swaps them
    # back in instead of recomputing them.
    rig.bridge.start()
    rig.call("early", 0, 4 * BLOCK)
    rig.decide("early", CacheAction.PRESERVE, ttl_ms=600_000)
    rig.wait_for(lambda: "early" in rig.get("/stats")["pinned_sessions"], "the first pin")
    rig.call("late", 0, 4 * BLOCK)
    rig.decide("late", CacheAction.PRESERVE, ttl_ms=600_000)
    rig.wait_for(lambda: "late" in rig.get("/stats")["pinned_sessions"], "the second pin")
    rig.call("big", 0, 12 * BLOCK)  # 8 blocks free beside the pins
    stats = rig.get("/stats")
    assert stats["pinned_sessions"] == ["late"] and stats["host_free_blocks"] == 4
    assert (stats["num_forced_swaps"], stats["num_forced_releases"]) == (1, 0)
    logged = rig.wait_until_logged()
    assert logged[("early", "swapped", "CPU", ("GPU", "4"))] == 1
    reply = rig.call("early", 1, 5 * BLOCK)
    assert reply["agentlog"]["swapped_in_blocks"] == 4
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * BLOCK  # not recomputed


def test_the_sim_source_reports_batches_it_can_no_longer_get(tmp_path: Path) -> None:
    from workers.engine_bridge.base import KVEventsLost
    from workers.engine_bridge.sim import SimKVSource

    async def body(server: Any, url: str) -> None:
        for i in range(4):
            _call(server, f"s{i}", 2 * BLOCK)  # one batch each; the buffer keeps the last 2
        source = SimKVSource(url, ENGINE_ID, poll_s=0.01)
        try:
            with pytest.raises(KVEventsLost) as lost:
                await anext(aiter(source.batches((server.epoch, 0))))
            assert (lost.value.first_missing, lost.value.first_available) == (1, 3)
            # From "the oldest it still has" there is nothing missing: batches 3 and 4.
            stream = source.batches(None)
            got = [await anext(stream), await anext(stream)]
            assert [b.seq for b in got] == [3, 4]
            assert [b.events[0].session_id for b in got] == ["s2", "s3"]
            await stream.aclose()
            # A cursor of an earlier engine run: the engine restarted, its new run starts at 1
            # (and here its first batches are gone, which is reported, not skipped silently).
            with pytest.raises(KVEventsLost) as lost:
                await anext(aiter(source.batches(("an-earlier-run", 7))))
            assert (lost.value.epoch, lost.value.first_missing) == (server.epoch, 1)
        finally:
            await source.aclose()

    asyncio.run(_with_server(tmp_path, 2, body))


def test_kv_control_rejects_bad_input_and_refuses_what_the_cache_cannot_do(tmp_path: Path) -> None:
    import aiohttp

    async def body(server: Any, url: str) -> None:
        async with aiohttp.ClientSession() as http:
            for payload in ({"session_id": "s"}, {"session_id": "s", "action": "KEEP"}, {"action": "SWAP"}):
                async with http.post(f"{url}/kv_control", json=payload) as response:
                    assert response.status == 400, payload
            _call(server, "s", 2 * BLOCK)
            async with http.post(f"{url}/kv_control", json={"session_id": "s", "action": "SWAP"}) as response:
                assert response.status == 409  # this engine has no host tier
                assert "OutOfBlocks" in (await response.json())["reason"]
            async with http.post(f"{url}/kv_control", json={"session_id": "s", "action": "DISCARD"}) as response:
                assert (await response.json()) == {"applied": True, "blocks": 2}
            async with http.get(f"{url}/kv_events", params={"after": "x"}) as response:
                assert response.status == 400
        assert server.engine.cache.blocks_of("s").num_context_blocks == 0

    asyncio.run(_with_server(tmp_path, 100, body))


@pytest.mark.parametrize("host_blocks", [0, 8], ids=["no host tier: released", "host tier: swapped"])
def test_a_call_that_does_not_fit_takes_the_lowest_ranked_pin(tmp_path: Path, host_blocks: int) -> None:
    import aiohttp

    async def body(server: Any, url: str) -> None:
        async with aiohttp.ClientSession() as http:

            async def control(session: str, action: str, **extra: Any) -> None:
                payload = {"session_id": session, "action": action, **extra}
                async with http.post(f"{url}/kv_control", json=payload) as response:
                    assert response.status == 200, await response.text()

            async def call(session: str, blocks: int, turn: int = 0) -> dict[str, Any]:
                payload = {"request_id": f"{session}/{turn}", "session_id": session,
                           "prompt_runs": [[session, blocks * BLOCK]], "max_tokens": 1}  # fmt: skip
                async with http.post(f"{url}/v1/completions", json=payload) as response:
                    assert response.status == 200, await response.text()
                    result: dict[str, Any] = await response.json()
                    return result

            await call("high", 4)
            await control("high", "PRESERVE", ttl_ms=600_000, score=2.0)
            await call("low", 4)
            await control("low", "PRESERVE", ttl_ms=600_000, score=1.0)
            await call("big", 12)  # 8 blocks are free: the lowest-ranked pin goes, not the call
            cache = server.engine.cache
            pinned = {sid for sid in cache.session_ids() if cache.blocks_of(sid).pinned}
            assert pinned == {"high"}
            if host_blocks:  # moved to the host tier (the next call swaps it in), reported as a swap
                assert (server.num_forced_swaps, server.num_forced_releases) == (1, 0)
                assert cache.blocks_of("low").num_host_blocks == 4
                async with http.get(f"{url}/kv_events", params={"after": "0"}) as response:
                    batches = (await response.json())["batches"]
                swaps = [e for b in batches for e in b["events"] if e.get("kind") == "swapped"]
                assert [(e["session_id"], e["from_tier"], e["to_tier"], e["num_blocks"]) for e in swaps] == [
                    ("low", "GPU", "CPU", 4)
                ]
                # Its next call reads the same context: swapped back in, not recomputed (all but the
                # last block: a prompt that hits whole still computes its last token, as vLLM's).
                again = await call("low", 4, turn=1)
                assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BLOCK
                assert again["agentlog"]["swapped_in_blocks"] == 3
            else:  # released: its blocks are LRU-evictable, and the big call evicted them
                assert (server.num_forced_swaps, server.num_forced_releases) == (0, 1)
            await call("whole", 16)  # the whole cache: every pin goes
            assert server.num_forced_swaps + server.num_forced_releases == 2

    asyncio.run(_with_server(tmp_path, 100, body, host_blocks))


def test_a_restarted_bridge_skips_decisions_its_backlog_shows_are_stale(rig: Rig) -> None:
    # While the bridge is down: a SWAP is decided during the session's gap, then the session
    # comes back. The bridge reads the engine's buffer before its first decision, so it knows.
    rig.call("back", 0, 4 * BLOCK)
    rig.decide("back", CacheAction.SWAP)
    time.sleep(0.01)
    rig.call("back", 1, 5 * BLOCK)
    rig.bridge.start()
    rig.wait_for(lambda: "stale SWAP for back skipped" in rig.bridge.log_tail(50), "the skip")
    assert rig.get("/stats")["host_free_blocks"] == 8  # nothing was swapped out


def test_an_error_reply_is_a_refusal_not_a_retry(tmp_path: Path) -> None:
    from aiohttp import web

    from workers.engine_bridge.base import ActuationRefused
    from workers.engine_bridge.sim import SimActuator

    async def failing(_request: web.Request) -> web.Response:
        return web.Response(status=500, text="boom")

    async def body() -> None:
        app = web.Application()
        app.router.add_post("/kv_control", failing)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        actuator = SimActuator(f"http://127.0.0.1:{port}", ENGINE_ID)
        try:
            decision = ev.CacheDecisionMade(
                engine_id=ENGINE_ID, action=CacheAction.RELEASE, score=0.0, num_blocks=0, reason="t"
            )
            with pytest.raises(ActuationRefused, match="HTTP 500: boom"):
                await actuator.apply("s", decision)  # type: ignore[arg-type]
        finally:
            await actuator.aclose()
            await runner.cleanup()

    asyncio.run(body())
