"""An SDK agent on a chat engine: its model calls a user tool through function calling.

Real processes on a real Kafka broker (``tests/e2e/sdk_scenario.py``): the sim engine answering
``/v1/chat/completions``, a planner with ``--engine-kind openai`` (``AGENTLOG_ENGINE_KIND``), the
decider and the executor, loading ``tests/e2e/sdk_chat_agent.py``. The planner is SIGKILLed in
the middle of an LLM call. Checked:

- every session finishes; the model's tool call is in the log (``LLMCallCompleted``), was
  proposed with its arguments, committed by the decider, run once by the executor, and its
  result went back to the model, which then answered;
- a malformed tool call (arguments not JSON, or against the schema) is recorded as the model
  sent it, makes no tool step, and the model is told the error on its next call;
- no LLM call was computed twice: the engine served exactly the calls the log holds.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import pytest

from schemas import events as ev
from services.programs.base import ModelToolCall
from tests.e2e.sdk_scenario import SdkScenario

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PLUGIN = "tests.e2e.sdk_chat_agent"
CHAT_ENV = {"AGENTLOG_ENGINE_KIND": "openai", "AGENTLOG_VOTERS": "default"}

CRASH_POINTS = [
    # The engine computed (and recorded) the call, the log never heard: the retry is answered from the record.
    ("planner-0", "planner.after_engine:2"),
    # LLMCallStarted is in the log, the engine was not asked yet.
    ("planner-0", "planner.after_llm_started:3"),
]


@pytest.mark.parametrize(("victim", "crash_at"), CRASH_POINTS, ids=[c for _, c in CRASH_POINTS])
def test_a_chat_agents_tool_calls_are_proposed_voted_executed_and_answered(
    victim: str, crash_at: str, kafka_bootstrap: str, namespace: str, pg_url: str, tmp_path: Path
) -> None:
    scenario = SdkScenario(kafka_bootstrap, namespace, pg_url, tmp_path, num_sessions=0, plugins=PLUGIN, env=CHAT_ENV)
    run = uuid.uuid4().hex[:4]
    goals = {
        f"lisbon-{run}": "What will the weather be in Lisbon?",
        f"porto-{run}": "And in Porto, for the weekend?",
        f"badjson-{run}": "Weather in Faro #malformed-json",
        f"badargs-{run}": "Weather in Braga #malformed-args",
    }
    scenario.start(victim, crash_at)
    try:
        for session, goal in goals.items():
            asyncio.run(scenario.request(session, "weather_agent", {"goal": goal}))
        book, _ = scenario.drive(list(goals))
        crashed_log = scenario.stack.processes[victim].log_path.read_text(errors="replace")
        assert f"crash point {crash_at.split(':')[0]} reached" in crashed_log, "the crash point was never reached"
        forecasts = [json.loads(line) for line in (tmp_path / "sandbox" / "forecasts.jsonl").read_text().splitlines()]
        distinct = 0
        for session in goals:
            state = book.records[session].state
            assert state.status is not None and state.status.value == "finished", (session, state.failure)
            assert not state.anomalies, state.anomalies
            distinct += len(state.llm_calls)
            output = json.loads(state.output_json or "")
            assert output["answer"].startswith("simulated answer"), output
            first = state.llm_calls["llm-0"].completed
            assert first is not None and first.finish_reason == "tool_calls"
            [call] = ModelToolCall.list_from_json(first.tool_calls_json)  # recorded as the model sent it
            [told] = output["tool_messages"]
            assert told["tool_call_id"] == call.id and told["name"] == "forecast"
            if "#malformed" in goals[session]:
                assert [s.call_id for s in state.steps] == ["llm-0", "llm-1"]  # no tool step
                assert state.tool_calls == {}
                error = json.loads(told["content"])["error"]
                if "json" in session:
                    assert error.startswith("the arguments of forecast are not JSON"), error
                    with pytest.raises(ValueError):
                        json.loads(call.arguments)
                else:
                    assert error.startswith("the arguments of forecast do not match its schema"), error
            else:
                assert [s.call_id for s in state.steps] == ["llm-0", "tool-1", "llm-2"]
                proposed = state.tool_calls["tool-1"]
                assert proposed.proposed.tool == "forecast"
                assert json.loads(proposed.proposed.arguments_json) == json.loads(call.arguments)
                assert isinstance(proposed.verdict, ev.ToolCallCommitted)
                assert {v.voter: v.decision.value for v in proposed.verdict.votes}["arg_schema"] == "APPROVE"
                assert json.loads(told["content"]) == json.loads(proposed.completed.result_json)  # type: ignore[union-attr]
                assert [f["key"] for f in forecasts].count(proposed.proposed.idempotency_key) == 1
        assert len(forecasts) == 2  # one execution per well-formed call
        stats = scenario.engine_stats()
        assert distinct == 2 * len(goals)
        assert stats["num_served"] == distinct  # no LLM call computed twice
        if "after_engine" in crash_at:
            assert stats["num_replayed"] >= 1  # the call the planner lost was answered from the engine's record
    finally:
        scenario.stack.stop()
