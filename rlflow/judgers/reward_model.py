"""``reward_model``: a sequence-classification model scores prompt + completion, as TRL's model-id reward function.

Follows ``trl.GRPOTrainer``'s reward-model path: a conversational sample is rendered with the reward model's own
chat template (``apply_chat_template(prompt + completion)``, no generation prompt), a plain one is
``prompt + completion``; texts are tokenized with ``add_special_tokens=False`` and right padding, and the reward
is ``logits[:, 0]``, which the transformers head reads at the last non-pad token (so the model's
``pad_token_id`` is set to the tokenizer's, whose missing pad token becomes its EOS, as in TRL).

Usage::

    data:
      judgers:
        "*": [gsm8k, {class_path: reward_model, init_args: {model_path: Skywork/Skywork-Reward-V2-Qwen3-0.6B,
                                                             batch_size: 8, dtype: bfloat16}}]
      reward_weights: {reward_model: 0.5}

Building is cheap and checks the config (a missing local path, an unknown dtype or device, CUDA asked for but
absent, the model's ``num_labels`` from its ``config.json``); tokenizer and weights load on the first call
(or :meth:`RewardModelJudger.load`), so the first call's time, which ``data.judging.timeout`` covers, includes
loading. Differences from TRL: ``num_labels != 1`` is an error (TRL loads with ``num_labels=1``, so a checkpoint without
such a head would score with a random one), and ``max_length``
(off by default, as in TRL) drops tokens from the left, keeping the completion's end where the score is read.
Simplifications: ``device="auto"`` (and ``"cuda"``) is ``cuda:$LOCAL_RANK``, the training GPU under Lightning's
default device order (give ``cuda:<i>`` for a ``trainer.devices`` list), or the CPU without CUDA; calls are
serialised by a lock (one model, one batch at a time).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

from rlflow.judgers.base import Judger, completion_text

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RewardModelError(RuntimeError):
    """The reward model cannot be loaded or cannot score this data."""


def resolve_device(device: str, model: str = "") -> torch.device:
    """``auto``: the training GPU if CUDA is available, else the CPU; ``cuda`` without an index: the training GPU.

    The training GPU is ``cuda:$LOCAL_RANK``: the judger runs in its own thread, where CUDA's current device
    (per thread) is not the one Lightning set.
    """
    if device == "auto" and not torch.cuda.is_available():
        return torch.device("cpu")
    try:
        resolved = torch.device("cuda" if device == "auto" else device)
    except RuntimeError as exc:
        raise ValueError(f"reward model {model!r}: device must be 'auto', 'cpu', 'cuda' or 'cuda:<index>', "
                         f"got {device!r}") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise RewardModelError(f"reward model {model!r}: device {device!r} asks for CUDA, which is not available "
                               "here; use 'cpu' or 'auto'")
    if resolved.type == "cuda" and resolved.index is None:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return resolved


def missing_local_path(path: str) -> bool:
    """Whether ``path`` names a local directory that is not there (a hub id ``org/name`` is not a local path)."""
    if os.path.exists(os.path.expanduser(path)):
        return False
    return path.startswith((".", "/", "~")) or path.count("/") > 1


class RewardModelJudger(Judger):
    """Scores each prompt + completion with ``AutoModelForSequenceClassification`` (``num_labels == 1``).

    Args:
        model_path: Local directory or hub id of the reward model.
        tokenizer_path: Where its tokenizer (and chat template) is, if not beside the model.
        batch_size: Samples per forward pass.
        device: ``cpu``, ``cuda:1``..., ``cuda`` (the training GPU) or ``auto`` (the training GPU if any, else CPU).
        dtype: ``float32``, ``bfloat16``, ``float16``, or ``auto`` (bfloat16 on CUDA, float32 on CPU).
        max_length: Keep at most this many tokens per sample, dropped from the left (the prompt's start); None: all.
        name: Metric name (``rewards/<name>/mean``).
    """

    def __init__(
        self,
        model_path: str,
        tokenizer_path: str | None = None,
        batch_size: int = 8,
        device: str = "auto",
        dtype: str = "auto",
        max_length: int | None = None,
        name: str = "reward_model",
    ) -> None:
        self.model_path, self.tokenizer_path = str(model_path), str(tokenizer_path or model_path)
        for what, path in (("model", self.model_path), ("tokenizer", self.tokenizer_path)):
            if missing_local_path(path):
                raise FileNotFoundError(f"reward model: the {what} path {path!r} does not exist")
        if batch_size < 1 or (max_length is not None and max_length < 1):
            raise ValueError(f"reward model {self.model_path!r}: batch_size and max_length must be >= 1, "
                             f"got {batch_size} and {max_length}")
        if dtype != "auto" and dtype not in DTYPES:
            raise ValueError(f"reward model {self.model_path!r}: dtype must be 'auto' or one of {sorted(DTYPES)}, "
                             f"got {dtype!r}")
        self.device = resolve_device(device, self.model_path)
        self.dtype = DTYPES.get(dtype) or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.batch_size, self.max_length, self.name = batch_size, max_length, name
        self.check_config()
        self.model: Any = None
        self.tokenizer: Any = None
        self._lock = threading.Lock()

    def check_config(self) -> None:
        """Read the model's ``config.json`` (cheap) and refuse a head that is not a single score."""
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(self.model_path)
        except Exception as exc:
            raise RewardModelError(f"reward model {self.model_path!r}: cannot read its config: {exc}") from exc
        if config.num_labels != 1:
            raise RewardModelError(f"reward model {self.model_path!r} has num_labels={config.num_labels}; a reward "
                                   "model must output one score (a sequence-classification head with num_labels=1)")

    def __getstate__(self) -> dict[str, Any]:  # pickled without the weights and the lock: they reload lazily
        return {**self.__dict__, "model": None, "tokenizer": None, "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def load(self) -> None:
        """Load tokenizer and model now (done by the first call otherwise)."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if self.model is not None:
            return
        try:
            tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        except Exception as exc:
            raise RewardModelError(f"reward model {self.model_path!r}: cannot load its tokenizer from "
                                   f"{self.tokenizer_path!r}: {type(exc).__name__}: {exc}") from exc
        if tokenizer.pad_token_id is None:
            if tokenizer.eos_token is None:
                raise RewardModelError(f"reward model {self.model_path!r}: its tokenizer ({self.tokenizer_path!r}) "
                                       "has neither a pad nor an EOS token to pad batches with")
            tokenizer.pad_token = tokenizer.eos_token  # as TRL
        tokenizer.truncation_side = "left"
        try:
            model = AutoModelForSequenceClassification.from_pretrained(self.model_path, dtype=self.dtype)
        except Exception as exc:
            raise RewardModelError(f"reward model {self.model_path!r}: cannot load it as a sequence classifier: "
                                   f"{type(exc).__name__}: {exc}") from exc
        model.config.pad_token_id = tokenizer.pad_token_id  # the head scores the last token that is not this one
        self.tokenizer, self.model = tokenizer, model.to(self.device).eval()

    def texts(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[str]:
        """TRL's reward-model inputs: the chat template over prompt + completion messages, or prompt + completion."""
        out = []
        for prompt, completion in zip(prompts, completions):
            if isinstance(prompt, str):
                out.append(prompt + completion_text(completion))
                continue
            if not self.tokenizer.chat_template:
                raise RewardModelError(f"reward model {self.model_path!r}: the data is conversational but its "
                                       f"tokenizer ({self.tokenizer_path!r}) has no chat template")
            reply = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
            out.append(self.tokenizer.apply_chat_template(list(prompt) + list(reply), tokenize=False))
        return out

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any],
                 completion_ids: Sequence[Sequence[int]] | None = None, **columns: Any) -> list[float]:
        with self._lock, torch.inference_mode():
            self.load()
            texts = self.texts(prompts, completions)
            rewards: list[float] = []
            for start in range(0, len(texts), self.batch_size):
                batch = self.tokenizer(texts[start:start + self.batch_size], return_tensors="pt", padding=True,
                                       padding_side="right", add_special_tokens=False,
                                       truncation=self.max_length is not None, max_length=self.max_length)
                try:
                    logits = self.model(**batch.to(self.device)).logits
                except Exception as exc:  # e.g. a text longer than the model's positions, out of memory
                    raise RewardModelError(f"reward model {self.model_path!r}: scoring a batch of "
                                           f"{batch['input_ids'].shape[1]} tokens failed: {type(exc).__name__}: "
                                           f"{exc}") from exc
                rewards.extend(logits[:, 0].float().tolist())
            return rewards
