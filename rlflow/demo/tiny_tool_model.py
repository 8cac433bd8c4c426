"""Build the tiny tool-calling policy of the agentic CPU demo (``configs/demo_tools_cpu.yaml``) and its data.

What it does
------------
1. The character tokenizer of :mod:`rlflow.demo.tiny_model` with a small chat template that lists the tools' names
   in a system line (``Tools: calculator``; the full JSON schemas would triple the prompt of a 0.4M-parameter model
   that cannot read them anyway) and renders tool results as ``tool`` turns.
2. A tiny randomly initialised Qwen3 (the demo's size), warm-started by SFT on 3-digit multiplication
   (``What is 123*456?``) in two ways, mixed: a fraction of the targets call the calculator
   (``<tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call>``), read its result
   and answer ``#### 56088``; the rest answer ``#### <product>`` at once, which a model this small cannot compute
   reliably. The SFT runs in phases (``--phases steps:tool_fraction:lr,...``, each with a fresh AdamW and
   cosine schedule): 400 steps at 30% tool examples, 300 at 80% (copying the operands into the call and the
   result into the answer is only learned there: after the first phase alone the copies are wrong), then 40 at
   35% and a lower learning rate, which brings the tool-call rate back down to about a quarter. The tool turns
   are laid out exactly as the multi-turn rollout lays them out (the tool message's
   tokens come from :meth:`rlflow.rollout.multiturn.MultiTurn.insert_ids`), loss on the model's own tokens only.
   So after SFT the policy sometimes calls the tool (and is then mostly right) and otherwise mostly wrong: GRPO
   with the strict GSM8K judger can raise the reward by calling the tool more often.
3. Writes ``train.jsonl`` / ``val.jsonl`` (XTuner RL rows, ``data_source: openai/gsm8k``) of new problems.
4. Prints the SFT loss and the sampled tool-call rate and reward of the warm start (a multi-turn rollout with the
   ``hf`` backend and the real calculator).

Simplifications: operands are 100-999 and the prompt has a fixed layout, so copying numbers is positional; the SFT
has no validation split or early stopping; everything runs on the CPU.

:func:`build` does all of it; ``tools/make_tiny_tool_model.py`` is its command line::

    python tools/make_tiny_tool_model.py --out checkpoints/tiny-tool-qwen3 --data-out checkpoints/mult

The default ``--phases`` runs the three phases above in one go. ``--init`` continues the SFT of an earlier build
instead of starting from a fresh model, so the same phases can also be run one at a time (``--phases
400:0.3:0.005``, then ``--init`` of that with ``--seed 1 --phases 300:0.8:0.003``, then ``--seed 2 --phases
40:0.35:0.001``) with the same weights as the one-run build. The printed warm-start figures are one sample of 64
problems.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from rlflow.demo.tiny_model import IM_END, build_model, build_tokenizer, has_model, train_sft, write_jsonl
from rlflow.rollout.multiturn import MultiTurn
from rlflow.tools.base import load_tools

TOOL_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools: ' + (tools | map(attribute='function') | map(attribute='name')"
    " | join(', ')) + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{{- '<tool_call>' + (call['function'] | tojson) + '</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
#: (steps, fraction of tool examples, peak learning rate) of each SFT phase
DEFAULT_PHASES = ((400, 0.3, 5e-3), (300, 0.8, 3e-3), (40, 0.35, 1e-3))


def question(a: int, b: int) -> str:
    return f"What is {a}*{b}?"


def call_text(a: int, b: int) -> str:
    return '<tool_call>{"name": "calculator", "arguments": {"expression": "' + f"{a}*{b}" + '"}}</tool_call>'


def problems(rng: random.Random, n: int) -> list[tuple[int, int]]:
    return [(rng.randint(100, 999), rng.randint(100, 999)) for _ in range(n)]


def rl_row(i: int, split: str, a: int, b: int) -> dict:
    return {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": question(a, b)}],
            "ability": "math", "reward_model": {"ground_truth": str(a * b), "style": "rule"},
            "extra_info": {"index": i, "split": split}}


class Encoder:
    """SFT examples laid out as the multi-turn rollout lays them out: ``(ids, labels)``, labels -100 on the prompt
    and the inserted tool tokens."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.tools = load_tools(["calculator"])
        self.mt = MultiTurn(tokenizer, self.tools, max_turns=3)
        self.eos = tokenizer.eos_token_id

    def prompt_ids(self, a: int, b: int) -> list[int]:
        text = self.tok.apply_chat_template([{"role": "user", "content": question(a, b)}], add_generation_prompt=True,
                                            tokenize=False, tools=[t.schema for t in self.tools.values()])
        return self.tok.encode(text, add_special_tokens=False)

    def encode(self, a: int, b: int, use_tool: bool) -> tuple[list[int], list[int]]:
        p = self.prompt_ids(a, b)
        enc = lambda s: self.tok.encode(s, add_special_tokens=False)  # noqa: E731
        answer = enc(f"#### {a * b}{IM_END}")
        if not use_tool:
            return p + answer, [-100] * len(p) + answer
        call = enc(call_text(a, b) + IM_END)
        inserted = self.mt.insert_ids([{"role": "tool", "name": "calculator", "content": str(a * b)}], self.eos)
        ids = p + call + inserted + answer
        return ids, [-100] * len(p) + call + [-100] * len(inserted) + answer


def sft(model, encoder: Encoder, steps: int, seed: int, tool_fraction: float, batch_size: int = 16,
        lr: float = 5e-3) -> list[float]:
    """:func:`rlflow.demo.tiny_model.train_sft` on multiplication problems; every batch holds exactly
    ``round(tool_fraction * batch_size)`` tool examples."""
    rng = random.Random(seed + 1)
    n_tool = round(tool_fraction * batch_size)

    def next_batch():
        return [encoder.encode(a, b, i < n_tool) for i, (a, b) in enumerate(problems(rng, batch_size))]

    return train_sft(model, next_batch, encoder.tok.pad_token_id, steps, lr)


@torch.no_grad()
def warm_start_stats(model, encoder: Encoder, probs: list[tuple[int, int]], seed: int) -> dict[str, float]:
    """Tool-call rate and strict-#### reward of one sampled multi-turn rollout per problem (T=1, ``hf``)."""
    from rlflow.data.dataset import PromptRecord
    from rlflow.judgers.gsm8k import GSM8KJudger
    from rlflow.rollout.base import SamplingParams
    from rlflow.rollout.hf import HFRollout

    torch.manual_seed(seed)
    backend = HFRollout()
    backend.bind(model, encoder.tok)
    records = [PromptRecord([{"role": "user", "content": question(a, b)}], {}, "-", encoder.prompt_ids(a, b))
               for a, b in probs]
    params = SamplingParams(temperature=1.0, max_tokens=160, stop_token_ids=[encoder.eos])
    completions = [g[0] for g in encoder.mt.generate(backend, records, params, n=1)]
    judge = GSM8KJudger()
    rewards = [judge.score(c.messages[-1]["content"], ground_truth=str(a * b)) for c, (a, b) in zip(completions, probs)]
    return {"tool_calls": sum(bool(c.info["tool_calls"]) for c in completions) / len(probs),
            "reward": sum(r or 0.0 for r in rewards) / len(probs)}


def build(out_dir, data_dir=None, phases=DEFAULT_PHASES, seed: int = 0, force: bool = False, n_train: int = 2048,
          n_val: int = 64, eval_prompts: int = 64, threads: int = 2, init: str | None = None) -> Path:
    """Tokenizer + tiny Qwen3 + phased SFT (``phases``: ``(steps, tool_fraction, lr)``; phase ``i`` draws its
    examples with seed ``seed + i``) into ``out_dir``, data into ``data_dir``; return ``out_dir``."""
    t0 = time.time()
    out_dir = Path(out_dir)
    rng = random.Random(seed + 1000)  # RL problems: drawn apart from the SFT stream (collisions are rare)
    train, val = problems(rng, n_train), problems(rng, n_val)
    if data_dir is not None:
        write_jsonl(Path(data_dir) / "train.jsonl", [rl_row(i, "train", a, b) for i, (a, b) in enumerate(train)])
        write_jsonl(Path(data_dir) / "val.jsonl", [rl_row(i, "test", a, b) for i, (a, b) in enumerate(val)])
        print(f"wrote {len(train)} train / {len(val)} val rows to {data_dir}")
    if has_model(out_dir) and not force:
        print(f"{out_dir} already holds a model; skipping build (use --force to rebuild)")
        return out_dir
    torch.set_num_threads(threads)
    tokenizer = build_tokenizer()
    tokenizer.chat_template = TOOL_TEMPLATE
    encoder = Encoder(tokenizer)
    if init is not None:  # continue the SFT of an earlier build (another tool fraction, another learning rate)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(init)
    else:
        model = build_model(tokenizer, seed)
    print(f"params: {sum(p.numel() for p in model.parameters()):,}")
    for i, (steps, tool_fraction, lr) in enumerate(phases):
        t_sft = time.time()
        losses = sft(model, encoder, steps, seed + i, tool_fraction, lr=lr)
        print(f"sft phase {i + 1}: {steps} steps, {tool_fraction:.0%} tool examples, lr {lr:g}, "
              f"{time.time() - t_sft:.1f}s, loss first {losses[0]:.3f} last {losses[-1]:.3f}")
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if eval_prompts > 0:
        stats = warm_start_stats(model, encoder, val[:eval_prompts], seed)
        print(f"warm start (T=1.0, {min(eval_prompts, len(val))} val prompts): tool-call rate "
              f"{stats['tool_calls']:.2f}, reward {stats['reward']:.3f}")
    print(f"saved to {out_dir} in {time.time() - t0:.1f}s")
    return out_dir


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="checkpoint directory")
    ap.add_argument("--data-out", default=None, help="write train.jsonl/val.jsonl here")
    ap.add_argument("--phases", default=",".join(f"{n}:{f}:{lr}" for n, f, lr in DEFAULT_PHASES),
                    help="SFT phases as steps:tool_fraction:lr, comma-separated ('' for none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init", default=None, help="continue the SFT of this checkpoint instead of a fresh model")
    ap.add_argument("--force", action="store_true", help="rebuild even if --out holds a model")
    args = ap.parse_args(argv)
    phases = [(int(n), float(f), float(lr)) for n, f, lr in (p.split(":") for p in args.phases.split(",") if p)]
    build(args.out, args.data_out, phases, args.seed, args.force, init=args.init)


if __name__ == "__main__":
    main()
