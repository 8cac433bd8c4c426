"""The experience maker gives judgers the rollout step (TRL's ``trainer_state``), keeps what they log (``log_extra``
columns in the sample rows, ``log_metric`` means in the step's metrics) and stops the run, before anything is
trained, where a judger cannot work."""

from __future__ import annotations

import pytest

from rlflow.config_error import ConfigError
from rlflow.data.datamodule import RolloutDataModule
from rlflow.data.settings import JudgingSettings
from rlflow.judgers.runner import JudgerError
from tests.unit.judgers.test_overlap import K, ShuffledStream, premade


def stepwise(completions, trainer_state, log_extra, log_metric, **kwargs):
    """A curriculum reward written to TRL's signature: its reward is the step; it logs a column and a metric."""
    step = trainer_state.global_step
    log_extra("seen_step", [step] * len(completions))
    log_metric("curriculum/step", float(step))
    log_metric("reward", -1.0)  # named like a built-in metric: the built-in one wins
    log_metric("step", 4242.0)  # named like the loggers' step column: dropped
    return [float(step)] * len(completions)


def abstains(completions, **kwargs):
    return [None] * len(completions)


def wrong_signature(completion, **kwargs):
    return [0.0]


def cannot_score(completions, **kwargs):
    """Fails on every call, with a signature that can be called: found only when it runs."""
    return [len(completions) + "x"]


def by_ability(completions, ability, **kwargs):
    return [1.0 if a else 0.0 for a in ability]


def by_hint(completions, hint, **kwargs):
    return [0.5 if h is None else 1.0 for h in hint]


def data_module(tiny_model, tiny_data, tokenizer, judgers, records=4, train=None, **kw):
    dm = RolloutDataModule(train_data_path=str(train or tiny_data / "train.jsonl"), tokenizer_path=str(tiny_model),
                           prompt_repeat_k=K, global_batch_size=records, sampling={"max_tokens": 8},
                           judging={"judgers": judgers, "overlap": False}, **kw)
    dm.setup("fit")
    dm.backend = ShuffledStream(premade(dm, dm.train_records[:records], tokenizer), pause=0.0)
    dm.bind(None)
    return dm


def test_judgers_see_the_step_and_what_they_log_reaches_rows_and_metrics(tiny_model, tiny_data, tokenizer):
    dm = data_module(tiny_model, tiny_data, tokenizer, {"*": "tests.unit.data.test_experience_maker_judging:stepwise"})
    out = dm.make_experience(dm.train_records[:4], policy_version=0, step=2)
    assert [e.reward for e in dm.buffer.items] == [2.0] * 4 * K
    assert out.metrics["curriculum/step"] == 2.0 and out.metrics["reward"] == 2.0
    assert [row["seen_step"] for row in out.samples] == [2] * 4 * K
    assert all(row["step"] == 2 for row in out.samples)


def test_taken_metric_names_and_a_judger_scoring_nothing_are_warned_about_once(
        tiny_model, tiny_data, tokenizer, caplog):
    here = "tests.unit.data.test_experience_maker_judging"
    dm = data_module(tiny_model, tiny_data, tokenizer, {"*": [f"{here}:stepwise", f"{here}:abstains"]})
    with caplog.at_level("WARNING"):
        for step in (1, 2):
            out = dm.make_experience(dm.train_records[:4], policy_version=0, step=step)
            assert "step" not in out.metrics and out.metrics["reward"] == float(step)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert sum("log_metric('step', ...) is not logged: 'step' is a logger's own column" in w for w in warnings) == 1
    assert sum("log_metric('reward', ...) is not logged: 'reward' is a metric of the rollout step" in w
               for w in warnings) == 1
    assert sum("rollout step 1: judger 'abstains' returned no reward (None or NaN) for any of its 16 samples" in w
               for w in warnings) == 1
    assert not any("'stepwise' returned no reward" in w for w in warnings)


def test_a_judger_that_cannot_work_stops_the_step_before_anything_is_trained(tiny_model, tiny_data, tokenizer):
    path = "tests.unit.data.test_experience_maker_judging:cannot_score"
    dm = data_module(tiny_model, tiny_data, tokenizer, {"*": ["gsm8k", path]})
    with pytest.raises(JudgerError, match=r"^rollout step 5: judger 'cannot_score' failed on 16 of its 16 samples: "
                                          r"TypeError: .*; it was given the keywords prompts, completions"):
        dm.make_experience(dm.train_records[:4], policy_version=0, step=5)
    assert dm.buffer.items == []


def test_a_reward_function_whose_parameter_no_column_fills_is_refused_before_generation(tiny_model, tiny_data,
                                                                                         tokenizer):
    """TRL's contract passes each column by name: a required parameter that names no column of the rows the
    function judges (``completion`` for ``completions``) would fail every call; the data setup says so first. A
    parameter some rows fill is called with None for the others, as TRL does."""
    from rlflow.data.dataset import DataError

    path = "tests.unit.data.test_experience_maker_judging:wrong_signature"
    with pytest.raises(DataError, match=r"^train data: judger 'wrong_signature' requires the parameter\(s\) "
                                        r"completion, which no train row it judges has as a column \(columns: "
                                        r"ability, data_source, extra_info, ground_truth, reward_model\)"):
        data_module(tiny_model, tiny_data, tokenizer, {"*": ["gsm8k", path]})
    dm = data_module(tiny_model, tiny_data, tokenizer, {"*": f"{__name__}:by_ability"})
    assert dm.train_records  # ability: a column of every row


def test_every_rank_stops_when_a_judger_cannot_work_on_another(tiny_model, tiny_data, tokenizer):
    dm = data_module(tiny_model, tiny_data, tokenizer, {"*": "gsm8k"})
    dm.maker.ranks.any_true = lambda flag: True  # another rank's judger failed on all of its samples
    with pytest.raises(JudgerError, match="rollout step 0: a judger cannot work on another rank"):
        dm.make_experience(dm.train_records[:4], policy_version=0, step=0)


def test_the_failure_rate_setting_reaches_the_panel_and_is_checked(tiny_model, tiny_data, tokenizer):
    dm = RolloutDataModule(train_data_path=str(tiny_data / "train.jsonl"), tokenizer_path=str(tiny_model),
                           judging={"max_failure_rate": 0.05})
    assert dm.judges.max_failure_rate == 0.05
    assert RolloutDataModule(train_data_path=str(tiny_data / "train.jsonl"),
                             tokenizer_path=str(tiny_model)).judges.max_failure_rate is None
    with pytest.raises(ConfigError, match=r"data.judging.max_failure_rate must be in \[0.0, 1.0\], got 1.5"):
        JudgingSettings(max_failure_rate=1.5)


def test_a_column_only_some_rows_have_reaches_a_batch_without_it_as_none(tiny_model, tiny_data, tokenizer, tmp_path):
    """As a TRL dataset's column: a batch of rows none of which has ``hint`` still passes ``hint`` (all None)."""
    import json

    rows = [json.loads(line) for line in (tiny_data / "train.jsonl").read_text().splitlines()]
    rows[-1]["hint"] = "carry the one"
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    dm = data_module(tiny_model, tiny_data, tokenizer, {"*": f"{__name__}:by_hint"}, train=train)
    assert all("hint" not in r.columns for r in dm.train_records[:4])
    dm.make_experience(dm.train_records[:4], policy_version=0, step=0)
    assert [e.reward for e in dm.buffer.items] == [0.5] * 4 * K
