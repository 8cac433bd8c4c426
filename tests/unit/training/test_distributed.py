"""FSDP2 on CPU (gloo): sharding helpers, metric reduction, sharded generation, log-probs, gradients and export on
two ranks. The ``rlflow fit`` runs under FSDP2 (1-vs-2-process equivalence, resume) are in
``tests/integration/test_distributed_fit.py``.
"""


from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch


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
        # data.filtering.skip_solved: each rank's solved groups (its share of the batch) reach both samplers
        from types import SimpleNamespace

        from rlflow.data.experience_maker import EvalPlan, ExperienceMaker
        from rlflow.data.sampler import PromptBatchSampler

        records = [SimpleNamespace(i=i) for i in range(6)]
        maker = SimpleNamespace(prompts=SimpleNamespace(records=records), _record_index=None, k=2,
                                evaluation=EvalPlan(None, 1, 1.0, 0),
                                sampler=PromptBatchSampler(6, 2, skip_solved=True))
        maker.sampler.record(3, True)  # solved before, judged unsolved now on rank 1
        mine, rewards = (([records[0], records[1]], [1.0, 1.0, 1.0, 0.0]) if rank == 0
                         else ([records[3], records[5]], [0.5, 1.0, 1.0, 1.0]))
        results["solved_metrics"] = ExperienceMaker.record_solved(maker, mine, rewards)
        dm = maker
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
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from rlflow.data.experience import Experience, collate
    from rlflow.rollout.select import resolve_backend
    from rlflow.training.distributed import all_max, full_tensor, shard_model
    from rlflow.training.logprobs import completion_logprobs
    from rlflow.training.packing import balance_pack_count, collate_packed, pack_experiences, packed_completion_logprobs
    from rlflow.training.packing_support import packing_unsupported_reason
    from tests.helpers.tiny_archs import IdTokenizer

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

