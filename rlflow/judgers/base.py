"""The judger contract: TRL's reward-function signature.

A judger is any callable ``fn(prompts, completions, completion_ids, **columns) -> list[float | None]``:
``prompts`` and ``completions`` are chat message lists when the dataset is conversational (TRL's layout:
``completions[i] == [{"role": "assistant", "content": text}]``) and plain strings otherwise; ``columns`` holds
every dataset column (``ground_truth``, ``data_source``, ``extra_info``, ...) as one list entry per sample. A
``None`` reward means "not applicable" and is skipped when several judgers are summed. Every call also gets
TRL's ``trainer_state``, ``log_extra(column, values)`` and ``log_metric(name, value)`` keywords
(:mod:`rlflow.judgers.context`); a judger without ``**kwargs`` gets only the keywords its signature names. So a
reward function written for ``trl.GRPOTrainer`` is a judger as it is; :class:`Judger` is a convenience base class
(its :meth:`~Judger.score` sees each sample's columns, not those keywords), and the type
of ``data.judging.judgers`` entries: a judger *class* configured with ``class_path``/``init_args`` must subclass it (so
jsonargparse can validate its arguments); a function, or any callable, is named by its import path as a string.

A judger may be ``async def`` (several run concurrently) or plain (run in a thread, so it may block). Optional
extras the runner honours: a ``name`` attribute (the metric key, else the function's ``__name__`` as in TRL);
a constructor argument ``max_tokens`` (filled from ``data.sampling.max_tokens`` when the config does not set it);
and, for
judgers that fail per sample rather than per call, a ``consume_failed()`` method returning the positions (in its
last call) of the samples it gave ``None`` because of an error: counted in ``judger/failures`` and named on
those samples in ``trajectories.jsonl`` (``judgers_failed``). A ``consume_failures()`` method returning only how
many is counted, not marked per sample. An ``answer(completion: str) -> str | None`` method (the final answer a
completion states, as a string; None when it states none) lets evaluation report ``eval/maj@k``, the majority
vote over a prompt's samples (``gsm8k`` and ``math`` have one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def completion_text(completion: Any) -> str:
    """The text of one completion, whether it is a plain string or TRL's ``[{"role", "content"}]`` list."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    raise TypeError(f"a completion must be a string or a list of chat messages, got {type(completion).__name__}")


class Judger:
    """Base class for judgers that score one sample at a time.

    Subclasses implement :meth:`score`; ``__call__`` maps it over the batch with TRL's keyword contract.
    ``name`` is the key of the per-judger metrics (``rewards/<name>/mean``).
    """

    name: str = "judger"
    #: Dataset columns this judger cannot work without (checked before training by the data tools).
    required_columns: tuple[str, ...] = ()

    def score(self, completion: str, **sample: Any) -> float | None:
        raise NotImplementedError

    def __call__(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]] | None = None,
        **columns: Sequence[Any],
    ) -> list[float | None]:
        out: list[float | None] = []
        for i, completion in enumerate(completions):
            sample = {key: values[i] for key, values in columns.items() if isinstance(values, (list, tuple))}
            if completion_ids is not None:
                sample["completion_ids"] = completion_ids[i]
            out.append(self.score(completion_text(completion), **sample))
        return out
