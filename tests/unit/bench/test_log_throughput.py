"""bench.log_throughput's table: both ratios, by the wall clock and by the process's CPU time."""

from __future__ import annotations

import pytest

from bench.log_throughput import Phase, Timing, format_table

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
