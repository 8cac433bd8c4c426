"""Evaluation metrics: accuracy and pass@k over the eval set, overall and per ``data_source``.

As XTuner's evaluator does, every eval prompt is generated (greedily by default, or ``k`` samples at
``data.eval.temperature``), judged by the same judgers as training, and a completion counts as correct when its
reward reaches ``data.eval.pass_threshold``. Reported: ``eval/accuracy`` (the mean over all samples, i.e. the
unbiased pass@1), ``eval/pass@k`` (the unbiased estimator of Chen et al. 2021, "Evaluating Large Language Models
Trained on Code": ``1 - C(n - c, k) / C(n, k)`` per prompt with ``n`` samples of which ``c`` are correct; also
``eval/pass@j`` for the powers of two ``j`` below ``k``), ``eval/maj@k`` (self-consistency: the answer most of a
prompt's ``k`` samples state, right or wrong; over the prompts whose judger states answers, see
:func:`majority_correct`), ``eval/reward``, ``eval/mean_length``, and ``eval/<data_source>/<metric>`` for every
source; and ``eval/judger_failures``, the samples a judger failed on (raised, timed out: scored without it, so a
failing judger cannot pass for a drop in accuracy unseen).

Evaluation sampling runs under its own seed, on a forked RNG, so evaluating never changes the random stream of
training: a run with evaluation resumes exactly, and the same weights always get the same score.

Every rank evaluates the prompts its eval loader gives it; :class:`EvalMetrics` (a torchmetrics ``Metric``)
gathers the per-prompt counts of every rank before it computes, so the logged figures are the whole eval set's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of ``k`` samples drawn without replacement from ``n`` (``c`` correct) is
    correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):  # C(n-c, k) / C(n, k) as a running product, numerically stable
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def pass_ks(k: int) -> list[int]:
    """The ``j`` of the ``pass@j`` reported with ``k`` samples per prompt: the powers of two from 2 below ``k``, and
    ``k`` (as verl reports ``@2, @4, ..., @N``); none for ``k`` = 1 (``accuracy`` is pass@1)."""
    return [j for j in (2 ** e for e in range(1, k.bit_length())) if j < k] + ([k] if k > 1 else [])


def majority_correct(answers: list[str | None], correct: list[bool]) -> bool:
    """Whether the majority vote of one prompt's samples is right (self-consistency, Wang et al. 2022).

    ``answers[i]`` is the final answer sample ``i`` states (None: it states none), ``correct[i]`` whether that sample
    was judged correct. The vote goes to the answer stated most often (a tie to the one stated first); it is right
    when the first sample stating it was judged correct (samples with one answer are judged alike by an answer
    judger). No stated answer: wrong. Answers are compared as strings, as the judger states them.
    """
    if len(answers) != len(correct):
        raise ValueError(f"{len(answers)} answers for {len(correct)} samples")
    counts: dict[str, int] = {}
    for answer in answers:
        if answer is not None:
            counts[answer] = counts.get(answer, 0) + 1
    if not counts:
        return False
    voted = max(counts, key=counts.__getitem__)  # the first of the most stated: dicts keep insertion order
    return correct[answers.index(voted)]


@contextlib.contextmanager
def isolated_rng(seed: int) -> Iterator[None]:
    """Run a block with every torch generator seeded to ``seed``, then put the previous states back."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


#: Per-prompt states of :class:`EvalMetrics`: source index, samples, correct ones, reward sum, length sum, samples a
#: judger failed on, and whether its majority vote is right (1/0; NaN where its judgers state no answers).
STATES = ("source", "samples", "correct", "reward", "length", "failed", "majority")


class EvalMetrics(Metric):
    """The ``eval/*`` metrics as a torchmetrics ``Metric``: per-prompt counts, concatenated across ranks on compute.

    Each prompt adds its source, its number of samples ``n`` and correct samples ``c``, and the sums of its rewards
    and lengths; :meth:`compute` gathers every rank's prompts (torchmetrics' ``cat`` reduction), so the metrics are
    the whole eval set's, not one rank's.

    Args:
        k: Samples per prompt; pass@k is reported when it is above 1.
        sources: Every ``data_source`` the eval set holds (the same list on every rank); others count as ``unknown``.
    """

    full_state_update = False

    def __init__(self, k: int = 1, sources: list[str | None] | None = None) -> None:
        super().__init__()
        self.k = k
        self.sources = sorted({s or "unknown" for s in (sources or [])} | {"unknown"})
        for name in STATES:
            self.add_state(name, default=[], dist_reduce_fx="cat")

    def update(self, data_sources: list[str | None], correct: list[list[bool]], rewards: list[list[float]],
               lengths: list[list[int]], failed: list[list[bool]] | None = None,
               answers: list[list[str | None] | None] | None = None) -> None:
        """Add one batch: per prompt, its source and the correctness, reward and length of each of its samples,
        whether a judger failed on it (``failed``; None: none did) and the answer each states (``answers``, for
        ``maj@k``; None, for the batch or a prompt: its judgers state none)."""
        index = {name: i for i, name in enumerate(self.sources)}
        failed = failed if failed is not None else [[]] * len(correct)
        answers = answers if answers is not None else [None] * len(correct)
        for source, c, r, n, f, a in zip(data_sources, correct, rewards, lengths, failed, answers, strict=True):
            vote = float("nan") if a is None else float(majority_correct(a, c))
            self.majority.append(torch.tensor([vote], dtype=torch.float64))
            self.source.append(torch.tensor([index.get(source or "unknown", index["unknown"])]))
            self.samples.append(torch.tensor([len(c)], dtype=torch.float64))
            self.correct.append(torch.tensor([sum(c)], dtype=torch.float64))
            self.reward.append(torch.tensor([sum(r)], dtype=torch.float64))
            self.length.append(torch.tensor([sum(n)], dtype=torch.float64))
            self.failed.append(torch.tensor([sum(f)], dtype=torch.float64))

    def compute(self) -> dict[str, float]:
        """``eval/accuracy``, ``eval/pass@k``, ``eval/maj@k``, ``eval/reward``, ``eval/mean_length``, overall and per
        source, and ``eval/judger_failures``: the samples a judger failed on (scored without it, so possibly counted
        wrong)."""
        if len(self.samples) == 0:  # a list of batches, or one tensor once torchmetrics has synced the states
            return {}
        state = {name: dim_zero_cat(getattr(self, name)) for name in STATES}
        metrics = self._metrics(state, torch.ones_like(state["samples"], dtype=torch.bool), "eval")
        metrics["eval/judger_failures"] = state["failed"].sum().item()
        present = sorted(set(state["source"].tolist()))
        if len(present) > 1 or self.sources[present[0]] != "unknown":
            for i in present:
                metrics.update(self._metrics(state, state["source"] == i, f"eval/{self.sources[i]}"))
        return metrics

    def _metrics(self, state: dict[str, torch.Tensor], rows: torch.Tensor, prefix: str) -> dict[str, float]:
        n, c = state["samples"][rows], state["correct"][rows]
        total = n.sum().item()
        out = {
            f"{prefix}/accuracy": c.sum().item() / total,
            f"{prefix}/reward": state["reward"][rows].sum().item() / total,
            f"{prefix}/mean_length": state["length"][rows].sum().item() / total,
        }
        for j in pass_ks(self.k):
            per_prompt = [pass_at_k(int(a), int(b), j) for a, b in zip(n.tolist(), c.tolist())]
            out[f"{prefix}/pass@{j}"] = sum(per_prompt) / len(per_prompt)
        if self.k > 1:
            votes = state["majority"][rows]
            votes = votes[~votes.isnan()]
            if len(votes):  # over the prompts whose judgers state answers
                out[f"{prefix}/maj@{self.k}"] = votes.mean().item()
        return out


def eval_seed(seed: int, step: int, batch_idx: int) -> int:
    """The seed of one eval batch: fixed by the run seed, the training step and the batch."""
    return (seed * 1_000_003 + step * 10_007 + batch_idx) % (2**63 - 1)

