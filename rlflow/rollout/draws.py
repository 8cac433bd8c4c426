"""Counter-based random draws for the engine's sampler: a row's ``t``-th uniform is a pure function of (key, t).

Why: the engine samples each token by inverse-CDF from one uniform per row and step. Drawn from one generator for
the whole batch, the uniform a row gets depends on which rows share its batch and on the order in which they were
admitted; a multi-turn rollout that admits a trajectory's next turn as soon as its tools answer
(:mod:`rlflow.rollout.multiturn`) would then sample differently whenever the tools' timing differs. Here every
row carries a 64-bit *stream key* and a token counter ``t``, and its uniform is the ``t``-th output of the
splitmix64 generator (Steele, Lea and Flood, 2014) started at that key:

    z = key + (t + 1) * 0x9E3779B97F4A7C15;  z = mix64(z);  u = (z >> 11) * 2**-53   (in [0, 1))

with ``mix64`` the splitmix64 finaliser (two xor-shift-multiply rounds and a final xor-shift). Keys are hashes of
small integers (:func:`stream_key`): for a single-turn call ``(call key, prompt index, sample index)``, for a
multi-turn trajectory ``(call key, trajectory index)`` with ``t`` counting the trajectory's sampled tokens over all
its turns. The call key is ``(seed, number of seeded calls so far)`` for an engine with a seed (that counter is
its whole random state, checkpointed with the data module) and one draw from torch's global generator otherwise
(whose state Lightning's checkpoint already holds). The ``hf`` backend uses the same streams and keys
(:class:`CallKeys`, :class:`rlflow.rollout.hf.RowDrawsSampler`), so ``hf`` and the engine with one seed sample
the same tokens.

Simplifications: the arithmetic runs in NumPy's uint64 (wrap-around is defined there; torch's int64 shifts are
arithmetic and its overflow is not specified) on the host, one vector of ``rows`` per step, so a GPU decode step
copies ``rows`` float64 values to the device; splitmix64 is a statistically good generator (it passes BigCrush)
but not a cryptographic one, and different keys' streams are independent only in that statistical sense.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from rlflow.rollout.requests import DecodeRequest

MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment: 2**64 / golden ratio, odd
_C1, _C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_G, _M1, _M2 = np.uint64(GOLDEN), np.uint64(_C1), np.uint64(_C2)
_S30, _S27, _S31, _S11, _ONE = (np.uint64(s) for s in (30, 27, 31, 11, 1))


def mix64(x: int) -> int:
    """splitmix64's finaliser on a Python int (taken modulo 2**64)."""
    x &= MASK
    x = ((x ^ (x >> 30)) * _C1) & MASK
    x = ((x ^ (x >> 27)) * _C2) & MASK
    return x ^ (x >> 31)


def stream_key(*parts: int) -> int:
    """The 64-bit stream key of a tuple of integers (an order-sensitive hash: each part is mixed into the last)."""
    h = 0
    for p in parts:
        h = mix64(h + GOLDEN + (int(p) & MASK))
    return h


def _finalise(z: np.ndarray) -> np.ndarray:
    """splitmix64's output function on uint64 states, as uniforms in ``[0, 1)`` (NumPy's integer arrays wrap
    silently)."""
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    z ^= z >> _S31
    return (z >> _S11).astype(np.float64) * (2.0 ** -53)


def uniforms(keys: np.ndarray, t: np.ndarray) -> np.ndarray:
    """The ``t``-th uniform in ``[0, 1)`` of each stream ``keys`` (both uint64 arrays of one shape), float64."""
    return _finalise(keys + (t + _ONE) * _G)


def call_key(seed: int | None, calls: int) -> int:
    """The key of a sampling call: ``(seed, calls)`` hashed with a seed, else one draw from torch's global CPU
    generator (so ``torch.manual_seed`` and Lightning's checkpointed generator states fix it)."""
    if seed is not None:
        return stream_key(seed, calls)
    return int(torch.randint(0, 2 ** 62, (1,)).item())


def keyed_requests(prompts: list[list[int]], key: int, n: int, first: int = 0) -> list[DecodeRequest]:
    """One request of ``n`` rows per prompt, tagged with its index in ``prompts``; sample ``s`` of prompt ``i`` draws
    from the stream ``(key, first + i, s)``: prompts ``first, first + 1, ...`` of a call of key ``key``, so a share
    of a call decoded elsewhere (:mod:`rlflow.rollout.split`) samples what the whole call would."""
    return [DecodeRequest(p, [stream_key(key, first + i, s) for s in range(n)], tag=i) for i, p in enumerate(prompts)]


class CallKeys:
    """The call keys of a backend that samples with per-row draws (the ``engine`` and ``hf`` backends): ``seed``
    and ``calls``, the count of seeded calls, are its whole random state, which the data module checkpoints
    (``rng_state``) and evaluation isolates (:func:`isolated_draws`)."""

    seed: int | None = None
    calls: int = 0

    def next_call_key(self) -> int:
        """The key of a new sampling call (:func:`call_key`); counts the seeded calls."""
        key = call_key(self.seed, self.calls)
        if self.seed is not None:
            self.calls += 1
        return key

    def prompt_requests(self, prompts: list[list[int]], greedy: bool, n: int) -> list[DecodeRequest]:
        """One request of ``n`` rows per prompt (tagged with its index), sample ``s`` of prompt ``i`` drawing from the
        stream ``(call key, i, s)``; a greedy call uses no draws and leaves the random state where it is."""
        return keyed_requests(prompts, 0 if greedy else self.next_call_key(), n)

    def reseed(self, seed: int) -> None:
        """Restart a seeded backend's draws from ``seed``; without a seed the call keys keep coming from torch's
        global generator."""
        if self.seed is not None:
            self.seed, self.calls = seed, 0

    def rng_state(self) -> dict[str, Any]:
        return {"seed": self.seed, "calls": self.calls}

    def load_rng_state(self, state: dict[str, Any], force: bool = False) -> None:
        """Continue from :meth:`rng_state` ``state`` when the seed is the same (``force``: take it as it is)."""
        if force:
            self.seed, self.calls = state["seed"], int(state["calls"])
        elif self.seed is not None and state.get("seed") == self.seed:
            self.calls = int(state["calls"])


class RowDraws:
    """The random streams of a decode batch's rows, kept aligned with its rows (appended at admission, indexed at
    compaction, advanced every step). Each row holds splitmix64's state ``key + (t + 1) * GOLDEN`` for its next
    token ``t``, so a step costs one addition and the output function (:func:`uniforms` of the same keys and
    counters)."""

    def __init__(self) -> None:
        self.state = np.zeros(0, dtype=np.uint64)

    def __len__(self) -> int:
        return int(self.state.shape[0])

    def add(self, keys: list[int], starts: list[int]) -> None:
        """Rows with stream ``keys`` whose next token is number ``starts``."""
        new = np.array(keys, dtype=np.uint64) + (np.array(starts, dtype=np.uint64) + _ONE) * _G
        self.state = np.concatenate([self.state, new])

    def keep(self, rows: list[int]) -> None:
        self.state = self.state[rows]

    def take(self, rows: list[int]) -> np.ndarray:
        """The streams of ``rows`` where they are now, for another batch's :meth:`extend` (the rows keep theirs)."""
        return self.state[rows].copy()

    def extend(self, streams: np.ndarray) -> None:
        """Rows whose streams another batch's :meth:`take` handed over, where those streams were."""
        self.state = np.concatenate([self.state, streams])

    def draw(self, device: torch.device, start: int = 0) -> torch.Tensor:
        """The uniforms of rows ``start:`` for their current tokens (``[rows]`` float64 on ``device``); advances
        their streams."""
        u = torch.from_numpy(_finalise(self.state[start:]))
        self.state[start:] += _G
        return u.to(device) if u.device != device else u


@contextlib.contextmanager
def isolated_draws(backend: Any, seed: int) -> Iterator[None]:
    """Run a block (an evaluation) with a seeded engine's draws restarted from ``seed``, then continue the draws
    where they were, so evaluating never moves the training draws. Backends without a seeded engine's random state
    follow torch's global generator, which :func:`rlflow.training.evaluation.isolated_rng` isolates."""
    state = backend.rng_state() if hasattr(backend, "rng_state") else None
    if state is None or state.get("seed") is None:
        yield
        return
    backend.reseed(seed)
    try:
        yield
    finally:
        backend.load_rng_state(state, force=True)
