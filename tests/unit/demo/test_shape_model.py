"""rlflow.demo.shape_model: random-init models of published shapes, for benchmarks without the hub.

The parameter counts are the published ones, worked out by hand from each model card's figures (not from the
tool's table): Qwen3-0.6B has 0.6B parameters of which 0.44B are not embeddings (per layer: q 1024x2048, k and v
1024x1024, o 2048x1024, q/k norms 128 each, MLP 3 x 1024x3072, two norms of 1024 = 15,730,944; x 28 + final norm
1024 = 440,467,456; plus the tied 151936 x 1024 embedding = 596,049,920); SmolLM2-135M has 134,515,008 (per layer
3,540,096, x 30 + 576, plus the tied 49152 x 576 embedding).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlflow.demo import shape_model as make_shape_model


@pytest.mark.parametrize("shape,total,embedding", [
    ("qwen3-0.6b", 596_049_920, 151_936 * 1024),
    ("smollm2-135m", 134_515_008, 49_152 * 576),
])
def test_parameter_counts_are_the_published_ones(shape, total, embedding):
    with torch.device("meta"):  # the shapes only, no memory
        model = AutoModelForCausalLM.from_config(make_shape_model.shape_config(shape))
    assert sum(p.numel() for p in model.parameters()) == total
    assert model.get_input_embeddings().weight.numel() == embedding
    assert model.config.tie_word_embeddings


def test_build_writes_a_loadable_model_with_the_tokenizers_ids(tiny_model, tmp_path):
    out = tmp_path / "shape"
    make_shape_model.main(["--shape", "smollm2-135m", "--layers", "1", "--tokenizer", str(tiny_model),
                           "--out", str(out)])
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.num_hidden_layers == 1 and model.config.hidden_size == 576
    assert model.config.eos_token_id == tok.eos_token_id and model.config.pad_token_id == tok.pad_token_id
    ids = tok("What is 6 - 5?", return_tensors="pt")["input_ids"]
    assert model(ids).logits.shape == (1, ids.shape[1], 49_152)


def test_unknown_shape_names_the_available_ones(tmp_path):
    with pytest.raises(ValueError, match="qwen3-0.6b, smollm2-135m"):
        make_shape_model.shape_config("qwen3-8b")
