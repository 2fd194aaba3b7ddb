"""How long an engine takes to prefill, decode and move KV blocks: a roofline-style model.

The defaults describe Llama-3-8B (bf16) served by vLLM on one NVIDIA A100-SXM4-80GB,
batch size 1. They are ASSUMPTIONS derived from public specifications and a few
published measurements, not measurements of ours; set the fields for other hardware.

- KV bytes per token, 131,072: Llama-3-8B's config has 32 layers, 8 KV heads (GQA)
  of dimension 128; K and V, 2 bytes each in bf16: 32 * 8 * 128 * 2 * 2.
- Prefill, 0.1 ms per token (about 10k tokens/s): a forward pass costs about
  2 * 8.0e9 = 16 GFLOP per token; at about 160 TFLOPS achieved, half of the A100's
  312 TFLOPS dense bf16 peak (NVIDIA A100 datasheet). Prefill is compute bound.
- Prefill attention, 3.3e-6 ms per (query token, context token) pair:
  QK^T and AV cost 4 * 32 layers * 4096 (hidden) = 524,288 FLOPs per pair, at the
  same 160 TFLOPS. It adds about 3% at 1k tokens of context and about 25% at 8k.
- Decode, 10 ms per token: batch-1 decode is memory bound; reading 16 GB of bf16
  weights at the A100-80GB's 2,039 GB/s takes 7.9 ms. A published vLLM sweep
  (johnmusgrave.com, "vLLM throughput-latency sweep on NVIDIA A100": Llama-3.1-8B,
  one request, about 75 tokens/s on an A100-40GB, 77% of its bandwidth roofline)
  puts the 80 GB card at about 10 ms per token.
- Decode also reads the whole KV cache every step: kv_bytes_per_token / HBM
  bandwidth (2.0e12 B/s) = 6.6e-5 ms per context token per step (about 0.5 ms per
  step at 8k tokens of context).
- Swap, 20 GB/s: PCIe Gen4 x16 carries 32 GB/s per direction raw and 20-25 GB/s in
  practice with pinned host memory; a vLLM block is copied as many 32 KiB pieces
  (per layer, for K and V), so we take the low end. A block of 16 tokens is 2 MiB:
  0.105 ms per block, about 15x cheaper than recomputing it (1.6 ms).
- Per-call overhead, 3 ms, and per-swap overhead, 0.2 ms (scheduling, launches,
  synchronization): rough guesses.

**Batched decode** (``batch_step_ms``, ``batch_steps_ms``; for a continuous-batching
engine model, the cache-policy benchmark's): one decode step of a batch reads the
weights once, whatever the batch size, and computes and reads KV per sequence. Of
the 10 ms batch-1 step, ``decode_ms_per_sequence`` = 0.1 ms is per-sequence compute
(16 GFLOP per token at 160 TFLOPS, as prefill) and the remaining 9.9 ms
(``decode_step_fixed_ms``) is the weight read every step pays once. So a step of
``B`` sequences whose contexts total ``C`` tokens costs ``9.9 + 0.1 * B + C *
decode_ms_per_context_token`` ms, plus the prefill work (``prefill_ms``) of the calls
that join the batch in that step; with ``B = 1`` the steps of a call add up to
exactly ``prefill_ms + decode_ms`` (the batch-1 numbers above). Batching stops
paying at about 100 sequences, where per-sequence compute equals the weight read (the
roofline's ridge); KV reads grow with every sequence's context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["CostModel", "ReloadMethod"]

ReloadMethod = Literal["recompute", "swap"]

_MS_PER_S = 1000.0


@dataclass(frozen=True, slots=True)
class CostModel:
    """Milliseconds for the work of one call; see the module docstring for the defaults."""

    block_size: int = 16  # tokens per KV block (vLLM's default on CUDA)
    kv_bytes_per_token: int = 131_072
    call_overhead_ms: float = 3.0
    prefill_ms_per_token: float = 0.1
    prefill_attention_ms_per_token_pair: float = 3.3e-6
    decode_ms_per_token: float = 10.0
    hbm_bytes_per_s: float = 2.0e12
    pcie_bytes_per_s: float = 20e9
    swap_overhead_ms: float = 0.2
    decode_ms_per_sequence: float = 0.1  # of decode_ms_per_token: per-sequence compute in a batched step

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.kv_bytes_per_token <= 0:
            raise ValueError(
                f"need block_size > 0 and kv_bytes_per_token > 0, got {self.block_size}, {self.kv_bytes_per_token}"
            )
        if self.hbm_bytes_per_s <= 0 or self.pcie_bytes_per_s <= 0:
            raise ValueError(
                f"bandwidths must be positive, got hbm {self.hbm_bytes_per_s} and pcie {self.pcie_bytes_per_s}"
            )
        times = (
            self.call_overhead_ms,
            self.prefill_ms_per_token,
            self.prefill_attention_ms_per_token_pair,
            self.decode_ms_per_token,
            self.swap_overhead_ms,
            self.decode_ms_per_sequence,
        )
        if min(times) < 0:
            raise ValueError(f"times must not be negative, got {times}")

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block (all layers, K and V)."""
        return self.block_size * self.kv_bytes_per_token

    @property
    def decode_ms_per_context_token(self) -> float:
        """Time to read one token's KV from HBM, paid by every decode step."""
        return self.kv_bytes_per_token / self.hbm_bytes_per_s * _MS_PER_S

    def recompute_ms(self, num_tokens: int, context_tokens: int = 0) -> float:
        """Compute of prefilling ``num_tokens`` after ``context_tokens`` already in cache
        (no per-call overhead). Token i attends to ``context_tokens + i + 1`` tokens."""
        _check_counts(num_tokens, context_tokens)
        num_pairs = num_tokens * context_tokens + num_tokens * (num_tokens + 1) // 2
        return num_tokens * self.prefill_ms_per_token + num_pairs * self.prefill_attention_ms_per_token_pair

    def prefill_ms(self, num_tokens: int, context_tokens: int = 0) -> float:
        """Time to first token of a call that prefills ``num_tokens`` after a cached prefix
        of ``context_tokens``: the per-call overhead plus ``recompute_ms``."""
        return self.call_overhead_ms + self.recompute_ms(num_tokens, context_tokens)

    def decode_ms(self, num_tokens: int, context_tokens: int) -> float:
        """Time to generate ``num_tokens`` after ``context_tokens`` (the prompt): each step
        costs ``decode_ms_per_token`` plus reading the KV of the context so far."""
        _check_counts(num_tokens, context_tokens)
        num_kv_reads = num_tokens * context_tokens + num_tokens * (num_tokens - 1) // 2
        return num_tokens * self.decode_ms_per_token + num_kv_reads * self.decode_ms_per_context_token

    @property
    def decode_step_fixed_ms(self) -> float:
        """Of a decode step, what the batch pays once (the weight read), whatever its size."""
        return max(0.0, self.decode_ms_per_token - self.decode_ms_per_sequence)

    def batch_step_ms(self, num_sequences: int, context_tokens: int) -> float:
        """One decode step of a batch of ``num_sequences`` whose contexts total ``context_tokens``
        (each sequence reads its whole context): the weight read once, per-sequence compute,
        every sequence's KV. 0 for an empty batch. With one sequence it is one step of ``decode_ms``."""
        return self.batch_steps_ms(1, num_sequences, context_tokens)

    def batch_steps_ms(self, num_steps: int, num_sequences: int, context_tokens: int) -> float:
        """``num_steps`` consecutive decode steps of the same ``num_sequences`` sequences, whose
        contexts total ``context_tokens`` at the first step and grow by one token per sequence per
        step. ``batch_steps_ms(n, 1, c) == decode_ms(n, c)``."""
        _check_counts(num_steps, num_sequences)
        _check_counts(context_tokens, 0)
        if num_steps == 0 or num_sequences == 0:
            return 0.0
        per_step = self.decode_step_fixed_ms + num_sequences * (self.decode_ms_per_token - self.decode_step_fixed_ms)
        num_kv_reads = num_steps * context_tokens + num_sequences * num_steps * (num_steps - 1) // 2
        return num_steps * per_step + num_kv_reads * self.decode_ms_per_context_token

    def swap_ms(self, num_blocks: int) -> float:
        """Time to move ``num_blocks`` between host and GPU over PCIe (either way)."""
        _check_counts(num_blocks, 0)
        if num_blocks == 0:
            return 0.0
        return self.swap_overhead_ms + num_blocks * self.block_bytes / self.pcie_bytes_per_s * _MS_PER_S

    def recompute_vs_swap(self, num_blocks: int) -> ReloadMethod:
        """The cheaper way to get back a prefix of ``num_blocks`` blocks: swap it in, or
        recompute it from the start. A tie goes to "recompute" (it needs no host memory)."""
        if self.swap_ms(num_blocks) < self.recompute_ms(num_blocks * self.block_size):
            return "swap"
        return "recompute"


def _check_counts(num_tokens: int, context_tokens: int) -> None:
    if num_tokens < 0 or context_tokens < 0:
        raise ValueError(f"counts must not be negative, got {num_tokens} and {context_tokens}")
