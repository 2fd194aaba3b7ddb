"""agentlog's SDK: write an agent, its tools and its approval rules as ordinary Python.

    from services.sdk import program, tool, voter, approve, reject, hold

    @program(name="travel")
    async def travel(ctx):
        reply = await ctx.llm(messages=[{"role": "user", "content": ctx.args["goal"]}])
        flights = await ctx.tool("search_flights", {"to": "LIS"})
        await ctx.checkpoint()
        return {"plan": reply.text, "flights": flights}

    @tool(name="search_flights", effect="idempotent", schema={"type": "object", ...})
    def search_flights(args, ctx):
        return [...]

    @voter(name="budget")
    def budget(proposal):
        return reject("too expensive") if proposal.arguments.get("price", 0) > 500 else approve("within budget")

A program is replayed from the log on every step (docs/sdk.md): it must be a
deterministic function of its arguments and the results its awaits return.
Tools and voters run in the executor and the decider; every process of a stack
loads the same modules (``--plugins`` / ``AGENTLOG_PLUGINS``, or entry points
``agentlog.programs``, ``agentlog.tools``, ``agentlog.voters``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, overload

from schemas.events import EffectClass
from services.programs.base import NonDeterminism
from services.programs.sdk import (
    Context,
    ForkFailed,
    ForkOutcome,
    MalformedToolCall,
    ProgramFunction,
    Reply,
    SdkProgram,
    ToolError,
)
from services.registry import OutcomeUnknown, Tool, ToolFunction, ToolOutput, ToolUnavailable, effect_class
from services.tools import ToolSpec
from services.voters import Ballot, FunctionVoter, Proposal, VoterFunction, abstain, approve, hold, reject

__all__ = [
    "Ballot",
    "Context",
    "EffectClass",
    "ForkFailed",
    "ForkOutcome",
    "MalformedToolCall",
    "NonDeterminism",
    "OutcomeUnknown",
    "Proposal",
    "Reply",
    "Tool",
    "ToolError",
    "ToolOutput",
    "ToolUnavailable",
    "abstain",
    "approve",
    "hold",
    "program",
    "reject",
    "tool",
    "voter",
]


@overload
def program(function: ProgramFunction, /) -> SdkProgram: ...


@overload
def program(*, name: str | None = None, description: str = "") -> Callable[[ProgramFunction], SdkProgram]: ...


def program(
    function: ProgramFunction | None = None, /, *, name: str | None = None, description: str = ""
) -> SdkProgram | Callable[[ProgramFunction], SdkProgram]:
    """Make ``async def f(ctx)`` a program (named ``name``, else the function's name)."""

    def wrap(fn: ProgramFunction) -> SdkProgram:
        return SdkProgram(name or fn.__name__, fn, description or (fn.__doc__ or "").strip())

    return wrap(function) if function is not None else wrap


def tool(
    *,
    name: str | None = None,
    effect: EffectClass | str,
    schema: dict[str, Any] | None = None,
    description: str = "",
    compensation: str | Tool | None = None,
) -> Callable[[ToolFunction], Tool]:
    """Make ``fn(args, ctx)`` (sync or async) a tool.

    ``effect``: ``pure``, ``idempotent``, ``compensatable`` (give ``compensation``: the tool that
    undoes it, called with the same arguments) or ``irreversible`` (never run twice; an operator
    approves each call). ``schema``: the JSON schema of the arguments (the decider checks every
    proposal against it). ``ctx`` has ``session_id``, ``call_id``, ``idempotency_key`` (the same
    on every attempt of one call) and ``sandbox``. Return a JSON value (or ``ToolOutput`` to say
    how many tokens it is); raise to fail the call: ``ToolUnavailable`` when it did nothing
    because something it needs is down (the executor tries again with backoff),
    ``OutcomeUnknown`` when it cannot tell whether its effect happened (an irreversible call then
    waits, in doubt, for an operator), any other exception fails it.
    """
    effect_value = effect_class(effect)
    comp = compensation.name if isinstance(compensation, Tool) else compensation

    def wrap(fn: ToolFunction) -> Tool:
        spec = ToolSpec(
            name or fn.__name__,
            effect_value,
            description or (fn.__doc__ or "").strip(),
            schema if schema is not None else {"type": "object"},
            comp,
        )
        return Tool(spec, fn)

    return wrap


def voter(*, name: str | None = None, description: str = "") -> Callable[[VoterFunction], FunctionVoter]:
    """Make ``fn(proposal)`` a voter: it returns ``approve(reason)``, ``reject(reason)``,
    ``hold(reason)`` or ``abstain(reason)``. ``proposal`` has ``tool``, ``arguments``, ``goal``,
    ``history`` (the session's earlier steps) and ``session`` (its whole folded state)."""

    def wrap(fn: VoterFunction) -> FunctionVoter:
        return FunctionVoter(name or fn.__name__, fn, description or (fn.__doc__ or "").strip())

    return wrap
