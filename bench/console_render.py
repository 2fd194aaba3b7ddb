"""The web console's render time on a log of 100,000+ events, page beside page in one run.

    python -m bench.console_render [--log-url POSTGRES] [--sessions 880] [--turns 16] [--big-turns 1500] [--rounds 30]

Writes a fresh namespace of the Postgres log: ``--sessions`` sessions of ``--turns`` turns
(each turn an LLM call, a tool call proposed, committed, started and completed, and a KV cache
decision: 7 events) plus one long session of ``--big-turns`` turns, so about 115 events a
session and, with the defaults, 112,000 events in all. The projector (``workers.projector``)
projects it into a fresh read model; then the console (``workers.console.serve``, logged in
as an operator) answers GETs of the sessions list, a typical session's page, the long
session's page, the waiting calls and the cache page, each round in that order, timed from
request to the last byte of the answer on loopback (so: the queries, the log's history of the
session, and the rendering). It prints the median and 95th percentile per page and the ratio
to the sessions list; it is never a test.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid
from datetime import UTC, datetime, timedelta

import aiohttp

from cli.common import init_log
from log import Draft, open_log
from log.embedded import start_embedded
from schemas import events as ev
from workers.console import ConsoleConfig, serve
from workers.projector import ReadModel, rebuild

PASSWORD = uuid.uuid4().hex
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _session(sid: str, turns: int, start: datetime) -> dict[str, list[Draft]]:
    """A session's drafts per writer, with times one second a turn apart."""
    out: dict[str, list[Draft]] = {a: [] for a in ("operator", "planner", "decider", "executor", "cache-manager")}
    at = start

    def add(actor: str, body: ev.Event, step_ms: float = 50) -> None:
        nonlocal at
        at += timedelta(milliseconds=step_ms)
        out[actor].append(Draft(sid, body, occurred_at=at))

    add("operator", ev.SessionRequested(program="trace", args_json="{}", author="bench"))
    add("planner", ev.SessionStarted(program="trace", args_json="{}"))
    for turn in range(turns):
        llm, tool = f"llm-{2 * turn}", f"tool-{2 * turn + 1}"
        prompt = 512 + 256 * turn
        add("planner", ev.LLMCallStarted(call_id=llm, turn=turn, engine_id="sim-0", prompt_tokens=prompt,
                                         max_output_tokens=64, prompt_digest="d"))  # fmt: skip
        done = ev.LLMCallCompleted(
            call_id=llm, engine_id="sim-0", prompt_tokens=prompt, cached_tokens=max(0, prompt - 256),
            output_tokens=64, output_text="", finish_reason="stop", queue_ms=1, prefill_ms=20, decode_ms=100,
        )  # fmt: skip
        add("planner", done, 200)
        key = f"{sid}/{tool}"
        add("planner", ev.ToolCallProposed(call_id=tool, tool="search", arguments_json='{"q": "x"}',
                                           effect_class=ev.EffectClass.PURE, idempotency_key=key))  # fmt: skip
        votes = [ev.Vote(voter="allow_list", decision=ev.VoteDecision.APPROVE, reason="allowed")]
        add("decider", ev.ToolCallCommitted(call_id=tool, votes=votes, policy="unanimous"))
        add("cache-manager", ev.CacheDecisionMade(engine_id="sim-0", action=ev.CacheAction.PRESERVE, ttl_ms=800,
                                                  score=1.0, num_blocks=32 + turn, reason="tool gap"))  # fmt: skip
        add("executor", ev.ToolCallStarted(call_id=tool, tool="search", idempotency_key=f"{sid}/{tool}", attempt=1))
        add("executor", ev.ToolCallCompleted(call_id=tool, result_json="{}", result_tokens=256, duration_ms=500), 500)
    add("planner", ev.SessionFinished(output_json="{}", num_llm_calls=turns, num_tool_calls=turns))
    return out


async def _write(url: str, namespace: str, sessions: int, turns: int, big_turns: int) -> int:
    await init_log(url, 4, namespace=namespace)
    by_actor: dict[str, list[Draft]] = {}
    for i in range(sessions + 1):
        sid, n = (f"long-{i:04d}", big_turns) if i == sessions else (f"s-{i:04d}", turns)
        for actor, drafts in _session(sid, n, T0 + timedelta(seconds=3 * i)).items():
            by_actor.setdefault(actor, []).extend(drafts)
    total = 0
    for actor, drafts in by_actor.items():
        async with open_log(url, actor=actor, namespace=namespace) as log:
            for i in range(0, len(drafts), 2000):
                total += len(await log.append_many(drafts[i : i + 2000]))
    return total


async def _bench(url: str, namespace: str, args: argparse.Namespace) -> None:
    began = time.monotonic()
    total = await _write(url, namespace, args.sessions, args.turns, args.big_turns)
    wrote_s = time.monotonic() - began
    began = time.monotonic()
    async with open_log(url, actor="projector", namespace=namespace) as log:
        projector = await rebuild(log, url, group=f"projector-{namespace}")
    projected_s = time.monotonic() - began
    print(f"log: {total:,} events ({args.sessions} sessions of {args.turns} turns, one of {args.big_turns}) "
          f"written in {wrote_s:.1f} s; projected ({projector.num_projected:,}) in {projected_s:.1f} s")  # fmt: skip

    stop, ready = asyncio.Event(), asyncio.get_running_loop().create_future()
    config = ConsoleConfig(PASSWORD, None, os.urandom(32))
    task = asyncio.create_task(serve(config, url, url, "127.0.0.1", 0, ready=ready.set_result, stop=stop))
    port = await asyncio.wait_for(ready, 30)
    pages = {
        "sessions list (200 rows)": "/",
        f"session page, {7 * args.turns + 3} events": f"/sessions/s-{args.sessions // 2:04d}",
        f"session page, {7 * args.big_turns + 3:,} events": f"/sessions/long-{args.sessions:04d}",
        "waiting calls": "/waiting",
        "cache page": "/cache",
    }
    times: dict[str, list[float]] = {name: [] for name in pages}
    long_id, history_ms = f"long-{args.sessions:04d}", []
    sizes: dict[str, int] = {}
    log = await open_log(url, actor="auditor", namespace=namespace).start()
    try:
        async with aiohttp.ClientSession(
            f"http://127.0.0.1:{port}", cookie_jar=aiohttp.CookieJar(unsafe=True)
        ) as client:
            async with client.post("/login", data={"password": PASSWORD}, allow_redirects=False) as r:
                assert r.status == 303, r.status
            for round_ in range(args.rounds + 2):  # two warm-up rounds, not counted
                t = time.perf_counter()
                await log.history(long_id)
                history_ms.append((time.perf_counter() - t) * 1000)
                for name, path in pages.items():
                    t = time.perf_counter()
                    async with client.get(path, allow_redirects=False) as r:
                        body = await r.read()
                    elapsed = time.perf_counter() - t
                    assert r.status == 200, (path, r.status)
                    sizes[name] = len(body)
                    if round_ >= 2:
                        times[name].append(elapsed * 1000)
    finally:
        await log.close()
        stop.set()
        await task
    base = statistics.median(times["sessions list (200 rows)"])
    print(f"\n{'page':<30} {'median ms':>10} {'p95 ms':>8} {'vs list':>8} {'KiB':>7}")
    for name, ms in times.items():
        ms.sort()
        p95 = ms[min(len(ms) - 1, int(0.95 * len(ms)))]
        med = statistics.median(ms)
        print(f"{name:<30} {med:>10.1f} {p95:>8.1f} {med / base:>7.2f}x {sizes[name] / 1024:>7.0f}")
    load = os.getloadavg()[0]
    history_ms = sorted(history_ms[2:])
    print(f"{'  of which log.history alone':<30} {statistics.median(history_ms):>10.1f} "
          f"{history_ms[min(len(history_ms) - 1, int(0.95 * len(history_ms)))]:>8.1f}")  # fmt: skip
    print(f"\n{args.rounds} rounds after 2 warm-up rounds; load average {load:.1f} on {os.cpu_count()} cores")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--log-url", default=os.environ.get("AGENTLOG_PG_URL"), help="a Postgres log (default: embedded)"
    )
    parser.add_argument("--sessions", type=int, default=880)
    parser.add_argument("--turns", type=int, default=16)
    parser.add_argument("--big-turns", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    url = args.log_url or start_embedded()
    namespace = f"bench{uuid.uuid4().hex[:8]}"
    os.environ["AGENTLOG_NAMESPACE"] = namespace  # the console's log and read model are this namespace's
    asyncio.run(_bench(url, namespace, args))
    asyncio.run(_drop(url, namespace))


async def _drop(url: str, namespace: str) -> None:
    model = await ReadModel(url, namespace).start()
    try:
        await model.drop()
    finally:
        await model.close()


if __name__ == "__main__":
    main()
