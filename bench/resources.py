"""Resources left behind after N sessions, with and without ownership by the session, side by side.

Run::

    python -m bench.resources [--sessions N=40] [--kib 256] [--log-url URL] [--out bench/results/resources.txt]

Without ``--log-url`` the log is in this process's memory (``memory:NAME``); with
``AGENTLOG_PG_URL``-style URLs it is Postgres. The planner, decider and executor run in this
process, as in the integration tests.

What runs
---------
The same workload twice, in one invocation, each mode on a fresh log namespace and a fresh
directory: ``N`` sessions of the ``script`` program, each one tool call that makes what a
sandboxed tool typically makes (a scratch directory with a ``--kib`` file in it, a helper
process ``sleep 600``, a listening TCP port), then, for every third session, a step that
fails the session (the others finish).

- **owned** (agentlog): the tool acquires the three through ``ctx.resources``
  (workers/resources.py); the executor logs them and releases them when the session ends;
- **unowned** (what a tool does on its own): ``tempfile.mkdtemp``, ``subprocess.Popen``, a
  socket bound and kept, and nobody releases them (the process and the socket live as long as
  the executor; the directory forever).

When every session has ended and the workers have stopped (drained), the bench counts on the
machine, not in the log: directories and bytes under the mode's directory, processes whose
environment carries the mode's tag (``AGENTLOG_BENCH=<run>-<mode>``, children included),
and which of the ports the tools opened still accept a connection. Then it cleans up what
the unowned mode left, so the machine is as before. Wall time is the time from the first
request until every session has ended (release included for owned).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cli.common import ensure_topics
from log import open_log
from schemas import events as ev
from services.checkpoint import fold_events
from services.replay import cut_events
from services.sdk import tool
from services.voters import default_allowed, default_decider
from workers.decider import DeciderWorker
from workers.engines.factory import create_engine
from workers.executor import ExecutorWorker
from workers.planner import PlannerWorker
from workers.plugins import builtin_registry

_LEAKED_SOCKETS: list[socket.socket] = []  # the unowned tool's sockets: open until the bench closes them


def _tagged_env(args: dict[str, Any]) -> dict[str, str]:
    return {**os.environ, "AGENTLOG_BENCH": str(args["tag"])}


@tool(name="owned_work", effect="idempotent", schema={"type": "object"})
async def owned_work(args: dict[str, Any], ctx: Any) -> dict[str, Any]:
    scratch = await ctx.resources.directory()
    (scratch.path / "data.bin").write_bytes(os.urandom(int(args["kib"]) * 1024))
    helper = await ctx.resources.process(["sleep", "600"], env=_tagged_env(args))
    port = await ctx.resources.port()
    return {"dir": str(scratch.path), "pid": helper.pid, "port": port.port}


@tool(name="unowned_work", effect="idempotent", schema={"type": "object"})
def unowned_work(args: dict[str, Any], ctx: Any) -> dict[str, Any]:
    scratch = Path(tempfile.mkdtemp(dir=args["root"]))
    (scratch / "data.bin").write_bytes(os.urandom(int(args["kib"]) * 1024))
    helper = subprocess.Popen(["sleep", "600"], env=_tagged_env(args), start_new_session=True)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    _LEAKED_SOCKETS.append(server)
    return {"dir": str(scratch), "pid": helper.pid, "port": server.getsockname()[1]}


@dataclass
class Row:
    mode: str
    sessions: int
    dirs: int
    bytes: int
    processes: int
    ports: int
    wall_s: float
    effects: int


def tagged_pids(tag: str) -> list[int]:
    needle = f"AGENTLOG_BENCH={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state not in ("Z", "X"):
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


async def run_mode(mode: str, args: argparse.Namespace, work: Path, run: str) -> tuple[Row, list[int]]:
    namespace = f"bres{uuid.uuid4().hex[:8]}"
    url = args.log_url or f"memory:bench-resources-{namespace}"
    await asyncio.to_thread(ensure_topics, url, namespace=namespace)
    root = work / mode
    root.mkdir(parents=True)
    registry = builtin_registry()
    for item in (owned_work, unowned_work):
        registry.add(item, "bench.resources")
    logs = {r: await open_log(url, actor=r, namespace=namespace).start() for r in ("planner", "decider", "executor")}
    engine = create_engine("http://127.0.0.1:9", engine_id="sim-0", kind="sim")  # no LLM step is ever taken
    allowed = registry.tool_specs
    workers: list[Any] = [
        PlannerWorker(logs["planner"], engine=engine, registry=registry),
        DeciderWorker(logs["decider"], registry=registry, decider=default_decider(default_allowed(allowed))),
        ExecutorWorker(
            logs["executor"], registry=registry, sandbox=root / "sandbox", resource_dir=root / "resources",
            kill_grace_s=1.0,
        ),
    ]  # fmt: skip
    tasks = [asyncio.create_task(w.run()) for w in workers]
    tag = f"{run}-{mode}"
    sessions = [f"{mode}-{i}" for i in range(args.sessions)]
    tool_args = {"kib": args.kib, "tag": tag, "root": str(root)}
    began = time.perf_counter()
    async with open_log(url, actor="operator", namespace=namespace) as operator:
        for i, session in enumerate(sessions):
            steps: list[dict[str, Any]] = [{"tool": f"{mode}_work", "arguments": tool_args}]
            if i % 3 == 2:
                steps.append({"fail": "on purpose"})  # neither llm nor tool: the script fails the session
            body = ev.SessionRequested(program="script", args_json=json.dumps({"steps": steps}), author="bench")
            await operator.append(session, body)
    ports: list[int] = []
    num_effects = 0
    async with open_log(url, actor="auditor", namespace=namespace) as reader:
        deadline = time.monotonic() + args.timeout
        pending = set(sessions)
        while pending:
            if time.monotonic() > deadline:
                raise SystemExit(f"{mode}: {len(pending)} sessions did not end in {args.timeout} s")
            for session in list(pending):
                state = fold_events(session, cut_events(await reader.history(session)))
                settled = all(not r.live for r in state.resources.values())
                if state.finished and settled:
                    pending.discard(session)
                    tool_call = state.tool_calls.get("tool-0")
                    if tool_call is not None and tool_call.completed is not None:
                        ports.append(int(json.loads(tool_call.completed.result_json)["port"]))
                    num_effects += sum(1 for r in await reader.history(session) if r.topic == "agent.effects")
            await asyncio.sleep(0.2)
        wall = time.perf_counter() - began
    for w in workers:
        w.shutdown()
    await asyncio.gather(*tasks)
    for log in logs.values():
        await log.close()
    scratch = [d for d in root.rglob("*") if d.is_dir() and d.name not in ("sandbox", "resources")]
    num_bytes = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    row = Row(
        mode,
        len(sessions),
        len(scratch),
        num_bytes,
        len(tagged_pids(tag)),
        sum(map(listening, ports)),
        wall,
        num_effects,
    )
    return row, ports


def clean_up(tag: str, work: Path) -> None:
    """Release what the unowned mode left (the owned one left nothing)."""
    for pid in tagged_pids(tag):
        os.kill(pid, signal.SIGKILL)
    for server in _LEAKED_SOCKETS:
        server.close()
    _LEAKED_SOCKETS.clear()
    shutil.rmtree(work, ignore_errors=True)


def table(rows: list[Row], args: argparse.Namespace) -> str:
    lines = [
        f"bench/resources.py: {args.sessions} sessions per mode (1 in 3 fails), each tool call makes a directory "
        f"with {args.kib} KiB, a process and a listening port; counted on the machine after the workers stopped",
        f"{os.cpu_count()} CPUs, load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}; "
        f"log: {'memory' if not args.log_url else args.log_url.split(':', 1)[0]}",
        "",
        "| mode | sessions | dirs left | bytes left | processes left | ports left | wall s | agent.effects records |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.mode} | {r.sessions} | {r.dirs} | {r.bytes:,} | {r.processes} | {r.ports} | {r.wall_s:.1f} | "
            f"{r.effects} |"
        )
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> int:
    run = uuid.uuid4().hex[:6]
    work = Path(tempfile.mkdtemp(prefix="agentlog-bench-resources-"))
    rows: list[Row] = []
    try:
        for mode in ("owned", "unowned"):
            row, _ = await run_mode(mode, args, work, run)
            rows.append(row)
            print(f"  {mode}: {row}", flush=True)
    finally:
        clean_up(f"{run}-unowned", work)
    text = table(rows, args)
    print(text)
    if args.out:
        await asyncio.to_thread(Path(args.out).write_text, text + "\n")
    owned = rows[0]
    return 0 if (owned.dirs, owned.bytes, owned.processes, owned.ports) == (0, 0, 0, 0) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.resources", description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=40)
    parser.add_argument("--kib", type=int, default=256)
    parser.add_argument("--log-url", default=None, help="default: a log in this process's memory")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--out", default=None, help="write the table here too")
    args = parser.parse_args(argv)
    if args.sessions < 1 or args.kib < 0:
        parser.error("--sessions must be at least 1 and --kib at least 0")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
