"""What the OpenAI-compatible gateway costs: the same sim engine called directly and through the gateway.

Run::

    python -m bench.gateway [--bootstrap HOST:PORT] [--pg-url URL] [--requests 400] [--concurrency 16]
                            [--json FILE] [--baseline CHECKOUT]

With ``--baseline`` (another checkout of agentlog, e.g. ``git worktree add --detach DIR main``),
a second stack runs that checkout's code beside this one's, in a namespace of its own, and
every round alternates over both stacks' paths (rows ``direct (baseline)``, ``gateway
(baseline)``): before and after a change in one run, at the same load.

It starts a stack on Kafka (``--bootstrap``, default ``KAFKA_BOOTSTRAP_SERVERS``; a fresh
namespace per run), then another on Postgres (``--pg-url``, default ``AGENTLOG_PG_URL``; skipped
without one): the sim engine with ``--time-scale 0`` (it answers as soon as it has
computed the reply, so what is left is HTTP, JSON and the gateway), the planner, decider and
executor (the planner adopts every record, as in a deployment) and ``workers.gateway``. Then,
for plain and streamed chat completions, side by side in one run:

- **latency**: ``--requests`` requests one at a time, each a new conversation (so neither the
  engine's request-id replay nor the gateway's log replay answers it), timed from sending to
  the last byte; direct calls give the engine a fresh ``request_id`` each;
- **throughput**: the same number of requests from ``--concurrency`` clients at once;
- **tool result** (plain, latency only, ``--requests`` / 4): a conversation whose first request
  makes the model call the ``echo`` tool (untimed: through the gateway it waits for the
  decider's vote), then, timed, the request that reports the tool's result and gets the
  model's next answer; through the gateway it appends a ``GatewayToolResultReported`` besides
  the answer's record (alongside the engine call, so not on its path).

Beside them, the path ``passthrough``: the same requests through ``bench.passthrough``, an aiohttp
server in a process of its own that forwards each request to the same engine and does nothing
else. Its added latency is the floor of the hop itself (two more HTTP exchanges, the JSON parsed
and written again), which any gateway in front of the engine pays.

Direct, pass-through and gateway rounds alternate in blocks of 20 (every other block in reverse
order) so that drift on a shared machine hits all of them.
Added latency is a path minus direct, per percentile. The gateway's share beyond the hop is one
durable append (``GatewayLLMCallServed``; ``acks=all`` on Kafka, a commit on Postgres) per request
plus its own bookkeeping. The header lines give that append's own p50/p99 (``SharedLog.append_many``
of one record with the gateway's producer settings, measured in the same run, in a namespace of
its own), the CPU time each of the stack's processes spent per gateway request over the run (the
planner, decider and executor react to every record the gateway appends, on the same cores), and
the machine's load average, to read the rest by.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from cli.common import ensure_topics
from cli.stack import Stack
from log import Draft, open_log
from log.local_kafka import free_ports
from schemas import events as ev
from workers.gateway import SESSION_HEADER, GatewayWorker

BLOCK = 20


@dataclass
class Round:
    path: str
    stream: bool
    latencies_ms: list[float]
    throughput_rps: float
    mode: str = ""
    """``plain``, ``stream`` or ``tool result``."""

    def __post_init__(self) -> None:
        self.mode = self.mode or ("stream" if self.stream else "plain")

    def percentile(self, p: float) -> float:
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


ECHO = {
    "type": "function",
    "function": {
        "name": "echo",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    },
}


def _body(i: int, run: str, stream: bool) -> dict[str, Any]:
    return {
        "model": "sim",
        "messages": [{"role": "user", "content": f"bench {run} conversation {i}: say something short."}],
        "max_tokens": 16,
        "stream": stream,
    }


async def _one(http: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]) -> float:
    began = time.perf_counter()
    async with http.post(url, json=body, headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: {response.status} {await response.text()}")
        async for _ in response.content.iter_any():
            pass
    return (time.perf_counter() - began) * 1000


BASELINE = " (baseline)"
"""The label of the paths through ``--baseline``'s stack."""


KINDS = ("direct", "passthrough", "gateway")
"""The paths of a stack: the engine itself, through ``bench.passthrough``, through the gateway."""


def _kind(path: str) -> str:
    return next(kind for kind in KINDS if path.startswith(kind))


class Bench:
    """Requests to each stack's engine (``direct``), pass-through and gateway; ``targets``: label
    ("" or ``BASELINE``) -> kind (of ``KINDS``) -> base URL (a stack may have no pass-through)."""

    def __init__(self, targets: dict[str, dict[str, str]], key: str) -> None:
        self.urls = {
            (kind, label): f"{url}/chat/completions" if kind == "gateway" else f"{url}/v1/chat/completions"
            for label, urls in targets.items()
            for kind, url in urls.items()
        }
        self.paths = [f"{kind}{label}" for label in targets for kind in KINDS if (kind, label) in self.urls]
        self.key = key
        self.run = uuid.uuid4().hex[:6]
        self.counter = 0
        self.sent = dict.fromkeys(self.paths, 0)
        """Requests sent per path, every round and warm-up included (for CPU per request)."""

    def request(self, path: str, stream: bool) -> tuple[str, dict[str, Any], dict[str, str]]:
        self.counter += 1
        self.sent[path] += 1
        body = _body(self.counter, self.run, stream)
        session = f"bench-{self.run}-{self.counter}"
        kind = _kind(path)
        url = self.urls[(kind, path.removeprefix(kind))]
        if kind != "gateway":
            return url, {**body, "session_id": session, "request_id": f"{session}/llm-0"}, {}
        return url, body, {"Authorization": f"Bearer {self.key}", SESSION_HEADER: session}

    def _order(self, start: int) -> list[str]:
        """The paths of the block starting at request ``start``: every other block in reverse, so that
        no path always follows another's (whose stack is still busy with its last requests)."""
        return self.paths if (start // BLOCK) % 2 == 0 else self.paths[::-1]

    async def latency(self, http: aiohttp.ClientSession, n: int, stream: bool) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {path: [] for path in self.paths}
        for start in range(0, n, BLOCK):
            for path in self._order(start):
                for _ in range(min(BLOCK, n - start)):
                    out[path].append(await _one(http, *self.request(path, stream)))
        return out

    async def tool_latency(self, http: aiohttp.ClientSession, n: int) -> dict[str, list[float]]:
        """The request after a tool call: it carries the tool's result."""
        out: dict[str, list[float]] = {path: [] for path in self.paths}
        for start in range(0, n, BLOCK):
            for path in self._order(start):
                for _ in range(min(BLOCK, n - start)):
                    url, body, headers = self.request(path, False)
                    asked = {**body, "tools": [ECHO], "tool_choice": {"type": "function", "function": {"name": "echo"}}}
                    async with http.post(url, json=asked, headers=headers) as response:
                        message = (await response.json())["choices"][0]["message"]
                    result = {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "echoed"}
                    follow = {**asked, "messages": [*asked["messages"], message, result], "tool_choice": "none"}
                    self.sent[path] += 1
                    if _kind(path) != "gateway":
                        follow["request_id"] = f"{body['session_id']}/llm-2"
                    out[path].append(await _one(http, url, follow, headers))
        return out

    async def throughput(self, http: aiohttp.ClientSession, path: str, n: int, stream: bool, clients: int) -> float:
        requests = [self.request(path, stream) for _ in range(n)]
        queue: asyncio.Queue[tuple[str, dict[str, Any], dict[str, str]]] = asyncio.Queue()
        for r in requests:
            queue.put_nowait(r)

        async def client() -> None:
            while not queue.empty():
                await _one(http, *queue.get_nowait())

        began = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        return n / (time.perf_counter() - began)

    async def all_rounds(self, n: int, clients: int, warmup: int) -> list[Round]:
        connector = aiohttp.TCPConnector(limit=clients * 2)
        async with aiohttp.ClientSession(connector=connector) as http:
            for stream in (False, True):
                await self.latency(http, warmup, stream)
            rounds = []
            for stream in (False, True):
                latencies = await self.latency(http, n, stream)
                for path in self.paths:
                    rps = await self.throughput(http, path, n, stream, clients)
                    rounds.append(Round(path, stream, latencies[path], rps))
            tool = await self.tool_latency(http, max(BLOCK, n // 4))
            rounds += [Round(path, False, tool[path], float("nan"), "tool result") for path in self.paths]
            return rounds


async def append_latency(log_url: str, namespace: str, n: int) -> tuple[float, float]:
    """p50 and p99 ms of one durable append, as the gateway makes one per request (its producer's
    settings: no linger)."""
    body = ev.GatewayToolResultReported(call_id="tool-1", tool_call_id="c", result_json="1", result_tokens=1, gap_ms=0)
    times = []
    async with open_log(log_url, actor="gateway", namespace=namespace, linger_ms=GatewayWorker.linger_ms) as log:
        for i in range(n):
            began = time.perf_counter()
            await log.append_many([Draft(f"s{i}", body, str(uuid.uuid4()))])
            times.append((time.perf_counter() - began) * 1000)
    times.sort()
    return times[len(times) // 2], times[min(len(times) - 1, round(0.99 * (len(times) - 1)))]


def table(rounds: list[Round]) -> str:
    lines = [
        "| mode | path | requests/s | p50 ms | p99 ms | added p50 ms | added p99 ms |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    by = {(r.path, r.mode): r for r in rounds}
    paths = list(dict.fromkeys(r.path for r in rounds))
    for mode in ("plain", "stream", "tool result"):
        for path in paths:
            r = by[(path, mode)]
            kind = _kind(path)
            direct = by[("direct" + path.removeprefix(kind), mode)]
            added = (
                (f"{r.percentile(50) - direct.percentile(50):.2f}", f"{r.percentile(99) - direct.percentile(99):.2f}")
                if kind != "direct"
                else ("", "")
            )
            rps = "" if r.throughput_rps != r.throughput_rps else f"{r.throughput_rps:.0f}"  # NaN: not measured
            lines.append(
                f"| {mode} | {path} | {rps} | {r.percentile(50):.2f} "
                f"| {r.percentile(99):.2f} | {added[0]} | {added[1]} |"
            )
    return "\n".join(lines)


def _stack(log_url: str, work: Path, key: str, args: argparse.Namespace, code: Path | None) -> Stack:
    """A stack in a fresh namespace; ``code``: the checkout its processes import (None: this one)."""
    namespace = f"bench{uuid.uuid4().hex[:8]}"
    env = {"AGENTLOG_NAMESPACE": namespace, "AGENTLOG_GATEWAY_API_KEYS": key, "AGENTLOG_LOG_LEVEL": "WARNING"}
    if code is not None:
        env["PYTHONPATH"] = str(code)
    ensure_topics(log_url, namespace=namespace)
    return Stack(
        log_url,
        work,
        time_scale=0.0,
        extra_env=env,
        gateway=True,
        gateway_args=["--max-requests-per-minute", str(10 * args.requests)],
    )


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Run:
    """What ``run_on`` measured on one log."""

    rounds: list[Round]
    append_p50: float
    append_p99: float
    cpu_ms: dict[str, dict[str, float]]
    """Stack label ("" or ``BASELINE``) -> its processes -> CPU ms per gateway request over all
    rounds (an engine's covers its direct and pass-through requests too)."""


@contextlib.contextmanager
def _passthrough(engine_url: str, work: Path) -> Iterator[str]:
    """``bench.passthrough`` in a process of its own, in front of ``engine_url``; yields its URL."""
    (port,) = free_ports(1)
    with (work / "passthrough.log").open("ab") as out:
        popen = subprocess.Popen(
            [sys.executable, "-m", "bench.passthrough", "--engine-url", engine_url, "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_for(f"{url}/health")
        yield url
    finally:
        popen.terminate()
        popen.wait(10)


def run_on(log_url: str, args: argparse.Namespace) -> Run:
    """The rounds of one log (a stack of its own, in a fresh namespace, with a pass-through in front
    of its engine; with ``--baseline``, one more stack of that checkout's code, its paths
    alternating with this one's), its append floor and the CPU its processes spent."""
    key = uuid.uuid4().hex
    with tempfile.TemporaryDirectory() as work, contextlib.ExitStack() as running:
        stacks = {"": _stack(log_url, Path(work) / "this", key, args, None)}
        if args.baseline is not None:
            stacks[BASELINE] = _stack(log_url, Path(work) / "baseline", key, args, args.baseline)
        for label, stack in stacks.items():
            # ``python -m`` puts the working directory first on the path: the baseline's processes
            # start in its checkout (then PYTHONPATH, then this checkout's installed packages).
            here = Path.cwd()
            os.chdir(args.baseline if label else here)
            try:
                running.enter_context(stack)
            finally:
                os.chdir(here)
            _wait_for(stack.gateway_url.removesuffix("/v1") + "/health")
        targets = {label: {"direct": stack.engine_url, "gateway": stack.gateway_url} for label, stack in stacks.items()}
        targets[""]["passthrough"] = running.enter_context(_passthrough(stacks[""].engine_url, Path(work)))
        bench = Bench(targets, key)
        pids = {(label, name): p.pid for label, stack in stacks.items() for name, p in stack.processes.items()}
        before = {key: _cpu_s(pid) for key, pid in pids.items()}
        rounds = asyncio.run(bench.all_rounds(args.requests, args.concurrency, args.warmup))
        cpu_ms: dict[str, dict[str, float]] = {label: {} for label in stacks}
        for (label, name), pid in pids.items():
            cpu_ms[label][name] = (_cpu_s(pid) - before[(label, name)]) * 1000 / bench.sent[f"gateway{label}"]
        floor_namespace = f"bench{uuid.uuid4().hex[:8]}"
        ensure_topics(log_url, namespace=floor_namespace)
        append_p50, append_p99 = asyncio.run(append_latency(log_url, floor_namespace, args.requests))
    return Run(rounds, append_p50, append_p99, cpu_ms)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway", description=__doc__.split("\n")[0])
    parser.add_argument("--bootstrap", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS"))
    parser.add_argument(
        "--pg-url",
        default=os.environ.get("AGENTLOG_PG_URL"),
        help="also run on this Postgres log (default AGENTLOG_PG_URL; none: Kafka only)",
    )
    parser.add_argument("--requests", type=int, default=400, help="per path and mode")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="another checkout (e.g. git worktree add --detach DIR main): its stack runs beside this one's "
        "and their requests alternate, for before/after in one run",
    )
    args = parser.parse_args(argv)
    if not args.bootstrap:
        parser.error("needs a Kafka broker: --bootstrap HOST:PORT or KAFKA_BOOTSTRAP_SERVERS")
    logs = {"kafka": f"kafka://{args.bootstrap}"}
    if args.pg_url:
        logs["postgres"] = args.pg_url
    data = []
    for name, log_url in logs.items():
        run = run_on(log_url, args)
        rounds, append_p50 = run.rounds, run.append_p50
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        cpu = "; ".join(
            f"{label.strip() or 'this'}: " + ", ".join(f"{process} {ms:.2f}" for process, ms in by_process.items())
            for label, by_process in run.cpu_ms.items()
        )
        print(f"\n{name}: gateway and pass-through vs direct sim engine, {args.requests} requests per path and mode, "
              f"throughput with {args.concurrency} concurrent clients; "
              f"one durable append: p50 {append_p50:.2f} ms, p99 {run.append_p99:.2f} ms; "
              f"load average {load} on {os.cpu_count()} CPUs\n"
              f"CPU ms per gateway request: {cpu}")  # fmt: skip
        print(table(rounds))
        data += [
            {
                "log": name,
                "path": r.path,
                "mode": r.mode,
                "stream": r.stream,
                "requests_per_s": None if r.throughput_rps != r.throughput_rps else r.throughput_rps,
                "p50_ms": r.percentile(50),
                "p99_ms": r.percentile(99),
                "mean_ms": statistics.fmean(r.latencies_ms),
                "append_p50_ms": append_p50,
                "cpu_ms_per_gateway_request": run.cpu_ms,
            }
            for r in rounds
        ]
    if args.json is not None:
        args.json.write_text(json.dumps(data, indent=2) + "\n")


def _wait_for(url: str, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout_s:g} s")


if __name__ == "__main__":
    main()
