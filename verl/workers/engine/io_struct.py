"""The small records a hand-written RL loop passes to the engines (AReaL-lite's names).

- `FinetuneSpec`: how long training runs (epochs x dataset size / batch size), for the LR schedule;
- `SaveLoadMeta`: where and how `engine.save(meta)` / `engine.load(meta)` write and read a model;
- `WeightUpdateMeta`: how new weights travel from a training engine to an inference engine
  (`actor.upload_weights(meta)`, `rollout.update_weights(meta)`): `colocated` streams them from the FSDP2 shards
  straight into an engine in the same process (no file, no full-model gather), `disk` goes through an HF folder
  (for an inference engine elsewhere).

Layer 1-like: dataclasses only, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["FinetuneSpec", "SaveLoadMeta", "WeightUpdateMeta"]


@dataclass(frozen=True)
class FinetuneSpec:
    """Length of a training run: `total_train_steps` = epochs x ceil(dataset_size / train_batch_size)."""

    total_train_epochs: int
    dataset_size: int
    train_batch_size: int

    def __post_init__(self) -> None:
        for name in ("total_train_epochs", "dataset_size", "train_batch_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"FinetuneSpec.{name} must be a positive int, got {getattr(self, name)!r}")

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.dataset_size / self.train_batch_size)

    @property
    def total_train_steps(self) -> int:
        return self.total_train_epochs * self.steps_per_epoch


_WEIGHT_FORMATS = ("hf", "dcp")


@dataclass(frozen=True)
class SaveLoadMeta:
    """`path`: a folder. `weight_format`: `hf` (an HF model folder: config, safetensors, tokenizer; the weights are
    gathered once for the export) or `dcp` (this project's sharded checkpoint: every rank its shard, plus the
    optimizer, LR schedule and RNG when `with_optim`). `tokenizer`: saved beside `hf` weights when given."""

    path: str
    weight_format: Literal["hf", "dcp"] = "hf"
    with_optim: bool = False
    tokenizer: Any = None

    def __post_init__(self) -> None:
        if self.weight_format not in _WEIGHT_FORMATS:
            raise ValueError(
                f"SaveLoadMeta.weight_format={self.weight_format!r}; allowed: {', '.join(_WEIGHT_FORMATS)}"
            )
        if self.weight_format == "hf" and self.with_optim:
            raise ValueError(
                "SaveLoadMeta: with_optim=True needs weight_format='dcp' (an HF folder holds no optimizer)"
            )


_UPDATE_TYPES = ("colocated", "disk")


@dataclass(frozen=True)
class WeightUpdateMeta:
    """How `upload_weights` / `update_weights` move weights. `colocated`: `engine` is the inference engine of this
    process (an `AsyncRolloutEngine`); the training engine streams its parameters into it from the FSDP2 shards, one
    gathered tensor at a time (`verl.workers.weight_sync`). `disk`: the training engine writes an HF folder at
    `path` (rank 0), the inference engine loads it."""

    type: Literal["colocated", "disk"]
    engine: Any = None
    path: str | None = None

    def __post_init__(self) -> None:
        if self.type not in _UPDATE_TYPES:
            raise ValueError(f"WeightUpdateMeta.type={self.type!r}; allowed: {', '.join(_UPDATE_TYPES)}")
        if self.type == "colocated" and self.engine is None:
            raise ValueError("WeightUpdateMeta(type='colocated') needs engine=<the inference engine of this process>")
        if self.type == "disk" and not self.path:
            raise ValueError("WeightUpdateMeta(type='disk') needs path=<a folder both engines can reach>")

    @classmethod
    def from_colocated(cls, engine: Any) -> WeightUpdateMeta:
        return cls(type="colocated", engine=engine)

    @classmethod
    def from_disk(cls, path: str) -> WeightUpdateMeta:
        return cls(type="disk", path=path)
