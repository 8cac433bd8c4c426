"""Data sources: every on-disk layout read to the same records, source specs, per-source judgers, a mixed datamodule."""


from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlflow.data.dataset import DataError, read_jsonl
from rlflow.data.sources import DataSource, iter_records, parse_sources, per_source_means, read_source
from rlflow.judgers.panel import SourceJudgers
from tests.helpers.paths import DATA


def example_rows(n: int = 12) -> list[dict]:
    return [json.loads(line) for line in (DATA / "train_example.jsonl").read_text().splitlines()[:n]]


def same_records(a, b) -> None:
    assert [(r.prompt, r.columns) for r in a] == [(r.prompt, r.columns) for r in b]


def test_parquet_in_the_hub_layout_reads_like_the_jsonl(tmp_path):
    rows = example_rows()
    shard = tmp_path / "main" / "train-00000-of-00001.parquet"
    shard.parent.mkdir()
    pq.write_table(pa.Table.from_pylist(rows), shard)
    expected = read_jsonl(DATA / "train_example.jsonl")[:12]
    records = read_source(str(shard))
    same_records(records, expected)
    assert records[0].columns["ground_truth"] == "72" and records[0].origin == "train-00000-of-00001"
    assert records[3].source == f"{shard}:row 4"
    same_records(read_source(str(tmp_path / "main")), expected)  # the directory of shards


def test_streaming_and_cached_reads_agree(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(example_rows(5)), path)
    streamed = [r for _, r in iter_records(path, streaming=True)]
    cached = [r for _, r in iter_records(path, streaming=False)]
    same_records(streamed, cached)
    assert (tmp_path / "hf_cache").exists()  # the non-streaming read built the Arrow cache there


def test_shards_globs_and_mixed_splits(tmp_path):
    rows = example_rows(10)
    folder = tmp_path / "main"
    folder.mkdir()
    pq.write_table(pa.Table.from_pylist(rows[:6]), folder / "train-00000-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(rows[6:]), folder / "train-00001-of-00002.parquet")
    (folder / ".cache" / "huggingface").mkdir(parents=True)
    (folder / ".cache" / "huggingface" / "stale.jsonl").write_text("not data")  # huggingface-cli's own files
    records = read_source(str(folder))
    assert [r.columns["extra_info"]["index"] for r in records] == list(range(10))  # shard order, then row order
    pq.write_table(pa.Table.from_pylist(rows[:2]), folder / "test-00000-of-00001.parquet")
    with pytest.raises(DataError, match=r"several splits \(test, train\); name one with a glob"):
        read_source(str(folder))
    assert len(read_source(str(folder / "train-*.parquet"))) == 10
    with pytest.raises(DataError, match="no file matches"):
        read_source(str(folder / "validation-*.parquet"))


def test_datasets_save_to_disk_and_json_array(tmp_path):
    from datasets import Dataset, DatasetDict

    rows = example_rows(4)
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    same_records(read_source(str(tmp_path / "saved")), read_jsonl(DATA / "train_example.jsonl")[:4])
    splits = DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_list(rows[:1])})
    splits.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError,
                       match=r"DatasetDict with splits (train, test|test, train); point the path at one split"):
        read_source(str(tmp_path / "dd"))
    assert len(read_source(str(tmp_path / "dd" / "train"))) == 4
    array = tmp_path / "rows.json"
    array.write_text(json.dumps(rows[:2] + [{"prompt": 3}], indent=1))
    with pytest.raises(DataError, match=rf"{array}:row 3: field 'prompt' must be a string"):
        read_source(str(array))
    array.write_text(json.dumps(rows[:2]))
    assert len(read_source(str(array))) == 2


def test_bad_rows_and_paths_name_file_row_and_field(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["fine", ""], "data_source": ["x", "x"]}), path)
    with pytest.raises(DataError, match=rf"(?s)1 malformed row\(s\).*{path}:row 2: field 'prompt' is an empty string"):
        read_source(str(path))
    raw = tmp_path / "raw" / "main"
    raw.mkdir(parents=True)
    pq.write_table(pa.table({"question": ["q"], "answer": ["#### 1"]}), raw / "train-00000-of-00001.parquet")
    with pytest.raises(DataError, match="raw GSM8K\\? convert it with tools/convert_gsm8k.py"):
        read_source(str(raw))
    with pytest.raises(DataError, match="data file not found"):
        read_source(str(tmp_path / "missing.jsonl"))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "notes.txt").write_text("x")
    with pytest.raises(DataError, match="no data files .* it holds notes.txt"):
        read_source(str(tmp_path / "docs"))
    (tmp_path / "not.parquet").write_text("not parquet at all")
    with pytest.raises(DataError, match=r"not\.parquet"):
        read_source(str(tmp_path / "not.parquet"))
    lines = tmp_path / "d.jsonl"  # jsonl keeps the foundation's file:line:field errors
    lines.write_text('{"prompt": "ok"}\n{"prompt": [{"role": "user", "content": 1}]}\n')
    with pytest.raises(DataError, match=rf"{lines}:2: field 'prompt\[0\].content' must be a string"):
        read_source(str(lines))


def test_parse_sources_specs_and_errors():
    a, b, c = parse_sources(["x/train.jsonl", {"path": "y/train.jsonl", "weight": 3, "max_prompt_length": 64},
                             {"path": "math.parquet", "name": "math", "judgers": "gsm8k"}])
    assert (a.name, b.name, c.name) == ("train.0", "train.1", "math")  # same file names told apart
    assert (b.weight, b.max_prompt_length) == (3, 64)
    assert c.judger_routes() == {"*": "gsm8k"} and a.judger_routes() is None
    assert DataSource("p", judgers={"openai/gsm8k": "gsm8k"}).judger_routes() == {"openai/gsm8k": "gsm8k"}
    assert DataSource("p", judgers={"class_path": "gsm8k"}).judger_routes() == {"*": {"class_path": "gsm8k"}}
    with pytest.raises(ValueError,
                       match=r"data.train_data_path\[0\]: unknown key\(s\) wieght; a source takes path, weight"):
        parse_sources([{"path": "a", "wieght": 2}])
    with pytest.raises(ValueError, match=r"\[1\].weight must be a positive number"):
        parse_sources(["a", {"path": "b", "weight": 0}])
    with pytest.raises(ValueError, match="no '{prompt}' placeholder"):
        parse_sources({"path": "a", "prompt_template": "Q: {question}"})


def always(value):
    def judge(prompts, completions, completion_ids=None, **columns):
        return [value] * len(completions)

    judge.__name__ = f"always_{str(value).replace('.', '_')}"
    return judge


def test_each_source_is_judged_by_its_own_judgers():
    one, half = always(1.0), always(0.5)
    sources = parse_sources([{"path": "a.jsonl", "name": "a"}, {"path": "b.jsonl", "name": "b", "judgers": half}])
    judgers = SourceJudgers({"*": one}, {"always_0_5": 2.0}, sources, timeout=None)
    origins = ["a", "b", "b", "a"]
    result = judgers.judge(origins, ["p"] * 4, ["c"] * 4, [[1]] * 4, {"data_source": ["s"] * 4})
    assert result.rewards == [1.0, 1.0, 1.0, 1.0]  # 0.5 weighted by 2 for b's rows
    assert result.per_judger["always_0_5"] == [None, 0.5, 0.5, None]
    assert result.metrics["rewards/always_1_0/mean"] == 1.0 and result.metrics["rewards/always_0_5/mean"] == 0.5
    assert result.metrics["judger/unscored"] == 0.0
    with pytest.raises(ValueError, match="data.judging.weights names judger 'nope'"):
        SourceJudgers({"*": one}, {"nope": 1.0}, sources)
    # two sources of train and eval given one name with different judgers
    clash = parse_sources([{"path": "a", "name": "x", "judgers": one}]) + parse_sources(
        [{"path": "b", "name": "x", "judgers": half}], "data.eval_data_path")
    with pytest.raises(ValueError, match="named 'x' with different judgers"):
        SourceJudgers({"*": one}, None, clash)


def test_per_source_means_by_hand():
    assert per_source_means(["a", "b", "a", None], [1.0, 0.0, 0.0, 5.0]) == {"reward/a": 0.5, "reward/b": 0.0}


def test_datamodule_mixes_sources_with_their_own_limits(tiny_model, tmp_path):
    from rlflow.data.datamodule import RolloutDataModule
    from rlflow.data.mix import MixBatchSampler

    short = [{"prompt": "1+1=", "data_source": "short", "reward_model": {"ground_truth": "2"}}] * 6
    long = [
        {"prompt": "x" * 20 + str(i), "data_source": "long", "reward_model": {"ground_truth": "1"}} for i in range(5)
    ]
    long += [{"prompt": "y" * 80, "data_source": "long", "reward_model": {"ground_truth": "1"}}]
    (tmp_path / "short.jsonl").write_text("".join(json.dumps(r) + "\n" for r in short))
    pq.write_table(pa.Table.from_pylist(long), tmp_path / "long.parquet")
    dm = RolloutDataModule(train_data_path=[
            str(tmp_path / "short.jsonl"),
            {"path": str(tmp_path / "long.parquet"), "weight": 3, "max_prompt_length": 40},
        ], tokenizer_path=str(tiny_model), global_batch_size=4, max_prompt_length=8,
        judging={"judgers": {"*": "gsm8k"}})
    dm.setup("fit")
    assert dm.train_prompts.sizes == {"short": 6, "long": 5}
    assert dm.train_prompts.dropped_by_source == {"short": 0, "long": 1}
    assert isinstance(dm.sampler, MixBatchSampler)
    batch = next(iter(dm.train_dataloader()))
    assert sorted(r.data_source for r in batch) == ["long", "long", "long", "short"]


def test_a_folder_of_split_named_files_is_refused_or_split_and_stray_files_are_named(tmp_path):
    """tools/convert_gsm8k.py writes train.jsonl and test.jsonl side by side: never read together as one set."""
    rows = example_rows(6)
    folder = tmp_path / "gsm8k"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    (folder / "TEST.JSONL").write_text("".join(json.dumps(r) + "\n" for r in rows[4:]))
    (folder / "dataset_infos.json").write_text('{"default": {}}')  # a hub download's metadata: not rows
    with pytest.raises(DataError, match=r"several splits \(test, train\); name one with a glob, e.g. .*/\*\*/train\*"):
        read_source(str(folder))
    assert len(read_source(f"{folder}?split=train")) == 4
    assert len(read_source(f"{folder}?split=test")) == 2  # an upper-case suffix is a .jsonl file too
    (tmp_path / "notes.md").write_text("# notes\n")
    with pytest.raises(DataError, match=r"notes.md: not a data file \(.jsonl, .json, .parquet, .arrow, .csv"):
        read_source(str(tmp_path / "notes.md"))
    (folder / "README.md").write_text("# card\n")
    assert len(read_source(str(folder / "train*"))) == 4  # a glob skips what is not data
    with pytest.raises(DataError, match=r"no data file matches this pattern .*it matches README.md"):
        read_source(str(folder / "README*"))


@pytest.mark.parametrize("item, message", [
    ({"path": "a.jsonl", "system_prompt": 5}, r"data.train_data_path\[0\].system_prompt must be a string, got int 5"),
    ({"path": "a.jsonl", "weight": True}, r"weight must be a positive number, got True"),
    ({"path": "a.jsonl", "max_prompt_length": 2.5}, r"max_prompt_length must be a whole number >= 1, got 2.5"),
    ({"path": None}, r"data.train_data_path\[0\].path is empty"),
])
def test_a_source_mappings_values_are_checked_by_type(item, message):
    with pytest.raises(ValueError, match=message):
        parse_sources([item])


def test_a_given_name_that_numbering_also_makes_is_refused():
    with pytest.raises(ValueError, match="two sources are named 'few.0'"):
        parse_sources([{"path": "x/base.jsonl", "name": "few.0"}, "c/few.jsonl", "c2/few.jsonl"])


def test_strings_with_colons_in_a_config_source_stay_strings(tiny_model, tmp_path, capsys):
    """The config parser read values of a source mapping as YAML: 'Question: {prompt}' became a mapping."""
    from rlflow.entry import main

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in example_rows(4)))
    config = tmp_path / "c.yaml"
    config.write_text(f"model:\n  model_path: {tiny_model}\ndata:\n  global_batch_size: 2\n  train_data_path:\n"
                      f"    - {{path: {data}, prompt_template: 'Question: {{prompt}}',\n"
                      "       system_prompt: 'Note: brief'}\n")
    assert main(["data", "check", "--config", str(config)]) == 0, capsys.readouterr()
    from rlflow.cli import cli_main

    cli = cli_main(["--config", str(config), "--trainer.logger=false"], run=False)
    source = cli.datamodule.train_prompts.sources[0]
    assert (source.prompt_template, source.system_prompt) == ("Question: {prompt}", "Note: brief")


def test_a_file_listed_twice_is_warned_about(caplog):
    with caplog.at_level("WARNING", logger="rlflow"):
        sources = parse_sources(["x/base.jsonl", "./x/base.jsonl", "y/other.jsonl"])
    assert [s.name for s in sources] == ["base.0", "base.1", "other"]
    assert "base.jsonl is listed 2 times; each is read as a source of its own" in caplog.text
    assert "other.jsonl" not in caplog.text


def test_a_csv_cell_holding_chat_messages_is_read_as_the_messages(tmp_path):
    """A CSV holds a list of messages only as text: JSON, or the Python form pandas' ``to_csv`` writes. Both read
    as the messages; text that merely looks like a list stays text; decoded messages are checked as messages."""
    import csv

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    path = tmp_path / "rows.csv"
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["prompt", "solution"])
        writer.writerow([json.dumps(messages), "5"])
        writer.writerow([str(messages), "5"])  # pandas' to_csv of a list column: Python's repr
        writer.writerow(["[1, 2] + [3]: what is the list?", "[1, 2, 3]"])
        writer.writerow(['[{"role": "user"}]', "x"])  # no content: not messages, the text as written
    records = read_source(str(path))
    assert [r.prompt for r in records[:2]] == [messages, messages]
    assert records[2].prompt == "[1, 2] + [3]: what is the list?"
    assert records[3].prompt == '[{"role": "user"}]'
    bad = tmp_path / "bad.csv"
    bad.write_text('prompt\n"[{""role"": ""bot"", ""content"": ""hi""}]"\n')
    with pytest.raises(DataError, match=r"bad.csv:row 1: field 'prompt\[0\].role' must be one of"):
        read_source(str(bad))


def test_a_name_given_twice_is_refused_and_a_given_name_is_never_renumbered():
    with pytest.raises(ValueError, match=r"data.train_data_path\[1\].name: 'gsm8k' is also the name of "
                                         r"data.train_data_path\[0\]"):
        parse_sources([{"path": "a/x.jsonl", "name": "gsm8k"}, {"path": "b/y.jsonl", "name": "gsm8k"}])
    sources = parse_sources([{"path": "a/x.jsonl", "name": "train"}, "b/train.jsonl", "c/train.jsonl"])
    assert [s.name for s in sources] == ["train", "train.0", "train.1"]


def test_a_flow_mapping_without_a_space_after_the_colon_is_pointed_at():
    import yaml

    item = yaml.safe_load("{path:data/train.jsonl}")  # one key, 'path:data/train.jsonl', with no value
    with pytest.raises(ValueError, match=r"unknown key\(s\) path:data/train.jsonl; a source takes .* \(YAML reads "
                                         r"\{path:data/train.jsonl\} as one key: write \{path: data/train.jsonl\}"):
        parse_sources([item])


def test_eval_prompts_that_are_also_train_prompts_are_warned_about(tiny_model, tiny_data, tmp_path, caplog):
    """Held-out accuracy is not held out where the eval set repeats train prompts: a warning naming the first, or,
    where every eval prompt is a train prompt (the tiny demo task's 64 of its 200 facts, on purpose), an info line."""
    import json
    import logging

    from rlflow.data.check import check_datamodule
    from rlflow.data.datamodule import RolloutDataModule
    from rlflow.data.prompts import shared_prompts

    caplog.set_level(logging.INFO)
    train = [json.loads(line) for line in (tiny_data / "train.jsonl").read_text().splitlines()]
    held_out = tmp_path / "held_out.jsonl"  # the task's format, numbers no train row has
    held_out.write_text("".join(json.dumps({**train[0], "prompt": [{"role": "user", "content": f"What is {a} + 100?"}]})
                                + "\n" for a in range(7)) + json.dumps(train[5]) + "\n")
    cases = [(held_out, "WARNING", f"1 of 8 eval prompts are also train prompts (the first: {held_out}:8)"),
             (tiny_data / "val.jsonl", "INFO", f"64 of 64 eval prompts are also train prompts (the first: "
                                               f"{tiny_data / 'val.jsonl'}:1)")]
    for eval_path, level, warned in cases:
        caplog.clear()
        dm = RolloutDataModule(train_data_path=str(tiny_data / "train.jsonl"), eval_data_path=str(eval_path),
                               tokenizer_path=str(tiny_model), judging={"judgers": {"*": "gsm8k"}})
        dm.setup("fit")
        found = [(r.levelname, r.getMessage()) for r in caplog.records if "also train prompts" in r.getMessage()]
        assert found == [(level, f"data: {warned}; eval/accuracy is not held-out accuracy on them")]
        # `rlflow data check` finds the same rows by the same rule
        fit_rows = [r.source for r in shared_prompts(dm.train_prompts.records, dm.eval_records)]
        checked = check_datamodule(dm)
        assert [r.shared for r in checked.sources if r.split == "eval"] == [fit_rows] and fit_rows
    held_out.write_text("".join(line for line in held_out.read_text().splitlines(keepends=True)[:7]))
    caplog.clear()
    RolloutDataModule(train_data_path=str(tiny_data / "train.jsonl"), eval_data_path=str(held_out),
                      tokenizer_path=str(tiny_model), judging={"judgers": {"*": "gsm8k"}}).setup("fit")
    assert not [r for r in caplog.records if "also train prompts" in r.getMessage()]
