"""The cache-policy bench (bench/cache_policies.py) on a tiny trace: every policy runs to the end."""

from __future__ import annotations

import random

import pytest

from bench.cache_policies import POLICIES, Row, print_tables, run_one, service_s, write_csv
from services.engine.cost import CostModel
from services.traces.model import Trace, TraceSession, TraceTurn
from services.traces.synthetic import synthetic


def _trace() -> Trace:
    turns = (
        TraceTurn(200, 5, "search", 1.0, 40),
        TraceTurn(10, 5, "human", 30.0, 20),
        TraceTurn(10, 5),
    )
    return Trace(tuple(TraceSession(f"s{i}", "test", float(i), turns) for i in range(4)))


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_finishes_every_session(policy: str) -> None:
    cost = CostModel()
    m = run_one(_trace(), policy, gpu_blocks=40, cost=cost)
    assert len(m.jct) == 4 and all(j > 0 for j in m.jct)
    assert m.prompt_tokens > m.computed_tokens > 0


def test_vllm_neither_pins_nor_swaps_and_ample_memory_equalises() -> None:
    cost = CostModel()
    trace = synthetic(6, rng=random.Random(1), arrival_rate_per_s=0.5, median_output_tokens=20)
    m = run_one(trace, "vllm", gpu_blocks=20_000, cost=cost)
    assert (m.idle_block_s, m.swapped_in_blocks, m.swapped_out_blocks, m.forced) == (0.0, 0, 0, 0)
    oracle = run_one(trace, "oracle", gpu_blocks=20_000, cost=cost)
    ours = run_one(trace, "ours", gpu_blocks=20_000, cost=cost)
    # Nothing is ever evicted: every policy recomputes the same tokens.
    assert oracle.computed_tokens == ours.computed_tokens == m.computed_tokens
    assert service_s(trace, cost) > 0


def test_tables_and_csv(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    rows = [Row("w", 0.5, 1.0, 0.25, 10, p, 2.0, 3.0, 5, 0.5, 0.0, 0.0, 0) for p in ("vllm", "ours")]
    print_tables(rows)
    assert "ours 2.00 best baseline vllm 2.00 -> tie" in capsys.readouterr().out
    write_csv(rows, tmp_path / "out.csv")
    assert (tmp_path / "out.csv").read_text().splitlines()[0].startswith("workload,load,rate")
