r"""Build a randomly initialised model with a real model's shape, for benchmarks where no weights can be downloaded.

Why: speed at real scale depends on the shapes (layers, widths, heads, vocabulary), not on the weights, and a
machine without the hub (the lent GPU machines, CI) cannot fetch them. Random weights sample nearly uniformly over
the vocabulary, so completions run to ``max_tokens``: a steady decode load. :func:`build` writes one;
``tools/make_shape_model.py`` is its command line::

    python tools/make_shape_model.py --shape qwen3-0.6b --tokenizer checkpoints/tiny-qwen3 --out /tmp/qwen3-0.6b
    python benchmarks/bench_rollout.py --model /tmp/qwen3-0.6b --device cuda --dtype both --max-tokens 256

The tokenizer is copied from ``--tokenizer`` (any tokenizer whose ids fit the vocabulary; the tiny model's
character tokenizer keeps prompts at GSM8K-like lengths). ``--layers`` cuts the depth (quick CPU checks of the
same widths). Simplifications: the configs in :data:`SHAPES` are those published on the hub for these models;
``initializer_range`` is transformers' default init, not a trained model's weight statistics.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

#: Published configs (config.json on the hub) of the shapes the benchmarks use.
SHAPES: dict[str, dict] = {
    "qwen3-0.6b": dict(
        model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        attention_bias=False,
    ),
    "smollm2-135m": dict(
        model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
        rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, attention_bias=False,
    ),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt")


def shape_config(shape: str, layers: int | None = None):
    """The transformers config of ``shape`` (:data:`SHAPES`), with ``layers`` decoder layers if given."""
    from transformers import AutoConfig

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; available: {', '.join(SHAPES)}")
    fields = dict(SHAPES[shape])
    if layers is not None:
        fields["num_hidden_layers"] = layers
    model_type = fields.pop("model_type")
    rope_theta = fields.pop("rope_theta")
    config = AutoConfig.for_model(model_type, **fields)
    config.rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}
    return config


def build(shape: str, out: Path, tokenizer: Path, layers: int | None = None, seed: int = 0):
    """Write a random-init model of ``shape`` (with ``layers`` decoder layers if given) and ``tokenizer``'s files
    to ``out``; return the model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = shape_config(shape, layers)
    if not (tokenizer / "tokenizer_config.json").exists():
        raise FileNotFoundError(f"--tokenizer {tokenizer} has no tokenizer_config.json")
    tok = AutoTokenizer.from_pretrained(tokenizer)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the ids this tokenizer uses
        setattr(config, name, getattr(tok, name))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, out / name)
    return model


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3-0.6b", help=f"one of {', '.join(SHAPES)}")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--tokenizer", default=Path("checkpoints/tiny-qwen3"), type=Path,
                    help="directory whose tokenizer files are copied (ids must fit the vocabulary)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's own)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    model = build(args.shape, args.out, args.tokenizer, args.layers, args.seed)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.shape}: {model.config.num_hidden_layers} layers, {params:,} parameters, random init -> {args.out}")


if __name__ == "__main__":
    main()
