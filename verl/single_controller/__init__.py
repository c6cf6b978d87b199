"""The single controller: one driver process drives groups of worker processes (verl's programming model).

`Worker` + `@register(dispatch_mode=...)` define what a worker group can be asked to do; `RayResourcePool`,
`RayClassWithInitArgs`, `RayWorkerGroup` and `create_colocated_worker_cls` run the workers as Ray actors;
`LocalWorkerGroup` runs a one-process group's worker inside the driver, without Ray.
Layer 6 (see docs/architecture.md#layers): must not import trainer or worker (layer 7) code.
"""

from verl.single_controller.base import Dispatch, Execute, Worker, register
from verl.single_controller.local import LocalWorkerGroup
from verl.single_controller.ray import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    WorkerDiedError,
    WorkerGroupFuture,
    create_colocated_worker_cls,
)

__all__ = [
    "Dispatch",
    "Execute",
    "LocalWorkerGroup",
    "RayClassWithInitArgs",
    "RayResourcePool",
    "RayWorkerGroup",
    "Worker",
    "WorkerDiedError",
    "WorkerGroupFuture",
    "create_colocated_worker_cls",
    "register",
]
