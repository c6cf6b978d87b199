"""`BaseCheckpointManager`: what every checkpoint manager shares (verl's class at verl's path).

Owns reading `checkpoint_config` (verl's `CheckpointConfig`: `save_contents` / `load_contents`, any of model,
optimizer, extra, hf_model, default the first three; `save_lora_only`), this process's rank and world size, the
LoRA-only test of a state dict, retention of saved folders (`max_ckpt_to_keep`) and the RNG states kept in the
extra state. The FSDP2 manager (`fsdp_checkpoint_manager.FSDPCheckpointManager`) does the I/O.
Layer 1: torch and numpy only; no Ray, no model code.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["BaseCheckpointManager"]

DEFAULT_CONTENTS = ("model", "optimizer", "extra")
LORA_MARKERS = ("lora_", ".adapter_")  # a state-dict key holding one of these is an adapter weight


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class BaseCheckpointManager:
    """Save and load, every rank together, a model's sharded state, its optimizer's, the LR scheduler's and the
    RNG states ("extra"). A subclass defines `save_checkpoint(local_path, hdfs_path=None, global_step=0,
    max_ckpt_to_keep=None)` and `load_checkpoint(local_path, hdfs_path=None, del_local_after_load=False)`.

    `checkpoint_config` is a mapping or an attribute object (DictConfig, dataclass) or None (verl's defaults).
    """

    def __init__(
        self,
        model: Any,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        processing_class: Any = None,
        checkpoint_config: Any = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.processing_class = processing_class
        self.checkpoint_config = checkpoint_config
        self.checkpoint_save_contents = self._contents("save_contents")
        self.checkpoint_load_contents = self._contents("load_contents")
        self.previous_saved_paths: list[str] = []
        self.rank, self.world_size = _rank_and_world()

    def _config_value(self, key: str, default: Any) -> Any:
        config = self.checkpoint_config
        if not config:
            return default
        if hasattr(config, "get"):  # a mapping, DictConfig or verl's CheckpointConfig
            return config.get(key, default)
        return getattr(config, key, default)

    def _contents(self, key: str) -> list[str]:
        value = self._config_value(key, None)
        return list(DEFAULT_CONTENTS if value is None else value)

    # ------------------------------------------------------------------ what to save and load
    @property
    def should_save_model(self) -> bool:
        return "model" in self.checkpoint_save_contents

    @property
    def should_save_optimizer(self) -> bool:
        return "optimizer" in self.checkpoint_save_contents

    @property
    def should_save_extra(self) -> bool:
        return "extra" in self.checkpoint_save_contents

    @property
    def should_save_hf_model(self) -> bool:
        """A full HF copy of the model in `<local_path>/huggingface` too."""
        return "hf_model" in self.checkpoint_save_contents

    @property
    def should_save_lora_only(self) -> bool:
        """`save_lora_only`: a model with LoRA adapters saves only the adapter weights."""
        return bool(self._config_value("save_lora_only", False))

    @property
    def should_load_model(self) -> bool:
        return "model" in self.checkpoint_load_contents

    @property
    def should_load_optimizer(self) -> bool:
        return "optimizer" in self.checkpoint_load_contents

    @property
    def should_load_extra(self) -> bool:
        return "extra" in self.checkpoint_load_contents

    @property
    def should_load_hf_model(self) -> bool:
        return "hf_model" in self.checkpoint_load_contents

    @staticmethod
    def is_lora_only_state_dict(state_dict: Mapping[str, Any] | None) -> bool:
        """True when every key of a non-empty state dict names an adapter weight (`lora_` or `.adapter_`)."""
        if not state_dict:
            return False
        return all(any(marker in key for marker in LORA_MARKERS) for key in state_dict)

    # ------------------------------------------------------------------ retention
    def register_checkpoint(self, new_path: str, max_ckpt_to_keep: int | None) -> None:
        """Remember a completely saved folder and delete the oldest ones beyond `max_ckpt_to_keep` (None or <= 0:
        keep all). Called by rank 0 after a save."""
        self.previous_saved_paths.append(new_path)
        if not max_ckpt_to_keep or max_ckpt_to_keep <= 0:
            return
        excess = len(self.previous_saved_paths) - max_ckpt_to_keep
        if excess > 0:
            for path in self.previous_saved_paths[:excess]:
                shutil.rmtree(os.path.abspath(path), ignore_errors=True)
            self.previous_saved_paths = self.previous_saved_paths[excess:]

    # ------------------------------------------------------------------ RNG ("extra")
    @staticmethod
    def get_rng_state() -> dict[str, Any]:
        """torch CPU, numpy and python RNG states, plus every CUDA device's when CUDA is available."""
        state = {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    @staticmethod
    def load_rng_state(state: Mapping[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])
        np.random.set_state(state["numpy"])
        random.setstate(state["python"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
