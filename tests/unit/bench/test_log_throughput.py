"""bench.log_throughput's table: both ratios, by the wall clock and by the process's CPU time; the goal's verdict
on the median of the rounds."""

from __future__ import annotations

import pytest

from bench.log_throughput import GOAL_RATIO, Phase, Timing, format_table, goal_lines

pytestmark = pytest.mark.unit

INFO = {
    "cores": 2,
    "python": "3.11",
    "kafka_python": "3",
    "crc32c": "native",
    "platform": "linux",
    "gc_thresholds": (50_000, 20, 10),
    "readers": "compiled",
    "load_average": "1.0 -> 1.0",
}


def test_the_cpu_ratio_compares_events_per_cpu_second() -> None:
    # agentlog: 1,000 events in 0.05 s of wall, 0.04 s of CPU; raw: in 0.02 s and 0.01 s.
    phase = Phase("consume", Timing(0.05, 1000, 400_000, cpu_s=0.04), Timing(0.02, 1000, 400_000, cpu_s=0.01))
    assert phase.ratio == pytest.approx(0.4)
    assert phase.cpu_ratio == pytest.approx(0.25)
    assert Phase("decode+verify", Timing(0.01, 1000, 400_000, cpu_s=0.01)).cpu_ratio is None


def test_the_table_shows_both_ratios_and_what_the_process_ran_with() -> None:
    phases = [
        Phase("consume [rdkafka]", Timing(0.05, 1000, 400_000, cpu_s=0.04), Timing(0.02, 1000, 400_000, cpu_s=0.01)),
        Phase("decode+verify", Timing(0.01, 1000, 400_000, cpu_s=0.01)),
    ]
    table = format_table(phases, 1000, 4, INFO)
    consume = next(line for line in table.splitlines() if line.startswith("consume [rdkafka]"))
    assert consume.split()[-2:] == ["0.40", "0.25"]
    assert "per CPU s" in table
    assert "record readers compiled; collector thresholds (50000, 20, 10)" in table


def _round(consume_cpu_s: float, append_cpu_s: float = 0.01) -> list[Phase]:
    """One round where raw takes 0.01 s of CPU and 0.02 s of wall for each phase's 1,000 events."""
    raw = Timing(0.02, 1000, 400_000, cpu_s=0.01)
    return [
        Phase("append [rdkafka]", Timing(0.02, 1000, 400_000, cpu_s=append_cpu_s), raw),
        Phase("consume [rdkafka]", Timing(0.02, 1000, 400_000, cpu_s=consume_cpu_s), raw),
        Phase("decode+verify", Timing(0.01, 1000, 400_000, cpu_s=0.01)),
    ]


def test_the_goal_is_decided_on_the_median_round_not_the_best_one() -> None:
    # consume per CPU s: 1.00, 0.50, 0.625 of raw: one round over the line, the median under it.
    lines = goal_lines([_round(0.01), _round(0.02), _round(0.016)])
    assert "  consume [rdkafka]  1.00 0.50 0.62" in lines
    verdict = lines[-1]
    assert verdict.startswith(f"goal >= {GOAL_RATIO:g}x raw kafka-python, median per CPU s over 3 rounds")
    assert "append [rdkafka] 1.00 -> met (wall clock 1.00)" in verdict
    assert "consume [rdkafka] 0.62 -> NOT met (wall clock 1.00)" in verdict
    assert "decode+verify" not in verdict  # in memory: no raw side, no goal


def test_the_goal_line_says_when_nothing_was_measured_on_both_sides() -> None:
    lines = goal_lines([[Phase("decode+verify", Timing(0.01, 1000, 400_000, cpu_s=0.01))]])
    assert lines == [f"goal >= {GOAL_RATIO:g}x raw kafka-python: not measured (no phase ran on both sides)"]
