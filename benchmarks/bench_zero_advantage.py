r"""Benchmark: the update's time with ``model.update.skip_zero_advantage`` against the full backward pass, by the
share of groups whose advantage is 0.

Runs ``rlflow fit`` in this process with a config as shipped (paths, step count, logging, checkpointing, evaluation
and the learning rate overridden), once with the option off and once on for each share, alternately. After each
rollout the advantages are set: the first ``share x groups`` groups get 0 (their completions all got the same
reward: what ``frac_reward_zero_std`` counts), the others +1/-1 by turns. The learning rate is 1e-12, which leaves
the float32 weights as they are, so every run samples the same completions step after step and the two settings
do the same work apart from the option. Timed: the update (``PolicyUpdate.run``: the training forwards, backward
passes, gradient clipping and optimizer step) and the whole step (``step_time``), medians over the steps after the
first::

    python benchmarks/bench_zero_advantage.py --config configs/smollm2_gsm8k_cpu.yaml --steps 4 --shares 0.25 0.5 1.0
    ...
    zero-advantage share    update off  update on   ratio  step off  step on   ratio  backward seqs off/on  forward-only
    0.25                        2.73 s     2.31 s   1.18x    4.56 s   4.21 s   1.08x            16 / 12         0.28 s
    ...

Other arguments are passed to every ``rlflow fit`` (``--model.model_path=...``).

Simplifications: one process per setting in turn (not interleaved within a run); the rollout's own time is the same
in both settings and included in the step ratio only.
"""

from __future__ import annotations

import argparse
import csv
import functools
import os
import statistics
import tempfile
import time
from pathlib import Path


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    """The benchmark's options, and the rest: ``rlflow fit`` flags added to every run."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/smollm2_sums_cpu.yaml")
    ap.add_argument("--steps", type=int, default=5, help="rollout steps per run (the first is left out)")
    ap.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0],
                    help="shares of the groups given advantage 0")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    return ap.parse_known_args(argv)


def run(args, extra: list[str], share: float, skip: bool, root: Path) -> dict[str, float]:
    """One ``rlflow fit`` with the advantages set as the module docstring says; medians of its timed steps."""
    from rlflow.cli import cli_main
    from rlflow.data.datamodule import RolloutDataModule
    from rlflow.training.module import PolicyUpdate

    drained, update_run, micro_step = RolloutDataModule.minibatches, PolicyUpdate.run, PolicyUpdate.micro_step
    update_s: list[float] = []
    trained: list[int] = []  # sequences through the backward pass, per step
    forward_only_s: list[float] = []  # seconds in forward-only micro-batches, per step

    def controlled(self, num):
        minibatches = drained(self, num)
        groups = sorted({e.group for mb in minibatches for e in mb})
        zero = set(groups[: round(share * len(groups))])
        for mb in minibatches:
            for i, e in enumerate(mb):
                e.advantage = 0.0 if e.group in zero else (1.0 if i % 2 else -1.0)
        trained.append(0)
        forward_only_s.append(0.0)
        return minibatches

    def timed_run(self, module, minibatches):
        start = time.perf_counter()
        try:
            return update_run(self, module, minibatches)
        finally:
            update_s.append(time.perf_counter() - start)

    @functools.wraps(micro_step)
    def counted(self, module, micro, minibatch_size, ctx, step, backward=True):
        if backward:
            trained[-1] += len(micro)
        start = time.perf_counter()
        try:
            return micro_step(self, module, micro, minibatch_size, ctx, step, backward)
        finally:
            if not backward:
                forward_only_s[-1] += time.perf_counter() - start

    RolloutDataModule.minibatches, PolicyUpdate.run, PolicyUpdate.micro_step = controlled, timed_run, counted
    try:
        flags = ["fit", "--config", args.config, "--trainer.max_steps", str(args.steps),
                 "--trainer.logger.init_args.save_dir", str(root), "--trainer.enable_progress_bar", "false",
                 "--checkpoint.every_n_train_steps", "0", "--model.export_hf", "false",
                 "--model.optim.lr", "1e-12", "--data.eval_data_path=null", "--evaluate_every_n_steps=null",
                 "--model.update.skip_zero_advantage", str(skip).lower(), *extra]
        cli = cli_main(flags)
        rows = [r for r in csv.DictReader(open(Path(cli.trainer.log_dir) / "metrics.csv")) if r.get("step_time")]
    finally:
        RolloutDataModule.minibatches, PolicyUpdate.run, PolicyUpdate.micro_step = drained, update_run, micro_step
    return {"update": statistics.median(update_s[1:]),
            "step": statistics.median(float(r["step_time"]) for r in rows[1:]), "backward": statistics.median(trained),
            "forward_only": statistics.median(forward_only_s[1:])}


def main(argv=None) -> list[tuple[float, dict, dict]]:
    """Runs the benchmark and prints its table; returns ``(share, off, on)`` per share."""
    args, extra = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, share in enumerate(args.shares):
            off = run(args, extra, share, False, Path(tmp) / f"off{i}")
            on = run(args, extra, share, True, Path(tmp) / f"on{i}")
            results.append((share, off, on))
    print(f"{args.config}: {torch.get_num_threads()} torch thread(s), {args.steps - 1} timed steps per run, "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print(f"{'zero-advantage share':22s}{'update off':>12s}{'update on':>11s}{'ratio':>8s}{'step off':>10s}"
          f"{'step on':>9s}{'ratio':>8s}{'backward seqs off/on':>22s}{'forward-only':>14s}")
    for share, off, on in results:
        print(f"{share:<22.2f}{off['update']:>10.2f} s{on['update']:>9.2f} s{off['update'] / on['update']:>7.2f}x"
              f"{off['step']:>8.2f} s{on['step']:>7.2f} s{off['step'] / on['step']:>7.2f}x"
              f"{off['backward']:>14.0f} / {on['backward']:<5.0f}{on['forward_only']:>10.2f} s")
    return results


if __name__ == "__main__":
    main()
