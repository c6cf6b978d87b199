"""Worker groups on Ray: one Ray actor per process of a resource pool, driven as one object.

Owns `RayWorkerGroup`, `WorkerGroupFuture` (what a `blocking=False` method returns; `.get()` collects) and
`WorkerDiedError` (raised as soon as Ray reports a worker's death, naming method, role and rank; `call_timeout_s`
bounds a call with `TimeoutError`); re-exports `RayResourcePool`, `RayClassWithInitArgs` and the fused-worker
factories under verl's import path. Never calls `ray.init`. Must not import trainer or worker code.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayError, RayTaskError
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from verl.protocol import DataProtoFuture
from verl.single_controller.base.decorator import (
    RegisterAttrs,
    collect_outputs,
    dispatch_calls,
    runs_on_rank_zero_only,
)
from verl.single_controller.base.worker import ENV_KEYS, NUM_THREADS_ENV, Worker
from verl.single_controller.base.worker_group import WorkerGroup
from verl.single_controller.ray.colocate import (
    FUSED_METHOD_SEP,
    create_colocated_worker_cls,
    create_colocated_worker_cls_fused,
    create_colocated_worker_raw_cls,
)
from verl.single_controller.ray.nodes import (
    NEVER_STARTED,
    NODE_CHECK_S,
    bundle_nodes,
    describe_lost,
    looks_like_lost_peer,
    loss_wait_s,
    never_started_cause,
    wait_for_lost_nodes,
)
from verl.single_controller.ray.resource_pool import RayClassWithInitArgs, RayResourcePool, require_ray
from verl.utils import acceleration
from verl.utils.acceleration import WORKER_DEVICE_ENV

# Ray's setting of its workers' nice value (Ray's default 15); the driver's value, else 0, is passed to every worker.
WORKER_NICENESS_ENV = "RAY_worker_niceness"
# What a group sets to place each rank; `worker_env` may not change these (verl's "protected system env").
GROUP_ENV_KEYS = (*ENV_KEYS, NUM_THREADS_ENV, WORKER_DEVICE_ENV, "RAY_LOCAL_WORLD_SIZE", "WG_PREFIX", "WG_BACKEND")


class WorkerDiedError(RuntimeError):
    """A worker process of a group died (or Ray lost it) while a call on the group was pending."""


# ------------------------------------------------------------------------------------------------ futures
class WorkerGroupFuture(DataProtoFuture):
    """The pending result of a group call. `.get()` waits for every rank that runs it and returns the
    collected result (the same value a blocking call returns); it may be called again and returns the
    same value. A `DataProtoFuture` (verl returns one for non-blocking DataProto methods); passed to another
    group's method it is collected in the driver first (`collect_in_driver`), so padding is handled."""

    collect_in_driver = True

    def __init__(
        self,
        refs: list[ray.ObjectRef],
        ranks: list[int],
        finish: Callable[[list[Any]], Any],
        method: str,
        label: str,
        timeout_s: float | None,
        rank_nodes: list[str | None] | None = None,
    ) -> None:
        super().__init__(collect_fn=finish, futures=refs)
        self._refs = refs
        self._ranks = ranks
        self._finish = finish
        self._method = method
        self._label = label
        self._timeout_s = timeout_s
        self._rank_nodes = rank_nodes  # the Ray node of every rank of the group (None: not known, not checked)
        self._done = False
        self._result: Any = None

    def done(self) -> bool:
        """True when every rank has finished (successfully or not); never blocks."""
        ready, _ = ray.wait(self._refs, num_returns=len(self._refs), timeout=0)
        return len(ready) == len(self._refs)

    def get(self, timeout_s: float | None = None) -> Any:
        """Wait for all ranks (at most `timeout_s`, default: the group's `call_timeout_s`) and collect."""
        if not self._done:
            outputs = self._wait_all(self._timeout_s if timeout_s is None else timeout_s)
            self._result = self._finish(outputs)
            self._done = True
        return self._result

    def _wait_all(self, timeout_s: float | None) -> list[Any]:
        """Per-rank outputs in rank order; the first failure or death of any rank raises at once."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        rank_of = dict(zip(self._refs, self._ranks))
        outputs: dict[int, Any] = {}
        pending = list(self._refs)
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            tick = remaining
            if self._rank_nodes is not None:  # wake up every NODE_CHECK_S to look at the nodes
                tick = NODE_CHECK_S if remaining is None else min(remaining, NODE_CHECK_S)
            ready, pending = ray.wait(pending, num_returns=1, timeout=tick)
            if not ready:
                self._raise_if_nodes_lost(None)  # a node that went away answers nothing: check every tick
                if deadline is None or time.monotonic() < deadline:
                    continue
                waiting = sorted(rank_of[ref] for ref in pending)
                raise TimeoutError(
                    f"'{self._method}' on {self._label} rank {waiting[0]} did not finish within {timeout_s} s "
                    f"(ranks still running: {waiting})"
                )
            rank = rank_of[ready[0]]
            outputs[rank] = self._get_one(ready[0], rank, pending, rank_of)
        return [outputs[rank] for rank in self._ranks]

    def _raise_if_nodes_lost(self, cause: BaseException | None, wait_s: float = 0.0) -> None:
        """WorkerDiedError naming the lost nodes and their ranks when Ray reports a node of this group dead (waiting
        up to `wait_s` for it to say so); nothing when the nodes are not known or all alive."""
        if self._rank_nodes is None:
            return
        lost = wait_for_lost_nodes(self._rank_nodes, wait_s)
        if lost:
            message = describe_lost(lost, self._rank_nodes, self._method, self._label)
            raise WorkerDiedError(message + (f" (first error: {_last_line(cause)})" if cause else "")) from cause

    def _raise_lost_peer(self, err: BaseException, pending: list, rank_of: dict) -> None:
        """A rank's collective failed the way it does when a peer went away: wait up to `loss_wait_s()` for the
        cause to show (Ray marking a node of this group dead, or another rank of this call dying) and raise that
        instead, naming the lost node or the dead rank; return when neither shows."""
        deadline = time.monotonic() + loss_wait_s()
        pending = list(pending)
        while time.monotonic() < deadline:
            self._raise_if_nodes_lost(err)
            if not pending:  # no other rank to hear from: only Ray's verdict on the nodes can still come
                if self._rank_nodes is None:
                    return
                deadline = min(deadline, time.monotonic() + NODE_CHECK_S)
                time.sleep(1.0)
                continue
            ready, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            for ref in ready:
                try:
                    ray.get(ref)
                except RayTaskError:  # another survivor's collective
                    continue
                except RayError as death:
                    raise self._died(death, rank_of[ref]) from death

    def _get_one(self, ref: ray.ObjectRef, rank: int, pending: list = (), rank_of: dict | None = None) -> Any:
        where = f"'{self._method}' on {self._label} rank {rank}"
        try:
            return ray.get(ref)
        except RayTaskError as err:  # the method raised: keep the exception's type, say where it happened
            if looks_like_lost_peer(err):  # a surviving rank's collective: name the lost peer instead
                self._raise_lost_peer(err, list(pending), rank_of or {})
            if hasattr(err, "add_note"):
                err.add_note(f"raised by {where}")
            raise
        except RayError as err:
            if NEVER_STARTED in str(err):  # Ray's reason is in its logs, not in the error
                cause = never_started_cause()
                if cause:
                    raise WorkerDiedError(f"{where} failed: the worker never started: {cause}") from err
            raise self._died(err, rank) from err

    def _died(self, err: RayError, rank: int) -> WorkerDiedError:
        """The error for rank `rank`'s death: its lost node when Ray marks one dead (an unreachable actor may be on
        a node Ray has not declared dead yet, its health checks take a while: then wait up to
        `loss_wait_s()` for the verdict; a dead actor on a live node is final at once), else the death."""
        self._raise_if_nodes_lost(err, loss_wait_s() if isinstance(err, ActorUnavailableError) else 0.0)
        return WorkerDiedError(
            f"'{self._method}' on {self._label} rank {rank} failed: the worker died ({_summary(err)})"
        )


def _last_line(err: BaseException, limit: int = 200) -> str:
    """The last line of an error's message (a wrapped worker exception's own `Type: message`), colour codes
    removed, at most `limit` characters."""
    import re

    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", str(err)).splitlines() if line.strip()]
    last = lines[-1] if lines else type(err).__name__
    return last if len(last) <= limit else last[: limit - 3] + "..."


def _summary(err: BaseException) -> str:
    """`Type: first line ... last line` of an error (Ray's messages span many lines; the first and last say most)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {' ... '.join(lines[:1] + lines[-1:] if len(lines) > 1 else lines)}"


# ----------------------------------------------------------------------------------------------- groups
_SCALARS = (int, float, str, bool, bytes, type(None))


def put_shared_arguments(
    args: list[tuple], kwargs: list[dict[str, Any]], ranks: list[int]
) -> tuple[list[tuple], list[dict[str, Any]]]:
    """Per-rank arguments with every non-scalar object that all called ranks receive (the same object, e.g. a
    ONE_TO_ALL state dict or batch) put into Ray's object store once and passed as one ObjectRef, instead of
    being serialised once per rank. Ray hands the workers the value, not the ref (top-level arguments)."""
    if len(ranks) < 2:
        return args, kwargs
    first = ranks[0]
    shared: dict[int, ray.ObjectRef] = {}

    def put_once(value: Any) -> Any:
        if id(value) not in shared:
            shared[id(value)] = ray.put(value)
        return shared[id(value)]

    def is_shared(value: Any, get: Callable[[int], Any]) -> bool:
        return not isinstance(value, _SCALARS) and all(get(r) is value for r in ranks)

    args, kwargs = list(args), list(kwargs)
    for i, value in enumerate(args[first]):
        if is_shared(value, lambda r, i=i: args[r][i]):
            ref = put_once(value)
            for r in ranks:
                args[r] = args[r][:i] + (ref,) + args[r][i + 1 :]
    for key, value in list(kwargs[first].items()):
        if is_shared(value, lambda r, key=key: kwargs[r][key]):
            ref = put_once(value)
            for r in ranks:
                kwargs[r] = {**kwargs[r], key: ref}
    return args, kwargs


def _check_worker_env(worker_env: dict[str, str] | None) -> dict[str, str]:
    """The extra environment variables of every worker: a dict of str to str not setting any of GROUP_ENV_KEYS."""
    if worker_env is None:
        return {}
    if not isinstance(worker_env, dict):
        raise TypeError(f"worker_env must be a dict of environment variables, got {type(worker_env).__name__}")
    bad = {key: value for key, value in worker_env.items() if not (isinstance(key, str) and isinstance(value, str))}
    if bad:
        raise TypeError(f"worker_env names and values must be strings, got {bad!r}")
    protected = sorted(set(worker_env) & set(GROUP_ENV_KEYS))
    if protected:
        raise ValueError(f"worker_env cannot override {protected}: the worker group sets {list(GROUP_ENV_KEYS)}")
    return dict(worker_env)


class RayWorkerGroup(WorkerGroup):
    """One Ray actor of `ray_cls_with_init` per bundle of `resource_pool`, driven as one object.

    Every `@register`ed method becomes a method of the group; any method can also be called by name on every rank
    (`execute_all_sync`, ...) or on rank 0 (`execute_rank_zero_sync`, ...). Each actor starts with RANK,
    WORLD_SIZE, LOCAL_RANK (0 on GPU, where Ray shows one GPU), LOCAL_WORLD_SIZE (also RAY_LOCAL_WORLD_SIZE),
    MASTER_ADDR/MASTER_PORT (picked by rank 0, which starts first), WG_PREFIX, WG_BACKEND=ray, VERL_NUM_THREADS,
    VERL_WORKER_DEVICE, then the device's and the caller's `worker_env` (which may not override those), at nice 0.
    `bin_pack=True`: STRICT_PACK placement groups (False: PACK); `detached=True` names the actors and lets them
    outlive the driver. For a fused class use `spawn` (one handle per role) or `fuse`.
    """

    requires_ray = True  # the trainer checks Ray's resources before creating groups of this class

    def __init__(
        self,
        resource_pool: RayResourcePool,
        ray_cls_with_init: RayClassWithInitArgs,
        name_prefix: str | None = None,
        bin_pack: bool = True,
        detached: bool = False,
        call_timeout_s: float | None = None,
        worker_env: dict[str, str] | None = None,
    ) -> None:
        require_ray()
        user_cls = ray_cls_with_init.user_cls
        if not (isinstance(user_cls, type) and issubclass(user_cls, Worker)):
            raise TypeError(f"a worker group needs a subclass of verl Worker, got {user_cls!r}")
        if ray_cls_with_init.fused_worker_used and not getattr(user_cls, "is_fused_worker", False):
            raise TypeError(
                f"fused_worker_used is set but {user_cls.__name__} is not a fused class; make it with "
                "create_colocated_worker_raw_cls (or create_colocated_worker_cls)"
            )
        self.worker_env = _check_worker_env(worker_env)
        if call_timeout_s is not None and not call_timeout_s > 0:
            raise ValueError(f"call_timeout_s must be None (no timeout) or > 0 seconds, got {call_timeout_s!r}")
        self.resource_pool = resource_pool
        self.name_prefix = name_prefix if name_prefix is not None else uuid.uuid4().hex[:6]
        self.role: str | None = None
        self.call_timeout_s = call_timeout_s
        self._user_cls = user_cls
        self._workers: list[ray.actor.ActorHandle] = []
        self._rank_nodes: list[str | None] = []  # the Ray node id of each rank's placement bundle
        strategy = "STRICT_PACK" if bin_pack else "PACK"
        self._create_workers(ray_cls_with_init, resource_pool.get_placement_groups(strategy, detached), detached)
        self._bind_methods(user_cls, method_prefix="")

    @property
    def world_size(self) -> int:
        return len(self._workers)

    @property
    def workers(self) -> list[ray.actor.ActorHandle]:
        """The Ray actor handles, in rank order."""
        return list(self._workers)

    @property
    def rank_nodes(self) -> list[str | None]:
        """The Ray node id each rank runs on (its placement bundle's), in rank order."""
        return list(self._rank_nodes)

    @property
    def label(self) -> str:
        """How errors name this group: its role (fused roles) and its name prefix."""
        if self.role is not None:
            return f"role '{self.role}' (worker group '{self.name_prefix}')"
        return f"worker group '{self.name_prefix}'"

    # -------------------------------------------------------------------------------- creating actors
    def _create_workers(self, cls_with_init: RayClassWithInitArgs, pgs: list[PlacementGroup], detached: bool) -> None:
        pool = self.resource_pool
        cls = cls_with_init.cls
        remote_cls = cls if isinstance(cls, ray.actor.ActorClass) else ray.remote(cls)
        master: dict[str, str] = {}
        rank = 0
        for pg, n_local in zip(pgs, pool.process_on_nodes):
            self._rank_nodes += bundle_nodes(pg, n_local)
            for local_rank in range(n_local):
                env_vars = {
                    "RANK": str(rank),
                    "WORLD_SIZE": str(pool.world_size),
                    # on GPU Ray shows each actor only its own device, so its device index is 0
                    "LOCAL_RANK": "0" if pool.use_gpu else str(local_rank),
                    "RAY_LOCAL_RANK": str(local_rank),
                    "LOCAL_WORLD_SIZE": str(n_local),
                    "RAY_LOCAL_WORLD_SIZE": str(n_local),
                    "WG_PREFIX": self.name_prefix,
                    "WG_BACKEND": "ray",
                    NUM_THREADS_ENV: str(pool.num_threads_per_process()),
                    **master,
                }
                # the device's speed-ups (verl.utils.acceleration): on a CPU the thread policy, OpenMP's and the
                # allocator's variables (verl.cpu); nothing on a GPU
                device = "cuda" if pool.use_gpu else "cpu"
                env_vars[WORKER_DEVICE_ENV] = device
                env_vars.update(acceleration.for_device(device).worker_env())
                # Ray runs its workers at nice 15: any process at the default priority (the driver, Ray's own
                # daemons, the user's other jobs) then preempts the worker doing all the compute
                env_vars[WORKER_NICENESS_ENV] = os.environ.get(WORKER_NICENESS_ENV, "0")
                env_vars.update(self.worker_env)
                options = dict(cls_with_init.options)
                runtime_env = dict(options.pop("runtime_env", None) or {})
                runtime_env["env_vars"] = {**(runtime_env.get("env_vars") or {}), **env_vars}
                options.update(pool.actor_resources())
                options["runtime_env"] = runtime_env
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=local_rank
                )
                if detached:
                    options["name"] = f"{self.name_prefix}{self._user_cls.__name__}_{rank}"
                    options["lifetime"] = "detached"
                actor = remote_cls.options(**options).remote(*cls_with_init.args, **cls_with_init.kwargs)
                self._workers.append(actor)
                if rank == 0:
                    ref = actor.get_master_addr_port.remote()
                    future = WorkerGroupFuture(
                        [ref], [0], lambda out: out[0], "__init__", self.label, self.call_timeout_s, self._rank_nodes
                    )
                    addr, port = future.get()
                    master = {"MASTER_ADDR": addr, "MASTER_PORT": port}
                rank += 1

    # ------------------------------------------------------------------------------ calling methods
    def _call(self, name: str, actor_method: str, attrs: RegisterAttrs, args: tuple, kwargs: dict) -> WorkerGroupFuture:
        calls = dispatch_calls(attrs.dispatch_mode, self.world_size, args, kwargs, worker_group=self)
        rank_zero_only = runs_on_rank_zero_only(attrs)
        ranks = [0] if rank_zero_only else list(range(self.world_size))
        args, kwargs = put_shared_arguments(calls.args, calls.kwargs, ranks)
        refs = [getattr(self._workers[r], actor_method).remote(*args[r], **kwargs[r]) for r in ranks]

        def finish(outputs: list[Any]) -> Any:
            return outputs[0] if rank_zero_only else collect_outputs(attrs.dispatch_mode, outputs, calls)

        return WorkerGroupFuture(refs, ranks, finish, name, self.label, self.call_timeout_s, self._rank_nodes)

    def _remote(self, rank: int, method_name: str, args: tuple, kwargs: dict) -> ray.ObjectRef:
        """Start worker method `method_name` on `rank` (a role handle: the role's method, via `_fuw_execute`)."""
        if self.role is not None:
            return self._workers[rank]._fuw_execute.remote(
                f"{self.role}{FUSED_METHOD_SEP}{method_name}", *args, **kwargs
            )
        return getattr(self._workers[rank], method_name).remote(*args, **kwargs)

    def _wait(self, refs: list[ray.ObjectRef], method_name: str) -> list[Any]:
        """The outputs of `refs` (ranks 0, 1, ...), with the group's timeout and death detection."""
        ranks = list(range(len(refs)))
        return WorkerGroupFuture(
            refs, ranks, list, method_name, self.label, self.call_timeout_s, self._rank_nodes
        ).get()

    def execute_all_async(self, method_name: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        """Start worker method `method_name` (registered or not) on every rank; one ObjectRef per rank. When
        every argument is a list of `world_size` items, rank i gets item i of each (verl's rule); otherwise
        every rank gets the arguments as they are."""
        n = self.world_size
        if all(isinstance(value, list) and len(value) == n for value in (*args, *kwargs.values())):
            per_rank = [(tuple(a[r] for a in args), {k: v[r] for k, v in kwargs.items()}) for r in range(n)]
        else:
            per_rank = [(args, kwargs)] * n
        return [self._remote(rank, method_name, *per_rank[rank]) for rank in range(n)]

    def execute_all_sync(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        """`execute_all_async`, waited for: the outputs in rank order."""
        return self._wait(self.execute_all_async(method_name, *args, **kwargs), method_name)

    def execute_rank_zero_async(self, method_name: str, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        """Start worker method `method_name` on rank 0 with the arguments as they are."""
        return self._remote(0, method_name, args, kwargs)

    def execute_rank_zero_sync(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """`execute_rank_zero_async`, waited for: rank 0's output."""
        return self._wait([self.execute_rank_zero_async(method_name, *args, **kwargs)], method_name)[0]

    execute_all = execute_all_async  # verl's names for the non-blocking calls
    execute_rank_zero = execute_rank_zero_async

    def _share_with(self, handle: RayWorkerGroup) -> None:
        handle.resource_pool = self.resource_pool
        handle.name_prefix = self.name_prefix
        handle.call_timeout_s = self.call_timeout_s
        handle.worker_env = self.worker_env
        handle._workers = self._workers
        handle._rank_nodes = self._rank_nodes


__all__ = [
    "RayClassWithInitArgs",
    "RayResourcePool",
    "RayWorkerGroup",
    "WorkerDiedError",
    "WorkerGroupFuture",
    "create_colocated_worker_cls",
    "create_colocated_worker_cls_fused",
    "create_colocated_worker_raw_cls",
]
