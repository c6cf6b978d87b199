"""verl's checkpoint-engine contract: `CheckpointEngine` (send the trainer's weights, receive them on the rollout
side), `CheckpointEngineRegistry` (backends by name, `rollout.checkpoint_engine.backend`), the colocated backend
`naive` (`ColocatedCheckpointEngine`) and `CheckpointEngineWorker` (the rollout side: received weights into the
rollout engine).

The trainer side is the actor worker's `update_weights(global_steps, mode)`: with backend `naive` it loads the
rollout engine in its own process, otherwise it hands `engine.get_per_tensor_param()` to
`checkpoint_engine.send_weights`. Layer 6 (beside `verl.single_controller`): imports the Worker base, the registry
helper and the weight-sync config reader; must not import Ray or trainer code.
"""

from __future__ import annotations

import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import torch

from verl.single_controller.base import Dispatch, Worker, register
from verl.utils.registry import LazyRegistry
from verl.workers.weight_sync import bucket_bytes

__all__ = ["CheckpointEngine", "CheckpointEngineRegistry", "CheckpointEngineWorker", "ColocatedCheckpointEngine"]

NamedTensors = Iterable[tuple[str, torch.Tensor]]
_BACKENDS = LazyRegistry("checkpoint engine", "actor_rollout_ref.rollout.checkpoint_engine.backend", {})


class CheckpointEngineRegistry:
    """Checkpoint engines by backend name: `@CheckpointEngineRegistry.register("name")` on a `CheckpointEngine`
    subclass, `get(name)` for the class, `new(name, *args, **kwargs)` for an instance. An unknown name is a
    ValueError listing the registered ones."""

    @staticmethod
    def register(backend: str):
        return _BACKENDS.register(backend)

    @staticmethod
    def get(backend: str) -> type[CheckpointEngine]:
        return _BACKENDS.get(backend)

    @staticmethod
    def new(backend: str, *args: Any, **kwargs: Any) -> CheckpointEngine:
        return _BACKENDS.get(backend)(*args, **kwargs)


class CheckpointEngine(ABC):
    """Moves the trainer's weights to the rollout: the actor process calls `send_weights(weights)`, the rollout
    process `receive_weights()` and loads what it yields. Around each transfer a transport backend runs `prepare()`
    (buckets, metadata such as an address), `build_topology` (the ranks of both groups), `init_process_group(**kw)`
    and afterwards `finalize()`."""

    # what receive_weights yields: "named_tensors" ((name, tensor) pairs) or verl's "delta_flush"
    wire_format = "named_tensors"

    @abstractmethod
    def prepare(self) -> dict[str, Any]:
        """Allocate the transfer buffers; returns this worker's metadata for `build_topology`."""

    @classmethod
    @abstractmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """`init_process_group` keyword arguments for the actor group and for the rollout group: each value a list
        with one entry per rank of that group."""

    @abstractmethod
    def init_process_group(self, **kwargs: Any) -> None:
        """Join the transfer's process group (arguments from `build_topology`)."""

    @abstractmethod
    def finalize(self) -> None:
        """Free the transfer buffers (and the process group) after a transfer."""

    @abstractmethod
    async def send_weights(self, weights: NamedTensors, global_steps: int | None = None) -> Any:
        """Send `(name, tensor)` pairs; `global_steps` is the trainer step these weights belong to."""

    @abstractmethod
    def receive_weights(self, global_steps: int | None = None) -> NamedTensors | AsyncIterator:
        """The received `(name, tensor)` pairs, as a (sync or async) iterator."""


@CheckpointEngineRegistry.register("naive")
class ColocatedCheckpointEngine(CheckpointEngine):
    """Actor and rollout in one process: `send_weights` keeps the stream, `receive_weights` yields it once.
    There is no transport, so `prepare`, `build_topology`, `init_process_group` and `finalize` raise."""

    def __init__(self, bucket_size: int, is_master: bool = False) -> None:
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.weights: NamedTensors | None = None

    def _no_transport(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the colocated ('naive') checkpoint engine has no transport or process group")

    prepare = init_process_group = finalize = _no_transport
    build_topology = classmethod(_no_transport)

    def send_weights(self, weights: NamedTensors, global_steps: int | None = None) -> None:
        self.weights = weights

    def receive_weights(self, global_steps: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        if self.weights is None:
            raise RuntimeError("receive_weights() before send_weights(): the colocated engine holds no weights")
        yield from self.weights
        self.weights = None


class CheckpointEngineWorker(Worker):
    """The rollout side of a transfer: builds `rollout_config.checkpoint_engine.backend` (with
    `update_weights_bucket_megabytes` as `bucket_size` and `engine_kwargs[backend]`, after importing
    `custom_backend_module`) and loads what it receives into `server_adapter`: verl's async server adapters
    (`await update_weights(weights, global_steps=..., wire_format=...)`) or this project's rollout engines
    (`BaseRollout.update_weights(weights)`, fed a sync stream)."""

    def __init__(self, rollout_config: Any, model_config: Any, server_adapter: Any = None) -> None:
        super().__init__()
        if server_adapter is None:
            raise ValueError(
                "CheckpointEngineWorker needs the rollout engine to load into (server_adapter); this project does "
                "not start verl's rollout servers"
            )
        self.rollout_config = rollout_config
        self.model_config = model_config
        self.server_adapter = server_adapter
        section = rollout_config.get("checkpoint_engine", None) or {}
        backend = section.get("backend", "naive")
        if section.get("custom_backend_module", None):  # a plugin registering its backend on import
            importlib.import_module(section["custom_backend_module"])
        engine_kwargs = (section.get("engine_kwargs", None) or {}).get(backend, None) or {}
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            backend, bucket_size=bucket_bytes(rollout_config), **engine_kwargs
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None) -> None:
        """Receive one transfer of weights (for trainer step `global_steps`) and load it into the rollout engine."""
        weights = self.checkpoint_engine.receive_weights(global_steps=global_steps)
        load = self.server_adapter.update_weights
        if inspect.iscoroutinefunction(load):
            wire_format = getattr(self.checkpoint_engine, "wire_format", "named_tensors")
            await load(weights, global_steps=global_steps, wire_format=wire_format)
            return
        if isinstance(weights, AsyncIterator):
            raise TypeError(
                f"rollout engine {type(self.server_adapter).__name__} loads weights from a sync stream, but "
                f"checkpoint engine {type(self.checkpoint_engine).__name__} yields them asynchronously"
            )
        load(weights)

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call `method` of this worker's checkpoint engine (prepare, init_process_group, finalize, ...)."""
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)
