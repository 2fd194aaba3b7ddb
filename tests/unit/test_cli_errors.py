"""logctl's edges without a server: bad --args, strict --json, the restart backoff of logctl up."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from cli.main import app
from cli.render import to_json
from cli.stack import Backoff, describe_exit

pytestmark = pytest.mark.unit

UNREACHABLE = "postgresql://bob:hunter2-unit@127.0.0.1:1/agentlog"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ("{bad", "--args is not JSON"),
        ("[1]", "--args must be a JSON object, not a list"),
        ('"text"', "--args must be a JSON object, not a str"),
        ("3", "--args must be a JSON object, not a int"),
    ],
)
def test_run_refuses_args_that_are_not_a_json_object_in_one_line(args: str, says: str) -> None:
    result = CliRunner().invoke(app, ["run", "script", "--args", args, "--log-url", UNREACHABLE, "--no-wait"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("logctl: ") and says in lines[0], result.output
    assert "hunter2" not in result.output


def test_run_refuses_a_missing_trace_file_in_one_line() -> None:
    result = CliRunner().invoke(app, ["run", "no-such-trace.jsonl", "--log-url", UNREACHABLE, "--no-wait"])
    assert result.exit_code == 2
    assert result.output.strip() == "logctl: cannot read the trace no-such-trace.jsonl: No such file or directory"


def test_to_json_is_strict_json_with_null_for_no_value() -> None:
    text = to_json({"mean": math.nan, "p95": [math.inf, 1.5], "n": 3})

    def refuse(constant: str) -> None:
        raise AssertionError(f"not strict JSON: {constant}")

    assert json.loads(text, parse_constant=refuse) == {"mean": None, "p95": [None, 1.5], "n": 3}


def test_backoff_doubles_to_its_cap_and_starts_over_after_a_long_life() -> None:
    backoff = Backoff(first_s=1, max_s=8, reset_after_s=60)
    assert [backoff.after_exit(uptime_s=2) for _ in range(6)] == [1, 2, 4, 8, 8, 8]
    assert backoff.num_exits == 6  # never given up: it keeps counting and retrying at the cap
    assert backoff.after_exit(uptime_s=60) == 1  # it had stayed up a minute: a fresh start
    assert backoff.after_exit(uptime_s=0.5) == 2


def test_an_exit_says_its_signal() -> None:
    assert describe_exit(-9) == "code -9, SIGKILL"
    assert describe_exit(3) == "code 3"
