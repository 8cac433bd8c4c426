"""The generator process (``rlflow.rollout.process``): holding a job while the trainer has its cores.

:meth:`GeneratorProcess.pause` must stop an engine job between two decode iterations (the job does not finish
while paused) and must not change what it samples (the same tokens and log-probs as a job never paused); a
backend without a ``step_hook`` (``hf``) is not held.
"""

from __future__ import annotations

import time

import pytest

from rlflow.rollout.base import SamplingParams
from rlflow.rollout.process import GeneratorProcess, Job

pytestmark = pytest.mark.slow
PARAMS = SamplingParams(max_tokens=24, temperature=1.0)


@pytest.fixture(scope="module")
def policy(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer(text)["input_ids"] for text in ("1+2=", "30+4=", "7*8=")]


def generator(policy, tiny_model, spec: str) -> GeneratorProcess:
    gen = GeneratorProcess(threads=1)
    gen.attach(policy, str(tiny_model), spec)
    gen.wait_ready()
    return gen


def job(prompts, step: int = 0) -> Job:
    return Job(step=step, version=0, seed=123, prompts=prompts, params=PARAMS, n=4)


def test_a_paused_engine_job_waits_and_samples_what_an_unpaused_one_samples(policy, tiny_model, prompts):
    gen = generator(policy, tiny_model, "engine")
    try:
        gen.submit(job(prompts))
        straight = gen.collect(timeout=120)
        gen.pause()
        gen.submit(job(prompts, step=1))
        with pytest.raises(TimeoutError):  # held before its first decode iteration, not finished meanwhile
            gen.collect(timeout=2)
        gen.resume()
        held = gen.collect(timeout=120)
        # paused again in the middle of a job (somewhere between its iterations), released 0.5 s later
        gen.submit(job(prompts, step=2))
        time.sleep(0.002)
        gen.pause()
        time.sleep(0.5)
        gen.resume()
        interrupted = gen.collect(timeout=120)
    finally:
        gen.close()
    assert held.seconds >= 1.0 > straight.seconds  # the wait counts in the job's time: it really was held
    assert straight.num_tokens > 0
    for other in (held, interrupted):
        assert other.groups == straight.groups  # the same tokens, log-probs and finish reasons, bit for bit


def test_an_hf_job_is_not_held(policy, tiny_model, prompts):
    gen = generator(policy, tiny_model, "hf")
    try:
        gen.pause()
        gen.submit(job(prompts))
        result = gen.collect(timeout=120)  # hf has no step hook: pausing lends nothing and holds nothing
    finally:
        gen.close(keep=False)  # stopped, not kept for a next run
    assert result.num_tokens > 0
    assert not gen.process.is_alive()


def test_close_releases_a_paused_worker(policy, tiny_model, prompts):
    gen = generator(policy, tiny_model, "engine")
    gen.pause()
    gen.submit(job(prompts))
    start = time.perf_counter()
    gen.close()  # must not hang on the held job (nor wait out close's 5 s before terminating it)
    assert time.perf_counter() - start < 4.5
    assert not gen.process.is_alive() and gen.process.exitcode == 0  # it stopped when told to, not terminated


def test_a_generator_adopts_the_worker_rlflow_fit_started(policy, tiny_model, tokenizer, prompts, one_thread):
    from rlflow.rollout import prestart
    from rlflow.rollout.select import resolve_backend
    from rlflow.rollout.worker import plain_groups, run_job

    prestart.start(1)
    early = prestart._EARLY[0]
    gen = generator(policy, tiny_model, "engine")
    try:
        assert gen.process is early  # no second process
        result = gen.collect(timeout=120) if gen.submit(job(prompts)) is None else None
    finally:
        gen.close()
    here = run_job(job(prompts), resolve_backend("engine", policy, tokenizer))  # the same job in this process
    assert result.groups == here.groups and result.num_tokens > 0
    assert plain_groups(result.completions()) == result.groups
