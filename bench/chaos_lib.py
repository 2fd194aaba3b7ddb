"""Chaos on a real stack: sessions, an operator loop, a seeded fault schedule, and the invariants.

Shared by ``bench/chaos.py`` (at scale) and the end-to-end tests (``tests/e2e/test_recovery.py``
drives its crash-point scenarios with ``Operator``). Everything is real: OS processes from
``cli.stack``, a Kafka broker of the run's own (``LocalKafkaBroker``, its own port and data
directory, so it can be SIGKILLed, paused and restarted without touching anyone else's), and
Postgres for the ledger and the planners' snapshots.

``fault_schedule`` is pure: the same seed gives the same faults at the same offsets.
The invariants are read back from the log, the ledger and the engine's record after the run,
never inferred from timers.

Postgres restarts are in the schedule only when the run has a Postgres of its own
(``ChaosRun.pg_data``: an embedded server started for the run); a server others use is
never restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
from typer.testing import CliRunner

from bench.chaos_resources import (
    WORK_TAG,
    ResourceCount,
    count_log,
    count_ports_left,
    describe_pid,
    entries_left,
    kill_all,
    logged_ports,
    run_pids,
    tagged_pids,
)
from bench.chaos_tools import TAG as TOOL_TAG
from cli.common import ensure_topics
from cli.main import app
from cli.sessions import SessionBook, read_log, read_sessions
from cli.stack import Backoff, Stack, Supervisor, free_port
from log import open_log
from log.kafka_backend import BOUNDED_DELIVERY_TIMEOUT_MS
from log.local_kafka import LocalKafkaBroker
from schemas import events as ev
from services.session import SessionState

OPERATOR = "chaos-operator"
ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")


def script(i: int, hold_tag: str | None = None) -> dict[str, Any]:
    """LLM, tool, LLM, payment, LLM: every kind of step, an irreversible one in the middle.

    With ``hold_tag`` (a stack that loads ``bench.chaos_tools``), a ``chaos_hold`` step after the
    sleep: a directory, a process and a port acquired through the executor, owned by the session
    until it ends."""
    hold = [{"tool": "chaos_hold", "arguments": {"tag": hold_tag, "seconds": 5}}] if hold_tag else []
    return {
        "steps": [
            {"llm": {"prompt_tokens": 120, "output_tokens": 8}},
            {"tool": "sleep", "arguments": {"seconds": 0.05}},
            *hold,
            {"llm": {"prompt_tokens": 40, "output_tokens": 8}},
            {"tool": "payment", "arguments": {"account": f"acct-{i}", "amount_cents": 100 + i}},
            {"llm": {"prompt_tokens": 30, "output_tokens": 4}},
        ]
    }


LLM_CALLS_PER_SESSION = 3


class Operator:
    """Watches the log like a person would: approves held payments, resolves in-doubt calls
    from the ledger (did the payment happen?), and has dead processes restarted."""

    def __init__(
        self, log_url: str, namespace: str, pg_url: str, stack: Stack, sessions: list[str], hold_tag: str | None = None
    ) -> None:
        self.log_url = log_url
        self.namespace = namespace
        self.pg_url = pg_url
        self.stack = stack
        self.sessions = sessions
        self.hold_tag = hold_tag
        """Sessions acquire resources (``script``'s ``chaos_hold`` step) tagged with this."""
        self.book = SessionBook()
        """What the operator has seen so far (an interrupted run reports from it)."""
        self.appended: set[tuple[str, str, str]] = set()
        """(session, event type, call id) of every append of this operator the log acknowledged."""
        self.on_events: Callable[[float, list[Any]], None] | None = None
        """Called with (time.time(), events) for every poll that returned events."""

    async def request(self, log: Any, i: int, session: str) -> None:
        body = ev.SessionRequested(program="script", args_json=json.dumps(script(i, self.hold_tag)), author=OPERATOR)
        # One event id per session: a request retried after its first try landed is a no-op.
        await log.append(session, body, event_id=request_event_id(session))
        self.appended.add((session, "SessionRequested", ""))

    async def request_all(self) -> None:
        async with open_log(self.log_url, actor="operator", namespace=self.namespace) as log:
            for i, session in enumerate(self.sessions):
                await self.request(log, i, session)

    async def read(self) -> SessionBook:
        async with open_log(self.log_url, actor="auditor", namespace=self.namespace) as log:
            book = await read_sessions(log, group=f"check-{uuid.uuid4().hex[:6]}", idle_polls=1)
        return book

    async def payments(self) -> list[tuple[str, int]]:
        conn = await asyncpg.connect(self.pg_url)
        try:
            rows = await conn.fetch(
                "SELECT idempotency_key, count(*) FROM agentlog_ledger.payments WHERE session_id = ANY($1::text[]) "
                "GROUP BY idempotency_key",
                self.sessions,
            )
        finally:
            await conn.close()
        return [(r[0], r[1]) for r in rows]

    def engine_stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.stack.engine_url}/stats", timeout=5) as response:
            stats: dict[str, Any] = json.loads(response.read())
            return stats

    def restart_dead(self) -> None:
        """Start again, at once and without a crash point, whatever died."""
        for name, process in list(self.stack.processes.items()):
            if not process.alive():
                self.stack.start_process(name, {"AGENTLOG_CRASH_AT": ""})  # the restart runs clean
                if name == "engine":
                    self.stack.wait_for_engine(30)

    async def operate(
        self,
        deadline_s: float,
        *,
        restart: Callable[[], None] | None = None,
        outages: bool = False,
        until: Callable[[], bool] | None = None,
        on_watching: Callable[[], None] | None = None,
        ended: Callable[[SessionState], bool] | None = None,
    ) -> tuple[SessionBook, list[str]]:
        """Operate until every session has ended (and ``until()``, if given, holds: more sessions
        may still be coming); then fold the whole log once more, cold.

        ``restart`` is called every round (default ``restart_dead``). With ``outages`` (the
        broker may be down or paused), an operator action that fails is tried again next round.
        ``on_watching`` is called once the operator's consumer is open (faults may begin then).
        ``ended``: what "ended" means for a session (default: finished, failed or cancelled).
        """
        restart = restart or self.restart_dead
        ended = ended or (lambda state: state.finished)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + deadline_s
        resolved: list[str] = []
        approved: set[tuple[str, str]] = set()
        book = self.book = SessionBook()
        topics = ["agent.actions", "agent.verdicts", "agent.effects", "ops.commands"]
        # What the rounds swallowed while the broker was out (step: error -> times, first at):
        # told with a run that does not finish, so that a watcher stuck for good says why.
        swallowed: dict[str, list[float]] = {}
        started_at = last_events_at = loop.time()
        async with (
            open_log(self.log_url, actor="operator", namespace=self.namespace) as log,
            log.consumer(f"watch-{uuid.uuid4().hex[:6]}", topics, from_beginning=True) as consumer,
        ):
            if on_watching is not None:
                on_watching()
            while loop.time() < deadline:
                restart()
                step = "poll"
                try:
                    events = await consumer.poll(timeout_s=0.3)
                    if events:
                        last_events_at = loop.time()
                    if events and self.on_events is not None:
                        self.on_events(time.time(), events)
                    step = "fold"
                    book.add_all(events)
                    step = "act"
                    if not outages:
                        await self._act(log, book, approved, resolved)
                    elif self._has_work(book, approved, resolved):
                        await asyncio.wait_for(self._act_on_fresh_log(book, approved, resolved), ACT_TIMEOUT_S)
                except Exception as e:
                    if not outages:
                        raise
                    seen = swallowed.setdefault(f"{step}: {type(e).__name__}: {str(e)[:300]}", [0, loop.time()])
                    seen[0] += 1
                    await asyncio.sleep(0.5)  # the broker is down or paused: the next round tries again
                more = until is not None and not until()
                if not more and all(s in book.records and ended(book.records[s].state) for s in self.sessions):
                    return await self.read(), resolved
            watcher = (
                f"the operator's consumer: {consumer.stats.num_delivered} events delivered, the last "
                f"{loop.time() - last_events_at:.0f} s ago; reads {consumer.reads}; partitions at its last poll "
                f"{len(consumer.assignment_at_poll())}, now {len(consumer.assignment())}; {consumer.membership()}\n"
                "errors its rounds swallowed (times, first at s):\n"
                + "".join(f"  {n} x, {at - started_at:.0f} s: {what}\n" for what, (n, at) in swallowed.items())
            )
        raise AssertionError(f"sessions did not finish in {deadline_s} s\n{watcher}{self.describe(book)}")

    def _has_work(self, book: SessionBook, approved: set[tuple[str, str]], resolved: list[str]) -> bool:
        for session in self.sessions:
            record = book.records.get(session)
            for call_id, tool in record.state.tool_calls.items() if record else ():
                held = tool.proposed.tool == "payment" and tool.status.value == "proposed"
                if held and (session, call_id) not in approved:
                    return True
                if tool.status.value == "in_doubt" and f"{session}/{call_id}" not in resolved:
                    return True
        return False

    async def _act_on_fresh_log(self, book: SessionBook, approved: set[tuple[str, str]], resolved: list[str]) -> None:
        """Across broker restarts, each round's appends go through a log (a producer) of its own:
        an append whose acknowledgement was lost with the old broker must not hold the operator."""
        async with open_log(self.log_url, actor="operator", namespace=self.namespace) as log:
            await self._act(log, book, approved, resolved)

    async def _act(self, log: Any, book: SessionBook, approved: set[tuple[str, str]], resolved: list[str]) -> None:
        for session in self.sessions:
            record = book.records.get(session)
            for call_id, tool in record.state.tool_calls.items() if record else ():
                key = (session, call_id)
                if tool.proposed.tool == "payment" and tool.status.value == "proposed" and key not in approved:
                    await log.append(
                        session,
                        ev.ApprovalGiven(
                            call_id=call_id, decision=ev.ApprovalDecision.APPROVE, author=OPERATOR, reason="ok"
                        ),
                    )
                    approved.add(key)
                    self.appended.add((session, "ApprovalGiven", call_id))
                if tool.status.value == "in_doubt" and f"{session}/{call_id}" not in resolved:
                    # The operator checks the outside world (the ledger): did the payment happen?
                    done = tool.proposed.idempotency_key in dict(await self.payments())
                    flag = "--mark-done" if done else "--retry"
                    argv = ["approve", session, call_id, flag, "--log-url", self.log_url, "--reason", "ledger"]
                    result = await asyncio.to_thread(
                        CliRunner().invoke, app, argv, env={"AGENTLOG_NAMESPACE": self.namespace}
                    )
                    assert result.exit_code == 0, result.output
                    resolved.append(f"{session}/{call_id}")

    def describe(self, book: SessionBook) -> str:
        states = "\n".join(
            f"{s}: {r.state.status} llm={[(c, bool(x.completed)) for c, x in r.state.llm_calls.items()]} "
            f"tools={[(c, t.status.value, t.attempts) for c, t in r.state.tool_calls.items()]} "
            f"early={list(r.state.early)} "
            f"resources={[(x.resource_id, x.kind.value, x.status.value) for x in r.state.resources.values() if x.live]}"
            for s, r in book.records.items()
        )
        logs = "\n".join(f"--- {n}\n{p.log_tail(60)}" for n, p in self.stack.processes.items())
        return f"{states}\n{logs}"


# ------------------------------------------------------------------------------ the fault schedule

ROLES = ("planner-0", "planner-1", "decider", "executor", "engine")
BROKER_KILL = "broker-kill"
BROKER_PAUSE = "broker-pause"
ENGINE_RESTART = "engine-restart"
POSTGRES_RESTART = "postgres-restart"


def kill(role: str) -> str:
    return f"kill {role}"


@dataclass(frozen=True)
class Fault:
    at_s: float
    """Seconds after the first session was requested."""
    kind: str
    """``kill <role>`` (SIGKILL), ``broker-kill`` (SIGKILL, then a restart on the same port and
    data), ``broker-pause`` (SIGSTOP past the consumers' session timeout, then SIGCONT) or
    ``engine-restart`` (SIGTERM; the supervisor starts it again) or ``postgres-restart`` (the
    ledger's and snapshots' server stopped, fast shutdown, and started again on the same data)."""


def fault_schedule(
    seed: int,
    num_faults: int,
    window_s: float,
    roles: tuple[str, ...] = ROLES,
    min_broker_kills: int = 1,
    *,
    postgres: bool = False,
) -> list[Fault]:
    """``num_faults`` faults at seeded random offsets in ``window_s``, sorted by time.

    Broker faults are one in ten (at least ``min_broker_kills``: kills and pauses in turn),
    kept at least ``BROKER_GAP_S`` apart so that each outage is over before the next begins;
    every other fault is a role SIGKILL, an engine restart or (with ``postgres``) a Postgres
    restart, chosen uniformly."""
    rng = random.Random(seed)
    num_broker = min(num_faults, max(min_broker_kills, num_faults // 10))
    slots = max(1, int(window_s // BROKER_GAP_S))
    # Not in the first slot: the stack and the operator are still connecting then.
    first = 1 if slots > 1 else 0
    broker_slots = sorted(rng.sample(range(first, slots), min(num_broker, slots - first)))
    faults = [
        Fault(
            round(slot * BROKER_GAP_S + rng.uniform(0, BROKER_GAP_S / 4), 3),
            BROKER_KILL if i % 2 == 0 else BROKER_PAUSE,
        )
        for i, slot in enumerate(broker_slots)
    ]
    kinds = [kill(r) for r in roles] + [ENGINE_RESTART] + ([POSTGRES_RESTART] if postgres else [])
    faults += [Fault(round(rng.uniform(0, window_s), 3), rng.choice(kinds)) for _ in range(num_faults - len(faults))]
    return sorted(faults, key=lambda f: (f.at_s, f.kind))


ACT_TIMEOUT_S = 30.0
"""An operator round (or a request) not acknowledged in this long is given up and tried again."""
BROKER_GAP_S = 20.0
PAUSE_S = 9.0
"""Longer than the consumers' 6 s session timeout (log/kafka_backend.py): the group drops them."""


@dataclass
class Postgres:
    """The run's own embedded Postgres (``python -m log.embedded``, in a process of its own each
    time: the library keeps one server handle per data directory and process)."""

    pgdata: Path
    url: str = ""

    def _embedded(self, command: str) -> str:
        argv = [sys.executable, "-m", "log.embedded", command, "--pgdata", str(self.pgdata)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"log.embedded {command} failed: {done.stderr.strip()[-500:]}")
        return done.stdout.strip()

    def start(self) -> str:
        self.pgdata.parent.mkdir(parents=True, exist_ok=True)
        url = self._embedded("start").removeprefix("AGENTLOG_PG_URL=")
        # Same data directory, same socket directory: the URL the stack holds stays good.
        if self.url and url != self.url:
            raise RuntimeError(f"Postgres came back at another address ({url}, was {self.url})")
        self.url = url
        return url

    def stop(self) -> None:
        self._embedded("stop")

    def restart(self) -> None:
        self.stop()
        self.start()


class FaultInjector(threading.Thread):
    """Applies a schedule to a running stack and broker, from its own thread."""

    def __init__(
        self, schedule: list[Fault], stack: Stack, broker: LocalKafkaBroker, postgres: Postgres | None = None
    ) -> None:
        super().__init__(name="faults", daemon=True)
        self.schedule = schedule
        self.stack = stack
        self.broker = broker
        self.postgres = postgres
        self.applied: Counter[str] = Counter()
        self.broker_back_at: list[float] = []
        """time.time() of each broker kill or pause (its recovery is measured from there)."""
        self.broker_down = threading.Event()
        self.errors: list[str] = []
        self._halt = threading.Event()

    def run(self) -> None:
        began = time.monotonic()
        for fault in self.schedule:
            if self._halt.wait(max(0.0, began + fault.at_s - time.monotonic())):
                return
            try:
                self.apply(fault.kind)
                self.applied[fault.kind] += 1
            except Exception as error:  # reported with the run's results
                self.errors.append(f"{fault}: {type(error).__name__}: {error}")

    def stop(self) -> None:
        self._halt.set()
        if self.ident is not None:  # started
            self.join()

    def apply(self, kind: str) -> None:
        if kind == BROKER_KILL:
            self.broker_down.set()
            self.broker_back_at.append(time.time())
            self.broker.kill()
            self.broker.start()
            self.broker_down.clear()
        elif kind == BROKER_PAUSE:
            pid = self.broker.pid
            assert pid is not None
            self.broker_back_at.append(time.time())
            os.kill(pid, signal.SIGSTOP)
            self._halt.wait(PAUSE_S)  # a run that is stopping cuts the pause short
            os.kill(pid, signal.SIGCONT)
        elif kind == ENGINE_RESTART:
            self.stack.processes["engine"].stop()
        elif kind == POSTGRES_RESTART:
            assert self.postgres is not None, "a Postgres restart in a run without a Postgres of its own"
            self.postgres.restart()
        else:
            role = kind.removeprefix("kill ")
            if role in self.stack.processes:
                self.stack.processes[role].kill()


# ------------------------------------------------------------------------------ one run


@dataclass
class ChaosReport:
    sessions: int
    faults: Counter[str]
    requested_during_faults: int = 0
    """Requests acknowledged before the last fault: the sessions the faults could hit."""
    finished: int = 0
    failed_with_reason: int = 0
    unended: list[str] = field(default_factory=list)
    duplicate_payments: int = 0
    missing_payments: int = 0
    recomputed_llm_calls: int = 0
    events_lost: int = 0
    verify_problems: int = -1
    verify_details: list[str] = field(default_factory=list)  # what logctl verify said, for a failing run
    dead_processes: list[str] = field(default_factory=list)
    fault_errors: list[str] = field(default_factory=list)
    recover_s: list[float] = field(default_factory=list)
    seconds: float = 0.0
    resources: ResourceCount | None = None
    """What the sessions acquired (``chaos_hold``), released and left (None: a run without it)."""
    left_after_stop: list[str] = field(default_factory=list)
    """Processes of the run still alive after it stopped everything (killed then): ``pid command``."""
    stop_errors: list[str] = field(default_factory=list)
    """A part of the run that did not stop (the stack, the broker, Postgres)."""
    interrupted: str | None = None
    """The signal that stopped the run early (SIGINT, SIGTERM): its invariants were not checked."""

    @property
    def ok(self) -> bool:
        return (
            self.interrupted is None
            and (self.resources is None or self.resources.ok)
            and not self.left_after_stop
            and not self.stop_errors
            and not self.unended
            and self.finished + self.failed_with_reason == self.sessions
            and self.duplicate_payments == 0
            and self.missing_payments == 0
            and self.recomputed_llm_calls == 0
            and self.events_lost == 0
            and self.verify_problems == 0
            and not self.dead_processes
            and not self.fault_errors
        )

    def _resource_rows(self) -> list[tuple[str, str]]:
        r = self.resources
        if r is None:
            return []

        def counted(n: int) -> str:
            return "not counted" if n < 0 else str(n)

        rows = [
            ("resources acquired (log)", str(r.acquired)),
            ("  released at the session's end", str(r.released_at_end)),
            ("  reclaimed after an executor SIGKILL", str(r.reclaimed)),
        ]
        if r.released_other:
            rows.append(("  released otherwise", str(r.released_other)))
        return [
            *rows,
            ("resources not released (log)", str(len(r.not_released))),
            ("resource dirs/files left on the machine", counted(r.dirs_left)),
            ("resource processes left on the machine", counted(r.processes_left)),
            ("resource ports left listening", counted(r.ports_left)),
        ]

    def table(self) -> str:
        rec = sorted(self.recover_s)
        median = f"{statistics.median(rec):.1f} s" if rec else "n/a"
        p95 = f"{rec[min(len(rec) - 1, max(0, round(0.95 * len(rec)) - 1))]:.1f} s" if rec else "n/a"
        head = [
            ("sessions", str(self.sessions)),
            ("sessions requested while faults ran", str(self.requested_during_faults)),
            ("faults injected", str(sum(self.faults.values()))),
            *((f"  {kind}", str(n)) for kind, n in sorted(self.faults.items())),
        ]
        tail = [
            ("processes of the run left after its stop", str(len(self.left_after_stop))),
            ("run time", f"{self.seconds:.0f} s"),
        ]
        if self.interrupted is not None:
            # Only what is known: no invariant was checked on a run that did not end.
            rows = [
                *head,
                ("sessions finished (seen so far)", str(self.finished)),
                *self._resource_rows(),
                *tail,
                ("interrupted by", self.interrupted),
                ("all invariants held", "not checked"),
            ]
            return _format(rows)
        rows = [
            *head,
            ("sessions finished", str(self.finished)),
            ("sessions failed (with a reason)", str(self.failed_with_reason)),
            ("sessions not ended", str(len(self.unended))),
            ("duplicate irreversible effects", str(self.duplicate_payments)),
            ("completed effects missing in ledger", str(self.missing_payments)),
            ("recomputed LLM calls", str(self.recomputed_llm_calls)),
            ("events lost", str(self.events_lost)),
            ("logctl verify problems", str(self.verify_problems)),
            *self._resource_rows(),
            ("processes dead at the end", str(len(self.dead_processes))),
            ("broker recoveries measured", str(len(rec))),
            ("recover after broker fault, median", median),
            ("recover after broker fault, p95", p95),
            *tail,
            ("all invariants held", "yes" if self.ok else "NO"),
        ]
        return _format(rows)


def _format(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v:>10}" for k, v in rows)


@dataclass
class ChaosRun:
    work_dir: Path
    pg_url: str | None
    """The ledger's and snapshots' Postgres; None: an embedded one of the run's own (under
    ``work_dir``), which the schedule then restarts too."""
    num_sessions: int
    num_faults: int
    seed: int
    window_s: float = 0.0
    """Faults and session requests are spread over this many seconds (0: a default from the counts)."""
    time_scale: float = 0.1
    deadline_s: float = 600.0
    broker_port: int = 0
    """The run's broker listens here and its controller on the next port (0: free ports)."""
    min_broker_faults: int = 1
    """At least this many broker faults (kills and pauses in turn), if the window has room."""
    requested_during_faults: int = 0
    """Sessions whose request was acknowledged while the schedule was still running."""

    def schedule(self) -> list[Fault]:
        """The faults of this run: the seed, the counts and whether Postgres is the run's own decide them."""
        window = self.window()
        return fault_schedule(
            self.seed, self.num_faults, window, min_broker_kills=self.min_broker_faults, postgres=self.pg_url is None
        )

    def window(self) -> float:
        return self.window_s or max(30.0, self.num_faults * 3.0, self.num_sessions * 0.5)

    def run(self) -> ChaosReport:
        """One run. SIGINT or SIGTERM (on the main thread) stops it early, cleanly: the faults stop,
        the stack, the broker and Postgres are stopped, and the report says what it had
        (``interrupted``; nothing was checked)."""
        with _Signals() as signals:
            return self._run(signals)

    def _run(self, signals: _Signals) -> ChaosReport:
        window = self.window()
        schedule = self.schedule()
        namespace = f"chaos{uuid.uuid4().hex[:8]}"
        # Unique per run (the ledger may be shared, keyed by session): the seed decides the faults only.
        sessions = [f"c{i}-{namespace}" for i in range(self.num_sessions)]
        postgres = Postgres(self.work_dir / "pg" / "data") if self.pg_url is None else None
        # Detached (a session of its own): a Ctrl-C in the terminal reaches this process, which stops
        # the broker last, after the workers drained; not the broker first.
        broker = LocalKafkaBroker(
            self.broker_port, self.broker_port + 1 if self.broker_port else 0, self.work_dir / "kafka", detach=True
        )
        log_url = f"kafka://{broker.bootstrap_servers}"
        plugins = ",".join(filter(None, [os.environ.get("AGENTLOG_PLUGINS"), "bench.chaos_tools"]))
        env = {
            "AGENTLOG_NAMESPACE": namespace,
            "AGENTLOG_LOG_LEVEL": "INFO",
            "AGENTLOG_PLUGINS": plugins,  # every role knows chaos_hold; the executor runs it
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            WORK_TAG: str(self.work_dir),  # the run's processes, and what they start, carry it
        }
        stack = Stack(log_url, self.work_dir / "stack", time_scale=self.time_scale, num_planners=2, extra_env=env)
        stack.engine_port = free_port()
        operator = Operator(log_url, namespace, self.pg_url or "", stack, [], hold_tag=namespace)
        injector = FaultInjector(schedule, stack, broker, postgres)
        began = time.monotonic()
        supervision: _Supervision | None = None
        report: ChaosReport | None = None
        try:
            pg_url = postgres.start() if postgres is not None else self.pg_url
            assert pg_url is not None
            operator.pg_url = env["AGENTLOG_LEDGER_URL"] = pg_url
            broker.start()
            ensure_topics(log_url, namespace=namespace)
            stack.start()
            supervisor = Supervisor(stack, report=lambda line: None, backoff=lambda: Backoff(first_s=0.5, max_s=4.0))
            supervision = _Supervision(supervisor)
            supervision.start()
            pending = _RecoveryWatch(injector)
            operator.on_events = pending.see
            book, _ = signals.run(self._operate(operator, sessions, window, injector, supervisor))
            report = self._check(operator, book, injector)
            report.recover_s = pending.recovered
        except (KeyboardInterrupt, asyncio.CancelledError):
            if signals.received is None:
                raise
            report = self._interrupted(operator, injector, signals.received)
        finally:
            signals.stopping = True  # from here on a signal waits for the stop below
            stop_errors = _stop_all(supervision, injector, stack, broker, postgres)
        report.stop_errors = stop_errors
        report.seconds = time.monotonic() - began
        self._count_left(report, namespace)
        return report

    def _interrupted(self, operator: Operator, injector: FaultInjector, signal_name: str) -> ChaosReport:
        """What an interrupted run had: the operator's view so far, the faults applied so far."""
        report = ChaosReport(sessions=len(operator.sessions), faults=injector.applied, interrupted=signal_name)
        report.requested_during_faults = self.requested_during_faults
        report.fault_errors = injector.errors
        states = [operator.book.records[s].state for s in operator.sessions if s in operator.book.records]
        report.finished = sum(1 for state in states if state.finished)
        report.resources = count_log(states)
        return report

    def _count_left(self, report: ChaosReport, namespace: str) -> None:
        """After everything stopped, on the machine: the resources' directories and processes, and
        any process of the run at all; what is found is killed once counted."""
        tool_pids = tagged_pids(TOOL_TAG, namespace)
        if report.resources is not None:
            # Of an interrupted run: what its unended sessions held (a run of the stack would release it).
            report.resources.dirs_left = entries_left(self.resource_dir)
            report.resources.processes_left = len(tool_pids)
        others = sorted(set(run_pids(self.work_dir)) - set(tool_pids))
        report.left_after_stop = [describe_pid(pid) for pid in others]
        kill_all([*tool_pids, *others])

    @property
    def resource_dir(self) -> Path:
        """The executor's resource directory (its default: beside the stack's sandbox)."""
        return self.work_dir / "stack" / "resources"

    async def _operate(
        self, operator: Operator, sessions: list[str], window: float, injector: FaultInjector, supervisor: Supervisor
    ) -> tuple[SessionBook, list[str]]:
        """Request the sessions spread over the fault window while the faults run, then one canary
        session after the last fault (it finishes only if no consumer stopped), and operate."""

        async def requests() -> None:
            requester = _Requester(operator)

            async def request(i: int, session: str) -> None:
                await requester.request(i, session)
                if injector.is_alive():
                    self.requested_during_faults += 1

            try:
                await request_over_window(sessions, window, request, injector.is_alive)
                canary = f"canary-{operator.namespace}"
                await requester.request(len(sessions), canary)
            finally:
                await requester.close()

        tasks: list[asyncio.Task[None]] = []

        def begin() -> None:  # the operator is watching: faults and requests may start
            injector.start()
            tasks.append(asyncio.create_task(requests()))

        result = await operator.operate(
            self.deadline_s + window,
            restart=lambda: None,  # _Supervision restarts the dead
            outages=True,
            until=lambda: bool(tasks) and tasks[0].done(),
            on_watching=begin,
            ended=settled,
        )
        await tasks[0]  # raises if a request could not be appended at all
        return result

    def _check(self, operator: Operator, book: SessionBook, injector: FaultInjector) -> ChaosReport:
        report = ChaosReport(sessions=len(operator.sessions), faults=injector.applied)
        report.requested_during_faults = self.requested_during_faults
        report.fault_errors = injector.errors
        for session in operator.sessions:
            state = book.records[session].state if session in book.records else None
            status = state.status.value if state is not None and state.status is not None else None
            if status == "finished":
                report.finished += 1
            elif status == "failed" and state is not None and state.failure:
                report.failed_with_reason += 1
            else:
                report.unended.append(session)
        payments = dict(asyncio.run(operator.payments()))
        report.duplicate_payments = sum(n - 1 for n in payments.values() if n > 1)
        completed = {
            t.proposed.idempotency_key
            for s in operator.sessions
            if s in book.records
            for t in book.records[s].state.tool_calls.values()
            if t.proposed.tool == "payment" and t.status.value == "completed"
        }
        report.missing_payments = len(completed - set(payments))
        distinct = sum(len(book.records[s].state.llm_calls) for s in operator.sessions if s in book.records)
        report.recomputed_llm_calls = int(operator.engine_stats()["num_served"]) - distinct
        seen: set[tuple[str, str, str]] = set()

        def sink(events: list[Any]) -> None:
            for e in events:
                if getattr(e.body, "author", None) == OPERATOR:
                    seen.add((e.session_id, type(e.body).__name__, getattr(e.body, "call_id", "")))

        async def read_back() -> None:
            async with open_log(operator.log_url, actor="auditor", namespace=operator.namespace) as log:
                await read_log(log, sink, group=f"count-{uuid.uuid4().hex[:6]}", idle_polls=1)

        asyncio.run(read_back())
        report.events_lost = len(operator.appended - seen)
        result = CliRunner().invoke(
            app, ["verify", "--log-url", operator.log_url, "--json"], env={"AGENTLOG_NAMESPACE": operator.namespace}
        )
        problems = json.loads(result.output)["problems"] if result.output.strip() else None
        report.verify_problems = -1 if problems is None else len(problems)
        report.verify_details = [json.dumps(p, default=str) for p in problems or []][:20]
        report.dead_processes = [n for n, p in operator.stack.processes.items() if not p.alive()]
        # The log's account of the resources; the ports now, while the executor (their holder) runs.
        states = [book.records[s].state for s in operator.sessions if s in book.records]
        report.resources = count_log(states)
        report.resources.ports_left = count_ports_left(logged_ports(states), self.work_dir)
        return report


def settled(state: SessionState) -> bool:
    """Ended, and every resource it acquired released (the executor releases after the end)."""
    return state.finished and not any(r.live for r in state.resources.values())


async def request_over_window(
    sessions: list[str],
    window_s: float,
    request: Callable[[int, str], Awaitable[None]],
    schedule_running: Callable[[], bool],
) -> None:
    """Request session ``i`` at ``i * window_s / len(sessions)``: the sessions are under way
    while the faults happen (the point of the run), then wait for the schedule to end.

    Polled, not joined in a thread: a cancelled run must not wait for the schedule."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    for i, session in enumerate(sessions):
        await asyncio.sleep(max(0.0, start + i * window_s / len(sessions) - loop.time()))
        await request(i, session)
    while schedule_running():  # noqa: ASYNC110 - a thread, not a coroutine, to wait for
        await asyncio.sleep(0.5)


def request_event_id(session: str) -> str:
    """The event id of a session's request (``Operator.request``)."""
    return f"{session}/requested"


RETRY_AFTER_S = 2 * BOUNDED_DELIVERY_TIMEOUT_MS / 1000
"""How long ``_Requester`` waits before trying a failed request again: past the bound on the
delivery of what its abandoned log still had in flight."""


class _Requester:
    """Appends the session requests through one log while it works, and through a fresh one
    after a failure: a request while the broker is down or paused fails (or is never
    acknowledged: an acknowledgement lost with the old broker must not hold the requests),
    and is tried again until the broker is back. One log for all, not one per request:
    opening a log (a producer, metadata) takes seconds on a loaded machine, longer than the
    gap between two requests of a large run.

    A retry must not write the request twice. The first try may still land after it failed
    here (its producer is abandoned with the record in flight), so the log has bounded
    delivery, as the workers' logs do: a record lands or fails within
    ``BOUNDED_DELIVERY_TIMEOUT_MS``, and the retry waits longer than that. It then finds a
    request that landed (the fresh log reads the session's chain) under the same event id
    (``request_event_id``), and appends nothing. Before (a random event id, a one-second
    wait), a 300-session run on kafka-python wrote two requests at seq 0 of one session."""

    def __init__(self, operator: Operator) -> None:
        self.operator = operator
        self._log: Any = None
        self._exit: contextlib.AsyncExitStack | None = None

    async def request(self, i: int, session: str, attempts: int = 60) -> None:
        for attempt in range(attempts):
            try:
                await asyncio.wait_for(self._once(i, session), ACT_TIMEOUT_S)
                self.operator.sessions.append(session)
                return
            except Exception:
                await self.close()
                if attempt == attempts - 1:
                    raise
                await asyncio.sleep(RETRY_AFTER_S)

    async def _once(self, i: int, session: str) -> None:
        if self._log is None:
            exit_stack = contextlib.AsyncExitStack()
            self._exit = exit_stack
            self._log = await exit_stack.enter_async_context(
                open_log(
                    self.operator.log_url, actor="operator", namespace=self.operator.namespace, bounded_delivery=True
                )
            )
        await self.operator.request(self._log, i, session)

    async def close(self) -> None:
        exit_stack, self._exit, self._log = self._exit, None, None
        if exit_stack is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(exit_stack.aclose(), ACT_TIMEOUT_S)


@dataclass
class _RecoveryWatch:
    """Time from each broker fault until the operator sees the first event appended after it."""

    injector: FaultInjector
    recovered: list[float] = field(default_factory=list)
    _done: int = 0

    def see(self, now: float, events: list[Any]) -> None:
        marks = self.injector.broker_back_at
        while self._done < len(marks):
            fault_at = marks[self._done]
            if not any(e.envelope.occurred_at.timestamp() > fault_at for e in events):
                return
            self.recovered.append(now - fault_at)
            self._done += 1


class _Signals:
    """SIGINT and SIGTERM during a run (on the main thread; elsewhere they are left alone).

    The first one stops the run: in the operator's event loop it cancels the operator (its
    consumers and producers close as on any cancellation), anywhere else it raises
    ``KeyboardInterrupt``; ``ChaosRun`` then stops the faults, the stack, the broker and
    Postgres. Once that stop has begun (``stopping``), a signal only says to wait: a second
    Ctrl-C must not leave the broker or Postgres running. Before, one more raises again (the
    first may have landed where something swallowed it).
    """

    def __init__(self) -> None:
        self.received: str | None = None
        """The first signal's name."""
        self.stopping = False
        self._saved: dict[int, Any] = {}
        self._task: tuple[asyncio.AbstractEventLoop, asyncio.Task[Any]] | None = None

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._saved[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)

    def run(self, coro: Awaitable[T]) -> T:
        """``asyncio.run``, where a signal cancels ``coro`` (raised into the loop, it could land
        inside the loop's own code); an interrupted run raises ``KeyboardInterrupt``."""

        async def main() -> T:
            task = asyncio.current_task()
            assert task is not None
            self._task = (asyncio.get_running_loop(), task)
            try:
                return await coro
            finally:
                self._task = None

        try:
            result = asyncio.run(main())
        except asyncio.CancelledError:
            if self.received is None:
                raise
            raise KeyboardInterrupt from None
        if self.received is not None:  # the signal came as the operator returned
            raise KeyboardInterrupt
        return result

    def _on_signal(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.stopping:
            print(f"{name}: the run is stopping its stack, broker and Postgres; wait", file=sys.stderr, flush=True)
            return
        first = self.received is None
        if first:
            self.received = name
            print(f"{name}: stopping the run (faults, stack, broker, Postgres)", file=sys.stderr, flush=True)
        if first and self._task is not None:
            loop, task = self._task
            loop.call_soon_threadsafe(task.cancel)
            return
        raise KeyboardInterrupt


def _stop_all(
    supervision: _Supervision | None,
    injector: FaultInjector,
    stack: Stack,
    broker: LocalKafkaBroker,
    postgres: Postgres | None,
) -> list[str]:
    """Stop every part of a run, whatever state it is in, in this order: the supervisor (so that
    nothing is started again), the fault thread (an outage under way ends: a paused broker is
    resumed, a restart completes), the stack (the workers drain while the broker still runs),
    the broker, Postgres. A part that fails to stop does not keep the next from stopping."""
    steps: list[tuple[str, Callable[[], object]]] = [
        ("the supervisor", supervision.stop if supervision is not None else lambda: None),
        ("the fault thread", injector.stop),
        ("the stack", stack.stop),
        ("the broker", broker.stop),
        ("Postgres", postgres.stop if postgres is not None else lambda: None),
    ]
    errors = []
    for what, stop in steps:
        try:
            stop()
        except Exception as error:
            errors.append(f"stopping {what}: {type(error).__name__}: {error}")
    return errors


class _Supervision(threading.Thread):
    """Runs the supervisor on its own, as ``logctl up`` does: roles come back whatever the operator is waiting on."""

    def __init__(self, supervisor: Supervisor) -> None:
        super().__init__(name="supervisor", daemon=True)
        self.supervisor = supervisor
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(0.2):
            self.supervisor.check()

    def stop(self) -> None:
        self._halt.set()
        self.join()
