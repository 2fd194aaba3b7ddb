"""Reading sessions back from the log for people: fold, summarize, replay-check.

Used by ``logctl sessions``, ``run`` (progress), ``replay`` and ``demo``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

from log import LoggedEvent, SharedLog
from log.errors import BackendUnavailable
from log.topics import SESSION_TOPICS
from schemas import events as ev
from services.gateway import adoption_problems
from services.planning import prompt_digest, recorded_results
from services.programs import PROGRAMS, CallLLM, CallTool, Finish, Fork, Program, ProgramView, TakeCheckpoint
from services.programs.base import NonDeterminism
from services.session import GATEWAY_PROGRAM, LLMCall, PlannerStep, SessionState, SessionStatus


@dataclass
class SessionRecord:
    """A folded session plus the times people want to see."""

    state: SessionState
    requested_at: datetime | None = None
    ended_at: datetime | None = None
    last_event_at: datetime | None = None

    @property
    def job_time_s(self) -> float | None:
        if self.requested_at and self.ended_at:
            return (self.ended_at - self.requested_at).total_seconds()
        return None


class SessionBook:
    """Sessions folded from a stream of events."""

    def __init__(self) -> None:
        self.records: dict[str, SessionRecord] = {}

    def add(self, event: LoggedEvent) -> None:
        record = self.records.get(event.session_id)
        if record is None:
            record = self.records[event.session_id] = SessionRecord(SessionState(event.session_id))
        if not record.state.apply(event.envelope):
            return
        at = event.envelope.occurred_at
        record.last_event_at = max(record.last_event_at or at, at)
        starts = isinstance(event.body, ev.SessionStarted) and record.requested_at is None
        if isinstance(event.body, ev.SessionRequested) or starts:
            record.requested_at = at
        elif isinstance(event.body, ev.SessionFinished | ev.SessionFailed):
            record.ended_at = at

    def add_all(self, events: Iterable[LoggedEvent]) -> None:
        for event in events:
            self.add(event)


async def read_sessions(log: SharedLog, *, group: str, idle_polls: int = 2) -> SessionBook:
    """Fold every session in the log (reads until the log is quiet)."""
    book = SessionBook()
    await read_log(log, book.add_all, group=group, idle_polls=idle_polls)
    return book


async def read_log(
    log: SharedLog,
    sink: Callable[[list[LoggedEvent]], None],
    *,
    group: str,
    topics: tuple[str, ...] = SESSION_TOPICS,
    idle_polls: int = 2,
) -> None:
    """Hand every verified event of ``topics`` to ``sink``, in polled batches, from the first
    record until the end offsets seen at the start are read and the log is quiet."""
    async with log.consumer(group, topics, from_beginning=True) as consumer:
        ends = {t: sum((await log.end_offsets(t)).values()) for t in topics}
        seen = 0
        quiet = 0
        joining = 0
        while quiet < idle_polls or seen < sum(ends.values()) - consumer.stats.num_dead_lettered:
            events = await consumer.poll(timeout_s=0.3, max_records=5000)
            seen += len(events)
            sink(events)
            if not events and not consumer.assignment_at_poll():
                # Still joining the group: an empty poll says nothing about the log yet.
                joining += 1
                if joining >= 200:
                    raise BackendUnavailable(f"consumer group {group} got no partitions in 60 s")
                continue
            quiet = 0 if events else quiet + 1
            if quiet >= 10:
                break  # the end offsets count records a reader never gets (transaction markers)


def percentile(values: list[float], p: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))
    return ordered[index]


@dataclass
class Summary:
    sessions: int
    finished: int
    failed: int
    running: int
    llm_calls: int
    tool_calls: int
    mean_job_s: float
    p95_job_s: float
    prompt_tokens: int
    cached_tokens: int

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def summarize(records: Iterable[SessionRecord]) -> Summary:
    records = list(records)
    jobs = [r.job_time_s for r in records if r.job_time_s is not None]
    llm = [c for r in records for c in r.state.llm_calls.values()]
    completed = [c.completed for c in llm if c.completed is not None]
    statuses = [r.state.status for r in records]
    return Summary(
        sessions=len(records),
        finished=statuses.count(SessionStatus.FINISHED),
        failed=sum(s in (SessionStatus.FAILED, SessionStatus.CANCELLED) for s in statuses),
        running=sum(s in (SessionStatus.RUNNING, SessionStatus.REQUESTED) for s in statuses),
        llm_calls=len(llm),
        tool_calls=sum(len(r.state.tool_calls) for r in records),
        mean_job_s=sum(jobs) / len(jobs) if jobs else math.nan,
        p95_job_s=percentile(jobs, 95),
        prompt_tokens=sum(c.prompt_tokens for c in completed),
        cached_tokens=sum(c.cached_tokens for c in completed),
    )


def replay_check(state: SessionState, programs: Mapping[str, Program] = PROGRAMS) -> list[str]:
    """Re-run the session's program against its recorded results; every disagreement, in words.

    A gateway session has no program here (an external agent drove it): its check is that the
    planner and the executor adopted exactly what the gateway recorded."""
    if state.program == GATEWAY_PROGRAM:
        return adoption_problems(state)
    program = programs.get(state.program)
    if program is None:
        return [f"unknown program {state.program!r}: cannot re-run it"]
    problems: list[str] = []
    results, _pending = recorded_results(state)
    for step, recorded in enumerate(state.steps):
        try:
            action = program.next_action(
                ProgramView(state.session_id, state.args, tuple(results[:step]), state.context_id)
            )
        except NonDeterminism as e:  # an SDK program checks its replayed steps itself
            return [*problems, str(e)]
        if isinstance(recorded, PlannerStep):
            wanted = TakeCheckpoint if recorded.kind == "checkpoint" else Fork
            if not isinstance(action, wanted):
                problems.append(
                    f"step {step}: log has {recorded.kind} step {recorded.call_id}, program now returns {action!r}"
                )
        elif isinstance(recorded, LLMCall):
            if not isinstance(action, CallLLM):
                problems.append(f"step {step}: log has LLM call {recorded.call_id}, program now returns {action!r}")
            elif prompt_digest(action.prompt) != recorded.started.prompt_digest:
                problems.append(f"step {step}: the prompt of {recorded.call_id} differs from the recorded one")
        elif not isinstance(action, CallTool) or (
            action.tool != recorded.proposed.tool
            or json.dumps(action.arguments, sort_keys=True) != recorded.proposed.arguments_json
        ):
            problems.append(f"step {step}: log has tool call {recorded.call_id}, program now returns {action!r}")
        if step >= len(results):
            break
    if state.status is SessionStatus.FINISHED and len(results) == len(state.steps):
        final = program.next_action(ProgramView(state.session_id, state.args, tuple(results), state.context_id))
        if not isinstance(final, Finish) or json.dumps(final.output, sort_keys=True) != state.output_json:
            problems.append(f"the program now ends with {final!r}, the log with {state.output_json}")
    return problems
