"""workers.logs: JSON lines with the ids a record was logged with."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from workers.logs import JsonFormatter, configure_logging

pytestmark = pytest.mark.unit


def record(msg: str, **extra: object) -> logging.LogRecord:
    r = logging.LogRecord("workers.planner", logging.INFO, __file__, 1, msg, (), None)
    r.__dict__.update(extra)
    return r


def test_a_json_line_carries_the_session_and_call() -> None:
    line = json.loads(JsonFormatter("planner").format(record("asked the engine", session_id="s-1", call_id="llm-0")))
    assert line["role"] == "planner" and line["level"] == "INFO" and line["msg"] == "asked the engine"
    assert (line["session_id"], line["call_id"]) == ("s-1", "llm-0")
    assert "topic" not in line and line["ts"].endswith("+00:00")


def test_an_exception_is_one_field_of_one_line() -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        r = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    text = JsonFormatter("executor").format(r)
    assert "\n" not in text
    assert "RuntimeError: boom" in json.loads(text)["exc"]


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="use one of text, json"):
        configure_logging("planner", log_format="yaml")
