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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

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
    tools: Mapping[str, ToolSpec] = field(default_factory=lambda: TOOLS)
    """Every tool the stack knows (built-ins and plugins)."""

    @property
    def spec(self) -> ToolSpec | None:
        return self.tools.get(self.proposed.tool)

    @property
    def tool(self) -> str:
        return self.proposed.tool

    @property
    def arguments(self) -> dict[str, Any]:
        """The proposed arguments (an empty dict when they are not a JSON object)."""
        try:
            arguments = json.loads(self.proposed.arguments_json)
        except json.JSONDecodeError:
            return {}
        return arguments if isinstance(arguments, dict) else {}

    @property
    def goal(self) -> str:
        """What the session is for, in words: its ``goal`` or ``task`` argument, else all its arguments."""
        args = self.session.args
        for key in ("goal", "task"):
            if isinstance(args.get(key), str):
                return str(args[key])
        return json.dumps(args, sort_keys=True)

    @property
    def history(self) -> list[Any]:
        """The session's steps before this one, in order (``LLMCall`` / ``ToolCall`` / ``PlannerStep``)."""
        return [s for s in self.session.steps if s.call_id != self.proposed.call_id]


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
class Ballot:
    """What a user's voter function returns: a decision and the reason for it (see ``approve`` etc.)."""

    decision: VoteDecision
    reason: str


def approve(reason: str = "approved") -> Ballot:
    return Ballot(VoteDecision.APPROVE, reason)


def reject(reason: str) -> Ballot:
    return Ballot(VoteDecision.REJECT, reason)


def hold(reason: str) -> Ballot:
    """Not yet: no verdict until something changes (an operator's ``logctl approve``, for example)."""
    return Ballot(VoteDecision.HOLD, reason)


def abstain(reason: str = "no opinion") -> Ballot:
    return Ballot(VoteDecision.ABSTAIN, reason)


VoterFunction = Callable[[Proposal], Ballot]


@dataclass(frozen=True)
class FunctionVoter:
    """A voter written as a function of the proposal (``services.sdk.voter``).

    A function that raises or returns something other than a ``Ballot`` rejects the call
    (fail closed), with the error as the reason: a voter bug must not let a call through.
    """

    name: str
    function: VoterFunction
    description: str = ""

    def vote(self, proposal: Proposal) -> Vote:
        try:
            ballot = self.function(proposal)
        except Exception as e:
            return _vote(self.name, VoteDecision.REJECT, f"the voter raised {type(e).__name__}: {e}")
        if not isinstance(ballot, Ballot):
            return _vote(self.name, VoteDecision.REJECT, f"the voter returned {ballot!r}, not approve/reject/hold")
        return _vote(self.name, ballot.decision, ballot.reason)


@dataclass(frozen=True)
class JudgeQuestion:
    """What the LLM judge asks an engine about one proposal."""

    goal: str
    tool: str
    arguments_json: str
    prompt: str
    session_id: str = ""
    call_id: str = ""


JudgeAsk = Callable[[JudgeQuestion], str]
"""Asks an engine (injected: the decider wires it to its engine) and returns the model's text."""

JUDGE_INSTRUCTIONS = (
    "You review the tool calls of an AI agent. Answer with one line: APPROVE or REJECT, a colon, "
    "and a short reason. Approve a call only when it is consistent with the session's goal."
)


@dataclass(frozen=True)
class LLMJudge:
    """Asks a model whether a proposed call is consistent with the session's goal (LogAct's judge).

    The answer's first word decides: ``APPROVE`` or ``REJECT`` (the rest is the reason). An answer that
    is neither, or an engine that cannot be asked, HOLDs the call for an operator; a call an operator
    approved or denied is left to them (ABSTAIN). The engine call is ``ask``, injected, so the
    judgement is a pure function of the proposal and the answer.
    """

    ask: JudgeAsk
    name: str = "llm_judge"
    max_history: int = 8
    blocking: bool = True
    """``ask`` waits on an engine: the decider calls this voter off its event loop."""

    def question(self, proposal: Proposal) -> JudgeQuestion:
        steps = [
            f"- {s.proposed.tool}({s.proposed.arguments_json}) -> {s.status.value}"
            for s in proposal.history
            if hasattr(s, "proposed")
        ][-self.max_history :]
        prompt = "\n".join(
            [
                JUDGE_INSTRUCTIONS,
                f"Goal: {proposal.goal}",
                "Earlier tool calls:" if steps else "Earlier tool calls: none",
                *steps,
                f"Proposed call: {proposal.tool}({proposal.proposed.arguments_json})",
                "Answer:",
            ]
        )
        return JudgeQuestion(
            proposal.goal,
            proposal.tool,
            proposal.proposed.arguments_json,
            prompt,
            proposal.session.session_id,
            proposal.proposed.call_id,
        )

    def vote(self, proposal: Proposal) -> Vote:
        tool = proposal.session.tool_calls.get(proposal.proposed.call_id)
        if tool is not None and tool.approvals:
            return _vote(self.name, VoteDecision.ABSTAIN, "an operator decided this call")
        try:
            answer = self.ask(self.question(proposal))
        except Exception as e:
            return _vote(self.name, VoteDecision.HOLD, f"the judge could not be asked ({type(e).__name__}: {e})")
        return judgement(self.name, answer)


def judgement(voter: str, answer: str) -> Vote:
    """The vote an answer of the judge's model means (see ``LLMJudge``)."""
    text = answer.strip()
    head, _, rest = text.partition(":")
    word = head.strip().split()[0].upper() if head.strip() else ""
    reason = (rest.strip() or text)[:300]
    if word == "APPROVE":
        return _vote(voter, VoteDecision.APPROVE, f"the judge approves: {reason}")
    if word == "REJECT":
        return _vote(voter, VoteDecision.REJECT, f"the judge rejects: {reason}")
    return _vote(voter, VoteDecision.HOLD, f"the judge's answer is neither APPROVE nor REJECT: {text[:200]!r}")


def simulated_judge(question: JudgeQuestion) -> str:
    """The judge's answer on the simulated engine, which has no model: deterministic and documented.

    APPROVE when every word of the tool's name (split at ``_``) occurs in the goal, REJECT otherwise:
    a goal that says "search flights and book the cheapest" allows ``search_flights`` and ``book``,
    not ``delete_account``.
    """
    goal = question.goal.lower()
    missing = [w for w in question.tool.lower().split("_") if w and w not in goal]
    if missing:
        return f"REJECT: {question.tool} is not part of the goal ({', '.join(missing)} not mentioned)"
    return f"APPROVE: {question.tool} is part of the goal"


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

    @property
    def blocking(self) -> bool:
        """Some voter waits on something outside (an engine): call ``decide`` off the event loop."""
        return any(getattr(v, "blocking", False) for v in self.voters)

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


def default_allowed(tools: Mapping[str, ToolSpec]) -> dict[str, frozenset[str]]:
    """The allow list of a stack with these tools: ``trace`` uses only ``trace_tool``, others any tool."""
    return {"trace": frozenset({"trace_tool"}), "*": frozenset(tools)}


DEFAULT_VOTERS = ("allow_list", "arg_schema", "rate_limit", "human_approval")
"""The built-in voters a decider runs unless told otherwise (plugin voters run besides them)."""


@dataclass(frozen=True)
class VoterSettings:
    """What building a voter may need: the stack's tools, the rate limit, the judge's engine."""

    tools: Mapping[str, ToolSpec] = field(default_factory=lambda: TOOLS)
    max_calls_per_minute: int = 1000
    ask_judge: JudgeAsk | None = None


VoterFactory = Callable[[VoterSettings], Voter]


def _judge(settings: VoterSettings) -> Voter:
    if settings.ask_judge is None:
        raise ValueError("the llm_judge voter needs an engine to ask")
    return LLMJudge(settings.ask_judge)


BUILTIN_VOTERS: dict[str, VoterFactory] = {
    "allow_list": lambda s: AllowList(default_allowed(s.tools)),
    "arg_schema": lambda s: ArgumentSchema(),
    "rate_limit": lambda s: RateLimit(max_calls=s.max_calls_per_minute),
    "human_approval": lambda s: HumanApproval(),
    "llm_judge": _judge,
}
"""Built-in voters by name, built from the settings (``llm_judge`` is not in ``DEFAULT_VOTERS``)."""


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
