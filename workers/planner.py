"""The planner: hosts agent programs, calls the engine, appends actions.

Reads agent.actions, agent.verdicts, agent.effects and ops.commands; appends
only to agent.actions. For each session of its partitions it asks
``services.planning.next_move`` what to do and does it: start a requested
session, call the engine (``LLMCallStarted`` before, ``LLMCallCompleted``
after), propose a tool call, finish or fail. Verdicts and effects are other
roles' work: the planner waits for them in the log.

Each session is driven by at most one task at a time; an event that arrives
while it runs makes it look again when it is done.

Crash points (workers/crash.py): ``planner.after_llm_started`` (the engine was
not asked yet), ``planner.after_engine`` (the engine answered, the output is
not logged yet), ``planner.after_llm_completed``, ``planner.after_proposed``.

Run: ``python -m workers.planner [--log-url URL] --engine-url http://127.0.0.1:8100``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from typing import Any

from log import LoggedEvent, SharedLog
from schemas import events as ev
from services.planning import (
    CallEngine,
    FailSession,
    FinishSession,
    Idle,
    ProposeTool,
    StartSession,
    WaitFor,
    next_move,
)
from services.programs import PROGRAMS, Program
from services.session import SessionState
from workers.crash import crash_point
from workers.engines import Engine, EngineError, EngineUnavailable, HttpEngine
from workers.runtime import SessionWorker

_log = logging.getLogger(__name__)

ENGINE_RETRY_S = (0.2, 0.5, 1.0, 2.0, 5.0)


class PlannerWorker(SessionWorker):
    role = "planner"
    topics = ("agent.actions", "agent.verdicts", "agent.effects", "ops.commands")
    reports_unknown_sessions = True
    reconcile_every_s = 5.0

    def __init__(
        self,
        log: SharedLog,
        *,
        engine: Engine,
        programs: dict[str, Program] | None = None,
        engine_patience_s: float = 120.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(log, **kwargs)
        self.engine = engine
        self.programs = programs if programs is not None else PROGRAMS
        self.engine_patience_s = engine_patience_s
        self._driving: dict[str, bool] = {}  # session -> "look again when done"
        self.num_engine_calls = 0

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--engine-url", default=os.environ.get("AGENTLOG_ENGINE_URL", "http://127.0.0.1:8100"), help="engine API"
        )
        parser.add_argument("--engine-id", default="sim-0")

    @classmethod
    async def create(cls, log: SharedLog, args: argparse.Namespace) -> PlannerWorker:
        engine = HttpEngine(args.engine_url, engine_id=args.engine_id)
        return cls(log, group=args.group, instance_id=args.instance_id, engine=engine)

    async def close(self) -> None:
        await self.engine.close()

    async def resume(self, state: SessionState) -> None:
        self.kick(state.session_id)

    async def on_event(self, state: SessionState, event: LoggedEvent) -> None:
        self.kick(state.session_id)

    async def reconcile(self, state: SessionState) -> None:
        self.kick(state.session_id)  # a no-op when it is being driven; cheap when it only waits

    async def on_partition_lost(self, partition: int) -> None:
        for session_id in [s for s in self._driving if self.log.partition_for(s) == partition]:
            self._driving[session_id] = False  # its task stops at the next step (state is gone)

    def kick(self, session_id: str) -> None:
        """Make sure the session is being driven (and looks at its latest state)."""
        if session_id in self._driving:
            self._driving[session_id] = True
            return
        self._driving[session_id] = False
        self.spawn(self._drive(session_id))

    async def _drive(self, session_id: str) -> None:
        try:
            while True:
                state = self.sessions.get(session_id)
                if state is None:
                    return  # the partition moved to another planner
                self._driving[session_id] = False
                if await self._step(state):
                    continue
                if not self._driving.get(session_id):
                    return
        finally:
            self._driving.pop(session_id, None)

    async def _step(self, state: SessionState) -> bool:
        """Carry out one move; True when there may be another one right away."""
        program = self.programs.get(state.program)
        move = next_move(state, program)
        sid = state.session_id
        match move:
            case Idle() | WaitFor():
                return False
            case StartSession():
                await self.append(sid, ev.SessionStarted(program=move.program, args_json=move.args_json), kind="start")
            case CallEngine():
                await self._call_engine(state, move)
            case ProposeTool():
                await self.append(
                    sid,
                    ev.ToolCallProposed(
                        call_id=move.call_id,
                        tool=move.tool,
                        arguments_json=move.arguments_json,
                        effect_class=move.effect_class,
                        idempotency_key=move.idempotency_key,
                        compensation_tool=move.compensation_tool,
                        resource=move.resource,
                    ),
                    kind="proposed",
                    key=move.call_id,
                )
                crash_point("planner.after_proposed")
            case FinishSession():
                await self.append(
                    sid,
                    ev.SessionFinished(
                        output_json=move.output_json,
                        num_llm_calls=move.num_llm_calls,
                        num_tool_calls=move.num_tool_calls,
                    ),
                    kind="end",
                )
            case FailSession():
                _log.warning("session %s fails: %s (%s)", sid, move.reason, move.error_type)
                await self.append(sid, ev.SessionFailed(reason=move.reason, error_type=move.error_type), kind="end")
        return True

    async def _call_engine(self, state: SessionState, move: CallEngine) -> None:
        sid = state.session_id
        if not move.resume:
            await self.append(
                sid,
                ev.LLMCallStarted(
                    call_id=move.call_id,
                    turn=move.turn,
                    engine_id=self.engine.engine_id,
                    prompt_tokens=move.prompt.num_tokens,
                    max_output_tokens=move.max_output_tokens,
                    prompt_digest=move.prompt_digest,
                ),
                kind="llm-started",
                key=move.call_id,
            )
            crash_point("planner.after_llm_started")
        try:
            completion = await self._complete(sid, move)
        except EngineError as e:
            await self.append(sid, ev.SessionFailed(reason=str(e), error_type="EngineError"), kind="end")
            return
        crash_point("planner.after_engine")
        self.num_engine_calls += 1
        await self.append(
            sid,
            ev.LLMCallCompleted(
                call_id=move.call_id,
                engine_id=completion.engine_id,
                prompt_tokens=completion.prompt_tokens,
                cached_tokens=completion.cached_tokens,
                output_tokens=completion.output_tokens,
                output_text=completion.text,
                finish_reason=completion.finish_reason,
                queue_ms=completion.queue_ms,
                prefill_ms=completion.prefill_ms,
                decode_ms=completion.decode_ms,
            ),
            kind="llm-completed",
            key=move.call_id,
        )
        crash_point("planner.after_llm_completed")

    async def _complete(self, session_id: str, move: CallEngine) -> Any:
        """Ask the engine, retrying while it is unreachable (it may be restarting)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.engine_patience_s
        attempt = 0
        while True:
            try:
                return await self.engine.complete(
                    session_id=session_id,
                    request_id=move.request_id,
                    prompt=move.prompt,
                    max_output_tokens=move.max_output_tokens,
                )
            except EngineUnavailable as e:
                if loop.time() >= deadline:
                    raise EngineError(f"engine unavailable for {self.engine_patience_s:g} s: {e}") from e
                delay = ENGINE_RETRY_S[min(attempt, len(ENGINE_RETRY_S) - 1)]
                _log.warning("engine unavailable (%s); retrying %s in %.1f s", e, move.request_id, delay)
                await asyncio.sleep(delay)
                attempt += 1


if __name__ == "__main__":
    from workers.main import run_worker

    run_worker(PlannerWorker)
