"""After an optimizer step a pipelined run's own backend is told the weights changed (evaluation and the batches the
pipeline generates in the trainer decode with it), except a server's, which a job of the pipeline's thread may be
using: that one is synced between jobs (:meth:`RolloutPipeline.sync_weights`)."""

from __future__ import annotations

from types import SimpleNamespace

from rlflow.data.datamodule import RolloutDataModule
from rlflow.rollout.base import RolloutBackend
from rlflow.rollout.pipeline import RolloutPipeline


class Counting(RolloutBackend):
    def __init__(self, reads_policy_weights: bool) -> None:
        self.reads_policy_weights = reads_policy_weights
        self.synced = 0

    def sync_weights(self) -> None:
        self.synced += 1


def test_the_trainers_backend_is_synced_after_every_update_pipelined_or_not():
    live, pipeline = Counting(True), RolloutPipeline(1)
    pipeline.backend = live  # as start() attaches it
    RolloutDataModule.sync_weights(SimpleNamespace(pipeline=pipeline, backend=live))
    RolloutDataModule.sync_weights(SimpleNamespace(pipeline=None, backend=live))
    assert live.synced == 2


def test_a_server_shared_with_the_pipelines_thread_is_not_synced_under_its_job():
    server, pipeline = Counting(False), RolloutPipeline(1)
    pipeline.backend = server
    RolloutDataModule.sync_weights(SimpleNamespace(pipeline=pipeline, backend=server))
    assert server.synced == 0  # ThreadGenerator.load_weights syncs it, between jobs
