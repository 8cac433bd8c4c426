"""Multi-turn rollout time on the ``engine`` with each trajectory continued from its own KV cache, against the same
engine re-prefilling the whole trajectory every turn (the anchor, measured in the same run, interleaved).

The model and prompts are the agentic CPU demo's (``configs/demo_tools_cpu.yaml``: build them with
``python tools/make_tiny_tool_model.py --out checkpoints/tiny-tool-qwen3 --data-out checkpoints/mult``): 16
multiplication prompts x 8 samples, the real ``calculator`` tool, ``max_tokens`` 160, up to 3 turns, T=1. Both
settings use the same engine seed, so they sample the same trajectories (up to float rounding); the figures are
the median of ``--repeats`` interleaved runs, and the prefilled-token counts show what the continuation saves.
``--environment guess_number --max-turns 8 --max-tokens 400`` gives longer histories (the example environment of
``plugins/rlflow-env-example`` hints after every wrong answer).

Usage::

    python benchmarks/bench_multiturn_cache.py --model checkpoints/tiny-tool-qwen3 --data checkpoints/mult/train.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


class Replay:
    """The engine without ``keep_caches``: the multi-turn loop then re-prefills every turn (the anchor). Its
    ``serve`` and call keys are the engine's, so the loop is the same asynchronous one and each trajectory samples
    from the same random stream as with the caches."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def stream(self, *args, **kwargs):
        return self.engine.stream(*args, **kwargs)

    def serve(self, *args, **kwargs):
        return self.engine.serve(*args, **kwargs)

    def next_call_key(self) -> int:
        return self.engine.next_call_key()


def tool_prompts(tok, path: str, count: int, schemas: list[dict], columns: dict) -> list:
    """The first ``count`` rows of an XTuner-format jsonl as prompt records, rendered with the chat template and the
    tools' ``schemas``."""
    from rlflow.data.dataset import PromptRecord

    records = []
    with open(path) as f:
        for line in list(f)[:count]:
            messages = json.loads(line)["prompt"]
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, tools=schemas)
            records.append(PromptRecord(messages, columns, "-", tok.encode(text, add_special_tokens=False), text))
    return records


def trajectory_stats(groups) -> tuple[list[list[int]], float, float]:
    """A multi-turn rollout's sampled ids per trajectory, mean turns and mean tool calls per trajectory."""
    done = [c for g in groups for c in g]
    turns = sum(c.info["turns"] for c in done) / len(done)
    calls = sum(sum(c.info["tool_calls"].values()) for c in done) / len(done)
    return [c.token_ids for c in done], turns, calls


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="checkpoints/tiny-tool-qwen3")
    parser.add_argument("--data", default="checkpoints/mult/train.jsonl")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--environment", default=None,
                        help="an rlflow.environments name instead of the calculator (e.g. guess_number, secret 7: "
                             "the demo model's answers get a hint and it answers again, turn after turn)")
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlflow.rollout.base import SamplingParams
    from rlflow.rollout.engine import EngineRollout
    from rlflow.rollout.multiturn import MultiTurn
    from rlflow.tools.base import load_tools

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tools = load_tools(["calculator"])
    records = tool_prompts(tok, args.data, args.prompts, [t.schema for t in tools.values()], {"ground_truth": "7"})
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, stop_token_ids=[tok.eos_token_id])
    mt = MultiTurn(tok, tools if args.environment is None else {}, environment=args.environment,
                   max_turns=args.max_turns)
    times: dict[str, list[float]] = {"continue": [], "re-prefill": []}
    prefilled: dict[str, int] = {}
    turns = calls = 0.0
    sampled: dict[str, list[list[int]]] = {}
    for _ in range(args.repeats):
        for name in times:
            engine = EngineRollout(seed=0)
            engine.bind(model, tok)
            before = engine.prefilled_tokens
            t0 = time.perf_counter()
            groups = mt.generate(engine if name == "continue" else Replay(engine), records, params, n=args.n)
            times[name].append(time.perf_counter() - t0)
            prefilled[name] = engine.prefilled_tokens - before
            sampled[name], turns, calls = trajectory_stats(groups)
    cont, anchor = statistics.median(times["continue"]), statistics.median(times["re-prefill"])
    print(f"{args.environment or 'calculator'}: {args.prompts} prompts x {args.n}, max_tokens {args.max_tokens}, "
          f"max_turns {args.max_turns}, "
          f"{args.threads} thread(s); {turns:.2f} turns and {calls:.2f} tool calls per trajectory")
    print(f"re-prefill (anchor): {anchor:.3f} s, {prefilled['re-prefill']} tokens prefilled")
    print(f"continue from cache: {cont:.3f} s, {prefilled['continue']} tokens prefilled")
    same = sum(a == b for a, b in zip(sampled["continue"], sampled["re-prefill"]))
    print(f"speed-up: {anchor / cont:.2f}x (median of {args.repeats} interleaved runs); identical trajectories: "
          f"{same}/{len(sampled['continue'])}")


if __name__ == "__main__":
    main()
