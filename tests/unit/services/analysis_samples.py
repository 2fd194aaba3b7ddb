"""A workload of two sessions whose analysis numbers are exact binary fractions (tests of logctl analyze)."""

from __future__ import annotations

from pydantic import BaseModel

from schemas import events as ev


def started(call_id: str, turn: int, prompt: int) -> ev.LLMCallStarted:
    return ev.LLMCallStarted(
        call_id=call_id, turn=turn, engine_id="sim-0", prompt_tokens=prompt, max_output_tokens=128, prompt_digest="d"
    )


def completed(
    call_id: str, prompt: int, cached: int, queue: float, prefill: float, decode: float
) -> ev.LLMCallCompleted:
    return ev.LLMCallCompleted(
        call_id=call_id, engine_id="sim-0", prompt_tokens=prompt, cached_tokens=cached, output_tokens=128,
        output_text="", finish_reason="length", queue_ms=queue, prefill_ms=prefill, decode_ms=decode,
    )  # fmt: skip


def proposed(call_id: str, tool: str) -> ev.ToolCallProposed:
    return ev.ToolCallProposed(
        call_id=call_id, tool=tool, arguments_json="{}", effect_class=ev.EffectClass.PURE, idempotency_key=call_id
    )


Event = tuple[str, str, BaseModel, float]


def workload() -> list[Event]:
    """Two sessions of 8 s each (16 s of job time).

    - ``a``: LLM call [0, 1] (prompt 512, nothing cached, 128 out), waits on ``search`` [1, 7],
      LLM call [7, 8] (prompt 1536, 512 cached of the 640 it could reuse: 128 recomputed;
      engine 500 ms prefill + 500 ms decode, so 0.5 s of prefill on 1024 computed tokens);
    - ``b``: LLM call [0, 2] that queued 1,000 of its 2,000 engine ms (1 s behind ``a``), waits
      on ``sleep`` [2, 4], LLM call [4, 6] with all 640 tokens it could reuse cached, then 2 s
      of planner time until it finishes at 8.

    So: gaps 8 of 16 s (0.5; search 0.375, sleep 0.125), hit rate 1152 of 4096 prompt tokens
    (a 512 of 2048, b 640 of 2048), 128 tokens recomputed (oracle hit rate 0.3125),
    head-of-line 1 s (0.0625), and the oracle saves 0.5 s * 128 / 1024 = 0.0625 s.
    """
    sid = "a"
    events: list[tuple[str, BaseModel, float]] = [
        (sid, ev.SessionRequested(program="trace", args_json="{}", author="t"), 0.0),
        (sid, ev.SessionStarted(program="trace", args_json="{}"), 0.0),
        (sid, started("llm-0", 0, 512), 0.0),
        (sid, completed("llm-0", 512, 0, 0.0, 500.0, 500.0), 1.0),
        (sid, proposed("tool-1", "search"), 1.0),
        (sid, ev.ToolCallCompleted(call_id="tool-1", result_json="{}", result_tokens=896, duration_ms=5900.0), 6.9),
        (sid, started("llm-2", 1, 1536), 7.0),
        (sid, completed("llm-2", 1536, 512, 0.0, 500.0, 500.0), 8.0),
        (sid, ev.SessionFinished(output_json="{}", num_llm_calls=2, num_tool_calls=1), 8.0),
    ]
    sid = "b"
    events += [
        (sid, ev.SessionRequested(program="trace", args_json="{}", author="t"), 0.0),
        (sid, ev.SessionStarted(program="trace", args_json="{}"), 0.25),
        (sid, started("llm-0", 0, 512), 0.0),
        (sid, completed("llm-0", 512, 0, 1000.0, 500.0, 500.0), 2.0),
        (sid, proposed("tool-1", "sleep"), 2.0),
        (sid, started("llm-2", 1, 1536), 4.0),
        (sid, completed("llm-2", 1536, 640, 0.0, 1000.0, 1000.0), 6.0),
        (sid, ev.SessionFinished(output_json="{}", num_llm_calls=2, num_tool_calls=1), 8.0),
    ]
    return [(s, f"{s}-{i}", body, at) for i, (s, body, at) in enumerate(events)]
