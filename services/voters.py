"""Voters and the decision policy: may a proposed tool call run?

Each voter looks at one proposal (with the session's state and the time the
proposal was made) and votes APPROVE, REJECT, ABSTAIN or HOLD (not yet: wait
for something, e.g. a human). ``decide`` applies the policy over the votes:

- ``unanimous`` (default): any REJECT aborts the call; otherwise any HOLD
  keeps it waiting (no verdict yet); otherwise it is committed. ABSTAIN counts
  for nothing.

Voters are pure: the time is passed in (the proposal's ``occurred_at``, from
the log), never read from a clock.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

import jsonschema

from schemas.events import ApprovalDecision, EffectClass, ToolCallProposed, Vote, VoteDecision
from services.session import SessionState
from services.tools import TOOLS, ToolSpec


@dataclass(frozen=True)
class Proposal:
    """A proposed call and what a voter may consult about it."""

    session: SessionState
    proposed: ToolCallProposed
    proposed_at: datetime
    recent_proposals: Sequence[datetime] = ()
    """When the session's earlier proposals were made (for rate limits)."""

    @property
    def spec(self) -> ToolSpec | None:
        return TOOLS.get(self.proposed.tool)


class Voter(Protocol):
    @property
    def name(self) -> str: ...

    def vote(self, proposal: Proposal) -> Vote: ...


def _vote(voter: str, decision: VoteDecision, reason: str) -> Vote:
    return Vote(voter=voter, decision=decision, reason=reason)


@dataclass(frozen=True)
class AllowList:
    """Each program may use only the tools listed for it (``"*"`` lists the default)."""

    allowed: dict[str, frozenset[str]]
    name: str = "allow_list"

    def vote(self, proposal: Proposal) -> Vote:
        program = proposal.session.program
        tools = self.allowed.get(program, self.allowed.get("*", frozenset()))
        if proposal.proposed.tool in tools:
            return _vote(self.name, VoteDecision.APPROVE, f"{proposal.proposed.tool} is allowed for {program}")
        return _vote(self.name, VoteDecision.REJECT, f"{proposal.proposed.tool} is not allowed for program {program}")


@dataclass(frozen=True)
class ArgumentSchema:
    """The arguments must be a JSON object valid against the tool's schema; unknown tools are rejected."""

    name: str = "arg_schema"

    def vote(self, proposal: Proposal) -> Vote:
        spec = proposal.spec
        if spec is None:
            return _vote(self.name, VoteDecision.REJECT, f"unknown tool {proposal.proposed.tool!r}")
        if spec.effect_class != proposal.proposed.effect_class:
            return _vote(
                self.name,
                VoteDecision.REJECT,
                f"{spec.name} is {spec.effect_class.value}, the proposal says {proposal.proposed.effect_class.value}",
            )
        try:
            arguments = json.loads(proposal.proposed.arguments_json)
            jsonschema.validate(arguments, spec.args_schema)
        except json.JSONDecodeError as e:
            return _vote(self.name, VoteDecision.REJECT, f"arguments are not JSON: {e.msg}")
        except jsonschema.ValidationError as e:
            where = "/".join(str(p) for p in e.absolute_path) or "arguments"
            return _vote(self.name, VoteDecision.REJECT, f"{where}: {e.message}")
        return _vote(self.name, VoteDecision.APPROVE, "arguments match the schema")


@dataclass(frozen=True)
class RateLimit:
    """At most ``max_calls`` proposals per session within ``window_s`` seconds (log time)."""

    max_calls: int = 1000
    window_s: float = 60.0
    name: str = "rate_limit"

    def vote(self, proposal: Proposal) -> Vote:
        recent = [
            t for t in proposal.recent_proposals if 0 <= (proposal.proposed_at - t).total_seconds() < self.window_s
        ]
        if len(recent) >= self.max_calls:
            return _vote(
                self.name,
                VoteDecision.REJECT,
                f"{len(recent)} calls in the last {self.window_s:g} s (max {self.max_calls})",
            )
        return _vote(self.name, VoteDecision.APPROVE, f"{len(recent) + 1} of {self.max_calls} in the window")


@dataclass(frozen=True)
class HumanApproval:
    """Irreversible tools wait for an operator's ``logctl approve`` (or are refused by ``deny``)."""

    effect_classes: frozenset[EffectClass] = frozenset({EffectClass.IRREVERSIBLE})
    name: str = "human_approval"

    def vote(self, proposal: Proposal) -> Vote:
        if proposal.proposed.effect_class not in self.effect_classes:
            return _vote(self.name, VoteDecision.ABSTAIN, "no approval needed")
        tool = proposal.session.tool_calls.get(proposal.proposed.call_id)
        for approval in reversed(tool.approvals if tool else []):
            if approval.decision is ApprovalDecision.APPROVE:
                return _vote(self.name, VoteDecision.APPROVE, f"approved by {approval.author}: {approval.reason}")
            if approval.decision is ApprovalDecision.DENY:
                return _vote(self.name, VoteDecision.REJECT, f"denied by {approval.author}: {approval.reason}")
        return _vote(self.name, VoteDecision.HOLD, "irreversible: waiting for an operator (logctl approve)")


@dataclass(frozen=True)
class Verdict:
    """The outcome of the policy: commit, abort, or no verdict yet (hold)."""

    decision: VoteDecision  # APPROVE = commit, REJECT = abort, HOLD = wait
    votes: tuple[Vote, ...]
    reason: str
    policy: str = "unanimous"


@dataclass
class Decider:
    """Runs every voter and applies the policy."""

    voters: Sequence[Voter] = field(default_factory=list)
    policy: str = "unanimous"

    def decide(self, proposal: Proposal) -> Verdict:
        votes = tuple(voter.vote(proposal) for voter in self.voters)
        rejections = [v for v in votes if v.decision is VoteDecision.REJECT]
        if rejections:
            reason = "; ".join(f"{v.voter}: {v.reason}" for v in rejections)
            return Verdict(VoteDecision.REJECT, votes, reason, self.policy)
        holds = [v for v in votes if v.decision is VoteDecision.HOLD]
        if holds:
            return Verdict(VoteDecision.HOLD, votes, "; ".join(f"{v.voter}: {v.reason}" for v in holds), self.policy)
        return Verdict(VoteDecision.APPROVE, votes, "every voter approved or abstained", self.policy)


DEFAULT_ALLOWED: dict[str, frozenset[str]] = {
    "trace": frozenset({"trace_tool"}),
    "*": frozenset(TOOLS),
}


def default_decider(allowed: dict[str, frozenset[str]] | None = None, *, max_calls_per_minute: int = 1000) -> Decider:
    """The decider the decider worker runs unless configured otherwise."""
    return Decider(
        [
            AllowList(allowed or DEFAULT_ALLOWED),
            ArgumentSchema(),
            RateLimit(max_calls=max_calls_per_minute),
            HumanApproval(),
        ]
    )
