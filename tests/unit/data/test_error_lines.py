"""Bad input to ``rlflow data check`` and the jsonl reader is one line naming the file, line and field."""

from __future__ import annotations

import json

import pytest

from rlflow.data.dataset import DataError, iter_jsonl, read_jsonl
from rlflow.entry import main

DEMO = "configs/demo_cpu.yaml"


def test_data_check_names_the_file_line_and_full_key_of_an_unknown_setting(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  sampling:\n    max_tokenz: 3\n")
    code = main(["data", "check", "--config", DEMO, "--config", str(bad)])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 1
    assert lines == [f"rlflow: error: {bad}, line 3: data.sampling.max_tokenz is not a setting; "
                     "did you mean data.sampling.max_tokens?"]


def rows(n: int) -> list[str]:
    return [json.dumps({"prompt": f"q{i}", "data_source": "openai/gsm8k"}) for i in range(n)]


@pytest.mark.parametrize("newline, last", [("\n", "\n"), ("\r\n", "\r\n"), ("\n", "")])
def test_a_row_missing_its_closing_brace_is_reported_at_the_end_of_its_line(tmp_path, newline, last):
    lines = rows(2)
    lines[1] = lines[1][:-1]  # no closing }
    path = tmp_path / "mal.jsonl"
    path.write_text(newline.join(lines) + last, newline="")
    errors = [str(item) for _, item in iter_jsonl(path) if isinstance(item, DataError)]
    assert errors == [f"{path}:2: invalid JSON at the end of the line: Expecting ',' delimiter"]


def test_an_error_inside_a_row_gives_its_column(tmp_path):
    path = tmp_path / "mal.jsonl"
    path.write_text(rows(1)[0] + '\n{"prompt": "a", "data_source": tru}\n')
    with pytest.raises(DataError) as err:
        read_jsonl(path)
    assert str(err.value).splitlines()[1].strip() == f"{path}:2: invalid JSON at column 32: Expecting value"
