"""Programs as ordinary ``async def`` code: the replay machinery behind ``services.sdk``.

A program written with the SDK is an ``async def program(ctx)`` that awaits
steps (``ctx.llm``, ``ctx.tool``, ``ctx.checkpoint``, ``ctx.fork``).
``SdkProgram`` adapts it to the ``Program`` protocol: on every call of
``next_action`` it runs the function from the start against the view's
results, as Temporal and DBOS replay a workflow:

- the coroutine is driven by hand (``coro.send``): no event loop, no real
  awaiting, nothing runs concurrently, so a run is a pure function of the view;
- step k is the k-th await: while the view holds a result for it, the await
  returns that result at once (a failed tool call raises ``ToolError``);
- the first await without a result is the program's next action; the
  coroutine is then closed (the next call of ``next_action`` starts again);
- returning from the function is ``Finish`` with the returned value.

Non-determinism is caught where it is cheap to catch: a replayed step whose
kind, tool, arguments or prompt differ from what the log recorded for that
step, a program that ends before the steps the log holds, and an await of
anything that is not a ``ctx`` step (``asyncio.sleep``, a network client) all
raise ``NonDeterminism`` or ``InvalidAction`` naming the step; the planner fails
the session with it. A step the log holds but has no result for yet (an LLM
call in flight, a tool call waiting for its verdict) is checked by the planner
itself (``services/planning.py``).

Forks work like ``os.fork``: ``await ctx.fork([args, ...])`` creates one branch
session per entry. A branch runs the same function from the start against its
parent's history; at the fork step its ``ctx.fork`` returns at once with
``outcome.branch`` (the branch's entry), so the code goes its own way from
there. In the parent the await returns, once every branch has ended, the merged
outputs (``outcome.results``: branch session id -> output).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Coroutine, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from services.programs.base import (
    Action,
    CallLLM,
    CallTool,
    Finish,
    Fork,
    InvalidAction,
    LLMResult,
    NonDeterminism,
    ProgramView,
    Prompt,
    Result,
    TakeCheckpoint,
    ToolResult,
)

FORK_KEY = "__fork__"
"""The key of a branch's arguments that says where it forked (hidden from ``ctx.args``)."""

ROLES = frozenset({"system", "user", "assistant", "tool"})
RESERVED_TOOLS = frozenset({"checkpoint", "merge"})
"""The tool names of the planner's own steps in a program's results: no tool may be called so."""

DEFAULT_MAX_TOKENS = 256


class ToolError(Exception):
    """A tool call the program awaited did not succeed: aborted by the decider, or failed."""

    def __init__(self, result: ToolResult) -> None:
        super().__init__(f"{result.tool} ({result.call_id}): {result.error}")
        self.result = result

    @property
    def aborted(self) -> bool:
        """The decider refused the call (it never ran)."""
        return (self.result.error or "").startswith("aborted by the decider")


class ForkFailed(Exception):
    """The branches of a fork could not be merged (they conflict); the message lists the conflicts."""


class MalformedToolCall(Exception):
    """A tool call of the model's that cannot be made: arguments that are not JSON or fail the tool's
    schema, or a tool that was not offered. ``call`` is the call as the model sent it (OpenAI's form)."""

    def __init__(self, call: Mapping[str, Any], error: str) -> None:
        super().__init__(error)
        self.call = dict(call)
        self.error = error


@dataclass(frozen=True)
class Reply:
    """What ``await ctx.llm(...)`` returns: the model's answer and its token counts."""

    text: str
    prompt_tokens: int
    output_tokens: int
    call_id: str
    tool_calls: tuple[dict[str, Any], ...] = ()
    """Tool calls the model asked for (OpenAI's ``tool_calls``, arguments as the raw string it sent);
    only a chat engine returns them. ``await ctx.run_tool_calls(reply)`` makes them."""
    tools: tuple[dict[str, Any], ...] = field(default=(), repr=False)
    """The tools the call offered the model (what ``run_tool_calls`` checks a call against)."""

    @property
    def message(self) -> dict[str, Any]:
        """The reply as a chat message, to append to the conversation."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.tool_calls:
            message["tool_calls"] = list(self.tool_calls)
        return message


@dataclass(frozen=True)
class ForkOutcome:
    """What ``await ctx.fork(...)`` returns: in a branch, its entry; in the parent, the merged outputs."""

    branch: dict[str, Any] | None = None
    index: int | None = None
    results: dict[str, Any] = field(default_factory=dict)
    """Branch session id -> its final output (``{"failed": reason}`` for a failed branch); parent only."""

    @property
    def is_branch(self) -> bool:
        return self.branch is not None


# ------------------------------------------------------------------------- steps


class _Step:
    """One awaitable step. Awaiting it yields it to the driver, which sends back its value."""

    kind = ""

    def __init__(self, ctx: Context, action: Action) -> None:
        self.ctx = ctx
        self.action = action

    def __await__(self) -> Generator[_Step, Any, Any]:
        value = yield self
        return value

    def replay(self, result: Result, step: int) -> Any:
        """The value of the await, given the step's recorded result (raises on a mismatch)."""
        raise NotImplementedError

    def describe(self) -> str:
        return self.kind


class _LLMStep(_Step):
    kind = "an LLM call"

    def replay(self, result: Result, step: int) -> Any:
        if not isinstance(result, LLMResult):
            raise _mismatch(step, result, self.describe())
        assert isinstance(self.action, CallLLM)
        if result.prompt_digest and result.prompt_digest != self.action.prompt.digest():
            raise NonDeterminism(
                f"step {step}: the log holds LLM call {result.call_id} with another prompt than the one the "
                f"program now sends (prompt digest {result.prompt_digest[:12]} != {self.action.prompt.digest()[:12]})"
            )
        calls = tuple(call.to_openai() for call in result.tool_calls)
        return Reply(
            result.output_text, result.prompt_tokens, result.output_tokens, result.call_id, calls, self.action.tools
        )


class _ToolStep(_Step):
    kind = "a tool call"

    def describe(self) -> str:
        assert isinstance(self.action, CallTool)
        return f"tool call {self.action.tool}({json.dumps(self.action.arguments, sort_keys=True)})"

    def replay(self, result: Result, step: int) -> Any:
        assert isinstance(self.action, CallTool)
        if not isinstance(result, ToolResult) or result.tool in RESERVED_TOOLS or result.tool != self.action.tool:
            raise _mismatch(step, result, self.describe())
        if result.arguments is not None and result.arguments != self.action.arguments:
            raise NonDeterminism(
                f"step {step}: the log holds tool call {result.call_id} ({result.tool}) with arguments "
                f"{json.dumps(result.arguments, sort_keys=True)}, the program now asks for "
                f"{json.dumps(self.action.arguments, sort_keys=True)}"
            )
        if not result.ok:
            raise ToolError(result)
        return result.result


class _CheckpointStep(_Step):
    kind = "a checkpoint"

    def replay(self, result: Result, step: int) -> Any:
        if not isinstance(result, ToolResult) or result.tool != "checkpoint":
            raise _mismatch(step, result, self.describe())
        return str((result.result or {}).get("checkpoint_id", result.call_id))


class _ForkStep(_Step):
    kind = "a fork"

    def replay(self, result: Result, step: int) -> Any:
        if not isinstance(result, ToolResult) or result.tool != "merge":
            raise _mismatch(step, result, self.describe())
        if not result.ok:
            raise ForkFailed(f"step {step}: the branches of {result.call_id} conflict: {result.error}")
        return ForkOutcome(results=dict(result.result or {}))


def _describe(result: Result) -> str:
    if isinstance(result, LLMResult):
        return f"LLM call {result.call_id}"
    if result.tool == "checkpoint":
        return f"checkpoint {result.call_id}"
    if result.tool == "merge":
        return f"fork {result.call_id}"
    return f"tool call {result.call_id} ({result.tool})"


def _mismatch(step: int, result: Result, wanted: str) -> NonDeterminism:
    return NonDeterminism(f"step {step}: the log holds {_describe(result)} but the program now asks for {wanted}")


# ----------------------------------------------------------------------- context


class Context:
    """What a program sees: its arguments, its session, and the steps it may await."""

    def __init__(self, view: ProgramView) -> None:
        self._view = view
        args = dict(view.args)
        self._forks: tuple[dict[str, Any], ...] = tuple(args.pop(FORK_KEY, []))
        """Every fork this session is a branch of, outermost first (a branch's arguments carry them)."""
        self._args = args
        self._step = 0
        self._num_forks_replayed = 0

    @property
    def args(self) -> dict[str, Any]:
        """The session's arguments (a copy: changing it changes nothing)."""
        copy: dict[str, Any] = _json_copy(self._args, "the arguments")
        return copy

    @property
    def session_id(self) -> str:
        return self._view.session_id

    @property
    def merged(self) -> tuple[dict[str, Any], ...]:
        """Results an operator merged into this session (``logctl merge``), oldest first."""
        return self._view.merged

    @property
    def step(self) -> int:
        """The index of the next step the program awaits."""
        return self._step

    def llm(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] = (),
        max_tokens: int = DEFAULT_MAX_TOKENS,
        tool_choice: str | Mapping[str, Any] | None = None,
        size: str | None = None,
    ) -> _Step:
        """Ask the model: ``messages`` are OpenAI chat messages, ``tools`` OpenAI function specs,
        ``tool_choice`` OpenAI's (``"none"``, ``"auto"``, ``"required"`` or
        ``{"type": "function", "function": {"name": ...}}``; None: the engine's default).
        ``size``: the model size this step needs (``"small"`` or ``"large"``), for a stack with engines of
        both sizes (``services.routing.choose_size``: an operator's pin and what the log learned weigh in).

        Returns a ``Reply``. A chat engine is sent the messages and tools as they are; a completions
        engine the messages rendered into one text prompt (``render_messages``). Either way the
        rendering's digest is what the log checks on replay, and the engine counts the tokens.
        """
        normalized = tuple(_message(m, i) for i, m in enumerate(messages))
        tool_specs = tuple(_json_copy(t, "a tool spec") for t in tools)
        choice = None if tool_choice is None else _json_copy(tool_choice, "tool_choice")
        prompt = Prompt(text=render_messages(normalized, tool_specs, choice))
        if size not in (None, "small", "large"):
            raise ValueError(f"size must be 'small', 'large' or None, got {size!r}")
        return _LLMStep(self, CallLLM(prompt, int(max_tokens), normalized, tool_specs, choice, size))

    def tool(self, name: str, args: Mapping[str, Any] | None = None, *, resource: str | None = None) -> _Step:
        """Call a tool; returns its result, raises ``ToolError`` when it was aborted or failed.

        ``resource`` names what the call changes (merges report two branches that change the same one).
        """
        if not isinstance(name, str) or not name or name in RESERVED_TOOLS:
            raise InvalidAction(f"step {self._step}: {name!r} is not a tool name")
        arguments = _json_copy(dict(args or {}), f"the arguments of {name}")
        return _ToolStep(self, CallTool(name, arguments, resource))

    async def run_tool_calls(self, reply: Reply, *, on_error: str = "tell") -> list[dict[str, Any]]:
        """Make the tool calls of ``reply``, in order; returns the ``tool`` messages that answer them
        (append them after ``reply.message`` for the next ``ctx.llm``).

        Each well-formed call is a ``ctx.tool`` step: proposed, voted on, executed; its message holds
        the result as JSON. A call that cannot be made (``MalformedToolCall``: arguments that are not
        JSON or fail the schema the call offered, a tool that was not offered) makes no step. With
        ``on_error="tell"`` (the default) a malformed call, and a call the decider refused or that
        failed (``ToolError``), is answered with ``{"error": ...}``, so the model is told on its next
        call; with ``on_error="raise"`` the first of them raises instead, for the program to handle.
        The raw calls are in the log (``LLMCallCompleted.tool_calls_json``), so this replays the same.
        """
        if on_error not in ("tell", "raise"):
            raise InvalidAction(f"step {self._step}: on_error must be 'tell' or 'raise', got {on_error!r}")
        messages: list[dict[str, Any]] = []
        for index, call in enumerate(reply.tool_calls):
            function = call.get("function") or {}
            name = str(function.get("name") or "")
            message = {"role": "tool", "tool_call_id": str(call.get("id") or f"{reply.call_id}-{index}"), "name": name}
            try:
                arguments = _checked_arguments(name, function.get("arguments"), reply.tools)
            except MalformedToolCall as e:
                if on_error == "raise":
                    raise MalformedToolCall(call, e.error) from None
                messages.append({**message, "content": json.dumps({"error": e.error})})
                continue
            try:
                result = await self.tool(name, arguments)
            except ToolError as e:
                if on_error == "raise":
                    raise
                messages.append({**message, "content": json.dumps({"error": e.result.error})})
                continue
            messages.append({**message, "content": json.dumps(result, sort_keys=True)})
        return messages

    def checkpoint(self) -> _Step:
        """Take a checkpoint here (a cut a session can be restored or forked from); returns its id."""
        return _CheckpointStep(self, TakeCheckpoint())

    def fork(self, branches: Sequence[Mapping[str, Any]]) -> _Step:
        """Fork into one branch per entry; see the module docstring (``ForkOutcome``)."""
        entries = tuple(_json_copy(dict(b), "a fork branch") for b in branches)
        mark = {"step": self._step, "branches": len(entries)}
        # Each branch carries every fork it descends from: a nested branch replays them all.
        branch_args = tuple(
            {**self._args, FORK_KEY: [*self._forks, {**mark, "index": i, "args": entry}]}
            for i, entry in enumerate(entries)
        )
        return _ForkStep(self, Fork(branch_args))

    def _branch_at(self, step: int) -> dict[str, Any] | None:
        """This session's branch entry if the next fork it descends from was made at ``step``.

        Marks are used once each, in order: a branch that forks again at its first own step
        (the same index) makes a new fork there.
        """
        if self._num_forks_replayed < len(self._forks):
            mark = self._forks[self._num_forks_replayed]
            if mark.get("step") == step:
                self._num_forks_replayed += 1
                return mark
        return None


def _offered(tools: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """Tool name -> its argument schema, for OpenAI specs (``{"type": "function", "function": {...}}``)
    and bare ones (``{"name", "parameters"}``)."""
    offered: dict[str, Mapping[str, Any]] = {}
    for spec in tools:
        function = spec.get("function", spec)
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            parameters = function.get("parameters")
            offered[function["name"]] = parameters if isinstance(parameters, Mapping) else {"type": "object"}
    return offered


def _checked_arguments(name: str, raw: Any, tools: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The arguments of a model's tool call, or ``MalformedToolCall`` saying what is wrong with it."""
    offered = _offered(tools)
    if name not in offered:
        known = ", ".join(sorted(offered)) or "none"
        raise MalformedToolCall({}, f"unknown tool {name!r}; the tools offered are: {known}")
    try:
        arguments = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError as e:
        raise MalformedToolCall({}, f"the arguments of {name} are not JSON ({e}): {str(raw)[:200]}") from None
    if not isinstance(arguments, dict):
        raise MalformedToolCall({}, f"the arguments of {name} must be a JSON object, got {json.dumps(arguments)[:200]}")
    try:
        jsonschema.validate(arguments, dict(offered[name]))
    except jsonschema.ValidationError as e:
        raise MalformedToolCall({}, f"the arguments of {name} do not match its schema: {e.message}") from None
    except jsonschema.SchemaError as e:
        raise MalformedToolCall({}, f"the schema offered for {name} is not a JSON schema: {e.message}") from None
    return arguments


def _message(message: Mapping[str, Any], index: int) -> dict[str, Any]:
    if not isinstance(message, Mapping) or message.get("role") not in ROLES:
        raise InvalidAction(f"message {index} must be a mapping with a role in {sorted(ROLES)}: {message!r}")
    copy: dict[str, Any] = _json_copy(dict(message), f"message {index}")
    return copy


def _json_copy(value: Any, what: str) -> Any:
    """A deep copy through JSON: what the log can hold, and nothing the program can change later."""
    try:
        return json.loads(json.dumps(value, sort_keys=True))
    except (TypeError, ValueError) as e:
        raise InvalidAction(f"{what} must be JSON: {e}") from e


def render_messages(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] = (),
    tool_choice: str | Mapping[str, Any] | None = None,
) -> str:
    """The text prompt a completions engine gets for chat ``messages`` (stable: it is digested).

    One block per message, ``<|role|>`` then its content (JSON for anything but a string),
    tool calls of assistant messages as JSON; the tools first (then the tool choice, when one
    is given); ``<|assistant|>`` last.
    """
    lines: list[str] = []
    if tools:
        lines.append("<|tools|>")
        lines.extend(json.dumps(t, sort_keys=True) for t in tools)
    if tool_choice is not None:
        lines.append("<|tool_choice|>")
        lines.append(json.dumps(tool_choice, sort_keys=True))
    for message in messages:
        role = str(message["role"])
        if role == "tool" and message.get("name"):
            role = f"tool {message['name']}"
        lines.append(f"<|{role}|>")
        content = message.get("content")
        if content is not None:
            lines.append(content if isinstance(content, str) else json.dumps(content, sort_keys=True))
        if message.get("tool_calls"):
            lines.append(json.dumps(message["tool_calls"], sort_keys=True))
    lines.append("<|assistant|>")
    return "\n".join(lines)


# ------------------------------------------------------------------------ driver

ProgramFunction = Callable[[Context], Coroutine[Any, Any, Any]]


@dataclass(frozen=True)
class SdkProgram:
    """An ``async def program(ctx)`` as a ``Program``: ``next_action`` replays it (module docstring)."""

    name: str
    function: ProgramFunction
    description: str = ""

    def next_action(self, view: ProgramView) -> Action:
        ctx = Context(view)
        coro = self.function(ctx)
        if not inspect.iscoroutine(coro):
            raise InvalidAction(f"program {self.name} must be an async def (it returned {coro!r})")
        try:
            return _drive(self.name, ctx, coro, view.results)
        finally:
            coro.close()  # a suspended run is abandoned: the next view runs it from the start


def _drive(name: str, ctx: Context, coro: Coroutine[Any, Any, Any], results: Sequence[Result]) -> Action:
    send: tuple[bool, Any] = (False, None)  # (throw?, value)
    while True:
        try:
            awaited = coro.throw(send[1]) if send[0] else coro.send(send[1])
        except StopIteration as stop:
            if ctx.step < len(results):
                raise NonDeterminism(
                    f"step {ctx.step}: the log holds {_describe(results[ctx.step])} but the program now finishes"
                ) from None
            return Finish(_output(name, stop.value))
        if not isinstance(awaited, _Step) or awaited.ctx is not ctx:
            raise InvalidAction(
                f"step {ctx.step}: program {name} awaited {awaited!r}, which is not a step of its ctx; a program "
                "may await only ctx.llm, ctx.tool, ctx.checkpoint and ctx.fork (do I/O and waiting in a tool)"
            )
        step = ctx.step
        if isinstance(awaited, _ForkStep) and (mark := ctx._branch_at(step)) is not None:
            # This session is a branch of this very fork: the fork is its parent's step, not its own.
            send = (False, ForkOutcome(branch=dict(mark["args"]), index=int(mark["index"])))
            continue
        if step >= len(results):
            return awaited.action
        ctx._step += 1
        try:
            send = (False, awaited.replay(results[step], step))
        except (ToolError, ForkFailed) as e:
            send = (True, e)  # the program may catch it: it is the recorded outcome of the step


def _output(name: str, value: Any) -> dict[str, Any]:
    """The session's output: a returned dict as is, anything else as ``{"result": value}``."""
    output = value if isinstance(value, dict) else ({} if value is None else {"result": value})
    copy: dict[str, Any] = _json_copy(output, f"the output of program {name}")
    return copy
