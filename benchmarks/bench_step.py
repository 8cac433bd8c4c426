r"""Benchmark: GRPO step time and completion tokens/s of ``rlflow fit`` against ``trl.GRPOTrainer``.

Both train the same model on the same prompts with the same settings: ``--prompts`` prompts x ``--group``
completions per step, ``--max-tokens`` new tokens, temperature 1, AdamW at ``--lr``, the ``bnpo`` loss with
epsilon 0.2, no KL (beta 0), group-std-scaled advantages, one optimizer step per rollout step accumulated over
micro-batches of ``--micro-batch`` sequences, the GSM8K judger as the reward. Each framework runs in its own
subprocess (same ``OMP_NUM_THREADS``), alternately, ``--repeats`` times; the first ``--warmup`` steps of every run
are left out. The last line (one line, wrapped here) is the ratio of median step times::

    python benchmarks/bench_step.py --model checkpoints/tiny-qwen3 \
        --data checkpoints/arith/train.jsonl --threads 2 --repeats 3 --steps 6
    ...
    step rlflow/trl speedup: 3.57x (rlflow 0.20 s/step 14470 tok/s, trl 0.72 s/step 3778 tok/s; tok/s ratio 3.83x;
        median of 3 runs x 5 steps; 2 thread(s), load average 0.41 -> 1.32 on 2 CPUs)

``--config configs/demo_cpu.yaml`` runs rlflow with that config as shipped (only paths, step count, logging,
checkpointing and evaluation overridden), so the figure is what users of the config get, and takes the settings
TRL mirrors (prompts, group, max tokens, temperature, lr, warm-up, loss, epsilons, KL coefficient, micro-batch)
from it; explicit flags still win::

    python benchmarks/bench_step.py --config configs/demo_cpu.yaml --threads 2 \
        --repeats 3 --steps 6

``--bf16`` compares both at bf16 compute with float32 master weights: TRL with ``bf16=True`` (on CPU, accelerate's
``torch.autocast("cpu", bfloat16)`` around the model's forward, generation included) against rlflow with
``trainer.precision: bf16-mixed`` (Lightning's CPU autocast) and the engine decoding through bf16 weight copies
(``data.rollout.init_args.dtype: bfloat16``). Without it both run float32.

``--rlflow-args`` passes extra ``rlflow fit`` flags (default: the ``engine`` rollout and packing without
``--config``, nothing with it); ``--only-packing`` instead times one training forward/backward of padded vs
packed micro-batches.

Simplifications: CPU (or whatever device each framework picks by default); TRL's step time is measured by a
``TrainerCallback`` (``on_step_begin`` to ``on_step_end``, which includes its generation), rlflow's is its own
``step_time`` metric (``training_step`` start to end, including generation); TRL's ``generation_batch_size``
equals the step's 128 completions so both make one rollout and one optimizer step per step.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ workers
def rlflow_settings(args) -> list[str]:
    """``rlflow fit`` flags of the compared settings: the config as shipped, or the benchmark's own flags."""
    if args.config:
        return ["--config", args.config]
    return [
        f"--model.optim.lr={args.lr}", f"--model.optim.warmup_steps={args.warmup_steps}", f"--model.loss={args.loss}",
        f"--model.loss.epsilon_low={args.epsilon}", f"--model.loss.epsilon_high={args.epsilon_high}",
        f"--model.loss.kl_coef={args.kl_coef}", f"--model.update.micro_batch_size={args.micro_batch}",
        f"--data.prompt_repeat_k={args.group}", f"--data.global_batch_size={args.prompts}",
        f"--data.sampling.max_tokens={args.max_tokens}", f"--data.sampling.temperature={args.temperature}",
    ]


def rlflow_worker(args) -> dict:
    from rlflow.cli import cli_main

    with tempfile.TemporaryDirectory() as root:
        cli_main([
            "fit", *rlflow_settings(args), f"--model.model_path={args.model}", "--model.export_hf=false",
            f"--data.train_data_path={args.data}", "--data.eval_data_path=null", "--trajectories.enabled=false",
            "--trainer.accelerator=cpu", "--trainer.devices=1", f"--trainer.max_steps={args.steps}",
            f"--trainer.default_root_dir={root}", "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
            f"--trainer.logger.save_dir={root}", "--trainer.enable_progress_bar=false",
            "--trainer.enable_checkpointing=false", f"--seed_everything={args.seed}", *args.rlflow_args.split(),
        ])
        (metrics,) = Path(root).rglob("metrics.csv")
        with open(metrics) as f:
            rows = [{k: float(v) for k, v in r.items() if v != ""} for r in csv.DictReader(f)]
    rows = [r for r in rows if "step_time" in r]
    n = args.prompts * args.group
    return {
        "step_time": [r["step_time"] for r in rows],
        "completion_tokens": [r["completions/mean_length"] * n for r in rows],
        "reward": [r["reward"] for r in rows],
    }


def trl_worker(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    rows = trl_rows(args.data)
    gsm8k = gsm8k_reward()
    recorder = trl_recorder("completions/mean_length")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(args.model)
    with tempfile.TemporaryDirectory() as out:
        per_step = args.prompts * args.group
        config = GRPOConfig(
            output_dir=out, use_cpu=True, bf16=args.bf16, learning_rate=args.lr, lr_scheduler_type="constant",
            warmup_steps=args.warmup_steps, weight_decay=0.0, max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.999,
            per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=per_step // args.micro_batch,
            num_generations=args.group, max_completion_length=args.max_tokens, temperature=args.temperature, top_p=1.0,
            top_k=0, beta=args.kl_coef, loss_type=args.loss, epsilon=args.epsilon, epsilon_high=args.epsilon_high,
            num_iterations=1, max_steps=args.steps,
            logging_steps=1, report_to="none", save_strategy="no", seed=args.seed, disable_dropout=True,
            dataloader_num_workers=0, log_completions=False,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=[gsm8k], args=config, train_dataset=Dataset.from_list(rows),
                              processing_class=tok, callbacks=[recorder])
        trainer.train()
    tokens = [logs["completions/mean_length"] * args.prompts * args.group for logs in recorder.logs]
    return {"step_time": recorder.times, "completion_tokens": tokens,
            "reward": [logs.get("reward", float("nan")) for logs in recorder.logs]}


def trl_rows(path) -> list[dict]:
    """The rows of an rlflow jsonl (``prompt`` chat messages, ``reward_model.ground_truth``) as TRL's dataset rows:
    ``prompt`` and ``ground_truth`` (a string), which TRL passes to reward functions as a keyword."""
    with open(path, encoding="utf-8") as f:
        return [{"prompt": r["prompt"], "ground_truth": str(r["reward_model"]["ground_truth"])}
                for r in map(json.loads, filter(str.strip, f))]


def gsm8k_reward():
    """rlflow's ``gsm8k`` judger as a TRL reward function named ``gsm8k`` (TRL logs it as ``rewards/gsm8k``)."""
    from rlflow.judgers.gsm8k import GSM8KJudger

    judger = GSM8KJudger()

    def gsm8k(prompts, completions, **kwargs):
        return judger(prompts, completions, **kwargs)

    return gsm8k


def trl_recorder(key: str):
    """A ``transformers.TrainerCallback`` for TRL's trainer that records each step's seconds (``on_step_begin`` to
    ``on_step_end``, its generation included) in ``times`` and each logged dict holding ``key`` in ``logs``."""
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.logs: list[dict] = []
            self.t0 = 0.0

        def on_step_begin(self, a, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            self.times.append(time.perf_counter() - self.t0)

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and key in logs:
                self.logs.append(dict(logs))

    return Recorder()


# ----------------------------------------------------------------------------------------- packing only
def packing_bench(args) -> dict:
    """Median time of one forward+backward over the same experiences, padded micro-batches vs token packs."""
    import random

    from transformers import AutoModelForCausalLM

    from rlflow.data.experience import Experience, collate
    from rlflow.training.logprobs import completion_logprobs
    from rlflow.training.packing import collate_packed, pack_experiences, packed_completion_logprobs

    model = AutoModelForCausalLM.from_pretrained(args.model).train()
    rng = random.Random(args.seed)
    n = args.prompts * args.group
    out = {}
    for label, lo in (("equal lengths", args.max_tokens), ("varied lengths", 1)):
        exps = [Experience([rng.randrange(4, 100) for _ in range(100)],
                           [rng.randrange(4, 100) for _ in range(rng.randint(lo, args.max_tokens))],
                           [0.0] * args.max_tokens, 0.0, 1.0, i // args.group, "stop", 0) for i in range(n)]
        budget = args.micro_batch * (100 + args.max_tokens)  # the padded micro-batch's token count at most

        def padded(exps=exps):
            for s in range(0, n, args.micro_batch):
                lp, _ = completion_logprobs(model, collate(exps[s: s + args.micro_batch], 0))
                lp.sum().backward()

        def packed(exps=exps, budget=budget):
            for micro in pack_experiences(exps, budget):
                lp, _ = packed_completion_logprobs(model, collate_packed(micro))
                lp.sum().backward()

        for name, fn in (("padded", padded), ("packed", packed)):
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
                model.zero_grad(set_to_none=True)
            out[f"{label}/{name}"] = statistics.median(times)
        tokens = sum(len(e.prompt_ids) + len(e.completion_ids) for e in exps)
        padded_s, packed_s = out[f"{label}/padded"], out[f"{label}/packed"]
        print(f"{label}: {tokens} real tokens; padded {padded_s:.3f} s, packed {packed_s:.3f} s "
              f"(packed/padded time {packed_s / padded_s:.2f})", flush=True)
    return out


# ------------------------------------------------------------------------------------------------- driver
def run_worker(which: str, argv: list[str], threads: int | None) -> dict:
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, __file__, *argv, "--worker", which], env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the {which} run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarise(runs: list[dict], warmup: int) -> dict:
    times = [t for r in runs for t in r["step_time"][warmup:]]
    tokens = [t for r in runs for t in r["completion_tokens"][warmup:]]
    rewards = [statistics.mean(x) for x in zip(*[r["reward"] for r in runs])] if runs else []
    return {"median_step_s": statistics.median(times), "tok_s": sum(tokens) / sum(times), "reward_by_step": rewards,
            "steps_timed": len(times)}


#: bench_step argument <- where an rlflow config sets it: its grouped key, else the flat key of older configs
CONFIG_KEYS = {
    "prompts": ("data.global_batch_size",), "group": ("data.prompt_repeat_k",),
    "max_tokens": ("data.sampling.max_tokens", "data.max_tokens"),
    "temperature": ("data.sampling.temperature", "data.temperature"),
    "lr": ("model.optim.lr", "model.lr"), "warmup_steps": ("model.optim.warmup_steps", "model.warmup_steps"),
    "loss": ("model.loss.class_path", "model.loss"),
    "epsilon": ("model.loss.init_args.epsilon_low", "model.epsilon_low"),
    "epsilon_high": ("model.loss.init_args.epsilon_high", "model.epsilon_high"),
    "kl_coef": ("model.loss.init_args.kl_coef", "model.kl_coef"),
    "micro_batch": ("model.update.micro_batch_size", "model.micro_batch_size"),
    "model": ("model.model_path",), "data": ("data.train_data_path",),
}


def config_settings(path: str) -> dict:
    """The benchmark arguments an rlflow config sets (what it leaves out keeps the benchmark's default)."""
    import yaml

    with open(path, encoding="utf-8") as f:
        config = yaml.safe_load(f)
    out = {}
    for arg, keys in CONFIG_KEYS.items():
        for key in keys:
            value = config
            for part in key.split("."):
                value = value.get(part) if isinstance(value, dict) else None
            if isinstance(value, (int, float, str)) and not isinstance(value, bool):
                out[arg] = value
                break
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="checkpoints/tiny-qwen3")
    ap.add_argument("--data", default="checkpoints/arith/train.jsonl",
                    help="XTuner-format jsonl (reward_model.ground_truth)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="steps left out of the timing at the start of each run")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of both runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup-steps", type=int, default=0)
    ap.add_argument("--loss", default="bnpo", help="rlflow loss / TRL loss_type (bnpo, grpo, dr_grpo, dapo)")
    ap.add_argument("--epsilon", type=float, default=0.2)
    ap.add_argument("--epsilon-high", type=float, default=0.2)
    ap.add_argument("--kl-coef", type=float, default=0.0, help="rlflow model.loss.init_args.kl_coef / TRL beta")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--config", default=None, help="rlflow config to run as shipped (e.g. configs/demo_cpu.yaml); "
                    "TRL mirrors its settings")
    ap.add_argument("--rlflow-args", default=None,
                    help="extra rlflow fit flags (default without --config: "
                    "'--data.rollout=engine --model.update.packing=true')")
    ap.add_argument("--bf16", action="store_true",
                    help="bf16 compute on both sides (TRL bf16=True; rlflow bf16-mixed + bf16 engine decoding)")
    ap.add_argument("--only", choices=["rlflow", "trl"], default=None, help="run one framework and print its figures")
    ap.add_argument("--only-packing", action="store_true", help="time padded vs packed forward/backward instead")
    ap.add_argument("--worker", choices=["rlflow", "trl"], default=None, help=argparse.SUPPRESS)
    args, _ = ap.parse_known_args(argv)
    if args.config:  # the config's values become the defaults: explicit flags still win
        ap.set_defaults(**config_settings(args.config))
        args, _ = ap.parse_known_args(argv)
    if args.rlflow_args is None:
        args.rlflow_args = "" if args.config else "--data.rollout=engine --model.update.packing=true"
    if args.bf16:
        engine = "" if "--data.rollout" in args.rlflow_args else "--data.rollout=engine "
        args.rlflow_args += f" --trainer.precision=bf16-mixed {engine}--data.rollout.init_args.dtype=bfloat16"
    if args.worker:
        result = rlflow_worker(args) if args.worker == "rlflow" else trl_worker(args)
        print(json.dumps(result))
        return
    if args.only_packing:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        packing_bench(args)
        return
    print(f"settings: {args.prompts} prompts x {args.group} completions, {args.max_tokens} max tokens, "
          f"T={args.temperature}, lr {args.lr} (warm-up {args.warmup_steps}), loss {args.loss}, "
          f"epsilon {args.epsilon}/{args.epsilon_high}, kl {args.kl_coef}, TRL micro-batch {args.micro_batch}, "
          f"{'bf16 compute' if args.bf16 else 'float32'} (TRL bf16={args.bf16}); rlflow: "
          f"{' '.join(rlflow_settings(args)) if args.config else 'the flags above'} {args.rlflow_args}; "
          f"OMP_NUM_THREADS={args.threads or os.environ.get('OMP_NUM_THREADS', 'unset')}", flush=True)
    load_start = os.getloadavg()[0]
    forward = [a for a in (argv if argv is not None else sys.argv[1:])]
    names = [args.only] if args.only else ["rlflow", "trl"]
    if "trl" in names:
        try:
            import trl  # noqa: F401
        except ImportError:
            sys.exit("trl is not importable: pip install -e '.[dev]' (TRL is a development dependency), or pass "
                     "--only rlflow")
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(args.repeats):
        for name in names:
            result = run_worker(name, forward, args.threads)
            runs[name].append(result)
            s = summarise([result], args.warmup)
            print(f"run {r + 1} {name:6s}: median {s['median_step_s']:.2f} s/step, {s['tok_s']:.1f} completion tok/s, "
                  f"steps {[round(t, 2) for t in result['step_time']]}, "
                  f"reward {[round(x, 3) for x in result['reward']]}",
                  flush=True)
    summary = {name: summarise(v, args.warmup) for name, v in runs.items()}
    for name, s in summary.items():
        print(f"{name}: median {s['median_step_s']:.2f} s/step over {s['steps_timed']} steps, {s['tok_s']:.1f} tok/s, "
              f"mean reward by step {[round(x, 3) for x in s['reward_by_step']]}")
    if len(summary) == 2:
        a, b = summary["rlflow"], summary["trl"]
        print(f"step rlflow/trl speedup: {b['median_step_s'] / a['median_step_s']:.2f}x "
              f"(rlflow {a['median_step_s']:.2f} s/step "
              f"{a['tok_s']:.0f} tok/s, trl {b['median_step_s']:.2f} s/step {b['tok_s']:.0f} tok/s; tok/s ratio "
              f"{a['tok_s'] / b['tok_s']:.2f}x; median of {args.repeats} runs x {args.steps - args.warmup} steps; "
              f"{args.threads or os.environ.get('OMP_NUM_THREADS', 'default')} thread(s), load average "
              f"{load_start:.2f} -> {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
