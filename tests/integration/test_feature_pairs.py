"""Every pair of the options users combine either trains 2 rollout steps (and, with ``resume``, continues exactly
from a checkpoint) or is refused at startup in one line.

The options are not tried pair by pair: :data:`RUNS` is a pairwise covering design
(:func:`tests.helpers.covering.covering_runs`), a few ``rlflow fit`` runs of the tiny model that each turn on
several options at once, so that every pair that can work together is on together in some run. The expensive
options (2 FSDP2 ranks in a subprocess, the vision model) are on in as few runs as the greedy finds, and
``lmdeploy`` (a GPU and the lmdeploy package) has runs of its own, skipped where it cannot run. A pair that cannot
work together is in :data:`REFUSED` with the words of its refusal, and is checked on its own: it must fail before
training with one ``rlflow: error:`` line. A pair whose one option switches the other off (split rollouts beside
anything that generates another way) trains, with the one line that says so (:data:`SWITCHED_OFF`); the design
counts the switched-off option's other pairs only in runs where it is really on. Each run also checks that its
options left their mark (a metric, a line, the module's state). ``test_the_runs_cover_every_allowed_pair`` keeps
the design honest: an option added to :data:`OPTIONS` is paired with every other one, or the test says which pair
no run covers.

``resume`` trains the 2 steps with a checkpoint after each, then continues from step 1's checkpoint in another
directory: the continued step logs exactly the metrics and trajectories of the straight run's step 2.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_vlm
from tests.helpers.covering import allowed_pairs, covered_pairs, covering_runs, run_pairs, switched_off
from tests.helpers.fit import fit_args
from tests.helpers.paths import ROOT
from tests.helpers.processes import rlflow_env
from tests.helpers.resume_helpers import MEASURED

DIGITS = '["0","1","2","3","4","5","6","7","8","9"]'

#: option name -> the settings that turn it on (``{vlm}``, ``{squares}``, ``{rm}``: built by the fixtures)
OPTIONS: dict[str, dict[str, str]] = {
    "fsdp2": {"trainer.strategy": "fsdp", "trainer.devices": "2"},
    "images": {"model.model_path": "{vlm}", "data.train_data_path": "{squares}"},
    "lora": {"model.lora": '{"r": 4, "alpha": 8}'},
    "split": {"data.pipeline.split_rollout": "true"},
    "pipelined": {"data.pipeline.max_staleness": "2"},
    "partial": {"data.pipeline.max_staleness": "2", "data.pipeline.partial_rollouts": "true"},
    "dynamic_sampling": {"data.filtering.dynamic_sampling": "true", "data.filtering.max_rounds": "2"},
    "two_updates": {"model.update.optimizer_steps": "2"},
    "kl": {"model.loss.init_args.kl_coef": "0.05"},
    "padded": {"model.update.packing": "false"},
    "tools": {"data.multiturn.tools": "[calculator]", "data.multiturn.max_turns": "2"},
    # the tiny model is random: a digit ends its turn, so turns are short and the environment answers
    "environment": {"data.multiturn.environment": "guess_number", "data.multiturn.max_turns": "2",
                    "data.sampling.stop": DIGITS, "data.sampling.max_tokens": "24"},
    "reward_model": {},
    "engine": {"data.rollout": "engine"},
    "hf": {"data.rollout": "hf"},
    "lmdeploy": {"data.rollout": "lmdeploy", "trainer.accelerator": "gpu"},
    "resume": {},
}
#: option -> the judger it adds to the graded digit judger every run has
JUDGERS: dict[str, dict | str] = {
    "environment": "env_reward",
    "reward_model": {"class_path": "reward_model", "init_args": {"model_path": "{rm}", "batch_size": 8}},
}
#: option -> a metric every step of a run with it logs
EVIDENCE: dict[str, str] = {
    "kl": "kl",
    "pipelined": "sampling/staleness/mean",
    "partial": "sampling/partial/new_version_tokens",
    "dynamic_sampling": "sampling/rounds",
    "tools": "tools/call_frequency",
    "environment": "env/failures",
    "reward_model": "rewards/reward_model/mean",
}
#: (option, switcher) -> a phrase of the line saying that ``option`` is off in a run with ``switcher``
SWITCHED_OFF: dict[tuple[str, str], str] = {
    ("split", "pipelined"): "data.pipeline.max_staleness=2",
    ("split", "partial"): "data.pipeline.max_staleness=2",
    ("split", "tools"): "multi-turn rollouts (data.multiturn) are not split",
    ("split", "environment"): "multi-turn rollouts (data.multiturn) are not split",
    ("split", "hf"): "the rollout backend is HFRollout, not the engine",
    ("split", "images"): "the rollout backend is HFRollout, not the engine",  # data.rollout=auto picks hf for a VLM
    ("split", "fsdp2"): "2 ranks (FSDP)",
    ("split", "lmdeploy"): "the trainer is on cuda",
}
SPLIT_OFF = "data.pipeline.split_rollout is off for this run: "
#: values of one setting: never on together
EXCLUSIVE = [{"pipelined", "partial"}, {"engine", "hf", "lmdeploy"}]
#: relative cost of a run with the option; above 1: on in as few runs as possible
COST = {"fsdp2": 3.0, "images": 3.0, "resume": 1.5}
#: options whose runs need a GPU and the lmdeploy package (skipped elsewhere)
GPU_ONLY = ["lmdeploy"]

#: pairs refused at startup, and a phrase of the one-line reason
REFUSED: dict[frozenset[str], str] = {
    frozenset({"pipelined", "dynamic_sampling"}): "data.filtering.dynamic_sampling is not pipelined",
    frozenset({"partial", "dynamic_sampling"}): "data.filtering.dynamic_sampling is not pipelined",
    frozenset({"pipelined", "tools"}): "multi-turn rollouts",
    frozenset({"partial", "tools"}): "multi-turn rollouts",
    frozenset({"pipelined", "environment"}): "multi-turn rollouts",
    frozenset({"partial", "environment"}): "multi-turn rollouts",
    frozenset({"partial", "hf"}): "data.pipeline.partial_rollouts needs the engine rollout backend",
    frozenset({"partial", "lmdeploy"}): "data.pipeline.partial_rollouts needs the engine rollout backend",
    frozenset({"partial", "fsdp2"}): "data.pipeline.partial_rollouts is not supported with 2 ranks",
    frozenset({"images", "pipelined"}): "images are not pipelined",
    frozenset({"images", "partial"}): "images are not pipelined",
    frozenset({"images", "engine"}): "the engine rollout backend cannot run this model: it is a vision-language model",
    frozenset({"images", "tools"}): "prompts with images are not rolled out multi-turn",
    frozenset({"images", "environment"}): "prompts with images are not rolled out multi-turn",
}

RUNS = covering_runs(list(OPTIONS), EXCLUSIVE, REFUSED, COST, apart=GPU_ONLY, inert=SWITCHED_OFF)


def settings(run: tuple[str, ...] | frozenset[str]) -> dict[str, str]:
    """The settings of ``run``'s options together (two options that set one key differently are a mistake here)."""
    out: dict[str, str] = {}
    for name in run:
        for key, value in OPTIONS[name].items():
            assert out.setdefault(key, value) == value, f"{name} sets {key}={value}, another option {out[key]}"
    judgers = [{"class_path": "tests.helpers.resume_helpers.DigitJudger"}, *(JUDGERS[n] for n in run if n in JUDGERS)]
    out["data.judging.judgers"] = json.dumps({"*": judgers})
    return out


def arguments(run, paths: dict[str, Path], root: Path, *extra: str) -> list[str]:
    """``rlflow fit`` arguments of ``run``: 2 steps of the tiny model (or the vision model) logging under ``root``."""
    chosen = settings(run)
    for name, path in paths.items():
        chosen = {k: v.replace("{" + name + "}", str(path)) for k, v in chosen.items()}
    base = fit_args(paths["tiny"], paths["data"], root, "--model.export_hf=false", steps=2)
    base = [a for a in base if a.split("=", 1)[0][2:] not in chosen]
    return [*base, *(f"--{k}={v}" for k, v in chosen.items()), *extra]


# ------------------------------------------------------------------------------------------------- the design
def test_the_runs_cover_every_allowed_pair():
    pairs = allowed_pairs(list(OPTIONS), EXCLUSIVE, REFUSED)
    missing = [sorted(p) for p in pairs if p not in covered_pairs(RUNS, SWITCHED_OFF)]
    assert not missing, f"no run turns on these pairs together: {missing}"
    for run in RUNS:
        assert not [p for p in REFUSED if p <= set(run)], run  # no run holds a refused pair
        assert all(len(g & set(run)) <= 1 for g in EXCLUSIVE), run
        settings(run)  # its options set no key two ways
    assert all(p <= OPTIONS.keys() for p in [*REFUSED, *map(set, SWITCHED_OFF)])
    assert EVIDENCE.keys() | IN_PROCESS_EVIDENCE.keys() | PRINTED.keys() <= OPTIONS.keys()
    cpu_runs = [r for r in RUNS if not set(r) & set(GPU_ONLY)]
    cpu_pairs = [p for p in pairs if not p & set(GPU_ONLY)]
    assert set(cpu_pairs) <= covered_pairs(cpu_runs, SWITCHED_OFF)  # a machine without a GPU runs every other pair
    for heavy in ("fsdp2", "images"):  # the most expensive options are on in a few runs only
        assert sum(heavy in r for r in cpu_runs) <= 3, heavy


def test_the_covering_design_is_deterministic_and_covers_an_added_option():
    options = [*OPTIONS, "new_option"]
    refused = {**REFUSED, frozenset({"new_option", "lora"}): "a refusal"}
    runs = covering_runs(options, EXCLUSIVE, refused, COST, apart=GPU_ONLY, inert=SWITCHED_OFF)
    assert runs == covering_runs(options, EXCLUSIVE, refused, COST, apart=GPU_ONLY, inert=SWITCHED_OFF)
    new = {p for p in covered_pairs(runs, SWITCHED_OFF) if "new_option" in p}
    assert new == {frozenset({"new_option", o}) for o in OPTIONS if o != "lora"}
    assert len(runs) < len(allowed_pairs(options, EXCLUSIVE, refused)) / 5  # far fewer runs than pairs


def test_a_switched_off_option_counts_only_with_what_switches_it_off():
    inert = [("split", "hf")]
    assert run_pairs(["split", "hf", "lora"], inert) == {frozenset({"split", "hf"}), frozenset({"hf", "lora"})}
    assert frozenset({"split", "lora"}) in run_pairs(["split", "engine", "lora"], inert)
    runs = covering_runs(["split", "lora", "hf", "engine"], [{"hf", "engine"}], inert=inert)
    assert any({"split", "lora"} <= set(r) and "hf" not in r for r in runs)  # split meets lora where it is on
    assert covered_pairs(runs, inert) == set(allowed_pairs(["split", "lora", "hf", "engine"], [{"hf", "engine"}], []))


# --------------------------------------------------------------------------------------------------- the runs
@pytest.fixture(scope="module")
def paths(tiny_model, tiny_data, tmp_path_factory) -> dict[str, Path]:
    from tests.unit.judgers.test_reward_model import save_reward_model

    root = tmp_path_factory.mktemp("pairs")
    return {"tiny": tiny_model, "data": tiny_data, "vlm": tiny_vlm.build(root / "vlm"),
            "squares": tiny_vlm.write_squares_data(root / "squares", rows=8), "rm": save_reward_model(root / "rm")}


def gpu_skip(run) -> None:
    if not set(run) & set(GPU_ONLY):
        return
    if not (torch.cuda.is_available() and importlib.util.find_spec("lmdeploy")):
        pytest.skip("the lmdeploy rollout backend needs a CUDA GPU and the lmdeploy package")
    if "fsdp2" in run and torch.cuda.device_count() < 2:
        pytest.skip("2 FSDP2 ranks with lmdeploy need 2 CUDA GPUs")


def rlflow_process(args: list[str]) -> subprocess.CompletedProcess:
    """``rlflow`` in a subprocess (for 2 FSDP2 ranks: Lightning starts the second rank), one torch thread a rank."""
    env = rlflow_env()
    return subprocess.run([sys.executable, "-m", "rlflow", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def fit(args: list[str], two_ranks: bool, capsys) -> tuple[object | None, str]:
    """``rlflow fit`` in this process (its ``LightningCLI``), or in a subprocess for 2 ranks (None); and what it
    printed."""
    if two_ranks:
        out = rlflow_process(args)
        assert out.returncode == 0, out.stderr[-4000:]
        return None, out.stdout
    from rlflow.cli import cli_main

    capsys.readouterr()
    cli = cli_main(args)
    return cli, capsys.readouterr().out


#: option -> a phrase of what a run with it prints, and whether it is printed (True) or left out (False)
PRINTED: dict[str, tuple[str, bool]] = {
    "split": ("data.pipeline.split_rollout: the generator process decodes half of each rollout's prompts", True),
    "padded": ("model.update.packing: micro-batches are packs", False),
}
#: option -> what the run's ``LightningCLI`` shows of it (in-process runs)
IN_PROCESS_EVIDENCE = {
    "lora": lambda cli: cli.model.peft_model is not None,
    "padded": lambda cli: cli.model.packing is False,
    "two_updates": lambda cli: cli.model.policy_version == 4,
    "hf": lambda cli: type(cli.datamodule.backend).__name__ == "HFRollout",
    "engine": lambda cli: type(cli.datamodule.backend).__name__ == "EngineRollout",
}


def logged(root: Path) -> tuple[dict[int, dict[str, float]], list[dict]]:
    """The training rows of the run under ``root`` by step, and its trajectories (rank 0's)."""
    (log_dir,) = root.glob("lightning_logs/version_*")
    rows = {}
    for row in csv.DictReader((log_dir / "metrics.csv").open()):
        if row.get("loss"):
            rows[int(row["step"])] = {k: float(v) for k, v in row.items() if v != ""}
    lines = [json.loads(line) for line in (log_dir / "trajectories.jsonl").read_text().splitlines()]
    return rows, lines


def check_options_were_on(run, cli, printed: str, rows: dict[int, dict[str, float]]) -> None:
    """Each option of ``run`` left its mark (a metric, the module's state), or the line saying it was off."""
    off = switched_off(run, SWITCHED_OFF)
    for option in off:
        said = [line for line in printed.splitlines() if SPLIT_OFF in line]
        reasons = [SWITCHED_OFF[(option, s)] for s in run if (option, s) in SWITCHED_OFF]
        if cli is None:  # each of 2 ranks has one torch thread: the first reason the split gives
            reasons.append("the trainer has 1 torch thread(s)")
        assert len(said) == 1 and any(r in said[0] for r in reasons), (option, said)
    for option in (set(run) - off) & PRINTED.keys():
        phrase, shown = PRINTED[option]
        assert (phrase in printed) is shown, (option, phrase)
    for row in rows.values():
        assert row["num_tokens"] > 0 and row["loss"] == row["loss"]
        for option in set(run) & EVIDENCE.keys():
            assert EVIDENCE[option] in row, option
    for option in (set(run) - off) & IN_PROCESS_EVIDENCE.keys():
        assert cli is None or IN_PROCESS_EVIDENCE[option](cli), option


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS, ids=["+".join(r) for r in RUNS])
def test_each_run_trains_two_steps(run, paths, tmp_path, capsys):
    gpu_skip(run)
    two_ranks, resume = "fsdp2" in run, "resume" in run
    saves = ["--checkpoint.every_n_train_steps=1", "--checkpoint.save_top_k=-1"] if resume else \
        ["--checkpoint.every_n_train_steps=0"]
    straight = tmp_path / "straight"
    cli, printed = fit(arguments(run, paths, straight, *saves), two_ranks, capsys)
    rows, lines = logged(straight)
    assert sorted(rows) == [0, 1]
    check_options_were_on(run, cli, printed, rows)
    if not resume:
        return
    # continued from step 1's checkpoint (in another directory): step 2 as the straight run logged it
    (ckpt,) = straight.glob("lightning_logs/version_0/checkpoints/epoch=*-step=1.ckpt")
    resumed = tmp_path / "resumed"
    fit(arguments(run, paths, resumed, *saves, f"--ckpt_path={ckpt}"), two_ranks, capsys)
    again, again_lines = logged(resumed)
    assert sorted(again) == [1]
    assert again[1].keys() == rows[1].keys()
    differ = {k: (rows[1][k], again[1][k]) for k in rows[1].keys() - MEASURED if rows[1][k] != again[1][k]}
    assert not differ, differ
    assert again_lines == [t for t in lines if t["step"] == 1] != []


REFUSED_PAIRS = sorted(tuple(sorted(p)) for p in REFUSED)


@pytest.mark.slow
@pytest.mark.parametrize("pair", REFUSED_PAIRS, ids=["+".join(p) for p in REFUSED_PAIRS])
def test_each_refused_pair_is_one_line_at_startup(pair, paths, tmp_path, capsys):
    """Refused before training, in one line (a 2-rank run before its second rank starts: one process, one line)."""
    gpu_skip(pair)
    args = arguments(pair, paths, tmp_path, "--checkpoint.every_n_train_steps=0")
    if "fsdp2" in pair:
        out = rlflow_process(args)
        code, err = out.returncode, out.stderr
    else:
        import multiprocessing

        from rlflow.cli import main

        before = set(multiprocessing.active_children())  # workers kept by earlier runs of this process may be alive
        code = main(args)
        err = capsys.readouterr().err
        left = [p for p in multiprocessing.active_children() if p not in before and p.name == "rlflow-generator"]
        assert not left, "a refused run left its generator process running"
    lines = [line for line in err.splitlines() if line.startswith("rlflow: error:")]
    assert code == 1 and len(lines) == 1 and REFUSED[frozenset(pair)] in lines.pop(), err[-2000:]
    assert not list(tmp_path.rglob("metrics.csv")), "refused after training had started"
