"""Ray resources of a worker group: `RayResourcePool` (one placement group per node, one bundle per process) and
`RayClassWithInitArgs` (a Worker class with its `__init__` arguments and Ray actor options). Library code here never
calls `ray.init`. Must not import trainer or worker (layer 7) code.
"""

from __future__ import annotations

import math
import uuid
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

# How long to wait for a resource pool's placement groups before saying the cluster is too small.
PLACEMENT_GROUP_TIMEOUT_S = 120.0


def require_ray() -> None:
    """Raise a clear error when Ray is not initialised (this package never starts Ray itself)."""
    if not ray.is_initialized():
        raise RuntimeError(
            "Ray is not initialised: call ray.init() before creating resource pools or worker groups "
            "(the trainer does this in main_ppo; tests use the ray_session fixture)"
        )


def _cpu_gpu(resources: dict[str, float]) -> dict[str, float]:
    return {key: resources[key] for key in ("CPU", "GPU") if key in resources}


class RayResourcePool:
    """`process_on_nodes[i]` processes on node i, reserved as one Ray placement group per node.

    Each process gets one bundle: `{"CPU": cpus_per_process}` on CPU, `{"CPU": 1, "GPU": 1}` on GPU. Up to
    `max_colocate_count` worker groups may share a bundle, each taking an equal share of it (to put several
    roles in *one* process, fuse them with `create_colocated_worker_cls` instead).
    """

    def __init__(
        self,
        process_on_nodes: list[int],
        use_gpu: bool = False,
        max_colocate_count: int = 1,
        name_prefix: str = "",
        accelerator_type: str | None = None,
        cpus_per_process: float = 1,
    ) -> None:
        process_on_nodes = list(process_on_nodes)
        if not process_on_nodes or any(not isinstance(n, int) or n < 1 for n in process_on_nodes):
            raise ValueError(f"process_on_nodes must be a non-empty list of positive ints, got {process_on_nodes!r}")
        if not isinstance(max_colocate_count, int) or max_colocate_count < 1:
            raise ValueError(f"max_colocate_count must be a positive int, got {max_colocate_count!r}")
        if not cpus_per_process > 0:
            raise ValueError(f"cpus_per_process must be > 0, got {cpus_per_process!r}")
        self.process_on_nodes = process_on_nodes
        self.use_gpu = bool(use_gpu)
        self.max_colocate_count = max_colocate_count
        self.name_prefix = name_prefix
        self.accelerator_type = accelerator_type
        self.cpus_per_process = 1 if self.use_gpu else cpus_per_process
        self._placement_groups: list[PlacementGroup] | None = None

    @property
    def world_size(self) -> int:
        """The number of processes (bundles) in the pool."""
        return sum(self.process_on_nodes)

    def bundle(self) -> dict[str, float]:
        """The resources reserved for one process."""
        bundle: dict[str, float] = {"CPU": self.cpus_per_process}
        if self.use_gpu:
            bundle["GPU"] = 1
        if self.accelerator_type is not None:
            bundle[f"accelerator_type:{self.accelerator_type}"] = 1e-3
        return bundle

    def actor_resources(self) -> dict[str, float]:
        """The Ray actor options `num_cpus` / `num_gpus` of one worker: its share of a bundle."""
        resources = {"num_cpus": self.cpus_per_process / self.max_colocate_count}
        if self.use_gpu:
            resources["num_gpus"] = 1 / self.max_colocate_count
        return resources

    def num_threads_per_process(self) -> int:
        """torch threads for one worker: its whole-CPU share of a bundle, at least 1."""
        return max(1, math.floor(self.cpus_per_process / self.max_colocate_count))

    def get_placement_groups(self, strategy: str = "STRICT_PACK", detached: bool = False) -> list[PlacementGroup]:
        """The pool's placement groups (one per node), created and waited for on the first call."""
        if self._placement_groups is not None:
            return self._placement_groups
        require_ray()
        lifetime = "detached" if detached else None
        pgs = [
            placement_group(
                [self.bundle() for _ in range(n)],
                strategy=strategy,
                name=f"{self.name_prefix}verl_pool_{uuid.uuid4().hex[:8]}_{i}",
                lifetime=lifetime,
            )
            for i, n in enumerate(self.process_on_nodes)
        ]
        ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=PLACEMENT_GROUP_TIMEOUT_S)
        if len(ready) < len(pgs):
            for pg in pgs:
                remove_placement_group(pg)
            raise RuntimeError(
                f"resource pool {self.name_prefix!r} could not reserve {self.process_on_nodes} processes of "
                f"{self.bundle()} each within {PLACEMENT_GROUP_TIMEOUT_S:.0f} s; Ray has "
                f"{_cpu_gpu(ray.available_resources())} available of {_cpu_gpu(ray.cluster_resources())}"
            )
        self._placement_groups = pgs
        return pgs

    def remove_placement_groups(self) -> None:
        """Give the pool's resources back to Ray; this kills every actor placed on the pool."""
        for pg in self._placement_groups or []:
            remove_placement_group(pg)
        self._placement_groups = None


class RayClassWithInitArgs:
    """A Worker class (plain or `ray.remote`'d) with the arguments for its `__init__` and extra Ray actor
    options (`update_options({"runtime_env": {...}})`, ...), to be instantiated once per rank.

    `fused_worker_used` (verl's flag) says that `cls` is a fused class (`create_colocated_worker_raw_cls`, or a
    subclass of one); `create_colocated_worker_cls` sets it, and a worker group refuses it on any other class."""

    def __init__(self, cls: type, *args: Any, **kwargs: Any) -> None:
        self.cls = cls
        self.args = args
        self.kwargs = kwargs
        self.options: dict[str, Any] = {}
        self.fused_worker_used = False

    def update_options(self, options: dict[str, Any]) -> None:
        """Add Ray actor options (as for `ActorClass.options`); later calls override earlier keys."""
        if not isinstance(options, dict):
            raise TypeError(f"options must be a dict of Ray actor options, got {type(options).__name__}")
        self.options.update(options)

    @property
    def user_cls(self) -> type:
        """The plain Python class (unwrapped when `cls` is a `ray.remote` actor class)."""
        return getattr(self.cls, "__ray_actor_class__", self.cls)
