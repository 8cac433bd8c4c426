"""A tiny, locally trained Qwen3 checkpoint (and a matching data set) for rlflow's demos and tests.

What it does
------------
1. Builds a *character-level* tokenizer with the `tokenizers` library (one token per printable
   ASCII character + newline + tab, an ``<unk>`` token, and the Qwen special tokens
   ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos)), wraps it in
   ``transformers.PreTrainedTokenizerFast`` with a Qwen-style chat template and left padding.
2. Builds a tiny randomly initialised ``Qwen3ForCausalLM`` (~0.4M parameters).
3. Warm-starts it with a short supervised fine-tune (plain torch loop, AdamW, loss on completion
   tokens only) on a synthetic two-operand arithmetic task phrased in GSM8K's RL prompt format.
   On purpose only part of the SFT targets end with the GSM8K ``#### <answer>`` line; the rest
   end with ``The answer is <answer>.`` (exactly half of every batch), so right after SFT the arithmetic is
   mostly right (~0.8-0.9 of equations at temperature 1.0) but only about half the samples use the ``####``
   format: the sampled GSM8K reward starts near 0.4 and GRPO has room to raise it towards the arithmetic's
   accuracy by learning the format.
4. Optionally (``--data-out``) writes ``train.jsonl`` / ``val.jsonl`` of the same task in
   XTuner's RL jsonl format, with prompts held out from the SFT data.
5. Prints parameter count, SFT loss first/last, a sampled reward at temperature 1.0 on val
   prompts, and wall time.

Simplifications: the "word problems" are just ``What is a + b?`` / ``What is a - b?`` with single-digit
operands (200 facts, negative results included); SFT, RL and evaluation share those problems (the demo shows
GRPO fixing the format and sharpening uncertain answers, not generalisation); the reward printed here is a tiny
inline copy of the strict GSM8K judger; there is no validation-based early stopping; everything runs on CPU.

:func:`build` does all of it; ``tools/make_tiny_model.py`` is its command line::

    python tools/make_tiny_model.py --out checkpoints/tiny-qwen3 [--data-out data/arith] \
        [--sft-steps N] [--seed 0] [--force]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import string
import time
from pathlib import Path

from rlflow.quiet import quiet_third_party

quiet_third_party()  # before transformers imports torchao: its import-time noise (rlflow/quiet.py)

import torch  # noqa: E402
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from rlflow.rollout.engine import cache_kwargs, common_prefix_len  # noqa: E402

PAD, IM_START, IM_END, UNK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END, UNK]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
OPS = ("+", "-")
A_RANGE, B_RANGE = range(10), range(10)  # single digits: 200 facts a tiny model learns in ~2 minutes

DEFAULT_SFT_STEPS = 500  # math ~0.8-0.9 right at T=1 (seeds 0-2); 300 steps left it at ~0.5 and RL drifted it
DEFAULT_HASH_FRACTION = 0.5  # fraction of SFT targets that end with "#### <c>": room for RL to learn the format
MODEL_KWARGS = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
)


# ----------------------------------------------------------------------------- tokenizer


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: every character is one token; specials are matched first."""
    chars = sorted(set(string.printable) - {"\x0b", "\x0c", "\r"})  # printable ASCII + \t \n
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in chars:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # concatenate characters, no spaces in between
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=UNK,
        pad_token=PAD,
        eos_token=IM_END,
        additional_special_tokens=[IM_START],
        padding_side="left",
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL_KWARGS["max_position_embeddings"],
    )


# ----------------------------------------------------------------------------- task / data


def all_problems() -> list[tuple[int, str, int]]:
    """Every (a, op, b) of the task; subtraction only with a >= b."""
    return [
        (a, op, b)
        for a in A_RANGE
        for b in B_RANGE
        for op in OPS
    ]


def solve(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


def question(a: int, op: str, b: int) -> str:
    return f"What is {a} {op} {b}?"


def prompt_text(a: int, op: str, b: int) -> str:
    return f"{INSTRUCTION}\n{question(a, op, b)}"


def completion(a: int, op: str, b: int, hash_format: bool) -> str:
    c = solve(a, op, b)
    final = f"#### {c}" if hash_format else f"The answer is {c}."
    return f"{a} {op} {b} = {c}\n{final}"


def split_problems(seed: int, n_train: int, n_val: int):
    """Shuffle all problems; RL train = the first ``n_train``, val = the first ``n_val``, SFT pool = all.

    The task is small (200 facts), so SFT, RL and evaluation share problems: the demo measures how fast GRPO
    fixes the answer format and sharpens answers the SFT left uncertain, not generalisation.
    """
    probs = all_problems()
    random.Random(seed).shuffle(probs)
    return probs[:n_train], probs[:n_val], probs


def rl_row(i: int, split: str, prob: tuple[int, str, int]) -> dict:
    c = str(solve(*prob))
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": prompt_text(*prob)}],
        "ability": "math",
        "reward_model": {"ground_truth": c, "style": "rule"},
        "extra_info": {
            "index": i,
            "split": split,
            "question": question(*prob),
            "answer": completion(*prob, hash_format=True),
        },
    }


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def write_data(data_dir: Path, train, val) -> None:
    write_jsonl(data_dir / "train.jsonl", [rl_row(i, "train", p) for i, p in enumerate(train)])
    write_jsonl(data_dir / "val.jsonl", [rl_row(i, "test", p) for i, p in enumerate(val)])


def strict_gsm8k_score(text: str, ground_truth: str) -> float:
    """Tiny copy of the strict GSM8K judger: last '#### <num>' in the last 300 chars."""
    found = re.findall(r"#### (\-?[0-9\.\,]+)", text[-300:])
    if not found:
        return 0.0
    return float(found[-1].replace(",", "").replace("$", "") == ground_truth)


# ----------------------------------------------------------------------------- model


def build_model(tokenizer, seed: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    ids = dict(
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.convert_tokens_to_ids(IM_START),
        eos_token_id=tokenizer.eos_token_id,
    )
    config = Qwen3Config(vocab_size=len(tokenizer), **MODEL_KWARGS, **ids)
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(**ids)
    return model


def encode_example(tokenizer, prob, hash_format: bool) -> tuple[list[int], list[int]]:
    """Return (input_ids, labels) with labels = -100 on the prompt."""
    messages = [{"role": "user", "content": prompt_text(*prob)}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    p_ids = tokenizer.encode(prompt, add_special_tokens=False)
    c_ids = tokenizer.encode(completion(*prob, hash_format) + IM_END, add_special_tokens=False)
    return p_ids + c_ids, [-100] * len(p_ids) + c_ids


def shared_prefix_len(examples) -> int:
    """Length of the token prefix common to every example, leaving >= 1 own prompt token."""
    return common_prefix_len([ids for ids, _ in examples])


def collate(examples, pad_id: int, start: int = 0):
    """Right-pad `examples[i][start:]` (RoPE is relative, so the padding side does not matter)."""
    examples = [(ids[start:], lab[start:]) for ids, lab in examples]
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id)
    labels = torch.full((len(examples), width), -100)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (ids, lab) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        mask[i, : len(ids)] = 1
    return input_ids, mask, labels


def batch_loss(model, examples, pad_id: int) -> torch.Tensor:
    """Mean completion-token loss. The prompt prefix shared by the whole batch (the constant
    instruction) is run once with batch size 1 and its KV cache is broadcast to the batch;
    gradients still flow through it. This makes each step ~2.5x cheaper on CPU."""
    n = shared_prefix_len(examples)
    input_ids, mask, labels = collate(examples, pad_id, start=n)
    if n == 0:
        return model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
    prefix = torch.tensor([examples[0][0][:n]])
    out = model.model(input_ids=prefix, use_cache=True)
    cache = out.cache if "cache" in out else out.past_key_values  # transformers >= 5.2x names it cache
    cache.batch_repeat_interleave(len(examples))
    full_mask = torch.cat([torch.ones(len(examples), n, dtype=mask.dtype), mask], dim=1)
    return model(input_ids=input_ids, attention_mask=full_mask, labels=labels, **cache_kwargs(model, cache)).loss


def train_sft(model, next_batch, pad_id: int, steps: int, lr: float) -> list[float]:
    """AdamW (weight decay 0.01, betas 0.9/0.98) with linear warm-up over ``steps // 20`` steps, then cosine decay;
    ``next_batch()`` gives each step's ``(ids, labels)`` examples. Returns the per-step losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * s / steps)))
    )
    model.train()
    losses = []
    for _ in range(steps):
        loss = batch_loss(model, next_batch(), pad_id)  # the shared prompt head run once
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    return losses


def sft(model, tokenizer, pool, steps: int, seed: int, batch_size=32, lr=5e-3,
        hash_fraction=DEFAULT_HASH_FRACTION) -> list[float]:
    """:func:`train_sft` on examples drawn from ``pool``; returns per-step losses."""
    rng = random.Random(seed + 1)
    # Every batch holds exactly round(hash_fraction * batch_size) "####" targets: with a random
    # per-example coin the format bias drifts with the last few batches (seen: p(####) = 0.29).
    n_hash = round(hash_fraction * batch_size)

    def next_batch():
        return [encode_example(tokenizer, rng.choice(pool), i < n_hash) for i in range(batch_size)]

    return train_sft(model, next_batch, tokenizer.pad_token_id, steps, lr)


@torch.no_grad()
def sampled_reward(model, tokenizer, probs, temperature=1.0, seed=0, max_new_tokens=48) -> dict:
    """One sample per prompt: mean strict-#### reward, plus format / equation hit rates."""
    torch.manual_seed(seed)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt_text(*p)}], add_generation_prompt=True, tokenize=False
        )
        for p in probs
    ]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(
        **enc, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
        max_new_tokens=max_new_tokens,
    )
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    n = len(probs)
    return {
        "reward": sum(strict_gsm8k_score(t, str(solve(*p))) for t, p in zip(texts, probs)) / n,
        "format": sum("#### " in t for t in texts) / n,  # diagnostic: used the #### format
        "math": sum(f"= {solve(*p)}\n" in t for t, p in zip(texts, probs)) / n,  # equation right
    }


# ----------------------------------------------------------------------------- entry points


def has_model(out_dir: Path) -> bool:
    return all((out_dir / name).exists() for name in ("config.json", "tokenizer.json", "tokenizer_config.json"))


def build(out_dir, data_dir=None, sft_steps: int = DEFAULT_SFT_STEPS, seed: int = 0,
          force: bool = False, n_train: int = 1024, n_val: int = 64, eval_prompts: int = 64,
          threads: int = 2) -> Path:
    """Build tokenizer + tiny Qwen3 (+ SFT warm start) into `out_dir`; return `out_dir`."""
    t0 = time.time()
    out_dir = Path(out_dir)
    train, val, pool = split_problems(seed, n_train, n_val)
    if data_dir is not None:
        write_data(Path(data_dir), train, val)
        print(f"wrote {len(train)} train / {len(val)} val rows to {data_dir}")
    if has_model(out_dir) and not force:
        print(f"{out_dir} already holds a model; skipping build (use --force to rebuild)")
        return out_dir
    torch.set_num_threads(threads)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed)
    print(f"params: {sum(p.numel() for p in model.parameters()):,}")
    if sft_steps > 0:
        t_sft = time.time()
        losses = sft(model, tokenizer, pool, sft_steps, seed)
        print(f"sft: {sft_steps} steps in {time.time() - t_sft:.1f}s, "
              f"loss first {losses[0]:.3f} last {losses[-1]:.3f}")
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if eval_prompts > 0:
        stats = sampled_reward(model, tokenizer, val[:eval_prompts], seed=seed)
        print(f"sampled reward (T=1.0, {min(eval_prompts, len(val))} val prompts): "
              f"{stats['reward']:.3f} (#### format {stats['format']:.2f}, "
              f"equation correct {stats['math']:.2f})")
    print(f"saved to {out_dir} in {time.time() - t0:.1f}s")
    return out_dir


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="checkpoint directory")
    ap.add_argument("--data-out", default=None, help="write train.jsonl/val.jsonl here")
    ap.add_argument("--sft-steps", type=int, default=DEFAULT_SFT_STEPS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="rebuild even if --out has a model")
    ap.add_argument("--eval-prompts", type=int, default=64, help="0 skips the reward print")
    args = ap.parse_args(argv)
    build(args.out, args.data_out, sft_steps=args.sft_steps, seed=args.seed, force=args.force,
          eval_prompts=args.eval_prompts)


if __name__ == "__main__":
    main()
