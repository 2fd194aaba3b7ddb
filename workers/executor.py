"""The executor: runs committed tool calls, and only those.

Reads agent.verdicts (what may run), agent.actions (what the call is),
agent.effects (what it already did) and ops.commands (operators resolving
in-doubt calls); appends to agent.effects:

- ``ToolCallStarted`` before a tool runs (and waits until it is durable),
  then ``ToolCallCompleted`` or ``ToolCallFailed`` after;
- on recovery, a call with Started and no outcome is retried with the same
  idempotency key when its tool is pure or idempotent, and becomes
  ``ToolCallInDoubt`` otherwise (compensatable and irreversible tools never
  run twice): an operator resolves it with ``logctl approve --retry`` or
  ``--mark-done``;
- a tool that raises ``ToolUnavailable`` (it did nothing: its database is down)
  runs again with backoff for ``--unavailable-retry-s``, then fails retryable; one
  that raises ``OutcomeUnknown`` (the request went out, the answer never came)
  runs again if retry-safe and goes in doubt otherwise, as after a crash.

Resources (services/resources.py, workers/resources.py): a tool acquires
directories, files, processes, ports and containers through ``ctx.resources``;
the executor logs each acquisition (intent first, then the handle) and each
release on agent.effects, releases a session's resources when it ends (finished,
failed, cancelled) and those of the calls a restore abandoned, reclaims on
recovery what a dead run left behind (the attempts that never finished, every
port), and retries a release that failed after a backoff (``ResourceReleaseFailed``),
for as long as it takes.

Crash points (workers/crash.py): ``executor.before_started``,
``executor.after_started`` (before the tool runs), ``executor.after_tool``
(the tool ran, its outcome is not logged yet), ``executor.after_completed``,
``executor.after_resource_logged`` (a resource's intent is logged, it does not
exist yet), ``executor.after_resource_acquired`` (it exists and is logged);
each also as ``<point>.<tool>`` (e.g. ``executor.after_tool.payment``).

Run: ``python -m workers.executor [--log-url URL] [--ledger-url URL] [--sandbox DIR] [--resource-dir DIR]
[--kill-grace-s S] [--time-scale F] [--unavailable-retry-s S] [--snapshot-url postgresql://...]``
(snapshots and partition marks: a restart reads its partitions from their marks, workers/recovery.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from log import LoggedEvent, SharedLog
from log.topics import AGENT_ACTIONS, AGENT_EFFECTS, AGENT_GATEWAY, AGENT_VERDICTS, OPS_COMMANDS
from schemas import events as ev
from schemas.events import ApprovalDecision
from services.gateway import adopt_results
from services.registry import OutcomeUnknown, Registry, ToolUnavailable
from services.resources import Release, backoff_ms, releases
from services.session import GATEWAY_PROGRAM, SessionState, ToolCall, ToolStatus
from workers.config import add_snapshot_arguments, open_snapshot_store
from workers.crash import crash_point
from workers.plugins import builtin_registry
from workers.resources import ReleaseError, ResourceManager
from workers.runtime import SessionWorker
from workers.tools import Ledger, ToolContext, run_tool

_log = logging.getLogger(__name__)


class ExecutorWorker(SessionWorker):
    role = "executor"
    # agent.gateway: the results external agents report for the calls they ran themselves.
    topics = (AGENT_VERDICTS.name, AGENT_ACTIONS.name, AGENT_EFFECTS.name, OPS_COMMANDS.name, AGENT_GATEWAY.name)
    reports_duplicate_verdicts = True
    acts_on = frozenset({ToolStatus.COMMITTED, ToolStatus.STARTED, ToolStatus.IN_DOUBT})

    def __init__(
        self,
        log: SharedLog,
        *,
        ledger: Ledger | None = None,
        sandbox: Path | None = None,
        time_scale: float = 1.0,
        registry: Registry | None = None,
        resource_dir: Path | None = None,
        kill_grace_s: float = 2.0,
        unavailable_retry_s: float = 60.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(log, **kwargs)
        self.registry = registry or builtin_registry()
        self.ledger = ledger
        self.sandbox = sandbox or Path(tempfile_dir()) / "sandbox"
        self.time_scale = time_scale
        self._running: set[tuple[str, str]] = set()
        self.num_executed = 0
        self.unavailable_retry_s = unavailable_retry_s
        self.num_unavailable = 0  # runs that raised ToolUnavailable and were tried again
        self.resources = ResourceManager(
            resource_dir or self.sandbox.parent / "resources",
            self._append_resource_event,
            grace_s=kill_grace_s,
            crash=self._crash,
            release_by_id=self._release_by_id,
        )
        self._releasing: set[tuple[str, str]] = set()
        self._next_sweep = 0.0

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--ledger-url", default=os.environ.get("AGENTLOG_LEDGER_URL"), help="Postgres for payments")
        parser.add_argument("--sandbox", type=Path, default=None, help="directory file_write may write in")
        parser.add_argument("--resource-dir", type=Path, default=None, help="where tools' directories and files go")
        parser.add_argument(
            "--kill-grace-s", type=float, default=2.0, help="seconds a tool's process gets between SIGTERM and SIGKILL"
        )
        parser.add_argument("--time-scale", type=float, default=float(os.environ.get("AGENTLOG_TIME_SCALE", "1")))
        parser.add_argument(
            "--unavailable-retry-s",
            type=float,
            default=60.0,
            help="how long a tool that raises ToolUnavailable (its service is down) is tried again",
        )
        add_snapshot_arguments(parser)

    @classmethod
    async def create(cls, log: SharedLog, args: argparse.Namespace) -> ExecutorWorker:
        ledger_url = args.ledger_url or _default_ledger_url()
        ledger = await Ledger(ledger_url).start()
        return cls(
            log,
            group=args.group,
            instance_id=args.instance_id,
            ledger=ledger,
            sandbox=args.sandbox,
            time_scale=args.time_scale,
            snapshots=await open_snapshot_store(log, args),
            registry=args.registry,
            resource_dir=args.resource_dir,
            kill_grace_s=args.kill_grace_s,
            unavailable_retry_s=args.unavailable_retry_s,
        )

    async def close(self) -> None:
        if self.ledger is not None:
            await self.ledger.close()
        if self.snapshots is not None:
            await self.snapshots.close()

    # ---------------------------------------------------------------- recovery

    async def _record_reported(self, state: SessionState) -> None:
        """A gateway session's calls are run by its client, never here: record what it reported."""
        await self.append_all(adopt_results(state))

    async def resume(self, state: SessionState) -> None:
        if state.program == GATEWAY_PROGRAM:
            await self._record_reported(state)
            return
        # No tool of this session runs here yet: what a dead run left behind is reclaimed first.
        self._release_due(state, reclaim=True)
        for tool in list(state.tool_calls.values()):
            if tool.status is ToolStatus.COMMITTED:
                self._start(state, tool, attempt=1)
            elif tool.status is ToolStatus.STARTED:
                known = self.registry.tools.get(tool.proposed.tool)
                if known is not None and known.spec.retry_safe:
                    self._start(state, tool, attempt=tool.attempts + 1)
                else:
                    await self._in_doubt(state, tool)
            elif tool.status is ToolStatus.IN_DOUBT:
                await self._resolve(state, tool)

    async def on_event(self, state: SessionState, event: LoggedEvent) -> None:
        # A verdict may be read before its proposal (topics are ordered only within
        # themselves), so act on whichever of the two completes the picture.
        body = event.body
        if isinstance(body, ev.SessionFinished | ev.SessionFailed | ev.RestoreApplied):
            self._release_due(state)
        if state.program == GATEWAY_PROGRAM:
            if isinstance(body, ev.GatewayToolResultReported | ev.ToolCallCommitted | ev.ToolCallProposed):
                await self._record_reported(state)
            return
        if isinstance(body, ev.ToolCallCommitted | ev.ToolCallProposed | ev.ApprovalGiven):
            tool = state.tool_calls.get(body.call_id)
            if tool is None:
                return
            if tool.status is ToolStatus.COMMITTED:
                self._start(state, tool, attempt=1)
            elif tool.status is ToolStatus.IN_DOUBT and isinstance(body, ev.ApprovalGiven):
                await self._resolve(state, tool)

    async def _in_doubt(
        self, state: SessionState, tool: ToolCall, *, attempt: int | None = None, why: str | None = None
    ) -> None:
        attempt = tool.attempts if attempt is None else attempt
        await self.append(
            state.session_id,
            ev.ToolCallInDoubt(
                call_id=tool.call_id,
                tool=tool.proposed.tool,
                effect_class=tool.proposed.effect_class,
                reason=(
                    f"attempt {attempt} {why or 'started and never reported an outcome'}; "
                    f"{tool.proposed.effect_class.value.lower()} tools are not run again without an operator"
                ),
            ),
            kind="in-doubt",
            key=f"{tool.call_id}/{attempt}",
        )
        _log.warning("%s %s is in doubt: resolve with logctl approve", state.session_id, tool.call_id)

    async def _resolve(self, state: SessionState, tool: ToolCall) -> None:
        """Follow the operator's latest word on an in-doubt call."""
        decision = next(
            (a for a in reversed(tool.approvals) if a.decision in (ApprovalDecision.RETRY, ApprovalDecision.MARK_DONE)),
            None,
        )
        if decision is None:
            return
        if decision.decision is ApprovalDecision.RETRY:
            self._start(state, tool, attempt=tool.attempts + 1)
        else:
            result = {"marked_done_by": decision.author, "reason": decision.reason}
            await self.append(
                state.session_id,
                ev.ToolCallCompleted(
                    call_id=tool.call_id, result_json=json.dumps(result), result_tokens=0, duration_ms=0
                ),
                kind="completed",
                key=tool.call_id,
            )

    # --------------------------------------------------------------- execution

    def _start(self, state: SessionState, tool: ToolCall, *, attempt: int) -> None:
        key = (state.session_id, tool.call_id)
        if key in self._running:
            return
        if not isinstance(tool.verdict, ev.ToolCallCommitted):
            raise AssertionError(f"refusing to run {tool.call_id}: no commit verdict")  # never reached by design
        self._running.add(key)
        task = self.spawn(self._execute(state, tool, attempt))
        task.add_done_callback(lambda _: self._running.discard(key))

    @staticmethod
    def _crash(point: str, tool: str) -> None:
        crash_point(point)
        crash_point(f"{point}.{tool}")  # e.g. executor.after_tool.payment: only that tool's calls count

    async def _execute(self, state: SessionState, tool: ToolCall, attempt: int) -> None:
        session_id, call_id = state.session_id, tool.call_id
        proposed = tool.proposed
        self._crash("executor.before_started", proposed.tool)
        await self.append(
            session_id,
            ev.ToolCallStarted(
                call_id=call_id, tool=proposed.tool, idempotency_key=proposed.idempotency_key, attempt=attempt
            ),
            kind="started",
            key=f"{call_id}/{attempt}",
        )
        self._crash("executor.after_started", proposed.tool)
        implementation = self.registry.tools.get(proposed.tool)
        context = ToolContext(
            session_id,
            call_id,
            proposed.idempotency_key,
            self.sandbox,
            self.ledger,
            self.time_scale,
            self.resources.scope(session_id, call_id, proposed.tool, attempt),
        )
        began = time.monotonic()
        outcome: ev.ToolCallCompleted | ev.ToolCallFailed
        delay_s = 0.2
        while True:
            try:
                if implementation is None:
                    raise LookupError(f"no implementation for tool {proposed.tool!r}")
                result, tokens = await run_tool(implementation, json.loads(proposed.arguments_json), context)
                self.num_executed += 1
                self._crash("executor.after_tool", proposed.tool)
                outcome = ev.ToolCallCompleted(
                    call_id=call_id,
                    result_json=json.dumps(result, sort_keys=True),
                    result_tokens=tokens,
                    duration_ms=(time.monotonic() - began) * 1000,
                )
                kind = "completed"
            except (ToolUnavailable, OutcomeUnknown) as e:
                retry_safe = implementation is not None and implementation.spec.retry_safe
                if isinstance(e, OutcomeUnknown) and not retry_safe:
                    # Not a failure: the effect may have happened. As after a crash, an operator decides.
                    await self._in_doubt(state, tool, attempt=attempt, why=f"lost its outcome ({e})")
                    _log.warning("%s %s is in doubt (%s): resolve with logctl approve", session_id, call_id, e)
                    self._release_due(state)
                    return
                if time.monotonic() - began + delay_s <= self.unavailable_retry_s:
                    # Nothing happened (or, for a retry-safe tool, may happen again): wait and run it again.
                    self.num_unavailable += 1
                    _log.warning("%s %s: %s; running it again in %.1f s", session_id, call_id, e, delay_s)
                    await asyncio.sleep(delay_s)
                    delay_s = min(delay_s * 2, 5.0)
                    continue
                outcome = self._failed(call_id, e, began, retryable=True)
                kind = "failed"
            except Exception as e:  # a tool that raises fails its call, never the executor
                outcome = self._failed(call_id, e, began, retryable=False)
                kind = "failed"
            break
        await self.append(session_id, outcome, kind=kind, key=call_id)
        self._crash("executor.after_completed", proposed.tool)
        self._release_due(state)  # the session may have ended (cancelled) while the tool ran

    @staticmethod
    def _failed(call_id: str, error: Exception, began: float, *, retryable: bool) -> ev.ToolCallFailed:
        return ev.ToolCallFailed(
            call_id=call_id,
            error=f"{type(error).__name__}: {error}",
            error_type=type(error).__name__,
            retryable=retryable,
            duration_ms=(time.monotonic() - began) * 1000,
        )

    # --------------------------------------------------------------- resources

    async def handle(self, events: list[LoggedEvent]) -> None:
        await super().handle(events)
        now = time.monotonic()
        if now >= self._next_sweep:
            # Level-triggered: stuck releases whose backoff has passed, and anything an edge missed.
            self._next_sweep = now + 0.25
            for state in list(self.sessions.values()):
                if state.resources and self.log.partition_for(state.session_id) in self._ready:
                    self._release_due(state)

    async def _append_resource_event(self, session_id: str, body: ev.Event, kind: str, key: str) -> None:
        await self.append(session_id, body, kind=kind, key=key)

    def _release_due(self, state: SessionState, *, reclaim: bool = False) -> None:
        for order in releases(state, now=self.log.clock(), reclaim=reclaim):
            key = (state.session_id, order.resource.resource_id)
            if key in self._releasing:
                continue
            self._releasing.add(key)
            task = self.spawn(self._release(state, order))
            task.add_done_callback(lambda _, k=key: self._releasing.discard(k))  # type: ignore[misc]

    async def _release_by_id(self, session_id: str, resource_id: str, reason: str) -> None:
        resource = self.state(session_id).resources.get(resource_id)
        if resource is None or not resource.live:
            return
        await self._release(self.state(session_id), Release(resource, reason))

    async def _release(self, state: SessionState, order: Release) -> None:
        """One attempt: ``ResourceReleased``, or ``ResourceReleaseFailed`` with the next attempt's delay."""
        resource = order.resource
        rid = resource.resource_id
        try:
            detail = await self.resources.release(state.session_id, resource)
        except ReleaseError as error:
            attempt = resource.num_failures + 1
            failed = ev.ResourceReleaseFailed(
                resource_id=rid, attempt=attempt, reason=order.reason, error=str(error), retry_in_ms=backoff_ms(attempt)
            )
            await self.append(state.session_id, failed, kind="resource-release-failed", key=f"{rid}/{attempt}")
            _log.warning("%s: cannot release %s (%s): %s", state.session_id, rid, resource.kind.value, error)
            return
        released = ev.ResourceReleased(resource_id=rid, reason=order.reason, detail=detail)
        await self.append(state.session_id, released, kind="resource-released", key=rid)


def tempfile_dir() -> str:
    from log.embedded import data_dir

    return str(data_dir())


def _default_ledger_url() -> str:
    if url := os.environ.get("AGENTLOG_PG_URL"):
        return url
    from log.embedded import start_embedded

    return start_embedded()


if __name__ == "__main__":
    from workers.main import run_worker

    run_worker(ExecutorWorker)
