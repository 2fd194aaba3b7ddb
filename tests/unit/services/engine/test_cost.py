"""CostModel: the formulas on exact numbers, and the recompute-or-swap choice."""

from __future__ import annotations

import pytest

from services.engine.cost import CostModel

pytestmark = pytest.mark.unit


def test_defaults_describe_llama3_8b_on_an_a100() -> None:
    cost = CostModel()
    assert cost.block_bytes == 16 * 32 * 8 * 128 * 2 * 2 == 2 * 1024 * 1024
    assert cost.swap_ms(0) == 0.0
    assert cost.swap_ms(1) == pytest.approx(0.2 + 2 * 1024 * 1024 / 20e9 * 1000)
    assert cost.decode_ms(1, 0) == 10.0
    assert cost.decode_ms_per_context_token == pytest.approx(131_072 / 2.0e12 * 1000)
    assert cost.prefill_ms(0) == cost.call_overhead_ms == 3.0


def test_prefill_pays_per_token_and_per_attended_pair() -> None:
    cost = CostModel(call_overhead_ms=1.0, prefill_ms_per_token=0.5, prefill_attention_ms_per_token_pair=0.01)
    # 2 new tokens after 3 cached ones attend to 4 and 5 tokens: 9 pairs.
    assert cost.recompute_ms(2, 3) == pytest.approx(2 * 0.5 + 9 * 0.01)
    assert cost.prefill_ms(2, 3) == pytest.approx(1.0 + 2 * 0.5 + 9 * 0.01)


def test_decode_reads_the_growing_context_every_step() -> None:
    cost = CostModel(decode_ms_per_token=2.0, kv_bytes_per_token=1_000, hbm_bytes_per_s=1e6)  # 1 ms per token read
    # 3 steps after 10 tokens read 10, 11 and 12 tokens of KV.
    assert cost.decode_ms(3, 10) == pytest.approx(3 * 2.0 + 33 * 1.0)
    assert cost.decode_ms(0, 10) == 0.0


def test_swap_is_cheaper_than_recompute_by_default_and_ties_go_to_recompute() -> None:
    assert CostModel().recompute_vs_swap(1) == "swap"
    assert CostModel().recompute_vs_swap(1000) == "swap"
    assert CostModel(pcie_bytes_per_s=1e8).recompute_vs_swap(10) == "recompute"
    tie = CostModel(
        block_size=1,
        kv_bytes_per_token=1,
        prefill_ms_per_token=1.0,
        prefill_attention_ms_per_token_pair=0.0,
        pcie_bytes_per_s=1000.0,
        swap_overhead_ms=0.0,
    )
    assert tie.swap_ms(1) == tie.recompute_ms(1) == 1.0
    assert tie.recompute_vs_swap(1) == "recompute"


def test_bad_constants_are_rejected() -> None:
    with pytest.raises(ValueError, match="block_size"):
        CostModel(block_size=0)
    with pytest.raises(ValueError, match="bandwidths"):
        CostModel(pcie_bytes_per_s=0)
    with pytest.raises(ValueError, match="negative"):
        CostModel(decode_ms_per_token=-1)
    with pytest.raises(ValueError, match="negative"):
        CostModel().swap_ms(-1)
