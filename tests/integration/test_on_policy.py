"""Strictly on-policy by default: step n trains on completions sampled from the weights after step n-1.

Lightning prefetches the next batch before the current step runs; rlflow's dataloader yields only prompts, and
generation happens inside ``training_step``. These tests prove it two ways: by the version stamp on each
experience, and by fingerprinting the actual weights at generation time.
"""

from __future__ import annotations

import lightning as L
import torch

from rlflow.cli import cli_main
from rlflow.judgers.runner import JudgerRunner
from rlflow.rollout.hf import HFRollout
from tests.helpers.fit import fit_args


def length_reward(prompts, completions, completion_ids, **kwargs):
    """A TRL-style reward with spread on a random model (so advantages, and updates, are non-zero)."""
    return [float(len(ids)) for ids in completion_ids]


def fingerprint(model: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() * (i + 1) for i, p in enumerate(model.parameters())))


class RecordingRollout(HFRollout):
    """The ``hf`` backend, noting a fingerprint of the weights it samples from."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[float] = []

    def generate(self, prompts, params, n=1, progress=None):
        self.seen.append(fingerprint(self.model))
        return super().generate(prompts, params, n, progress=progress)


class AfterStep(L.Callback):
    """Fingerprints the weights after every training step (i.e. after its optimizer step)."""

    def __init__(self) -> None:
        self.after: list[float] = []
        self.own_records: list[bool] = []  # whether the step's batch held the datamodule's own records

    def on_train_start(self, trainer, pl_module):
        self.after.append(fingerprint(pl_module.policy))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after.append(fingerprint(pl_module.policy))
        own = {id(r) for r in trainer.datamodule.train_records}
        self.own_records.append(all(id(r) in own for r in batch))


def test_each_step_trains_on_completions_from_the_previous_steps_weights(tiny_model, tiny_data, tmp_path):
    cli = cli_main(fit_args(tiny_model, tiny_data, tmp_path, steps=4)[1:], run=False)
    rollout, probe = RecordingRollout(), AfterStep()
    cli.datamodule.backend = rollout
    cli.datamodule.judges.default = JudgerRunner({"*": length_reward})
    cli.trainer.callbacks.append(probe)
    cli.trainer.fit(cli.model, cli.datamodule)

    # stamps: the update that makes version n+1 trains on experience sampled by version n
    assert cli.model.trained_versions == [(n, n) for n in range(4)]
    # weights: generation n saw exactly the weights left by step n-1 (the initial weights for n = 0)
    assert len(rollout.seen) == 4
    assert rollout.seen == probe.after[:4]
    # and the weights did change between steps, so the comparison above is not vacuous
    assert len(set(probe.after)) > 1
    # the prompt batch reached the step as the datamodule's own records: Lightning's default batch transfer would
    # have copied every record and token id, each step (RolloutDataModule.transfer_batch_to_device)
    assert probe.own_records == [True] * 4


def test_several_optimizer_steps_per_rollout_are_stamped_with_their_lag(tiny_model, tiny_data, tmp_path):
    cli = cli_main(
        fit_args(tiny_model, tiny_data, tmp_path, "--model.update.optimizer_steps=2", steps=2)[1:], run=False
    )
    cli.trainer.fit(cli.model, cli.datamodule)
    # two rollout steps x two mini-batches: the second mini-batch of each rollout is one version behind
    assert cli.model.trained_versions == [(0, 0), (1, 0), (2, 2), (3, 2)]
