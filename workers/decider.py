"""The decider: votes on every proposed tool call and appends the verdict.

Reads agent.actions (proposals) and ops.commands (operators' approvals);
appends ToolCallCommitted / ToolCallAborted to agent.verdicts, with every
vote. A call held by a voter (human approval) gets no verdict until an
approval or a denial arrives. The verdict's event id is derived from the
call, so a verdict is never appended twice, even across restarts.

The voters are ``--voters`` (default ``AGENTLOG_VOTERS``, else the built-in
``allow_list,arg_schema,rate_limit,human_approval`` and every plugin voter;
``default`` in the list stands for that set, e.g. ``default,llm_judge``). The
``llm_judge`` voter asks the engine (``--engine-url``, ``--engine-kind``) whether
a call is consistent with the session's goal; on the simulated engine, which has
no model, it answers with ``services.voters.simulated_judge`` (deterministic).

Run: ``python -m workers.decider [--log-url URL] [--snapshot-url postgresql://...] [--voters NAMES]``
(snapshots and partition marks: a restart reads its partitions from their marks, workers/recovery.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

from log import LoggedEvent, SharedLog
from log.topics import AGENT_ACTIONS, AGENT_VERDICTS, OPS_COMMANDS
from schemas import events as ev
from schemas.events import VoteDecision
from services.programs.base import Prompt
from services.registry import Registry
from services.session import SessionState, ToolCall, ToolStatus
from services.voters import (
    DEFAULT_VOTERS,
    Decider,
    JudgeAsk,
    JudgeQuestion,
    Proposal,
    VoterSettings,
    default_decider,
    simulated_judge,
)
from workers.config import add_snapshot_arguments, open_snapshot_store
from workers.crash import crash_point
from workers.engines.factory import ENGINE_KINDS, create_engine
from workers.plugins import builtin_registry
from workers.runtime import SessionWorker

JUDGE_MAX_TOKENS = 48
JUDGE_TIMEOUT_S = 60.0


class DeciderWorker(SessionWorker):
    role = "decider"
    topics = (AGENT_ACTIONS.name, OPS_COMMANDS.name, AGENT_VERDICTS.name)
    acts_on = frozenset({ToolStatus.PROPOSED})
    reconcile_every_s = 5.0

    def __init__(
        self, log: SharedLog, *, decider: Decider | None = None, registry: Registry | None = None, **kwargs: object
    ) -> None:
        super().__init__(log, **kwargs)  # type: ignore[arg-type]
        self.registry = registry or builtin_registry()
        self.tools = self.registry.tool_specs
        self.decider = decider or default_decider()
        self.engine: Any = None

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        add_snapshot_arguments(parser)
        parser.add_argument(
            "--voters",
            default=os.environ.get("AGENTLOG_VOTERS", "default"),
            help="comma-separated voters; 'default' is the built-in set and every plugin voter",
        )
        parser.add_argument(
            "--engine-url",
            default=os.environ.get("AGENTLOG_ENGINE_URL", "http://127.0.0.1:8100"),
            help="the engine llm_judge asks",
        )
        parser.add_argument(
            "--engine-kind", choices=ENGINE_KINDS, default=os.environ.get("AGENTLOG_ENGINE_KIND", "sim")
        )

    @classmethod
    async def create(cls, log: SharedLog, args: argparse.Namespace) -> DeciderWorker:
        registry: Registry = args.registry
        names = voter_names(args.voters, registry)
        worker_engine = None
        ask: JudgeAsk = simulated_judge
        if "llm_judge" in names and args.engine_kind != "sim":
            worker_engine = create_engine(args.engine_url, engine_id="judge", kind=args.engine_kind)
            ask = engine_judge(worker_engine, asyncio.get_running_loop())
        settings = VoterSettings(tools=registry.tool_specs, ask_judge=ask)
        decider = Decider(registry.build_voters(names, settings))
        snapshots = await open_snapshot_store(log, args)
        worker = cls(
            log, group=args.group, instance_id=args.instance_id, snapshots=snapshots, decider=decider, registry=registry
        )
        worker.engine = worker_engine
        return worker

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.close()
        if self.snapshots is not None:
            await self.snapshots.close()

    async def resume(self, state: SessionState) -> None:
        for tool in list(state.tool_calls.values()):
            if tool.status is ToolStatus.PROPOSED:
                await self.decide(state, tool)

    async def reconcile(self, state: SessionState) -> None:
        await self.resume(state)  # verdicts have deterministic ids: deciding again is a no-op

    async def on_event(self, state: SessionState, event: LoggedEvent) -> None:
        body = event.body
        if isinstance(body, ev.ToolCallProposed | ev.ApprovalGiven):
            tool = state.tool_calls.get(body.call_id)
            if tool is not None and tool.status is ToolStatus.PROPOSED:
                await self.decide(state, tool)

    async def decide(self, state: SessionState, tool: ToolCall) -> None:
        assert tool.proposed_at is not None  # set by the fold from the proposal's envelope
        earlier = [
            t.proposed_at for t in state.tool_calls.values() if t.proposed_at and t.proposed_at < tool.proposed_at
        ]
        proposal = Proposal(state, tool.proposed, tool.proposed_at, sorted(earlier), self.tools)
        if self.decider.blocking:  # a voter waits on an engine: keep the loop (and the engine client) free
            verdict = await asyncio.to_thread(self.decider.decide, proposal)
        else:
            verdict = self.decider.decide(proposal)
        if verdict.decision is VoteDecision.HOLD:
            return
        crash_point("decider.before_verdict")
        body: ev.ToolCallCommitted | ev.ToolCallAborted
        if verdict.decision is VoteDecision.APPROVE:
            body = ev.ToolCallCommitted(call_id=tool.call_id, votes=list(verdict.votes), policy=verdict.policy)
        else:
            body = ev.ToolCallAborted(
                call_id=tool.call_id, votes=list(verdict.votes), policy=verdict.policy, reason=verdict.reason
            )
        await self.append(state.session_id, body, kind="verdict", key=tool.call_id)
        crash_point("decider.after_verdict")


def voter_names(spec: str, registry: Registry) -> list[str]:
    """``"default,llm_judge"`` -> the voters to run, ``default`` expanded (unknown names fail later)."""
    names: list[str] = []
    for name in (n.strip() for n in spec.split(",")):
        if name == "default":
            names.extend([*DEFAULT_VOTERS, *registry.plugin_voters()])
        elif name:
            names.append(name)
    return names


def engine_judge(engine: Any, loop: asyncio.AbstractEventLoop) -> JudgeAsk:
    """``ask`` for the LLM judge on a real engine: one completion per question, from the voter's thread.

    The request id is derived from the call, so a decider that asks again after a crash asks the
    same request (an engine that keeps a record answers it from there).
    """

    def ask(question: JudgeQuestion) -> str:
        completion = asyncio.run_coroutine_threadsafe(
            engine.complete(
                session_id=question.session_id,
                request_id=f"{question.session_id}/judge/{question.call_id}",
                prompt=Prompt(text=question.prompt),
                max_output_tokens=JUDGE_MAX_TOKENS,
            ),
            loop,
        ).result(JUDGE_TIMEOUT_S)
        return str(completion.text)

    return ask


if __name__ == "__main__":
    from workers.main import run_worker

    run_worker(DeciderWorker)
