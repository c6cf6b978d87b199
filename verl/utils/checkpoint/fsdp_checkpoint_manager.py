"""Save and restore the training state of an FSDP2 model: sharded weights, optimizer, LR scheduler and RNG.

Layout of one checkpoint directory (W = world size, r = rank; every rank writes its own three files):
    model_world_size_{W}_rank_{r}.pt        this rank's local shards of the model state dict
    optim_world_size_{W}_rank_{r}.pt        this rank's local shards of the optimizer state dict
    extra_state_world_size_{W}_rank_{r}.pt  LR scheduler state, torch/cuda/numpy/python RNG states, global_step
    huggingface/                            (save_hf=True, rank 0) full weights via save_pretrained + tokenizer;
                                            without save_hf but with a processing_class: config, generation
                                            config and tokenizer only (what `verl.model_merger` needs)

State dicts come from torch.distributed.checkpoint.state_dict (sharded options); DTensors are stored as their
local shards and rebuilt on load from the live model's placements, so a checkpoint loads back only with the
same world size. Every file is written under a temporary name and then os.replace'd. Weights holding NaN/inf
are never written: `save_checkpoint` checks every rank's shards first and, if any is non-finite, every rank
raises `NonFiniteWeightsError` before writing anything. No Ray code (layer 1).
"""

from __future__ import annotations

import copy
import os
import random
import shutil
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from verl.utils.checkpoint.errors import NonFiniteWeightsError
from verl.utils.fsdp_utils import get_full_state_dict

__all__ = ["FSDPCheckpointManager", "NonFiniteWeightsError"]

_SHARDED = StateDictOptions(full_state_dict=False)


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _first_nonfinite(state: dict[str, Any]) -> str | None:
    """Name of the first floating-point tensor of `state` holding a NaN or inf, else None."""
    for name, tensor in state.items():
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return name
    return None


def _any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is True on at least one (a collective when a process group exists)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    value = torch.tensor([float(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _atomic_save(obj: Any, path: str) -> None:
    tmp_path = f"{path}.tmp"
    torch.save(obj, tmp_path)
    os.replace(tmp_path, path)


def _to_local(obj: Any) -> Any:
    """Replace every DTensor in a nested dict/list by its local shard on CPU; plain tensors go to CPU too."""
    if isinstance(obj, DTensor):
        return obj.to_local().detach().cpu().clone()
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_local(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_local(v) for v in obj)
    return obj


def _from_local(saved: Any, template: Any, where: str) -> Any:
    """Rebuild DTensors from saved local shards, using the live state dict `template` for mesh and placements."""
    if isinstance(template, DTensor):
        local_shape = template.to_local().shape
        if not isinstance(saved, torch.Tensor) or saved.shape != local_shape:
            seen = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
            raise ValueError(
                f"checkpoint entry {where} has shape {seen}, the model expects local shape {tuple(local_shape)}"
            )
        local = saved.to(device=template.to_local().device, dtype=template.dtype)
        return DTensor.from_local(
            local, template.device_mesh, template.placements, shape=template.shape, stride=template.stride()
        )
    if isinstance(template, torch.Tensor) and isinstance(saved, torch.Tensor):
        return saved.to(template.device)
    if isinstance(saved, dict):
        template = template if isinstance(template, dict) else {}
        return {k: _from_local(v, template.get(k), f"{where}.{k}") for k, v in saved.items()}
    return saved


def _rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _hf_class(model: nn.Module) -> type:
    """The model's own class (FSDP2 wraps `Qwen2ForCausalLM` in a generated `FSDPQwen2ForCausalLM` subclass)."""
    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


class FSDPCheckpointManager:
    """Checkpoints of one rank's training state; every rank of the group calls save/load together.

    `model` is an FSDP2-sharded (or plain) HF model; `optimizer` and `lr_scheduler` may be None (not saved);
    `processing_class` (a tokenizer or processor) is saved next to the HF weights when `save_hf=True`.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        processing_class: Any = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.processing_class = processing_class

    @staticmethod
    def _paths(local_path: str, rank: int, world_size: int) -> dict[str, str]:
        suffix = f"world_size_{world_size}_rank_{rank}.pt"
        return {part: os.path.join(local_path, f"{part}_{suffix}") for part in ("model", "optim", "extra_state")}

    def save_checkpoint(self, local_path: str, global_step: int = 0, save_hf: bool = False) -> None:
        """Write this rank's model/optimizer/extra-state files into `local_path` (created if needed).

        With `save_hf`, all ranks gather the full weights and rank 0 writes `local_path/huggingface` in HF format.
        Raises NonFiniteWeightsError on every rank, before anything is written, when any rank's weights hold NaN/inf.
        """
        rank, world_size = _rank_and_world()
        model_state = _to_local(get_model_state_dict(self.model, options=_SHARDED))
        bad = _first_nonfinite(model_state)
        if _any_rank(bad is not None):
            where = f"rank {rank} tensor {bad!r}" if bad else "another rank's shards"
            raise NonFiniteWeightsError(
                f"refusing to save step {global_step} to {local_path!r}: the model weights hold NaN/inf ({where}); "
                "nothing was written"
            )
        os.makedirs(local_path, exist_ok=True)
        paths = self._paths(local_path, rank, world_size)
        _atomic_save(model_state, paths["model"])
        if self.optimizer is not None:
            optim_state = get_optimizer_state_dict(self.model, self.optimizer, options=_SHARDED)
            _atomic_save(_to_local(optim_state), paths["optim"])
        extra = {
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "rng": _rng_state(),
            "global_step": global_step,
        }
        _atomic_save(extra, paths["extra_state"])
        if save_hf:
            self._save_hf(os.path.join(local_path, "huggingface"), rank)
        elif rank == 0 and self.processing_class is not None and hasattr(self.model, "config"):
            self._save_hf_config(os.path.join(local_path, "huggingface"))
        _barrier()

    def save_hf_model(self, hf_path: str) -> None:
        """Only the HF model folder (config, weights, tokenizer) at `hf_path`, written by rank 0 after one gather of
        the weights (a collective: every rank calls it); replaces a folder already there only once complete."""
        rank, _ = _rank_and_world()
        self._save_hf(hf_path, rank)
        _barrier()

    def _save_hf_config(self, hf_path: str) -> None:
        """Config (with the model class in `architectures`), generation config and tokenizer; no weights."""
        config = copy.deepcopy(self.model.config)
        config.architectures = [_hf_class(self.model).__name__]
        tmp_path = f"{hf_path}.tmp"
        shutil.rmtree(tmp_path, ignore_errors=True)
        config.save_pretrained(tmp_path)
        if getattr(self.model, "generation_config", None) is not None:
            self.model.generation_config.save_pretrained(tmp_path)
        self.processing_class.save_pretrained(tmp_path)
        shutil.rmtree(hf_path, ignore_errors=True)
        os.replace(tmp_path, hf_path)

    def _save_hf(self, hf_path: str, rank: int) -> None:
        full_state = get_full_state_dict(self.model, cpu_offload=True)  # collective: every rank takes part
        if rank != 0:
            return
        if not hasattr(self.model, "config") or not hasattr(self.model, "save_pretrained"):
            raise ValueError(f"save_hf needs a HF PreTrainedModel, got {type(self.model).__name__}")
        with torch.device("meta"):
            hf_model = _hf_class(self.model)(self.model.config)
        hf_model.load_state_dict(full_state, assign=True, strict=True)
        hf_model.tie_weights()
        tmp_path = f"{hf_path}.tmp"
        shutil.rmtree(tmp_path, ignore_errors=True)
        hf_model.save_pretrained(tmp_path, state_dict=full_state)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(tmp_path)
        shutil.rmtree(hf_path, ignore_errors=True)
        os.replace(tmp_path, hf_path)

    def load_checkpoint(self, local_path: str) -> None:
        """Restore model, optimizer (if given), LR scheduler (if given) and RNG states saved by `save_checkpoint`.

        Raises FileNotFoundError naming the path when a file is missing or was written with another world size.
        """
        rank, world_size = _rank_and_world()
        paths = self._paths(local_path, rank, world_size)
        needed = ["model", "extra_state"] + (["optim"] if self.optimizer is not None else [])
        missing = [paths[p] for p in needed if not os.path.isfile(paths[p])]
        if missing:
            found = sorted(f for f in os.listdir(local_path) if f.endswith(".pt")) if os.path.isdir(local_path) else []
            raise FileNotFoundError(
                f"checkpoint at {local_path!r} lacks {missing} for world size {world_size}, rank {rank}; "
                f"files present: {found or 'none'} (a checkpoint loads only with the world size it was saved with)"
            )
        saved_model = torch.load(paths["model"], map_location="cpu", weights_only=True)
        live_model = get_model_state_dict(self.model, options=_SHARDED)
        extra_keys = sorted(set(saved_model) - set(live_model))
        missing_keys = sorted(set(live_model) - set(saved_model))
        if extra_keys or missing_keys:
            raise ValueError(
                f"checkpoint {paths['model']!r} does not match the model: missing {missing_keys}, unexpected {extra_keys}"
            )
        set_model_state_dict(self.model, _from_local(saved_model, live_model, "model"), options=_SHARDED)
        if self.optimizer is not None:
            saved_optim = torch.load(paths["optim"], map_location="cpu", weights_only=True)
            live_optim = get_optimizer_state_dict(self.model, self.optimizer, options=_SHARDED)
            set_optimizer_state_dict(
                self.model, self.optimizer, _from_local(saved_optim, live_optim, "optim"), options=_SHARDED
            )
        extra = torch.load(paths["extra_state"], map_location="cpu", weights_only=False)
        if self.lr_scheduler is not None:
            if extra["lr_scheduler"] is None:
                raise ValueError(f"checkpoint {paths['extra_state']!r} holds no lr_scheduler state")
            self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        _set_rng_state(extra["rng"])
        _barrier()
