r"""Learning per step and wall time to a reward: rlflow's SmolLM2 sums recipe against ``trl.GRPOTrainer``.

Both sides train SmolLM2-135M-Instruct on the same rows (``checkpoints/sums/train.jsonl``, ``python -m
rlflow.demo.sums``), with the same two rewards weighted 0.5 each (GSM8K's strict ``#### answer`` line, rlflow's
``gsm8k`` judger, and ``rlflow.demo.sums:final_number_reward``) and the settings of ``configs/smollm2_sums_cpu.yaml``:
4 prompts x 4 completions a step, 32 new tokens at temperature 0.8, the ``bnpo`` loss with epsilons 0.2/0.28, no
KL, AdamW at a constant 2e-5, one optimizer step per rollout step, float32 master weights with bf16 autocast where
the CPU multiplies bf16. rlflow runs the config as shipped (only the step count, seed, logging, checkpointing and
evaluation overridden); TRL gets those settings as ``GRPOConfig`` fields. Each run is its own process with the same
``OMP_NUM_THREADS`` (``--threads``); ``--jobs`` runs that many at once (TRL's runs started first).

What it prints: per run, each step's sampled reward (the weighted mean over the step's 16 completions, what both
log as ``reward``) and seconds; after training, the greedy held-out accuracy (the last number of a 32-token
``model.generate`` completion equals the sum, on the 64 ``val.jsonl`` sums never trained on), by one evaluator for
both, and the base model's. The last lines: mean reward of the first and last 5 steps, held-out accuracy (mean and
range over seeds), median step seconds, and the seconds (and steps) each side took to first reach ``--target`` (the
reward's ``--window``-step moving average), with the ratio of the medians (a run that never reaches it counted
as the slowest)::

    python tools/get_smollm2.py && python -m rlflow.demo.sums       # the model and the rows
    python benchmarks/learn_vs_trl.py --seeds 0 1 2 3 4 --trl-seeds 0 1 2 3 4 --steps 20 --threads 1 --jobs 2
    # TRL: a dev dependency (.[dev])

Simplifications: TRL's step seconds come from a ``TrainerCallback`` (``on_step_begin`` to ``on_step_end``, its
generation included), rlflow's from its ``step_time`` metric (the training step, generation included); model
loading and evaluation are outside both. The seeds seed each framework's own sampling, so the two sides' runs
with one seed are not the same draws.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "smollm2_sums_cpu.yaml"


# ------------------------------------------------------------------------------------------------- evaluation
def held_out_accuracy(model, tokenizer, rows: list[dict], max_tokens: int = 32, batch: int = 16) -> float:
    """Share of ``rows`` whose greedy completion's last number is the row's sum (``model.generate``)."""
    import torch

    from rlflow.demo.sums import final_number_reward

    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    right = 0.0
    model.eval()
    for start in range(0, len(rows), batch):
        part = rows[start:start + batch]
        texts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in part]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        completions = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        right += sum(final_number_reward(completions, [r["reward_model"]["ground_truth"] for r in part]))
    return right / len(rows)


def read_rows(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ------------------------------------------------------------------------------------------------- workers
def rlflow_worker(args) -> dict:
    from rlflow.cli import cli_main

    with tempfile.TemporaryDirectory() as root:
        cli = cli_main([
            "fit", "--config", str(CONFIG), f"--model.model_path={args.model}", "--model.export_hf=false",
            f"--data.train_data_path={args.data / 'train.jsonl'}", f"--data.eval_data_path={args.data / 'val.jsonl'}",
            f"--evaluate_every_n_steps={args.steps + 1}",  # never within the run: evaluated below, as TRL's
            "--trajectories.enabled=false", f"--trainer.max_steps={args.steps}",
            f"--trainer.logger.init_args.save_dir={root}", "--trainer.enable_progress_bar=false",
            "--trainer.enable_checkpointing=false", f"--seed_everything={args.seed}", f"--data.seed={args.seed}",
            *args.rlflow_args.split(),
        ])
        (metrics,) = Path(root).rglob("metrics.csv")
        with open(metrics) as f:
            logged = [{k: float(v) for k, v in r.items() if v != ""} for r in csv.DictReader(f)]
        logged = [r for r in logged if "step_time" in r]
        accuracy = held_out_accuracy(cli.model.policy, cli.datamodule.tokenizer, read_rows(args.data / "val.jsonl"))
    return {"reward": [r["reward"] for r in logged], "step_time": [r["step_time"] for r in logged],
            "accuracy": accuracy}


def trl_worker(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.bench_step import gsm8k_reward, trl_recorder, trl_rows
    from rlflow.demo.sums import final_number_reward
    from rlflow.rollout.hardware import bf16_faster

    rows = trl_rows(args.data / "train.jsonl")
    gsm8k = gsm8k_reward()
    recorder = trl_recorder("reward")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, use_cpu=True, bf16=bf16_faster(torch.device("cpu")), learning_rate=2e-5,
            lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, adam_beta1=0.9,
            adam_beta2=0.999, per_device_train_batch_size=16, gradient_accumulation_steps=1, num_generations=4,
            max_completion_length=32, temperature=0.8, top_p=1.0, top_k=0, beta=0.0, loss_type="bnpo", epsilon=0.2,
            epsilon_high=0.28, num_iterations=1, max_steps=args.steps, reward_weights=[0.5, 0.5],
            logging_steps=1, report_to="none", save_strategy="no", seed=args.seed, disable_dropout=True,
            dataloader_num_workers=0, log_completions=False,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=[gsm8k, final_number_reward], args=config,
                              train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                              callbacks=[recorder])
        trainer.train()
    accuracy = held_out_accuracy(trainer.model, tokenizer, read_rows(args.data / "val.jsonl"))
    return {"reward": [logs["reward"] for logs in recorder.logs], "step_time": recorder.times, "accuracy": accuracy}


def base_worker(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    return {"accuracy": held_out_accuracy(model, tokenizer, read_rows(args.data / "val.jsonl"))}


WORKERS = {"rlflow": rlflow_worker, "trl": trl_worker, "base": base_worker}


def run_worker(which: str, args, seed: int) -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(args.threads)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    command = [sys.executable, __file__, "--worker", which, "--seed", str(seed), "--steps", str(args.steps),
               "--model", str(args.model), "--data", str(args.data), "--threads", str(args.threads),
               f"--rlflow-args={args.rlflow_args}"]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"the {which} run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------- summary
def moving_average(values: list[float], width: int = 3) -> list[float]:
    """Mean of each value with the ``width - 1`` before it (fewer at the start)."""
    return [statistics.mean(values[max(0, i - width + 1):i + 1]) for i in range(len(values))]


def steps_to(target: float, rewards: list[float], window: int = 3) -> int | None:
    """The step (from 1) at which the reward's ``window``-step moving average first reaches ``target`` (None:
    never)."""
    for i, value in enumerate(moving_average(rewards, window)):
        if value >= target:
            return i + 1
    return None


def seconds_to(target: float, rewards: list[float], times: list[float], window: int = 3) -> float | None:
    """Seconds of training until the reward's ``window``-step moving average first reaches ``target`` (None:
    never)."""
    steps = steps_to(target, rewards, window)
    return None if steps is None else sum(times[:steps])


def median_seconds(reached: list[float | None]) -> float:
    """Median of seconds to the target over runs, a run that never reached it counted as slower than every run that
    did (``inf``): the median is finite only when at least half the runs reached the target."""
    return statistics.median(math.inf if s is None else s for s in reached)


def summary(name: str, runs: list[dict], target: float, window: int = 3) -> tuple[str, list[float | None]]:
    first = statistics.mean(r for run in runs for r in run["reward"][:5])
    last = statistics.mean(r for run in runs for r in run["reward"][-5:])
    accuracies = [run["accuracy"] for run in runs]
    step = statistics.median(t for run in runs for t in run["step_time"])
    reached = [seconds_to(target, run["reward"], run["step_time"], window) for run in runs]
    shown = ", ".join("never" if s is None else f"{s:.0f}" for s in reached)
    steps = ", ".join(str(steps_to(target, run["reward"], window) or "never") for run in runs)
    line = (f"{name:7} {len(runs)} run(s): reward steps 1-5 {first:.3f} -> last 5 {last:.3f}; held-out accuracy "
            f"{statistics.mean(accuracies):.1%} ({min(accuracies):.1%}-{max(accuracies):.1%}); median step "
            f"{step:.1f} s; seconds to reward {target:g}: {shown} (steps {steps})")
    return line, reached


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "checkpoints" / "smollm2-135m-instruct")
    ap.add_argument("--data", type=Path, default=ROOT / "checkpoints" / "sums", help="train.jsonl and val.jsonl")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2], help="rlflow runs")
    ap.add_argument("--trl-seeds", type=int, nargs="*", default=[0], help="TRL runs")
    ap.add_argument("--target", type=float, default=0.3, help="reward whose reaching is timed (moving average)")
    ap.add_argument("--window", type=int, default=3, help="steps of the reward's moving average")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of each run")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (each its own process of --threads threads)")
    ap.add_argument("--rlflow-args", default="",
                    help="more rlflow fit flags for rlflow's runs, space-separated (--rlflow-args=--model.x=y)")
    ap.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(WORKERS[args.worker](args)))
        return 0
    for path in (args.model, args.data / "train.jsonl"):
        if not path.exists():
            raise SystemExit(f"{path} is missing: python tools/get_smollm2.py; python -m rlflow.demo.sums")
    load = os.getloadavg()[0]
    base = run_worker("base", args, 0)["accuracy"]
    print(f"base model: held-out accuracy {base:.1%}", flush=True)
    runs: dict[str, list[dict]] = {"rlflow": [], "trl": []}
    order = [("rlflow", s) for s in args.seeds] + [("trl", s) for s in args.trl_seeds]
    order.sort(key=lambda x: x[1])  # alternate the sides seed by seed
    if args.jobs > 1:  # the longer runs (TRL's) first, so that the jobs end together
        order.sort(key=lambda x: x[0] != "trl")

    def one(item: tuple[str, int]) -> None:
        which, seed = item
        run = run_worker(which, args, seed)
        runs[which].append({**run, "seed": seed})
        print(f"{which} seed {seed}: rewards {[round(r, 3) for r in run['reward']]}; steps s "
              f"{[round(t, 1) for t in run['step_time']]}; held-out accuracy {run['accuracy']:.1%}", flush=True)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(one, order))
    lines, reached = {}, {}
    for which in runs:
        runs[which].sort(key=lambda run: run["seed"])
        if runs[which]:
            lines[which], reached[which] = summary(which, runs[which], args.target, args.window)
            print(lines[which])
    if reached.get("rlflow") and reached.get("trl"):
        trl, ours = median_seconds(reached["trl"]), median_seconds(reached["rlflow"])
        ratio = f"{trl / ours:.2f}x" if math.isfinite(ours) and math.isfinite(trl) else "not defined"
        print(f"time to reward {args.target:g} ({args.window}-step average): trl/rlflow {ratio} (medians, a run that "
              f"never reached it counted as the slowest)")
    print(f"{args.steps} steps, {args.threads} thread(s) x {args.jobs} job(s), load average {load:.2f} -> "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
