"""Worker groups without Ray: the one worker of a one-process pool runs inside the driver process.

Owns `LocalWorkerGroup`, the drop-in for a world-size-1 `RayWorkerGroup` that `trainer.single_process=true` uses:
same `@register` dispatch and collect, `spawn` for fused roles, already-done futures, the worker's own exceptions,
and the environment a Ray actor would see (restored by `close()`). The trainer refuses what one process cannot do
(several workers, async rollout, reward actors). Layer 6: must not import trainer or worker code.
"""

from __future__ import annotations

import os
from typing import Any

from verl.single_controller.base.decorator import (
    RegisterAttrs,
    collect_outputs,
    dispatch_calls,
    runs_on_rank_zero_only,
)
from verl.single_controller.base.worker import NUM_THREADS_ENV, Worker, get_free_port
from verl.single_controller.base.worker_group import WorkerGroup
from verl.single_controller.ray.base import RayClassWithInitArgs, RayResourcePool
from verl.utils import acceleration

__all__ = ["DoneFuture", "LocalWorkerGroup", "close_local_worker_groups"]

_OPEN_GROUPS: list[LocalWorkerGroup] = []  # groups built in this process and not closed yet


def close_local_worker_groups() -> None:
    """Close every `LocalWorkerGroup` of this process that is still open (the trainer's teardown, also
    after a failed start)."""
    while _OPEN_GROUPS:
        _OPEN_GROUPS.pop().close()


class DoneFuture:
    """The result of a `blocking=False` call on a `LocalWorkerGroup`: the call has already run."""

    def __init__(self, result: Any) -> None:
        self._result = result

    def done(self) -> bool:
        return True

    def get(self, timeout_s: float | None = None) -> Any:
        return self._result


class LocalWorkerGroup(WorkerGroup):
    """The worker of a one-process `resource_pool`, built in this process; see the module doc.

    Takes the arguments of `RayWorkerGroup` (`name_prefix`, `bin_pack`, `detached`, `call_timeout_s` are
    accepted and have nothing to do here: a call runs to its end in this process)."""

    requires_ray = False  # the trainer skips its check of Ray's resources for this group class

    def __init__(
        self,
        resource_pool: RayResourcePool,
        ray_cls_with_init: RayClassWithInitArgs,
        name_prefix: str | None = None,
        **_ray_options: Any,
    ) -> None:
        if resource_pool.world_size != 1:
            raise ValueError(
                f"a single-process worker group runs exactly one worker, but the resource pool has "
                f"{resource_pool.process_on_nodes} processes per node; use Ray (trainer.single_process=false) "
                "for more than one worker"
            )
        user_cls = ray_cls_with_init.user_cls
        if not (isinstance(user_cls, type) and issubclass(user_cls, Worker)):
            raise TypeError(f"a worker group needs a subclass of verl Worker, got {user_cls!r}")
        self.resource_pool = resource_pool
        self.name_prefix = name_prefix or "local"
        self.role: str | None = None
        self._user_cls = user_cls
        env = {
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "RAY_LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(get_free_port()),
            NUM_THREADS_ENV: str(resource_pool.num_threads_per_process()),
        }
        device = "cuda" if resource_pool.use_gpu else "cpu"
        env[acceleration.WORKER_DEVICE_ENV] = device
        # the device's speed-ups this running process can still take (verl.utils.acceleration)
        env.update(acceleration.for_device(device).worker_env(new_process=False))
        self._saved_env = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        try:
            self._worker = user_cls(*ray_cls_with_init.args, **ray_cls_with_init.kwargs)
        except BaseException:
            self._restore_env()
            raise
        self._closed = False
        _OPEN_GROUPS.append(self)
        self._bind_methods(user_cls, method_prefix="")

    @property
    def world_size(self) -> int:
        return 1

    @property
    def workers(self) -> list[Worker]:
        """The worker object itself (a list of one, in rank order as for `RayWorkerGroup.workers`)."""
        return [self._worker]

    @property
    def label(self) -> str:
        return f"role '{self.role}' (in-process)" if self.role is not None else "in-process worker group"

    # ------------------------------------------------------------------------------ calling methods
    def _call(self, name: str, worker_method: str, attrs: RegisterAttrs, args: tuple, kwargs: dict) -> DoneFuture:
        # the same split as on Ray (a DataProto argument arrives as a new DataProto sharing the tensors), so a
        # worker that adds or pops keys does not change the driver's batch
        calls = dispatch_calls(attrs.dispatch_mode, 1, args, kwargs, worker_group=self)
        output = getattr(self._worker, worker_method)(*calls.args[0], **calls.kwargs[0])
        return DoneFuture(
            output if runs_on_rank_zero_only(attrs) else collect_outputs(attrs.dispatch_mode, [output], calls)
        )

    def _share_with(self, handle: LocalWorkerGroup) -> None:
        handle.resource_pool = self.resource_pool
        handle.name_prefix = self.name_prefix
        handle._worker = self._worker
        handle._owner = self  # a role handle closes the group it came from

    # ------------------------------------------------------------------------------------------ closing
    def close(self) -> None:
        """Destroy the worker's torch.distributed group (if it made one) and restore the environment
        variables the group set. Idempotent; a spawned role handle closes the group it came from."""
        owner = getattr(self, "_owner", self)
        if owner._closed:
            return
        owner._closed = True
        if owner in _OPEN_GROUPS:
            _OPEN_GROUPS.remove(owner)
        from verl.utils.fsdp_utils import destroy_distributed

        destroy_distributed()
        acceleration.leave()  # the worker's device speed-ups (a CPU's thread policy) end with it
        owner._restore_env()

    def _restore_env(self) -> None:
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
