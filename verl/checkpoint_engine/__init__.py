"""Checkpoint engines: how the trainer's weights reach the rollout (verl's `verl.checkpoint_engine`).

Only the colocated backend, `naive` (`ColocatedCheckpointEngine`), is built in: the actor and the rollout engine
share a process and the weights are handed over there (`verl.workers.weight_sync`); in async mode the driver
streams buckets to a standalone rollout group (`verl.workers.weight_stream`). verl's transport backends (nccl,
nixl, hccl, kimi, mooncake, delta_sharded) are not implemented; a backend registered with
`CheckpointEngineRegistry.register` is built by name like verl's.
"""

from verl.checkpoint_engine.base import (
    CheckpointEngine,
    CheckpointEngineRegistry,
    CheckpointEngineWorker,
    ColocatedCheckpointEngine,
)

__all__ = ["CheckpointEngine", "CheckpointEngineRegistry", "CheckpointEngineWorker", "ColocatedCheckpointEngine"]
