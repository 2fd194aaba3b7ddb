"""Agent programs: deterministic functions of a session's results to its next action."""

from services.programs.base import (
    Action,
    CallLLM,
    CallTool,
    Fail,
    Finish,
    Fork,
    InvalidAction,
    LLMResult,
    Program,
    ProgramView,
    Prompt,
    TakeCheckpoint,
    TokenRun,
    ToolResult,
)
from services.programs.react import ReactProgram
from services.programs.script import ScriptProgram
from services.programs.trace import TraceProgram

PROGRAMS: dict[str, Program] = {p.name: p for p in (TraceProgram(), ReactProgram(), ScriptProgram())}
"""Built-in programs by name."""

__all__ = [
    "PROGRAMS",
    "Action",
    "CallLLM",
    "CallTool",
    "Fail",
    "Finish",
    "Fork",
    "InvalidAction",
    "LLMResult",
    "Program",
    "ProgramView",
    "Prompt",
    "ReactProgram",
    "ScriptProgram",
    "TakeCheckpoint",
    "TokenRun",
    "ToolResult",
    "TraceProgram",
]
