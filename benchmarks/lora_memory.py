"""Peak memory of one GRPO-style training step with LoRA adapters vs full fine-tuning, on the CPU.

Each mode runs in a fresh process (so one mode's freed memory cannot hide the other's peak): load the model
(``--dtype``), with ``--mode lora`` inject PEFT adapters the way ``model.lora`` does
(:func:`rlflow.models.lora.apply_lora`),
then take one step on a random batch of ``--seqs`` sequences of ``--prompt`` + ``--completion`` tokens: rlflow's
chunked completion log-probs, a policy-gradient loss, backward, AdamW step (its moments are allocated here, as in the
first step of a run). Every weight is read once before the step, so pages of a memory-mapped checkpoint count
as loaded, not as the step's. A thread samples the process's resident memory (VmRSS) every 2 ms; reported are the RSS
after loading, the peak during the step and their difference (what the step itself needs: activations, gradients,
optimizer state), plus the trainable parameter count. The last line is the LoRA/full ratio of the step's memory.

    python benchmarks/lora_memory.py --model checkpoints/tiny-qwen3
    python benchmarks/lora_memory.py --model checkpoints/smollm2-135m-instruct --seqs 4 --completion 32

Simplifications: CPU resident memory, not a GPU allocator's; the step is one micro-batch, not a whole rollout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class PeakSampler:
    """Samples VmRSS in a thread until stopped; ``peak`` is the largest value seen."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval, self.peak, self._stop = interval, rss_mib(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_mib())
            time.sleep(self.interval)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_mib())


def child(args: argparse.Namespace) -> dict:
    import torch

    from rlflow.data.experience import Experience, collate
    from rlflow.models.loading import load_causal_lm
    from rlflow.models.lora import LoraSettings, apply_lora
    from rlflow.training.logprobs import completion_logprobs

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = load_causal_lm(args.model, args.dtype)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    if args.mode == "lora":
        apply_lora(model, LoraSettings(r=args.r, alpha=2 * args.r, target_modules="all-linear"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-6)
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (args.seqs, args.prompt + args.completion))
    exps = [Experience(row[: args.prompt].tolist(), row[args.prompt:].tolist(), [0.0] * args.completion,
                       0.0, 1.0 if i % 2 else -1.0, i // 4, "length", 0) for i, row in enumerate(ids)]
    batch = collate(exps, pad_id=0)
    with torch.no_grad():  # read every weight once: memory-mapped checkpoint pages count before the step, not in it
        sum(float(p.sum()) for p in model.parameters())
    loaded = rss_mib()
    start = time.perf_counter()
    with PeakSampler() as sampler:
        logprobs, _ = completion_logprobs(model, batch, 1.0, 1024)
        mask = batch["completion_mask"]
        loss = -(logprobs * batch["advantages"][:, None] * mask).sum() / mask.sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {
        "mode": args.mode, "trainable": sum(p.numel() for p in params),
        "total": sum(p.numel() for p in model.parameters()), "loaded_mib": loaded, "peak_mib": sampler.peak,
        "step_mib": sampler.peak - loaded, "seconds": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "checkpoints" / "tiny-qwen3"))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--completion", type=int, default=64)
    parser.add_argument("--r", type=int, default=16, help="LoRA rank (alpha = 2r, all linear layers)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--mode", choices=["full", "lora"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:  # a child: one mode, one JSON line
        print(json.dumps(child(args)))
        return
    results = {}
    for mode in ("full", "lora"):
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--mode", mode], capture_output=True,
                             text=True, check=True)
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"model {args.model} ({args.dtype}), {args.seqs} x ({args.prompt} + {args.completion}) tokens, "
          f"LoRA r={args.r} all-linear, gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}")
    print(f"{'mode':<6}{'trainable':>14}{'loaded MiB':>12}{'peak MiB':>11}{'step MiB':>11}{'step s':>9}")
    for r in results.values():
        print(f"{r['mode']:<6}{r['trainable']:>14,}{r['loaded_mib']:>12.1f}{r['peak_mib']:>11.1f}"
              f"{r['step_mib']:>11.1f}{r['seconds']:>9.2f}")
    full, lora = results["full"], results["lora"]
    print(f"LoRA/full: step memory {lora['step_mib'] / full['step_mib']:.3f}, peak RSS "
          f"{lora['peak_mib'] / full['peak_mib']:.3f}, "
          f"trainable parameters {lora['trainable'] / full['trainable']:.4f}")


if __name__ == "__main__":
    main()
