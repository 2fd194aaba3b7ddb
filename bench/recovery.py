"""Recovery after planner crashes: residual completion vs restart from scratch, side by side.

Run::

    python -m bench.recovery [--sessions N=30] [--kills K=3] [--seed S=0] [--time-scale 0.01]
                             [--arrival-rate 0.2] [--log-url URL] [--timeout 240] [--json FILE]

Without ``--log-url`` the log is the embedded Postgres (``AGENTLOG_DATA_DIR``
says where it lives); ``--log-url kafka://host:port`` uses a Kafka broker.

What runs
---------
One workload, two modes, one after the other in the same invocation. The
workload is ``N`` sessions of the InferCept trace (``cli.demo.load_infercept``,
program ``trace``), requested with the same Poisson arrivals as ``logctl
demo`` (trace arrival times multiplied by ``--time-scale``, in real seconds
from the first request). Each mode gets a fresh namespace on the log (topic
prefix on Kafka, schema on Postgres) and a fresh stack (engine, planner,
decider, executor as OS processes, with a new work dir, so the engine's
``/stats`` and its record of served requests count that mode only). The
session ids are the same in both modes, so the prompts are token for token
the same.

- **residual** (agentlog): at each kill point the planner gets SIGKILL and is
  restarted at once (``Stack.start_process("planner-0")``). The new planner
  re-folds the log and does only the residual work (DESIGN.md section 5).
- **scratch** (what a system without the log does): at each kill point the
  planner gets SIGKILL; every session whose latest copy has not finished is
  abandoned (a ``CancelRequested`` from the operator principal) and requested
  again from its beginning under a new session id (``<id>-r1``, ``<id>-r2``,
  ...), same program and arguments; then the planner is restarted. Progress
  of the abandoned copies is lost, as it is when a planner keeps its agents'
  state in memory. Sessions not yet requested at a kill are not touched.

A mode ends when the latest copy of every session has finished (or failed);
then the workers are stopped gracefully (the executor drains what it runs),
the engine's ``/stats`` and record are read, and the log is read to its end.
The namespaces stay in the log for inspection (e.g. ``AGENTLOG_NAMESPACE=<ns>
logctl sessions``); the stack's logs stay in the work dir the run prints.

How the kill points are chosen
------------------------------
The clock of the kill schedule is the number of ``LLMCallCompleted`` events
in the mode's log (every copy counts), so kills come after the same amount of
LLM work in both modes. With ``M`` = the LLM calls the workload needs (the
sum of the sessions' turns) and ``K`` kills, kill ``i`` (0-based) is at the
count ``round(M * f_i)`` where ``f_i = 0.05 + 0.9 * (i + u_i) / K`` and
``u_i`` is uniform in [0, 1) from ``random.Random(seed)``: one kill in each
of ``K`` equal slices of the middle 90% of the expected run. The bench watches
the log and kills as soon as it sees the count reach the threshold (a poll
later: up to a few hundred milliseconds). A kill also waits until the
restarted planner has completed at least one LLM call, so two thresholds
that are crossed together never kill a planner that has not started yet.

What each number means
----------------------
All counts are read back from the mode's log (folded with ``SessionBook``),
from the engine's ``/stats`` and from the engine's record of served requests
(``served.jsonl`` in its state dir: request id, prompt and cached tokens).

- *LLM calls needed*: the distinct LLM calls of the latest (finished) copy of
  each session, i.e. what the programs needed. Equal in both modes.
- *LLM calls computed by the engine*: ``/stats`` ``num_served`` (requests the
  engine ran; a repeated request id answered from its record is not run).
- *LLM calls issued again*: computed minus needed: LLM work done twice.
- *answered from the engine record*: ``/stats`` ``num_replayed``: requests
  the planner sent again under the same request id (it crashed while the
  engine was answering) and that the engine answered without computing.
- *prefill tokens computed*: prompt minus cached tokens, summed over every
  request the engine computed (its record).
- *prefill tokens recomputed*: prompt minus cached tokens of the LLM calls
  that were not needed: those of abandoned copies as logged in their
  ``LLMCallCompleted``, plus requests the engine computed that have no
  ``LLMCallCompleted`` anywhere in the log (the planner died before logging
  the answer and nobody asked for it again), from the engine's record.
- *tool calls needed*: the tool calls of the latest copies.
- *tool calls executed again*: ``ToolCallStarted`` events beyond one per
  needed tool call: every start of an abandoned copy's tool call (the
  executor keeps running committed calls of a cancelled session) and every
  retry (attempt > 1) of a needed one.
- *wall time*: from the first ``SessionRequested`` to the last ``SessionFinished``
  of a latest copy (log timestamps).
- *mean job time*: per session, from the request of its first copy to the
  end of its latest copy (what the user waited), averaged.
- *planner back after*: per kill, from the SIGKILL to the restarted planner's
  first append (log timestamp), averaged; it covers process start, joining
  the consumer group and replaying the log (in scratch mode also the bench's
  one batch of cancels and new requests, appended before the restart).

The ratio column is scratch / residual ("inf" when residual is 0 and scratch
is not, "-" when both are 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from cli.sessions import SessionBook, SessionRecord
from cli.stack import Stack
from log import Draft, LoggedEvent, SharedLog, open_log
from log.topics import AGENT_ACTIONS, SESSION_TOPICS
from schemas import events as ev
from services.planning import request_id
from services.session import SessionStatus

MODES = ("residual", "scratch")
PLANNER = "planner-0"
OPERATOR = "recovery-bench"
DEFAULT_SESSIONS = 30
DEFAULT_KILLS = 3
DEFAULT_TIMEOUT_S = 240.0
POLL_S = 0.25


class BenchError(RuntimeError):
    """The run could not be measured (a worker died, a deadline passed); the message says why."""


# ------------------------------------------------------------------ pure parts


def kill_thresholds(num_llm_calls: int, num_kills: int, rng: random.Random) -> list[int]:
    """LLMCallCompleted counts at which to kill: one in each of ``num_kills`` slices of the middle 90%.

    Strictly increasing and within [1, num_llm_calls - 1] when there is room (see the module docstring).
    """
    thresholds: list[int] = []
    for i in range(num_kills):
        fraction = 0.05 + 0.9 * (i + rng.random()) / num_kills
        at = max(1, min(num_llm_calls - 1, round(num_llm_calls * fraction)))
        if thresholds and at <= thresholds[-1]:
            at = thresholds[-1] + 1
        thresholds.append(at)
    return thresholds


def copy_id(session_id: str, restart: int) -> str:
    """The id of a session's ``restart``-th fresh copy (0 is the original)."""
    return session_id if restart == 0 else f"{session_id}-r{restart}"


def ratio(scratch: float, residual: float) -> float | None:
    """scratch / residual; None when both are 0, inf when only residual is."""
    if residual == 0:
        return None if scratch == 0 else math.inf
    return scratch / residual


@dataclass
class KillPoint:
    """One kill as it happened."""

    threshold: int
    num_completed: int
    """LLMCallCompleted events seen when the planner was killed."""
    at_s: float
    """Seconds after the first request."""
    at_wall: float
    """The kill's wall clock time (POSIX seconds), to compare with log timestamps."""
    num_abandoned: int = 0
    """Sessions started again from scratch (scratch mode)."""
    restart_after_s: float | None = None
    """From the kill to the new planner process (scratch mode: after the cancels and new requests)."""
    back_after_s: float | None = None
    """From the kill to the restarted planner's first append."""


@dataclass
class Observed:
    """What the bench read from one mode's log, and what it did to it."""

    book: SessionBook = field(default_factory=SessionBook)
    latest: dict[str, str] = field(default_factory=dict)
    """Session (the original id) -> id of its latest copy, for the sessions requested so far."""
    llm_completed: set[str] = field(default_factory=set)
    """Event ids of LLMCallCompleted (every copy)."""
    tool_starts: Counter[tuple[str, str]] = field(default_factory=Counter)
    """(session copy, call id) -> ToolCallStarted events."""
    seen_starts: set[str] = field(default_factory=set)
    kills: list[KillPoint] = field(default_factory=list)
    last_action_at: datetime | None = None

    def add(self, event: LoggedEvent) -> None:
        self.book.add(event)
        body = event.body
        if isinstance(body, ev.LLMCallCompleted):
            self.llm_completed.add(event.envelope.event_id)
        elif isinstance(body, ev.ToolCallStarted) and event.envelope.event_id not in self.seen_starts:
            self.seen_starts.add(event.envelope.event_id)
            self.tool_starts[(event.session_id, body.call_id)] += 1
        if event.topic == AGENT_ACTIONS.name:
            at = event.envelope.occurred_at
            self.last_action_at = at if self.last_action_at is None else max(self.last_action_at, at)
            for kill in self.kills:
                if kill.back_after_s is None and at.timestamp() > kill.at_wall:
                    kill.back_after_s = at.timestamp() - kill.at_wall

    def unfinished(self) -> list[str]:
        """Sessions (original ids) requested so far whose latest copy has not finished."""
        records = self.book.records
        return [s for s, c in self.latest.items() if c not in records or not records[c].state.finished]


@dataclass
class ModeResult:
    """The numbers of one mode (see the module docstring for their meaning)."""

    mode: str
    num_sessions: int
    num_finished: int
    num_failed: int
    num_kills: int
    num_abandoned: int
    llm_calls_needed: int
    llm_calls_computed: int
    llm_calls_issued_again: int
    llm_calls_answered_from_record: int
    prefill_tokens_computed: int
    prefill_tokens_recomputed: int
    prefill_recomputed_logged: int
    prefill_recomputed_unlogged: int
    tool_calls_needed: int
    tool_calls_started: int
    tool_calls_executed_again: int
    wall_s: float
    mean_job_s: float
    planner_back_after_s: float
    kill_points: list[dict[str, Any]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    """Latest copies that did not finish, with their status and reason."""
    anomalies: list[str] = field(default_factory=list)
    """What the session folds found odd (a second verdict, an output for an unknown call)."""


def measure(
    mode: str,
    records: Mapping[str, SessionRecord],
    latest: Mapping[str, str],
    tool_starts: Mapping[tuple[str, str], int],
    served: Mapping[str, tuple[int, int]],
    engine_stats: Mapping[str, Any],
    kills: Sequence[KillPoint] = (),
) -> ModeResult:
    """The numbers of one mode from its folded log, the engine's record and ``/stats``.

    ``latest``: original session id -> latest copy; ``served``: engine request id ->
    (prompt tokens, cached tokens) of every request the engine computed.
    """
    finals = [records[c] for c in latest.values() if c in records]
    done = [r for r in finals if r.state.status is SessionStatus.FINISHED]
    needed_copies = {r.state.session_id for r in finals}
    needed_requests = {request_id(r.state.session_id, call) for r in finals for call in r.state.llm_calls}
    needed_tools = {(r.state.session_id, call) for r in finals for call in r.state.tool_calls}

    logged_requests: set[str] = set()
    recomputed_logged = 0
    for record in records.values():
        for call in record.state.llm_calls.values():
            if call.completed is None:
                continue
            logged_requests.add(request_id(record.state.session_id, call.call_id))
            if record.state.session_id not in needed_copies:
                recomputed_logged += call.completed.prompt_tokens - call.completed.cached_tokens
    recomputed_unlogged = sum(
        prompt - cached
        for rid, (prompt, cached) in served.items()
        if rid not in logged_requests and rid not in needed_requests
    )

    starts = sum(tool_starts.values())
    again = sum(n - 1 if key in needed_tools else n for key, n in tool_starts.items() if n > 0)

    requested = {s: at for s in latest if s in records and (at := records[s].requested_at) is not None}
    ended = {s: at for s, c in latest.items() if c in records and (at := records[c].ended_at) is not None}
    wall = (max(ended.values()) - min(requested.values())).total_seconds() if requested and ended else math.nan
    jobs = [(ended[s] - requested[s]).total_seconds() for s in ended if s in requested]
    backs = [k.back_after_s for k in kills if k.back_after_s is not None]
    num_served = int(engine_stats.get("num_served", len(served)))
    return ModeResult(
        mode=mode,
        num_sessions=len(latest),
        num_finished=len(done),
        num_failed=sum(r.state.finished and r.state.status is not SessionStatus.FINISHED for r in finals),
        num_kills=len(kills),
        num_abandoned=sum(k.num_abandoned for k in kills),
        llm_calls_needed=len(needed_requests),
        llm_calls_computed=num_served,
        llm_calls_issued_again=num_served - len(needed_requests),
        llm_calls_answered_from_record=int(engine_stats.get("num_replayed", 0)),
        prefill_tokens_computed=sum(prompt - cached for prompt, cached in served.values()),
        prefill_tokens_recomputed=recomputed_logged + recomputed_unlogged,
        prefill_recomputed_logged=recomputed_logged,
        prefill_recomputed_unlogged=recomputed_unlogged,
        tool_calls_needed=len(needed_tools),
        tool_calls_started=starts,
        tool_calls_executed_again=again,
        wall_s=wall,
        mean_job_s=sum(jobs) / len(jobs) if jobs else math.nan,
        planner_back_after_s=sum(backs) / len(backs) if backs else math.nan,
        kill_points=[asdict(kill) for kill in kills],
        failures=[
            f"{r.state.session_id}: {r.state.status.value if r.state.status else '?'} {r.state.failure or ''}".strip()
            for r in finals
            if r.state.status is not SessionStatus.FINISHED
        ],
        anomalies=[f"{r.state.session_id}: {a}" for r in records.values() for a in r.state.anomalies],
    )


ROWS: tuple[tuple[str, str, str], ...] = (
    # (label, ModeResult field, format)
    ("sessions finished", "num_finished", "d"),
    ("planner kills", "num_kills", "d"),
    ("sessions started again from scratch", "num_abandoned", "d"),
    ("LLM calls needed", "llm_calls_needed", "d"),
    ("LLM calls computed by the engine", "llm_calls_computed", "d"),
    ("LLM calls issued again", "llm_calls_issued_again", "d"),
    ("  answered from the engine record", "llm_calls_answered_from_record", "d"),
    ("prefill tokens computed", "prefill_tokens_computed", ",d"),
    ("prefill tokens recomputed", "prefill_tokens_recomputed", ",d"),
    ("tool calls needed", "tool_calls_needed", "d"),
    ("tool calls started", "tool_calls_started", "d"),
    ("tool calls executed again", "tool_calls_executed_again", "d"),
    ("wall time (s)", "wall_s", ".2f"),
    ("mean job time (s)", "mean_job_s", ".2f"),
    ("planner back after (s, mean)", "planner_back_after_s", ".2f"),
)


def format_table(residual: ModeResult, scratch: ModeResult) -> str:
    """Both modes side by side, with scratch / residual."""
    width = max(len(label) for label, _, _ in ROWS)
    lines = [f"{'':<{width}}  {'residual':>12}  {'scratch':>12}  {'scratch/residual':>16}"]
    for label, name, spec in ROWS:
        a, b = getattr(residual, name), getattr(scratch, name)
        r = ratio(b, a)
        shown = "-" if r is None or math.isnan(r) else "inf" if math.isinf(r) else f"{r:.2f}x"
        lines.append(f"{label:<{width}}  {_fmt(a, spec):>12}  {_fmt(b, spec):>12}  {shown:>16}")
    return "\n".join(lines)


def _fmt(value: float, spec: str) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "-"
    return format(value, spec)


def read_served(path: Path) -> dict[str, tuple[int, int]]:
    """The engine's record of computed requests: request id -> (prompt tokens, cached tokens)."""
    served: dict[str, tuple[int, int]] = {}
    if not path.exists():
        return served
    for line in path.read_text().splitlines():
        if line.strip():
            entry = json.loads(line)
            usage = entry["response"]["usage"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            served[entry["request_id"]] = (int(usage["prompt_tokens"]), int(cached))
    return served


# ---------------------------------------------------------------- the workload


@dataclass(frozen=True)
class Workload:
    sessions: list[tuple[str, dict[str, Any]]]
    """(session id, trace session as the ``trace`` program's ``session`` argument), in arrival order."""
    arrivals: list[float]
    """Real seconds after the first request."""

    @property
    def num_llm_calls(self) -> int:
        return sum(len(s["turns"]) for _, s in self.sessions)


def make_workload(num_sessions: int, arrival_rate: float, seed: int, time_scale: float) -> Workload:
    from cli.demo import load_infercept

    sessions = sorted(load_infercept(num_sessions, arrival_rate, seed), key=lambda s: s["arrival_s"])
    first = sessions[0]["arrival_s"]
    return Workload(
        [(f"rec-{i:03d}-{s['session_id'][:8]}", s) for i, s in enumerate(sessions)],
        [(s["arrival_s"] - first) * time_scale for s in sessions],
    )


# ------------------------------------------------------------------- one mode


class ModeRun:
    """Drives one mode: a fresh namespace and stack, the arrivals, the kills, the reading back."""

    def __init__(
        self, mode: str, workload: Workload, thresholds: list[int], args: argparse.Namespace, work_dir: Path
    ) -> None:
        self.mode = mode
        self.workload = workload
        self.thresholds = thresholds
        self.log_url: str | None = args.log_url
        self.timeout_s: float = args.timeout
        self.namespace = f"rec{uuid.uuid4().hex[:8]}{mode}"
        self.stack = Stack(
            self.log_url, work_dir / mode, time_scale=args.time_scale, extra_env={"AGENTLOG_NAMESPACE": self.namespace}
        )
        self.observed = Observed()
        self.programs = {sid: {"session": session} for sid, session in workload.sessions}
        self.restarts: Counter[str] = Counter()
        self.began = 0.0
        self.engine_stats: dict[str, Any] = {}

    def say(self, message: str) -> None:
        print(f"[{self.mode}] {message}", flush=True)

    def run(self) -> ModeResult:
        asyncio.run(self._create_topics())
        try:
            try:
                self.stack.start()
            except (RuntimeError, TimeoutError) as e:
                raise BenchError(self._stuck(f"the stack did not start: {e}")) from e
            self.say(f"stack up (namespace {self.namespace}, logs in {self.stack.work_dir / 'logs'})")
            asyncio.run(self._drive())
        except BaseException:
            self.stack.stop()
            raise
        self.stack.stop()
        o = self.observed
        served = read_served(self.stack.work_dir / "engine" / "served.jsonl")
        return measure(self.mode, o.book.records, o.latest, o.tool_starts, served, self.engine_stats, o.kills)

    async def _create_topics(self, partitions: int = 4) -> None:
        log = open_log(self.log_url, actor="admin", namespace=self.namespace)
        await log.backend.start()
        try:
            await log.backend.create_topics(partitions)
        finally:
            await log.backend.close()

    async def _drive(self) -> None:
        group = f"recovery-bench-{uuid.uuid4().hex[:8]}"
        async with (
            open_log(self.log_url, actor="operator", namespace=self.namespace) as log,
            log.consumer(group, SESSION_TOPICS, from_beginning=True) as consumer,
        ):
            o = self.observed
            sessions, arrivals = self.workload.sessions, self.workload.arrivals
            self.began = time.monotonic()
            deadline = self.began + self.timeout_s
            next_session = 0
            kills = list(self.thresholds)
            last_kill_count = -1
            while True:
                self._check_alive()
                elapsed = time.monotonic() - self.began
                while next_session < len(sessions) and arrivals[next_session] <= elapsed:
                    sid = sessions[next_session][0]
                    o.latest[sid] = sid
                    await log.append_many([self._request_draft(sid, sid)])
                    next_session += 1
                if next_session == len(sessions) and not o.unfinished():
                    break
                if time.monotonic() > deadline:
                    raise BenchError(self._stuck(f"the sessions did not finish within {self.timeout_s:g} s"))
                wait = POLL_S if next_session == len(sessions) else arrivals[next_session] - elapsed
                for event in await consumer.poll(timeout_s=min(POLL_S, max(0.01, wait)), max_records=5000):
                    o.add(event)
                count = len(o.llm_completed)
                if kills and count >= max(kills[0], last_kill_count + 1):
                    await self._kill(log, consumer, kills.pop(0))
                    last_kill_count = len(o.llm_completed)
            done = time.monotonic() - self.began
            self.say(f"every session finished after {done:.1f} s; stopping the workers")
            await asyncio.to_thread(self._stop_workers)
            self.engine_stats = await asyncio.to_thread(self._read_engine_stats)
            await self._read_to_end(log, consumer, SESSION_TOPICS)

    def _request_draft(self, session: str, copy: str) -> Draft:
        """The request of one copy of ``session`` (its event id makes a repeat a no-op, as in logctl run)."""
        body = ev.SessionRequested(program="trace", args_json=json.dumps(self.programs[session]), author=OPERATOR)
        return Draft(copy, body, event_id=f"request/{copy}")

    async def _kill(self, log: SharedLog, consumer: Any, threshold: int) -> None:
        o = self.observed
        planner = self.stack.processes[PLANNER]
        old_pid = planner.pid
        planner.kill()
        kill = KillPoint(threshold, len(o.llm_completed), time.monotonic() - self.began, time.time())
        if self.mode == "scratch":
            # Only the planner writes agent.actions: once it is dead, reading that topic to
            # its end tells exactly which sessions finished.
            await self._read_to_end(log, consumer, [AGENT_ACTIONS.name])
            abandoned = o.unfinished()
            drafts: list[Draft] = []  # cancels and requests all go to ops.commands: one batch
            for session in abandoned:
                reason = "restart from scratch: the planner crashed"
                drafts.append(Draft(o.latest[session], ev.CancelRequested(author=OPERATOR, reason=reason)))
                self.restarts[session] += 1
                o.latest[session] = copy_id(session, self.restarts[session])
                drafts.append(self._request_draft(session, o.latest[session]))
            await log.append_many(drafts)
            kill.num_abandoned = len(abandoned)
        o.kills.append(kill)
        new_pid = self.stack.start_process(PLANNER).pid
        kill.restart_after_s = time.time() - kill.at_wall
        note = f", {kill.num_abandoned} sessions abandoned and requested again" if self.mode == "scratch" else ""
        self.say(
            f"kill {len(o.kills)}/{len(self.thresholds)} at {kill.num_completed} LLM calls completed "
            f"(threshold {threshold}, {kill.at_s:.1f} s): planner pid {old_pid} SIGKILLed{note}; "
            f"restarted as pid {new_pid}"
        )

    async def _read_to_end(self, log: SharedLog, consumer: Any, topics: Iterable[str], timeout_s: float = 60) -> None:
        """Poll until the consumer has read every partition of ``topics`` up to its end offset now."""
        ends = {(t, p): end for t in topics for p, end in (await log.end_offsets(t)).items()}
        deadline = time.monotonic() + timeout_s
        while any(consumer.position(t, p) < end for (t, p), end in ends.items()):
            if time.monotonic() > deadline:
                behind = {f"{t}[{p}]": end - consumer.position(t, p) for (t, p), end in ends.items()}
                raise BenchError(self._stuck(f"could not read the log to its end within {timeout_s:g} s: {behind}"))
            for event in await consumer.poll(timeout_s=POLL_S, max_records=5000):
                self.observed.add(event)

    def _check_alive(self) -> None:
        for name, process in self.stack.processes.items():
            if not process.alive():
                code = process.popen.returncode if process.popen else None
                raise BenchError(self._stuck(f"{name} (pid {process.pid}) exited with code {code} on its own"))

    def _stop_workers(self) -> None:
        for name, process in self.stack.processes.items():
            if name != "engine":
                code = process.stop()
                if code not in (0, None):
                    self.say(f"warning: {name} exited with code {code} when stopped (see {process.log_path})")

    def _read_engine_stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.stack.engine_url}/stats", timeout=10) as response:
            stats: dict[str, Any] = json.loads(response.read())
            return stats

    def _stuck(self, what: str) -> str:
        o = self.observed
        unfinished = o.unfinished()
        tails = "\n".join(
            f"--- {name} ({process.log_path}), last lines:\n{process.log_tail(30)}"
            for name, process in self.stack.processes.items()
        )
        waiting = len(self.workload.sessions) - len(o.latest)
        names = ", ".join(o.latest[s] for s in unfinished[:10]) + (" ..." if len(unfinished) > 10 else "")
        return (
            f"[{self.mode}] {what}; {len(o.latest) - len(unfinished)} sessions done, {len(unfinished)} unfinished"
            f"{f' ({names})' if names else ''}, {waiting} not requested yet; "
            f"{len(o.llm_completed)} LLM calls completed, {len(o.kills)} kills\n{tails}"
        )


# ------------------------------------------------------------------------ main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.recovery",
        description="Recovery after planner crashes: residual completion vs restart from scratch.",
    )
    parser.add_argument("--sessions", type=int, default=DEFAULT_SESSIONS, help="InferCept sessions (default 30)")
    parser.add_argument("--kills", type=int, default=DEFAULT_KILLS, help="planner SIGKILLs per mode (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="which sessions, arrivals and kill points")
    parser.add_argument("--time-scale", type=float, default=0.01, help="multiply tool and engine time (0.01)")
    parser.add_argument("--arrival-rate", type=float, default=0.2, help="arrivals per second of trace time")
    parser.add_argument("--log-url", default=None, help="kafka://host:port or postgresql://...; default embedded")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per mode (default 240)")
    parser.add_argument("--work-dir", type=Path, default=None, help="stack logs and engine state")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers to this file")
    args = parser.parse_args(argv)
    if args.sessions < 1 or args.kills < 0:
        parser.error("--sessions must be at least 1 and --kills at least 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from log.embedded import data_dir

    run_id = uuid.uuid4().hex[:6]
    work_dir = args.work_dir or data_dir() / "runs" / f"recovery-{run_id}"
    workload = make_workload(args.sessions, args.arrival_rate, args.seed, args.time_scale)
    thresholds = kill_thresholds(workload.num_llm_calls, args.kills, random.Random(args.seed))
    print(
        f"recovery bench {run_id}: {len(workload.sessions)} InferCept sessions ({workload.num_llm_calls} LLM calls), "
        f"arrivals over {workload.arrivals[-1]:.1f} s, time x{args.time_scale:g}, "
        f"on {args.log_url or 'the embedded log'}; kills at LLMCallCompleted counts {thresholds}",
        flush=True,
    )
    results: dict[str, ModeResult] = {}
    try:
        for mode in MODES:
            results[mode] = ModeRun(mode, workload, thresholds, args, work_dir).run()
    except BenchError as e:
        print(f"\nrecovery bench failed: {e}", file=sys.stderr)
        return 1
    residual, scratch = results["residual"], results["scratch"]
    print()
    print(format_table(residual, scratch))
    for result in (residual, scratch):
        if result.num_kills < len(thresholds):
            print(f"\n{result.mode}: only {result.num_kills} of {len(thresholds)} kills happened (the run ended first)")
        if result.failures:
            print(f"\n{result.mode}: {len(result.failures)} sessions did not finish: {'; '.join(result.failures)}")
        if result.anomalies:
            print(f"\n{result.mode}: {len(result.anomalies)} anomalies in the log: {'; '.join(result.anomalies)}")
        if result.llm_calls_needed != workload.num_llm_calls:
            print(
                f"\n{result.mode}: the finished sessions made {result.llm_calls_needed} LLM calls, "
                f"the workload has {workload.num_llm_calls}"
            )
    if args.json:
        report = {
            "run_id": run_id,
            "config": {
                "sessions": args.sessions,
                "kills": args.kills,
                "seed": args.seed,
                "time_scale": args.time_scale,
                "arrival_rate": args.arrival_rate,
                "log_url": args.log_url or "embedded",
                "kill_thresholds": thresholds,
                "workload_llm_calls": workload.num_llm_calls,
            },
            "residual": asdict(residual),
            "scratch": asdict(scratch),
            "ratio_scratch_over_residual": {
                name: ratio(getattr(scratch, name), getattr(residual, name)) for _, name, _ in ROWS
            },
        }
        args.json.write_text(json.dumps(_json_safe(report), indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


def _json_safe(value: object) -> object:
    """``value`` with NaN and infinities as null (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


if __name__ == "__main__":
    sys.exit(main())
