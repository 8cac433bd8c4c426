"""FSDP2 through Lightning on CPU (gloo): sharding helpers, metric reduction, 1-vs-2-process equivalence, resume.

The end-to-end runs launch ``python -m rlflow fit --trainer.devices=2 --trainer.strategy=fsdp`` in a subprocess:
Lightning's own launcher starts the second rank. So that one process and two sample the very same completions,
they use :class:`SeededGroupRollout`, the ``hf`` backend seeded per prompt (the stock backend draws one random
stream per batch, which depends on how the batch is split over ranks), and a dense reward so the loss is not 0.
"""

from __future__ import annotations

import csv
import os
import statistics
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from conftest import ROOT, fit_args

from rlflow.rollout.hf import HFRollout

TESTS = Path(__file__).resolve().parent


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


# ------------------------------------------------------------------------------------------ pure helpers
def test_combine_metrics_matches_statistics_over_the_pooled_samples():
    from rlflow.training.distributed import combine_metrics

    rank_samples = [[0.0, 1.0, 1.0, 0.5], [0.25, 0.0, 1.0, 1.0]]
    lengths = [[3, 7, 12, 12], [1, 12, 5, 9]]
    per_rank = []
    for rewards, lens in zip(rank_samples, lengths):
        terminated = [n for n in lens if n < 12]
        per_rank.append({
            "reward": statistics.fmean(rewards),
            "rewards/j/mean": statistics.fmean(rewards),
            "rewards/j/std": statistics.stdev(rewards),
            "completions/min_length": min(lens),
            "completions/max_length": max(lens),
            "completions/clipped_ratio": sum(n == 12 for n in lens) / len(lens),
            "completions/mean_terminated_length": statistics.fmean(terminated),
            "num_completion_tokens": float(sum(lens)),
            "rollout/time": 1.0 + len(per_rank),
            "loss": 0.25 * (1 + len(per_rank)),
        })
    out = combine_metrics(per_rank, samples_per_rank=4, sum_keys={"loss"})
    pooled = rank_samples[0] + rank_samples[1]
    all_lengths = lengths[0] + lengths[1]
    assert out["reward"] == pytest.approx(statistics.fmean(pooled))
    assert out["rewards/j/std"] == pytest.approx(statistics.stdev(pooled))
    assert out["completions/min_length"] == 1 and out["completions/max_length"] == 12
    assert out["completions/clipped_ratio"] == pytest.approx(sum(n == 12 for n in all_lengths) / 8)
    assert out["completions/mean_terminated_length"] == pytest.approx(
        statistics.fmean([n for n in all_lengths if n < 12])
    )
    assert out["num_completion_tokens"] == sum(all_lengths)
    assert out["rollout/time"] == 2.0  # the slowest rank
    assert out["loss"] == pytest.approx(0.25 + 0.5)  # each rank's share of the global loss adds up


def test_strategy_alias_and_registry():
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import StrategyRegistry

    from rlflow.training.distributed import FSDP2Strategy, resolve_strategy_alias

    assert resolve_strategy_alias("fsdp") == "fsdp2"
    assert resolve_strategy_alias("ddp") == "ddp"
    for name in ("fsdp2", "fsdp2_bf16", "fsdp2_cpu_offload"):
        assert name in StrategyRegistry
    trainer = Trainer(strategy="fsdp2_bf16", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, FSDP2Strategy)
    assert trainer.strategy.param_dtype == torch.bfloat16 and trainer.strategy.reduce_dtype == torch.float32
    with pytest.raises(ValueError, match="bfloat16"):
        FSDP2Strategy(param_dtype="bf16")
    offload = Trainer(strategy=FSDP2Strategy(cpu_offload=True), accelerator="cpu", devices=2, logger=False)
    with pytest.raises(ValueError, match="CUDA"):  # refused before any process group is created
        offload.strategy.setup_environment()


def test_cli_maps_fsdp_to_fsdp2(tiny_model, tiny_data, tmp_path):
    from rlflow.cli import cli_main
    from rlflow.training.distributed import FSDP2Strategy

    args = fit_args(tiny_model, tiny_data, tmp_path, "--trainer.strategy=fsdp")
    args = [a.replace("--trainer.devices=1", "--trainer.devices=2") for a in args[1:]]  # no subcommand: no run
    cli = cli_main(args, run=False)
    assert isinstance(cli.trainer.strategy, FSDP2Strategy)
    assert cli.trainer.num_devices == 2


def test_decoder_layers_are_found_or_the_error_says_why(tiny_model):
    from transformers import AutoModelForCausalLM

    from rlflow.training.distributed import decoder_layers

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    layers = decoder_layers(model)
    assert layers == list(model.model.layers)
    with pytest.raises(ValueError, match="_no_split_modules"):
        decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))


# -------------------------------------------------------------------------- sharding helpers on 2 ranks
def _sharded_worker(rank: int, init_file: str, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from rlflow.data.experience import Experience, collate
    from rlflow.training.distributed import (
        full_tensor,
        full_weights,
        gather_full_state_dict,
        shard_model,
        sharded_completion_logprobs,
    )
    from rlflow.training.logprobs import naive_token_stats

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        plain = AutoModelForCausalLM.from_pretrained(model_dir)
        sharded = shard_model(AutoModelForCausalLM.from_pretrained(model_dir), init_device_mesh("cpu", (2,)))
        results = {}
        # generation: rank 1 runs 4 times as many decode steps; inside full_weights no collective is waiting
        prompt = torch.tensor([[5, 9, 17, 23]])
        with torch.no_grad(), full_weights(sharded):
            got = sharded.generate(input_ids=prompt, max_new_tokens=3 + 9 * rank, do_sample=False, eos_token_id=None)
        want = plain.generate(input_ids=prompt, max_new_tokens=3 + 9 * rank, do_sample=False, eos_token_id=None)
        results["generate_equal"] = torch.equal(got, want)
        results["resharded"] = all(type(p).__name__ == "DTensor" for p in sharded.parameters())
        # log-probs and gradients through the sharded path equal the plain model's full logits
        exps = [Experience([5, 9, 17], [23, 42, 11, 7], [0.0] * 4, 1.0, 1.0, 0, "stop", 0),
                Experience([8, 3], [4, 4, 30], [0.0] * 3, 0.0, -1.0, 0, "stop", 0)]
        batch = collate(exps, pad_id=0)
        with torch.no_grad():  # (reference / old log-probs) leaves no unsharded weights behind
            nograd_lp, _ = sharded_completion_logprobs(sharded, batch, temperature=0.7, chunk_size=3)
        results["root_resharded_after_no_grad"] = type(sharded.lm_head.weight).__name__ == "DTensor"
        lp, ent = sharded_completion_logprobs(sharded, batch, temperature=0.7, chunk_size=3)
        results["no_grad_equal"] = torch.equal(nograd_lp, lp.detach())
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
        ref_logits = plain(**inputs).logits[:, -batch["completion_ids"].shape[1] - 1: -1]
        ref_lp, ref_ent = naive_token_stats(ref_logits, batch["completion_ids"], 0.7)
        mask = batch["completion_mask"]
        results["logprob_err"] = float((lp - ref_lp)[mask].abs().max())
        results["entropy_err"] = float((ent - ref_ent)[mask].abs().max())
        (lp[mask].sum()).backward()
        (ref_lp[mask].sum()).backward()
        grad_err = 0.0
        for (_name, p), q in zip(sharded.named_parameters(), plain.parameters()):
            # FSDP averages gradients over the 2 ranks, which computed the same loss: the mean is the plain gradient
            grad_err = max(grad_err, float((full_tensor(p.grad) - q.grad).abs().max()))
        results["grad_err"] = grad_err
        # GDPO over both ranks' judger rewards: each rank's slice of the one-process answer over all of them
        from rlflow import registry
        from rlflow.advantages.base import estimate, estimate_global

        g = torch.Generator().manual_seed(5)
        comp = torch.rand(16, 2, generator=g).round()  # 0/1 rewards of 2 judgers, 2 ranks x 2 groups of 4
        comp[3, 1] = float("nan")  # judger 2 gave none
        weights = torch.tensor([1.0, 0.5])
        gdpo = registry.build("rlflow.advantages", "gdpo")
        mine = estimate_global(gdpo, torch.zeros(8), 4, components=(comp[8 * rank: 8 * rank + 8], weights))
        whole = estimate(gdpo, torch.zeros(16), 4, components=(comp, weights))
        results["gdpo_err"] = float((mine - whole[8 * rank: 8 * rank + 8]).abs().max())
        # data.skip_solved: each rank's solved groups (its share of the batch) reach both samplers
        from types import SimpleNamespace

        from rlflow.data.datamodule import RolloutDataModule
        from rlflow.data.sampler import PromptBatchSampler

        records = [SimpleNamespace(i=i) for i in range(6)]
        dm = SimpleNamespace(train_records=records, _record_index=None, prompt_repeat_k=2, eval_pass_threshold=1.0,
                             sampler=PromptBatchSampler(6, 2, skip_solved=True))
        dm.sampler.record(3, True)  # solved before, judged unsolved now on rank 1
        mine, rewards = (([records[0], records[1]], [1.0, 1.0, 1.0, 0.0]) if rank == 0
                         else ([records[3], records[5]], [0.5, 1.0, 1.0, 1.0]))
        results["solved_metrics"] = RolloutDataModule.record_solved(dm, mine, rewards)
        results["solved"] = sorted(dm.sampler.solved)
        # the export gathers full weights on rank 0 only
        full = gather_full_state_dict(sharded)
        results["full_keys"] = len(full)
        if rank == 0:
            plain_sd = plain.state_dict()
            results["full_equal"] = all(torch.equal(full[k], plain_sd[k]) for k in full)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def on_two_ranks(worker, tiny_model, tmp_path) -> list[dict]:
    """Run ``worker(rank, init_dir, model_dir, out_dir)`` on two gloo ranks; each rank's saved results."""
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(str(tmp_path / "init"), str(tiny_model), str(tmp_path)), nprocs=2, join=True)
    return [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]


@pytest.mark.slow
def test_sharded_generation_logprobs_grads_and_export_on_two_gloo_ranks(tiny_model, tmp_path):
    r0, r1 = on_two_ranks(_sharded_worker, tiny_model, tmp_path)
    for r in (r0, r1):
        assert r["generate_equal"] and r["resharded"]
        assert r["root_resharded_after_no_grad"] and r["no_grad_equal"]
        assert r["logprob_err"] < 1e-5 and r["entropy_err"] < 1e-4
        assert r["grad_err"] < 1e-5
        assert r["gdpo_err"] < 1e-6  # batch statistics over both ranks' rewards
        assert r["solved"] == [0, 5] and r["solved_metrics"]["data/solved_prompts"] == 2.0  # both ranks' groups
    assert r0["full_equal"] and r0["full_keys"] > 0
    assert r1["full_keys"] == 0  # full weights are assembled on rank 0 only


# ------------------------------------------------------------------------------ packing on 2 sharded ranks
def _packed_sharded_worker(rank: int, init_file: str, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist
    from tiny_archs import IdTokenizer
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from rlflow.data.experience import Experience, collate
    from rlflow.rollout.select import resolve_backend
    from rlflow.training.distributed import all_max, full_tensor, shard_model
    from rlflow.training.logprobs import completion_logprobs
    from rlflow.training.packing import balance_pack_count, collate_packed, pack_experiences, packed_completion_logprobs
    from rlflow.training.packing_support import packing_unsupported_reason

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        plain = AutoModelForCausalLM.from_pretrained(model_dir)
        sharded = shard_model(AutoModelForCausalLM.from_pretrained(model_dir), init_device_mesh("cpu", (2,)))
        exps = [Experience([5, 9, 17], [23, 42, 11, 7], [0.0] * 4, 1.0, 1.0, 0, "stop", 0),
                Experience([5, 9, 17], [30, 8], [0.0] * 2, 1.0, -1.0, 0, "stop", 0),
                Experience([8, 3], [4, 4, 30], [0.0] * 3, 0.0, 1.0, 1, "stop", 0)]
        results = {"probe": packing_unsupported_reason(sharded, sharded=True)}
        # data.rollout=auto on the sharded policy: the engine's probe decodes inside full_weights (no collectives)
        backend = resolve_backend("auto", sharded, IdTokenizer())
        results["backend"] = (type(backend).__name__, getattr(backend, "decode_path", ""))
        whole = collate_packed(exps, share_prompts=True)  # one pack, the group's prompt once
        with torch.no_grad():
            nograd_lp, _ = packed_completion_logprobs(sharded, whole, 0.7, chunk_size=3, sharded=True)
            plain_lp, plain_ent = packed_completion_logprobs(plain, whole, 0.7, chunk_size=3)
            padded_lp, _ = completion_logprobs(plain, collate(exps, pad_id=0), 0.7, chunk_size=3)
        results["root_resharded_after_no_grad"] = type(sharded.lm_head.weight).__name__ == "DTensor"
        mask = whole["completion_mask"]
        results["vs_plain_packed"] = float((nograd_lp - plain_lp)[mask].abs().max())
        results["vs_plain_padded"] = float((nograd_lp - padded_lp)[mask].abs().max())
        # uneven pack counts (rank 0: one pack, rank 1: one per sequence), levelled as GRPOModule.micro_batches does;
        # each rank's packs together hold every sequence, so FSDP's mean gradient is the plain gradient
        packs = pack_experiences(exps, 1000 if rank == 0 else 1, share_prompts=True)
        packs = balance_pack_count(packs, all_max(len(packs)))
        results["packs"] = len(packs)
        for pack in packs:
            batch = collate_packed(pack, share_prompts=True)
            lp, ent = packed_completion_logprobs(sharded, batch, 0.7, chunk_size=3, sharded=True)
            (lp[batch["completion_mask"]].sum() + ent[batch["completion_mask"]].sum()).backward()
        ref_lp, ref_ent = packed_completion_logprobs(plain, whole, 0.7, chunk_size=3)
        (ref_lp[mask].sum() + ref_ent[mask].sum()).backward()
        results["grad_err"] = max(float((full_tensor(p.grad) - q.grad).abs().max())
                                  for p, q in zip(sharded.parameters(), plain.parameters()))
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_packed_logprobs_grads_and_auto_rollout_under_fsdp(tiny_model, tmp_path):
    for r in on_two_ranks(_packed_sharded_worker, tiny_model, tmp_path):
        assert r["probe"] is None  # the fit-start check finds packing exact under FSDP
        assert r["backend"] == ("EngineRollout", "fused decode")  # weights unsharded for the rollout: fused
        assert r["root_resharded_after_no_grad"]
        assert r["vs_plain_packed"] < 1e-5 and r["vs_plain_padded"] < 1e-5
        assert r["packs"] == 3  # rank 0's single pack was split to match rank 1's three
        assert r["grad_err"] < 1e-5


# ------------------------------------------------------------------------------- end to end through Lightning
SEEDED = [
    '--data.rollout={"class_path": "test_distributed.SeededGroupRollout"}',
    '--data.judgers={"*": "test_distributed:digit_reward"}',
    "--model.kl_coef=0.01",
    "--model.lr=1e-4",
]


def read_metrics(log_dir: Path) -> list[dict[str, float]]:
    with open(log_dir / "metrics.csv") as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def run_two_ranks(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
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
    args = fit_args(tiny_model, tiny_data, root, *SEEDED, "--trainer.strategy=fsdp", "--model.pack_max_length=120",
                    "--model.ref_model_sync_steps=2", "--model.ref_model_mixup_alpha=1.0",
                    "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
                    "--trainer.callbacks.every_n_train_steps=1", "--trainer.callbacks.save_top_k=-1", steps=4)
    args = [a.replace("--trainer.devices=1", "--trainer.devices=2") for a in args]
    out = run_two_ranks(args, root)
    (root / "output.txt").write_text(out.stdout + out.stderr)
    return root, root / "lightning_logs" / "version_0", args


@pytest.mark.slow
def test_two_packed_ranks_give_the_same_step_one_loss_and_rewards_as_one_padded_process(
        two_rank_run, tiny_model, tiny_data, tmp_path):
    """Sharding and packing together change nothing but the speed: 2 FSDP ranks training on packs (the default)
    take the step one process takes on padded micro-batches."""
    from rlflow.cli import cli_main

    root, log_dir, _ = two_rank_run
    assert "model.packing: micro-batches are packs" in (root / "output.txt").read_text()
    two = read_metrics(log_dir)[0]
    cli = cli_main(fit_args(tiny_model, tiny_data, tmp_path, *SEEDED, "--model.packing=false", steps=1))
    assert not cli.model.packing
    one = read_metrics(Path(cli.trainer.log_dir))[0]
    assert one["reward_std"] > 0 and abs(one["loss"]) > 1e-6  # a non-trivial step
    for key in ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/min_length",
                "completions/max_length", "num_tokens"):
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
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_NUM_NODES="2",
               SLURM_GPUS_PER_NODE="h100:8", SLURM_JOB_NODELIST="node-[a-b]", SLURM_JOB_ID="4242")
    out = subprocess.run(["bash", str(ROOT / "tools" / "slurm_grpo.sh"), "cfg.yaml", "--model.lr=2e-6"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    line = next(l for l in out.stdout.splitlines() if l.startswith("SRUN"))
    assert (
        "--kill-on-bad-exit=1 rlflow fit --config cfg.yaml --trainer.num_nodes=2 --trainer.devices=8 --model.lr=2e-6"
        in line
    )
    assert "MASTER=node-a:24242" in line
    missing = subprocess.run(["bash", str(ROOT / "tools" / "slurm_grpo.sh")], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "usage" in missing.stderr


@pytest.mark.slow
def test_lmdeploy_recipe_config_resolves(tiny_model):
    """The 8-GPU config parses: FSDP2 strategy with bf16 compute / fp32 reduction, lmdeploy rollout, XTuner's
    settings."""
    import yaml

    out = subprocess.run(
        [sys.executable, "-m", "rlflow", "fit", "--config", str(ROOT / "configs" / "grpo_gsm8k_qwen3_8b_lmdeploy.yaml"),
         f"--model.model_path={tiny_model}", "--print_config"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    cfg = yaml.safe_load(out.stdout)
    strategy = cfg["trainer"]["strategy"]
    assert strategy["class_path"] == "rlflow.training.distributed.FSDP2Strategy"
    assert (strategy["init_args"]["param_dtype"], strategy["init_args"]["reduce_dtype"]) == ("bfloat16", "float32")
    assert cfg["trainer"]["devices"] == 8
    assert cfg["data"]["rollout"]["class_path"] == "rlflow.rollout.lmdeploy.LMDeployRollout"
    m, d = cfg["model"], cfg["data"]
    assert (d["prompt_repeat_k"], m["lr"], m["epsilon_low"], m["epsilon_high"], m["kl_coef"], m["kl_type"]) == \
        (5, 1e-6, 0.2, 0.28, 0.001, "low_var_kl")
    assert (d["max_prompt_length"], d["max_tokens"], d["global_batch_size"] % 8) == (512, 1024, 0)
