"""``rlflow data check``: every row validated against the tokenizer and the judgers, without training."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlflow.data.check import percentile
from rlflow.entry import main
from rlflow.judgers.base import Judger


def picky(prompts, completions, completion_ids=None, solution=None, **_):
    """A TRL-style reward function that needs a 'solution' column (and crashes without it)."""
    return [float(s["value"] == c) for s, c in zip(solution, completions)]


def write_jsonl(path, rows):
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows))
    return path


def row(prompt, truth="1", source="openai/gsm8k"):
    return {"prompt": prompt, "data_source": source, "reward_model": {"ground_truth": truth}}


def test_percentile_by_hand():
    values = [10, 4, 8, 6]  # sorted 4 6 8 10; position (n-1)q/100
    assert percentile(values, 50) == 7.0  # halfway between 6 and 8
    assert percentile(values, 90) == pytest.approx(9.4)  # 8 + 0.7 * 2
    assert percentile(values, 0) == 4 and percentile(values, 100) == 10
    assert percentile([5], 99) == 5
    assert percentile([], 50) != percentile([], 50)  # nan


def test_files_report_counts_lengths_drops_and_errors_with_file_line(tiny_model, tmp_path, capsys):
    path = write_jsonl(tmp_path / "d.jsonl", [
        row("a" * 4), row("b" * 6), "{broken\n", {"prompt": "c" * 5, "data_source": "openai/gsm8k"},
        row("d" * 30), row("e" * 8), row("f" * 10), row("g" * 5, source="elsewhere"),
    ])
    rc = main(["data", "check", str(path), "--tokenizer", str(tiny_model), "--max-prompt-length", "12",
               "--judgers", '{"openai/gsm8k": "gsm8k"}'])
    out = capsys.readouterr().out
    assert rc == 1
    assert "rows 8 | malformed 1 | no judger/column 2 | too long 1 | kept 4" in out
    # a character tokenizer: plain prompts of 4, 6, 8, 10 characters are 4, 6, 8, 10 tokens
    assert "prompt tokens: p50 7  p90 9  p99 10  max 10  (max_prompt_length 12)" in out
    assert f"{path}:5: 30 prompt tokens > max_prompt_length 12" in out
    assert f"{path}:3: invalid JSON" in out
    assert f"{path}:4: judger 'gsm8k' needs column 'ground_truth'" in out
    assert f"{path}:8: no judger for data_source 'elsewhere'" in out
    assert "FAILED: 1 source(s), 4 usable train and 0 eval prompts, 1 dropped as too long, 3 error(s)" in out
    assert "mix:" not in out  # files on the command line are not a configured mix


def test_a_judger_that_cannot_read_a_source_fails_the_check(tmp_path, capsys):
    good = write_jsonl(tmp_path / "good.jsonl", [{"prompt": "p", "solution": {"value": "x"}}])
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "answer": "x"}])
    rc = main(["data", "check", str(good), str(bad), "--judgers", '{"*": "tests.unit.data.test_data_check.picky"}'])
    out = capsys.readouterr().out
    assert rc == 1
    assert f"{bad}:1: judger 'picky' fails on rows of bad: TypeError" in out
    assert "train source 'good'" in out and "(no tokenizer: prompt lengths not measured" in out
    assert out.count("error(s); the first") == 1  # only the bad source


def test_config_mode_checks_the_configured_mix_and_eval_set(tiny_model, tiny_data, tmp_path, capsys):
    rows = [json.loads(line) for line in (tiny_data / "val.jsonl").read_text().splitlines()[:20]]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "extra.parquet")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)  # the longest extra prompt, computed independently
    texts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    longest = max(len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts)
    limit = longest + 8
    config = tmp_path / "c.yaml"
    config.write_text(
        f"model:\n  model_path: {tiny_model}\n"
        "data:\n  global_batch_size: 4\n  train_data_path:\n"
        f"    - {{path: {tiny_data / 'train.jsonl'}, weight: 3}}\n"
        f"    - {{path: {tmp_path / 'extra.parquet'}, weight: 1, name: extra, max_prompt_length: {limit}}}\n"
        f"  eval_data_path: {tiny_data / 'val.jsonl'}\n"
    )
    assert main(["data", "check", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "train source 'train'" in out and "train source 'extra'" in out and "eval source 'val'" in out
    n_train = len((tiny_data / "train.jsonl").read_text().splitlines())
    n_eval = len((tiny_data / "val.jsonl").read_text().splitlines())
    assert f"mix: weight 3 -> 3.00 of 4 prompts per step, one pass every {n_train / 3:.1f} steps" in out
    assert "mix: weight 1 -> 1.00 of 4 prompts per step, one pass every 20.0 steps" in out
    assert f"max {longest}  (max_prompt_length {limit})" in out  # its own limit
    # the tiny task's val prompts are among its train prompts (on purpose: 200 facts in all), and so said
    assert (f"  {n_eval} of its {n_eval} prompts are also train prompts (the first: {tiny_data / 'val.jsonl'}:1): "
            "eval/accuracy is not held-out accuracy on them\n") in out
    assert out.count("also train prompts") == 1  # train sources are not compared with each other
    assert (
        f"OK: 3 source(s), {n_train + 20} usable train and {n_eval} eval prompts, 0 dropped as too long, 0 error(s)"
        in out
    )
    # overrides work as in rlflow fit: a limit below every prompt drops them all and fails the check
    assert main(["data", "check", "--config", str(config), "--data.max_prompt_length=5"]) == 1
    out = capsys.readouterr().out
    assert "kept 0" in out and "no usable prompt in this source" in out and "FAILED" in out


def test_usage_and_unreadable_sources(tmp_path, capsys):
    assert main(["data"]) == 2
    assert "usage: rlflow data check" in capsys.readouterr().out
    missing = tmp_path / "missing.jsonl"
    assert main(["data", "check", str(missing)]) == 1
    assert f"    data.train_data_path: {missing}: data file not found\n" in capsys.readouterr().out  # as fit says it
    assert main(["data", "check", str(missing), str(tmp_path / "other.jsonl")]) == 1
    assert f"    data.train_data_path[0]: {missing}: data file not found\n" in capsys.readouterr().out


def stuck(prompts, completions, **_):
    """A judger that never answers in time (a dead grading service)."""
    import time

    time.sleep(30)
    return [0.0] * len(completions)


def test_a_judger_that_hangs_times_out_under_data_judger_timeout(tiny_model, tiny_data, tmp_path, capsys):
    import time

    config = tmp_path / "c.yaml"
    config.write_text(f"model:\n  model_path: {tiny_model}\ndata:\n  train_data_path: {tiny_data / 'val.jsonl'}\n")
    start = time.perf_counter()
    rc = main(["data", "check", "--config", str(config), "--data.judging.timeout=0.5",
               '--data.judging.judgers={"*": "tests.unit.data.test_data_check.stuck"}'])
    assert time.perf_counter() - start < 20  # the probe was abandoned after 0.5 s, not waited for (30 s)
    out = capsys.readouterr().out
    assert rc == 1
    assert "judger 'stuck' fails on rows of val: JudgerTimeout" in out and "data.judging.timeout=0.5" in out


def test_the_missing_column_hint_fits_the_column(tiny_model, tmp_path, capsys):
    from rlflow.judgers.panel import column_hint

    assert "reward_model.ground_truth" in column_hint(["judger 'gsm8k' needs column 'ground_truth'"])
    other = column_hint(["judger 'trl' needs column 'solution'"])
    assert "ground_truth" not in other and "rename" in other
    path = write_jsonl(tmp_path / "d.jsonl", [row("abcd")])
    rc = main(["data", "check", str(path), "--tokenizer", str(tiny_model),
               "--judgers", '{"*": "tests.unit.data.test_data_check:NeedsSolution"}'])
    out = capsys.readouterr().out
    assert rc == 1
    assert f"{path}:1: judger 'needs_solution' needs column 'solution', which the row lacks{other}" in out


class NeedsSolution(Judger):
    name = "needs_solution"
    required_columns = ("solution",)

    def __call__(self, completions, **kwargs):
        return [0.0] * len(completions)


def test_fewer_usable_rows_than_a_step_fails_the_check_as_it_stops_fit(tiny_model, tiny_data, tmp_path, capsys):
    few = write_jsonl(tmp_path / "few.jsonl", [row("1+1?"), row("2+2?"), row("3+3?")])
    config = tmp_path / "c.yaml"
    config.write_text(f"model:\n  model_path: {tiny_model}\ndata:\n  global_batch_size: 4\n"
                      f"  train_data_path: {few}\n")
    assert main(["data", "check", "--config", str(config)]) == 1
    out = capsys.readouterr().out
    assert "3 usable train prompts, fewer than data.global_batch_size=4 (one rollout step's prompts)" in out
    assert main(["data", "check", "--config", str(config), "--data.global_batch_size=3"]) == 0
    capsys.readouterr()
    from rlflow.cli import main as fit_main

    code = fit_main(["fit", "--config", str(config), "--trainer.max_steps=1", "--trainer.accelerator=cpu",
                     f"--trainer.default_root_dir={tmp_path / 'run'}", "--trainer.logger=false"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert "rlflow: error: the dataset has 3 usable prompts, fewer than data.global_batch_size=4" in err
