"""Several engines behind one planner, on the real processes and a real Kafka broker.

Each test starts the stack (``cli.stack.Stack``: sim engines, each with its bridge, the planner,
decider, executor and the cache manager) on the shared broker in a namespace of its own, runs
script sessions through ``logctl run`` and reads the log and the engines' ``/stats`` back:

- cache locality: a session's calls after a tool gap go to the engine that holds its blocks, which
  serves their prefix from its cache; when that engine evicts part or all of them under pressure
  (no decision of the cache manager's), its ``kv.events`` say so and the next route expects what
  the engine kept, which is what it serves;
- failover: a SIGKILLed engine's sessions move to the other engine (reason ``failover``), which
  computes each moved call once, and every session finishes;
- model size: steps that declare ``small`` go to the small engine, the others to the large one, an
  operator's ``logctl pin-model`` is obeyed from the next call, and ``logctl audit --routes`` shows it;
  a step nobody declared is tried on the small model until the log says the small model does not
  complete it (its tool call aborted each time), then it goes to the large one.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from cli.common import ensure_topics
from cli.main import app
from cli.stack import Stack
from log import open_log
from schemas import events as ev

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def script(*steps: dict[str, Any]) -> dict[str, Any]:
    return {"steps": list(steps)}


def llm(prompt: int, output: int = 8, **extra: Any) -> dict[str, Any]:
    return {"llm": {"prompt_tokens": prompt, "output_tokens": output, **extra}}


def sleep(seconds: float) -> dict[str, Any]:
    return {"tool": "sleep", "arguments": {"seconds": seconds}}


class Routed:
    """The stack of one test and what its log says."""

    def __init__(self, kafka: str, namespace: str, work: Path, **stack: Any) -> None:
        self.log_url = f"kafka://{kafka}"
        self.namespace = namespace
        env = {"AGENTLOG_NAMESPACE": namespace, "AGENTLOG_LOG_LEVEL": "INFO", "AGENTLOG_ENGINE_DOWN_S": "60"}
        ensure_topics(self.log_url, namespace=namespace)
        self.stack = Stack(self.log_url, work, extra_env=env, cache_manager=True, num_engines=2, **stack)

    def run(self, args: dict[str, Any], *, sessions: int, prefix: str, wait: bool = True) -> list[str]:
        argv = ["run", "script", "--log-url", self.log_url, "-n", str(sessions), "--args", json.dumps(args)]
        argv += ["--prefix", prefix, "--timeout", "90"]
        if not wait:
            argv.append("--no-wait")
        ran = CliRunner().invoke(app, argv, env={"AGENTLOG_NAMESPACE": self.namespace})
        assert ran.exit_code == 0, ran.output + self.tails()
        return [f"{prefix}-{i:04d}" for i in range(sessions)]

    def cli(self, *argv: str) -> str:
        ran = CliRunner().invoke(app, [*argv, "--log-url", self.log_url], env={"AGENTLOG_NAMESPACE": self.namespace})
        assert ran.exit_code == 0, ran.output
        return ran.output

    def actions(self) -> dict[str, list[ev.Event]]:
        """Every session's agent.actions bodies, in log order."""

        async def read() -> dict[str, list[ev.Event]]:
            out: dict[str, list[ev.Event]] = defaultdict(list)
            async with open_log(self.log_url, actor="auditor", namespace=self.namespace) as log:
                for partition, end in (await log.end_offsets("agent.actions")).items():
                    async for record in log.scan("agent.actions", partition, 0, end):
                        envelope = log.decode(record)
                        out[envelope.session_id].append(envelope.body)
            return out

        return asyncio.run(read())

    def wait_until(self, done: Any, what: str, timeout_s: float = 60) -> dict[str, list[ev.Event]]:
        deadline = time.monotonic() + timeout_s
        while True:
            actions = self.actions()
            if done(actions):
                return actions
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} within {timeout_s:g} s\n{self.tails()}")
            time.sleep(0.3)

    def engine_stats(self, index: int) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.stack.url_of(index)}/stats", timeout=5) as response:
            stats: dict[str, Any] = json.loads(response.read())
            return stats

    def tails(self) -> str:
        return "\n".join(f"--- {n}\n{p.log_tail(15)}" for n, p in self.stack.processes.items())


def of(bodies: list[ev.Event], kind: type[ev.Model]) -> list[Any]:
    return [b for b in bodies if isinstance(b, kind)]


def finished(sessions: list[str]) -> Any:
    return lambda actions: all(of(actions.get(s, []), ev.SessionFinished) for s in sessions)


def test_calls_after_a_tool_gap_go_to_the_engine_that_holds_the_sessions_blocks(
    kafka_bootstrap: str, namespace: str, tmp_path: Path
) -> None:
    routed = Routed(kafka_bootstrap, namespace, tmp_path, time_scale=0.2)
    steps = script(llm(400), sleep(1.5), llm(32), sleep(1.5), llm(32))
    with routed.stack:
        sessions = routed.run(steps, sessions=4, prefix=f"loc-{uuid.uuid4().hex[:4]}")
        actions = routed.wait_until(finished(sessions), "every session finished")
        stats = [routed.engine_stats(0), routed.engine_stats(1)]
    for sid in sessions:
        bodies = actions[sid]
        routes = of(bodies, ev.EngineRouted)
        completed = of(bodies, ev.LLMCallCompleted)
        assert [r.call_id for r in routes] == ["llm-0", "llm-2", "llm-4"], routes
        home = routes[0].engine_id
        # After each gap: the engine of its blocks, chosen for them, and it served the prefix from its cache.
        for route, done in zip(routes[1:], completed[1:], strict=True):
            assert (route.engine_id, route.reason) == (home, "locality"), route
            assert route.expected_cached_tokens >= 400 and route.expected_recompute_tokens < route.prompt_tokens
            assert done.engine_id == home and done.cached_tokens >= 400, done
        # LLMCallStarted names the routed engine.
        assert [s.engine_id for s in of(bodies, ev.LLMCallStarted)] == [home] * 3
    # Every call was computed once, on the engine the log says served it.
    assert sum(s["num_served"] for s in stats) == 3 * len(sessions) and sum(s["num_replayed"] for s in stats) == 0


def kv_removed(routed: Routed, session_id: str, engine_id: str) -> int:
    """Blocks ``kv.events`` says the engine removed of the session so far."""

    async def read() -> int:
        count = 0
        async with open_log(routed.log_url, actor="auditor", namespace=routed.namespace) as log:
            for partition, end in (await log.end_offsets("kv.events")).items():
                async for record in log.scan("kv.events", partition, 0, end):
                    envelope = log.decode(record)
                    body = envelope.body
                    if isinstance(body, ev.KVBlocksRemoved) and envelope.session_id == session_id:
                        count += len(body.block_hashes) if body.engine_id == engine_id else 0
        return count

    return asyncio.run(read())


def pressure(routed: Routed, index: int, prompt_tokens: int) -> dict[str, Any]:
    """One call straight to engine ``index`` (no planner, no route): its blocks push others out, LRU."""
    body = {
        "request_id": f"pressure-{uuid.uuid4().hex[:8]}",
        "session_id": f"pressure-{uuid.uuid4().hex[:8]}",
        "prompt_runs": [[987_654, prompt_tokens]],
        "max_tokens": 1,
    }
    request = urllib.request.Request(
        f"{routed.stack.url_of(index)}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        answer: dict[str, Any] = json.loads(response.read())
        return answer


@pytest.mark.parametrize(
    ("pressure_tokens", "reason"),
    [
        # 64 blocks of 16 tokens. After the first call (400 + 8 tokens: 25 full blocks, 26 used) 39
        # blocks are free ahead of the session's 25 cached ones in the LRU queue, its tail first.
        (770, "locality"),  # 49 blocks: evicts 10 of its tail, it keeps 15 (240 tokens) there
        (1015, "least_loaded"),  # 64 blocks: evicts all of it; nobody holds any of it
    ],
    ids=["part", "all"],
)
def test_an_engines_eviction_shows_in_kv_events_and_the_next_route_expects_what_it_kept(
    pressure_tokens: int, reason: str, kafka_bootstrap: str, namespace: str, tmp_path: Path
) -> None:
    routed = Routed(kafka_bootstrap, namespace, tmp_path, time_scale=0.2, engine_args=["--gpu-blocks", "64"])
    steps = script(llm(400), sleep(40), llm(32))  # 8 s at the time scale: the test evicts in the gap
    with routed.stack:
        (sid,) = routed.run(steps, sessions=1, prefix=f"ev-{uuid.uuid4().hex[:4]}", wait=False)
        actions = routed.wait_until(lambda a: of(a.get(sid, []), ev.LLMCallCompleted), "the first call answered")
        home = of(actions[sid], ev.LLMCallCompleted)[0].engine_id
        index = int(home.rsplit("-", 1)[1])
        assert kv_removed(routed, sid, home) == 0
        pressure(routed, index, pressure_tokens)
        # The engine's removal of the session's blocks reaches kv.events (its bridge polls it).
        deadline = time.monotonic() + 10
        while (evicted := kv_removed(routed, sid, home)) == 0:
            assert time.monotonic() < deadline, routed.tails()
            time.sleep(0.2)
        early = [r for r in of(routed.actions()[sid], ev.EngineRouted) if r.call_id == "llm-2"]
        assert not early, f"the tool gap ended before the eviction was in the log: {early}"
        actions = routed.wait_until(finished([sid]), "the session finished")
    first, second = of(actions[sid], ev.EngineRouted)
    done = of(actions[sid], ev.LLMCallCompleted)[1]
    assert first.engine_id == home and second.call_id == "llm-2"
    # The route expected exactly what the engine then served from its cache (the log alone would
    # have expected the whole 408-token context back on its engine).
    assert second.expected_cached_tokens == done.cached_tokens, (second, done)
    assert second.reason == reason, second
    if reason == "locality":
        assert second.engine_id == home and done.engine_id == home
        assert 0 < second.expected_cached_tokens == 16 * (25 - evicted) < 400, (second, evicted)
        assert f"kv.events: {home} kept {second.expected_cached_tokens} of its 408 context tokens" in second.detail
    else:
        assert evicted == 25 and second.expected_cached_tokens == 0
        assert "no engine holds its prefix" in second.detail and "kept 0 of its 408" in second.detail


def test_a_forks_first_call_goes_where_its_parent_ran(kafka_bootstrap: str, namespace: str, tmp_path: Path) -> None:
    routed = Routed(kafka_bootstrap, namespace, tmp_path, time_scale=0.2)
    steps = script(llm(400), sleep(0.5), {"fork": [{"steps": [llm(32)]}, {"steps": [llm(48)]}]}, llm(16))
    with routed.stack:
        (parent,) = routed.run(steps, sessions=1, prefix=f"fk-{uuid.uuid4().hex[:4]}")
        actions = routed.wait_until(finished([parent]), "the parent finished")
    home = of(actions[parent], ev.EngineRouted)[0].engine_id
    branches = sorted(s for s in actions if s.startswith(f"{parent}."))
    assert len(branches) == 2, sorted(actions)
    for branch in branches:
        (route,) = of(actions[branch], ev.EngineRouted)  # the inherited call is the parent's, not routed again
        assert (route.engine_id, route.reason) == (home, "locality"), route
        assert route.expected_cached_tokens >= 400
        (done,) = of(actions[branch], ev.LLMCallCompleted)
        assert done.engine_id == home and done.cached_tokens >= 400, done


def test_a_forks_first_call_expects_what_kv_events_say_the_engine_kept_of_its_parents_prefix(
    kafka_bootstrap: str, namespace: str, tmp_path: Path
) -> None:
    routed = Routed(kafka_bootstrap, namespace, tmp_path, time_scale=0.2, engine_args=["--gpu-blocks", "64"])
    steps = script(llm(400), sleep(40), {"fork": [{"steps": [llm(32)]}]}, llm(16))
    with routed.stack:
        (parent,) = routed.run(steps, sessions=1, prefix=f"fkv-{uuid.uuid4().hex[:4]}", wait=False)
        actions = routed.wait_until(lambda a: of(a.get(parent, []), ev.LLMCallCompleted), "the first call answered")
        home = of(actions[parent], ev.LLMCallCompleted)[0].engine_id
        pressure(routed, int(home.rsplit("-", 1)[1]), 770)  # evicts 10 of the parent's 25 blocks there
        deadline = time.monotonic() + 10
        while (evicted := kv_removed(routed, parent, home)) == 0:
            assert time.monotonic() < deadline, routed.tails()
            time.sleep(0.2)
        assert not [s for s in routed.actions() if s.startswith(f"{parent}.")], "forked before the eviction"
        actions = routed.wait_until(finished([parent]), "the parent finished")
    (branch,) = [s for s in actions if s.startswith(f"{parent}.")]
    (route,) = of(actions[branch], ev.EngineRouted)  # the inherited call is the parent's, not routed again
    (done,) = of(actions[branch], ev.LLMCallCompleted)
    # The parent's blocks the engine kept (its kv.events, in the parent's partition) are the fork's prefix.
    assert (route.engine_id, route.reason) == (home, "locality"), route
    assert route.expected_cached_tokens == done.cached_tokens == 16 * (25 - evicted) == 240, (route, done)
    assert f"kv.events: {home} kept 240 of its 408 context tokens" in route.detail


def test_a_killed_engines_sessions_move_to_the_other_and_recompute_once(
    kafka_bootstrap: str, namespace: str, tmp_path: Path
) -> None:
    routed = Routed(kafka_bootstrap, namespace, tmp_path, time_scale=1.0)
    steps = script(llm(400), sleep(4), llm(32), sleep(0.2), llm(32))
    with routed.stack:
        sessions = routed.run(steps, sessions=4, prefix=f"fo-{uuid.uuid4().hex[:4]}", wait=False)
        actions = routed.wait_until(
            lambda a: all(of(a.get(s, []), ev.LLMCallCompleted) for s in sessions), "every first call answered"
        )
        homes = {s: of(actions[s], ev.LLMCallCompleted)[0].engine_id for s in sessions}
        victim = sorted(homes.values())[0]  # an engine that holds at least one session
        victim_index = int(victim.rsplit("-", 1)[1])
        survivor_index = 1 - victim_index
        survivor = routed.stack.engine_id(survivor_index)
        before = routed.engine_stats(survivor_index)["num_served"]
        routed.stack.processes["engine" if victim_index == 0 else f"engine-{victim_index}"].kill()
        actions = routed.wait_until(finished(sessions), "every session finished after the kill", timeout_s=90)
        after = routed.engine_stats(survivor_index)
    moved = [s for s in sessions if homes[s] == victim]
    assert moved
    for sid in moved:
        routes = of(actions[sid], ev.EngineRouted)
        failovers = [r for r in routes if r.reason == "failover"]
        assert len(failovers) == 1, routes
        (failover,) = failovers
        assert (failover.call_id, failover.engine_id, failover.failed_engine_id) == ("llm-2", survivor, victim)
        # Either its call found the engine dead (a second route of the same request), or another
        # session's call had found it dead already (its first route avoids it).
        if failover.attempt == 1:
            assert [(r.call_id, r.engine_id) for r in routes[1:3]] == [("llm-2", victim), ("llm-2", survivor)]
        else:
            assert failover.attempt == 0 and routes[1] is failover
        completed = of(actions[sid], ev.LLMCallCompleted)
        assert [c.engine_id for c in completed] == [victim, survivor, survivor]
        # Recomputed once on the survivor (nothing of it cached there), then its prefix is there.
        assert completed[1].cached_tokens == 0 and completed[2].cached_tokens >= 400
        assert routes[-1].engine_id == survivor and routes[-1].reason in ("locality", "only")  # the other is down
    # The survivor computed each call it served exactly once: the moved sessions' two calls each,
    # and the two remaining calls of the sessions that were at home there.
    stayed = [s for s in sessions if homes[s] == survivor]
    assert after["num_served"] - before == 2 * len(moved) + 2 * len(stayed)
    assert after["num_replayed"] == 0


def test_the_small_and_large_choice_follows_the_program_and_an_operator_pin(
    kafka_bootstrap: str, namespace: str, tmp_path: Path
) -> None:
    routed = Routed(kafka_bootstrap, namespace, tmp_path, time_scale=1.0, engine_sizes=["large", "small"])
    steps = script(
        llm(64, size="small"), sleep(0.2), llm(64, size="large"), sleep(4), llm(32, size="small"), sleep(0.2),
        llm(16, size="large"),
    )  # fmt: skip
    with routed.stack:
        (free, pinned) = routed.run(steps, sessions=2, prefix=f"sz-{uuid.uuid4().hex[:4]}", wait=False)
        # Pin the second session to the large model while it waits in its long tool gap.
        routed.wait_until(lambda a: len(of(a.get(pinned, []), ev.LLMCallCompleted)) >= 2, "two calls answered")
        assert "pinned to large" in routed.cli("pin-model", pinned, "large", "--reason", "needs the big one")
        actions = routed.wait_until(finished([free, pinned]), "both sessions finished")
        audit = json.loads(routed.cli("audit", "--routes", "--json"))
        table = routed.cli("audit", "--routes", "--session", pinned)
    sizes = {"sim-0": "large", "sim-1": "small"}
    free_routes = of(actions[free], ev.EngineRouted)
    assert [r.model_size for r in free_routes] == ["small", "large", "small", "large"], free_routes
    assert all(sizes[r.engine_id] == r.model_size for r in free_routes)
    assert [c.engine_id for c in of(actions[free], ev.LLMCallCompleted)] == [r.engine_id for r in free_routes]
    pinned_routes = of(actions[pinned], ev.EngineRouted)
    assert [r.model_size for r in pinned_routes] == ["small", "large", "large", "large"], pinned_routes
    assert [r.size_reason for r in free_routes] == ["declared by program"] * 4
    assert pinned_routes[2].size_reason == pinned_routes[3].size_reason == "pinned by operator"
    assert pinned_routes[2].engine_id == "sim-0"
    # logctl audit --routes shows every route with its size and why, and the pin.
    rows = [r for r in audit if r["session_id"] == pinned]
    assert [r["model_size"] for r in rows if r.get("pin") is None] == ["small", "large", "large", "large"]
    assert [(r["pin"], r["reason"]) for r in rows if r.get("pin") is not None] == [("large", "needs the big one")]
    assert "pinned to large" in table and "sim-1" in table and "4 routes, 1 pins" in table


def test_a_step_the_small_model_keeps_failing_goes_to_the_large_model_once_the_log_says_so(
    kafka_bootstrap: str, namespace: str, tmp_path: Path
) -> None:
    routed = Routed(kafka_bootstrap, namespace, tmp_path, time_scale=0.2, engine_sizes=["large", "small"])
    # Step 0 declares nothing; the tool it asks for is unknown, so the decider aborts it each time:
    # the step needed a retry. Step 2 (declared large) is that retry.
    steps = script(llm(64), {"tool": "no_such_tool", "arguments": {}}, llm(16, size="large"))
    prefix = f"lrn-{uuid.uuid4().hex[:4]}"
    with routed.stack:
        sessions = [routed.run(steps, sessions=1, prefix=f"{prefix}{i}")[0] for i in range(4)]  # one after another
        actions = routed.wait_until(finished(sessions), "every session finished")
        audit = json.loads(routed.cli("audit", "--routes", "--json", "--session", sessions[-1]))
    first = [of(actions[s], ev.EngineRouted)[0] for s in sessions]
    assert [(r.model_size, r.engine_id) for r in first] == [("small", "sim-1")] * 3 + [("large", "sim-0")]
    assert [r.size_reason for r in first] == [
        "trying the small model on this step (1 of 3)",
        "trying the small model on this step (2 of 3)",
        "trying the small model on this step (3 of 3)",
        "small model completed this step only 0/3 times",
    ]
    retries = [of(actions[s], ev.EngineRouted)[1] for s in sessions]
    assert [r.size_reason for r in retries] == ["retry after small failed"] * 3 + ["declared by program"]
    assert all(r.model_size == "large" for r in retries)
    assert audit[0]["size_reason"] == "small model completed this step only 0/3 times"


def test_logctl_up_starts_an_engine_and_a_bridge_per_engine_and_decisions_name_their_engine(
    kafka_bootstrap: str, namespace: str, tmp_path: Path
) -> None:
    import os

    from tests.logctl_up import logctl_up

    log_url = f"kafka://{kafka_bootstrap}"
    env = {**os.environ, "AGENTLOG_NAMESPACE": namespace}
    env.pop("AGENTLOG_KAFKA_CREDENTIALS", None)
    ensure_topics(log_url, namespace=namespace)
    flags = ["--insecure", "--time-scale", "0.2", "--work-dir", str(tmp_path), "--cache-manager", "--engines", "2",
             "--engine-sizes", "large,small"]  # fmt: skip
    with logctl_up(log_url, *flags, env=env) as up:
        assert {"engine", "engine-1", "engine-bridge", "engine-bridge-1", "cache-manager", "planner-0"} <= up.names
        engines = [line.split()[1:3] for line in up.started if line.startswith("engine ") and "sim-" in line]
        assert [e[1] for e in engines] == ["(sim-0,", "(sim-1,"], up.started
        # Sessions that declare the small model for every step, and sessions that declare the large
        # one: the small engine serves the first, the large one the others, whatever the router prefers.
        for size in ("small", "large"):
            steps = script(llm(200, size=size), sleep(1), llm(16, size=size))
            ran = CliRunner().invoke(
                app,
                ["run", "script", "--log-url", log_url, "-n", "3", "--args", json.dumps(steps), "--json"],
                env={"AGENTLOG_NAMESPACE": namespace},
            )
            assert ran.exit_code == 0, ran.output
            assert json.loads(ran.output.strip().splitlines()[-1])["finished"] == 3

        async def kv() -> tuple[set[str], set[str]]:
            stored: set[str] = set()
            decided: set[str] = set()
            async with open_log(log_url, actor="auditor", namespace=namespace) as log:
                for topic in ("kv.events", "kv.decisions"):
                    for partition, end in (await log.end_offsets(topic)).items():
                        async for record in log.scan(topic, partition, 0, end):
                            body = log.decode(record).body
                            if isinstance(body, ev.KVBlocksStored):
                                stored.add(body.engine_id)
                            if isinstance(body, ev.CacheDecisionMade):
                                decided.add(body.engine_id)
            return stored, decided

        # Both engines served calls, each bridge carried its engine's KV events in, and the cache
        # manager decided for each engine's sessions, naming the engine.
        deadline = time.monotonic() + 30
        while (found := asyncio.run(kv())) != ({"sim-0", "sim-1"}, {"sim-0", "sim-1"}):
            assert time.monotonic() < deadline, found
            time.sleep(0.5)


@pytest.mark.parametrize("crash_at", ["planner.after_routed:3", "planner.after_engine:3"])
def test_a_planner_killed_around_a_routed_call_completes_it_on_its_engine_once(
    crash_at: str, kafka_bootstrap: str, namespace: str, tmp_path: Path
) -> None:
    """Residual completion holds with routing: after a SIGKILL between the route and the call, or
    between the engine's answer and its record, the restarted planner sends the call where its route
    says (no second route), and that engine answers a repeated request from its record."""
    routed = Routed(kafka_bootstrap, namespace, tmp_path, time_scale=0.2)
    steps = script(llm(300), sleep(0.5), llm(32), sleep(0.5), llm(32))
    stack = routed.stack
    stack.cache_manager = False
    with stack:
        stack.processes["planner-0"].stop()
        stack.start_process("planner-0", {"AGENTLOG_CRASH_AT": crash_at})
        sessions = routed.run(steps, sessions=2, prefix=f"cr-{uuid.uuid4().hex[:4]}", wait=False)
        deadline = time.monotonic() + 60
        while stack.processes["planner-0"].alive():
            assert time.monotonic() < deadline, routed.tails()
            time.sleep(0.2)
        assert "crash point" in stack.processes["planner-0"].log_tail(40)
        stack.start_process("planner-0")
        actions = routed.wait_until(finished(sessions), "every session finished after the restart")
        stats = [routed.engine_stats(0), routed.engine_stats(1)]
    for sid in sessions:
        routes = of(actions[sid], ev.EngineRouted)
        assert [r.call_id for r in routes] == ["llm-0", "llm-2", "llm-4"], routes  # one route per call
        completed = of(actions[sid], ev.LLMCallCompleted)
        assert [c.engine_id for c in completed] == [r.engine_id for r in routes]
    # No call computed twice: every call once, and the one caught after the engine answered is
    # answered from that engine's record (so may another session's, answered but not yet logged
    # when the planner died).
    assert sum(s["num_served"] for s in stats) == 3 * len(sessions)
    replayed = sum(s["num_replayed"] for s in stats)
    assert replayed <= len(sessions) and (replayed >= 1 or not crash_at.startswith("planner.after_engine"))
