"""Tests of the example environment (run: python -m pytest plugins/rlflow-env-example/tests): the game's rules,
its entry point, and a multi-turn rollout through rlflow with a scripted policy."""

from __future__ import annotations

import pytest
from rlflow_env_guess import GuessNumber

from rlflow import registry
from rlflow.environments import EnvStep


def test_game_rules():
    env = GuessNumber(low=0, high=10, turn_penalty=0.25)
    first = env.reset({"prompt": "ignored", "ground_truth": "7"})
    assert first == [{"role": "user", "content": "Guess my number between 0 and 10. Answer with one number."}]
    assert env.step("I think 3") == EnvStep([{"role": "user", "content": "3 is wrong: my number is higher."}], 0.0)
    assert env.step("then 9") == EnvStep([{"role": "user", "content": "9 is wrong: my number is lower."}], 0.0)
    assert env.step("no idea").observation == [{"role": "user", "content": "Answer with one number."}]
    assert env.step("5 or 7") == EnvStep([], 0.5, True)  # the last number counts; two wrong guesses cost 0.5


def test_bad_row_names_the_column():
    with pytest.raises(ValueError, match="integer ground_truth"):
        GuessNumber().reset({"ground_truth": "seven"})


def test_registered_under_its_short_name():
    assert registry.load("rlflow.environments", "guess_number") is GuessNumber


def test_a_multiturn_rollout_through_rlflow():
    """The policy guesses 3, then 7; the environment's hint is inserted between the turns as context."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rlflow.data.dataset import PromptRecord
    from rlflow.rollout.base import Completion, RolloutBackend, SamplingParams
    from rlflow.rollout.multiturn import MultiTurn

    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {c: i for i, c in enumerate(["<|im_start|>", "<|im_end|>", *chars])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    raw.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

    class Scripted(RolloutBackend):
        def __init__(self):
            self.turns = ["3<|im_end|>", "7<|im_end|>"]
            self.prompts = []

        def generate(self, prompts, params, n=1, progress=None):
            self.prompts.append(prompts)
            ids = tok.encode(self.turns.pop(0), add_special_tokens=False)
            return [[Completion(ids, [-1.0] * len(ids), "stop") for _ in range(n)] for _ in prompts]

    record = PromptRecord([{"role": "user", "content": "x"}], {"ground_truth": 7}, "t.jsonl:1", [0], "")
    mt = MultiTurn(tok, {}, environment={"class_path": "guess_number", "init_args": {"low": 1, "high": 9}},
                   max_turns=4)
    backend = Scripted()
    (c,), = mt.generate(backend, [record], SamplingParams(max_tokens=200, stop_token_ids=[tok.eos_token_id]))
    assert tok.decode(c.prompt_ids).startswith("<|im_start|>user\nGuess my number between 1 and 9.")
    assert tok.decode(c.token_ids) == ("3<|im_end|>\n<|im_start|>user\n3 is wrong: my number is higher.<|im_end|>\n"
                                       "<|im_start|>assistant\n7<|im_end|>")
    assert c.mask == [True, True] + [False] * (len(c.token_ids) - 4) + [True, True]
    assert c.env_reward == 1.0 and c.info["turns"] == 2
    assert backend.prompts[1] == [c.prompt_ids + c.token_ids[:-2]]  # turn 2 continued from the exact ids
