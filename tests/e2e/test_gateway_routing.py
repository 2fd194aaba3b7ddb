"""The gateway routes across several engines, through real processes on a real Kafka broker, driven by the
official ``openai`` client: two sim engines, planner, decider, executor and ``workers.gateway``, as
``logctl up --gateway --engines 2`` starts them (every process gets ``AGENTLOG_ENGINES``).

- locality: a gateway session's calls after a gap go to the engine that served it before, which serves
  their prefix from its cache; the first calls of concurrent sessions spread over both engines;
- failover: with one engine SIGKILLed, the next call of a session it served goes to the other engine
  (the same request id, a second route with reason ``failover``), is answered, computed there once, and
  its prefix stays there; a streamed call fails over too;
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
    def __init__(self, kafka: str, namespace: str, work: Path) -> None:
        self.log_url = f"kafka://{kafka}"
        self.namespace = namespace
        env = {"AGENTLOG_NAMESPACE": namespace, "AGENTLOG_GATEWAY_API_KEYS": API_KEY, "AGENTLOG_ENGINE_DOWN_S": "60"}
        self.stack = Stack(self.log_url, work, extra_env=env, gateway=True, num_engines=2)

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
