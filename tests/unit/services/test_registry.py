"""The registry (services/registry.py) and the SDK's voters (services/voters.py): pure, no processes."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from schemas import events as ev
from schemas.events import EffectClass, VoteDecision
from services.registry import Registry, RegistryError, Tool
from services.sdk import Proposal, approve, hold, reject, tool, voter
from services.session import SessionState, fold
from services.voters import (
    BUILTIN_VOTERS,
    JudgeQuestion,
    LLMJudge,
    VoterSettings,
    judgement,
    simulated_judge,
)
from tests.unit.services.helpers import envelope

T0 = datetime(2026, 1, 1, tzinfo=UTC)


@tool(name="lookup", effect="idempotent", schema={"type": "object", "properties": {"q": {"type": "string"}}})
def lookup(args: dict[str, Any], ctx: Any) -> Any:
    return {"q": args["q"]}


def test_the_tool_decorator_builds_a_spec_and_keeps_the_function() -> None:
    assert isinstance(lookup, Tool)
    assert lookup.spec.effect_class is EffectClass.IDEMPOTENT
    assert lookup.spec.retry_safe
    assert lookup.function({"q": "x"}, None) == {"q": "x"}


def test_an_unknown_effect_class_fails_where_it_is_declared() -> None:
    with pytest.raises(ValueError, match="effect class 'maybe' is not one of pure, idempotent"):
        tool(name="t", effect="maybe")


def test_duplicates_bad_schemas_reserved_names_and_missing_compensations_are_refused() -> None:
    registry = Registry()
    registry.add(lookup, "mod.a")
    with pytest.raises(RegistryError, match=r"^mod.b: tool 'lookup' is registered twice \(already by mod.a\)$"):
        registry.add(lookup, "mod.b")
    bad = tool(name="bad", effect="pure", schema={"type": "no-such-type"})(lambda a, c: None)
    with pytest.raises(RegistryError, match="^mod.c: tool 'bad' has an argument schema that is not a valid JSON"):
        registry.add(bad, "mod.c")
    with pytest.raises(RegistryError, match="reserved for the planner's own steps"):
        registry.add(tool(name="checkpoint", effect="pure")(lambda a, c: None), "mod.d")
    with pytest.raises(RegistryError, match="compensatable tool 'book' names no compensation"):
        registry.add(tool(name="book", effect="compensatable")(lambda a, c: None), "mod.e")
    registry.add(tool(name="book2", effect="compensatable", compensation="unbook")(lambda a, c: None), "mod.f")
    with pytest.raises(RegistryError, match="^mod.f: tool 'book2' names compensation 'unbook', which is not a tool$"):
        registry.check()


def test_voters_are_built_from_settings_and_unknown_names_are_refused() -> None:
    registry = Registry()
    for name, factory in BUILTIN_VOTERS.items():
        registry.add_voter(name, factory, "agentlog (built-in)")
    with pytest.raises(RegistryError, match="unknown voter 'nope'"):
        registry.build_voters(["nope"], VoterSettings())
    with pytest.raises(RegistryError, match="llm_judge voter needs an engine"):
        registry.build_voters(["llm_judge"], VoterSettings())
    built = registry.build_voters(["arg_schema", "llm_judge"], VoterSettings(ask_judge=simulated_judge))
    assert [v.name for v in built] == ["arg_schema", "llm_judge"]


# ------------------------------------------------------------------------------ voters


def proposal(tool_name: str, arguments: dict[str, Any], args: dict[str, Any] | None = None) -> Proposal:
    state: SessionState = fold(
        "s",
        [
            envelope(ev.SessionStarted(program="agent", args_json=json.dumps(args or {}))),
            envelope(
                ev.ToolCallProposed(
                    call_id="tool-0",
                    tool=tool_name,
                    arguments_json=json.dumps(arguments),
                    effect_class=EffectClass.IRREVERSIBLE,
                    idempotency_key="s/tool-0",
                )
            ),
        ],
    )
    return Proposal(state, state.tool_calls["tool-0"].proposed, T0)


@voter(name="budget")
def budget(p: Proposal) -> Any:
    if p.tool != "pay":
        return approve("not a payment")
    if p.arguments["amount"] > 500:
        return reject(f"{p.arguments['amount']} is over the budget")
    return hold("a person looks at every payment") if p.arguments["amount"] > 100 else approve("small")


def test_a_function_voter_votes_with_its_name_and_reason() -> None:
    assert budget.vote(proposal("pay", {"amount": 900})).model_dump() == {
        "voter": "budget",
        "decision": VoteDecision.REJECT,
        "reason": "900 is over the budget",
    }
    assert budget.vote(proposal("pay", {"amount": 200})).decision is VoteDecision.HOLD
    assert budget.vote(proposal("pay", {"amount": 20})).decision is VoteDecision.APPROVE


def test_a_voter_that_raises_or_returns_nonsense_rejects_the_call() -> None:
    broken = voter(name="broken")(lambda p: p.arguments["missing"])
    vote = broken.vote(proposal("pay", {}))
    assert vote.decision is VoteDecision.REJECT and vote.reason == "the voter raised KeyError: 'missing'"
    vague = voter(name="vague")(lambda p: True)
    assert vague.vote(proposal("pay", {})).decision is VoteDecision.REJECT


def test_the_llm_judge_asks_about_the_goal_and_the_call_and_reads_the_answer() -> None:
    asked: list[JudgeQuestion] = []

    def ask(question: JudgeQuestion) -> str:
        asked.append(question)
        return "REJECT: the goal is a trip, not a refund"

    judge = LLMJudge(ask)
    vote = judge.vote(proposal("refund", {"amount": 3}, {"goal": "plan a trip to Lisbon"}))
    assert vote.decision is VoteDecision.REJECT
    assert vote.reason == "the judge rejects: the goal is a trip, not a refund"
    (question,) = asked
    assert question.goal == "plan a trip to Lisbon"
    assert 'Proposed call: refund({"amount": 3})' in question.prompt
    assert (question.session_id, question.call_id) == ("s", "tool-0")


def test_the_judges_answers_and_failures_map_to_votes() -> None:
    assert judgement("j", "approve: fine").decision is VoteDecision.APPROVE
    assert judgement("j", "  REJECT because").decision is VoteDecision.REJECT
    assert judgement("j", "I am not sure").decision is VoteDecision.HOLD
    assert judgement("j", "").decision is VoteDecision.HOLD

    def down(question: JudgeQuestion) -> str:
        raise ConnectionError("engine down")

    vote = LLMJudge(down).vote(proposal("pay", {}))
    assert vote.decision is VoteDecision.HOLD and "engine down" in vote.reason


def test_the_simulated_judge_approves_the_tools_its_goal_names() -> None:
    goal = {"goal": "search flights to Lisbon and book the cheapest"}
    judge = LLMJudge(simulated_judge)
    assert judge.vote(proposal("search_flights", {}, goal)).decision is VoteDecision.APPROVE
    assert judge.vote(proposal("book", {}, goal)).decision is VoteDecision.APPROVE
    vote = judge.vote(proposal("delete_account", {}, goal))
    assert vote.decision is VoteDecision.REJECT
    assert vote.reason == "the judge rejects: delete_account is not part of the goal (delete, account not mentioned)"
