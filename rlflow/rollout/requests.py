"""What the engine's decode loop admits: sampling requests, and the sources it takes them from while it decodes.

Why a source and not a list: a multi-turn rollout (:mod:`rlflow.rollout.multiturn`) only knows a trajectory's next
prompt once that trajectory's tools have answered, which happens while the other trajectories are still being
decoded. :meth:`EngineRollout.serve <rlflow.rollout.engine.EngineRollout.serve>` therefore asks its
:class:`RequestSource` for new requests between decode steps, admits them as soon as there is room, and blocks on
the source only when it has nothing left to decode. A request names its rows' random streams
(:mod:`rlflow.rollout.draws`), so what a row samples does not depend on when it was admitted or on its neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class DecodeRequest:
    """``len(keys)`` completions of ``ids`` (they share the prompt's prefill and cache), row ``s`` sampling from
    the random stream ``keys[s]`` starting at counter ``start``, at most ``max_tokens`` tokens (None: the call's
    ``SamplingParams.max_tokens``, which bounds it); ``tag`` is handed back with the completions."""

    ids: list[int]
    keys: list[int]
    start: int = 0
    max_tokens: int | None = None
    tag: Any = None

    @property
    def n(self) -> int:
        return len(self.keys)

    def limit(self, cap: int) -> int:
        """Most tokens a row of this request samples in a call capped at ``cap`` (``SamplingParams.max_tokens``)."""
        return cap if self.max_tokens is None else min(self.max_tokens, cap)


class RequestSource(Protocol):
    """Where :meth:`EngineRollout.serve <rlflow.rollout.engine.EngineRollout.serve>` takes its requests from."""

    def poll(self, wait: bool) -> list[DecodeRequest] | None:
        """The requests that arrived since the last poll (may be empty unless ``wait``; with ``wait`` block until
        there is at least one), or None once no request will come any more. Called on the decoding thread."""


class ListSource:
    """A fixed list of requests: all of them on the first poll, then None (a plain rollout call)."""

    def __init__(self, requests: list[DecodeRequest]) -> None:
        self.requests: list[DecodeRequest] | None = list(requests)

    def poll(self, wait: bool) -> list[DecodeRequest] | None:
        requests, self.requests = self.requests, None
        return requests


def check_call(prompts: list[list[int]], n: int) -> None:
    """A sampling call's arguments: ``n`` completions per prompt (at least 1), every prompt at least one token."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
