"""``logctl trace import|synth|stats`` on small files (the conversions are tested beside this file)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.traces import app
from services.traces import Trace

pytestmark = pytest.mark.unit

RUNNER = CliRunner()

INFERCEPT = {
    "s": [
        {"prompt_tokens": 100, "completion_tokens": 20, "api_time": 10.0, "api_token_length": 10},
        {"prompt_tokens": 130, "completion_tokens": 15},
    ]
}
CONTINUUM = [
    {
        "traj_id": "t",
        "messages": json.dumps(
            [
                {"role": "user", "content": "fix it"},
                {
                    "role": "assistant",
                    "content": "ok",
                    "tool_calls": "[{'function': {'name': 'bash', 'arguments': 'ls'}, 'execution_time_seconds': 0.5}]",
                },
                {"role": "tool", "content": "a.py"},
                {"role": "assistant", "content": "done"},
            ]
        ),
    }
]
MOONCAKE = [
    {"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [0, 1]},
    {"timestamp": 2000, "input_length": 1100, "output_length": 5, "hash_ids": [0, 2, 3]},
    {"timestamp": 9000, "input_length": 1200, "output_length": 5, "hash_ids": [0, 2, 4]},
]


def read(path: Path) -> Trace:
    return Trace.from_json_lines(path.read_text().splitlines())


def test_import_infercept_with_limit_and_time_scale(tmp_path: Path) -> None:
    source, out = tmp_path / "in.json", tmp_path / "out" / "trace.jsonl"
    source.write_text(json.dumps(INFERCEPT))
    result = RUNNER.invoke(app, ["import", "infercept", str(source), str(out), "--time-scale", "0.1", "--seed", "3"])
    assert result.exit_code == 0, result.output
    assert "infercept: 1 sessions, 2 recorded calls, 1 tool gaps" in result.output
    assert f"wrote 1 sessions, 2 turns to {out}" in result.output
    (session,) = read(out).sessions
    assert session.turns[0].tool_duration_s == pytest.approx(1.0)


def test_import_continuum_and_mooncake(tmp_path: Path) -> None:
    continuum, mooncake = tmp_path / "c.json", tmp_path / "m.jsonl"
    continuum.write_text(json.dumps(CONTINUUM))
    mooncake.write_text("\n".join(json.dumps(r) for r in MOONCAKE) + "\n")
    assert RUNNER.invoke(app, ["import", "continuum", str(continuum), str(tmp_path / "c.jsonl")]).exit_code == 0
    assert [t.tool for t in read(tmp_path / "c.jsonl").sessions[0].turns] == ["bash", None]
    result = RUNNER.invoke(app, ["import", "mooncake", str(mooncake), str(tmp_path / "m.out"), "--limit", "1"])
    assert result.exit_code == 0, result.output
    assert [len(s.turns) for s in read(tmp_path / "m.out")] == [1]  # the first of two sessions


def test_mooncake_refuses_an_arrival_rate(tmp_path: Path) -> None:
    mooncake = tmp_path / "m.jsonl"
    mooncake.write_text(json.dumps(MOONCAKE[0]))
    result = RUNNER.invoke(app, ["import", "mooncake", str(mooncake), str(tmp_path / "o"), "--arrival-rate", "2"])
    assert result.exit_code == 1
    assert "--arrival-rate does not apply to mooncake" in result.output


def test_a_malformed_source_is_reported_without_a_traceback(tmp_path: Path) -> None:
    source = tmp_path / "in.json"
    source.write_text(json.dumps({"s": []}))
    result = RUNNER.invoke(app, ["import", "infercept", str(source), str(tmp_path / "o")])
    assert result.exit_code == 1
    assert "expected a non-empty list of calls" in result.output
    assert not (tmp_path / "o").exists()


def test_synth_then_stats(tmp_path: Path) -> None:
    out = tmp_path / "syn.jsonl"
    result = RUNNER.invoke(app, ["synth", str(out), "--sessions", "30", "--tool-duration", "pareto", "--seed", "4"])
    assert result.exit_code == 0, result.output
    assert len(read(out)) == 30
    table = RUNNER.invoke(app, ["stats", str(out)])
    assert table.exit_code == 0, table.output
    assert "sessions" in table.output and "tool gap p90 s" in table.output and "search" in table.output
    as_json = json.loads(RUNNER.invoke(app, ["stats", str(out), "--json"]).output)
    assert as_json["sessions"] == 30
    assert {t["tool"] for t in as_json["tools"]} <= {"search", "code_exec", "browser", "human"}


def test_stats_reports_a_bad_trace_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"session_id": "s"}\n')
    result = RUNNER.invoke(app, ["stats", str(bad)])
    assert result.exit_code == 1
    assert "line 1: session is missing source, arrival_s, turns" in result.output
