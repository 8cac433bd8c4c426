"""``rlflow.demo.tiny_tool_model``: its data rows, and SFT examples laid out exactly as multi-turn rollouts are."""

from __future__ import annotations

import json

from rlflow.data.dataset import PromptRecord
from rlflow.demo import tiny_tool_model
from rlflow.rollout.base import SamplingParams
from tests.helpers.multiturn_helpers import ScriptedBackend


def test_sft_examples_match_the_multiturn_rollout_layout():
    tok = tiny_tool_model.build_tokenizer()
    tok.chat_template = tiny_tool_model.TOOL_TEMPLATE
    enc = tiny_tool_model.Encoder(tok)
    a, b = 123, 456
    ids, labels = enc.encode(a, b, use_tool=True)
    prompt = enc.prompt_ids(a, b)
    assert tok.decode(prompt) == "<|im_start|>system\nTools: calculator<|im_end|>\n<|im_start|>user\nWhat is 123*456?" \
                                 "<|im_end|>\n<|im_start|>assistant\n"
    backend = ScriptedBackend(tok, [[tiny_tool_model.call_text(a, b) + "<|im_end|>"], ["#### 56088<|im_end|>"]])
    record = PromptRecord([{"role": "user", "content": tiny_tool_model.question(a, b)}], {}, "-", prompt)
    (c,), = enc.mt.generate(backend, [record], SamplingParams(max_tokens=400, stop_token_ids=[tok.eos_token_id]))
    assert c.messages[1] == {"role": "tool", "name": "calculator", "content": "56088"}  # the real calculator ran
    assert ids == prompt + c.token_ids  # SFT trains on the very layout GRPO samples
    assert [label != -100 for label in labels[len(prompt):]] == c.mask
    direct, direct_labels = enc.encode(a, b, use_tool=False)
    assert tok.decode(direct[len(prompt):]) == "#### 56088<|im_end|>" and direct_labels[len(prompt)] != -100


def test_build_writes_rows_and_a_loadable_model(tmp_path):
    out = tiny_tool_model.build(tmp_path / "model", tmp_path / "data", phases=(), n_train=8, n_val=4, eval_prompts=0)
    rows = [json.loads(line) for line in (tmp_path / "data" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 8
    for row in rows:
        a, b = map(int, row["prompt"][0]["content"][len("What is "):-1].split("*"))
        assert 100 <= a <= 999 and 100 <= b <= 999 and row["reward_model"]["ground_truth"] == str(a * b)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    schema = {"type": "function", "function": {"name": "calculator"}}
    text = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, tools=[schema])
    assert "Tools: calculator" in text
