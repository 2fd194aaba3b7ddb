"""A chat model's tool calls in an SDK program: ``await ctx.run_tool_calls(reply)``.

Well-formed calls become tool steps (proposed, voted on, executed) and their results ``tool``
messages; malformed ones (arguments not JSON or against the schema, a tool not offered) make
no step and are answered with the error, or raise for the program to handle; all of it replays
the same from the log. The world's model is the simulated engine's (``services.engine.chat``).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from schemas import events as ev
from schemas.events import EffectClass
from services.engine.chat import chat_reply, parse_chat_request
from services.planning import CallEngine
from services.programs import CallLLM, CallTool, LLMResult, ProgramView, ToolResult
from services.programs.base import ModelToolCall
from services.sdk import Context, MalformedToolCall, program
from services.session import SessionStatus
from services.tools import ToolSpec
from tests.unit.services.branch_world import World

pytestmark = pytest.mark.unit

LOOKUP_SCHEMA = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": LOOKUP_SCHEMA}}


@program(name="caller")
async def caller(ctx: Context) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": ctx.args["goal"]}]
    for _ in range(4):
        reply = await ctx.llm(messages=messages, tools=[LOOKUP])
        messages.append(reply.message)
        if not reply.tool_calls:
            return {"answer": reply.text, "messages": messages}
        messages.extend(await ctx.run_tool_calls(reply))
    return {"gave_up": True}


@program(name="strict")
async def strict(ctx: Context) -> dict[str, Any]:
    reply = await ctx.llm(messages=[{"role": "user", "content": ctx.args["goal"]}], tools=[LOOKUP])
    try:
        await ctx.run_tool_calls(reply, on_error="raise")
    except MalformedToolCall as e:
        return {"malformed": e.error, "call": e.call["function"]["name"]}
    return {"ok": True}


def _view(*results: Any) -> ProgramView:
    return ProgramView("s", {"goal": "find"}, tuple(results))


def _llm(call_id: str, action: Any, *calls: ModelToolCall) -> LLMResult:
    return LLMResult(call_id, f"s/{call_id}", "", 5, 1, action.prompt.digest(), calls)


def test_each_well_formed_call_is_a_step_and_malformed_ones_are_told() -> None:
    first = caller.next_action(_view())
    assert isinstance(first, CallLLM) and first.tools == (LOOKUP,)
    calls = (
        ModelToolCall("c1", "lookup", '{"q": "x"}'),
        ModelToolCall("c2", "nope", "{}"),
        ModelToolCall("c3", "lookup", '{"q": "x"'),
        ModelToolCall("c4", "lookup", '{"q": 1}'),
        ModelToolCall("c5", "lookup", "[1]"),
        ModelToolCall("c6", "lookup", '{"q": "y"}'),
    )
    llm = _llm("llm-0", first, *calls)
    assert caller.next_action(_view(llm)) == CallTool("lookup", {"q": "x"})
    done = ToolResult("tool-1", "lookup", True, {"found": 1}, 3, None, {"q": "x"})
    assert caller.next_action(_view(llm, done)) == CallTool("lookup", {"q": "y"})
    refused = ToolResult("tool-2", "lookup", False, None, 0, "aborted by the decider: no", {"q": "y"})
    second = caller.next_action(_view(llm, done, refused))
    assert isinstance(second, CallLLM)
    assistant, *answers = second.messages[1:]
    assert assistant == {"role": "assistant", "content": "", "tool_calls": [c.to_openai() for c in calls]}
    contents = {a["tool_call_id"]: json.loads(a["content"]) for a in answers}
    assert [a["role"] for a in answers] == ["tool"] * 6
    assert contents["c1"] == {"found": 1}
    assert contents["c2"] == {"error": "unknown tool 'nope'; the tools offered are: lookup"}
    assert contents["c3"]["error"].startswith("the arguments of lookup are not JSON")
    assert contents["c4"]["error"] == "the arguments of lookup do not match its schema: 1 is not of type 'string'"
    assert contents["c5"]["error"] == "the arguments of lookup must be a JSON object, got [1]"
    assert contents["c6"] == {"error": "aborted by the decider: no"}


def test_on_error_raise_lets_the_program_handle_a_malformed_call() -> None:
    first = strict.next_action(_view())
    assert isinstance(first, CallLLM)
    llm = _llm("llm-0", first, ModelToolCall("c1", "lookup", "{"))
    finish = strict.next_action(_view(llm))
    assert getattr(finish, "output", None) == {
        "malformed": "the arguments of lookup are not JSON (Expecting property name enclosed in double quotes: "
        "line 1 column 2 (char 1)): {",
        "call": "lookup",
    }


def _sim_model(move: CallEngine) -> tuple[str, tuple[ModelToolCall, ...]]:
    """The simulated engine's answer to the move's messages and tools."""
    request = parse_chat_request({"model": "sim", "messages": list(move.messages), "tools": list(move.tools)})
    reply = chat_reply(request, request_id=move.request_id, num_prompt_tokens=1)
    return reply.content or "", tuple(ModelToolCall(c.id, c.name, c.arguments) for c in reply.tool_calls)


def _world() -> World:
    world = World(chat=_sim_model)
    world.programs["caller"] = caller
    world.tools["lookup"] = ToolSpec("lookup", EffectClass.IDEMPOTENT, "look up", LOOKUP_SCHEMA)
    world.results["lookup"] = {"found": 42}
    return world


@pytest.mark.parametrize("goal", ["find a flight", "find #malformed-json", "find #malformed-tool", "#malformed-args"])
def test_an_agent_loop_on_the_simulated_model_runs_to_its_answer(goal: str) -> None:
    world = _world()
    world.append(
        "s", ev.SessionRequested(program="caller", args_json=json.dumps({"goal": goal}), author="t"), "operator"
    )
    world.settle()
    state = world.state("s")
    assert state.status is SessionStatus.FINISHED, state.failure
    output = json.loads(state.output_json or "")
    assert output["answer"].startswith("simulated answer")
    recorded = ModelToolCall.list_from_json(state.llm_calls["llm-0"].completed.tool_calls_json)  # type: ignore[union-attr]
    [tool_message] = [m for m in output["messages"] if m["role"] == "tool"]
    assert tool_message["tool_call_id"] == recorded[0].id
    if "#malformed" in goal:  # no step: the model is told, and answers
        assert [s.call_id for s in state.steps] == ["llm-0", "llm-1"]
        assert set(json.loads(tool_message["content"])) == {"error"}
    else:
        assert [s.call_id for s in state.steps] == ["llm-0", "tool-1", "llm-2"]
        assert json.loads(tool_message["content"]) == {"found": 42}
        assert world.executions == {("s", "tool-1"): 1}
        assert json.loads(state.tool_calls["tool-1"].proposed.arguments_json) == json.loads(recorded[0].arguments)


def test_the_tool_choice_travels_with_the_call_and_is_part_of_its_digest() -> None:
    @program(name="chooser")
    async def chooser(ctx: Context) -> None:
        await ctx.llm(messages=[{"role": "user", "content": "x"}], tools=[LOOKUP], tool_choice=ctx.args.get("choice"))

    def action(choice: Any) -> CallLLM:
        step = chooser.next_action(ProgramView("s", {"choice": choice}))
        assert isinstance(step, CallLLM)
        return step

    named = {"type": "function", "function": {"name": "lookup"}}
    assert action(named).tool_choice == named and action(None).tool_choice is None
    digests = {action(c).prompt.digest() for c in (None, "required", named)}
    assert len(digests) == 3  # a program that changes its tool choice on replay is caught
