"""``model.update.skip_zero_advantage`` through ``rlflow fit``: the same optimizer steps as the full backward pass,
with only the sequences that train going through it, and a startup refusal in one line."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from rlflow.advantages.base import AdvantageEstimator
from tests.helpers.fit import fit_args


def controlled_fit(tiny_model, tiny_data, root: Path, skip: bool, monkeypatch) -> tuple:
    """Two rollout steps whose advantages are set here: step 1 +-1 in the first two groups and 0 in the others,
    step 2 all 0 (a step with no learning signal). Returns the CLI and each micro-batch's (sequences, backward)."""
    from rlflow.cli import cli_main
    from rlflow.data.datamodule import RolloutDataModule
    from rlflow.training.module import PolicyUpdate

    drained, micro_step = RolloutDataModule.minibatches, PolicyUpdate.micro_step
    steps, micro_batches = [], []

    def controlled(self, num):
        minibatches = drained(self, num)
        for mb in minibatches:
            for i, e in enumerate(mb):
                e.advantage = 0.0 if steps or e.group >= 2 else (1.0 if i % 2 else -1.0)
        steps.append(len(steps))
        return minibatches

    def recorded(self, module, micro, minibatch_size, ctx, step, backward=True):
        micro_batches.append((len(steps), len(micro), backward))
        return micro_step(self, module, micro, minibatch_size, ctx, step, backward)

    monkeypatch.setattr(RolloutDataModule, "minibatches", controlled)
    monkeypatch.setattr(PolicyUpdate, "micro_step", recorded)
    cli = cli_main(fit_args(tiny_model, tiny_data, root, f"--model.update.skip_zero_advantage={str(skip).lower()}",
                            "--model.optim.weight_decay=0.1", "--model.update.pack_max_length=64", steps=2))
    monkeypatch.undo()
    return cli, micro_batches


def rows(cli) -> list[dict[str, str]]:
    return [r for r in csv.DictReader(open(Path(cli.trainer.log_dir) / "metrics.csv")) if r.get("loss")]


@pytest.mark.slow
def test_the_skipped_sequences_change_nothing_but_the_work(tiny_model, tiny_data, tmp_path, monkeypatch):
    full, full_micro = controlled_fit(tiny_model, tiny_data, tmp_path / "full", False, monkeypatch)
    skip, skip_micro = controlled_fit(tiny_model, tiny_data, tmp_path / "skip", True, monkeypatch)
    # the work: every sequence goes backward in the full run; with the option, step 1's two trained groups only,
    # and step 2 (nothing trains) its one shortest sequence; the rest runs forward only
    assert all(backward for *_, backward in full_micro) and sum(n for s, n, _ in full_micro if s == 1) == 16
    backward = {s: sum(n for t, n, b in skip_micro if t == s and b) for s in (1, 2)}
    forward_only = {s: sum(n for t, n, b in skip_micro if t == s and not b) for s in (1, 2)}
    assert backward == {1: 8, 2: 1} and forward_only == {1: 8, 2: 15}
    # the same optimizer steps: every trained parameter stepped twice (step 2 on zero gradients: Adam's momentum
    # and the weight decay move it, as in the full run), and the same weights after them
    full_opt, skip_opt = full.model.optimizers().optimizer, skip.model.optimizers().optimizer
    params = [p for p in skip.model.policy.parameters() if p.requires_grad]
    assert len(skip_opt.state) == len(full_opt.state) == len(params)
    assert all(float(state["step"]) == 2 for state in skip_opt.state.values())
    for (name, a), b in zip(full.model.policy.named_parameters(), skip.model.policy.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7, msg=name)
    # the same logged update: loss and gradient norm (float rounding apart), 0 gradient on step 2
    logged_full, logged_skip = rows(full), rows(skip)
    for got, want in zip(logged_skip, logged_full):
        for key in ("loss", "grad_norm"):
            assert float(got[key]) == pytest.approx(float(want[key]), rel=1e-5, abs=1e-7), key
    assert float(logged_skip[1]["grad_norm"]) == 0.0 and float(logged_skip[0]["grad_norm"]) > 0
    assert float(logged_skip[0]["entropy"]) > 0  # the forward-only sequences still give their metrics


@pytest.mark.slow
def test_skipping_with_a_kl_term_is_refused_in_one_line_at_startup(tiny_model, tiny_data, tmp_path):
    import subprocess
    import sys

    from tests.helpers.paths import ROOT
    from tests.helpers.processes import rlflow_env

    args = fit_args(tiny_model, tiny_data, tmp_path, "--model.update.skip_zero_advantage=true",
                    "--model.loss.init_args.kl_coef=0.05", steps=1)
    done = subprocess.run([sys.executable, "-m", "rlflow", *args], cwd=ROOT, env=rlflow_env(), capture_output=True,
                          text=True, timeout=300)
    errors = [line for line in done.stderr.splitlines() if line.startswith("rlflow: error:")]
    assert done.returncode != 0 and len(errors) == 1, done.stderr[-2000:]
    assert "model.update.skip_zero_advantage=true" in errors[0] and "kl_coef=0.05" in errors[0]
    assert not list(tmp_path.rglob("*.ckpt"))


class RankZeroSolvedEverything(AdvantageEstimator):
    """Advantage 0 for every completion on rank 0 (every group's rewards agreed) and +1/-1 by turns elsewhere: rank 0
    trains nothing, rank 1 everything, so the ranks' passes differ in number and kind."""

    def compute(self, grouped, lengths=None):
        if dist.is_initialized() and dist.get_rank() == 0:
            return torch.zeros_like(grouped)
        return torch.tensor([1.0, -1.0]).repeat(grouped.shape[1] // 2 + 1)[: grouped.shape[1]].expand_as(grouped)


@pytest.mark.slow
def test_two_fsdp_ranks_that_leave_out_different_sequences_take_the_full_passs_step(tiny_model, tiny_data, tmp_path):
    """Rank 0 runs one pass forward and backward and its other sequences forward only, rank 1 all of its sequences
    forward and backward in more packs: each rank evens out its passes with passes that change nothing, nothing
    hangs, and the two steps give the weights the full backward pass gives."""
    from safetensors.torch import load_file

    from tests.integration.test_distributed_fit import run_two_ranks

    runs = {}
    estimator = '{"class_path": "tests.integration.test_skip_zero_advantage_fit.RankZeroSolvedEverything"}'
    for skip in ("false", "true"):
        root = tmp_path / skip
        root.mkdir()
        args = fit_args(
            tiny_model, tiny_data, root,
            '--data.rollout={"class_path": "tests.integration.test_distributed_fit.SeededGroupRollout"}',
            '--data.judging.judgers={"*": "tests.integration.test_distributed_fit:digit_reward"}',
            "--data.judging.isolation=thread", "--trainer.strategy=fsdp", "--model.update.pack_max_length=120",
            f"--data.advantage={estimator}",
            "--model.optim.weight_decay=0.1", f"--model.update.skip_zero_advantage={skip}", steps=2)
        run_two_ranks([a.replace("--trainer.devices=1", "--trainer.devices=2") for a in args], root)
        log_dir = root / "lightning_logs" / "version_0"
        runs[skip] = (load_file(log_dir / "hf" / "model.safetensors"),
                      [r for r in csv.DictReader(open(log_dir / "metrics.csv")) if r.get("loss")])
    (full, full_rows), (skipped, skip_rows) = runs["false"], runs["true"]
    assert full.keys() == skipped.keys()
    for name, weight in full.items():
        torch.testing.assert_close(skipped[name], weight, rtol=1e-5, atol=1e-7, msg=name)
    for got, want in zip(skip_rows, full_rows):
        assert float(got["grad_norm"]) == pytest.approx(float(want["grad_norm"]), rel=1e-5, abs=1e-7)
        assert float(got["grad_norm"]) > 0
