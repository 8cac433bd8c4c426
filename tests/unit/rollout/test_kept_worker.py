"""A generator worker kept for the next run of the same process (``rlflow.rollout.prestart.park``/``unpark``).

A run that closes its :class:`GeneratorProcess` with the worker idle hands the worker back; the next generator
with as many threads adopts it instead of starting a process. The adopted worker must sample from the new run's
model (not the old one's), with the new run's environment, exactly as a fresh worker would; a worker nobody
adopts stops after ``PARK_SECONDS``; at most one is kept per thread count; a failed, busy or console-script run
keeps none.
"""

from __future__ import annotations

import copy
import os
import time

import pytest
import torch

from rlflow.rollout import prestart
from rlflow.rollout.base import SamplingParams
from rlflow.rollout.process import GeneratorProcess, Job

pytestmark = pytest.mark.slow
PARAMS = SamplingParams(max_tokens=16, temperature=1.0)


@pytest.fixture(autouse=True)
def nothing_kept_before_or_after():
    """No worker kept by another test of this process is adopted here, and none of these outlives the test."""
    prestart.stop_parked()
    yield
    prestart.stop_parked()


@pytest.fixture(scope="module")
def policy(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer(text)["input_ids"] for text in ("1+2=", "30+4=")]


def job(prompts) -> Job:
    return Job(step=0, version=0, seed=7, prompts=prompts, params=PARAMS, n=3)


def run(gen: GeneratorProcess, policy, tiny_model, prompts, spec="engine"):
    gen.attach(policy, str(tiny_model), spec)
    gen.wait_ready()
    gen.submit(job(prompts))
    return gen.collect(timeout=120)


def alive_within(process, seconds: float) -> bool:
    """Whether ``process`` is still alive after up to ``seconds`` of waiting for it to end (polled, not joined:
    the timer that stops a kept worker joins it from its own thread)."""
    deadline = time.monotonic() + seconds
    while process.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return process.exitcode is None


class EnvironmentWriter:
    """A rollout backend that, when bound, writes ``os.environ["RLFLOW_TEST_MARK"]`` into the file named by
    ``os.environ["RLFLOW_TEST_MARK_FILE"]``: what environment the worker binds it in."""

    def bind(self, model, tokenizer) -> None:
        path = os.environ.get("RLFLOW_TEST_MARK_FILE")
        if path:
            with open(path, "w") as f:
                f.write(os.environ.get("RLFLOW_TEST_MARK", ""))


class FailsToBind:
    def bind(self, model, tokenizer) -> None:
        raise RuntimeError("this backend cannot bind")


def test_the_next_run_adopts_the_worker_and_samples_its_own_model_as_a_fresh_worker_does(
        policy, tiny_model, tokenizer, prompts, tmp_path, monkeypatch, one_thread):
    from rlflow.rollout.select import resolve_backend
    from rlflow.rollout.worker import run_job

    first = GeneratorProcess(threads=1)
    before = run(first, policy, tiny_model, prompts)
    first.close()
    assert first.process.is_alive() and first.model is None  # kept, its copy of the first model let go of

    changed = copy.deepcopy(policy)  # the next run's model: other weights, other samples
    with torch.no_grad():
        changed.lm_head.weight.mul_(3.0)
    second = GeneratorProcess(threads=1)
    assert second.process is first.process and second.reused  # no new process
    after = run(second, changed, tiny_model, prompts)
    second.close(keep=False)
    assert not alive_within(second.process, 10)

    fresh = run_job(job(prompts), resolve_backend("engine", changed, tokenizer))  # the same job here, on 1 thread
    assert after.groups == fresh.groups and after.num_tokens > 0
    assert after.groups != before.groups  # the kept worker sampled the new model, not the one it had

    # a kept worker binds with the adopting run's environment
    mark = tmp_path / "mark"
    third = GeneratorProcess(threads=1)
    third.attach(policy, str(tiny_model), EnvironmentWriter)
    third.wait_ready()
    third.close()
    assert not mark.exists()
    monkeypatch.setenv("RLFLOW_TEST_MARK_FILE", str(mark))
    monkeypatch.setenv("RLFLOW_TEST_MARK", "set after the worker started")
    fourth = GeneratorProcess(threads=1)
    assert fourth.process is third.process
    fourth.attach(policy, str(tiny_model), EnvironmentWriter)
    fourth.wait_ready()
    fourth.close(keep=False)
    assert mark.read_text() == "set after the worker started"


def test_one_worker_is_kept_per_thread_count_and_only_for_its_wait(monkeypatch):
    monkeypatch.setattr(prestart, "PARK_SECONDS", 60.0)
    one, other, two = GeneratorProcess(threads=1), GeneratorProcess(threads=1), GeneratorProcess(threads=2)
    one.close()
    other.close()  # a second one with 1 thread: the one kept before is stopped
    two.close()
    assert not alive_within(one.process, 10)
    assert other.process.is_alive() and two.process.is_alive()
    adopted = GeneratorProcess(threads=2)
    assert adopted.process is two.process  # by thread count
    adopted.close(keep=False)

    monkeypatch.setattr(prestart, "PARK_SECONDS", 0.5)
    late = GeneratorProcess(threads=1)  # adopts `other`, which then waits only half a second for the next run
    assert late.process is other.process
    late.close()
    assert not alive_within(late.process, 10)  # nobody adopted it in time: stopped, not killed
    assert late.process.exitcode == 0
    assert prestart.unpark(1) is None


def test_a_failed_busy_or_console_run_keeps_no_worker(policy, tiny_model, prompts, monkeypatch):
    failed = GeneratorProcess(threads=1)
    failed.attach(policy, str(tiny_model), FailsToBind)
    with pytest.raises(RuntimeError, match="cannot bind"):
        failed.wait_ready()
    assert not alive_within(failed.process, 10) and prestart.unpark(1) is None

    busy = GeneratorProcess(threads=1)
    busy.attach(policy, str(tiny_model), "engine")
    busy.submit(job(prompts))  # closed with its job in flight
    busy.close()
    assert not alive_within(busy.process, 10) and prestart.unpark(1) is None

    monkeypatch.setattr(prestart, "KEEP_WORKERS", False)  # what the rlflow console script sets
    console = GeneratorProcess(threads=1)
    run(console, policy, tiny_model, prompts)
    start = time.perf_counter()
    console.close()
    assert not alive_within(console.process, 10) and console.process.exitcode == 0
    assert prestart.unpark(1) is None and time.perf_counter() - start < 10
