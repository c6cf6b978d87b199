"""Where the workers run: `Role` (the parts a worker process can play) and `ResourcePoolManager` (named pools
of processes per node on Ray, which role lives in which pool, and a check that Ray has room for them all
before any worker starts).

Layer 8 helper: uses verl.single_controller's RayResourcePool; no trainer logic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from verl.single_controller.ray import RayResourcePool

__all__ = ["ResourcePoolManager", "Role"]


class Role(Enum):
    """Roles a worker process can play; fused roles share one process per rank."""

    Actor = 0
    Rollout = 1
    ActorRollout = 2
    Critic = 3
    RefPolicy = 4
    RewardModel = 5
    ActorRolloutRef = 6


@dataclass
class ResourcePoolManager:
    """Named resource pools (`{name: [processes per node, ...]}`) and which role lives in which pool."""

    resource_pool_spec: dict[str, list[int]]
    mapping: dict[Role, str]
    use_gpu: bool = False
    cpus_per_process: int = 1
    resource_pool_dict: dict[str, RayResourcePool] = field(default_factory=dict)

    def create_resource_pool(self) -> None:
        for name, process_on_nodes in self.resource_pool_spec.items():
            self.resource_pool_dict[name] = RayResourcePool(
                process_on_nodes=process_on_nodes,
                use_gpu=self.use_gpu,
                max_colocate_count=1,
                name_prefix=name,
                **({} if self.use_gpu else {"cpus_per_process": self.cpus_per_process}),
            )

    def check_resource_available(self) -> None:
        """Before any worker starts: every pool must fit into what Ray has (CPUs or GPUs in total, and each
        node's share of a pool, one placement group, on a single node). On a shortage, one ValueError saying what was asked and what
        is there, instead of a placement group waiting for resources that never come."""
        import ray

        kind = "GPU" if self.use_gpu else "CPU"
        per_process = 1 if self.use_gpu else self.cpus_per_process
        asked = {name: [n * per_process for n in nodes] for name, nodes in self.resource_pool_spec.items()}
        node_totals = sorted(
            (float(node["Resources"].get(kind, 0)) for node in ray.nodes() if node.get("Alive")), reverse=True
        )
        available = float(ray.available_resources().get(kind, 0))
        demands = sorted((d for nodes in asked.values() for d in nodes), reverse=True)
        if sum(demands) > available or not _first_fit(demands, node_totals):
            what = "; ".join(
                f"pool {name!r}: {self.resource_pool_spec[name]} processes per node x {per_process} {kind}"
                for name in asked
            )
            raise ValueError(
                f"not enough Ray resources for the workers: asked {sum(demands):g} {kind} ({what}); Ray has "
                f"{available:g} {kind} available, per node {[f'{c:g}' for c in node_totals]}. Lower "
                f"trainer.n_gpus_per_node/trainer.nnodes/trainer.cpus_per_worker or give Ray more "
                f"(ray_kwargs.ray_init.num_cpus, or `ray start --num-cpus` on the cluster)"
            )

    def default_cpus_per_process(self) -> int:
        """CPUs per worker process when `trainer.cpus_per_worker` is unset: the busiest node slot's share of a node.

        Slot i of every pool lands on one node (its placement group); the busiest slot holds the most processes
        (e.g. the actor and a standalone rollout group's rank 0). The slots go to the nodes with the most CPUs, so
        each process gets the smallest of those nodes' CPUs over the busiest slot's processes, at least 1: sized
        per node, not from the cluster's total (which would ask one node for another node's CPUs)."""
        import ray

        slots = max(len(nodes) for nodes in self.resource_pool_spec.values())
        per_slot = [sum(nodes[i] for nodes in self.resource_pool_spec.values() if i < len(nodes)) for i in range(slots)]
        cpus = sorted((int(node["Resources"].get("CPU", 0)) for node in ray.nodes() if node.get("Alive")), reverse=True)
        if not cpus:
            return 1
        smallest_used = cpus[min(slots, len(cpus)) - 1]
        return max(1, smallest_used // max(1, max(per_slot)))

    def get_resource_pool(self, role: Role) -> RayResourcePool:
        return self.resource_pool_dict[self.mapping[role]]


def _first_fit(demands: list[float], capacities: list[float]) -> bool:
    """Whether every demand (largest first) fits on some node, each node's capacity shrinking as it fills."""
    free = list(capacities)
    for demand in sorted(demands, reverse=True):
        node = next((i for i, cap in enumerate(free) if cap >= demand), None)
        if node is None:
            return False
        free[node] -= demand
    return True
