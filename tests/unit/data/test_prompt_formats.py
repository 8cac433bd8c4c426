"""Prompt formats: chat messages with a system-prompt override, multi-turn prompts, plain strings through a
template, and chat-template kwargs such as Qwen3's ``enable_thinking`` passed through."""

from __future__ import annotations

import json

import pytest

from rlflow.data.dataset import DataError, PromptFormat, PromptRecord, check_row

# The part of Qwen3's chat template that reads enable_thinking, on top of the tiny model's ChatML template.
THINKING_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


@pytest.fixture
def tok(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)  # a fresh copy: tests change its template


def record(prompt, **columns) -> PromptRecord:
    return check_row({"prompt": prompt, **columns}, "rows.jsonl:7")


def test_system_prompt_replaces_or_adds_the_system_message(tok):
    fmt = PromptFormat(system_prompt="Be brief.")
    with_system = record([{"role": "system", "content": "Old."}, {"role": "user", "content": "Hi"}])
    without = record([{"role": "user", "content": "Hi"}])
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert fmt.render(with_system, tok) == expected
    assert fmt.render(without, tok) == expected
    assert PromptFormat().render(with_system, tok).startswith("<|im_start|>system\nOld.<|im_end|>")


def test_multi_turn_prompts_keep_every_turn_in_order(tok):
    turns = [
        {"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And times 3?"},
    ]
    text = PromptFormat().render(record(turns), tok)
    assert text == (
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd times 3?<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(DataError, match=r"rows.jsonl:7: field 'prompt\[1\].role' is 'assistant': a prompt must end"):
        record(turns[:2])


def test_plain_strings_as_written_or_through_a_template(tok):
    plain = record("2 + 2 =", data_source="arith", extra_info={"level": 3})
    assert PromptFormat().render(plain, tok) == "2 + 2 ="
    fmt = PromptFormat(
        prompt_template="Question: {prompt}\nAnswer ({data_source}, level {extra_info[level]}) {{json}}:"
    )
    assert fmt.render(plain, tok) == "Question: 2 + 2 =\nAnswer (arith, level 3) {json}:"
    with pytest.raises(DataError, match=r"rows.jsonl:7: prompt_template needs field\(s\) data_source, "
                                        r"extra_info\[level\], which the row lacks \(columns: prompt\)"):
        fmt.render(record("2 + 2 ="), tok)
    with pytest.raises(DataError,
                       match=r"rows.jsonl:7: prompt_template cannot be filled from this row: KeyError: 'level'"):
        fmt.render(record("2 + 2 =", data_source="arith", extra_info={}), tok)
    with pytest.raises(ValueError, match="no '{prompt}' placeholder"):
        PromptFormat(prompt_template="Q: {question}")
    with pytest.raises(ValueError, match="not a valid format string"):
        PromptFormat(prompt_template="Q: {prompt")
    # chat prompts are not templated
    chat = record([{"role": "user", "content": "Hi"}])
    assert fmt.render(chat, tok) == PromptFormat().render(chat, tok)


def test_chat_template_kwargs_reach_the_template(tok):
    tok.chat_template = THINKING_TEMPLATE
    chat = record([{"role": "user", "content": "Hi"}])
    assert PromptFormat().render(chat, tok).endswith("<|im_start|>assistant\n")
    off = PromptFormat(chat_template_kwargs={"enable_thinking": False}).render(chat, tok)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_template_failures_and_missing_templates_name_the_row(tok):
    tok.chat_template = "{{ raise_exception('System message must be at the beginning.') }}"
    with pytest.raises(DataError,
                       match="rows.jsonl:7: the chat template rejected field 'prompt'.*System message must be"):
        PromptFormat().render(record([{"role": "user", "content": "Hi"}]), tok)
    tok.chat_template = None
    with pytest.raises(DataError, match="rows.jsonl:7: field 'prompt' is a list of chat messages "
                                        "but the tokenizer .* has no chat template"):
        PromptFormat().render(record([{"role": "user", "content": "Hi"}]), tok)


def test_datamodule_settings_and_per_source_overrides(tiny_model, tmp_path):
    from rlflow.data.datamodule import RolloutDataModule

    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"prompt": [{"role": "user", "content": "Hi"}], "data_source": "c"}) + "\n")
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"prompt": "1+1", "data_source": "p"}) + "\n")
    dm = RolloutDataModule(
        train_data_path=[
            str(chat),
            {"path": str(plain), "prompt_template": "Solve: {prompt} =", "system_prompt": "unused"},
        ],
        tokenizer_path=str(tiny_model),
        prompts={
            "system_prompt": "Data-level.",
            "template": "Q: {prompt}",
            "chat_template_kwargs": {"enable_thinking": False},
        },
        judging={"judgers": {"*": "gsm8k"}},
    )
    dm.load_tokenizer().chat_template = THINKING_TEMPLATE
    chat_rec, plain_rec = dm.train_prompts.load(dm.tokenizer)
    assert chat_rec.prompt_text == (
        "<|im_start|>system\nData-level.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert plain_rec.prompt_text == "Solve: 1+1 ="  # the source's template wins over data.prompts.template
    plain_source = dm.train_prompts.sources[1]
    assert dm.train_prompts.format_for(plain_source).render(plain_rec, dm.tokenizer) == "Solve: 1+1 ="
    assert dm.tokenizer.decode(plain_rec.prompt_ids) == plain_rec.prompt_text
    with pytest.raises(ValueError, match="no '{prompt}' placeholder"):
        RolloutDataModule(train_data_path=str(plain), prompts={"template": "{question}"})
