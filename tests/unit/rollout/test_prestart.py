"""``rlflow fit`` starting a pipelined run's generator process before it imports Lightning
(``rlflow.rollout.prestart``): what it predicts from the command line, and the hand-over of the early worker.
"""

from __future__ import annotations

import pytest

from rlflow.rollout import prestart


@pytest.fixture
def config(tmp_path):
    def write(text: str):
        path = tmp_path / f"c{len(list(tmp_path.iterdir()))}.yaml"
        path.write_text(text)
        return str(path)

    return write


def test_predicts_the_staleness_and_threads_a_fit_command_sets(config):
    pipelined = config("model: {optim: {lr: 1.0e-4}}\n"
                       "data:\n  pipeline:\n    max_staleness: 1\n    generator_threads: 1\n")
    plain = config("data: {prompt_repeat_k: 8}\n")
    assert prestart.predict(["--config", pipelined]) == (1, 1)
    assert prestart.predict([f"--config={pipelined}", "--trainer.max_steps=3"]) == (1, 1)
    assert prestart.predict(["-c", plain]) is None  # the default: on-policy
    assert prestart.predict(
        ["--config", plain, "--data.pipeline.max_staleness", "2", "--data.pipeline.generator_threads=2"]
    ) == (2, 2)
    # the last word wins, as in jsonargparse: a later file or override
    assert prestart.predict(["--config", pipelined, "--data.pipeline.max_staleness=0"]) is None
    assert prestart.predict(["--config", pipelined, "--config", plain]) == (1, 1)  # plain leaves the key alone
    off = config("data: {pipeline: {max_staleness: 0}}\n")
    assert prestart.predict(["--config", pipelined, "--config", off]) is None
    # a flag without a value does not swallow the next option
    assert prestart.predict(["--print_config", "--config", pipelined]) == (1, 1)


def test_predicts_nothing_it_cannot_read_or_that_needs_no_process(config):
    assert prestart.predict(["--config", "/no/such/file.yaml", "--data.pipeline.max_staleness=1"]) is None
    assert prestart.predict(["--config", config("data: [unclosed\n")]) is None
    assert prestart.predict(["--data.pipeline.max_staleness=one"]) is None
    assert prestart.predict(["--data.pipeline.max_staleness=1", "--data.pipeline.generator_threads=0"]) is None
    # lmdeploy sends its requests from a thread: no generator process
    assert prestart.predict(["--data.pipeline.max_staleness=1", "--data.rollout=lmdeploy"]) is None
    lmdeploy = config("data:\n  pipeline: {max_staleness: 1}\n"
                      "  rollout: {class_path: rlflow.rollout.lmdeploy.LMDeployRollout}\n")
    assert prestart.predict(["--config", lmdeploy]) is None


def test_the_early_worker_is_handed_out_once_to_a_generator_with_its_threads():
    prestart.start(1)
    try:
        early = prestart.adopt(1)
        assert early is not None and early[0].is_alive()
        assert prestart.adopt(1) is None  # once
    finally:
        prestart.stop_worker(early[0], early[1])
    assert not early[0].is_alive()
    prestart.start(2)
    process = prestart._EARLY[0]
    assert prestart.adopt(1) is None  # other threads: stopped, the caller starts its own
    assert not process.is_alive()
    prestart.start(1)
    process = prestart._EARLY[0]
    prestart.discard()  # the parsed config does not pipeline
    assert not process.is_alive() and prestart._EARLY is None


def test_rlflow_fit_starts_the_worker_before_lightnings_cli(monkeypatch, config):
    import rlflow.cli
    from rlflow import entry

    calls = []
    monkeypatch.setattr(prestart, "start", lambda threads: calls.append(("start", threads)))
    monkeypatch.setattr(rlflow.cli, "main", lambda argv=None: calls.append(("cli", argv)) or 0)
    monkeypatch.setattr(prestart, "KEEP_WORKERS", True)
    pipelined = config("data: {pipeline: {max_staleness: 1, generator_threads: 1}}\n")
    assert entry.main(["fit", "--config", pipelined]) == 0
    assert calls == [("start", 1), ("cli", ["fit", "--config", pipelined])]
    assert prestart.KEEP_WORKERS is False  # the process ends with this run: its worker is not kept for another
    calls.clear()
    assert entry.main(["validate", "--config", pipelined]) == 0  # only fit trains
    assert calls == [("cli", ["validate", "--config", pipelined])]



def test_a_process_that_never_closes_its_generator_still_exits():
    """A run that fails or is refused before closing its generator leaves its worker waiting for jobs. Another
    process holding the job queue's ends (a process forked later) keeps the queue from closing, and the worker
    ignores SIGTERM, which is all multiprocessing's exit handler sends before waiting for it: the trainer's process
    still exits (its worker stopped at exit)."""
    import subprocess
    import sys

    from tests.helpers.paths import ROOT

    code = ("import os, time\n"
            "from rlflow.rollout.process import GeneratorProcess\n"
            "generator = GeneratorProcess(1)\n"
            "time.sleep(3)\n"
            "if os.fork() == 0:\n"
            "    time.sleep(30)\n"
            "    os._exit(0)\n"
            "del generator\n")
    # no pipes: the forked process and multiprocessing's resource tracker would hold them open after the exit
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, timeout=20)
    assert out.returncode == 0


@pytest.mark.parametrize("attached", [False, True])
def test_the_worker_freezes_the_heap_when_it_ends_told_to_or_failing(monkeypatch, tiny_model, attached):
    """Whether told to stop before anything was attached or ending on an error report, the worker freezes what
    is alive before its process exits (its last collection would walk every object torch created)."""
    import gc
    import queue

    import torch

    from rlflow.rollout.worker import worker_main

    jobs, results, frozen = queue.Queue(), queue.Queue(), []
    jobs.put(("attach", None, str(tiny_model), "no-such-backend") if attached else None)
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(True))
    threads = torch.get_num_threads()
    try:
        worker_main(1, jobs, results)
    finally:
        torch.set_num_threads(threads)
    assert frozen == [True]
    reported = [results.get_nowait() for _ in range(results.qsize())]
    assert [r[0] for r in reported] == (["error"] if attached else [])
