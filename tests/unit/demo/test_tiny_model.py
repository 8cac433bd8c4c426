"""Tests for rlflow.demo.tiny_model, the CPU demo's model and data (random-init build only: --sft-steps 0)."""

import json
import re
from pathlib import Path

import pytest
import torch

from rlflow.demo import tiny_model as mtm

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    out = mtm.build(root / "model", data_dir=root / "data", sft_steps=0, seed=0, eval_prompts=0)
    return out, root / "data"


@pytest.fixture(scope="module")
def tokenizer(built):
    return transformers.AutoTokenizer.from_pretrained(built[0])


def test_tokenizer_round_trips_text(tokenizer):
    texts = [
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many.",
        "She earns $12 an hour; 3/4 of 1,234.5 = ?\n#### 925.875",
        "  leading and trailing spaces  \n\nand\ttabs ~`!@#%^&*()_+-={}[]|\\:;\"'<>?",
        "ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz 0123456789",
    ]
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) == len(text)  # character level
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids) == text


def test_special_tokens(tokenizer):
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.padding_side == "left"
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    ids = {tokenizer.pad_token_id, tokenizer.eos_token_id, im_start, tokenizer.unk_token_id}
    assert len(ids) == 4 and None not in ids
    assert tokenizer.encode("é", add_special_tokens=False) == [tokenizer.unk_token_id]
    encoded = tokenizer.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert encoded[0] == im_start and encoded[-1] == tokenizer.eos_token_id and len(encoded) == 9
    batch = tokenizer(["a", "abc"], padding=True, add_special_tokens=False)
    assert batch["input_ids"][0][0] == tokenizer.pad_token_id  # left padding


def test_chat_template(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_gen = tokenizer.apply_chat_template(messages[1:], add_generation_prompt=False, tokenize=False)
    assert no_gen == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"


def test_model_reloads_with_identical_logits(built, tokenizer):
    out, _ = built
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config.model_type == "qwen3"
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    assert model.config.vocab_size >= len(tokenizer)
    fresh = mtm.build_model(mtm.build_tokenizer(), seed=0).eval()  # same seed, no SFT
    input_ids = torch.tensor([tokenizer.encode("What is 12 + 34? #### 46", add_special_tokens=False)])
    with torch.no_grad():
        reloaded = model(input_ids=input_ids).logits
        again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()(input_ids=input_ids).logits
        expected = fresh(input_ids=input_ids).logits
    assert reloaded.shape == (1, input_ids.shape[1], model.config.vocab_size)
    torch.testing.assert_close(reloaded, again, rtol=0, atol=0)
    torch.testing.assert_close(reloaded, expected)


def _read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_data_rows(built):
    _, data = built
    train, val = _read_jsonl(data / "train.jsonl"), _read_jsonl(data / "val.jsonl")
    n = len(mtm.all_problems())
    assert n == 200 and len(train) == n and len(val) == 64  # every fact is a training prompt
    for split, rows in (("train", train), ("test", val)):
        for i, row in enumerate(rows):
            assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
            assert row["reward_model"]["style"] == "rule"
            assert row["extra_info"]["index"] == i and row["extra_info"]["split"] == split
            (message,) = row["prompt"]
            assert message["role"] == "user" and "####" in message["content"]
            a, op, b = re.search(r"What is (\d+) ([+-]) (\d+)\?", message["content"]).groups()
            expected = int(a) + int(b) if op == "+" else int(a) - int(b)
            truth = row["reward_model"]["ground_truth"]
            assert truth == str(expected)
            assert row["extra_info"]["question"] in message["content"]
            assert row["extra_info"]["answer"].endswith(f"#### {truth}")
    prompts = lambda rows: {r["prompt"][0]["content"] for r in rows}  # noqa: E731
    assert len(prompts(train)) == len(train)  # no duplicate prompts
    assert prompts(val) <= prompts(train)  # by design: the tiny task evaluates on trained facts


def test_data_is_deterministic(built, tmp_path):
    _, data = built
    train, val, _ = mtm.split_problems(0, 1024, 64)
    mtm.write_data(tmp_path, train, val)
    for name in ("train.jsonl", "val.jsonl"):
        assert (tmp_path / name).read_text() == (data / name).read_text()


def test_sft_pool_covers_every_problem_and_rl_prompts_come_from_it():
    train, val, pool = mtm.split_problems(0, 1024, 64)
    assert sorted(pool) == sorted(mtm.all_problems())
    assert set(train) <= set(pool) and set(val) <= set(train)


def test_strict_score():
    assert mtm.strict_gsm8k_score("12 + 3 = 15\n#### 15", "15") == 1.0
    assert mtm.strict_gsm8k_score("#### 1,015", "1015") == 1.0
    assert mtm.strict_gsm8k_score("The answer is 15.", "15") == 0.0
    assert mtm.strict_gsm8k_score("#### 14\n#### 15", "15") == 1.0


def test_sampled_reward_runs(built, tokenizer):
    model = transformers.AutoModelForCausalLM.from_pretrained(built[0]).eval()
    stats = mtm.sampled_reward(model, tokenizer, [(12, "+", 3), (40, "-", 7)], max_new_tokens=8)
    assert set(stats) == {"reward", "format", "math"}
    assert all(0.0 <= v <= 1.0 for v in stats.values())


def test_rerun_without_force_skips(built, capsys):
    out, _ = built
    before = (out / "config.json").stat().st_mtime_ns
    mtm.main(["--out", str(out), "--sft-steps", "0"])
    assert "already" in capsys.readouterr().out
    assert (out / "config.json").stat().st_mtime_ns == before
