"""The real-vLLM bench: its cost-model calibration (pure: speeds in, a cost model out) and the
priorities each mode sends."""

from __future__ import annotations

import pytest

from bench.vllm_agents import MODES, Driver, Speeds, calibrated
from services.engine.cost import CostModel
from services.scheduling import DEFAULT_SCHEDULING, PROGRAM_ORDER

pytestmark = pytest.mark.unit

STEPS = 64


def speeds_of(model: CostModel, short: int = 1024, long: int = 4096, batch: int = 4) -> Speeds:
    """What ``measure_speeds`` would measure on an engine that runs exactly as ``model`` says."""
    return Speeds(
        short=short, long=long, prefill_short_ms=model.prefill_ms(short), prefill_long_ms=model.prefill_ms(long),
        step_short_ms=model.decode_ms(STEPS, short) / STEPS, step_long_ms=model.decode_ms(STEPS, long) / STEPS,
        batch=batch, batch_step_ms=model.batch_steps_ms(STEPS, batch, batch * short) / STEPS, steps=STEPS,
    )  # fmt: skip


FIELDS = (
    "prefill_ms_per_token",
    "prefill_attention_ms_per_token_pair",
    "decode_ms_per_token",
    "decode_ms_per_sequence",
    "decode_ms_per_context_token",
)


def test_the_fit_recovers_the_model_that_produced_the_speeds() -> None:
    true = CostModel(
        block_size=32, call_overhead_ms=0.0, prefill_ms_per_token=0.4, prefill_attention_ms_per_token_pair=9e-5,
        decode_ms_per_token=12.0, decode_ms_per_sequence=1.0, hbm_bytes_per_s=131_072 / 1.4e-6,
    )  # fmt: skip
    fitted = calibrated(speeds_of(true), time_scale=1.0)
    for name in FIELDS:
        assert getattr(fitted, name) == pytest.approx(getattr(true, name), rel=1e-9), name


def test_trace_time_divides_every_term_by_the_time_scale() -> None:
    true = CostModel(block_size=32, call_overhead_ms=0.0, decode_ms_per_sequence=0.5)
    wall, trace = calibrated(speeds_of(true), 1.0), calibrated(speeds_of(true), 8.0)
    for name in FIELDS:
        assert getattr(trace, name) == pytest.approx(getattr(wall, name) / 8.0, rel=1e-9), name


def test_noise_never_makes_a_term_negative_or_a_sequence_cost_more_than_its_step() -> None:
    # A long-context step measured faster than a short one, a batch faster than one sequence,
    # a long prefill cheaper per token than a short one: no negative terms come out.
    noisy = Speeds(short=1024, long=4096, prefill_short_ms=600.0, prefill_long_ms=1800.0, step_short_ms=15.0,
                   step_long_ms=14.0, batch=4, batch_step_ms=12.0, steps=STEPS)  # fmt: skip
    fitted = calibrated(noisy, 1.0)
    assert all(getattr(fitted, name) >= 0 for name in FIELDS)
    assert fitted.decode_ms_per_sequence <= fitted.decode_ms_per_token
    assert fitted.decode_ms_per_context_token == 0.0


def test_each_mode_ranks_calls_as_the_planner_would_on_its_server() -> None:
    # manager+plas and plas+hold run on ranked pins, whose server announces --scheduling programs
    # (ranks that stay put); plas sends plas priorities; the rest send none.
    configs = {mode: Driver(mode, "http://engine", None, 1.0).book for mode in MODES}  # type: ignore[arg-type]
    assert {m: b.config if b else None for m, b in configs.items()} == {
        "vllm": None, "manager": None, "plas": DEFAULT_SCHEDULING, "manager+plas": PROGRAM_ORDER,
        "plas+hold": PROGRAM_ORDER,
    }  # fmt: skip
