"""The SDK's replay machinery (services/programs/sdk.py) on the in-memory fold.

An ``async def`` program runs in the pure world of ``branch_world`` (the
planner's moves, a decider, an executor): it finishes with what it returns,
each await becomes one step with the derived call ids, a replay never asks for
a recorded step again, and a program that changes its mind on replay fails its
session with ``NonDeterminism`` naming the step.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from schemas import events as ev
from schemas.events import EffectClass
from services.planning import FailSession, next_move
from services.programs import CallLLM, CallTool, Finish, Fork, LLMResult, ProgramView, TakeCheckpoint, ToolResult
from services.programs.base import Prompt
from services.programs.sdk import FORK_KEY, render_messages
from services.sdk import (
    Context,
    NonDeterminism,
    ToolError,
    program,
)
from services.session import SessionStatus
from services.tools import TOOLS, ToolSpec
from tests.unit.services.branch_world import World

LOOKUP = ToolSpec("lookup", EffectClass.IDEMPOTENT, "look something up", {"type": "object"})
PAY = ToolSpec("pay", EffectClass.IRREVERSIBLE, "pay", {"type": "object"})


def world_with(*programs: Any) -> World:
    world = World()
    for p in programs:
        world.programs[p.name] = p
    world.tools.update({"lookup": LOOKUP, "pay": PAY})
    world.results["lookup"] = {"price": 120}
    return world


def request(world: World, session: str, name: str, args: dict[str, Any]) -> None:
    world.append(session, ev.SessionRequested(program=name, args_json=json.dumps(args), author="t"), "operator")


@program(name="agent")
async def agent(ctx: Context) -> dict[str, Any]:
    messages = [{"role": "system", "content": "You plan trips."}, {"role": "user", "content": ctx.args["goal"]}]
    reply = await ctx.llm(messages=messages, tools=[{"type": "function", "function": {"name": "lookup"}}])
    messages.append(reply.message)
    found = await ctx.tool("lookup", {"q": ctx.args["goal"]})
    messages.append({"role": "tool", "name": "lookup", "content": json.dumps(found)})
    checkpoint = await ctx.checkpoint()
    paid = await ctx.tool("pay", {"amount": found["price"]})
    final = await ctx.llm(messages=messages, max_tokens=16)
    return {"checkpoint": checkpoint, "paid": paid, "answer": final.text, "step": ctx.step}


def test_an_async_program_runs_to_its_return_value_one_step_per_await() -> None:
    world = world_with(agent)
    request(world, "s", "agent", {"goal": "Lisbon"})
    world.settle()
    state = world.state("s")
    assert state.status is SessionStatus.FINISHED, state.failure
    assert json.loads(state.output_json or "") == {
        "checkpoint": "ckpt-2",
        "paid": {"ok": True},
        "answer": "ok",
        "step": 5,
    }
    assert [s.call_id for s in state.steps] == ["llm-0", "tool-1", "ckpt-2", "tool-3", "llm-4"]
    assert world.executions == {("s", "tool-1"): 1, ("s", "tool-3"): 1}
    started = [e for e in world.events["s"] if isinstance(e.envelope.body, ev.LLMCallStarted)]
    assert len(started) == 2  # each LLM call asked for once: replays answered from the log


def test_replay_returns_recorded_results_and_the_first_missing_step_is_the_action() -> None:
    view = ProgramView("s", {"goal": "Lisbon"})
    first = agent.next_action(view)
    assert isinstance(first, CallLLM)
    assert first.messages[1] == {"role": "user", "content": "Lisbon"}
    assert first.prompt.text == render_messages(first.messages, first.tools)
    llm = LLMResult("llm-0", "s/llm-0", "go", 10, 2, first.prompt.digest())
    second = agent.next_action(ProgramView("s", {"goal": "Lisbon"}, (llm,)))
    assert second == CallTool("lookup", {"q": "Lisbon"})
    tool = ToolResult("tool-1", "lookup", True, {"price": 7}, 3, None, {"q": "Lisbon"})
    assert isinstance(agent.next_action(ProgramView("s", {"goal": "Lisbon"}, (llm, tool))), TakeCheckpoint)
    ckpt = ToolResult("ckpt-2", "checkpoint", True, {"checkpoint_id": "ckpt-2"}, 16)
    assert agent.next_action(ProgramView("s", {"goal": "Lisbon"}, (llm, tool, ckpt))) == CallTool("pay", {"amount": 7})


def test_the_prompt_is_a_stable_function_of_the_messages() -> None:
    a = agent.next_action(ProgramView("s", {"goal": "Lisbon"}))
    b = agent.next_action(ProgramView("other", {"goal": "Lisbon"}))
    assert isinstance(a, CallLLM) and isinstance(b, CallLLM)
    assert a.prompt.digest() == b.prompt.digest()
    text = render_messages([{"role": "user", "content": "hi"}, {"role": "tool", "name": "t", "content": {"x": 1}}])
    assert text == '<|user|>\nhi\n<|tool t|>\n{"x": 1}\n<|assistant|>'


# ------------------------------------------------------------------- non-determinism

CHOICE: dict[str, Any] = {}


@program(name="fickle")
async def fickle(ctx: Context) -> dict[str, Any]:
    """Reads a global on replay: exactly what a program must not do."""
    await ctx.llm(messages=[{"role": "user", "content": CHOICE.get("prompt", "hello")}])
    await ctx.tool(CHOICE.get("tool", "lookup"), CHOICE.get("args", {"q": 1}))
    if CHOICE.get("stop"):
        return {}
    await ctx.llm(messages=[{"role": "user", "content": "again"}])
    return {"done": True}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tool": "pay"}, "step 1: the log holds tool call tool-1 (lookup) but the program now asks for tool call pay"),
        ({"args": {"q": 2}}, 'step 1: the log holds tool call tool-1 (lookup) with arguments {"q": 1}'),
        ({"prompt": "bye"}, "step 0: the log holds LLM call llm-0 with another prompt"),
        ({"stop": True}, "step 2: the log holds LLM call llm-2 but the program now finishes"),
    ],
)
def test_a_program_that_changes_its_mind_on_replay_fails_with_nondeterminism(
    change: dict[str, Any], message: str
) -> None:
    world = world_with(fickle)
    request(world, "s", "fickle", {})
    CHOICE.clear()
    for _ in range(40):  # up to the last LLM call: every earlier step is recorded
        world.decider("s")
        world.executor("s")
        if "llm-2" in world.state("s").llm_calls:
            break
        world.planner("s")
    CHOICE.update(change)
    try:
        move = next_move(world.state("s"), fickle, tools=world.tools)
    finally:
        CHOICE.clear()
    assert isinstance(move, FailSession)
    assert move.error_type == "NonDeterminism"
    assert move.reason.startswith(message), move.reason


def test_a_pending_step_that_changes_fails_as_the_planner_always_did() -> None:
    world = world_with(fickle)
    request(world, "s", "fickle", {})
    world.planner("s")  # SessionStarted
    world.planner("s", crash_in_llm=True)  # llm-0 started, no output: pending
    CHOICE["prompt"] = "bye"
    try:
        move = next_move(world.state("s"), fickle, tools=world.tools)
    finally:
        CHOICE.clear()
    assert isinstance(move, FailSession) and move.error_type == "NonDeterminism"
    assert move.reason.startswith("step 0: the log holds LLM call llm-0")


def test_awaiting_anything_but_a_ctx_step_fails_the_session_with_a_clear_error() -> None:
    import asyncio

    @program(name="sleepy")
    async def sleepy(ctx: Context) -> None:
        await asyncio.sleep(0)

    move = next_move(_requested_and_started("sleepy", sleepy), sleepy)
    assert isinstance(move, FailSession) and move.error_type == "ProgramError"
    assert "awaited None, which is not a step of its ctx" in move.reason


def test_a_plain_function_is_not_a_program() -> None:
    @program(name="sync")
    def sync(ctx: Context) -> dict[str, Any]:  # type: ignore[misc]
        return {}

    with pytest.raises(Exception, match="must be an async def"):
        sync.next_action(ProgramView("s", {}))


def _requested_and_started(name: str, prog: Any) -> Any:
    world = world_with(prog)
    request(world, "s", name, {})
    world.planner("s")
    return world.state("s")


# ------------------------------------------------------------------- failures, forks


def test_an_aborted_tool_call_raises_tool_error_which_the_program_may_catch() -> None:
    @program(name="careful")
    async def careful(ctx: Context) -> dict[str, Any]:
        try:
            await ctx.tool("pay", {"amount": 1})
        except ToolError as e:
            return {"aborted": e.aborted, "error": e.result.error}
        return {"aborted": False}

    world = world_with(careful)
    world.rejected.add("pay")
    request(world, "s", "careful", {})
    world.settle()
    state = world.state("s")
    assert json.loads(state.output_json or "") == {"aborted": True, "error": "aborted by the decider: refused"}
    assert not world.executions


@program(name="explorer")
async def explorer(ctx: Context) -> dict[str, Any]:
    await ctx.llm(messages=[{"role": "user", "content": "where to?"}])
    outcome = await ctx.fork([{"city": "Lisbon"}, {"city": "Porto"}])
    if outcome.is_branch:
        assert outcome.branch is not None
        price = await ctx.tool("lookup", {"city": outcome.branch["city"]})
        return {"city": outcome.branch["city"], "index": outcome.index, "price": price["price"]}
    cheapest = min(outcome.results.values(), key=lambda r: r["price"])
    return {"branches": sorted(outcome.results), "chosen": cheapest["city"], "args": ctx.args}


def test_a_fork_runs_each_branch_from_the_fork_point_and_returns_their_outputs() -> None:
    world = world_with(explorer)
    request(world, "p", "explorer", {"budget": 3})
    world.settle()
    parent = world.state("p")
    assert parent.status is SessionStatus.FINISHED, parent.failure
    output = json.loads(parent.output_json or "")
    assert output["branches"] == ["p.fork-1.0", "p.fork-1.1"]
    assert output["chosen"] == "Lisbon"
    assert output["args"] == {"budget": 3}  # the fork marks are not the program's arguments
    for index, city in enumerate(["Lisbon", "Porto"]):
        branch = world.state(f"p.fork-1.{index}")
        assert branch.status is SessionStatus.FINISHED, branch.failure
        assert json.loads(branch.output_json or "") == {"city": city, "index": index, "price": 120}
        assert branch.args[FORK_KEY][0]["args"] == {"city": city}
        own_llm = [e for e in world.events[f"p.fork-1.{index}"] if isinstance(e.envelope.body, ev.LLMCallStarted)]
        assert not own_llm  # the branch replays its parent's LLM call, never asks for it again
    assert sum(isinstance(e.envelope.body, ev.LLMCallStarted) for e in world.events["p"]) == 1


def test_a_fork_step_asks_for_a_fork_with_branch_arguments_that_carry_the_fork_point() -> None:
    llm = LLMResult("llm-0", "p/llm-0", "ok", 1, 1)
    action = explorer.next_action(ProgramView("p", {"budget": 3}, (llm,)))
    assert isinstance(action, Fork)
    assert action.branches[1] == {
        "budget": 3,
        FORK_KEY: [{"step": 1, "branches": 2, "index": 1, "args": {"city": "Porto"}}],
    }
    branch = explorer.next_action(ProgramView("p.fork-1.1", action.branches[1], (llm,)))
    assert branch == CallTool("lookup", {"city": "Porto"})


def test_a_branch_that_forks_again_at_its_first_own_step_makes_a_new_fork() -> None:
    @program(name="nested")
    async def nested(ctx: Context) -> dict[str, Any]:
        first = await ctx.fork([{"a": 1}])
        second = await ctx.fork([{"b": 2}])
        return {"first": first.branch, "second": second.branch}

    top = nested.next_action(ProgramView("p", {}))
    assert isinstance(top, Fork)
    inner = nested.next_action(ProgramView("p.fork-0.0", top.branches[0]))
    assert isinstance(inner, Fork)
    assert [m["step"] for m in inner.branches[0][FORK_KEY]] == [0, 0]
    leaf = nested.next_action(ProgramView("p.fork-0.0.fork-0.0", inner.branches[0]))
    assert leaf == Finish({"first": {"a": 1}, "second": {"b": 2}})


def test_the_output_is_the_returned_dict_or_wraps_any_other_value() -> None:
    @program(name="value")
    async def value(ctx: Context) -> int:
        return 42

    assert value.next_action(ProgramView("s", {})) == Finish({"result": 42})


def test_tool_arguments_must_be_json_and_tool_names_not_the_planners_own() -> None:
    @program(name="bad")
    async def bad(ctx: Context) -> None:
        await ctx.tool("merge", {})

    with pytest.raises(Exception, match="'merge' is not a tool name"):
        bad.next_action(ProgramView("s", {}))

    @program(name="bad_args")
    async def bad_args(ctx: Context) -> None:
        await ctx.tool("lookup", {"when": object()})

    with pytest.raises(Exception, match="the arguments of lookup must be JSON"):
        bad_args.next_action(ProgramView("s", {}))


def test_the_builtin_programs_keep_the_program_protocol() -> None:
    assert "lookup" not in TOOLS
    world = World()
    world.request("s", [{"llm": {"prompt_tokens": 8}}, {"tool": "echo", "arguments": {"text": "x"}}])
    world.settle()
    assert world.state("s").status is SessionStatus.FINISHED


def test_nondeterminism_is_raised_by_next_action_itself() -> None:
    tool = ToolResult("tool-0", "lookup", True, {}, 1, None, {"q": 1})
    with pytest.raises(NonDeterminism, match="step 0: the log holds tool call tool-0"):
        agent.next_action(ProgramView("s", {"goal": "x"}, (tool,)))


@program(name="sized")
async def sized(ctx: Context) -> str:
    cheap = await ctx.llm(messages=[{"role": "user", "content": "classify"}], size="small")
    return (await ctx.llm(messages=[{"role": "user", "content": cheap.text}])).text


def test_a_step_declares_its_model_size_without_changing_its_prompt() -> None:
    first = sized.next_action(ProgramView("s", {}))
    assert isinstance(first, CallLLM) and first.size == "small"
    llm = LLMResult("llm-0", "s/llm-0", "spam", 4, 1, first.prompt.digest())
    second = sized.next_action(ProgramView("s", {}, (llm,)))
    assert isinstance(second, CallLLM) and second.size is None
    # The size is not part of the prompt: the digest replay checks is the messages' alone.
    assert first.prompt.digest() == Prompt(text=render_messages(first.messages)).digest()


def test_a_size_other_than_small_or_large_fails_the_step() -> None:
    @program(name="huge")
    async def huge(ctx: Context) -> str:
        return (await ctx.llm(messages=[{"role": "user", "content": "x"}], size="huge")).text

    world = world_with(huge)
    request(world, "s", "huge", {})
    world.settle()
    state = world.state("s")
    assert state.status is SessionStatus.FAILED and "size must be" in (state.failure or "")
