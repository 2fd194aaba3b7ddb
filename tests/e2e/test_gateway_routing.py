"""The gateway routes across several engines, through real processes on a real Kafka broker, driven by the
official ``openai`` client: two sim engines, planner, decider, executor and ``workers.gateway``, as
``logctl up --gateway --engines 2`` starts them (every process gets ``AGENTLOG_ENGINES``).

- locality: a gateway session's calls after a gap go to the engine that served it before, which serves
  their prefix from its cache; the first calls of concurrent sessions spread over both engines;
- failover: with one engine SIGKILLed, the next call of a session it served goes to the other engine
  (the same request id, a second route with reason ``failover``), is answered, computed there once, and
  its prefix stays there; a streamed call fails over too;
- eviction: when the engine evicts part or all of a gateway session's blocks in its gap (an unrouted call
  straight to it pushes them out, LRU), the engine's ``kv.events`` (which name the gateway's session: it
  forwards ``session_id``) reach the gateway, and its next route expects what the engine kept, as the
  planner's would (``services.placement``), says so in its detail, and the engine serves exactly that;
- ``logctl audit --routes`` shows the gateway sessions' routes (adopted by the planner as ``EngineRouted``).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from typer.testing import CliRunner

from cli.common import ensure_topics
from cli.main import app
from cli.stack import Stack
from log import open_log
from schemas import events as ev
from workers.gateway import SESSION_HEADER

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

API_KEY = "test-key-" + uuid.uuid4().hex[:8]
WORDS = " ".join(f"word{i}" for i in range(300))  # a long first prompt: a prefix worth keeping


class RoutedGateway:
    def __init__(
        self, kafka: str, namespace: str, work: Path, engine_args: list[str] | None = None, cache_manager: bool = False
    ) -> None:
        self.log_url = f"kafka://{kafka}"
        self.namespace = namespace
        env = {"AGENTLOG_NAMESPACE": namespace, "AGENTLOG_GATEWAY_API_KEYS": API_KEY, "AGENTLOG_ENGINE_DOWN_S": "60"}
        self.stack = Stack(
            self.log_url,
            work,
            extra_env=env,
            gateway=True,
            num_engines=2,
            engine_args=list(engine_args or []),
            cache_manager=cache_manager,  # the engine bridges: the engines' kv.events into the log
        )

    def start(self) -> None:
        ensure_topics(self.log_url, namespace=self.namespace)
        self.stack.start()
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.stack.gateway_url.removesuffix("/v1") + "/health", timeout=1):
                    return
            except OSError:
                assert self.stack.processes["gateway"].alive(), self.stack.processes["gateway"].log_tail()
                time.sleep(0.2)
        raise TimeoutError(self.stack.processes["gateway"].log_tail())

    def client(self, session: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.stack.gateway_url,
            api_key=API_KEY,
            default_headers={SESSION_HEADER: session},
            max_retries=0,
            timeout=60,
        )

    def stats(self, index: int) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.stack.url_of(index)}/stats", timeout=5) as response:
            stats: dict[str, Any] = json.loads(response.read())
            return stats

    def routes(self, session: str, num_routes: int, timeout_s: float = 60) -> list[dict[str, Any]]:
        """``logctl audit --routes --json`` of the session, once it shows ``num_routes`` routes."""
        deadline = time.monotonic() + timeout_s
        rows: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            ran = CliRunner().invoke(
                app,
                ["audit", "--routes", "--json", "--session", session, "--log-url", self.log_url],
                env={"AGENTLOG_NAMESPACE": self.namespace},
            )
            assert ran.exit_code == 0, ran.output
            rows = [r for r in json.loads(ran.output) if r.get("pin") is None]
            if len(rows) >= num_routes:
                return rows
            time.sleep(0.5)
        raise AssertionError(f"{session}: {len(rows)} routes, not {num_routes}\n{self.tails()}")

    def tails(self) -> str:
        return "\n".join(f"--- {n}\n{p.log_tail(15)}" for n, p in self.stack.processes.items())


@pytest.fixture
def gateway(kafka_bootstrap: str, namespace: str, tmp_path: Path) -> Iterator[RoutedGateway]:
    g = RoutedGateway(kafka_bootstrap, namespace, tmp_path)
    g.start()
    try:
        yield g
    finally:
        g.stack.stop()


class Conversation:
    """One agent's chat through the gateway: each call sends the whole conversation so far."""

    def __init__(self, gateway: RoutedGateway, name: str) -> None:
        self.session = f"{name}-{uuid.uuid4().hex[:6]}"
        self.client = gateway.client(self.session)
        self.messages: list[Any] = [{"role": "user", "content": f"{self.session}: {WORDS}"}]
        self.engines: list[str] = []
        self.cached: list[int] = []

    def say(self, text: str, *, stream: bool = False) -> str:
        if text:
            self.messages.append({"role": "user", "content": text})
        if stream:
            chunks = list(
                self.client.chat.completions.create(
                    model="sim", messages=self.messages, stream=True, stream_options={"include_usage": True}
                )
            )
            answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = next(c.usage for c in chunks if c.usage is not None)
        else:
            completion = self.client.chat.completions.create(model="sim", messages=self.messages)
            answer = completion.choices[0].message.content or ""
            usage = completion.usage
        assert answer and usage is not None
        details = usage.prompt_tokens_details
        self.cached.append(details.cached_tokens or 0 if details is not None else 0)
        self.messages.append({"role": "assistant", "content": answer})
        return answer


def _say_all(conversations: list[Conversation], text: str) -> None:
    """Every conversation's next call at once (so the router sees the others' calls queued)."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(conversations))

    def say(c: Conversation) -> None:
        try:
            barrier.wait(10)  # sent together: each is routed while the others are in flight (~100s of ms)
            c.say(text)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=say, args=(c,)) for c in conversations]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


def _engines(rows: list[dict[str, Any]]) -> list[tuple[str, int, str, str]]:
    return [(r["call_id"], r["attempt"], r["engine_id"], r["reason"]) for r in rows]


def test_a_gateway_sessions_calls_after_a_gap_go_to_the_engine_that_served_it(gateway: RoutedGateway) -> None:
    conversations = [Conversation(gateway, f"loc{i}") for i in range(4)]
    _say_all(conversations, "")
    time.sleep(1.5)  # the agent's tool runs: a gap
    for c in conversations:  # one at a time: each call sees empty queues, the holder wins on its prefix
        c.say("and then?")
    time.sleep(0.5)
    for c in conversations:
        c.say("once more")
    homes = set()
    for c in conversations:
        rows = gateway.routes(c.session, 3)
        home = rows[0]["engine_id"]
        homes.add(home)
        assert rows[0]["reason"] in ("least_loaded", "locality"), rows  # nothing held anywhere yet
        assert rows[0]["expected_cached_tokens"] == 0 and rows[0]["router"] == "locality"
        assert _engines(rows[1:]) == [("llm-1", 0, home, "locality"), ("llm-2", 0, home, "locality")], rows
        for row in rows[1:]:
            assert row["expected_cached_tokens"] >= 300 and row["expected_recompute_tokens"] < row["prompt_tokens"]
            assert row["cached_tokens"] is not None and row["cached_tokens"] >= 250, row  # served from its cache
        assert c.cached[0] == 0 and min(c.cached[1:]) >= 250, c.cached
    assert homes == {"sim-0", "sim-1"}, "concurrent first calls spread over both engines (queued tokens)"
    stats = [gateway.stats(0), gateway.stats(1)]
    assert sum(s["num_served"] for s in stats) == 3 * len(conversations)
    assert sum(s["num_replayed"] for s in stats) == 0


def test_a_killed_engines_sessions_move_to_the_other_and_recompute_once(gateway: RoutedGateway) -> None:
    conversations = [Conversation(gateway, f"fo{i}") for i in range(4)]
    _say_all(conversations, "")
    homes = {c.session: gateway.routes(c.session, 1)[0]["engine_id"] for c in conversations}
    assert set(homes.values()) == {"sim-0", "sim-1"}, homes
    victim, survivor, survivor_index = "sim-1", "sim-0", 0
    before = gateway.stats(survivor_index)["num_served"]
    gateway.stack.processes["engine-1"].kill()
    moved = [c for c in conversations if homes[c.session] == victim]
    stayed = [c for c in conversations if homes[c.session] == survivor]
    # The first moved session's call is streamed and finds the engine dead; the others know it is down.
    for i, c in enumerate(moved):
        assert c.say("after the crash", stream=i == 0)
        c.say("and after that")
    for c in stayed:
        c.say("after the crash")
        c.say("and after that")
    after = gateway.stats(survivor_index)
    for i, c in enumerate(moved):
        rows = gateway.routes(c.session, 3 + (i == 0))
        failover = [r for r in rows if r["reason"] == "failover"]
        assert len(failover) == 1, rows
        assert (failover[0]["call_id"], failover[0]["engine_id"], failover[0]["failed_engine_id"]) == (
            "llm-1",
            survivor,
            victim,
        )
        if i == 0:  # its streamed call went to the dead engine, then (same request) to the survivor
            assert _engines(rows[1:3]) == [("llm-1", 0, victim, "locality"), ("llm-1", 1, survivor, "failover")]
        else:  # the engine was known down: its first route is the failover
            assert failover[0]["attempt"] == 0
        assert rows[-1]["engine_id"] == survivor and rows[-1]["reason"] in ("locality", "only")
        # Recomputed once on the survivor (nothing of it was there), then its prefix is there.
        assert c.cached[1] == 0 and c.cached[2] >= 250, c.cached
    for c in stayed:
        rows = gateway.routes(c.session, 3)
        assert {r["engine_id"] for r in rows} == {survivor} and not [r for r in rows if r["reason"] == "failover"]
    # The survivor computed each call it got exactly once: nothing replayed, nothing twice.
    assert after["num_served"] - before == 2 * len(moved) + 2 * len(stayed)
    assert after["num_replayed"] == 0
    table = CliRunner().invoke(
        app,
        ["audit", "--routes", "--session", moved[0].session, "--log-url", gateway.log_url],
        env={"AGENTLOG_NAMESPACE": gateway.namespace},
    )
    assert table.exit_code == 0 and "failover" in table.output and moved[0].session[:24] in table.output


def test_the_planner_adopts_the_gateways_routes_before_each_llm_call_started(gateway: RoutedGateway) -> None:
    c = Conversation(gateway, "adopt")
    c.say("")
    c.say("again")
    gateway.routes(c.session, 2)

    async def read() -> list[type[ev.Model]]:
        async with open_log(gateway.log_url, actor="auditor", namespace=gateway.namespace) as log:
            out = []
            for partition, end in (await log.end_offsets("agent.actions")).items():
                async for record in log.scan("agent.actions", partition, 0, end):
                    envelope = log.decode(record)
                    if envelope.session_id == c.session:
                        out.append(type(envelope.body))
            return out

    kinds = [k for k in asyncio.run(read()) if k in (ev.EngineRouted, ev.LLMCallStarted)]
    assert kinds == [ev.EngineRouted, ev.LLMCallStarted] * 2, kinds


def _kv_removed(gateway: RoutedGateway, session_id: str, engine_id: str) -> int:
    """Blocks ``kv.events`` says the engine removed of the session so far."""

    async def read() -> int:
        count = 0
        async with open_log(gateway.log_url, actor="auditor", namespace=gateway.namespace) as log:
            for partition, end in (await log.end_offsets("kv.events")).items():
                async for record in log.scan("kv.events", partition, 0, end):
                    envelope = log.decode(record)
                    body = envelope.body
                    if isinstance(body, ev.KVBlocksRemoved) and envelope.session_id == session_id:
                        count += len(body.block_hashes) if body.engine_id == engine_id else 0
        return count

    return asyncio.run(read())


def _pressure(gateway: RoutedGateway, index: int, num_blocks: int) -> None:
    """One call straight to engine ``index`` (no gateway, no route) that takes ``num_blocks`` blocks of
    16 tokens (its prompt and its one output token): they push the LRU's blocks out."""
    body = {
        "request_id": f"pressure-{uuid.uuid4().hex[:8]}",
        "session_id": f"pressure-{uuid.uuid4().hex[:8]}",
        "prompt_runs": [[987_654, 16 * num_blocks - 1]],
        "max_tokens": 1,
    }
    request = urllib.request.Request(
        f"{gateway.stack.url_of(index)}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200


@pytest.mark.parametrize("evict", ["part", "all"])
def test_an_engines_eviction_in_a_gateway_sessions_gap_shows_in_its_next_route(
    evict: str, kafka_bootstrap: str, namespace: str, tmp_path: Path
) -> None:
    gateway = RoutedGateway(
        kafka_bootstrap, namespace, tmp_path, engine_args=["--gpu-blocks", "64"], cache_manager=True
    )
    gateway.start()
    try:
        c = Conversation(gateway, f"ev{evict}")
        c.say("")
        (first,) = gateway.routes(c.session, 1)
        home = first["engine_id"]
        index = int(home.rsplit("-", 1)[1])
        served = first["cached_tokens"], first["prompt_tokens"]
        context = _context(gateway, c.session)
        # 64 blocks of 16 tokens: the call's full blocks stay cached, the rest of the cache is free, ahead
        # of them in the LRU queue (its tail first). Taking the free ones and k more evicts its last k.
        full = context // 16
        prompt_blocks = _prompt_tokens(gateway, c.session) // 16
        k = full - prompt_blocks // 2 if evict == "part" else full  # "part": it keeps half its prompt's blocks
        _pressure(gateway, index, 64 - full + k if evict == "part" else 64)
        deadline = time.monotonic() + 15
        while (evicted := _kv_removed(gateway, c.session, home)) < k:  # the engine's bridge polls it
            assert time.monotonic() < deadline, (evicted, k, served, gateway.tails())
            time.sleep(0.2)
        assert evicted == k, (evicted, k)
        time.sleep(0.6)  # the gateway reads kv.events at most every 0.5 s
        c.say("and then?")
        second = gateway.routes(c.session, 2)[1]
    finally:
        gateway.stack.stop()
    kept = 16 * (full - k)
    # The route expected what the engine then served from its cache (its records alone would have
    # expected the whole context back on its engine), and says why.
    assert second["expected_cached_tokens"] == c.cached[1] == second["cached_tokens"] == kept, (second, c.cached)
    assert f"kv.events: {home} kept {kept} of its {context} context tokens" in second["detail"], second
    if evict == "part":
        assert 0 < kept < context and second["engine_id"] == home and second["reason"] == "locality", second
    else:
        assert kept == 0 and second["reason"] == "least_loaded", second
        assert "no engine holds its prefix" in second["detail"], second


def _served_calls(gateway: RoutedGateway, session_id: str) -> list[ev.GatewayLLMCallServed]:
    async def read() -> list[ev.GatewayLLMCallServed]:
        out = []
        async with open_log(gateway.log_url, actor="auditor", namespace=gateway.namespace) as log:
            for partition, end in (await log.end_offsets("agent.gateway")).items():
                async for record in log.scan("agent.gateway", partition, 0, end):
                    envelope = log.decode(record)
                    if envelope.session_id == session_id and isinstance(envelope.body, ev.GatewayLLMCallServed):
                        out.append(envelope.body)
        return out

    return asyncio.run(read())


def _context(gateway: RoutedGateway, session_id: str) -> int:
    """The context the session's (one) recorded call left on its engine: its prompt and its output."""
    (served,) = _served_calls(gateway, session_id)
    return served.prompt_tokens + served.output_tokens


def _prompt_tokens(gateway: RoutedGateway, session_id: str) -> int:
    (served,) = _served_calls(gateway, session_id)
    return served.prompt_tokens
