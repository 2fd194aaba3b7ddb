"""docker-compose's vLLM service and its engine bridge agree with the code they run (no Docker needed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data["services"]  # type: ignore[no-any-return]


def option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_vllm_runs_the_projects_scheduler_with_kv_events_on_the_shared_volume(services: dict[str, Any]) -> None:
    vllm = services["vllm"]
    assert vllm["profiles"] == ["vllm"], "a GPU service: only with --profile vllm"
    assert vllm["image"].startswith("${AGENTLOG_VLLM_IMAGE:-vllm/vllm-openai:")
    scheduler = option(vllm["command"], "--scheduler-cls")
    module, cls = scheduler.rsplit(".", 1)
    assert (ROOT / (module.replace(".", "/") + ".py")).exists() and f"class {cls}(" in (
        ROOT / (module.replace(".", "/") + ".py")
    ).read_text()
    mounted = {v.split(":")[1] for v in vllm["volumes"]}
    assert {"/agentlog/workers", "/agentlog/services", "/agentlog/schemas"} <= mounted
    assert vllm["environment"]["PYTHONPATH"] == "/agentlog"
    for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details", "--enable-per-request-metrics"):
        assert flag in vllm["command"]
    events = json.loads(option(vllm["command"], "--kv-events-config"))
    assert events["enable_kv_cache_events"] and events["publisher"] == "zmq"
    devices = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]

    bridge = services["vllm-bridge"]
    assert bridge["profiles"] == ["vllm"]
    command = bridge["command"]
    assert f"--kv-events {events['endpoint']}" in command
    assert f"--kv-replay {events['replay_endpoint']}" in command
    assert f"--control {vllm['environment']['AGENTLOG_VLLM_CONTROL']}" in command
    assert bridge["environment"]["AGENTLOG_VLLM_CONTROL_TOKEN"] == vllm["environment"]["AGENTLOG_VLLM_CONTROL_TOKEN"]
    named = {v.split(":")[0] for v in vllm["volumes"]} & {v.split(":")[0] for v in bridge["volumes"]}
    assert {n for n in named if not n.startswith(".")} == {"vllm-run"}, "the sockets' volume is shared by these two"
    others = [name for name, s in services.items() if name not in ("vllm", "vllm-bridge")]
    assert all("vllm-run" not in str(services[name].get("volumes", [])) for name in others)
