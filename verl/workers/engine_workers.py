"""verl's `verl.workers.engine_workers` import path: the actor/rollout/reference worker on the training engine.

verl 0.9.1 has two worker implementations (`trainer.use_legacy_worker_impl`); this project has one, the FSDP2 engine
worker of `verl.workers.fsdp_workers`, importable from both paths. Here it gains verl's `update_weights(global_steps,
mode)`: with the `naive` backend (the only one this project starts) the rollout engine gets the actor's weights in
the same processes; with a checkpoint engine set on the worker (`verl.checkpoint_engine`), the actor's weights are
sent through it, tagged with the step they come from.
"""

from __future__ import annotations

from typing import Any

from verl.single_controller.base import Dispatch, register
from verl.workers.fsdp_workers import ActorRolloutRefWorker as _FSDPActorRolloutRefWorker
from verl.workers.fsdp_workers import CriticWorker

__all__ = ["ActorRolloutRefWorker", "CriticWorker"]


class ActorRolloutRefWorker(_FSDPActorRolloutRefWorker):
    """The FSDP2 actor/rollout/reference worker with verl's engine-worker weight update."""

    checkpoint_engine: Any = None  # a verl.checkpoint_engine.CheckpointEngine for a non-naive backend

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> dict:
        """Send the actor's weights to the rollout: `mode` auto takes `rollout.checkpoint_engine.backend`."""
        backend = self.config.rollout.checkpoint_engine.backend if mode == "auto" else mode
        if backend == "naive":
            self._sync_rollout_weights()
            return {}
        if self.checkpoint_engine is None:
            raise ValueError(
                f"update_weights(mode={mode!r}): backend {backend!r} needs a checkpoint engine on the worker "
                "(this project starts only the naive backend)"
            )
        per_tensor_param, _ = self.actor.engine.get_per_tensor_param()
        return (await self.checkpoint_engine.send_weights(per_tensor_param, global_steps=global_steps)) or {}
