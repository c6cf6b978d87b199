"""Worker groups on Ray: resource pools (placement groups), one Ray actor per process, fused (colocated) roles.

Owns `RayResourcePool`, `RayClassWithInitArgs`, `RayWorkerGroup`, `WorkerGroupFuture`, `WorkerDiedError` and
`create_colocated_worker_cls`. Library code here never calls `ray.init`: the trainer (or a test fixture) starts
Ray first. Must not import trainer or worker (layer 7) code.

A call on a group, e.g. `critic_wg.compute_values(batch)`, runs the `@register`ed method of the same name on
every actor: the decorator's dispatch mode splits the arguments per rank, every rank runs, the outputs are
collected. Blocking methods return the collected result. Methods registered with `blocking=False` return a
`WorkerGroupFuture` at once; the caller collects it with `.get()`, e.g. to overlap two groups:

    critic_future = critic_wg.update_critic(batch)   # non-blocking: returns immediately
    actor_output = actor_wg.update_actor(batch)      # runs while the critic updates
    critic_output = critic_future.get()              # waits for every critic rank, then collects

Failures are bounded in time: when a worker process dies (killed, crashed, `os._exit`), the call raises
`WorkerDiedError` naming the method, the role and the rank as soon as Ray reports the death, even while other
ranks are still busy; with `call_timeout_s` set, a call still unfinished after that many seconds raises
`TimeoutError` naming the method, the role and the first unfinished rank (the remote work is not cancelled).
"""

from __future__ import annotations

import math
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from verl.protocol import DataProtoFuture
from verl.single_controller.base.decorator import (
    RegisterAttrs,
    collect_outputs,
    dispatch_calls,
    register,
    registered_methods,
    runs_on_rank_zero_only,
)
from verl.single_controller.base.worker import NUM_THREADS_ENV, Worker
from verl.single_controller.base.worker_group import WorkerGroup
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
from verl.utils import acceleration
from verl.utils.acceleration import WORKER_DEVICE_ENV

# How long to wait for a resource pool's placement groups before saying the cluster is too small.
PLACEMENT_GROUP_TIMEOUT_S = 120.0
# Ray's setting of its workers' nice value (Ray's default 15); the driver's value, else 0, is passed to every worker.
WORKER_NICENESS_ENV = "RAY_worker_niceness"


def _require_ray() -> None:
    if not ray.is_initialized():
        raise RuntimeError(
            "Ray is not initialised: call ray.init() before creating resource pools or worker groups "
            "(the trainer does this in main_ppo; tests use the ray_session fixture)"
        )


def _cpu_gpu(resources: dict[str, float]) -> dict[str, float]:
    return {key: resources[key] for key in ("CPU", "GPU") if key in resources}


class WorkerDiedError(RuntimeError):
    """A worker process of a group died (or Ray lost it) while a call on the group was pending."""


# --------------------------------------------------------------------------------------------- resources
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
        _require_ray()
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
    options (`update_options({"runtime_env": {...}})`, ...), to be instantiated once per rank."""

    def __init__(self, cls: type, *args: Any, **kwargs: Any) -> None:
        self.cls = cls
        self.args = args
        self.kwargs = kwargs
        self.options: dict[str, Any] = {}

    def update_options(self, options: dict[str, Any]) -> None:
        """Add Ray actor options (as for `ActorClass.options`); later calls override earlier keys."""
        if not isinstance(options, dict):
            raise TypeError(f"options must be a dict of Ray actor options, got {type(options).__name__}")
        self.options.update(options)

    @property
    def user_cls(self) -> type:
        """The plain Python class (unwrapped when `cls` is a `ray.remote` actor class)."""
        return getattr(self.cls, "__ray_actor_class__", self.cls)


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


class RayWorkerGroup(WorkerGroup):
    """One Ray actor of `ray_cls_with_init` per bundle of `resource_pool`, driven as one object.

    Every `@register`ed method of the class becomes a method of the group (see the module doc). Each actor
    is started with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
    VERL_NUM_THREADS and VERL_WORKER_DEVICE set (plus the device's `worker_env`, `verl.utils.acceleration`), at nice 0 (Ray's default is 15; a RAY_worker_niceness of the driver wins): rank 0 starts first and picks MASTER_ADDR (its node
    IP) and a free MASTER_PORT, then the other ranks start with those. RAY_LOCAL_RANK is the process's index on its node; LOCAL_RANK is
    the same on CPU but 0 on GPU, where Ray makes only the actor's own GPU visible (so `cuda:LOCAL_RANK`
    is its device). `bin_pack=True` keeps each node's processes on one node
    (STRICT_PACK placement groups; False: PACK). `detached=True` names the actors and lets them outlive the
    driver. For a fused class (`create_colocated_worker_cls`) use `spawn` to get one handle per role.
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
    ) -> None:
        _require_ray()
        user_cls = ray_cls_with_init.user_cls
        if not (isinstance(user_cls, type) and issubclass(user_cls, Worker)):
            raise TypeError(f"a worker group needs a subclass of verl Worker, got {user_cls!r}")
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

    def _share_with(self, handle: RayWorkerGroup) -> None:
        handle.resource_pool = self.resource_pool
        handle.name_prefix = self.name_prefix
        handle.call_timeout_s = self.call_timeout_s
        handle._workers = self._workers
        handle._rank_nodes = self._rank_nodes


# ------------------------------------------------------------------------------------------ colocation
def _forward_to_role(role: str, name: str) -> Callable:
    def method(self: Worker, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.fused_worker_dict[role], name)(*args, **kwargs)

    method.__name__ = f"{role}_{name}"
    return method


def _merge_options(class_dict: dict[str, RayClassWithInitArgs]) -> dict[str, Any]:
    """The roles' Ray options as one dict (runtime_env env_vars merged); conflicting values raise."""
    merged: dict[str, Any] = {}
    env_vars: dict[str, str] = {}
    for role, cls_with_init in class_dict.items():
        for key, value in cls_with_init.options.items():
            if key == "runtime_env":
                value = dict(value)
                for var, var_value in (value.pop("env_vars", None) or {}).items():
                    if env_vars.setdefault(var, var_value) != var_value:
                        raise ValueError(
                            f"role {role!r} sets env var {var}={var_value!r}, another role {env_vars[var]!r}"
                        )
            if key in merged and merged[key] != value:
                raise ValueError(f"role {role!r} sets Ray option {key}={value!r}, another role {merged[key]!r}")
            merged[key] = value
    if env_vars:
        merged["runtime_env"] = {**merged.get("runtime_env", {}), "env_vars": env_vars}
    return merged


def create_colocated_worker_cls(class_dict: dict[str, RayClassWithInitArgs]) -> RayClassWithInitArgs:
    """Fuse several roles (`{role: RayClassWithInitArgs}`) into one Worker class, one process per bundle.

    The fused worker holds one instance per role (`self.fused_worker_dict[role]`), all in one process and
    so on one device, sharing the rank's environment (and so one torch.distributed process group). Each
    registered method `m` of a role becomes `{role}_{m}` on the fused class with the same dispatch settings;
    `RayWorkerGroup(pool, fused).spawn(prefix_set=class_dict.keys())` gives a handle per role with the
    role's own method names.
    """
    if not class_dict:
        raise ValueError("create_colocated_worker_cls needs at least one role, got an empty class_dict")
    roles: dict[str, type] = {}
    init_args: dict[str, tuple[tuple, dict]] = {}
    for role, cls_with_init in class_dict.items():
        if not isinstance(role, str) or not role.isidentifier():
            raise ValueError(f"role names must be Python identifiers (they prefix method names), got {role!r}")
        if not isinstance(cls_with_init, RayClassWithInitArgs):
            raise TypeError(f"class_dict[{role!r}] must be a RayClassWithInitArgs, got {type(cls_with_init).__name__}")
        user_cls = cls_with_init.user_cls
        if not (isinstance(user_cls, type) and issubclass(user_cls, Worker)):
            raise TypeError(f"class_dict[{role!r}] must hold a subclass of verl Worker, got {user_cls!r}")
        roles[role] = user_cls
        init_args[role] = (cls_with_init.args, cls_with_init.kwargs)

    class FusedWorker(Worker):
        fused_roles = dict(roles)

        def __init__(self, role_init_args: dict[str, tuple[tuple, dict]]) -> None:
            super().__init__()
            self.fused_worker_dict = {
                role: self.fused_roles[role](*args, **kwargs) for role, (args, kwargs) in role_init_args.items()
            }

    for role, user_cls in roles.items():
        for name, attrs in registered_methods(user_cls).items():
            method = _forward_to_role(role, name)
            method = register(attrs.dispatch_mode, attrs.execute_mode, attrs.blocking)(method)
            setattr(FusedWorker, method.__name__, method)
    FusedWorker.__name__ = FusedWorker.__qualname__ = "FusedWorker_" + "_".join(roles)

    fused = RayClassWithInitArgs(FusedWorker, role_init_args=init_args)
    fused.update_options(_merge_options(class_dict))
    return fused


__all__ = [
    "RayClassWithInitArgs",
    "RayResourcePool",
    "RayWorkerGroup",
    "WorkerDiedError",
    "WorkerGroupFuture",
    "create_colocated_worker_cls",
]
