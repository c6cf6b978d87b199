"""Save and restore the training state of an FSDP2 model: sharded weights, optimizer, LR scheduler and RNG.

Layout of one checkpoint directory (W = world size, r = rank; every rank writes its own files):
    model_world_size_{W}_rank_{r}.pt        this rank's local shards of the model state dict ("model")
    optim_world_size_{W}_rank_{r}.pt        this rank's local shards of the optimizer state dict ("optimizer")
    extra_state_world_size_{W}_rank_{r}.pt  LR scheduler state, torch/cuda/numpy/python RNG states, global_step ("extra")
    huggingface/                            ("hf_model" or save_hf=True, rank 0) full weights via save_pretrained +
                                            tokenizer; otherwise, with a processing_class: config, generation
                                            config and tokenizer only (what `verl.model_merger` needs)

What is written and read follows `checkpoint_config.save_contents` / `load_contents` (verl's, see
`checkpoint_manager.BaseCheckpointManager`); with `save_lora_only` a model with LoRA adapters (a `peft_config`)
saves only its `lora_` / `.adapter_` weights, and loading such a file sets only those, leaving the base weights as
they are. State dicts are the model's own (`model.state_dict()`: DTensors under FSDP2); DTensors are stored as their
local shards and rebuilt on load from the live model's placements, so a checkpoint loads back only with the same
world size. Every file is written under a temporary name and then os.replace'd. Weights holding NaN/inf are never
written: `save_checkpoint` checks every rank's shards first and, if any is non-finite, every rank raises
`NonFiniteWeightsError` before writing anything. No Ray code (layer 1).
"""

from __future__ import annotations

import copy
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from verl.utils.checkpoint.checkpoint_manager import LORA_MARKERS, BaseCheckpointManager
from verl.utils.checkpoint.errors import NonFiniteWeightsError
from verl.utils.fsdp_utils import get_full_state_dict

__all__ = ["FSDPCheckpointManager", "NonFiniteWeightsError"]

_SHARDED = StateDictOptions(full_state_dict=False)


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


def _hf_class(model: nn.Module) -> type:
    """The model's own class (FSDP2 wraps `Qwen2ForCausalLM` in a generated `FSDPQwen2ForCausalLM` subclass)."""
    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


class FSDPCheckpointManager(BaseCheckpointManager):
    """Checkpoints of one rank's training state; every rank of the group calls save/load together.

    `model` is an FSDP2-sharded (or plain) HF model; `optimizer` and `lr_scheduler` may be None (not saved);
    `processing_class` (a tokenizer or processor) is saved next to the HF weights; `checkpoint_config` as in
    `BaseCheckpointManager` (None: model, optimizer and extra state).
    """

    def _has_lora(self) -> bool:
        """Whether the model carries peft adapters (a `peft_config`)."""
        return hasattr(getattr(self.model, "_fsdp_wrapped_module", self.model), "peft_config")

    @staticmethod
    def _paths(local_path: str, rank: int, world_size: int) -> dict[str, str]:
        suffix = f"world_size_{world_size}_rank_{rank}.pt"
        return {part: os.path.join(local_path, f"{part}_{suffix}") for part in ("model", "optim", "extra_state")}

    def _model_state(self) -> dict[str, Any]:
        """This rank's model state to save, on CPU: every entry, or the adapter weights only (`save_lora_only`)."""
        state = self.model.state_dict()
        if self.should_save_lora_only and self._has_lora():
            total = len(state)
            state = {k: v for k, v in state.items() if any(marker in k for marker in LORA_MARKERS)}
            if not state:
                raise ValueError(
                    f"save_lora_only=True and the model has a peft_config, but none of its {total} state-dict keys "
                    f"is an adapter weight (holding one of {list(LORA_MARKERS)})"
                )
        return _to_local(state)

    def save_checkpoint(
        self,
        local_path: str | None,
        hdfs_path: str | None = None,
        global_step: int = 0,
        max_ckpt_to_keep: int | None = None,
        save_hf: bool = False,
    ) -> None:
        """Write this rank's files of `save_contents` into `local_path` (created if needed; None: nothing).

        With `save_hf` or "hf_model" in save_contents, all ranks gather the full weights and rank 0 writes
        `local_path/huggingface` in HF format. With `max_ckpt_to_keep`, rank 0 then deletes the oldest folders this
        manager saved beyond that many. `hdfs_path` is unused, as in verl. Raises NonFiniteWeightsError on every
        rank, before anything is written, when any rank's weights hold NaN/inf.
        """
        if local_path is None:
            return
        rank, world_size = self.rank, self.world_size
        model_state = self._model_state() if self.should_save_model else {}
        bad = _first_nonfinite(model_state)
        if _any_rank(bad is not None):
            where = f"rank {rank} tensor {bad!r}" if bad else "another rank's shards"
            raise NonFiniteWeightsError(
                f"refusing to save step {global_step} to {local_path!r}: the model weights hold NaN/inf ({where}); "
                "nothing was written"
            )
        os.makedirs(local_path, exist_ok=True)
        paths = self._paths(local_path, rank, world_size)
        if self.should_save_model:
            _atomic_save(model_state, paths["model"])
        del model_state
        if self.should_save_optimizer and self.optimizer is not None:
            optim_state = get_optimizer_state_dict(self.model, self.optimizer, options=_SHARDED)
            _atomic_save(_to_local(optim_state), paths["optim"])
        if self.should_save_extra:
            extra = {
                "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
                "rng": self.get_rng_state(),
                "global_step": global_step,
            }
            _atomic_save(extra, paths["extra_state"])
        if save_hf or self.should_save_hf_model:
            self._save_hf(os.path.join(local_path, "huggingface"), rank)
        elif rank == 0 and self.processing_class is not None and hasattr(self.model, "config"):
            self._save_hf_config(os.path.join(local_path, "huggingface"))
        _barrier()
        if rank == 0:
            self.register_checkpoint(local_path, max_ckpt_to_keep)

    def save_hf_model(self, hf_path: str) -> None:
        """Only the HF model folder (config, weights, tokenizer) at `hf_path`, written by rank 0 after one gather of
        the weights (a collective: every rank calls it); replaces a folder already there only once complete."""
        self._save_hf(hf_path, self.rank)
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

    def load_checkpoint(
        self, local_path: str | None, hdfs_path: str | None = None, del_local_after_load: bool = False
    ) -> None:
        """Restore what `load_contents` names (model; optimizer if given; LR scheduler if given and RNG states from
        the extra state) from files `save_checkpoint` wrote (None: nothing). A LoRA-only model file sets the adapter
        weights only. `hdfs_path` and `del_local_after_load` concern remote copies, which this manager never makes
        (unused, as for a local path in verl).

        Raises FileNotFoundError naming the path when a file is missing or was written with another world size.
        """
        if local_path is None:
            return
        rank, world_size = self.rank, self.world_size
        paths = self._paths(local_path, rank, world_size)
        wanted = {
            "model": self.should_load_model,
            "optim": self.should_load_optimizer and self.optimizer is not None,
            "extra_state": self.should_load_extra,
        }
        missing = [paths[part] for part, want in wanted.items() if want and not os.path.isfile(paths[part])]
        if missing:
            found = sorted(f for f in os.listdir(local_path) if f.endswith(".pt")) if os.path.isdir(local_path) else []
            raise FileNotFoundError(
                f"checkpoint at {local_path!r} lacks {missing} for world size {world_size}, rank {rank}; "
                f"files present: {found or 'none'} (a checkpoint loads only with the world size it was saved with)"
            )
        if wanted["model"]:
            self._load_model(paths["model"])
        if wanted["optim"]:
            saved_optim = torch.load(paths["optim"], map_location="cpu", weights_only=True)
            live_optim = get_optimizer_state_dict(self.model, self.optimizer, options=_SHARDED)
            set_optimizer_state_dict(
                self.model, self.optimizer, _from_local(saved_optim, live_optim, "optim"), options=_SHARDED
            )
        if wanted["extra_state"]:
            extra = torch.load(paths["extra_state"], map_location="cpu", weights_only=False)
            if self.lr_scheduler is not None:
                if extra["lr_scheduler"] is None:
                    raise ValueError(f"checkpoint {paths['extra_state']!r} holds no lr_scheduler state")
                self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
            self.load_rng_state(extra["rng"])
        _barrier()

    def _load_model(self, path: str) -> None:
        """Set the model's state from one rank's model file: every entry, or (a LoRA-only file) the adapters only."""
        saved = torch.load(path, map_location="cpu", weights_only=True)
        live = self.model.state_dict()
        lora_only = self.is_lora_only_state_dict(saved)
        unexpected = sorted(set(saved) - set(live))
        missing = [] if lora_only else sorted(set(live) - set(saved))
        if unexpected or missing:
            hint = " (a LoRA-only checkpoint: the model needs the same adapters)" if lora_only else ""
            raise ValueError(
                f"checkpoint {path!r} does not match the model: missing {missing}, unexpected {unexpected}{hint}"
            )
        self.model.load_state_dict(_from_local(saved, live, "model"), strict=not lora_only)
