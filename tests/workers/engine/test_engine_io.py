"""An engine built from a model folder (`initialize`), its saves and loads read back, and its weight updates to an
inference engine (colocated stream, HF folder on disk), on the tiny Qwen2 of the test session."""

import os

import pytest
import torch

from verl.workers.engine import (
    EngineRegistry,
    FinetuneSpec,
    FSDPEngine,
    FSDPEngineWithLMHead,
    FSDPEngineWithValueHead,
    SaveLoadMeta,
    WeightUpdateMeta,
)
from verl.workers.rollout.inference_engine import build_inference_engine

pytestmark = pytest.mark.usefixtures("own_process_group")  # tests/conftest.py


def full_params(module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in module.named_parameters():
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = value.detach().clone()
    return out


def trained_engine(path: str, steps: int = 2) -> FSDPEngine:
    """An engine that took `steps` AdamW steps on a fixed batch (so weights and optimizer state are not the start's)."""
    engine = FSDPEngine(model_config={"path": path}, optimizer_config={"lr": 1e-2})
    engine.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=2))
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    data = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    for _ in range(steps):
        engine.train_batch(data, lambda logits, mb: logits.logsumexp(-1).mean(), lambda mb: 1.0)
        engine.step_lr_scheduler()
    return engine


def test_initialize_builds_model_optimizer_and_schedule_from_a_folder(tiny_model_dir):
    engine = trained_engine(tiny_model_dir)
    assert engine.lr_scheduler.last_epoch == 2 and engine.get_data_parallel_size() == 1
    assert "exp_avg" in engine.optimizer.state[next(iter(engine.module.parameters()))]
    assert EngineRegistry.get_engine_cls("language_model", "fsdp2", "cpu") is FSDPEngineWithLMHead
    assert EngineRegistry.get_engine_cls("value_model", "fsdp", "cpu") is FSDPEngineWithValueHead
    with pytest.raises(ValueError, match="unknown engine backend 'megatron'"):
        EngineRegistry.get_engine_cls("language_model", "megatron")
    with pytest.raises(ValueError, match="needs model_config.path"):
        FSDPEngine(model_config={}).initialize()
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        FSDPEngine(model_config={"path": tiny_model_dir}).initialize(addr="10.0.0.1:1234")


def test_save_and_load_hf_and_sharded_with_optimizer(tiny_model_dir, tmp_path):
    engine = trained_engine(tiny_model_dir)
    engine.save(SaveLoadMeta(path=str(tmp_path / "hf"), weight_format="hf", tokenizer=None))
    engine.save(SaveLoadMeta(path=str(tmp_path / "dcp"), weight_format="dcp", with_optim=True))
    assert os.path.isfile(tmp_path / "hf" / "config.json")
    assert any(f.endswith(".safetensors") for f in os.listdir(tmp_path / "hf"))

    fresh = FSDPEngine(model_config={"path": tiny_model_dir}, optimizer_config={"lr": 1e-2})
    fresh.initialize()
    fresh.load(SaveLoadMeta(path=str(tmp_path / "hf"), weight_format="hf"))
    expected = full_params(engine.module)
    got = full_params(fresh.module)
    assert all(torch.equal(got[k], expected[k]) for k in expected)

    resumed = FSDPEngine(model_config={"path": tiny_model_dir}, optimizer_config={"lr": 1e-2})
    resumed.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=2))
    resumed.load(SaveLoadMeta(path=str(tmp_path / "dcp"), weight_format="dcp", with_optim=True))
    got = full_params(resumed.module)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert resumed.lr_scheduler.last_epoch == 2
    first = next(iter(engine.module.parameters()))
    resumed_first = next(iter(resumed.module.parameters()))
    torch.testing.assert_close(
        resumed.optimizer.state[resumed_first]["exp_avg"], engine.optimizer.state[first]["exp_avg"]
    )
    with pytest.raises(ValueError, match="with_optim=True needs weight_format='dcp'"):
        SaveLoadMeta(path="x", weight_format="hf", with_optim=True)
    with pytest.raises(ValueError, match="weight_format='safetensors'"):
        SaveLoadMeta(path="x", weight_format="safetensors")


def test_weight_updates_reach_the_inference_engine_colocated_and_through_disk(tiny_model_dir, tmp_path):
    engine = trained_engine(tiny_model_dir)
    expected = full_params(engine.module)

    colocated = build_inference_engine(tiny_model_dir, {"response_length": 4})
    meta = WeightUpdateMeta.from_colocated(colocated)
    future = colocated.update_weights(meta)
    engine.upload_weights(meta)
    future.result()
    got = dict(colocated.rollout.module.named_parameters())
    assert all(torch.equal(got[k].detach(), expected[k]) for k in expected)

    remote = build_inference_engine(tiny_model_dir, {"response_length": 4})
    meta = WeightUpdateMeta.from_disk(str(tmp_path / "weights"))
    future = remote.update_weights(meta)  # AReaL-lite's order: the engine asks first, the trainer writes
    engine.upload_weights(meta)
    assert future.result() is None
    got = dict(remote.rollout.module.named_parameters())
    assert all(torch.equal(got[k].detach(), expected[k]) for k in expected)
    remote.set_version(5)
    assert remote.get_version() == 5
    with pytest.raises(ValueError, match="needs path"):
        WeightUpdateMeta(type="disk")
    with pytest.raises(ValueError, match="allowed: colocated, disk"):
        WeightUpdateMeta(type="nccl")
    with pytest.raises(KeyError, match="unknown rollout keys \\['response_len'\\]"):
        build_inference_engine(tiny_model_dir, {"response_len": 4})
