"""SIGTERM and SIGINT in the middle of a rollout step: a real ``rlflow fit`` finishes the step, saves a checkpoint,
exits with ``128 + signal`` (143, 130) and one line, and ``--ckpt_path last`` continues it into exactly the run
that was never interrupted. A second signal, or a step that does not end in time, stops at once without a
traceback; the checkpoint of the step before stays intact. The generator process ends with the trainer, quietly.

The checkpoints are every 5 steps (``--checkpoint.every_n_train_steps=5``), so the checkpoint at step 3 is the
signal's own, not a scheduled one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import lightning as L
import pytest
import torch

from rlflow.cli import cli_main, main
from tests.helpers.paths import ROOT
from tests.helpers.processes import rlflow_env
from tests.helpers.resume_helpers import assert_same_final_state, assert_same_run, run_args

pytestmark = pytest.mark.slow

EVERY_5 = "--checkpoint.every_n_train_steps=5"


class SignalMidStep(L.Callback):
    """Sends ``signum`` (a name) to this process, or with ``group`` to its whole process group as a terminal's
    Ctrl-C does (the generator process included), ``times`` times, in the rollout step after ``step`` finished
    ones: after its generation, before its optimizer step. ``sleep``: seconds the step then still takes."""

    def __init__(self, step: int = 2, signum: str = "SIGTERM", group: bool = False, times: int = 1,
                 sleep: float = 0.0) -> None:
        self.step, self.signum, self.group, self.times, self.sleep = step, signum, group, times, sleep
        self.sent = False

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step != self.step or self.sent:
            return
        self.sent = True
        number = getattr(signal, self.signum)
        for _ in range(self.times):
            if self.group:
                os.killpg(os.getpgid(0), number)
            else:
                os.kill(os.getpid(), number)
            time.sleep(0.05)  # let the handler run between two signals
        time.sleep(self.sleep)


def callback(**init_args) -> str:
    import json

    spec = {"class_path": "tests.integration.test_signals.SignalMidStep", "init_args": init_args}
    return f"--trainer.callbacks+={json.dumps(spec)}"


def run_rlflow(args: list[str], threads: int = 1) -> subprocess.CompletedProcess:
    env = rlflow_env(OMP_NUM_THREADS=str(threads))
    return subprocess.run([sys.executable, "-m", "rlflow", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=400, start_new_session=True)


@pytest.mark.parametrize(
    "signum, group, code, extra, threads",
    [
        ("SIGTERM", False, 143, [], 1),
        # Ctrl-C reaches the whole process group: the generator process of a split rollout gets it too
        ("SIGINT", True, 130, ["--data.pipeline.split_rollout=true"], 2),
        # a scheduler that signals every process of the job, while the generator's look-ahead job is in flight
        ("SIGTERM", True, 143, ["--data.pipeline.max_staleness=1"], 1),
    ],
    ids=["sigterm", "sigint-split-rollout", "sigterm-group-pipelined"],
)
def test_a_signal_mid_step_saves_at_the_step_boundary_and_resumes_exactly(
    signum, group, code, extra, threads, tiny_model, small_data, tmp_path
):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(threads)  # the same float reductions as the subprocess
    try:
        cli_main(run_args(tiny_model, small_data, straight, EVERY_5, *extra))

        proc = run_rlflow(run_args(tiny_model, small_data, stopped, EVERY_5, *extra,
                                   callback(step=2, signum=signum, group=group)), threads)
        assert proc.returncode == code, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        lines = [line for line in proc.stderr.splitlines() if line.startswith("rlflow: ")]
        assert len(lines) == 1 and f"stopped by {signum} after rollout step 3" in lines[0], proc.stderr[-3000:]
        last = stopped / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
        assert torch.load(last, weights_only=True, map_location="cpu")["global_step"] == 3  # the signal's save
        assert str(last) in lines[0]

        cli = cli_main(run_args(tiny_model, small_data, stopped, EVERY_5, *extra, "--ckpt_path=last"))
    finally:
        torch.set_num_threads(torch_threads)
    assert cli.trainer.global_step == 6
    assert_same_run(straight, stopped, 6)
    assert_same_final_state(straight, stopped, 6)


@pytest.mark.parametrize("how", ["second-signal", "timeout"])
def test_a_second_signal_or_a_step_that_does_not_end_in_time_stops_at_once(
    how, tiny_model, small_data, tmp_path, one_thread, monkeypatch, capsys
):
    """Stopping at the step boundary is bounded: a second signal stops the step at once, and so does
    ``RLFLOW_STOP_TIMEOUT`` seconds without reaching it; the checkpoint of the step before is intact."""
    monkeypatch.setenv("RLFLOW_STOP_TIMEOUT", "0.5")
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    slow = callback(step=1, times=2) if how == "second-signal" else callback(step=1, sleep=60.0)
    start = time.perf_counter()
    code = main(run_args(tiny_model, small_data, tmp_path, slow, steps=4))
    seconds = time.perf_counter() - start
    err = capsys.readouterr().err
    assert code == 143 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("rlflow: ")]
    assert len(lines) == 1 and "stopped by SIGTERM in rollout step 2" in lines[0], err
    assert seconds < 50  # not the 60 s the step would have taken
    last = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 1  # step 1's, untouched
    assert not list(last.parent.glob(".partial-*"))
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers  # put back


class CtrlCWhileStarting(L.Callback):
    """A Ctrl-C while the run is still being set up (before GracefulStop's handlers are installed)."""

    def setup(self, trainer, pl_module, stage) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.0)  # the KeyboardInterrupt arrives here


def test_ctrl_c_before_training_starts_is_an_interrupt_not_an_error(tiny_model, small_data, tmp_path, capsys):
    # an rlflow process starts with Python's own Ctrl-C handler; a test worker may have been left with another
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        spec = '--trainer.callbacks+={"class_path": "tests.integration.test_signals.CtrlCWhileStarting"}'
        code = main(run_args(tiny_model, small_data, tmp_path, spec, steps=2))
        err = capsys.readouterr().err
        assert code == 130, err
        lines = [line for line in err.splitlines() if line.startswith("rlflow: ")]
        assert lines == ["rlflow: stopped by SIGINT outside a rollout step (exit code 130)"], err
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C works again in this process
    finally:
        signal.signal(signal.SIGINT, outer)
