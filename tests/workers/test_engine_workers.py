"""`verl.workers.engine_workers.ActorRolloutRefWorker.update_weights`: the naive backend syncs in place; another
backend sends the actor's gathered weights through the worker's checkpoint engine with the step they belong to."""

from __future__ import annotations

import asyncio

import pytest
from omegaconf import OmegaConf

from verl.workers import fsdp_workers
from verl.workers.engine_workers import ActorRolloutRefWorker


class _Engine:
    def get_per_tensor_param(self):
        return iter([("a", 1), ("b", 2)]), None


class _RecordingCheckpointEngine:
    def __init__(self):
        self.calls = []

    async def send_weights(self, weights, global_steps=None):
        self.calls.append((list(weights), global_steps))
        return {"sent": len(self.calls[-1][0])}


def _worker(backend: str) -> ActorRolloutRefWorker:
    worker = ActorRolloutRefWorker.__new__(ActorRolloutRefWorker)  # no processes: only the method is exercised
    worker.config = OmegaConf.create({"rollout": {"checkpoint_engine": {"backend": backend}}})
    worker.actor = type("Actor", (), {"engine": _Engine()})()
    worker.synced = 0
    worker._sync_rollout_weights = lambda: setattr(worker, "synced", worker.synced + 1)
    return worker


def test_the_import_path_of_verl_is_the_project_worker():
    assert issubclass(ActorRolloutRefWorker, fsdp_workers.ActorRolloutRefWorker)


def test_naive_backend_syncs_in_place():
    worker = _worker("naive")
    assert asyncio.run(worker.update_weights(global_steps=3)) == {}
    assert worker.synced == 1


def test_another_backend_sends_weights_with_the_step():
    worker = _worker("naive")
    worker.checkpoint_engine = _RecordingCheckpointEngine()
    assert asyncio.run(worker.update_weights(global_steps=17, mode="nccl")) == {"sent": 2}
    assert worker.checkpoint_engine.calls == [([("a", 1), ("b", 2)], 17)] and worker.synced == 0


def test_another_backend_without_an_engine_is_refused():
    with pytest.raises(ValueError, match="backend 'nccl' needs a checkpoint engine"):
        asyncio.run(_worker("nccl").update_weights(global_steps=1))
