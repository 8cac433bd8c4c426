"""``rlflow.demo.sums``: the SmolLM2 recipe's rows and its TRL-style reward function."""

from __future__ import annotations

import json

from rlflow.demo.sums import final_number_reward, problems, write_data
from rlflow.judgers.gsm8k import extract_answer


def test_the_last_number_decides_the_reward():
    completions = ["3 + 2 = 5", "3 + 2 = 5\n#### 12", "The sum is 5.", "no number",
                   [{"role": "assistant", "content": "5"}], "-5"]
    assert final_number_reward(completions, ["5", "5", " 5 ", "5", "5", "5"]) == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]


def test_rows_are_gsm8k_rows_and_the_held_out_sums_are_never_trained_on(tmp_path):
    train, val = write_data(tmp_path, n_val=10)
    train_rows = [json.loads(line) for line in train.read_text().splitlines()]
    val_rows = [json.loads(line) for line in val.read_text().splitlines()]
    assert len(val_rows) == 10 and len(train_rows) + len(val_rows) == len(problems())
    questions = {r["extra_info"]["question"] for r in train_rows}
    assert not questions & {r["extra_info"]["question"] for r in val_rows}
    for r in train_rows + val_rows:
        a, b = (int(x) for x in r["extra_info"]["question"][len("What is "):-1].split(" + "))
        assert r["reward_model"]["ground_truth"] == str(a + b)
        assert extract_answer(r["extra_info"]["answer"]) == str(a + b)  # the worked answer satisfies the gsm8k judger
        assert r["prompt"][0]["role"] == "user" and "####" in r["prompt"][0]["content"]
    assert write_data(tmp_path / "again", n_val=10)[1].read_text() == val.read_text()  # the split is fixed
