"""Reading prompt datasets: XTuner and TRL rows, chat templates, over-long prompts, and every bad-row error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlflow.data.dataset import DataError, read_jsonl
from tests.helpers.paths import DATA


def write(tmp_path: Path, lines: list[str], name: str = "d.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_a_list_ground_truth_of_answers_is_kept(tmp_path):
    path = write(tmp_path, ['{"prompt": "q", "reward_model": {"ground_truth": ["72", 72.0]}}'])
    (record,) = read_jsonl(path)
    assert record.columns["ground_truth"] == ["72", 72.0]


def test_reads_xtuner_rows_and_lifts_ground_truth():
    records = read_jsonl(DATA / "train_example.jsonl")
    assert len(records) == 200
    first = records[0]
    assert first.prompt[0]["role"] == "user" and "Natalia" in first.prompt[0]["content"]
    assert first.columns["ground_truth"] == "72"
    assert first.columns["data_source"] == "openai/gsm8k"
    assert first.columns["extra_info"]["index"] == 0
    assert first.source.endswith("train_example.jsonl:1")


def test_reads_trl_rows_with_string_prompts_and_extra_columns(tmp_path):
    path = write(tmp_path, [json.dumps({"prompt": "2+2=", "solution": "4", "difficulty": 1})])
    (record,) = read_jsonl(path)
    assert record.prompt == "2+2="
    assert record.columns == {"solution": "4", "difficulty": 1}


@pytest.mark.parametrize(
    "line, field",
    [
        ('{"prompt": "a", ', "invalid JSON"),
        ('["not", "an", "object"]', "must be a JSON object"),
        ('{"data_source": "x"}', "field 'prompt' is missing"),
        ('{"prompt": 5}', "field 'prompt' must be a string or a list of chat messages, got int"),
        ('{"prompt": ""}', "field 'prompt' is an empty string"),
        ('{"prompt": []}', "field 'prompt' is an empty list"),
        ('{"prompt": ["hi"]}', "field 'prompt[0]' must be an object"),
        ('{"prompt": [{"role": "robot", "content": "x"}]}', "field 'prompt[0].role'"),
        ('{"prompt": [{"role": "user", "content": 3}]}', "field 'prompt[0].content' must be a string, got int"),
        ('{"prompt": "a", "data_source": 7}', "field 'data_source' must be a string"),
        ('{"prompt": "a", "reward_model": "72"}', "field 'reward_model' must be a JSON object"),
        ('{"prompt": "a", "reward_model": {"ground_truth": {"x": 1}}}', "field 'reward_model.ground_truth'"),
        ('{"prompt": "a", "reward_model": {"ground_truth": [{"a": null}]}}',
         "field 'reward_model.ground_truth' must be a string, a number or a list of them (acceptable answers), "
         "got a list holding"),
        ('{"prompt": "a", "reward_model": {"ground_truth": []}}', "got an empty list"),
        ('{"prompt": "a", "reward_model": {"ground_truth": NaN}}', "got nan (not a number a completion can state)"),
        ('{"prompt": "a", "extra_info": [1]}', "field 'extra_info' must be a JSON object"),
        ('{"prompt": "a\tb"}', "invalid JSON at column 14: Invalid control character"),
        # a column named like a judger keyword would replace the sampled completions (or the run's state)
        ('{"prompt": "a", "completions": "SECRET"}', "column 'completions' is a keyword judgers are called with"),
        ('{"prompt": "a", "trainer_state": 1, "prompts": "P"}', "column 'prompts' is a keyword"),
        ('{"prompt": "a", "completion_ids": [1]}', "column 'completion_ids' is a keyword"),
        ('{"prompt": [{"role": "system", "content": "be brief"}]}', "field 'prompt[0].role' is 'system': a prompt"),
        ('{"prompt": [{"role": "user", "content": " "}]}', "field 'prompt' has no user message with text"),
    ],
)
def test_bad_rows_name_file_line_and_field(tmp_path, line, field):
    path = write(tmp_path, ['{"prompt": "fine"}', line])
    with pytest.raises(DataError) as err:
        read_jsonl(path)
    message = str(err.value)
    assert f"{path}:2" in message and not message.endswith(" at")
    assert field in message


def test_all_bad_rows_are_reported_at_once(tmp_path):
    path = write(tmp_path, ['{"prompt": 1}', '{"prompt": "ok"}', "{oops", '{"x": 1}'])
    with pytest.raises(DataError) as err:
        read_jsonl(path)
    message = str(err.value)
    assert message.startswith("3 malformed row(s)")
    assert f"{path}:1" in message and f"{path}:3" in message and f"{path}:4" in message
    assert f"{path}:2" not in message


def test_missing_empty_and_non_utf8_files(tmp_path):
    with pytest.raises(DataError, match="data file not found"):
        read_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="empty"):
        read_jsonl(write(tmp_path, [""], "empty.jsonl"))
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError, match=rf"{bad}:2: not UTF-8"):
        read_jsonl(bad)


def test_datamodule_applies_chat_template_and_drops_long_prompts(tiny_model, tmp_path):
    from rlflow.data.datamodule import RolloutDataModule

    short = {"prompt": [{"role": "user", "content": "What is 1 + 1?"}], "reward_model": {"ground_truth": "2"},
             "data_source": "openai/gsm8k"}
    long = {"prompt": [{"role": "user", "content": "x" * 500}], "reward_model": {"ground_truth": "2"},
            "data_source": "openai/gsm8k"}
    plain = {"prompt": "Q: 2 + 2 =", "reward_model": {"ground_truth": "4"}, "data_source": "openai/gsm8k"}
    path = write(tmp_path, [json.dumps(short), json.dumps(long), json.dumps(plain)])
    dm = RolloutDataModule(
        train_data_path=str(path), tokenizer_path=str(tiny_model), max_prompt_length=64, global_batch_size=1
    )
    records = dm.train_prompts.load(dm.load_tokenizer())
    assert dm.train_prompts.dropped == 1
    assert len(records) == 2
    chat, raw = records
    assert chat.prompt_text == "<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n"
    assert raw.prompt_text == "Q: 2 + 2 ="  # plain strings are used as written (TRL's standard format)
    assert dm.tokenizer.decode(chat.prompt_ids) == chat.prompt_text
    assert len(chat.prompt_ids) <= 64


def test_all_prompts_too_long_is_an_error(tiny_model, tmp_path):
    from rlflow.data.datamodule import RolloutDataModule

    path = write(tmp_path, [json.dumps({"prompt": "y" * 100})])
    dm = RolloutDataModule(train_data_path=str(path), tokenizer_path=str(tiny_model), max_prompt_length=10)
    with pytest.raises(DataError, match="max_prompt_length=10"):
        dm.setup("fit")


def test_a_byte_order_mark_duplicate_keys_and_a_pretty_printed_object(tmp_path):
    from rlflow.data.sources import read_source

    good = '{"prompt": "What is 1+1?", "reward_model": {"ground_truth": "2"}}'
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes("\ufeff".encode() + (good + "\n" + good + "\n").encode())
    assert len(read_jsonl(bom)) == 2  # an editor's byte-order mark is not part of the first row
    array = tmp_path / "rows.json"
    array.write_bytes("\ufeff".encode() + f"[\n  {good},\n  {good}\n]\n".encode())
    assert len(read_source(str(array))) == 2
    twice = tmp_path / "twice.jsonl"
    twice.write_text(good + '\n{"prompt": "first", "prompt": "second"}\n')
    with pytest.raises(DataError, match=rf"{twice}:2: key 'prompt' appears twice in one object"):
        read_jsonl(twice)
    pretty = tmp_path / "one.json"
    pretty.write_text(json.dumps(json.loads(good), indent=2))
    with pytest.raises(DataError, match=r"one.json: holds one JSON object over several lines; rlflow reads a JSON "
                                        r"array of rows"):
        read_source(str(pretty))


def test_rows_split_by_a_lone_carriage_return_are_named_as_such(tmp_path):
    good = '{"prompt": "What is 1+1?", "reward_model": {"ground_truth": "2"}}'
    path = tmp_path / "old_mac.jsonl"
    path.write_bytes((good + "\r" + good + "\n").encode())
    with pytest.raises(DataError, match=r"old_mac.jsonl:1: invalid JSON at column \d+: Extra data \(the line holds a "
                                        r"carriage return: rows must end with a newline"):
        read_jsonl(path)
    crlf = tmp_path / "windows.jsonl"
    crlf.write_bytes((good + "\r\n" + good + "\r\n").encode())
    assert len(read_jsonl(crlf)) == 2
