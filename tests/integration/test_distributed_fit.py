"""FSDP2 runs of ``rlflow fit`` on CPU (gloo): the strategy alias through the CLI, 1-vs-2-process equivalence,
sharded checkpoints resumed, the SLURM launcher script and the lmdeploy recipe config.

The two-rank runs launch ``python -m rlflow fit --trainer.devices=2 --trainer.strategy=fsdp`` in a subprocess:
Lightning's own launcher starts the second rank. So that one process and two sample the very same completions,
they use :class:`SeededGroupRollout`, the ``hf`` backend seeded per prompt (the stock backend draws one random
stream per batch, which depends on how the batch is split over ranks), and a dense reward so the loss is not 0.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from rlflow.rollout.hf import HFRollout
from tests.helpers.fit import fit_args
from tests.helpers.paths import ROOT
from tests.helpers.processes import rlflow_env


# ----------------------------------------------------------------------------------- plugins for the runs
class SeededGroupRollout(HFRollout):
    """``hf`` generation one group at a time, the torch RNG seeded from the prompt's tokens: the same samples
    whichever rank a prompt lands on."""

    def generate(self, prompts, params, n=1, progress=None):
        out = []
        for prompt in prompts:
            torch.manual_seed(zlib.crc32(repr(prompt).encode()))
            out.extend(super().generate([prompt], params, n))
        return out


def digit_reward(completions, **kwargs):
    """A dense reward (share of digits in the completion), so groups have different rewards from step 1."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


def test_cli_maps_fsdp_to_fsdp2(tiny_model, tiny_data, tmp_path):
    from rlflow.cli import cli_main
    from rlflow.training.distributed import FSDP2Strategy

    args = fit_args(tiny_model, tiny_data, tmp_path, "--trainer.strategy=fsdp")
    args = [a.replace("--trainer.devices=1", "--trainer.devices=2") for a in args[1:]]  # no subcommand: no run
    cli = cli_main(args, run=False)
    assert isinstance(cli.trainer.strategy, FSDP2Strategy)
    assert cli.trainer.num_devices == 2


def test_fsdp2_bf16_on_a_cpu_without_bf16_hardware_is_named(tiny_model, tiny_data, tmp_path, monkeypatch):
    """The strategy ``fsdp2_bf16`` computes in bf16 (its ``param_dtype``, which the fit's check reads): on a CPU
    that emulates bf16 the warning names it and the float32 strategy to use."""
    import torch

    import rlflow.rollout.hardware as hardware
    from rlflow.cli import cli_main
    from rlflow.training.module import emulated_bf16

    monkeypatch.setattr(hardware, "native_bf16", lambda device: False)
    args = fit_args(tiny_model, tiny_data, tmp_path, "--trainer.strategy=fsdp2_bf16", "--trainer.precision=32-true")
    cli = cli_main(args[1:], run=False)
    strategy = cli.trainer.strategy
    assert strategy.param_dtype == torch.bfloat16
    message = emulated_bf16("32-true", torch.device("cpu"), torch.float32, getattr(strategy, "param_dtype", None))
    assert message and "--trainer.strategy fsdp2 (float32 compute)" in message


# ------------------------------------------------------------------------------- end to end through Lightning
SEEDED = [
    '--data.rollout={"class_path": "tests.integration.test_distributed_fit.SeededGroupRollout"}',
    '--data.judging.judgers={"*": "tests.integration.test_distributed_fit:digit_reward"}',
    # in a thread: these runs test sharding, not isolation (test_judger_isolation_fit.py does), and a worker process
    # zygote per rank is one more Python start with torch per rank and run
    "--data.judging.isolation=thread",
    "--model.loss.kl_coef=0.01",
    "--model.optim.lr=1e-4",
]


def read_metrics(log_dir: Path) -> list[dict[str, float]]:
    with open(log_dir / "metrics.csv") as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def run_two_ranks(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = rlflow_env()
    out = subprocess.run([sys.executable, "-m", "rlflow", *args], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def two_rank_run(tiny_model, tiny_data, tmp_path_factory):
    """4 steps on 2 gloo ranks under ``trainer.strategy=fsdp``, a sharded checkpoint after every step; packed
    micro-batches (the default) of at most 120 tokens, so the ranks' pack counts differ (prompts are 100 tokens);
    the KL reference reset to the policy after every second step (each rank its shards), so checkpoints hold it."""
    root = tmp_path_factory.mktemp("fsdp2")
    args = fit_args(
        tiny_model,
        tiny_data,
        root,
        *SEEDED,
        "--trainer.strategy=fsdp",
        "--model.update.pack_max_length=120",
        "--model.reference.sync_steps=2",
        "--model.reference.mixup_alpha=1.0",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        "--trainer.callbacks.every_n_train_steps=1",
        "--trainer.callbacks.save_top_k=-1",
        steps=4,
    )
    args = [a.replace("--trainer.devices=1", "--trainer.devices=2") for a in args]
    out = run_two_ranks(args, root)
    (root / "output.txt").write_text(out.stdout + out.stderr)
    return root, root / "lightning_logs" / "version_0", args


@pytest.mark.slow
def test_two_packed_ranks_give_the_same_step_one_loss_and_rewards_as_one_padded_process(
    two_rank_run, tiny_model, tiny_data, tmp_path
):
    """Sharding and packing together change nothing but the speed: 2 FSDP ranks training on packs (the default)
    take the step one process takes on padded micro-batches."""
    from rlflow.cli import cli_main

    root, log_dir, _ = two_rank_run
    assert "model.update.packing: micro-batches are packs" in (root / "output.txt").read_text()
    two = read_metrics(log_dir)[0]
    cli = cli_main(fit_args(tiny_model, tiny_data, tmp_path, *SEEDED, "--model.update.packing=false", steps=1))
    assert not cli.model.packing
    one = read_metrics(Path(cli.trainer.log_dir))[0]
    assert one["reward_std"] > 0 and abs(one["loss"]) > 1e-6  # a non-trivial step
    for key in (
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        "completions/mean_length",
        "completions/min_length",
        "completions/max_length",
        "num_tokens",
    ):
        assert two[key] == pytest.approx(one[key], rel=1e-6, abs=1e-7), key
    for key in ("loss", "grad_norm", "kl"):  # (entropy is a mean of per-micro-batch means: it depends on the split)
        assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key
    # both ranks wrote their own share of the trajectories: 2 prompts x 4 completions each per step
    assert sum(1 for _ in open(log_dir / "trajectories.jsonl")) == 4 * 2 * 4
    assert sum(1 for _ in open(log_dir / "trajectories.rank1.jsonl")) == 4 * 2 * 4


@pytest.mark.slow
def test_sharded_checkpoint_resumes_where_the_run_left_off(two_rank_run, tiny_model):
    from transformers import AutoModelForCausalLM

    root, log_dir, args = two_rank_run
    ckpt = log_dir / "checkpoints" / "epoch=0-step=3.ckpt"
    assert ckpt.is_dir() and len(list(ckpt.glob("*.distcp"))) == 2  # one shard file per rank
    full = read_metrics(log_dir)
    assert [r["step"] for r in full] == [0, 1, 2, 3]
    # the sharded reference was reset to the sharded policy after step 1: step 2's KL is exactly 0
    assert full[1]["kl"] > 0.0 and full[2]["kl"] == 0.0 and full[3]["kl"] > 0.0
    resumed_root = root / "resumed"
    resumed_args = [a.replace(str(root), str(resumed_root)) for a in args] + [f"--ckpt_path={ckpt}"]
    run_two_ranks(resumed_args, root)
    resumed = read_metrics(resumed_root / "lightning_logs" / "version_0")
    assert [r["step"] for r in resumed] == [3]
    # weights, the moved reference, optimizer state, sampler position and counters came back: step 4 repeats
    for key in ("reward", "completions/mean_length", "num_tokens"):
        assert resumed[0][key] == pytest.approx(full[3][key], rel=1e-6), key
    for key in ("loss", "grad_norm", "kl"):
        assert resumed[0][key] == pytest.approx(full[3][key], rel=1e-4, abs=1e-6), key
    # the HF export at the end holds the gathered full weights and reloads
    exported = AutoModelForCausalLM.from_pretrained(resumed_root / "lightning_logs" / "version_0" / "hf").state_dict()
    initial = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    assert exported.keys() == initial.keys()
    assert all(torch.isfinite(t).all() for t in exported.values())
    assert any(not torch.equal(exported[k], initial[k]) for k in initial)  # 4 optimizer steps moved the weights


# ------------------------------------------------------------------------------------------- multi-node launch
def test_slurm_script_passes_the_allocation_to_lightning(tmp_path):
    """``tools/slurm_grpo.sh`` under a fake ``srun``/``scontrol``: nodes and GPUs reach ``trainer.*``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\necho "SRUN $* MASTER=$MASTER_ADDR:$MASTER_PORT"\n')
    (bin_dir / "scontrol").write_text('#!/bin/bash\nprintf "node-a\\nnode-b\\n"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = dict(
        os.environ,
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        SLURM_JOB_NUM_NODES="2",
        SLURM_GPUS_PER_NODE="h100:8",
        SLURM_JOB_NODELIST="node-[a-b]",
        SLURM_JOB_ID="4242",
    )
    out = subprocess.run(
        ["bash", str(ROOT / "tools" / "slurm_grpo.sh"), "cfg.yaml", "--model.optim.lr=2e-6"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    line = next(l for l in out.stdout.splitlines() if l.startswith("SRUN"))
    assert (
        "--kill-on-bad-exit=1 rlflow fit --config cfg.yaml --trainer.num_nodes=2 --trainer.devices=8 "
        "--model.optim.lr=2e-6" in line
    )
    assert "MASTER=node-a:24242" in line
    missing = subprocess.run(
        ["bash", str(ROOT / "tools" / "slurm_grpo.sh")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode != 0 and "usage" in missing.stderr


@pytest.mark.slow
def test_lmdeploy_recipe_config_resolves(tiny_model):
    """The 8-GPU config parses: FSDP2 strategy with bf16 compute / fp32 reduction, lmdeploy rollout, XTuner's
    settings."""
    import yaml

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlflow",
            "fit",
            "--config",
            str(ROOT / "configs" / "grpo_gsm8k_qwen3_8b_lmdeploy.yaml"),
            f"--model.model_path={tiny_model}",
            "--print_config",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    cfg = yaml.safe_load(out.stdout)
    strategy = cfg["trainer"]["strategy"]
    assert strategy["class_path"] == "rlflow.training.distributed.FSDP2Strategy"
    assert (strategy["init_args"]["param_dtype"], strategy["init_args"]["reduce_dtype"]) == ("bfloat16", "float32")
    assert cfg["trainer"]["devices"] == 8
    assert cfg["data"]["rollout"]["class_path"] == "rlflow.rollout.lmdeploy.LMDeployRollout"
    m, d = cfg["model"], cfg["data"]
    loss = m["loss"]["init_args"]
    assert (d["prompt_repeat_k"], m["optim"]["lr"], loss["epsilon_low"], loss["epsilon_high"], loss["kl_coef"],
            loss["kl_type"]) == (5, 1e-6, 0.2, 0.28, 0.001, "low_var_kl")
    assert (d["max_prompt_length"], d["sampling"]["max_tokens"], d["global_batch_size"] % 8) == (512, 1024, 0)
