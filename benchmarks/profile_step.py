r"""Profile: where one ``rlflow fit`` step's milliseconds go, phase by phase (and, optionally, operator by operator).

Runs ``rlflow fit`` in this process with a config as shipped (only paths, step count, logging, checkpointing and
evaluation overridden, as ``benchmarks/bench_step.py --config`` does), times the phases of every step after
``--warmup`` with ``perf_counter`` (wall) and ``process_time`` (CPU of all threads, less disturbed by other
processes on a shared machine), and prints their medians::

    OMP_NUM_THREADS=1 python benchmarks/profile_step.py --config configs/demo_cpu.yaml --steps 12 --threads 1
    ...
    phase                                         wall ms   cpu ms  share of step
    rollout: generate + judge (make_experience)      70.1     69.5    31%
    ...

Phases: the rollout (generation, judging overlapped with it, advantages; ``make_experience``), the old/reference
log-prob passes (``fill_logprobs``: none where the config needs none), the training forward (``logprobs_of``:
collation, the decoder, the chunked log-probs) with its collation shown apart, the loss, the backward
(``manual_backward``), gradient clipping, the optimizer step, Lightning's ``log_dict``, the rest of
``training_step`` (metrics, bookkeeping), and Lightning's own per-step work outside ``training_step`` (callbacks,
loggers, the loop; from one ``on_train_batch_start`` to the next). ``--ops N`` adds torch.profiler's top ``N``
operators over the timed steps (slower: time the phases without it).

Simplifications: phases are found by wrapping ``GRPOModule``/``RolloutDataModule`` methods and the functions
``rlflow.training.module`` calls, so a phase a custom subclass renames is counted in "the rest"; medians are per phase,
so they need not add up to the median step.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_ABSENT = object()

#: (label, owner, attribute) of each timed phase; owner is "module" (rlflow.training.module), "GRPOModule" or
# "datamodule"
PHASES = [
    ("rollout: generate + judge (make_experience)", "datamodule", "make_experience"),
    ("old/ref log-probs (fill_logprobs)", "GRPOModule", "fill_logprobs"),
    ("training forward (logprobs_of)", "GRPOModule", "logprobs_of"),
    ("  of which collation (collate_packed)", "module", "collate_packed"),
    ("loss", "GRPOModule", "loss_fn_call"),
    ("backward (manual_backward)", "GRPOModule", "manual_backward"),
    ("clip_grad_norm", "GRPOModule", "clip_gradients_and_norm"),
    ("optimizer.step + lr schedule", "module", "optimizer_step"),
    ("Lightning log_dict", "GRPOModule", "log_dict"),
]
TOP_LEVEL = [label for label, _, _ in PHASES if not label.startswith(" ")]


class StepProfile:
    """Wraps the phases' functions; collects wall and CPU seconds per phase and step."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.step = -1
        self.wall: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
        self.cpu: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
        self.depth: dict[str, int] = defaultdict(int)
        self.loop: list[float] = []
        self.loop_cpu: list[float] = []
        self.last_start: tuple[float, float] | None = None
        self.patched: list[tuple[object, str, object]] = []  # (owner, attribute, what it was): put back by uninstall

    def patch(self, owner: object, name: str, value: object) -> None:
        self.patched.append((owner, name, owner.__dict__.get(name, _ABSENT)))
        setattr(owner, name, value)

    def uninstall(self) -> None:
        """Put every wrapped function back (the tool may run inside a longer process, e.g. a test session)."""
        for owner, name, value in reversed(self.patched):
            if value is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        self.patched.clear()

    def timed(self, label: str, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if self.step < self.warmup or self.depth["old/ref log-probs (fill_logprobs)"] and label.startswith("train"):
                return fn(*args, **kwargs)  # a forward inside the old/ref pass is that pass's time
            self.depth[label] += 1
            t, c = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth[label] -= 1
                self.wall[label][self.step] += time.perf_counter() - t
                self.cpu[label][self.step] += time.process_time() - c
        return wrapper

    def install(self) -> None:
        import rlflow.training.module as module
        from rlflow.data.datamodule import RolloutDataModule
        from rlflow.training.module import GRPOModule

        owners = {"module": module, "GRPOModule": GRPOModule, "datamodule": RolloutDataModule}
        for label, owner, name in PHASES:
            if name == "loss_fn_call":
                continue  # the loss object is per run: wrapped in on_train_start below
            self.patch(owners[owner], name, self.timed(label, getattr(owners[owner], name)))
        step_fn = GRPOModule.training_step
        profile = self

        @functools.wraps(step_fn)
        def training_step(module_self, batch, batch_idx):
            profile.step = module_self.global_step
            loss_class = type(module_self.loss_fn)
            if not any(owner is loss_class for owner, _, _ in profile.patched):  # an object: time its class's call
                profile.patch(loss_class, "__call__", profile.timed("loss", loss_class.__call__))
            return profile.timed("training_step", step_fn)(module_self, batch, batch_idx)

        self.patch(GRPOModule, "training_step", training_step)

        def on_train_batch_start(module_self, batch, batch_idx):
            now = time.perf_counter(), time.process_time()
            if profile.last_start is not None and module_self.global_step > profile.warmup:
                profile.loop.append(now[0] - profile.last_start[0])
                profile.loop_cpu.append(now[1] - profile.last_start[1])
            profile.last_start = now

        self.patch(GRPOModule, "on_train_batch_start", on_train_batch_start)

    def medians(self) -> dict[str, float]:
        """Median wall milliseconds of each timed phase, and of the whole step (``"whole step"``) where measured."""
        out = {label: statistics.median(steps.values()) * 1e3 for label, steps in self.wall.items() if steps}
        if self.loop:
            out["whole step"] = statistics.median(self.loop) * 1e3
        return out

    def report(self) -> str:
        def med(d: dict[int, float]) -> float:
            return statistics.median(d.values()) * 1e3 if d else 0.0

        steps = self.wall["training_step"]
        step_ms = med(steps)
        lines = [f"{'phase':48s} {'wall ms':>8s} {'cpu ms':>8s}  share of step"]
        named = 0.0
        for label, _, _ in PHASES:
            if label not in self.wall:
                continue
            wall = med(self.wall[label])
            if label in TOP_LEVEL:
                named += statistics.mean(self.wall[label].values()) * 1e3
            lines.append(f"{label:48s} {wall:8.1f} {med(self.cpu[label]):8.1f}  {wall / step_ms:6.0%}")
        rest = statistics.mean(steps.values()) * 1e3 - named
        step_cpu = med(self.cpu["training_step"])
        label = "rest of training_step (metrics, bookkeeping)"
        lines.append(f"{label:48s} {rest:8.1f} {'':>8s}  {rest / step_ms:6.0%}")
        lines.append(f"{'training_step (what bench_step.py times)':48s} {step_ms:8.1f} {step_cpu:8.1f}")
        if self.loop:
            loop, loop_cpu = statistics.median(self.loop) * 1e3, statistics.median(self.loop_cpu) * 1e3
            label = "Lightning between steps (loop - training_step)"
            lines.append(f"{label:48s} {loop - step_ms:8.1f} {loop_cpu - step_cpu:8.1f}")
            lines.append(f"{'whole step (on_train_batch_start to the next)':48s} {loop:8.1f} {loop_cpu:8.1f}")
        lines.append(f"(medians over {len(steps)} steps; rest = mean step - mean of the named phases)")
        return "\n".join(lines)


def main(argv=None) -> StepProfile:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/demo_cpu.yaml")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out at the start")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ops", type=int, default=0, help="also print torch.profiler's top N operators")
    ap.add_argument("--json", default=None, help="also write the phases' median wall ms to this file")
    args, extra = ap.parse_known_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from rlflow.cli import cli_main

    profile = StepProfile(args.warmup)
    profile.install()
    torch_profile = None
    if args.ops:
        from rlflow.training.module import GRPOModule

        torch_profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        start = GRPOModule.training_step

        def training_step(module_self, batch, batch_idx):
            if module_self.global_step == args.warmup:
                torch_profile.__enter__()
            return start(module_self, batch, batch_idx)

        profile.patch(GRPOModule, "training_step", training_step)
    load = os.getloadavg()
    try:
        with tempfile.TemporaryDirectory() as root:
            cli_main([
                "fit", "--config", args.config, "--model.export_hf=false", "--data.eval_data_path=null",
                "--evaluate_every_n_steps=null",
                "--trajectories.enabled=false", "--trainer.accelerator=cpu", "--trainer.devices=1",
                f"--trainer.max_steps={args.steps}", f"--trainer.default_root_dir={root}",
                "--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.save_dir={root}",
                "--trainer.enable_progress_bar=false", "--trainer.enable_checkpointing=false",
                f"--seed_everything={args.seed}", *extra,
            ])
    finally:
        profile.uninstall()
    if torch_profile is not None:
        torch_profile.__exit__(None, None, None)
        print(torch_profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.ops))
    print(f"profile of {args.config} {' '.join(extra)}: {torch.get_num_threads()} torch thread(s), load average "
          f"{load[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end ({os.cpu_count()} CPUs)")
    print(profile.report())
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": torch.get_num_threads(), "ms": profile.medians()}))
    return profile


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
