"""Program-level priorities on the wire: what each engine adapter sends, how vLLM is started to
serve by them, and which processes send them by default."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from log import open_log
from schemas import events as ev
from services.programs.base import Prompt, TokenRun
from services.scheduling import PROGRAM_ORDER, SchedulingConfig
from workers.config import scheduling_config
from workers.engines.chat import ChatEngine
from workers.engines.http import HttpEngine
from workers.engines.vllm.server import VllmServerConfig
from workers.engines.vllm.server import main as server_main
from workers.engines.vllm_http import VllmEngine
from workers.gateway import GatewayWorker

pytestmark = pytest.mark.unit

PROMPT = Prompt((TokenRun("s", 8),))
TEXT = Prompt(text="hello there")


def test_completions_engines_send_the_priority_only_when_there_is_one() -> None:
    for engine in (HttpEngine("http://e"), VllmEngine("http://e")):
        with_one = engine.payload(session_id="s", request_id="s/llm-0", prompt=PROMPT, max_output_tokens=4, priority=-3)
        assert with_one["priority"] == -3
        without = engine.payload(session_id="s", request_id="s/llm-0", prompt=PROMPT, max_output_tokens=4)
        assert "priority" not in without


def test_the_chat_engine_sends_it_with_the_ids_and_never_to_an_endpoint_that_refuses_extra_fields() -> None:
    def body(engine: ChatEngine, priority: int | None) -> dict[str, object]:
        return engine.chat_payload(session_id="s", request_id="s/llm-0", prompt=TEXT, max_output_tokens=4,
                                   messages=(), tools=(), priority=priority)  # fmt: skip

    assert body(ChatEngine("http://e/v1"), 17)["priority"] == 17
    assert "priority" not in body(ChatEngine("http://e/v1"), None)
    assert "priority" not in body(ChatEngine("http://e/v1", ids_in_body=False), 17)


def test_vllm_is_started_with_priority_scheduling_on_request_and_says_so_to_the_planner(tmp_path: Path) -> None:
    fcfs = VllmServerConfig(model="m", run_dir=tmp_path, python="python")
    assert "--scheduling-policy" not in fcfs.command()
    assert fcfs.endpoints()["AGENTLOG_SCHEDULING"] == "off"
    assert fcfs.endpoints()["AGENTLOG_VLLM_SCHEDULING_POLICY"] == "fcfs"  # what the vLLM tests read
    priority = VllmServerConfig(model="m", run_dir=tmp_path, python="python", scheduling_policy="priority")
    command = priority.command()
    assert command[command.index("--scheduling-policy") + 1] == "priority"
    assert priority.endpoints()["AGENTLOG_SCHEDULING"] == "plas"
    assert priority.endpoints()["AGENTLOG_VLLM_SCHEDULING_POLICY"] == "priority"
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        VllmServerConfig(model="m", run_dir=tmp_path, python="python", scheduling_policy="lifo")


def test_ranked_pins_are_asked_of_the_scheduler_and_need_the_priority_policy(tmp_path: Path) -> None:
    assert "AGENTLOG_VLLM_RANKED_PINS" not in VllmServerConfig(model="m", run_dir=tmp_path, python="python").env()
    ranked = VllmServerConfig(model="m", run_dir=tmp_path, python="python", scheduling_policy="priority",
                              ranked_pins=True)  # fmt: skip
    assert ranked.env()["AGENTLOG_VLLM_RANKED_PINS"] == "1"
    assert ranked.endpoints()["AGENTLOG_SCHEDULING"] == "programs"  # ranks that stay put
    assert ranked.endpoints()["AGENTLOG_CACHE_RANKED_PINS"] == "1"  # the manager leaves releases to the valve
    assert ranked.endpoints()["AGENTLOG_VLLM_HOLD_S"] == "600"  # each call's context held until replaced
    plain = VllmServerConfig(model="m", run_dir=tmp_path, python="python").endpoints()
    assert (plain["AGENTLOG_CACHE_RANKED_PINS"], plain["AGENTLOG_VLLM_HOLD_S"]) == ("0", "")
    with pytest.raises(ValueError, match="ranked_pins needs scheduling_policy 'priority'"):
        VllmServerConfig(model="m", run_dir=tmp_path, python="python", ranked_pins=True)


def test_the_launcher_refuses_ranked_pins_without_the_priority_policy_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        server_main(["start", "--model", "m", "--run-dir", str(tmp_path), "--ranked-pins"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("--ranked-pins needs --scheduling-policy priority (pins are ranked by priority)")
    assert "Traceback" not in "".join(err)


def test_scheduling_defaults_mode_by_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENTLOG_SCHEDULING", raising=False)
    assert scheduling_config(None, default="plas") == SchedulingConfig()
    assert scheduling_config(None, default="off") is None
    assert scheduling_config("off", default="plas") is None
    monkeypatch.setenv("AGENTLOG_SCHEDULING", "plas")
    assert scheduling_config(None, default="off") == SchedulingConfig()
    monkeypatch.setenv("AGENTLOG_SCHEDULING", "programs")
    assert scheduling_config(None, default="off") == PROGRAM_ORDER == SchedulingConfig(service_weight=0.0)
    monkeypatch.setenv("AGENTLOG_SCHEDULING", "sometimes")
    with pytest.raises(ValueError, match="AGENTLOG_SCHEDULING must be one of plas, programs, off, not 'sometimes'"):
        scheduling_config(None, default="off")


def gateway(scheduling: SchedulingConfig | None) -> GatewayWorker:
    at = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    log = open_log(f"memory:gateway-{id(scheduling)}", actor="gateway", clock=lambda: at)
    return GatewayWorker(log, engine_url="http://e", scheduling=scheduling)


def test_the_gateway_gives_the_sessions_priority_in_place_of_the_clients() -> None:
    body = {"model": "m", "messages": [], "priority": -(10**9)}  # a client asking to go first
    worker = gateway(SchedulingConfig())
    now_ms = round(datetime(2026, 1, 1, 12, 0, tzinfo=UTC).timestamp() * 1000)
    assert worker._engine_body("s", body, 0)["priority"] == now_ms  # no history yet: its ready time
    served = ev.GatewayLLMCallServed.model_construct(call_id="llm-0", queue_ms=100.0, prefill_ms=20.0, decode_ms=80.0)
    worker.session("s").calls["llm-0"] = served
    worker.session("s").gaps_ms["tool-1"] = 3_000.0
    # anchored back by its recorded age (the call and the tool gap), later by the call's service
    assert worker._engine_body("s", body, 2)["priority"] == now_ms - (200 + 3_000) + 100
    # and what it was computed from, kept for the call's record (GatewayLLMCallServed)
    ranked = worker.session("s").ranked
    assert ranked is not None and (ranked.attained_ms, ranked.age_ms, ranked.warm) == (100.0, 3_200.0, False)
    # off: the body goes as the client sent it
    assert gateway(None)._engine_body("s", body, 0)["priority"] == -(10**9)


def test_vllm_gets_the_extra_environment_it_is_started_with(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the real-vLLM priority test starts its own server with (vLLM's /pause and /resume)."""
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    config = VllmServerConfig(model="m", run_dir=tmp_path, python="python", extra_env={"VLLM_SERVER_DEV_MODE": "1"})
    assert config.env()["VLLM_SERVER_DEV_MODE"] == "1"
    assert "VLLM_SERVER_DEV_MODE" not in VllmServerConfig(model="m", run_dir=tmp_path, python="python").env()
