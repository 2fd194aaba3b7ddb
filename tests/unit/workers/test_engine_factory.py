"""The planner's engine client follows --engine-kind / AGENTLOG_ENGINE_KIND."""

from __future__ import annotations

import argparse

import pytest

from workers.engines.factory import create_engine
from workers.engines.http import HttpEngine
from workers.engines.vllm_http import VllmEngine
from workers.planner import PlannerWorker

pytestmark = pytest.mark.unit


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    PlannerWorker.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_planner_picks_the_engine_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENTLOG_ENGINE_KIND", raising=False)
    assert _args().engine_kind == "sim"
    assert _args("--engine-kind", "vllm").engine_kind == "vllm"
    monkeypatch.setenv("AGENTLOG_ENGINE_KIND", "vllm")
    assert _args().engine_kind == "vllm"
    with pytest.raises(SystemExit):
        _args("--engine-kind", "tgi")


def test_create_engine_builds_the_client_of_each_kind() -> None:
    assert type(create_engine("http://127.0.0.1:1", engine_id="e", kind="sim")) is HttpEngine
    assert isinstance(create_engine("http://127.0.0.1:1", engine_id="e", kind="vllm"), VllmEngine)
    with pytest.raises(ValueError, match="unknown engine kind"):
        create_engine("http://127.0.0.1:1", engine_id="e", kind="tgi")
