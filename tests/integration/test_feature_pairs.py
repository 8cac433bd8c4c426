"""Every pair of the options users combine either trains 2 rollout steps or is refused at startup in one line.

Each option is added to the same small ``rlflow fit`` run of the tiny model; a pair that cannot work together must
say so before training (one ``rlflow: error:`` line naming the settings), never crash mid-run or train wrongly.
``REFUSED`` lists the pairs rlflow refuses, with the words of the refusal, so a pair that starts (or stops)
working is seen here.
"""

from __future__ import annotations

import csv
import itertools

import pytest

from rlflow.cli import main
from tests.helpers.fit import fit_args

#: option name -> the command-line arguments that turn it on
OPTIONS: dict[str, list[str]] = {
    "lora": ['--model.lora={"r": 4, "alpha": 8}'],
    "split": ["--data.pipeline.split_rollout=true"],
    "pipelined": ["--data.pipeline.max_staleness=2"],
    "partial": ["--data.pipeline.max_staleness=2", "--data.pipeline.partial_rollouts=true"],
    "dynamic_sampling": ["--data.filtering.dynamic_sampling=true", "--data.filtering.max_rounds=2"],
    "two_updates": ["--model.update.optimizer_steps=2"],
    "kl": ["--model.loss.init_args.kl_coef=0.05"],
    "padded": ["--model.update.packing=false"],
    "tools": ["--data.multiturn.tools=[calculator]", "--data.multiturn.max_turns=2"],
    "hf_backend": ["--data.rollout=hf"],
}

#: pairs refused at startup, and a phrase of the one-line reason
REFUSED: dict[frozenset[str], str] = {
    frozenset({"pipelined", "dynamic_sampling"}): "data.filtering.dynamic_sampling is not pipelined",
    frozenset({"partial", "dynamic_sampling"}): "data.filtering.dynamic_sampling is not pipelined",
    frozenset({"pipelined", "tools"}): "multi-turn rollouts",
    frozenset({"partial", "tools"}): "multi-turn rollouts",
    frozenset({"partial", "hf_backend"}): "data.pipeline.partial_rollouts needs the engine rollout backend",
}


def combined(pair: tuple[str, ...]) -> list[str]:
    args: list[str] = []
    for name in pair:
        args += [a for a in OPTIONS[name] if a not in args]
    return args


PAIRS = [pair for pair in itertools.combinations(OPTIONS, 2)
         if not ({"pipelined", "partial"} <= set(pair))]  # partial rollouts are a kind of pipelined run


@pytest.mark.slow
@pytest.mark.parametrize("pair", PAIRS, ids=["+".join(p) for p in PAIRS])
def test_each_pair_trains_or_is_refused_in_one_line(pair, tiny_model, tiny_data, tmp_path, capsys):
    args = fit_args(tiny_model, tiny_data, tmp_path, "--model.export_hf=false", "--checkpoint.every_n_train_steps=0",
                    *combined(pair), steps=2)
    code = main(args)
    err = capsys.readouterr().err
    refusal = REFUSED.get(frozenset(pair))
    if refusal is not None:
        lines = [line for line in err.splitlines() if line.startswith("rlflow: error:")]
        assert code == 1 and len(lines) == 1 and refusal in lines[0], err[-2000:]
        assert not list(tmp_path.rglob("metrics.csv")), "refused after training had started"
        return
    assert code == 0, err[-3000:]
    rows = [r for r in csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()) if r.get("reward")]
    assert [int(r["step"]) for r in rows] == [0, 1]
    assert all(float(r["num_tokens"]) > 0 for r in rows)
