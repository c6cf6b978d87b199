"""verl.checkpoint_engine.base: the backend registry, the colocated (`naive`) engine and the rollout side's
`CheckpointEngineWorker`, built from a rollout config and loading into a verl-style async server adapter or into
one of this project's engines (a plain `update_weights(stream)`)."""

import asyncio
import sys

import pytest
import torch
from omegaconf import OmegaConf

from verl.checkpoint_engine import (
    CheckpointEngine,
    CheckpointEngineRegistry,
    CheckpointEngineWorker,
    ColocatedCheckpointEngine,
)


class SyncEngine:
    """Stands for this project's rollout engines: `update_weights(stream)`."""

    def __init__(self):
        self.loaded = None

    def update_weights(self, weights):
        self.loaded = [(name, tensor.clone()) for name, tensor in weights]


def rollout_config(**checkpoint_engine):
    section = {"backend": "naive", "update_weights_bucket_megabytes": 3, "engine_kwargs": {}, **checkpoint_engine}
    return OmegaConf.create({"name": "hf", "checkpoint_engine": section})


def test_registry_builds_naive_and_names_the_known_backends():
    engine = CheckpointEngineRegistry.new("naive", bucket_size=1024)
    assert isinstance(engine, ColocatedCheckpointEngine) and engine.bucket_size == 1024
    assert CheckpointEngineRegistry.get("naive") is ColocatedCheckpointEngine
    with pytest.raises(ValueError, match=r"unknown checkpoint engine 'nccl' .*allowed: \[.*'naive'"):
        CheckpointEngineRegistry.get("nccl")


def test_colocated_engine_hands_the_stream_over_once():
    engine = ColocatedCheckpointEngine(bucket_size=1)
    weights = [("a", torch.ones(2)), ("b", torch.zeros(1))]
    engine.send_weights(iter(weights), global_steps=3)
    assert list(engine.receive_weights(global_steps=3)) == weights
    with pytest.raises(RuntimeError, match="before send_weights"):
        list(engine.receive_weights())
    with pytest.raises(NotImplementedError, match="no transport"):
        engine.prepare()


def test_worker_loads_received_weights_into_a_sync_engine(clean_env):
    engine = SyncEngine()
    worker = CheckpointEngineWorker(rollout_config(), model_config=None, server_adapter=engine)
    assert isinstance(worker.checkpoint_engine, ColocatedCheckpointEngine)
    assert worker.checkpoint_engine.bucket_size == 3 << 20  # update_weights_bucket_megabytes
    weights = [("w", torch.arange(3.0))]
    worker.checkpoint_engine.send_weights(iter(weights))
    asyncio.run(worker.update_weights(global_steps=5))
    assert [name for name, _ in engine.loaded] == ["w"] and torch.equal(engine.loaded[0][1], weights[0][1])


def test_worker_refuses_an_async_stream_for_a_sync_engine(clean_env):
    worker = CheckpointEngineWorker(rollout_config(), model_config=None, server_adapter=SyncEngine())

    async def pairs():
        yield "w", torch.ones(1)

    worker.checkpoint_engine.receive_weights = lambda global_steps=None: pairs()
    with pytest.raises(TypeError, match="SyncEngine loads weights from a sync stream"):
        asyncio.run(worker.update_weights())


def test_worker_needs_an_engine_to_load_into(clean_env):
    with pytest.raises(ValueError, match="needs the rollout engine to load into"):
        CheckpointEngineWorker(rollout_config(), model_config=None)


def test_worker_builds_a_plugin_backend_with_its_engine_kwargs(clean_env, tmp_path, monkeypatch):
    (tmp_path / "my_ckpt_backend.py").write_text(
        "from verl.checkpoint_engine import ColocatedCheckpointEngine, CheckpointEngineRegistry\n"
        "@CheckpointEngineRegistry.register('plugin_test')\n"
        "class Plugin(ColocatedCheckpointEngine):\n"
        "    def __init__(self, bucket_size, flavour):\n"
        "        super().__init__(bucket_size)\n"
        "        self.flavour = flavour\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_ckpt_backend", raising=False)
    config = rollout_config(
        backend="plugin_test", custom_backend_module="my_ckpt_backend", engine_kwargs={"plugin_test": {"flavour": 7}}
    )
    worker = CheckpointEngineWorker(config, model_config=None, server_adapter=SyncEngine())
    assert type(worker.checkpoint_engine).__name__ == "Plugin" and worker.checkpoint_engine.flavour == 7
    assert issubclass(CheckpointEngineRegistry.get("plugin_test"), CheckpointEngine)
