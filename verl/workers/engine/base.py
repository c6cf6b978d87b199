"""The training-engine interface (verl 0.9.1's `verl.workers.engine.BaseEngine`) and `EngineRegistry`.

An engine owns one data-parallel rank's model, optimizer and LR schedule. verl's contract, name for name:
`initialize`, `train_mode` / `eval_mode`, `forward_backward_batch(data, loss_function, forward_only)` (returns
`{"model_output", "loss", "metrics"}` per micro-batch), `train_batch`, `infer_batch`, the optimizer and checkpoint
calls. Settings travel as non-tensor entries of the TensorDict. Layer 5: torch and tensordict only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from tensordict import TensorDict

from verl.utils.device import get_device_name
from verl.utils.tensordict_utils import maybe_fix_3d_position_ids

__all__ = ["BaseEngine", "EngineRegistry"]


class BaseEngine(ABC):
    """What every training engine provides (verl's names and signatures). See the module docstring."""

    # ------------------------------------------------------------------ building and modes
    @abstractmethod
    def initialize(self) -> None:
        """Build (or load) the model, the optimizer and the LR schedule of this rank."""

    @property
    @abstractmethod
    def is_param_offload_enabled(self) -> bool:
        """Whether parameters live off the accelerator between uses."""

    @property
    @abstractmethod
    def is_optimizer_offload_enabled(self) -> bool:
        """Whether the optimizer state lives off the accelerator between updates."""

    @abstractmethod
    def train_mode(self, **kwargs: Any) -> AbstractContextManager:
        """A context in which the model trains (dropout on; offloaded state brought to the device)."""

    @abstractmethod
    def eval_mode(self, **kwargs: Any) -> AbstractContextManager:
        """A context in which the model only runs forwards."""

    # ------------------------------------------------------------------ optimizer
    @abstractmethod
    def optimizer_zero_grad(self) -> None:
        """Zero the gradients."""

    @abstractmethod
    def optimizer_step(self) -> float:
        """Clip the global grad norm, step (or skip a non-finite step); return the norm before clipping."""

    @abstractmethod
    def lr_scheduler_step(self) -> float:
        """Advance the LR schedule by one step; return the new learning rate."""

    # ------------------------------------------------------------------ batches
    @abstractmethod
    def forward_backward_batch(self, data: TensorDict, loss_function: Callable | None, forward_only: bool = False):
        """Forward (and, unless `forward_only`, backward) every micro-batch of `data`; see the module docstring."""

    def train_batch(self, data: TensorDict, loss_function: Callable) -> dict[str, Any]:
        """One optimizer step on `data`: zero grads, forward + backward of every micro-batch, clipped step.
        Returns `forward_backward_batch`'s output with `metrics["grad_norm"]` added."""
        maybe_fix_3d_position_ids(data)
        self.optimizer_zero_grad()
        outputs = self.forward_backward_batch(data, loss_function, forward_only=False)
        grad_norm = self.optimizer_step()
        if "grad_norm" in outputs["metrics"]:
            raise ValueError("the loss function's metrics must not be named 'grad_norm' (train_batch adds it)")
        outputs["metrics"]["grad_norm"] = grad_norm
        return outputs

    def infer_batch(self, data: TensorDict, loss_function: Callable | None = None) -> dict[str, Any]:
        """The forward of every micro-batch without gradients (`forward_backward_batch(..., forward_only=True)`)."""
        maybe_fix_3d_position_ids(data)
        with torch.no_grad():
            return self.forward_backward_batch(data, loss_function, forward_only=True)

    # ------------------------------------------------------------------ weights, parallelism, checkpoints
    @abstractmethod
    def get_per_tensor_param(self, **kwargs: Any) -> tuple[Iterator[tuple[str, torch.Tensor]], dict | None]:
        """(a generator of (name, full tensor) gathered one at a time from the shards, the peft config or None)."""

    @abstractmethod
    def get_data_parallel_size(self) -> int: ...

    @abstractmethod
    def get_data_parallel_rank(self) -> int: ...

    @abstractmethod
    def get_data_parallel_group(self) -> Any: ...

    @abstractmethod
    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        """Move the parameters and/or the optimizer state to `device` (`cpu` or the accelerator)."""

    @abstractmethod
    def save_checkpoint(
        self,
        local_path: str,
        hdfs_path: str | None = None,
        global_step: int = 0,
        max_ckpt_to_keep: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Save model, optimizer and LR-schedule state of this rank under `local_path`."""

    @abstractmethod
    def load_checkpoint(
        self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = True, **kwargs: Any
    ) -> None:
        """Restore what `save_checkpoint` wrote."""

    def is_mp_src_rank_with_outputs(self) -> bool:
        """Whether this rank holds the model outputs of its model-parallel group (every rank here: no model
        parallelism)."""
        return True

    def disable_adapter(self) -> AbstractContextManager:
        """A context with LoRA adapters switched off (the base model); a no-op context without adapters."""
        return nullcontext()


class EngineRegistry:
    """Engine classes by model type (`language_model`, `value_model`), backend (`fsdp`, `fsdp2`) and device."""

    _engines: dict[str, dict[str, dict[str, type]]] = {}

    @classmethod
    def register(cls, model_type: str, backend: list[str] | str, device: list[str] | str = "cuda") -> Callable:
        """Class decorator: register an engine class for each backend and device given."""

        def decorator(engine_class: type) -> type:
            if not issubclass(engine_class, BaseEngine):
                raise TypeError(f"{engine_class.__name__} is not a BaseEngine subclass")
            for name in [backend] if isinstance(backend, str) else backend:
                table = cls._engines.setdefault(model_type, {}).setdefault(name, {})
                for dev in [device] if isinstance(device, str) else device:
                    if dev in table and table[dev] is not engine_class:
                        raise ValueError(f"an engine is already registered for ({model_type}, {name}, {dev})")
                    table[dev] = engine_class
            return engine_class

        return decorator

    @classmethod
    def get_engine_cls(cls, model_type: str, backend: str, device: str | None = None) -> type:
        """The class registered for `model_type`/`backend` on `device` (default: this machine's device)."""
        if model_type not in cls._engines:
            raise ValueError(f"unknown engine model_type {model_type!r}; registered: {sorted(cls._engines)}")
        backends = cls._engines[model_type]
        if backend not in backends:
            raise ValueError(f"unknown engine backend {backend!r} for {model_type}; registered: {sorted(backends)}")
        device = device or get_device_name("auto")
        if device not in backends[backend]:
            raise ValueError(
                f"no {model_type}/{backend} engine for device {device!r}; registered: {sorted(backends[backend])}"
            )
        return backends[backend][device]

    @classmethod
    def new(cls, model_type: str, backend: str, *args: Any, **kwargs: Any) -> BaseEngine:
        """An instance of the registered class (arguments go to its constructor)."""
        return cls.get_engine_cls(model_type, backend)(*args, **kwargs)
