"""verl.utils.checkpoint.checkpoint_manager.BaseCheckpointManager as the FSDP2 manager uses it: what is saved and
loaded (`save_contents` / `load_contents` from a DictConfig), retention (`max_ckpt_to_keep`), and a LoRA-only
checkpoint (`save_lora_only`) of a real peft model sharded with FSDP2: only the adapters are written, and loading
them sets the adapters and leaves the base weights alone."""

import os

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from verl.models.tiny import random_qwen2
from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager
from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
from verl.utils.fsdp_utils import apply_fsdp2, get_full_state_dict
from verl.workers.lora import apply_lora


def test_contents_come_from_the_config_and_default_to_verls():
    default = BaseCheckpointManager(nn.Linear(1, 1))
    assert default.checkpoint_save_contents == default.checkpoint_load_contents == ["model", "optimizer", "extra"]
    assert not default.should_save_hf_model and not default.should_save_lora_only
    config = OmegaConf.create(
        {"save_contents": ["model", "hf_model"], "load_contents": ["model"], "save_lora_only": True}
    )
    manager = BaseCheckpointManager(nn.Linear(1, 1), checkpoint_config=config)
    assert manager.should_save_hf_model and not manager.should_save_optimizer and not manager.should_save_extra
    assert manager.should_load_model and not manager.should_load_extra and manager.should_save_lora_only


def test_only_the_named_contents_are_written_and_read(tmp_path):
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    only_model = {"save_contents": ["model"], "load_contents": ["model"]}
    FSDPCheckpointManager(model, optimizer, checkpoint_config=only_model).save_checkpoint(str(tmp_path / "c"))
    assert sorted(os.listdir(tmp_path / "c")) == ["model_world_size_1_rank_0.pt"]
    fresh = nn.Linear(3, 2)
    FSDPCheckpointManager(
        fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), checkpoint_config=only_model
    ).load_checkpoint(str(tmp_path / "c"))
    assert torch.equal(fresh.weight, model.weight)
    with pytest.raises(FileNotFoundError, match="lacks .*optim_world_size_1_rank_0.pt"):
        FSDPCheckpointManager(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1)).load_checkpoint(str(tmp_path / "c"))


def test_max_ckpt_to_keep_removes_the_oldest_saved_folders(tmp_path):
    manager = FSDPCheckpointManager(nn.Linear(1, 1))
    for step in range(1, 4):
        manager.save_checkpoint(str(tmp_path / f"global_step_{step}"), global_step=step, max_ckpt_to_keep=2)
    assert sorted(os.listdir(tmp_path)) == ["global_step_2", "global_step_3"]


def lora_model(adapter_shift: float, base_scale: float = 1.0):
    model = apply_fsdp2(apply_lora(random_qwen2(0, num_hidden_layers=1), {"lora_rank": 2, "lora_alpha": 4}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.add_(adapter_shift) if "lora_" in name else param.mul_(base_scale)
    return model


def test_lora_only_checkpoint_of_an_fsdp2_peft_model(tmp_path, process_group):
    config = {"save_lora_only": True, "save_contents": ["model"], "load_contents": ["model"]}
    trained = lora_model(adapter_shift=0.5)
    FSDPCheckpointManager(trained, checkpoint_config=config).save_checkpoint(str(tmp_path / "lora"))
    saved = torch.load(tmp_path / "lora" / "model_world_size_1_rank_0.pt", weights_only=True)
    adapters = [name for name, _ in trained.named_parameters() if "lora_" in name]
    assert sorted(saved) == sorted(adapters) and BaseCheckpointManager.is_lora_only_state_dict(saved)

    other = lora_model(adapter_shift=-1.0, base_scale=2.0)
    base_before = {k: v for k, v in get_full_state_dict(other).items() if "lora_" not in k}
    FSDPCheckpointManager(other, checkpoint_config=config).load_checkpoint(str(tmp_path / "lora"))
    got, want = get_full_state_dict(other), get_full_state_dict(trained)
    for name in got:
        assert torch.equal(got[name], want[name] if "lora_" in name else base_before[name]), name
