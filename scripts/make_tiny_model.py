"""Build a tiny random-weight Llama and a locally trained tokenizer, for real vLLM on a CPU.

No model hub is reachable from CI, so tests and benchmarks use this model: a 2-layer Llama
(hidden 128, 2 heads of 64: the CPU attention backend supports head sizes 32..512 in steps of
32) with random weights from a fixed seed, and a byte-level BPE tokenizer trained on a corpus
generated here from a fixed seed. Everything is deterministic: the same script writes
byte-identical files (``--check`` verifies that against a second build).

Run with the vLLM virtualenv (it has torch, transformers, tokenizers and safetensors)::

    .cache/vllm-venv/bin/python scripts/make_tiny_model.py .cache/tiny-llama

The output directory is a regular Hugging Face model directory (``config.json``,
``model.safetensors``, ``tokenizer.json``, ...), served with ``--model <dir>`` like any model;
a real model on a GPU takes the same code paths.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import tempfile
from pathlib import Path

VOCAB_SIZE = 4096
SEED = 20240611
SPECIAL = ["<unk>", "<s>", "</s>"]

# Words for the training corpus: the agent protocol's vocabulary (react's JSON replies) plus
# common English and code words, so that ordinary text tokenizes into a few tokens per word.
_LINES = (
    "You are an agent Reply with exactly one JSON object and nothing else to call a tool or when done",
    "Tools Task Assistant Tool Error answer arguments tool name text echo sleep seconds file write path",
    "content book cancel booking payment amount currency id key value result ok error true false null",
    "the of and to in is that for it as was with be by on not he this are or his from at which but have",
    "an they you were her she there been one all we their has would when if so no out up into time more",
    "def return class import from self None True False print range len list dict str int float yield",
    "async await with open while for break continue try except finally raise lambda pass assert global",
    "session call turn engine cache block prefix token prompt model request response latency memory",
)
_WORDS = [word for line in _LINES for word in line.split()]


def corpus(num_lines: int = 20_000) -> list[str]:
    rng = random.Random(SEED)
    lines = []
    for i in range(num_lines):
        kind = i % 4
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if kind == 0:
            lines.append(" ".join(words).capitalize() + ".")
        elif kind == 1:
            args = {rng.choice(_WORDS): rng.choice([rng.randint(0, 999), rng.choice(_WORDS)])}
            lines.append(json.dumps({"tool": rng.choice(_WORDS), "arguments": args}))
        elif kind == 2:
            lines.append(json.dumps({"answer": " ".join(words[:4])}))
        else:
            lines.append(f"def {words[0]}_{words[1]}({words[2]}, {words[3]}={rng.randint(0, 99)}):")
    # Every printable ASCII character once, so no text falls back to rare byte tokens.
    lines.append("".join(chr(c) for c in range(32, 127)))
    return lines


# Model shapes. ``tiny`` (the default): CI's model, where a prefill costs almost nothing.
# ``long``: enough layers and width, and an 8k window, that prefilling a 2-8k-token agent
# context takes seconds on a CPU, as it takes real time relative to tool gaps in deployments
# (bench/vllm_agents.py --regime long). Both: head size 64 (the CPU attention backend supports
# 32..512 in steps of 32), random weights from the same seed.
SHAPES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 2, "max_position_embeddings": 4096},
    "long": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 6, "num_attention_heads": 12,
             "num_key_value_heads": 4, "max_position_embeddings": 8192},
}  # fmt: skip


def build(out: Path, shape: str = "tiny") -> None:
    # One thread for the BPE trainer: its merges must not depend on thread scheduling.
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    dims = SHAPES[shape]
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=dims["max_position_embeddings"],
    )
    fast.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        **dims,
        head_dim=64,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def digest(directory: Path) -> str:
    """SHA-256 over the weights and the tokenizer (the files that decide what the model computes)."""
    h = hashlib.sha256()
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        h.update(name.encode())
        h.update((directory / name).read_bytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, nargs="?", default=Path(".cache/tiny-llama"))
    parser.add_argument("--force", action="store_true", help="rebuild even when the directory has a model")
    parser.add_argument("--check", action="store_true", help="build twice and fail unless the files are identical")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny", help="tiny (CI) or long (8k window)")
    args = parser.parse_args(argv)
    if (args.out / "model.safetensors").exists() and not args.force and not args.check:
        print(f"{args.out}: already built ({digest(args.out)[:16]})")
        return 0
    build(args.out, args.shape)
    print(f"{args.out}: built ({digest(args.out)[:16]})")
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            build(Path(tmp), args.shape)
            if digest(Path(tmp)) != digest(args.out):
                print("not deterministic: a second build differs", file=sys.stderr)
                return 1
        print("deterministic: a second build is identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
