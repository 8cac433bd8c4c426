"""rlflow.demo.gsm8k and its command line ``tools/convert_gsm8k.py``: the hub's parquet layout in, the published RL
rows out, byte for byte."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlflow.demo import gsm8k as convert_gsm8k
from tests.helpers.paths import DATA, ROOT


def example_lines(name: str) -> list[bytes]:
    return [line for line in (DATA / name).read_bytes().split(b"\n") if line]


def raw_rows(name: str) -> list[dict]:
    """The question/answer pairs the published rows were made from, in index order."""
    rows = [json.loads(line) for line in example_lines(name)]
    rows.sort(key=lambda r: r["extra_info"]["index"])
    return [{"question": r["extra_info"]["question"], "answer": r["extra_info"]["answer"]} for r in rows]


def write_hub_layout(root, splits=(("train", "train_example.jsonl"), ("test", "val_example.jsonl"))):
    """``<root>/main/<split>-00000-of-00001.parquet`` with the hub's two string columns."""
    (root / "main").mkdir(parents=True)
    for split, name in splits:
        rows = raw_rows(name)
        table = pa.table({"question": [r["question"] for r in rows], "answer": [r["answer"] for r in rows]})
        pq.write_table(table, root / "main" / f"{split}-00000-of-00001.parquet")
    return root


def test_hub_parquet_round_trips_to_the_published_rows_byte_for_byte(tmp_path):
    src = write_hub_layout(tmp_path / "gsm8k_data")
    out = tmp_path / "gsm8k"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "convert_gsm8k.py"), "--input-dir", str(src), "--out-dir", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "wrote 200 rows" in proc.stdout and "wrote 100 rows" in proc.stdout  # wc -l says 199/99: no final newline
    for produced, published in (("train.jsonl", "train_example.jsonl"), ("test.jsonl", "val_example.jsonl")):
        got = (out / produced).read_bytes()
        assert got.endswith(b"\n")  # one row per line, newline-terminated (the published file lacks the last one)
        assert got.split(b"\n")[:-1] == example_lines(published)


def test_jsonl_input_and_field_contents(tmp_path):
    src = tmp_path / "grade_school_math"
    src.mkdir()
    rows = [
        {"question": "A cost $1,250 and B/C cost 5. Total?", "answer": "1,250 + 5 = 1,255\n#### 1,255"},
        {"question": "Debt?", "answer": "It is negative.\n#### -7"},
    ]
    (src / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (src / "test.jsonl").write_text(json.dumps(rows[1]) + "\n")
    assert convert_gsm8k.convert(src, tmp_path / "out") == {"train": 2, "test": 1}
    text = (tmp_path / "out" / "train.jsonl").read_text()
    assert "B\\/C" in text  # "/" escaped as in the published rows
    first, second = [json.loads(line) for line in text.splitlines()]
    assert list(first) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert first["prompt"] == [{"content": rows[0]["question"] + " " + convert_gsm8k.INSTRUCTION, "role": "user"}]
    assert first["reward_model"] == {"ground_truth": "1255", "style": "rule"}  # commas removed
    assert second["reward_model"]["ground_truth"] == "-7"
    assert second["extra_info"] == {"answer": rows[1]["answer"], "index": 1, "question": "Debt?", "split": "train"}


def test_ground_truth_agrees_with_verls_regex_on_every_example():
    # verl's examples/data_preprocess/gsm8k.py, written out independently of the tool
    def verl(solution: str) -> str:
        return re.search("#### (\\-?[0-9\\.\\,]+)", solution).group(0).split("#### ")[1].replace(",", "")

    for name in ("train_example.jsonl", "val_example.jsonl"):
        for row in raw_rows(name):
            assert convert_gsm8k.ground_truth(row["answer"], "x") == verl(row["answer"])


def test_bad_inputs_name_the_file_and_row(tmp_path):
    with pytest.raises(convert_gsm8k.ConvertError, match="not a directory"):
        convert_gsm8k.convert(tmp_path / "nope", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "README.md").write_text("hi")
    with pytest.raises(convert_gsm8k.ConvertError, match=r"no train/test data .*main/<split>-\*\.parquet.*README\.md"):
        convert_gsm8k.convert(tmp_path / "empty", tmp_path / "out")
    bad = tmp_path / "bad" / "main"
    bad.mkdir(parents=True)
    pq.write_table(pa.table({"question": ["q1", "q2"], "answer": ["#### 3", "no final line"]}),
                   bad / "train-00000-of-00001.parquet")
    with pytest.raises(convert_gsm8k.ConvertError,
                       match=r"train-00000-of-00001\.parquet:row 2: field 'answer' has no '#### <number>'"):
        convert_gsm8k.convert(tmp_path / "bad", tmp_path / "out", splits=("train",))
    pq.write_table(pa.table({"q": ["x"]}), bad / "train-00000-of-00001.parquet")
    argv = ["--input-dir", str(tmp_path / "bad"), "--out-dir", str(tmp_path / "o"), "--splits", "train"]
    assert convert_gsm8k.main(argv) == 1
