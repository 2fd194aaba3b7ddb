"""Tool implementations that need no server: sandboxing and idempotency by key."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from workers.runtime import event_id
from workers.tools import ToolContext, echo, file_write, sleep, trace_tool

pytestmark = pytest.mark.unit


def context(tmp_path: Path, key: str = "s/tool-1") -> ToolContext:
    return ToolContext("s", "tool-1", key, tmp_path, None, time_scale=0.0)


def test_file_write_is_idempotent_by_key(tmp_path: Path) -> None:
    first = asyncio.run(file_write({"path": "out/a.txt", "content": "one"}, context(tmp_path)))
    assert (tmp_path / "out" / "a.txt").read_text() == "one"
    # A retry with the same key is the same effect, even if the file changed since.
    (tmp_path / "out" / "a.txt").write_text("changed by someone")
    again = asyncio.run(file_write({"path": "out/a.txt", "content": "one"}, context(tmp_path)))
    assert again[0]["already_written"] is True and first[0]["bytes"] == 3
    assert (tmp_path / "out" / "a.txt").read_text() == "changed by someone"
    # Another key writes again.
    asyncio.run(file_write({"path": "out/a.txt", "content": "two"}, context(tmp_path, "s/tool-9")))
    assert (tmp_path / "out" / "a.txt").read_text() == "two"


def test_file_write_stays_in_the_sandbox(tmp_path: Path) -> None:
    sandbox = tmp_path / "box"
    sandbox.mkdir()
    with pytest.raises(PermissionError, match="outside the sandbox"):
        asyncio.run(file_write({"path": "../escape.txt", "content": "x"}, context(sandbox)))
    assert not (tmp_path / "escape.txt").exists()


def test_pure_tools(tmp_path: Path) -> None:
    assert asyncio.run(echo({"text": "hello world!"}, context(tmp_path))) == ({"text": "hello world!"}, 3)
    assert asyncio.run(sleep({"seconds": 5}, context(tmp_path)))[0] == {"slept_s": 5}
    result, tokens = asyncio.run(
        trace_tool({"tool": "search", "duration_s": 7.5, "result_tokens": 42}, context(tmp_path))
    )
    assert tokens == 42 and result["tool"] == "search"


def test_event_ids_are_deterministic() -> None:
    assert event_id("s", "verdict", "tool-1") == event_id("s", "verdict", "tool-1")
    assert event_id("s", "verdict", "tool-1") != event_id("s", "verdict", "tool-2")


def _reach_crash_point(armed: str) -> subprocess.CompletedProcess[str]:
    """A process that reaches ``nowhere.at_all`` twice and says so after each, with ``armed`` armed."""
    script = (
        "from workers.crash import crash_point\n"
        "for _ in range(2):\n"
        "    crash_point('nowhere.at_all')\n"
        "    print('passed', flush=True)\n"
    )
    env = {**os.environ, "AGENTLOG_CRASH_AT": armed}
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)


def test_unarmed_crash_point_does_nothing() -> None:
    unarmed = _reach_crash_point("elsewhere.other_point")
    assert (unarmed.returncode, unarmed.stdout.split()) == (0, ["passed", "passed"])
    armed = _reach_crash_point("nowhere.at_all:2")  # the same process, with this point armed: killed at its 2nd hit
    assert (armed.returncode, armed.stdout.split()) == (-signal.SIGKILL, ["passed"])
