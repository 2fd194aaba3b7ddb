"""``logctl analyze`` on trace files, without a server: the report, strict --json, plots, bad input."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from typer.testing import CliRunner

from cli.data import INFERCEPT, trace_file
from cli.main import app
from log import open_log
from schemas import events as ev
from services.analysis import analyze, from_trace
from services.traces import Trace, TraceSession, TraceTurn
from tests.unit.services.analysis_samples import workload

pytestmark = pytest.mark.unit


def _strict(text: str) -> Any:
    def refuse(constant: str) -> None:
        raise AssertionError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def small_trace(tmp_path: Path) -> tuple[Path, Trace]:
    turns = (TraceTurn(400, 20, "search", 3.0, 100), TraceTurn(10, 20, "search", 5.0, 50), TraceTurn(5, 10))
    trace = Trace(tuple(TraceSession(f"s{i}", "test", float(i), turns) for i in range(3)))
    path = tmp_path / "small.jsonl"
    path.write_text("\n".join(trace.to_json_lines()) + "\n")
    return path, trace


def test_json_is_strict_and_the_report_of_the_fold(small_trace: tuple[Path, Trace]) -> None:
    path, trace = small_trace
    result = CliRunner().invoke(app, ["analyze", str(path), "--json"])
    assert result.exit_code == 0, result.output
    report = _strict(result.output)
    expected = analyze(from_trace(trace), report["source"])
    assert report["sessions"] == 3 and report["tool_gaps"] == 6 and report["gap_s"] == 24.0
    assert report["gap_share"] == expected.gap_share and report["oracle_saved_s"] == expected.oracle_saved_s
    assert report["queue_waits"]["p50"] is None  # no call waited: no value, not NaN
    assert report["verdict"]["answer"] == expected.verdict.answer.value
    assert [t["tool"] for t in report["tools"]] == ["search"] and len(report["session_reports"]) == 3


def test_the_text_report_leads_with_the_verdict(small_trace: tuple[Path, Trace]) -> None:
    path, _ = small_trace
    result = CliRunner().invoke(app, ["analyze", str(path), "--top", "2"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("workload: trace small.jsonl") and lines[3].startswith("verdict: a serving-layer")
    assert "the 2 longest jobs of 3" in result.output and "search" in result.output


def test_the_shipped_infercept_trace_through_its_importer() -> None:
    result = CliRunner().invoke(app, ["analyze", str(trace_file(INFERCEPT)), "--format", "infercept", "--json"])
    assert result.exit_code == 0, result.output
    report = _strict(result.output)
    assert report["sessions"] > 100 and 0.5 < report["gap_share"] < 1.0
    assert report["hit_rate"] == 0.0 and report["recomputed_tokens"] > 0  # the no-retention baseline


def test_png_writes_the_three_plots(small_trace: tuple[Path, Trace], tmp_path: Path) -> None:
    path, _ = small_trace
    result = CliRunner().invoke(app, ["analyze", str(path), "--png", str(tmp_path / "plots")])
    assert result.exit_code == 0, result.output
    written = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert written == ["hits_per_turn.png", "job_time.png", "tool_gaps.png"]
    assert all((tmp_path / "plots" / name).read_bytes().startswith(b"\x89PNG") for name in written)


def test_png_without_matplotlib_is_one_line(
    small_trace: tuple[Path, Trace], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    result = CliRunner().invoke(app, ["analyze", str(small_trace[0]), "--png", str(tmp_path)])
    assert result.exit_code == 1
    assert result.output.strip() == "logctl: --png needs matplotlib: pip install 'agentlog[plots]'"


@pytest.mark.parametrize(
    ("content", "args", "says"),
    [
        (None, [], "trace {path} not found"),
        ('{"session_id": "s", "source": "x", "arrival_s": 0, "turns": [\n', [], "line 1: not JSON"),
        ('{"session_id": "s", "source": "x", "arrival_s": 0, "turns": [{"prompt_tokens": 0}]}\n', [], "line 1"),
        ("[1, 2]", ["--format", "infercept"], "not a valid infercept trace"),
        ("{not json", ["--format", "continuum"], "not JSON"),
        ("", [], "no sessions in trace"),
    ],
)
def test_bad_input_is_one_line_and_a_non_zero_exit(
    tmp_path: Path, content: str | None, args: list[str], says: str
) -> None:
    path = tmp_path / "trace.jsonl"
    if content is not None:
        path.write_text(content)
    result = CliRunner().invoke(app, ["analyze", str(path), *args])
    assert result.exit_code != 0
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("logctl: ") and says.format(path=path) in lines[0], result.output


def _actor(body: BaseModel) -> str:
    return {ev.SessionRequested: "operator", ev.ToolCallCompleted: "executor"}.get(type(body), "planner")


def test_a_log_on_the_memory_backend_gives_the_constructed_numbers_exactly() -> None:
    url = f"memory:analyze-{uuid.uuid4().hex[:8]}"
    base = datetime(2026, 1, 1, tzinfo=UTC)
    now = [base]

    async def write() -> None:
        async with contextlib.AsyncExitStack() as stack:
            logs = {
                actor: await stack.enter_async_context(open_log(url, actor=actor, clock=lambda: now[0]))
                for actor in ("operator", "planner", "executor")
            }
            for session_id, _, body, at in sorted(workload(), key=lambda e: e[3]):
                now[0] = base + timedelta(seconds=at)
                await logs[_actor(body)].append(session_id, body)  # type: ignore[arg-type]

    assert CliRunner().invoke(app, ["init", "--log-url", url, "--partitions", "2"]).exit_code == 0
    asyncio.run(write())
    result = CliRunner().invoke(app, ["analyze", "--log-url", url, "--json"])
    assert result.exit_code == 0, result.output
    report = _strict(result.output)
    assert (report["sessions"], report["job_s"], report["gap_share"]) == (2, 16.0, 0.5)
    assert (report["hit_rate"], report["oracle_hit_rate"], report["queue_s"]) == (0.28125, 0.3125, 1.0)
    assert report["oracle_saved_s"] == 0.0625 and report["source"] == f"the log {url}"
