"""Pipelined GRPO end to end (``data.pipeline.max_staleness``): the schedule, the stamps, the correction, the bound
under
adversarial timing, ``max_staleness: 0`` being today's loop, and exact resume after ``kill -9``.

The stamps and the importance weights are checked against a plain recomputation: a full forward of the tiny
model with the weights of every version, snapshotted by a callback, not against anything the trainer computed.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from rlflow.cli import cli_main
from rlflow.rollout.engine import EngineRollout
from rlflow.rollout.pipeline import RolloutPipeline
from rlflow.rollout.process import ThreadGenerator, copy_weights
from tests.helpers.paths import ROOT
from tests.helpers.processes import rlflow_env
from tests.helpers.resume_helpers import (
    MEASURED,
    assert_same_final_state,
    assert_same_run,
    metrics_by_step,
    run_args,
    trajectories,
)

pytestmark = pytest.mark.slow
STEPS = 4


class Recorder(L.Callback):
    """Snapshots the policy's weights at the start and after every rollout step, and keeps each step's experience
    and metrics."""

    def __init__(self, slow_trainer: float = 0.0) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []
        self.experiences: list[list] = []
        self.metrics: list[dict[str, float]] = []
        self.slow_trainer = slow_trainer

    def on_train_start(self, trainer, pl_module):
        self.weights.append(copy.deepcopy(pl_module.policy.state_dict()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.weights.append(copy.deepcopy(pl_module.policy.state_dict()))
        self.experiences.append(list(pl_module.last_rollout.experiences))
        self.metrics.append(dict(pl_module.last_metrics))
        if self.slow_trainer and batch_idx % 2 == 0:  # an adversarially slow trainer (on every other step)
            time.sleep(self.slow_trainer)


def pipelined_run(tiny_model, data, root, *extra, recorder=None):
    args = run_args(tiny_model, data, root, "--data.pipeline.max_staleness=1", *extra, steps=STEPS)
    cli = cli_main(args[1:], run=False)
    recorder = recorder or Recorder()
    cli.trainer.callbacks.append(recorder)
    cli.trainer.fit(cli.model, cli.datamodule)
    return cli, recorder


@pytest.fixture(scope="module")
def pipelined(tiny_model, small_data, tmp_path_factory):
    torch.set_num_threads(1)
    return pipelined_run(tiny_model, small_data, tmp_path_factory.mktemp("pipelined"))


def plain_logprobs(model, experience, temperature: float = 1.0) -> torch.Tensor:
    """log p(completion token | prefix) from one full forward, written out by hand."""
    ids = torch.tensor([experience.prompt_ids + experience.completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature
    p = len(experience.prompt_ids)
    logp = torch.log_softmax(logits[p - 1 : -1], dim=-1)
    return logp.gather(1, torch.tensor(experience.completion_ids)[:, None])[:, 0]


def model_at(tiny_model, weights):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    model.load_state_dict(weights)
    return model


def test_every_step_after_the_first_trains_on_the_previous_versions_samples(pipelined):
    cli, rec = pipelined
    assert cli.model.trained_versions == [(0, 0), (1, 0), (2, 1), (3, 2)]
    for step, (experiences, metrics) in enumerate(zip(rec.experiences, rec.metrics)):
        expected = max(step - 1, 0)
        assert {e.policy_version for e in experiences} == {expected}
        assert metrics["sampling/staleness/max"] == metrics["sampling/staleness/mean"] == float(step > 0)
        assert metrics["sampling/staleness/regenerated_groups"] == 0.0
    assert cli.datamodule.pipeline.generator is None  # closed at the end of fit: no generator process left


def test_stamps_and_correction_weights_match_a_plain_recomputation(pipelined, tiny_model):
    cli, rec = pipelined
    assert cli.model.correction is not None and cli.model.correction.mode == "token_truncate"  # on by default
    assert cli.model.correction_in_forward  # one update per step: the weights come from the training forward
    models = [model_at(tiny_model, w) for w in rec.weights]
    for step in range(1, STEPS):
        ratios, gaps = [], []
        for e in rec.experiences[step]:
            behaviour = plain_logprobs(models[e.policy_version], e)
            # the generator's log-probs are those of the stamped version's weights ...
            assert torch.allclose(torch.tensor(e.rollout_logprobs), behaviour, atol=2e-4), step
            # ... and not of the next version's (the weights did move between versions)
            gaps.append((plain_logprobs(models[e.policy_version + 1], e) - behaviour).abs().max().item())
            # the ratio's numerator: the weights at the start of this rollout step (version `step`)
            current = plain_logprobs(models[step], e)
            ratios.append(torch.exp(current - behaviour).clamp(max=2.0))  # TIS, cap 2 (the default)
        assert max(gaps) > 1e-2
        w = torch.cat(ratios)
        m = rec.metrics[step]
        assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx(w.mean().item(), abs=1e-4)
        assert m["sampling/importance_sampling_ratio/min"] == pytest.approx(w.min().item(), abs=1e-4)
        assert m["sampling/importance_sampling_ratio/max"] == pytest.approx(w.max().item(), abs=1e-4)
        assert w.min().item() < 0.999 or w.max().item() > 1.001  # a correction that does something


@pytest.mark.parametrize("slow", ["generator", "trainer"])
def test_the_bound_holds_and_nothing_changes_under_adversarial_timing(
    slow, pipelined, tiny_model, small_data, tmp_path, monkeypatch
):
    """A generator that sleeps 1 s per job, or a trainer that sleeps 1 s on every other step: the staleness stays
    within the bound on every step and the run is the same, metric for metric, as the undisturbed one."""
    recorder = Recorder(slow_trainer=1.0 if slow == "trainer" else 0.0)
    if slow == "generator":
        monkeypatch.setattr(RolloutPipeline, "generator_delay", 1.0)
    cli, rec = pipelined_run(tiny_model, small_data, tmp_path, recorder=recorder)
    base = pipelined[1]
    for step in range(STEPS):
        assert rec.metrics[step]["sampling/staleness/max"] <= 1
        assert {e.policy_version for e in rec.experiences[step]} == {e.policy_version for e in base.experiences[step]}
        for key in base.metrics[step].keys() - MEASURED:
            assert rec.metrics[step][key] == base.metrics[step][key], (step, key)
    if slow == "generator":  # the trainer really waited for the slow generator instead of running ahead (step 0's
        # completions are generated in the trainer, while the generator starts and samples step 1)
        waits = [m["rollout/wait_time"] for m in rec.metrics]
        assert waits[0] == 0.0 and all(w > 0.25 for w in waits[1:]), waits


class CoreLog(L.Callback):
    """Records, at every backward pass and evaluation generation in the trainer, its torch threads and whether the
    generator process may run (its ``running`` event)."""

    def __init__(self) -> None:
        self.backward: list[tuple[int, bool]] = []
        self.generate: list[tuple[str, int, bool]] = []
        self.metrics: list[dict[str, float]] = []

    def state(self, trainer) -> bool:
        generator = trainer.datamodule.pipeline.generator
        return generator.running.is_set()

    def on_before_backward(self, trainer, pl_module, loss):
        self.backward.append((torch.get_num_threads(), self.state(trainer)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.metrics.append(dict(pl_module.last_metrics))


def lent_run(tiny_model, small_data, root, monkeypatch, log: CoreLog, *extra: str):
    args = run_args(
        tiny_model,
        small_data,
        root,
        "--data.pipeline.max_staleness=1",
        "--evaluate_every_n_steps=2",
        f"--data.eval_data_path={small_data / 'val.jsonl'}",
        *extra,
        steps=STEPS,
    )
    cli = cli_main(args[1:], run=False)
    cli.trainer.callbacks.append(log)
    generate = EngineRollout.generate

    def recording(backend, *a, **k):  # the trainer's own generations once the pipeline runs: step 0 and evaluation
        if cli.datamodule.pipeline.trainer_threads is not None:  # not the engine check at fit start
            kind = "eval" if cli.trainer.validating else "train"
            log.generate.append((kind, torch.get_num_threads(), log.state(cli.trainer)))
        return generate(backend, *a, **k)

    monkeypatch.setattr(EngineRollout, "generate", recording)
    cli.trainer.fit(cli.model, cli.datamodule)
    monkeypatch.setattr(EngineRollout, "generate", generate)
    return cli


def test_the_backward_and_evaluation_take_the_generators_cores_and_the_run_stays_reproducible(
    tiny_model, small_data, tmp_path, monkeypatch
):
    """With 2 trainer threads on 2 cores the trainer keeps 1 thread and the generator process gets the other, except
    during the backward pass and evaluation, which take both while the generator is held; the run is the same,
    metric for metric, when the generator is slow (so the holds fall on other decode iterations)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        base = lent_run(tiny_model, small_data, tmp_path / "base", monkeypatch, base_log := CoreLog())
        assert torch.get_num_threads() == 2  # given back when the generator closed
        monkeypatch.setattr(RolloutPipeline, "generator_delay", 0.3)
        lent_run(tiny_model, small_data, tmp_path / "slow", monkeypatch, slow_log := CoreLog())
        kept = lent_run(
            tiny_model,
            small_data,
            tmp_path / "kept",
            monkeypatch,
            kept_log := CoreLog(),
            "--data.pipeline.lend_cores=false",
        )
    finally:
        torch.set_num_threads(threads)
    assert base.datamodule.pipeline.lends_cores
    assert len(base_log.backward) == STEPS and set(base_log.backward) == {(2, False)}
    kinds = [g[0] for g in base_log.generate]
    assert kinds == ["train", "eval", "eval"], base_log.generate  # step 0; after steps 2 and 4
    assert base_log.generate[0][1:] == (1, True)  # step 0, generated in the trainer beside the generator's start
    assert {g[1:] for g in base_log.generate if g[0] == "eval"} == {(2, False)}
    for step in range(STEPS):
        for key in base_log.metrics[step].keys() - MEASURED:
            assert slow_log.metrics[step][key] == base_log.metrics[step][key], (step, key)
    # data.pipeline.lend_cores=false: the trainer keeps its one thread throughout and never holds the generator
    assert not kept.datamodule.pipeline.lends_cores
    assert set(kept_log.backward) == {(1, True)} and {g[1:] for g in kept_log.generate} == {(1, True)}


def test_max_staleness_zero_is_todays_loop_bit_for_bit(tiny_model, small_data, tmp_path, one_thread):
    default = cli_main(run_args(tiny_model, small_data, tmp_path / "default", steps=3))
    zero = cli_main(run_args(tiny_model, small_data, tmp_path / "zero", "--data.pipeline.max_staleness=0", steps=3))
    assert default.datamodule.pipeline is None and zero.datamodule.pipeline is None
    assert zero.model.correction is None  # nothing turned on behind the user's back
    assert_same_run(tmp_path / "default", tmp_path / "zero", 3)
    assert not any(k.startswith("sampling/staleness") for k in metrics_by_step(tmp_path / "zero")[0])


def test_a_bound_below_the_pipelines_staleness_is_a_config_error(tiny_model, small_data, tmp_path):
    from rlflow.config_error import ConfigError

    with pytest.raises(ConfigError, match="data.pipeline.max_staleness=1 is below"):
        cli_main(
            run_args(
                tiny_model,
                small_data,
                tmp_path,
                "--data.pipeline.max_staleness=1",
                "--model.update.optimizer_steps=2",
                steps=1,
            )
        )


class KillMidStep(L.Callback):
    """SIGKILL in the middle of the rollout step after ``step`` checkpointed ones (between its two optimizer
    steps), after writing the generator process's pid to ``pid_file``."""

    def __init__(self, step: int, pid_file: str) -> None:
        self.step, self.pid_file = step, pid_file

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == self.step and pl_module.policy_version == 2 * self.step + 1:
            Path(self.pid_file).write_text(str(trainer.datamodule.pipeline.generator.process.pid))
            os.kill(os.getpid(), signal.SIGKILL)


def kill_mid_step(tiny_model, small_data, out: Path, pid_file: Path, extra: tuple[str, ...]) -> dict:
    """Run ``rlflow fit`` in a subprocess killed with SIGKILL between the two optimizer steps of rollout step 3
    (:class:`KillMidStep`); return its last checkpoint."""
    kill = (
        '--trainer.callbacks+={"class_path": "tests.integration.test_pipeline.KillMidStep", '
        f'"init_args": {{"step": 3, "pid_file": "{pid_file}"}}}}'
    )
    env = rlflow_env()
    command = [sys.executable, "-m", "rlflow", *run_args(tiny_model, small_data, out, *extra, kill)]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=500)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    return torch.load(out / "lightning_logs/version_0/checkpoints/last.ckpt", weights_only=True)


def test_kill_and_resume_of_a_pipelined_run_matches_the_straight_run(tiny_model, small_data, tmp_path, one_thread):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    extra = ("--model.update.optimizer_steps=2", "--data.pipeline.max_staleness=2")
    cli_main(run_args(tiny_model, small_data, straight, *extra))
    pid_file = tmp_path / "generator.pid"
    state = kill_mid_step(tiny_model, small_data, killed, pid_file, extra)
    in_flight = state["RolloutDataModule"]["pipeline"]["in_flight"]
    assert state["global_step"] == 3 and in_flight["step"] == 3 and in_flight["version"] == 4  # step 3's samples
    # the orphaned generator notices its parent is gone and exits
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]

    cli = cli_main(run_args(tiny_model, small_data, killed, *extra, "--ckpt_path=last"))
    assert cli.trainer.global_step == 6
    assert_same_run(straight, killed, 6)
    assert {t["policy_version"] for t in trajectories(straight) if t["step"] == 4} == {6}  # sampled one step back
    assert_same_final_state(straight, killed, 6)


# --------------------------------------------------------------- a backend with its own weights (a server)
class OwnWeightsEngine(EngineRollout):
    """The engine on a private copy of the policy, refreshed only by ``push_weights``: how an inference server
    (lmdeploy) behaves, so pipelining drives it from a thread (:class:`rlflow.rollout.process.ThreadGenerator`)."""

    reads_policy_weights = False

    def __init__(self) -> None:
        super().__init__(seed=0)

    own = None

    def bind(self, model, tokenizer):  # bound again before evaluation: the server keeps what it holds
        self.policy = model
        if self.own is None:
            self.own = copy.deepcopy(model).eval()
        super().bind(self.own, tokenizer)

    def push_weights(self):
        copy_weights(self.policy, self.own)


def test_a_backend_with_its_own_weights_generates_from_a_thread(tiny_model, small_data, tmp_path):
    cli, rec = pipelined_run(
        tiny_model,
        small_data,
        tmp_path,
        '--data.rollout={"class_path": "tests.integration.test_pipeline.OwnWeightsEngine"}',
    )
    assert isinstance(cli.datamodule.backend, OwnWeightsEngine)
    assert cli.model.trained_versions == [(0, 0), (1, 0), (2, 1), (3, 2)]
    models = [model_at(tiny_model, w) for w in rec.weights]
    for step in range(1, STEPS):
        for e in rec.experiences[step]:  # sampled from the weights pushed at the start of the previous step
            assert e.policy_version == step - 1
            assert torch.allclose(torch.tensor(e.rollout_logprobs), plain_logprobs(models[step - 1], e), atol=2e-4)


def test_pipelining_refuses_an_lmdeploy_engine_that_sleeps_during_training():
    from rlflow.config_error import ConfigError
    from rlflow.rollout.lmdeploy import LMDeployRollout

    with pytest.raises(ConfigError, match="sleep_level"):
        ThreadGenerator(LMDeployRollout(sleep_level=2))
    generator = ThreadGenerator(LMDeployRollout(sleep_level=None))  # engines on GPUs of their own: fine
    generator.close()


def test_a_policy_off_the_cpu_keeps_the_trainers_threads_and_says_where_generation_runs(caplog):
    """On a GPU (here the meta device stands in) the trainer's threads are not cut for the generator process,
    which still decodes on CPU cores: a user who set max_staleness on a GPU is told so, and what to use instead."""
    import logging

    pipeline = RolloutPipeline(1, threads=3)
    threads = torch.get_num_threads()
    with caplog.at_level(logging.INFO, logger="rlflow"):
        pipeline.share_cores(torch.nn.Linear(2, 2, device="meta"))
    assert torch.get_num_threads() == threads and pipeline.trainer_threads is None
    assert "the policy is on meta; the generator process decodes on CPU cores (3 torch threads" in caplog.text
    assert "lmdeploy" in caplog.text


# ------------------------------------------------------------------------------------ two FSDP ranks
class SlowGeneratorOnRank(L.Callback):
    """Makes one rank's generator sleep ``delay`` seconds before every job."""

    def __init__(self, rank: int = 1, delay: float = 2.0) -> None:
        self.rank, self.delay = rank, delay

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_rank == self.rank:
            trainer.datamodule.pipeline.generator_delay = self.delay


def fsdp_run(tiny_model, tiny_data, root, steps, *extra):
    """``rlflow fit`` on 2 gloo ranks under ``trainer.strategy=fsdp`` with pipelining, rank 1's generator 2 s slower
    per job (longer than a step on a slow machine, so that rank 1 always waits)."""
    slow = (
        '--trainer.callbacks+={"class_path": "tests.integration.test_pipeline.SlowGeneratorOnRank", '
        '"init_args": {"rank": 1}}'
    )
    args = run_args(
        tiny_model,
        tiny_data,
        root,
        "--trainer.strategy=fsdp",
        "--data.pipeline.max_staleness=1",
        "--data.judging.isolation=thread",  # pipelining under sharding is tested here, not judger isolation
        slow,
        *extra,
        steps=steps,
    )
    args = [a.replace("--trainer.devices=1", "--trainer.devices=2") for a in args]
    env = rlflow_env()
    out = subprocess.run(
        [sys.executable, "-m", "rlflow", *args], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-4000:]


def rank_trajectories(root: Path) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for path in sorted(root.glob("lightning_logs/version_*/trajectories*.jsonl")):
        out.setdefault(path.name, []).extend(json.loads(line) for line in path.read_text().splitlines())
    return out


@pytest.fixture(scope="module")
def fsdp_straight(tiny_model, tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    fsdp_run(tiny_model, tiny_data, root, 3)
    return root


def test_two_fsdp_ranks_pipeline_in_step_when_one_generator_is_slow(fsdp_straight):
    """2 gloo ranks under ``trainer.strategy=fsdp``, each with its own generator process, rank 1's 2 s slower per
    job: the run finishes (no hang), every rank trains each step on its own completions of the previous version."""
    metrics = metrics_by_step(fsdp_straight)
    assert sorted(metrics) == [0, 1, 2]
    assert [metrics[s]["sampling/staleness/max"] for s in range(3)] == [0.0, 1.0, 1.0]
    # rank 1 waits ~2 s less the step's own time for its generator, rank 0 ~0 (logged: the ranks' mean); a 1 s delay
    # gave a mean of 0.25 s on a slow machine (steps of ~0.5 s), this one leaves room
    assert metrics[2]["rollout/wait_time"] > 0.3
    log_dir = fsdp_straight / "lightning_logs" / "version_0"
    for name in ("trajectories.jsonl", "trajectories.rank1.jsonl"):
        rows = [json.loads(line) for line in (log_dir / name).read_text().splitlines()]
        assert {(r["step"], r["policy_version"]) for r in rows} == {(0, 0), (1, 0), (2, 1)}, name


def test_a_continued_fsdp_pipelined_run_matches_the_straight_run(fsdp_straight, tiny_model, tiny_data, tmp_path):
    """2 steps on 2 FSDP ranks, then ``--ckpt_path last`` to 3: every rank's completions in flight were saved
    (gathered into the checkpoint), so the third step trains on what the straight run trained on, on both ranks."""
    fsdp_run(tiny_model, tiny_data, tmp_path, 2)
    state = torch.load(tmp_path / "lightning_logs/version_0/checkpoints/last.ckpt/meta.pt", weights_only=True)
    by_rank = state["RolloutDataModule"]["pipeline"]["in_flight_by_rank"]
    assert [(r["step"], r["version"]) for r in by_rank] == [(2, 1), (2, 1)] and by_rank[0] != by_rank[1]
    fsdp_run(tiny_model, tiny_data, tmp_path, 3, "--ckpt_path=last")
    assert_same_run(fsdp_straight, tmp_path, 3)
    assert rank_trajectories(fsdp_straight) == rank_trajectories(tmp_path)


def test_a_second_run_of_the_process_adopts_the_first_runs_worker_and_logs_what_it_logged(
        tiny_model, small_data, tmp_path, one_thread):
    """Two pipelined runs through the Python API in one process (a sweep): the second takes over the generator
    process the first handed back, instead of starting one, and with the same seed logs the same metrics."""
    from rlflow.rollout import prestart

    prestart.stop_parked()  # none kept by an earlier test of this process
    pipelined_run(tiny_model, small_data, tmp_path / "first")
    kept = prestart._PARKED.get(1)  # data.pipeline.generator_threads: 1
    assert kept is not None and kept[0].is_alive()
    pipelined_run(tiny_model, small_data, tmp_path / "second")
    again = prestart._PARKED.get(1)
    assert again is not None and again[0] is kept[0]  # the same process served both runs, and is kept again
    prestart.stop_parked()
    assert_same_run(tmp_path / "first", tmp_path / "second", STEPS)
