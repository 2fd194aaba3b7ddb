"""logctl commands for running agents: up, run, sessions, replay, approve, cancel."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Annotated, Any

import typer

from cli.common import Json, LogUrl, Plugins, ensure_topics, load_plugins, require_session
from cli.errors import BAD_INPUT, TIMED_OUT, CliError, fail
from cli.render import to_json
from cli.sessions import SessionBook, read_sessions, replay_check, summarize
from log import open_log
from log.topics import AGENT_ACTIONS
from schemas import events as ev
from services.programs import PROGRAMS, Program
from services.session import SessionState


def register(app: typer.Typer) -> None:
    app.command()(up)
    app.command()(run)
    app.command()(sessions)
    app.command()(replay)
    app.command()(approve)
    app.command()(deny)
    app.command()(cancel)
    app.command("pin-model")(pin_model)


def up(
    log_url: LogUrl = None,
    planners: Annotated[int, typer.Option(help="Planner processes (they split the partitions)")] = 1,
    time_scale: Annotated[float, typer.Option(help="Multiply tool and engine waits (0.01 = 100x faster)")] = 1.0,
    work_dir: Annotated[Path | None, typer.Option(help="Logs and engine state (default: the data dir)")] = None,
    insecure: Annotated[
        bool, typer.Option("--insecure", help="Kafka without SASL/ACLs (default: every process logs in as its role)")
    ] = False,
    cache_manager: Annotated[
        bool, typer.Option("--cache-manager", help="Also run the engine bridge and the cache manager")
    ] = False,
    gpu_blocks: Annotated[int, typer.Option(help="The sim engine's KV cache, in blocks of 16 tokens")] = 8192,
    host_blocks: Annotated[int, typer.Option(help="Its host tier (swap target), in blocks")] = 0,
    plugins: Plugins = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(help="Serve each worker's /metrics and /health, on this port and the next ones (default: off)"),
    ] = None,
    gateway: Annotated[
        bool, typer.Option("--gateway", help="Also run the OpenAI-compatible gateway (workers.gateway)")
    ] = False,
    gateway_port: Annotated[int, typer.Option(help="The gateway's port")] = 8200,
    projector: Annotated[
        bool, typer.Option("--projector", help="Also run the projector: the Postgres read model (docs/projector.md)")
    ] = False,
    console: Annotated[
        bool,
        typer.Option(
            "--console",
            help="Also run the web console (needs --projector and AGENTLOG_CONSOLE_PASSWORD; docs/console.md)",
        ),
    ] = False,
    console_port: Annotated[int, typer.Option(help="The web console's port")] = 8300,
    engines: Annotated[
        int,
        typer.Option(
            "--engines",
            min=1,
            help="Sim engines (each with its bridge under --cache-manager); "
            "the planners (and the gateway) route every LLM call between them",
        ),
    ] = 1,
    engine_sizes: Annotated[
        str, typer.Option(help="Each engine's model size, comma-separated (small or large; default: all large)")
    ] = "",
) -> None:
    """Start the engine and every worker as local processes, and keep them running; Ctrl-C (or
    SIGTERM) stops them gracefully.

    A process that exits is started again after a backoff (1 s, doubling to 30 s while it keeps
    exiting, back to 1 s once it stayed up a minute), and each exit is reported on stderr with
    its role, exit code and the wait; it never gives up on a role.

    On Kafka, secure mode is the default: with ``AGENTLOG_KAFKA_CREDENTIALS`` (the
    credentials.json of ``python -m log.local_kafka start --secure``) each process logs
    in as its own principal with only its own password.
    """
    from cli.stack import Stack, Supervisor
    from log.embedded import data_dir

    url = log_url or os.environ.get("AGENTLOG_LOG_URL") or ""
    if url.startswith("kafka://") and not insecure and not os.environ.get("AGENTLOG_KAFKA_CREDENTIALS"):
        raise typer.BadParameter(
            "a Kafka log runs secure by default: set AGENTLOG_KAFKA_CREDENTIALS to the broker's credentials.json "
            "(python -m log.local_kafka start --secure prints it), or pass --insecure for a plaintext broker"
        )

    if console and not projector:
        raise typer.BadParameter("--console reads the projector's read model: pass --projector too")
    if projector:
        from workers.projector import model_url

        if model_url(None, log_url) is None:
            raise typer.BadParameter(
                "--projector needs a Postgres for the read model: set AGENTLOG_READ_MODEL_URL (or use a Postgres log)"
            )
    if console and not (
        os.environ.get("AGENTLOG_CONSOLE_PASSWORD") or os.environ.get("AGENTLOG_CONSOLE_AUDITOR_PASSWORD")
    ):
        raise typer.BadParameter("--console needs AGENTLOG_CONSOLE_PASSWORD (the operator's login) or an auditor's")
    sizes = [part.strip() for part in engine_sizes.split(",") if part.strip()]
    if any(size not in ("small", "large") for size in sizes) or len(sizes) > engines:
        raise typer.BadParameter(
            f"--engine-sizes: at most {engines} of small or large, comma-separated; got {engine_sizes!r}"
        )
    load_plugins(plugins)  # a bad plugin stops here, before any process starts
    directory = work_dir or data_dir() / "stack"
    memory = ["--gpu-blocks", str(gpu_blocks), "--host-blocks", str(host_blocks)]
    stack = Stack(
        log_url,
        directory,
        time_scale=time_scale,
        num_planners=planners,
        cache_manager=cache_manager,
        engine_args=memory,
        cache_manager_args=memory if cache_manager else [],
        extra_env={"AGENTLOG_PLUGINS": plugins or ""},  # every process loads the same plugins
        metrics_port_base=metrics_port,
        gateway=gateway,
        gateway_port=gateway_port,
        projector=projector,
        console=console,
        console_port=console_port,
        num_engines=engines,
        engine_sizes=sizes,
    )
    ensure_topics(log_url)
    stack.start()
    for name, process in stack.processes.items():
        port = stack.metrics_ports.get(name)
        metrics = f"  metrics http://127.0.0.1:{port}/metrics" if port is not None else ""
        typer.echo(f"{name:<10} pid {process.pid:<7} log {process.log_path}{metrics}")
    if stack.num_engines == 1:
        typer.echo(f"engine     {stack.engine_url}")
    for i in range(stack.num_engines if stack.num_engines > 1 else 0):
        typer.echo(f"engine     {stack.url_of(i)} ({stack.engine_id(i)}, {stack.engine_size(i)})")
    if gateway:
        typer.echo(f"gateway    {stack.gateway_url} (OpenAI base URL; send the X-Agentlog-Session header)")
    if console:
        typer.echo(f"console    http://127.0.0.1:{stack.console_port}/")
    typer.echo("running; Ctrl-C to stop")
    # Ctrl-C and a process manager's SIGTERM both stop the stack gracefully; set explicitly,
    # because a shell that starts us in the background leaves SIGINT ignored, and Python's
    # default SIGTERM would end this process and orphan every worker.
    # The handler only sets a flag: an interrupt in the middle of a restart would orphan the new process.
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stopping.set())
    # A process that exits is started again after a backoff, and each exit is reported (cli/stack.py).
    supervisor = Supervisor(stack, report=lambda line: typer.echo(f"logctl: {line}", err=True))
    while not stopping.wait(0.2):
        supervisor.check()
    codes = stack.stop()
    typer.echo("stopped: " + ", ".join(f"{n}={c}" for n, c in codes.items()))


def run(
    program: Annotated[str, typer.Argument(help="Program name (trace, react), or a trace file (.jsonl)")],
    log_url: LogUrl = None,
    sessions: Annotated[int, typer.Option("--sessions", "-n", help="How many sessions to start")] = 1,
    args: Annotated[str, typer.Option(help="Program arguments as a JSON object")] = "{}",
    prefix: Annotated[str, typer.Option(help="Session id prefix (default: a fresh run id)")] = "",
    wait: Annotated[bool, typer.Option(help="Wait for the sessions and show progress")] = True,
    timeout_s: Annotated[float, typer.Option("--timeout", help="Give up waiting after this many seconds")] = 600,
    as_json: Json = False,
    plugins: Plugins = None,
) -> None:
    """Start N sessions of a program or of a trace file's sessions (asks the planner via ops.commands).

    Exits 2 when ``--timeout`` passes before every session finished (the summary is printed first).
    """
    programs = load_plugins(plugins).programs
    requests = session_requests(
        program, sessions, program_args(args), prefix or f"run-{uuid.uuid4().hex[:6]}", programs
    )
    book = asyncio.run(_run(log_url, requests, wait, timeout_s, quiet=as_json))
    if as_json:
        summary = summarize(book.records[s] for s, _, _ in requests if s in book.records)
        typer.echo(to_json(summary.__dict__))
    unfinished = [s for s, _, _ in requests if s not in book.records or not book.records[s].state.finished]
    if wait and unfinished:
        raise fail(
            f"{len(unfinished)} of {len(requests)} sessions did not finish within {timeout_s:g} s "
            f"({unfinished[0]} ...): is every worker running (logctl up)? logctl sessions shows where they are",
            TIMED_OUT,
        )


def program_args(text: str) -> dict[str, Any]:
    """``--args``: a JSON object (the program's arguments)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise CliError(f"--args is not JSON ({e}): {_ARGS_HINT}", BAD_INPUT) from e
    if not isinstance(value, dict):
        raise CliError(f"--args must be a JSON object, not a {type(value).__name__}: {_ARGS_HINT}", BAD_INPUT)
    return value


_ARGS_HINT = """give a JSON object, e.g. --args '{"steps": []}'"""


def session_requests(
    program: str, count: int, args: dict[str, Any], prefix: str, programs: dict[str, Program] | None = None
) -> list[tuple[str, str, dict[str, Any]]]:
    """(session id, program, args) for each session to start."""
    if program.endswith(".jsonl"):
        from services.traces.model import Trace, TraceFormatError

        try:
            trace = Trace.from_json_lines(Path(program).read_text().splitlines())
        except OSError as e:
            raise CliError(f"cannot read the trace {program}: {e.strerror}", BAD_INPUT) from e
        except TraceFormatError as e:
            raise CliError(f"{program} is not a trace (docs/trace-format.md): {e}", BAD_INPUT) from e
        chosen = trace.sessions[:count]
        return [(f"{prefix}-{s.session_id}", "trace", {"session": s.to_dict()}) for s in chosen]
    known = PROGRAMS if programs is None else programs
    if program not in known:
        raise typer.BadParameter(f"unknown program {program!r}; programs are {', '.join(known)} or a .jsonl trace")
    return [(f"{prefix}-{i:04d}", program, args) for i in range(count)]


async def _run(
    log_url: str | None,
    requests: list[tuple[str, str, dict[str, Any]]],
    wait: bool,
    timeout_s: float,
    *,
    quiet: bool = False,
    arrivals: list[float] | None = None,
) -> SessionBook:
    author = os.environ.get("USER", "operator")
    async with open_log(log_url, actor="operator") as log:
        started = time.monotonic()
        for i, (session_id, program, args) in enumerate(requests):
            if arrivals is not None:
                delay = arrivals[i] - (time.monotonic() - started)
                if delay > 0:
                    await asyncio.sleep(delay)
            await log.append(
                session_id,
                ev.SessionRequested(program=program, args_json=json.dumps(args), author=author),
                event_id=f"request/{session_id}",
            )
        if not quiet:
            typer.echo(f"requested {len(requests)} sessions ({requests[0][0]} ...)")
        book = SessionBook()
        if not wait:
            return book
        wanted = {s for s, _, _ in requests}
        async with log.consumer(f"logctl-run-{uuid.uuid4().hex[:8]}", [AGENT_ACTIONS.name], from_beginning=True) as c:
            deadline = time.monotonic() + timeout_s
            last_report = 0.0
            while time.monotonic() < deadline:
                events = await c.poll(timeout_s=0.5, max_records=5000)
                book.add_all(e for e in events if e.session_id in wanted)
                done = sum(1 for s in wanted if s in book.records and book.records[s].state.finished)
                if not quiet and (time.monotonic() - last_report > 2 or done == len(wanted)):
                    llm = sum(len(r.state.llm_calls) for r in book.records.values())
                    typer.echo(
                        f"  {done}/{len(wanted)} sessions done, {llm} LLM calls, {time.monotonic() - started:.1f} s"
                    )
                    last_report = time.monotonic()
                if done == len(wanted):
                    break
    # The full picture (verdicts and effects too) for the summary.
    async with open_log(log_url, actor="auditor") as log:
        full = await read_sessions(log, group=f"logctl-read-{uuid.uuid4().hex[:8]}")
    for session_id in [s for s in full.records if s not in wanted]:
        del full.records[session_id]
    return full


def sessions(
    log_url: LogUrl = None,
    limit: Annotated[int, typer.Option(help="Show at most this many (newest last)")] = 50,
    as_json: Json = False,
) -> None:
    """A table of sessions and their state."""

    async def read() -> SessionBook:
        async with open_log(log_url, actor="auditor") as log:
            return await read_sessions(log, group=f"logctl-sessions-{uuid.uuid4().hex[:8]}")

    book = asyncio.run(read())
    records = sorted(book.records.values(), key=lambda r: r.requested_at or r.last_event_at or 0)[-limit:]
    if as_json:
        typer.echo(
            to_json(
                [
                    {
                        "session_id": r.state.session_id,
                        "program": r.state.program,
                        "status": r.state.status.value if r.state.status else None,
                        "llm_calls": len(r.state.llm_calls),
                        "tool_calls": len(r.state.tool_calls),
                        "events": r.state.num_events,
                        "job_time_s": r.job_time_s,
                        "in_doubt": [c for c, t in r.state.tool_calls.items() if t.status.value == "in_doubt"],
                    }
                    for r in records
                ]
            )
        )
        return
    typer.echo(
        f"{'session':<36} {'program':<8} {'status':<10} {'llm':>4} {'tools':>5} {'events':>6} {'job s':>7}  notes"
    )
    for r in records:
        s = r.state
        doubt = [c for c, t in s.tool_calls.items() if t.status.value == "in_doubt"]
        held = [c for c, t in s.tool_calls.items() if t.status.value == "proposed"]
        notes = ("in doubt: " + ",".join(doubt) if doubt else "") + (" waiting: " + ",".join(held) if held else "")
        job = f"{r.job_time_s:.2f}" if r.job_time_s is not None else "-"
        status = s.status.value if s.status else "?"
        typer.echo(
            f"{s.session_id[:36]:<36} {s.program[:8]:<8} {status:<10} {len(s.llm_calls):>4} "
            f"{len(s.tool_calls):>5} {s.num_events:>6} {job:>7}  {notes.strip()}"
        )


def replay(
    session_id: Annotated[str, typer.Argument(help="The session to show")],
    log_url: LogUrl = None,
    check: Annotated[bool, typer.Option("--check", help="Re-run the program on the recorded results")] = False,
    as_json: Json = False,
) -> None:
    """A session's timeline across topics; --check re-folds it and reports any nondeterminism."""
    from cli.render import event_line, event_to_json
    from services.session import fold
    from workers.replay import add_parent_history

    async def read() -> tuple[list[Any], SessionState]:
        async with open_log(log_url, actor="auditor") as log:
            events = await log.history(session_id)
            state = fold(session_id, [e.envelope for e in events])
            if check:  # a fork's program ran on its parent's history up to the fork point: re-run it on that too
                await add_parent_history(log, None, state)
            return events, state

    events, state = asyncio.run(read())
    if not events:
        typer.echo(f"no events for session {session_id}", err=True)
        raise typer.Exit(1)
    problems = replay_check(state, load_plugins(None).programs) if check else []
    if as_json:
        typer.echo(to_json({"events": [event_to_json(e) for e in events], "problems": problems}))
    else:
        for event in events:
            typer.echo(event_line(event))
        if check:
            typer.echo("replay check: " + ("deterministic, matches the log" if not problems else "PROBLEMS"))
            for problem in problems:
                typer.echo(f"  {problem}")
    if problems:
        raise typer.Exit(2)


def approve(
    session_id: Annotated[str, typer.Argument()],
    call_id: Annotated[str, typer.Argument(help="The tool call, e.g. tool-3")],
    log_url: LogUrl = None,
    deny: Annotated[bool, typer.Option("--deny", help="Refuse the call")] = False,
    retry: Annotated[bool, typer.Option("--retry", help="In-doubt call: run it again")] = False,
    mark_done: Annotated[bool, typer.Option("--mark-done", help="In-doubt call: it did happen; do not run it")] = False,
    reason: Annotated[str, typer.Option(help="Why (kept in the log)")] = "",
    author: Annotated[str, typer.Option(help="Who decides (default: $USER)")] = "",
) -> None:
    """Approve (or --deny) a held tool call; resolve an in-doubt one with --retry or --mark-done."""
    if sum((deny, retry, mark_done)) > 1:
        raise typer.BadParameter("choose one of --deny, --retry, --mark-done")
    decision = (
        ev.ApprovalDecision.DENY
        if deny
        else ev.ApprovalDecision.RETRY
        if retry
        else ev.ApprovalDecision.MARK_DONE
        if mark_done
        else ev.ApprovalDecision.APPROVE
    )
    who = author or os.environ.get("USER", "operator")

    async def send() -> None:
        from workers.operator import UnknownSession, decide

        async with open_log(log_url, actor="operator") as log:
            try:
                _, position = await decide(log, session_id, call_id, decision, author=who, reason=reason)
            except UnknownSession as e:
                raise CliError(f"{e} (logctl sessions lists them)") from None
            typer.echo(f"{decision.value} {session_id} {call_id} by {who} at {position}")

    asyncio.run(send())


def deny(
    session_id: Annotated[str, typer.Argument()],
    call_id: Annotated[str, typer.Argument(help="The tool call, e.g. tool-3")],
    log_url: LogUrl = None,
    reason: Annotated[str, typer.Option(help="Why (kept in the log)")] = "",
    author: Annotated[str, typer.Option(help="Who decides (default: $USER)")] = "",
) -> None:
    """Refuse a tool call held for approval (same as approve --deny)."""
    approve(session_id, call_id, log_url=log_url, deny=True, reason=reason, author=author)


def cancel(
    session_id: Annotated[str, typer.Argument()],
    log_url: LogUrl = None,
    reason: Annotated[str, typer.Option(help="Why (kept in the log)")] = "cancelled by an operator",
) -> None:
    """Ask the planner to stop a session."""

    async def send() -> None:
        async with open_log(log_url, actor="operator") as log:
            await require_session(log, session_id)
            await log.append(session_id, ev.CancelRequested(author=os.environ.get("USER", "operator"), reason=reason))

    asyncio.run(send())
    typer.echo(f"cancel requested for {session_id}")


def pin_model(
    session_id: Annotated[str, typer.Argument()],
    size: Annotated[str, typer.Argument(help="small or large; none removes the pin")],
    log_url: LogUrl = None,
    reason: Annotated[str, typer.Option(help="Why (kept in the log)")] = "pinned by an operator",
) -> None:
    """Pin a session's LLM calls to a model size (on a stack with small and large engines); the
    planner obeys from the session's next call, and ``logctl audit --routes`` shows it."""
    if size not in ("small", "large", "none"):
        raise CliError(f"size must be small, large or none, got {size!r}", BAD_INPUT)

    async def send() -> None:
        async with open_log(log_url, actor="operator") as log:
            await require_session(log, session_id)
            body = ev.ModelPinRequested(
                author=os.environ.get("USER", "operator"), size=None if size == "none" else size, reason=reason
            )
            await log.append(session_id, body)

    asyncio.run(send())
    typer.echo(f"{session_id} pinned to {size}" if size != "none" else f"{session_id} unpinned")
