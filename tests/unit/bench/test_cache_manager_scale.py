"""bench.cache_manager_scale's verdict: the goal is the Kafka worker's, never the in-memory ceiling's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cache_manager_scale import Row, goal_lines, main

pytestmark = pytest.mark.unit


def row(name: str, events_per_s: float, decide_s: list[float]) -> Row:
    return Row(name, num_events=int(events_per_s), seconds=1.0, num_decisions=len(decide_s), decide_s=decide_s)


def test_without_a_kafka_worker_row_the_goal_is_not_measured() -> None:
    """A run without a broker's rows must not pass the in-memory fold off as the worker."""
    fast_memory_only = [row("fold+decide (memory)", 50_000, [0.0001] * 100)]
    assert goal_lines(fast_memory_only) == [
        "goal >= 20,000 events/s from Kafka: not measured (no Kafka worker row in this run)"
    ]


def test_each_kafka_worker_row_gets_its_verdict() -> None:
    rows = [
        row("fold+decide (memory)", 50_000, [0.0001] * 100),
        row("Kafka worker, poll 500, librdkafka", 21_000, [0.0005] * 100),
        row("Kafka worker, poll 500, kafka-python", 15_000, [0.0005] * 98 + [0.003] * 2),
    ]
    met, slow = goal_lines(rows)
    assert "librdkafka: 21,000 -> met" in met and met.endswith("0.500 ms -> met")
    assert "kafka-python: 15,000 -> NOT met" in slow and slow.endswith("ms -> NOT met")


def test_a_row_run_in_rounds_is_judged_on_its_median_round_not_its_best() -> None:
    """One lucky round of three over the line does not meet the goal; the p99 is the median too."""
    name = "Kafka worker, poll 500, librdkafka"
    rows = [
        row(name, 21_500, [0.0005] * 100),
        row(name, 16_000, [0.003] * 100),
        row(name, 18_000, [0.0004] * 100),
    ]
    (line,) = goal_lines(rows)
    assert f"{name}: 18,000 (median of 3 rounds: 21,500, 16,000, 18,000) -> NOT met" in line
    assert line.endswith("0.500 ms -> met")


@pytest.mark.parametrize("ranked", [False, True])
def test_the_in_memory_rows_measure_the_manager_with_and_without_ranked_pins_side_by_side(
    ranked: bool, tmp_path: Path
) -> None:
    out = tmp_path / "scale.json"
    argv = ["--events", "3000", "--sessions", "200", "--no-kafka", "--json", str(out)]
    assert main([*argv, "--ranked-pins"] if ranked else argv) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    first = "fold+decide (memory, ranked)" if ranked else "fold+decide (memory)"
    beside = "fold+decide (memory)" if ranked else "fold+decide (memory, ranked)"
    assert list(rows)[:2] == [first, beside]
    assert rows[first]["decisions"] > 0 and rows[beside]["decisions"] > 0
