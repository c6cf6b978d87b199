"""Tests for verl.utils.checkpoint.FSDPCheckpointManager: exact restore of model, optimizer, scheduler and RNG."""

import os
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from tests.multirank import run_ranks
from verl.models.tiny import random_qwen2
from verl.utils.checkpoint import FSDPCheckpointManager
from verl.utils.fsdp_utils import (
    apply_fsdp2,
    build_lr_scheduler,
    build_optimizer,
    destroy_distributed,
    free_port,
    get_full_state_dict,
    init_distributed,
    load_causal_lm,
)

OPTIM_CFG = {"lr": 1e-2, "eps": 1e-6, "lr_warmup_steps": 1, "warmup_style": "cosine", "min_lr_ratio": 0.1}


def tiny_qwen2(seed: int = 0, tie: bool = False, layers: int = 2) -> Qwen2ForCausalLM:
    return random_qwen2(seed, num_hidden_layers=layers, tie_word_embeddings=tie)


def build_training(tie: bool = False):
    """An FSDP2 tiny Qwen2 with AdamW and a warmup + cosine schedule over 10 steps."""
    model = apply_fsdp2(tiny_qwen2(seed=0, tie=tie))
    optimizer = build_optimizer(model, OPTIM_CFG)
    return model, optimizer, build_lr_scheduler(optimizer, OPTIM_CFG, total_training_steps=10)


def train_step(model, optimizer, scheduler, seed: int) -> None:
    ids = torch.randint(0, 100, (4, 8), generator=torch.Generator().manual_seed(seed))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ids = ids.chunk(world_size)[rank]
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


def rng_draws() -> tuple:
    return torch.rand(3), np.random.rand(3), random.random()


def snapshot(model, optimizer, scheduler) -> dict:
    """Everything a restore must bring back, as full (unsharded) CPU tensors."""
    optim_state = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    return {
        "model": get_full_state_dict(model),
        "optim": {name: {k: v.clone() for k, v in s.items()} for name, s in optim_state["state"].items()},
        "scheduler": scheduler.state_dict(),
        "lr": optimizer.param_groups[0]["lr"],
    }


def assert_snapshots_equal(got: dict, want: dict) -> None:
    assert set(got["model"]) == set(want["model"])
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name
    assert set(got["optim"]) == set(want["optim"])
    for name, state in want["optim"].items():
        assert set(got["optim"][name]) == set(state) == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in state.items():
            assert torch.equal(got["optim"][name][key].cpu(), value.cpu()), f"{name}.{key}"
    assert got["scheduler"] == want["scheduler"]
    assert got["lr"] == want["lr"]


def assert_draws_equal(got: tuple, want: tuple) -> None:
    assert torch.equal(got[0], want[0]) and np.array_equal(got[1], want[1]) and got[2] == want[2]


def save_perturb_load_check(ckpt_dir: str) -> None:
    """Train 2 steps, save, train on, reload: state, RNG and the next training step must equal the saved run's."""
    model, optimizer, scheduler = build_training()
    manager = FSDPCheckpointManager(model, optimizer, scheduler)
    train_step(model, optimizer, scheduler, seed=0)
    train_step(model, optimizer, scheduler, seed=1)
    torch.manual_seed(7)
    np.random.seed(7)
    random.seed(7)
    manager.save_checkpoint(ckpt_dir, global_step=2)
    saved = snapshot(model, optimizer, scheduler)
    draws_after_save = rng_draws()
    train_step(model, optimizer, scheduler, seed=2)
    after_one_more_step = snapshot(model, optimizer, scheduler)

    train_step(model, optimizer, scheduler, seed=3)  # perturb everything
    rng_draws()
    assert not torch.equal(
        snapshot(model, optimizer, scheduler)["model"]["lm_head.weight"], saved["model"]["lm_head.weight"]
    )
    manager.load_checkpoint(ckpt_dir)
    assert_snapshots_equal(snapshot(model, optimizer, scheduler), saved)
    assert_draws_equal(rng_draws(), draws_after_save)
    train_step(model, optimizer, scheduler, seed=2)  # resuming continues the saved run exactly
    assert_snapshots_equal(snapshot(model, optimizer, scheduler), after_one_more_step)


def test_save_writes_per_rank_files_and_no_temporaries(tmp_path, process_group):
    model, optimizer, scheduler = build_training()
    FSDPCheckpointManager(model, optimizer, scheduler).save_checkpoint(str(tmp_path / "ckpt"), global_step=3)
    assert sorted(os.listdir(tmp_path / "ckpt")) == [
        "extra_state_world_size_1_rank_0.pt",
        "model_world_size_1_rank_0.pt",
        "optim_world_size_1_rank_0.pt",
    ]
    extra = torch.load(tmp_path / "ckpt" / "extra_state_world_size_1_rank_0.pt", weights_only=False)
    assert extra["global_step"] == 3 and extra["lr_scheduler"]["last_epoch"] == 0
    assert set(extra["rng"]) >= {"cpu", "numpy", "python"}


def test_one_rank_save_perturb_load_restores_everything(tmp_path, process_group):
    save_perturb_load_check(str(tmp_path / "ckpt"))


def test_load_errors_name_the_path_and_world_size(tmp_path, process_group):
    model, optimizer, scheduler = build_training()
    manager = FSDPCheckpointManager(model, optimizer, scheduler)
    empty = tmp_path / "empty"
    with pytest.raises(FileNotFoundError, match=f"{empty}.*world size 1.*files present: none"):
        manager.load_checkpoint(str(empty))
    ckpt = tmp_path / "ckpt"
    manager.save_checkpoint(str(ckpt))
    for name in os.listdir(ckpt):  # pretend it was written by 2 ranks
        os.rename(ckpt / name, ckpt / name.replace("world_size_1", "world_size_2"))
    with pytest.raises(
        FileNotFoundError, match=r"world size 1.*model_world_size_2_rank_0\.pt.*only with the world size"
    ):
        manager.load_checkpoint(str(ckpt))


def test_load_rejects_checkpoint_of_another_model(tmp_path, process_group):
    small, _, _ = build_training()
    FSDPCheckpointManager(small).save_checkpoint(str(tmp_path / "ckpt"))
    other = apply_fsdp2(tiny_qwen2(layers=3))
    with pytest.raises(ValueError, match=r"missing \['model.layers.2"):
        FSDPCheckpointManager(other).load_checkpoint(str(tmp_path / "ckpt"))


def make_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"<unk>": 0, "<pad>": 1, "hello": 2, "world": 3}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>")


def test_save_hf_writes_loadable_model_and_tokenizer(tmp_path, process_group):
    model, optimizer, scheduler = build_training(tie=True)
    train_step(model, optimizer, scheduler, seed=0)
    manager = FSDPCheckpointManager(model, optimizer, scheduler, processing_class=make_tokenizer())
    manager.save_checkpoint(str(tmp_path / "ckpt"), save_hf=True)
    hf_dir = tmp_path / "ckpt" / "huggingface"
    assert not os.path.exists(str(hf_dir) + ".tmp")
    reloaded = load_causal_lm(str(hf_dir))
    assert reloaded.config.architectures == ["Qwen2ForCausalLM"]
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    full = get_full_state_dict(model)
    assert all(torch.equal(v, full[k]) for k, v in reloaded.state_dict().items())
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(hf_dir))
    assert tokenizer("hello world")["input_ids"] == [2, 3]
    # saving again over an existing huggingface/ directory replaces it
    manager.save_checkpoint(str(tmp_path / "ckpt"), save_hf=True)
    assert os.path.isfile(hf_dir / "config.json")


def _two_rank_checkpoint_worker(rank: int, world_size: int, port: int, ckpt_dir: str) -> None:
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )
    torch.set_num_threads(1)
    init_distributed("gloo")
    save_perturb_load_check(ckpt_dir)
    destroy_distributed()


@pytest.mark.slow  # 2 ranks forked from the preloaded fork server (tests/multirank.py)
def test_two_ranks_save_perturb_load_restores_everything(tmp_path):
    ckpt_dir = str(tmp_path / "ckpt")
    run_ranks(_two_rank_checkpoint_worker, 2, free_port(), ckpt_dir)
    assert sorted(f for f in os.listdir(ckpt_dir) if f.startswith("model_")) == [
        "model_world_size_2_rank_0.pt",
        "model_world_size_2_rank_1.pt",
    ]
    shards = [torch.load(os.path.join(ckpt_dir, f"model_world_size_2_rank_{r}.pt")) for r in range(2)]
    gate = [s["model.layers.0.mlp.gate_proj.weight"].shape[0] for s in shards]
    assert gate == [23, 22]  # 45 rows sharded unevenly, stored as local shards
