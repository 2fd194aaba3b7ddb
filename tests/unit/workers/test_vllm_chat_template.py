"""vLLM gets a chat template for a local model without one (the tiny test model), and it renders a
conversation with tool calls the way agentlog's ``render_messages`` writes one."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from workers.engines.vllm.server import CHAT_TEMPLATE, VllmServerConfig, needs_chat_template

pytestmark = pytest.mark.unit

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"unit": "celsius"}'}}
MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


@pytest.mark.parametrize("trim", [True, False])
def test_the_template_renders_one_block_per_message(trim: bool) -> None:
    # As transformers' apply_chat_template does: a sandbox, trim_blocks and lstrip_blocks on.
    env = ImmutableSandboxedEnvironment(trim_blocks=trim, lstrip_blocks=trim, undefined=jinja2.StrictUndefined)
    env.filters["tojson"] = lambda value: json.dumps(value)
    template = env.from_string(CHAT_TEMPLATE.read_text())
    text = template.render(messages=MESSAGES, add_generation_prompt=True, tools=None)
    calls = json.dumps([CALL])
    assert text == f"<|system|>\nbe brief\n<|user|>\nweather?\n<|assistant|>\n{calls}\n<|tool|>\nsunny\n<|assistant|>\n"
    assert not template.render(messages=MESSAGES[:1], add_generation_prompt=False).endswith("<|assistant|>\n")


def test_a_local_model_without_a_template_gets_ours(tmp_path: Path) -> None:
    bare, own = tmp_path / "bare", tmp_path / "own"
    for model, config in ((bare, {"model_max_length": 1024}), (own, {"chat_template": "{{ messages }}"})):
        model.mkdir()
        (model / "tokenizer_config.json").write_text(json.dumps(config))
    assert needs_chat_template(str(bare)) and not needs_chat_template(str(own))
    assert not needs_chat_template("meta-llama/Llama-3.1-8B-Instruct")  # a hub name: its own template

    def template_of(model: Path, chosen: Path | None = None) -> str | None:
        command = VllmServerConfig(
            str(model), tmp_path / "run", python="python", cpu=True, chat_template=chosen
        ).command()
        return command[command.index("--chat-template") + 1] if "--chat-template" in command else None

    assert template_of(bare) == str(CHAT_TEMPLATE)
    assert template_of(own) is None
    assert template_of(own, tmp_path / "mine.jinja") == str(tmp_path / "mine.jinja")
