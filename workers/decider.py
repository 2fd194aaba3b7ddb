"""The decider: votes on every proposed tool call and appends the verdict.

Reads agent.actions (proposals) and ops.commands (operators' approvals);
appends ToolCallCommitted / ToolCallAborted to agent.verdicts, with every
vote. A call held by a voter (human approval) gets no verdict until an
approval or a denial arrives. The verdict's event id is derived from the
call, so a verdict is never appended twice, even across restarts.

Run: ``python -m workers.decider [--log-url URL] [--snapshot-url postgresql://...]`` (snapshots
and partition marks: a restart reads its partitions from their marks, workers/recovery.py).
"""

from __future__ import annotations

import argparse

from log import LoggedEvent, SharedLog
from schemas import events as ev
from schemas.events import VoteDecision
from services.session import SessionState, ToolCall, ToolStatus
from services.voters import Decider, Proposal, default_decider
from workers.config import add_snapshot_arguments, open_snapshot_store
from workers.crash import crash_point
from workers.runtime import SessionWorker


class DeciderWorker(SessionWorker):
    role = "decider"
    topics = ("agent.actions", "ops.commands", "agent.verdicts")
    acts_on = frozenset({ToolStatus.PROPOSED})
    reconcile_every_s = 5.0

    def __init__(self, log: SharedLog, *, decider: Decider | None = None, **kwargs: object) -> None:
        super().__init__(log, **kwargs)  # type: ignore[arg-type]
        self.decider = decider or default_decider()

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        add_snapshot_arguments(parser)

    @classmethod
    async def create(cls, log: SharedLog, args: argparse.Namespace) -> DeciderWorker:
        snapshots = await open_snapshot_store(log, args)
        return cls(log, group=args.group, instance_id=args.instance_id, snapshots=snapshots)

    async def close(self) -> None:
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
        verdict = self.decider.decide(Proposal(state, tool.proposed, tool.proposed_at, sorted(earlier)))
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


if __name__ == "__main__":
    from workers.main import run_worker

    run_worker(DeciderWorker)
