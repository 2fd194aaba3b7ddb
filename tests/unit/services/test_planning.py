"""Residual completion: replay the program against recorded results, do only what is left."""

from __future__ import annotations

import json

import pytest

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
    prompt_digest,
)
from services.programs import PROGRAMS, CallLLM, Finish, ProgramView, Prompt
from services.session import SessionState, SessionStatus, fold
from tests.unit.services.helpers import envelope

pytestmark = pytest.mark.unit

TRACE = PROGRAMS["trace"]
SESSION = {
    "session_id": "x",
    "turns": [
        {"prompt_tokens": 100, "output_tokens": 10, "tool": "search", "tool_duration_s": 2.0, "tool_result_tokens": 30},
        {"prompt_tokens": 20, "output_tokens": 5, "tool": None, "tool_duration_s": None, "tool_result_tokens": None},
    ],
}


def started() -> list[ev.Event]:
    return [
        ev.SessionRequested(program="trace", args_json=json.dumps({"session": SESSION}), author="test"),
        ev.SessionStarted(program="trace", args_json=json.dumps({"session": SESSION})),
    ]


def completed(move: CallEngine) -> ev.LLMCallCompleted:
    return ev.LLMCallCompleted(
        call_id=move.call_id,
        engine_id="sim",
        prompt_tokens=move.prompt.num_tokens,
        cached_tokens=0,
        output_tokens=move.max_output_tokens,
        output_text="",
        finish_reason="stop",
        queue_ms=0,
        prefill_ms=0,
        decode_ms=0,
    )


def llm_started(move: CallEngine) -> ev.LLMCallStarted:
    return ev.LLMCallStarted(
        call_id=move.call_id,
        turn=move.turn,
        engine_id="sim",
        prompt_tokens=move.prompt.num_tokens,
        max_output_tokens=move.max_output_tokens,
        prompt_digest=move.prompt_digest,
    )


def state_of(bodies: list[ev.Event]) -> SessionState:
    return fold("s", [envelope(b) for b in bodies])


def test_a_requested_session_is_started() -> None:
    move = next_move(state_of(started()[:1]), TRACE)
    assert isinstance(move, StartSession) and move.program == "trace"


def test_whole_trace_session_step_by_step() -> None:
    bodies = started()
    first = next_move(state_of(bodies), TRACE)
    assert isinstance(first, CallEngine) and first.call_id == "llm-0" and not first.resume
    assert first.prompt.num_tokens == 100 and first.max_output_tokens == 10
    bodies += [llm_started(first), completed(first)]
    tool = next_move(state_of(bodies), TRACE)
    assert isinstance(tool, ProposeTool) and tool.call_id == "tool-1" and tool.tool == "trace_tool"
    assert json.loads(tool.arguments_json) == {"tool": "search", "duration_s": 2.0, "result_tokens": 30}
    assert tool.idempotency_key == "s/tool-1"
    bodies.append(
        ev.ToolCallProposed(
            call_id=tool.call_id,
            tool=tool.tool,
            arguments_json=tool.arguments_json,
            effect_class=tool.effect_class,
            idempotency_key=tool.idempotency_key,
        )
    )
    assert next_move(state_of(bodies), TRACE) == WaitFor("tool-1", "proposed")
    bodies += [
        ev.ToolCallCommitted(call_id="tool-1", votes=[], policy="unanimous"),
        ev.ToolCallStarted(call_id="tool-1", tool="trace_tool", idempotency_key="s/tool-1", attempt=1),
    ]
    assert next_move(state_of(bodies), TRACE) == WaitFor("tool-1", "started")
    bodies.append(ev.ToolCallCompleted(call_id="tool-1", result_json="{}", result_tokens=30, duration_ms=2000))
    second = next_move(state_of(bodies), TRACE)
    assert isinstance(second, CallEngine) and second.call_id == "llm-2"
    # The context: 100 prompt + 10 output + 30 tool result + 20 new prompt tokens, prefix-stable.
    assert second.prompt.num_tokens == 160
    assert second.prompt.runs[: len(first.prompt.runs)] == first.prompt.runs
    bodies += [llm_started(second), completed(second)]
    finish = next_move(state_of(bodies), TRACE)
    assert isinstance(finish, FinishSession) and finish.num_llm_calls == 2 and finish.num_tool_calls == 1
    bodies.append(ev.SessionFinished(output_json=finish.output_json, num_llm_calls=2, num_tool_calls=1))
    assert isinstance(next_move(state_of(bodies), TRACE), Idle)


def test_started_llm_call_without_output_is_resumed_not_restarted() -> None:
    bodies = started()
    first = next_move(state_of(bodies), TRACE)
    assert isinstance(first, CallEngine)
    bodies.append(llm_started(first))
    again = next_move(state_of(bodies), TRACE)
    assert isinstance(again, CallEngine) and again.resume and again.request_id == first.request_id == "s/llm-0"


def test_nondeterminism_is_reported() -> None:
    class Other:
        name = "trace"

        def next_action(self, view: ProgramView) -> CallLLM | Finish:
            return CallLLM(Prompt(text="something else"), 5)

    bodies = started()
    first = next_move(state_of(bodies), TRACE)
    assert isinstance(first, CallEngine)
    bodies.append(llm_started(first))
    move = next_move(state_of(bodies), Other())
    assert isinstance(move, FailSession) and move.error_type == "NonDeterminism"


@pytest.mark.parametrize(
    ("returned", "error_type"),
    [(None, "InvalidAction"), ("call the tool", "InvalidAction"), (ZeroDivisionError("boom"), "ProgramError")],
)
def test_invalid_actions_fail_the_session(returned: object, error_type: str) -> None:
    class Broken:
        name = "broken"

        def next_action(self, view: ProgramView) -> object:
            if isinstance(returned, Exception):
                raise returned
            return returned

    state = state_of(started())
    move = next_move(state, Broken())  # type: ignore[arg-type]
    assert isinstance(move, FailSession) and move.error_type == error_type


def test_unknown_program_and_unknown_tool() -> None:
    state = state_of([ev.SessionRequested(program="nope", args_json="{}", author="t")])
    move = next_move(state, None)
    assert isinstance(move, FailSession) and move.error_type == "UnknownProgram"

    class UsesUnknownTool:
        name = "u"

        def next_action(self, view: ProgramView) -> object:
            from services.programs import CallTool

            return CallTool("launch_rockets", {})

    move = next_move(state_of(started()), UsesUnknownTool())  # type: ignore[arg-type]
    assert isinstance(move, ProposeTool) and move.effect_class is ev.EffectClass.IRREVERSIBLE


def test_aborted_tool_is_a_failed_result_for_the_program() -> None:
    bodies = started()
    first = next_move(state_of(bodies), TRACE)
    assert isinstance(first, CallEngine)
    bodies += [llm_started(first), completed(first)]
    tool = next_move(state_of(bodies), TRACE)
    assert isinstance(tool, ProposeTool)
    bodies += [
        ev.ToolCallProposed(
            call_id=tool.call_id,
            tool=tool.tool,
            arguments_json=tool.arguments_json,
            effect_class=tool.effect_class,
            idempotency_key=tool.idempotency_key,
        ),
        ev.ToolCallAborted(call_id="tool-1", votes=[], policy="unanimous", reason="rate limit"),
        # A second, contradicting verdict is an anomaly and is not obeyed.
        ev.ToolCallCommitted(call_id="tool-1", votes=[], policy="unanimous"),
    ]
    state = state_of(bodies)
    assert state.tool_calls["tool-1"].status.value == "aborted"
    assert state.anomalies == ["duplicate verdict for tool-1: ToolCallCommitted ignored"]
    move = next_move(state, TRACE)
    assert isinstance(move, CallEngine) and move.call_id == "llm-2"


def test_cancel_fails_the_session() -> None:
    state = state_of([*started(), ev.CancelRequested(author="op", reason="stop")])
    move = next_move(state, TRACE)
    assert isinstance(move, FailSession) and move.error_type == "Cancelled"
    state.apply(envelope(ev.SessionFailed(reason=move.reason, error_type=move.error_type)))
    assert state.status is SessionStatus.CANCELLED


def test_applying_the_same_event_twice_is_a_no_op() -> None:
    e = envelope(started()[0])
    state = SessionState("s")
    assert state.apply(e) and not state.apply(e)
    assert state.num_events == 1


def test_prompt_digest_is_stable() -> None:
    assert prompt_digest(Prompt(text="a")) == prompt_digest(Prompt(text="a")) != prompt_digest(Prompt(text="b"))


def test_a_verdict_read_before_its_proposal_is_applied_when_the_proposal_arrives() -> None:
    proposal = ev.ToolCallProposed(
        call_id="tool-1", tool="echo", arguments_json="{}", effect_class=ev.EffectClass.PURE, idempotency_key="k"
    )
    state = state_of(
        [
            *started(),
            ev.ToolCallCommitted(call_id="tool-1", votes=[], policy="unanimous"),
            ev.ApprovalGiven(call_id="tool-1", decision=ev.ApprovalDecision.APPROVE, author="a", reason="r"),
        ]
    )
    assert "tool-1" not in state.tool_calls and len(state.early["tool-1"]) == 2
    state.apply(envelope(proposal))
    assert state.tool_calls["tool-1"].status.value == "committed"
    assert len(state.tool_calls["tool-1"].approvals) == 1
    assert state.early == {} and state.anomalies == []
