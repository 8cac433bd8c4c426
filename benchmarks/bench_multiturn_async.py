"""Multi-turn rollout time on the ``engine`` (or ``--backend hf``) with slow tools: trajectories at their own pace
(``MultiTurn.run_async``) against the same backend turn by turn (the anchor, measured in the same run, interleaved).

The model and prompts are the agentic CPU demo's (``configs/demo_tools_cpu.yaml``: build them with
``python tools/make_tiny_tool_model.py --out checkpoints/tiny-tool-qwen3 --data-out checkpoints/mult``): 16
multiplication prompts x 8 samples, ``max_tokens`` 160, up to 3 turns, T=1, and the real ``calculator`` tool made
slow: each call sleeps an exponentially distributed time of mean ``--delay`` seconds (a search API, a sandbox),
drawn from the call's arguments and the repeat, so a call waits as long in both settings.
The anchor is the same backend and loop behind a source that admits the next turns only once every tool of the
turn has answered and nothing decodes (synchronous turns, as ``MultiTurn.run_sync`` runs a backend without
``serve``); both settings key every trajectory's draws alike, so they sample identical trajectories (the last
line counts them) and the time difference is the scheduling alone. Medians of ``--repeats`` interleaved runs.

Usage::

    python benchmarks/bench_multiturn_async.py --model checkpoints/tiny-tool-qwen3 --data checkpoints/mult/train.jsonl
"""

from __future__ import annotations

import argparse
import functools
import math
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

if not __package__:  # run as ``python benchmarks/<name>.py``: the repository root, for ``benchmarks.`` imports
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_multiturn_cache import tool_prompts, trajectory_stats  # noqa: E402


class TurnBarrier:
    """A request source around :class:`~rlflow.rollout.multiturn.TurnSource` that hands over the next turns only
    when the engine is idle and no tool is running: synchronous turns on the asynchronous loop."""

    def __init__(self, source) -> None:
        self.source = source

    def poll(self, wait: bool):
        if not wait:
            return []
        ready: list = []
        while True:  # block only while holding nothing (the source knows no turn the barrier holds back)
            new = self.source.poll(wait=not ready)
            if new is None:
                return ready or None
            ready += new
            if not self.source.turns:
                return ready
            time.sleep(0.001)


class TurnByTurn:
    """The backend whose ``serve`` waits for whole turns (:class:`TurnBarrier`); caches and call keys as its own."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.keep_caches = getattr(engine, "keep_caches", None)  # hf keeps no caches

    def next_call_key(self) -> int:
        return self.engine.next_call_key()

    def serve(self, source, params, progress=None):
        return self.engine.serve(TurnBarrier(source), params, progress)


class EveryTurn:
    """A tool parser that reads every turn as one calculator call of the turn's text."""

    def parse(self, text: str):
        from rlflow.tools.base import ToolCall

        return text, [ToolCall("calculator", {"expression": text})]


def slow(fn, delay: float, run: list[int]):
    """``fn`` after a pause drawn from an exponential distribution of mean ``delay`` seconds, seeded by the call's
    arguments and the run number ``run[0]``: a trajectory's call waits as long in both settings of a repeat."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        u = random.Random(f"{run[0]}:{args}:{sorted(kwargs.items())}").random()
        threading.Event().wait(-delay * math.log(1.0 - u) if delay > 0 else 0.0)
        return fn(*args, **kwargs)

    return wrapper


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="checkpoints/tiny-tool-qwen3")
    parser.add_argument("--data", default="checkpoints/mult/train.jsonl")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--delay", type=float, default=0.2, help="mean seconds a tool call takes (exponential)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--backend", choices=["engine", "hf"], default="engine",
                        help="the backend both settings run on (hf: model.generate over the ready trajectories)")
    parser.add_argument("--call-every-turn", action="store_true",
                        help="parse every turn as a calculator call of its text (most fail, after their pause): "
                             "max_turns - 1 calls in a row per trajectory, where waiting for whole turns costs most")
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlflow.rollout.base import SamplingParams
    from rlflow.rollout.engine import EngineRollout
    from rlflow.rollout.hf import HFRollout
    from rlflow.rollout.multiturn import MultiTurn
    from rlflow.tools.base import Tool, load_tools

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    calculator = load_tools(["calculator"])["calculator"]
    run = [0]
    tools = {"calculator": Tool("calculator", slow(calculator.fn, args.delay, run), calculator.schema)}
    records = tool_prompts(tok, args.data, args.prompts, [calculator.schema], {})
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, stop_token_ids=[tok.eos_token_id])
    mt = MultiTurn(tok, tools, parser=EveryTurn() if args.call_every_turn else "hermes", max_turns=args.max_turns,
                   tool_timeout=600)
    times: dict[str, list[float]] = {"async": [], "turn by turn": []}
    sampled: dict[str, list[list[int]]] = {}
    turns = calls = 0.0
    for repeat in range(args.repeats):
        run[0] = repeat
        for name in times:
            engine = EngineRollout(seed=0) if args.backend == "engine" else HFRollout(seed=0)
            engine.bind(model, tok)
            t0 = time.perf_counter()
            groups = mt.generate(engine if name == "async" else TurnByTurn(engine), records, params, n=args.n)
            times[name].append(time.perf_counter() - t0)
            sampled[name], turns, calls = trajectory_stats(groups)
    fast, anchor = statistics.median(times["async"]), statistics.median(times["turn by turn"])
    every = " on every turn" if args.call_every_turn else ""
    print(f"{args.backend}: calculator{every} with a mean delay of {args.delay} s: "
          f"{args.prompts} prompts x {args.n}, max_tokens "
          f"{args.max_tokens}, max_turns {args.max_turns}, {args.threads} thread(s); {turns:.2f} turns and "
          f"{calls:.2f} tool calls per trajectory")
    print(f"turn by turn (anchor): {anchor:.3f} s; async: {fast:.3f} s")
    same = sum(a == b for a, b in zip(sampled["async"], sampled["turn by turn"]))
    print(f"speed-up: {anchor / fast:.2f}x (median of {args.repeats} interleaved runs); identical trajectories: "
          f"{same}/{len(sampled['async'])}")


if __name__ == "__main__":
    main()
