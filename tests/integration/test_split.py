"""On-policy rollouts shared with the generator process (``data.pipeline.split_rollout``, :mod:`rlflow.rollout.split`).

The split's completions are checked against the trainer's engine decoding the whole call alone (the plain loop),
token for token, and a split ``rlflow fit`` against the plain one, metric for metric; the trainer's random stream,
threads and progress reporting are checked to be what they are without the split.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from rlflow.cli import cli_main
from rlflow.rollout import prestart
from rlflow.rollout.base import SamplingParams
from rlflow.rollout.engine import EngineRollout
from rlflow.rollout.split import SplitRollout, split_problem, torch_threads
from tests.helpers.fit import fit_args
from tests.helpers.resume_helpers import assert_same_final_state, assert_same_run, run_args

pytestmark = pytest.mark.slow


@pytest.fixture
def two_threads():
    with torch_threads(2):
        yield


@pytest.fixture(scope="module")
def policy(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_model), AutoTokenizer.from_pretrained(tiny_model)


def prompts_of(tiny_data, tokenizer, count):
    rows = [json.loads(line) for line in (tiny_data / "train.jsonl").read_text().splitlines()[:count]]
    return [list(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True)["input_ids"])
            for r in rows]


def test_a_split_call_samples_what_the_engine_alone_samples(policy, tiny_model, tiny_data, two_threads):
    model, tokenizer = policy
    prompts = prompts_of(tiny_data, tokenizer, 7)  # an odd count: the trainer keeps 4, the generator gets 3
    params = SamplingParams(max_tokens=12, temperature=1.0, stop_token_ids=[tokenizer.eos_token_id])
    alone = EngineRollout(seed=3)
    alone.bind(model, tokenizer)
    engine = EngineRollout(seed=3)
    engine.bind(model, tokenizer)
    split = SplitRollout(engine, threads=1)
    seen, order, threads_inside, calls = [], [], [], []
    try:
        split.attach(str(tiny_model), "engine")
        for _ in range(2):  # two calls: the second takes the next call key, as the engine alone does
            expected = alone.generate(prompts, params, n=4)
            got = {}
            for index, group in split.stream(prompts, params, n=4, progress=lambda c, t: seen.append((c, t))):
                threads_inside.append(torch.get_num_threads())
                order.append(index)
                got[index] = group
            calls.append((expected, [got[i] for i in range(len(prompts))]))
    finally:
        split.close()
    for expected, got in calls:
        assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in g] for g in expected]
        assert [[c.logprobs for c in g] for g in got] == [[c.logprobs for c in g] for g in expected]
        assert [[c.finish_reason for c in g] for g in got] == [[c.finish_reason for c in g] for g in expected]
    assert sorted(order[:4]) == [0, 1, 2, 3] and order[4:7] == [4, 5, 6]  # the generator's share last, in order
    assert threads_inside[:4] == [1] * 4  # the trainer decoded its share on its other thread...
    assert torch.get_num_threads() == 2  # ...and has both back
    assert engine.calls == alone.calls == 2  # one call key per call, as without the split
    assert len(seen) == 14 and sum(c for c, _ in seen) == 56  # every group reported once, with its completions
    assert sum(t for _, t in seen) == sum(len(c.token_ids) for expected, _ in calls for g in expected for c in g)


def test_a_failing_share_in_the_trainer_still_collects_the_generators(policy, tiny_model, tiny_data, two_threads):
    model, tokenizer = policy
    prompts = prompts_of(tiny_data, tokenizer, 4)
    params = SamplingParams(max_tokens=6, temperature=1.0, stop_token_ids=[tokenizer.eos_token_id])
    engine = EngineRollout(seed=0)
    engine.bind(model, tokenizer)
    split = SplitRollout(engine, threads=1)
    try:
        split.attach(str(tiny_model), "engine")

        def broken(*args, **kwargs):
            raise RuntimeError("the trainer's share broke")
            yield  # pragma: no cover

        engine.serve = broken
        with pytest.raises(RuntimeError, match="share broke"):
            split.generate(prompts, params, n=2)
        assert not split.generator.busy  # collected: the next call can submit
        del engine.serve
        assert len(split.generate(prompts, params, n=2)) == 4
    finally:
        split.close()


def test_a_split_fit_logs_what_the_plain_fit_logs_and_continues_exactly(tiny_model, small_data, tmp_path, two_threads):
    plain, split, continued = tmp_path / "plain", tmp_path / "split", tmp_path / "continued"
    cli_main(run_args(tiny_model, small_data, plain, "--data.pipeline.split_rollout=false", steps=4))
    cli = cli_main(run_args(tiny_model, small_data, split, "--data.pipeline.split_rollout=true", steps=4))
    assert cli.datamodule.split is None  # torn down with the fit
    assert_same_run(plain, split, 4)  # every metric but timings, the evaluations and every trajectory
    cli_main(run_args(tiny_model, small_data, continued, "--data.pipeline.split_rollout=true", steps=2))
    cli_main(
        run_args(tiny_model, small_data, continued, "--data.pipeline.split_rollout=true", "--ckpt_path=last", steps=4)
    )
    assert_same_run(split, continued, 4)  # a finished run continued: the call keys go on where they were
    assert_same_final_state(split, continued, 4)


def test_the_split_goes_off_with_a_reason_where_it_cannot_run(tiny_model, small_data, tmp_path, caplog):
    with torch_threads(1), caplog.at_level(logging.INFO, logger="rlflow"):
        cli = cli_main(fit_args(tiny_model, small_data, tmp_path, "--data.pipeline.split_rollout=true", steps=1))
    assert cli.datamodule.split is None and not cli.datamodule.split_rollout
    assert "data.pipeline.split_rollout is off for this run: the trainer has 1 torch thread(s)" in caplog.text


def test_an_fsdp2_run_leaves_the_split_off_and_starts_no_process(
    tiny_model, small_data, tmp_path, caplog, two_threads, monkeypatch
):
    started = []
    monkeypatch.setattr("rlflow.data.datamodule.GeneratorProcess", lambda *a, **k: started.append(a))
    # the run leaves a one-rank process group and Lightning's rank variables behind: tests/conftest.py's
    # restored_environment removes both after the test
    with caplog.at_level(logging.INFO, logger="rlflow"):
        cli = cli_main(
            fit_args(
                tiny_model,
                small_data,
                tmp_path,
                "--data.pipeline.split_rollout=true",
                "--trainer.strategy=fsdp",
                steps=1,
            )
        )
    assert cli.trainer.global_step == 1 and cli.datamodule.split is None and started == []
    assert "data.pipeline.split_rollout is off for this run: the policy is sharded (FSDP2)" in caplog.text


def test_split_problems_name_the_reason(policy):
    model, tokenizer = policy
    engine = EngineRollout()
    engine.bind(model, tokenizer)
    with torch_threads(2):
        assert split_problem(1, 1, False, "cpu", engine) is None
        assert split_problem(1, 1, False, "cpu") is None  # before the backend exists: the run's settings only
        assert "2 ranks" in split_problem(1, 2, False, "cpu", engine)
        assert "sharded (FSDP2)" in split_problem(1, 1, True, "cpu")
        assert "trainer is on cuda" in split_problem(1, 1, False, "cuda")
        assert "not the engine" in split_problem(1, 1, False, "cpu", object())
        assert "none left" in split_problem(2, 1, False, "cpu", engine)
    meta = EngineRollout()
    meta.model = torch.nn.Linear(2, 2, device="meta")
    with torch_threads(2):
        assert "policy is on meta" in split_problem(1, 1, False, "cpu", meta)


@pytest.mark.parametrize(
    "extra, why",
    [
        (
            ["--data.pipeline.max_staleness=1"],
            "data.pipeline.max_staleness=1: the generator process generates ahead instead",
        ),
        (["--data.multiturn.tools=[calculator]"], "multi-turn rollouts"),
    ],
)
def test_pipelined_or_multi_turn_runs_leave_the_split_off_and_say_so(
    tiny_model, small_data, tmp_path, extra, why, caplog
):
    with caplog.at_level(logging.INFO, logger="rlflow"):
        cli = cli_main(
            fit_args(tiny_model, small_data, tmp_path, "--data.pipeline.split_rollout=true", *extra)[1:], run=False
        )
    assert not cli.datamodule.split_rollout
    assert f"data.pipeline.split_rollout is off for this run: {why}" in caplog.text


def test_rlflow_fit_starts_the_generator_early_for_a_split(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("data: {pipeline: {split_rollout: true}}\n")
    assert prestart.predict(["--config", str(config)]) == (0, 1)
    assert prestart.predict(["--config", str(config), "--data.pipeline.generator_threads=2"]) == (0, 2)
    assert prestart.predict(["--config", str(config), "--data.pipeline.split_rollout=false"]) is None
