"""Datasets as TRL users have them: hub ids read from the local ``datasets`` cache (never the network), saved
``DatasetDict`` folders with a split, TRL's standard and conversational layouts with their columns reaching judgers."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlflow.data.dataset import DataError
from rlflow.data.sources import parse_sources, read_source
from tests.helpers.hub_cache import cache_hub_dataset

QUESTIONS = [
    ("Natalia sold clips to 48 of her friends in April, and then half as many in May. How many in all?", "72"),
    ("Weng earns $12 an hour for babysitting. Yesterday she did 50 minutes. How much did she earn?", "10"),
    ("Betty needs $100 for a wallet. She has half of it; her parents give $15, grandparents twice that. "
     "How much more does she need?", "5"),
    ("James writes a 3-page letter to 2 different friends twice a week. How many pages a year?", "624"),
]
STANDARD = [{"prompt": q, "solution": a, "level": i} for i, (q, a) in enumerate(QUESTIONS)]
CONVERSATIONAL = [{"prompt": [{"role": "user", "content": q}], "solution": a} for q, a in QUESTIONS]


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A ``datasets`` cache holding ``tiny/gsm8k`` (configs ``main``: train+test, ``socratic``: train) and
    ``tiny/GSM8K-Chat`` (its ``default`` config, one split), as ``load_dataset`` leaves hub datasets."""
    cache = tmp_path_factory.mktemp("hf_home") / "datasets"
    cache_hub_dataset(cache, "tiny/gsm8k", "main", {"train": STANDARD[:3], "test": STANDARD[3:]})
    cache_hub_dataset(cache, "tiny/gsm8k", "socratic", {"train": STANDARD[:1]})
    cache_hub_dataset(cache, "tiny/GSM8K-Chat", "default", {"train": CONVERSATIONAL})
    return cache


@pytest.fixture
def offline_cache(hub_cache, monkeypatch):
    """The test cache as ``HF_DATASETS_CACHE``, with the hub offline (``HF_DATASETS_OFFLINE=1``)."""
    import datasets

    monkeypatch.setenv("HF_DATASETS_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(hub_cache))  # both are read at import
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return hub_cache


def rows_of(records) -> list[dict]:
    return [{"prompt": r.prompt, **r.columns} for r in records]


def test_hub_ids_read_the_cached_dataset_in_both_trl_layouts(offline_cache):
    train = read_source("hf://tiny/gsm8k?config=main&split=train")
    assert rows_of(train) == STANDARD[:3]
    assert train[0].origin == "gsm8k" and train[2].source == "hf://tiny/gsm8k?config=main&split=train:row 3"
    assert rows_of(read_source("hf://datasets/tiny/gsm8k?config=main&split=test")) == STANDARD[3:]
    assert rows_of(read_source("hf://tiny/gsm8k?config=main&split=train[1:]")) == STANDARD[1:3]  # datasets' slices
    assert rows_of(read_source("hf://tiny/gsm8k?config=main&split=train+test")) == STANDARD  # and sums of splits
    assert rows_of(read_source("hf://tiny/gsm8k?config=socratic&split=train")) == STANDARD[:1]
    chat = read_source("hf://tiny/GSM8K-Chat")  # one cached config, one split: neither needs naming
    assert rows_of(chat) == CONVERSATIONAL and chat[0].origin == "GSM8K-Chat"


def test_a_hub_read_never_asks_the_hub_even_when_online(hub_cache, monkeypatch):
    import datasets
    import huggingface_hub

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(hub_cache))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    asked = []

    def no_network(*args, **kwargs):
        asked.append(args)
        raise OSError("the test has no network")

    for method in ("hf_hub_download", "dataset_info", "list_repo_tree"):
        monkeypatch.setattr(huggingface_hub.HfApi, method, no_network)
    assert rows_of(read_source("hf://tiny/GSM8K-Chat?split=train")) == CONVERSATIONAL
    assert asked == [] and datasets.config.HF_HUB_OFFLINE is False  # offline while reading, then as it was


def test_a_missing_or_ambiguous_hub_dataset_is_one_line_naming_the_key(offline_cache):
    def error(path: str, key: str = "data.eval_data_path") -> str:
        with pytest.raises(DataError) as info:
            read_source(parse_sources(path, key)[0])
        message = str(info.value)
        assert "\n" not in message and message.startswith(f"{key}: {path}: ")
        return message

    missing = error("hf://nobody/nothing?config=main&split=train")
    assert f"not in the local datasets cache {offline_cache}" in missing
    assert missing.endswith("download it once, online, with "
                            "python -c \"from datasets import load_dataset; load_dataset('nobody/nothing', 'main')\"")
    assert "(cached configurations: main, socratic)" in error("hf://tiny/gsm8k?config=other")
    assert error("hf://tiny/gsm8k", "data.train_data_path").endswith(
        "several configurations of tiny/gsm8k are cached (main, socratic); name one: hf://tiny/gsm8k?config=main")
    assert error("hf://tiny/gsm8k?config=main").endswith(
        "tiny/gsm8k (main) has splits train, test; name one: hf://tiny/gsm8k?config=main&split=train")
    assert error("hf://tiny/gsm8k?config=main&split=validation").endswith(
        "no split 'validation' in tiny/gsm8k (main); its splits are train, test")
    for path, why in (("hf://a/b/c", "a hub dataset is written hf://OWNER/NAME"),
                      ("hf://tiny/gsm8k?revision=v1", "unknown option 'revision' after '?'"),
                      ("hf://tiny/gsm8k?split=a&split=b", "option 'split' is given twice")):
        with pytest.raises(ValueError, match=rf"^data.train_data_path\[1\]: {re.escape(path)}: {re.escape(why)}"):
            parse_sources(["x.jsonl", path])
    with pytest.raises(DataError, match="tiny/gsm8k: data file not found; a hub dataset is written hf://tiny/gsm8k"):
        read_source("tiny/gsm8k")


def test_saved_dataset_dicts_and_shard_folders_take_a_split(tmp_path):
    from datasets import Dataset, DatasetDict

    DatasetDict({"train": Dataset.from_list(STANDARD[:3]), "test": Dataset.from_list(STANDARD[3:])}).save_to_disk(
        str(tmp_path / "dd"))
    assert rows_of(read_source(f"{tmp_path / 'dd'}?split=test")) == STANDARD[3:]
    assert read_source(f"{tmp_path / 'dd'}?split=test")[0].origin == "dd"
    with pytest.raises(DataError, match=rf"DatasetDict with splits train, test; point the path at one split: "
                                        rf"{tmp_path / 'dd'}\?split=train \(or {tmp_path / 'dd' / 'train'}\)$"):
        read_source(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"no split 'dev' in this saved datasets.DatasetDict; its splits are train, te"):
        read_source(f"{tmp_path / 'dd'}?split=dev")
    DatasetDict({"train": Dataset.from_list(CONVERSATIONAL)}).save_to_disk(str(tmp_path / "one"))
    assert rows_of(read_source(str(tmp_path / "one"))) == CONVERSATIONAL  # its only split
    Dataset.from_list(STANDARD).save_to_disk(str(tmp_path / "flat"))
    assert rows_of(read_source(str(tmp_path / "flat"))) == STANDARD
    with pytest.raises(DataError, match=r"is a saved datasets.Dataset, which has no splits; drop \?split=train"):
        read_source(f"{tmp_path / 'flat'}?split=train")
    (tmp_path / "rows.jsonl").write_text(json.dumps(STANDARD[0]) + "\n")
    with pytest.raises(DataError, match="split= picks a split of a saved DatasetDict, .* is a file"):
        read_source(f"{tmp_path / 'rows.jsonl'}?split=train")
    shards = tmp_path / "main"
    shards.mkdir()
    pq.write_table(pa.Table.from_pylist(STANDARD[:3]), shards / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(STANDARD[3:]), shards / "test-00000-of-00001.parquet")
    assert rows_of(read_source(f"{shards}?split=test")) == STANDARD[3:]
    with pytest.raises(DataError, match=rf"several splits \(test, train\); name one .* or as {shards}\?split=train$"):
        read_source(str(shards))
    with pytest.raises(DataError, match=r"no files of split 'dev' .* its files are of test, train"):
        read_source(f"{shards}?split=dev")


def test_a_local_path_that_exists_always_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny" / "gsm8k").mkdir(parents=True)  # a folder named like a hub id
    (tmp_path / "tiny" / "gsm8k" / "train.jsonl").write_text(json.dumps(STANDARD[1]) + "\n")
    assert rows_of(read_source("tiny/gsm8k")) == [STANDARD[1]]
    odd = tmp_path / "rows?split=test"  # a folder whose name reads like an option
    odd.mkdir()
    (odd / "part.jsonl").write_text(json.dumps(STANDARD[2]) + "\n")
    assert rows_of(read_source(str(odd))) == [STANDARD[2]]
    assert rows_of(read_source(str(tmp_path / "*" / "part.json?"))) == [STANDARD[2]]  # a glob that does not exist


def chat_shapes(prompts, completions, **columns):
    """1 for a chat prompt ending with the user's turn, plus 10 for a completion given as chat messages."""
    return [float(isinstance(p, list) and p[-1]["role"] == "user") + 10 * float(isinstance(c, list))
            for p, c in zip(prompts, completions)]


def test_hub_columns_reach_the_judgers(offline_cache):
    from rlflow.judgers.panel import JudgePanel
    from tests.helpers.reward_helpers import solution_echo

    sources = parse_sources("hf://tiny/GSM8K-Chat?split=train")
    records = read_source(sources[0])
    panel = JudgePanel({"*": [solution_echo, chat_shapes]}, None, sources, timeout=None)
    panel.tokenizer = SimpleNamespace(batch_decode=lambda ids, **kw: ["#### 1" for _ in ids])
    result, _ = panel.judge(records, [SimpleNamespace(token_ids=[1]) for _ in records], k=1)
    assert result.per_judger["solution_echo"] == [float(a) for _, a in QUESTIONS]  # each row's own `solution`
    assert result.per_judger["chat_shapes"] == [11.0] * len(QUESTIONS)  # conversational prompts and completions


def test_data_check_reads_hub_ids_and_saved_splits(offline_cache, tmp_path, capsys):
    from datasets import Dataset, DatasetDict

    from rlflow.data.check import main

    DatasetDict({"train": Dataset.from_list(STANDARD[:3]), "test": Dataset.from_list(STANDARD[3:])}).save_to_disk(
        str(tmp_path / "dd"))
    judgers = json.dumps({"*": "tests.helpers.reward_helpers:solution_echo"})
    code = main(["check", "hf://tiny/gsm8k?config=main&split=train", f"{tmp_path / 'dd'}?split=test",
                 "--judgers", judgers])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "train source 'gsm8k': hf://tiny/gsm8k?config=main&split=train\n  rows 3 | malformed 0" in out
    assert f"train source 'dd': {tmp_path / 'dd'}?split=test\n  rows 1 | malformed 0" in out
    assert main(["check", "hf://nobody/nothing?split=train", "--judgers", judgers]) == 1
    out = capsys.readouterr().out
    assert "data.train_data_path: hf://nobody/nothing?split=train: not in the local datasets cache" in out
