"""Each voter's vote and the unanimous policy, on exact small cases."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from schemas import events as ev
from schemas.events import EffectClass, VoteDecision
from services.session import fold
from services.voters import AllowList, ArgumentSchema, HumanApproval, Proposal, RateLimit, default_decider
from tests.unit.services.helpers import T0, envelope

pytestmark = pytest.mark.unit


def proposal(
    tool: str,
    args: object,
    effect: EffectClass,
    *,
    approvals: list[ev.ApprovalGiven] = (),
    program="react",
    recent: int = 0,
) -> Proposal:  # type: ignore[assignment]
    proposed = ev.ToolCallProposed(
        call_id="tool-1",
        tool=tool,
        arguments_json=args if isinstance(args, str) else json.dumps(args),
        effect_class=effect,
        idempotency_key="s/tool-1",
    )
    bodies: list[ev.Event] = [ev.SessionStarted(program=program, args_json="{}"), proposed, *approvals]
    state = fold("s", [envelope(b) for b in bodies])
    return Proposal(state, proposed, T0, [T0 - timedelta(seconds=i) for i in range(recent)])


def test_allow_list() -> None:
    voter = AllowList({"trace": frozenset({"trace_tool"})})
    assert voter.vote(proposal("trace_tool", {}, EffectClass.PURE, program="trace")).decision is VoteDecision.APPROVE
    vote = voter.vote(proposal("payment", {}, EffectClass.IRREVERSIBLE, program="trace"))
    assert vote.decision is VoteDecision.REJECT and "not allowed for program trace" in vote.reason


def test_argument_schema() -> None:
    voter = ArgumentSchema()
    assert voter.vote(proposal("echo", {"text": "hi"}, EffectClass.PURE)).decision is VoteDecision.APPROVE
    bad = voter.vote(proposal("echo", {"text": 3}, EffectClass.PURE))
    assert bad.decision is VoteDecision.REJECT and bad.reason.startswith("text:")
    assert "unknown tool" in voter.vote(proposal("rm_rf", {}, EffectClass.PURE)).reason
    assert "not JSON" in voter.vote(proposal("echo", "{oops", EffectClass.PURE)).reason
    lying = voter.vote(proposal("payment", {"account": "a", "amount_cents": 1}, EffectClass.PURE))
    assert lying.decision is VoteDecision.REJECT and "irreversible" in lying.reason.lower()


def test_rate_limit() -> None:
    voter = RateLimit(max_calls=3, window_s=60)
    assert voter.vote(proposal("echo", {}, EffectClass.PURE, recent=2)).decision is VoteDecision.APPROVE
    assert voter.vote(proposal("echo", {}, EffectClass.PURE, recent=3)).decision is VoteDecision.REJECT


def test_human_approval_holds_then_follows_the_operator() -> None:
    voter = HumanApproval()
    args = {"account": "acme", "amount_cents": 500}
    assert voter.vote(proposal("echo", {"text": ""}, EffectClass.PURE)).decision is VoteDecision.ABSTAIN
    assert voter.vote(proposal("payment", args, EffectClass.IRREVERSIBLE)).decision is VoteDecision.HOLD
    approve = ev.ApprovalGiven(call_id="tool-1", decision=ev.ApprovalDecision.APPROVE, author="ana", reason="ok")
    deny = ev.ApprovalGiven(call_id="tool-1", decision=ev.ApprovalDecision.DENY, author="bo", reason="no")
    assert voter.vote(proposal("payment", args, EffectClass.IRREVERSIBLE, approvals=[approve])).decision is (
        VoteDecision.APPROVE
    )
    last = voter.vote(proposal("payment", args, EffectClass.IRREVERSIBLE, approvals=[approve, deny]))
    assert last.decision is VoteDecision.REJECT and "denied by bo" in last.reason


def test_unanimous_policy() -> None:
    decider = default_decider()
    ok = decider.decide(proposal("echo", {"text": "x"}, EffectClass.PURE))
    assert ok.decision is VoteDecision.APPROVE and [v.voter for v in ok.votes] == [
        "allow_list",
        "arg_schema",
        "rate_limit",
        "human_approval",
    ]
    held = decider.decide(proposal("payment", {"account": "a", "amount_cents": 1}, EffectClass.IRREVERSIBLE))
    assert held.decision is VoteDecision.HOLD
    refused = decider.decide(proposal("payment", {"account": "a"}, EffectClass.IRREVERSIBLE))
    assert refused.decision is VoteDecision.REJECT and "amount_cents" in refused.reason
