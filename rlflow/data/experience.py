"""Experience: one judged completion ready to train on, and the collation of many into tensors.

Sequences are laid out as TRL lays them out: the prompt left-padded to the longest prompt, then the
completion right-padded to the longest completion, so that the logits of one slice line up with every
completion token. Position ids are counted over real tokens only, as ``generate`` counts them.

A multi-turn experience's completion holds tool/environment tokens between the model's turns; its
``sampled_mask`` marks the sampled ones, and ``completion_mask`` (what every loss, log-prob statistic and KL
reads) is True on those only, while ``token_mask`` covers every real completion token (what the packed forward
computes log-probs for).
"""

from __future__ import annotations

import array
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Experience:
    """One completion with everything the loss needs; ``policy_version`` stamps the weights that sampled it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    rollout_logprobs: list[float]
    reward: float
    advantage: float
    group: int
    finish_reason: str
    policy_version: int
    data_source: str | None = None
    old_logprobs: list[float] | None = None
    ref_logprobs: list[float] | None = None
    info: dict[str, Any] = field(default_factory=dict)
    # the prompt's images (paths or bytes; rlflow.models.vision re-processes them)
    images: list[str | bytes] | None = None
    sampled_mask: list[bool] | None = None
    token_versions: list[int] | None = None  # partial rollouts: the version that sampled each token (oldest: above)

    @property
    def num_sampled(self) -> int:
        """Completion tokens the model sampled (all of them unless multi-turn)."""
        return len(self.completion_ids) if self.sampled_mask is None else sum(self.sampled_mask)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@dataclass
class RolloutStep:
    """One rollout step's outcome: the experiences put in the replay buffer, the step's rollout metrics, and one
    plain row per sample (what ``trajectories.jsonl`` and the W&B samples table show)."""

    experiences: list[Experience]
    metrics: dict[str, float]
    samples: list[dict[str, Any]]


_ARRAY_CODES = {torch.long: "q", torch.float32: "f", torch.float64: "d", torch.bool: "b"}


def flat_tensor(values: list[Any], dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor of ``values`` (Python numbers) through a typed :mod:`array`: a few times faster than
    ``torch.tensor`` on a list, which matters for the ten-thousand-element index lists a pack's collation builds."""
    code = _ARRAY_CODES.get(dtype)
    if code is None or not values:
        return torch.tensor(values, dtype=dtype)
    out = torch.frombuffer(array.array(code, values), dtype=torch.int8 if dtype is torch.bool else dtype)
    return out.bool() if dtype is torch.bool else out


def completion_tensors(experiences: list[Experience], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """The per-sequence tensors every collate returns: ``completion_ids`` (right-padded with ``pad_id``),
    ``completion_mask`` (sampled tokens only, see the module docstring), ``token_mask`` (every completion token) and
    ``rollout_logprobs``/``old_logprobs``/``ref_logprobs`` (0 where absent) of shape
    ``[sequences, max(longest completion, 1)]``, and ``advantages``/``truncated`` of shape ``[sequences]``."""
    c_width = max(max(len(e.completion_ids) for e in experiences), 1)
    lengths = [len(e.completion_ids) for e in experiences]

    def padded(values: list[Any], fill: Any, dtype: torch.dtype) -> torch.Tensor:
        # one tensor from one flat list (a tensor per row costs more than the data at these sizes); an absent
        # value list ([]) is all fill
        flat: list[Any] = []
        for v, c in zip(values, lengths):
            if not len(v):
                flat.extend([fill] * c_width)
                continue
            if len(v) < c:
                raise ValueError(f"a per-token list has {len(v)} values for a completion of {c} tokens")
            flat.extend(v[:c])
            flat.extend([fill] * (c_width - c))
        return flat_tensor(flat, dtype).view(len(values), c_width)

    token_mask = torch.arange(c_width)[None, :] < flat_tensor(lengths, torch.long)[:, None]
    sampled = [e.sampled_mask for e in experiences]
    completion_mask = token_mask.clone() if all(m is None for m in sampled) else padded(
        [[True] * c if m is None else m for m, c in zip(sampled, lengths)], False, torch.bool)
    floats = torch.get_default_dtype()
    return {
        "completion_ids": padded([e.completion_ids for e in experiences], pad_id, torch.long),
        "completion_mask": completion_mask,
        "token_mask": token_mask,
        "rollout_logprobs": padded([e.rollout_logprobs for e in experiences], 0.0, floats),
        "old_logprobs": padded([[] if e.old_logprobs is None else e.old_logprobs for e in experiences], 0.0, floats),
        "ref_logprobs": padded([[] if e.ref_logprobs is None else e.ref_logprobs for e in experiences], 0.0, floats),
        "advantages": torch.tensor([e.advantage for e in experiences], dtype=torch.float32),
        "truncated": torch.tensor([e.truncated for e in experiences]),
    }


def collate(experiences: list[Experience], pad_id: int) -> dict[str, torch.Tensor]:
    """Stack experiences into left-padded ``input_ids``, ``attention_mask`` and ``position_ids``
    ``[sequences, prompt_width + completion_width]`` plus :func:`completion_tensors` (whose ``completion_ids``,
    padded with ``pad_id``, equal the completion part of ``input_ids``); ``logits_to_keep`` is the completion
    width."""
    p_width = max(len(e.prompt_ids) for e in experiences)
    c_width = max(max(len(e.completion_ids) for e in experiences), 1)
    b = len(experiences)
    input_ids = torch.full((b, p_width + c_width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((b, p_width + c_width), dtype=torch.long)
    for i, e in enumerate(experiences):
        p, c = len(e.prompt_ids), len(e.completion_ids)
        input_ids[i, p_width - p: p_width] = torch.tensor(e.prompt_ids, dtype=torch.long)
        input_ids[i, p_width: p_width + c] = torch.tensor(e.completion_ids, dtype=torch.long)
        attention_mask[i, p_width - p: p_width + c] = 1
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        **completion_tensors(experiences, pad_id),
    }
