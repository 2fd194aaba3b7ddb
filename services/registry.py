"""The registry of a stack's programs, tools and voters: built-ins and plugins, one way in.

Every process builds one ``Registry`` at start-up (``workers/plugins.py``): the
built-ins first, then the user's plugins, each through the same ``add_*``
call, which refuses what cannot work and says where it came from:

- a name registered twice (a plugin's ``echo`` beside the built-in one);
- a tool whose argument schema is not a valid JSON schema (Draft 2020-12);
- a compensatable tool without a compensation, or whose compensation is not a
  registered tool (checked by ``check`` once everything is in);
- a tool named like one of the planner's own steps (``checkpoint``, ``merge``).

The objects registered are plain values: ``Tool`` (a ``ToolSpec`` and the
function the executor runs), a program (anything with ``name`` and
``next_action``), and voter factories (a voter built from ``VoterSettings``,
because the built-in ones need the stack's tools or an engine).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from schemas.events import EffectClass
from services.programs.base import Program
from services.programs.sdk import RESERVED_TOOLS
from services.tools import ToolSpec
from services.voters import Voter, VoterFactory, VoterSettings

ToolFunction = Callable[..., Any]
"""``fn(args, ctx)``, sync or async; returns a JSON value or a ``ToolOutput``; raises to fail."""


class RegistryError(Exception):
    """A program, tool or voter that cannot be registered; the message names where it came from."""


@dataclass(frozen=True)
class ToolOutput:
    """A tool's result with the number of tokens it adds to the context (else estimated from its JSON)."""

    result: Any
    tokens: int


class ToolUnavailable(Exception):
    """Raised by a tool that did nothing because something it needs is unreachable (its
    database refuses connections, a service is restarting). The executor runs the call again
    with the same idempotency key, with backoff, for a bounded time (``--unavailable-retry-s``),
    whatever its effect class: nothing happened, so nothing can happen twice. Then the call
    fails, marked retryable. Raise it only when the request was surely not sent."""


class OutcomeUnknown(Exception):
    """Raised by a tool that cannot tell whether its effect happened (the connection was lost
    after the request was sent). A pure or idempotent call runs again; a compensatable or
    irreversible one goes in doubt (``ToolCallInDoubt``) for an operator, who checks the
    outside world and answers ``logctl approve --retry`` or ``--mark-done``: a failure here
    would tell the agent "not paid" about a payment that may have happened."""


@dataclass(frozen=True)
class Tool:
    """A tool: what the planner and the voters know of it (``spec``) and what the executor runs."""

    spec: ToolSpec
    function: ToolFunction

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def function_spec(self) -> dict[str, Any]:
        """The tool as OpenAI function calling offers it to a model (``ctx.llm(tools=[...])``)."""
        function: dict[str, Any] = {"name": self.spec.name, "parameters": self.spec.args_schema}
        if self.spec.description:
            function["description"] = self.spec.description
        return {"type": "function", "function": function}


@dataclass
class Registry:
    """Programs, tools and voters by name, and where each came from (``sources``)."""

    programs: dict[str, Program] = field(default_factory=dict)
    tools: dict[str, Tool] = field(default_factory=dict)
    voters: dict[str, VoterFactory] = field(default_factory=dict)
    sources: dict[tuple[str, str], str] = field(default_factory=dict)
    """(kind, name) -> the module (or ``agentlog``) that registered it."""

    @property
    def tool_specs(self) -> dict[str, ToolSpec]:
        return {name: tool.spec for name, tool in self.tools.items()}

    def _claim(self, kind: str, name: Any, source: str) -> None:
        if not isinstance(name, str) or not name:
            raise RegistryError(f"{source}: a {kind} needs a non-empty name (got {name!r})")
        if (kind, name) in self.sources:
            raise RegistryError(
                f"{source}: {kind} {name!r} is registered twice (already by {self.sources[(kind, name)]})"
            )
        self.sources[(kind, name)] = source

    def add_program(self, program: Program, source: str) -> None:
        if not callable(getattr(program, "next_action", None)):
            raise RegistryError(f"{source}: program {program!r} has no next_action")
        self._claim("program", getattr(program, "name", None), source)
        self.programs[program.name] = program

    def add_tool(self, tool: Tool, source: str) -> None:
        spec = tool.spec
        if spec.name in RESERVED_TOOLS:
            raise RegistryError(f"{source}: tool name {spec.name!r} is reserved for the planner's own steps")
        if not isinstance(spec.effect_class, EffectClass):
            raise RegistryError(f"{source}: tool {spec.name!r} has effect class {spec.effect_class!r}")
        if not callable(tool.function):
            raise RegistryError(f"{source}: tool {spec.name!r} has no function to run")
        try:
            jsonschema.Draft202012Validator.check_schema(spec.args_schema)
        except jsonschema.SchemaError as e:
            where = "/".join(str(p) for p in e.absolute_path) or "the schema"
            raise RegistryError(
                f"{source}: tool {spec.name!r} has an argument schema that is not a valid JSON schema "
                f"({where}: {e.message})"
            ) from None
        if spec.effect_class is EffectClass.COMPENSATABLE and not spec.compensation:
            raise RegistryError(f"{source}: compensatable tool {spec.name!r} names no compensation")
        self._claim("tool", spec.name, source)
        self.tools[spec.name] = tool

    def add_voter(self, name: str, factory: VoterFactory, source: str) -> None:
        if not callable(factory):
            raise RegistryError(f"{source}: voter {name!r} is not callable")
        self._claim("voter", name, source)
        self.voters[name] = factory

    def add(self, item: Any, source: str) -> str:
        """Register an SDK object (``Tool``, a voter, a program); returns its kind."""
        if isinstance(item, Tool):
            self.add_tool(item, source)
            return "tool"
        if callable(getattr(item, "vote", None)) and isinstance(getattr(item, "name", None), str):
            voter: Voter = item
            self.add_voter(voter.name, lambda _settings: voter, source)
            return "voter"
        if callable(getattr(item, "next_action", None)):
            self.add_program(item, source)
            return "program"
        raise RegistryError(f"{source}: {item!r} is not a program, a tool or a voter")

    def check(self) -> None:
        """What only the whole set can tell: every compensation names a registered tool."""
        for tool in self.tools.values():
            comp = tool.spec.compensation
            if comp is not None and comp not in self.tools:
                source = self.sources[("tool", tool.name)]
                raise RegistryError(f"{source}: tool {tool.name!r} names compensation {comp!r}, which is not a tool")

    def build_voters(self, names: list[str], settings: VoterSettings) -> list[Voter]:
        """The voters ``names`` (each once, in that order), built with ``settings``."""
        unknown = [n for n in names if n not in self.voters]
        if unknown:
            raise RegistryError(f"unknown voter {unknown[0]!r}; voters are {', '.join(sorted(self.voters))}")
        try:
            return [self.voters[name](settings) for name in dict.fromkeys(names)]
        except ValueError as e:
            raise RegistryError(str(e)) from None

    def plugin_voters(self) -> list[str]:
        """Voters that do not come with agentlog, in registration order."""
        return [n for n in self.voters if self.sources[("voter", n)] != BUILTIN_SOURCE]


BUILTIN_SOURCE = "agentlog (built-in)"


def effect_class(value: EffectClass | str) -> EffectClass:
    """``"idempotent"``, ``"IDEMPOTENT"`` or ``EffectClass.IDEMPOTENT``."""
    if isinstance(value, EffectClass):
        return value
    try:
        return EffectClass(str(value).upper())
    except ValueError:
        names = ", ".join(e.value.lower() for e in EffectClass)
        raise ValueError(f"effect class {value!r} is not one of {names}") from None
