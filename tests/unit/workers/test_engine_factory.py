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


def test_the_chat_kind_reads_its_model_key_and_id_placement(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.programs.base import Prompt
    from workers.engines.chat import ChatEngine

    assert _args("--engine-kind", "openai").engine_kind == "openai"
    monkeypatch.setenv("AGENTLOG_ENGINE_MODEL", "my-model")
    monkeypatch.setenv("AGENTLOG_ENGINE_API_KEY", "sk-test")
    monkeypatch.setenv("AGENTLOG_ENGINE_IDS", "headers")
    engine = create_engine("http://127.0.0.1:1/v1/", engine_id="e", kind="openai")
    assert isinstance(engine, ChatEngine)
    assert (engine.base_url, engine.model, engine.ids_in_body) == ("http://127.0.0.1:1", "my-model", False)
    assert "sk-test" not in repr(engine)
    assert engine.headers(session_id="s", request_id="s/llm-0") == {
        "X-Request-Id": "s/llm-0",
        "X-Agentlog-Session": "s",
        "Authorization": "Bearer sk-test",
    }
    messages = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "t"}}
    payload = engine.chat_payload(
        session_id="s", request_id="r", prompt=Prompt(text="x"), max_output_tokens=3, messages=messages, tools=[tool]
    )
    assert payload == {"model": "my-model", "messages": messages, "tools": [tool], "max_completion_tokens": 3}
    monkeypatch.setenv("AGENTLOG_ENGINE_IDS", "query")
    with pytest.raises(ValueError, match="AGENTLOG_ENGINE_IDS"):
        create_engine("http://127.0.0.1:1", engine_id="e", kind="openai")
