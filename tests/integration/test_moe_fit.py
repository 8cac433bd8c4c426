"""``rlflow fit`` with an MoE policy adds ``router_aux_loss_coef * aux_loss`` to the step's loss (checked against
a run without it)."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest
from transformers import AutoConfig

from rlflow.config_error import ConfigError
from tests.helpers.fit import fit_args
from tests.unit.models.test_moe import tiny_moe

MOE = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, max_position_embeddings=256)


def moe_model(tiny_model: Path, out: Path) -> Path:
    """A tiny MoE model with the tiny model's tokenizer, saved at ``out``."""
    tiny_moe(AutoConfig.from_pretrained(tiny_model).vocab_size).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny_model / name).exists():
            shutil.copy(tiny_model / name, out / name)
    return out


@pytest.mark.slow
def test_fit_adds_the_weighted_aux_loss(tiny_model, tiny_data, tmp_path):
    """Two one-step runs from the same seed and weights sample the same rollout, so their first losses differ by
    exactly ``coef * aux_loss`` (one packed micro-batch)."""
    from rlflow.cli import cli_main

    moe_dir = moe_model(tiny_model, tmp_path / "moe")

    def first_row(root: Path, coef: str) -> dict[str, str]:
        cli = cli_main(fit_args(moe_dir, tiny_data, root, f"--model.policy.router_aux_loss_coef={coef}", steps=1))
        return next(r for r in csv.DictReader(open(Path(cli.trainer.log_dir) / "metrics.csv")) if r.get("loss"))

    with_aux, without = first_row(tmp_path / "a", "0.5"), first_row(tmp_path / "b", "0")
    aux = float(with_aux["aux_loss"])
    assert aux > 0 and not without.get("aux_loss")  # coefficient 0: no term, no metric
    assert float(with_aux["reward"]) == float(without["reward"])  # the same rollout
    assert float(with_aux["loss"]) - float(without["loss"]) == pytest.approx(0.5 * aux, rel=1e-4, abs=1e-6)



@pytest.mark.slow
def test_skipping_zero_advantage_sequences_is_refused_for_an_moe_policy(tiny_model, tiny_data, tmp_path):
    """Even without its load-balancing loss: the experts that get a gradient depend on the sequences that run."""
    from rlflow.cli import cli_main

    moe_dir = moe_model(tiny_model, tmp_path / "moe")
    args = fit_args(moe_dir, tiny_data, tmp_path, "--model.policy.router_aux_loss_coef=0",
                    "--model.update.skip_zero_advantage=true", steps=1)
    with pytest.raises(ConfigError, match="mixture of experts"):
        cli_main(args)
