"""logctl checkpoint, fork, restore and merge (docs/branches.md).

Each command appends the operator's request to ``ops.commands`` and, unless
``--no-wait``, waits for the planner's answer on ``agent.actions`` (the answer
names the request as its causation id). Bad input is refused before anything
is appended: an unknown session or checkpoint, a fork id that is taken, a
branch that does not exist. ``restore --dry-run`` appends nothing: it folds
the session and shows what a restore would do (refuse, naming the blocking
calls; compensate some calls first; or rewind, abandoning some steps).
``logctl state`` folds a session from its newest snapshot (or, with
``--from-start``, from its first event) and prints its digest.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any

import typer

from cli.common import Json, LogUrl, require_session
from cli.render import to_json
from log import LoggedEvent, SharedLog, open_log
from log.topics import AGENT_ACTIONS
from schemas import events as ev
from services.checkpoint import restore_plan
from services.session import SessionState

Wait = Annotated[bool, typer.Option(help="Wait for the planner's answer")]
Timeout = Annotated[float, typer.Option("--timeout", help="Give up waiting after this many seconds")]


def register(app: typer.Typer) -> None:
    app.command()(checkpoint)
    app.command()(fork)
    app.command()(restore)
    app.command()(merge)
    app.command()(state)


def _author() -> str:
    return os.environ.get("USER", "operator")


async def _state(log: SharedLog, session_id: str) -> tuple[SessionState, list[LoggedEvent]]:
    return await require_session(log, session_id)


async def _wait_for(
    log: SharedLog, session_id: str, match: Callable[[LoggedEvent], bool], timeout_s: float
) -> LoggedEvent | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for event in await log.history(session_id, [AGENT_ACTIONS.name]):
            if match(event):
                return event
        await asyncio.sleep(0.3)
    return None


_ANSWERS = (ev.CheckpointTaken, ev.RestoreApplied, ev.RestoreRefused, ev.MergeApplied, ev.MergeConflict)


def _answer_to(request_id: str) -> Callable[[LoggedEvent], bool]:
    """The planner's answer to a request (a restore's compensations name it too, but do not answer it)."""
    return lambda e: e.envelope.causation_id == request_id and isinstance(e.body, _ANSWERS)


async def _ask(
    log: SharedLog,
    session_id: str,
    body: ev.Event,
    *,
    wait: bool,
    timeout_s: float,
    answer: tuple[str, Callable[[LoggedEvent], bool]] | None = None,
) -> LoggedEvent | None:
    """Append the operator's request; when waiting, the planner's answer to it (None: none in time,
    or not waiting). ``answer``: where else to look for it (a session, a match) than the request's
    own session for an event naming the request as its cause."""
    request = str(uuid.uuid4())
    await log.append(session_id, body, event_id=request)
    if not wait:
        return None
    answer_session, match = answer or (session_id, _answer_to(request))
    return await _wait_for(log, answer_session, match, timeout_s)


def _fail(message: str, code: int = 1) -> None:
    typer.echo(message, err=True)
    raise typer.Exit(code)


def _emit(as_json: bool, data: dict[str, Any], text: str) -> None:
    typer.echo(to_json(data) if as_json else text)


def checkpoint(
    session_id: Annotated[str, typer.Argument(help="The session to checkpoint")],
    log_url: LogUrl = None,
    checkpoint_id: Annotated[str, typer.Option("--id", help="Id of the checkpoint (default: a fresh one)")] = "",
    wait: Wait = True,
    timeout_s: Timeout = 60,
    as_json: Json = False,
) -> None:
    """Ask for a checkpoint: the planner takes it at the session's next step boundary."""
    checkpoint_id = checkpoint_id or f"op-{uuid.uuid4().hex[:8]}"

    async def go() -> None:
        async with open_log(log_url, actor="operator") as log:
            state, _ = await _state(log, session_id)
            if checkpoint_id in state.checkpoints:
                raise typer.BadParameter(f"{session_id} already has a checkpoint {checkpoint_id!r}")
            body = ev.CheckpointRequested(author=_author(), checkpoint_id=checkpoint_id)
            answer = await _ask(log, session_id, body, wait=wait, timeout_s=timeout_s)
            if not wait:
                _emit(as_json, {"requested": checkpoint_id}, f"checkpoint {checkpoint_id} requested for {session_id}")
                return
            if answer is None or not isinstance(answer.body, ev.CheckpointTaken):
                _fail(f"no checkpoint within {timeout_s:g} s (is a planner running? is a call in flight?)", 2)
                return
            taken = answer.body
            effects = ", ".join(f"{e.call_id}:{e.tool}:{e.effect_class.value.lower()}" for e in taken.effects)
            _emit(
                as_json,
                taken.model_dump(mode="json"),
                f"checkpoint {taken.checkpoint_id} of {session_id}: {taken.num_events} events, "
                f"digest {taken.state_digest[:16]}, cut {taken.cut}, effects [{effects}]",
            )

    asyncio.run(go())


def fork(
    session_id: Annotated[str, typer.Argument(help="The session to fork")],
    at: Annotated[str, typer.Option("--at", help="The checkpoint to fork at")],
    log_url: LogUrl = None,
    fork_id: Annotated[str, typer.Option("--as", help="Id of the new session (default: SESSION.fork-XXXX)")] = "",
    wait: Wait = True,
    timeout_s: Timeout = 60,
    as_json: Json = False,
) -> None:
    """Fork a session at a checkpoint: a new session with the parent's history up to there, by reference."""
    fork_id = fork_id or f"{session_id}.f{uuid.uuid4().hex[:6]}"

    async def go() -> None:
        async with open_log(log_url, actor="operator") as log:
            state, _ = await _state(log, session_id)
            if at not in state.checkpoints:
                known = ", ".join(state.checkpoints) or "none"
                raise typer.BadParameter(f"{session_id} has no checkpoint {at!r} (known: {known})")
            if await log.history(fork_id):
                raise typer.BadParameter(f"session {fork_id!r} already exists; choose another --as")
            body = ev.ForkRequested(author=_author(), checkpoint_id=at, fork_session_id=fork_id)
            lineage = (fork_id, lambda e: isinstance(e.body, ev.ForkCreated))
            created = await _ask(log, session_id, body, wait=wait, timeout_s=timeout_s, answer=lineage)
            if not wait:
                _emit(as_json, {"fork_session_id": fork_id}, f"fork {fork_id} of {session_id} at {at} requested")
                return
            if created is None:
                _fail(f"the fork was not created within {timeout_s:g} s (is a planner running?)", 2)
            _emit(
                as_json,
                {"fork_session_id": fork_id, "parent_session_id": session_id, "checkpoint_id": at},
                f"forked {session_id} at {at} as {fork_id}",
            )

    asyncio.run(go())


def restore(
    session_id: Annotated[str, typer.Argument(help="The session to rewind")],
    to: Annotated[str, typer.Option("--to", help="The checkpoint to go back to")],
    log_url: LogUrl = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only show what would happen")] = False,
    wait: Wait = True,
    timeout_s: Timeout = 120,
    as_json: Json = False,
) -> None:
    """Rewind a session to a checkpoint (refused across irreversible effects; compensations run first)."""

    async def go() -> None:
        async with open_log(log_url, actor="operator") as log:
            state, _ = await _state(log, session_id)
            if to not in state.checkpoints:
                known = ", ".join(state.checkpoints) or "none"
                raise typer.BadParameter(f"{session_id} has no checkpoint {to!r} (known: {known})")
            plan = restore_plan(state, to)
            if dry_run:
                data = {
                    "checkpoint_id": to,
                    "refused": plan.refused,
                    "blocking_call_ids": list(plan.blocking),
                    "compensations": [c.__dict__ for c in plan.to_propose],
                    "abandoned_steps": list(plan.abandoned_steps),
                }
                if plan.refused:
                    text = f"would be refused: {plan.refused}"
                else:
                    undo = ", ".join(f"{c.tool} for {c.undoes}" for c in plan.to_propose)
                    text = (f"would run {undo}, then " if undo else "would ") + (
                        f"rewind {session_id} to {to}, abandoning {len(plan.abandoned_steps)} steps "
                        f"({', '.join(plan.abandoned_steps) or 'none'})"
                    )
                _emit(as_json, data, text)
                return
            body = ev.RestoreRequested(author=_author(), checkpoint_id=to, dry_run=False)
            answer = await _ask(log, session_id, body, wait=wait, timeout_s=timeout_s)
            if not wait:
                _emit(as_json, {"requested": to}, f"restore of {session_id} to {to} requested")
                return
            match answer.body if answer else None:
                case ev.RestoreApplied() as applied:
                    _emit(
                        as_json,
                        applied.model_dump(mode="json"),
                        f"restored {session_id} to {to}: {applied.num_abandoned} events abandoned, "
                        f"compensated [{', '.join(applied.compensated_call_ids)}]",
                    )
                case ev.RestoreRefused() as refused:
                    _emit(as_json, refused.model_dump(mode="json"), f"refused: {refused.reason}")
                    raise typer.Exit(1)
                case _:
                    _fail(f"no answer within {timeout_s:g} s (is a planner running? a compensation held?)", 2)

    asyncio.run(go())


def merge(
    parent: Annotated[str, typer.Argument(help="The session to merge into")],
    branches: Annotated[list[str], typer.Option("--from", help="A branch to merge (repeatable)")],
    log_url: LogUrl = None,
    wait: Wait = True,
    timeout_s: Timeout = 120,
    as_json: Json = False,
) -> None:
    """Fold branches' final outputs into a parent session; conflicts are reported, never merged."""

    async def go() -> None:
        async with open_log(log_url, actor="operator") as log:
            await _state(log, parent)
            for branch in branches:
                if branch == parent:
                    raise typer.BadParameter(f"{parent} cannot be merged into itself")
                if not await log.history(branch):
                    raise typer.BadParameter(f"no branch session {branch!r} in the log")
            body = ev.MergeRequested(author=_author(), branch_session_ids=branches)
            answer = await _ask(log, parent, body, wait=wait, timeout_s=timeout_s)
            if not wait:
                _emit(as_json, {"requested": branches}, f"merge of {', '.join(branches)} into {parent} requested")
                return
            match answer.body if answer else None:
                case ev.MergeApplied() as applied:
                    _emit(
                        as_json,
                        {"branch_session_ids": applied.branch_session_ids, "results": json.loads(applied.results_json)},
                        f"merged {', '.join(applied.branch_session_ids)} into {parent}: {applied.results_json}",
                    )
                case ev.MergeConflict() as conflict:
                    _emit(
                        as_json,
                        conflict.model_dump(mode="json"),
                        "merge conflict:\n" + "\n".join(f"  {c}" for c in conflict.conflicts),
                    )
                    raise typer.Exit(1)
                case _:
                    _fail(f"no answer within {timeout_s:g} s (are the branches still running?)", 2)

    asyncio.run(go())


def state(
    session_id: Annotated[str, typer.Argument(help="The session to fold")],
    log_url: LogUrl = None,
    from_start: Annotated[
        bool, typer.Option("--from-start", help="Ignore snapshots: fold from the first event")
    ] = False,
    snapshot_url: Annotated[
        str | None, typer.Option(help="Postgres of the snapshots (default: as the planner finds it)")
    ] = None,
    as_json: Json = False,
) -> None:
    """A session's folded state and digest, replayed from its newest snapshot (or from the start)."""
    from log.snapshots import SnapshotStore
    from services.checkpoint import state_digest
    from workers.config import log_namespace
    from workers.config import snapshot_url as find_snapshot_url
    from workers.replay import replay_session

    async def go() -> None:
        async with open_log(log_url, actor="auditor") as log:
            url = find_snapshot_url(snapshot_url, log_url)
            store = await SnapshotStore(url, log_namespace(log)).start() if url else None
            try:
                started = time.perf_counter()
                replayed = await replay_session(log, store, session_id, use_snapshot=not from_start)
                elapsed_ms = (time.perf_counter() - started) * 1000
            finally:
                if store is not None:
                    await store.close()
        folded = replayed.state
        if folded.status is None:
            _fail(f"no session {session_id!r} in the log")
        digest = state_digest(folded)
        data: dict[str, Any] = {
            "session_id": session_id,
            "status": folded.status.value if folded.status else None,
            "digest": digest,
            "source": replayed.source,
            "records_read": replayed.num_records,
            "steps": len(folded.steps),
            "generation": folded.generation,
            "checkpoints": list(folded.checkpoints),
            "ms": round(elapsed_ms, 1),
        }
        _emit(
            as_json,
            data,
            f"{session_id}: {data['status']}, {data['steps']} steps, generation {folded.generation}, "
            f"digest {digest[:16]} (from {replayed.source}, {replayed.num_records} records, "
            f"{elapsed_ms:.0f} ms)",
        )

    asyncio.run(go())
