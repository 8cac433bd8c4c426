"""Prompt data, the sampler, experience and the replay buffer, and the ``RolloutDataModule`` that ties them."""

from rlflow.data.dataset import DataError, PromptRecord, check_row, read_jsonl
from rlflow.data.experience import Experience, collate
from rlflow.data.replay_buffer import ReplayBuffer
from rlflow.data.sampler import PromptBatchSampler

__all__ = [
    "DataError", "PromptRecord", "check_row", "read_jsonl", "Experience", "collate", "ReplayBuffer",
    "PromptBatchSampler", "RolloutDataModule",
]


def __getattr__(name: str):  # the datamodule imports lightning; load it only when asked for
    if name == "RolloutDataModule":
        from rlflow.data.datamodule import RolloutDataModule

        return RolloutDataModule
    raise AttributeError(name)
