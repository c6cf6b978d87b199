"""`Worker`: the base class of every process a worker group drives (actor/rollout/ref, critic, reward model).

Reads the process's place in its group from the environment the group sets (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
`LOCAL_WORLD_SIZE`, `RAY_LOCAL_RANK`, `MASTER_ADDR`/`MASTER_PORT` (picked by rank 0), `VERL_NUM_THREADS`,
`VERL_WORKER_DEVICE`); never initialises torch.distributed itself. Also owns the per-mesh dp ranks for verl's nd
dispatch and, for fused roles, `fused_worker_dict`. Must not import trainer or worker code.
"""

from __future__ import annotations

import os
import socket

from verl.single_controller.base.decorator import Dispatch, register
from verl.utils import acceleration

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "RAY_LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
NUM_THREADS_ENV = "VERL_NUM_THREADS"


def _env_int(key: str, default: int | None = None) -> int:
    raw = os.environ.get(key)
    if raw is None:
        if default is None:
            raise RuntimeError(f"environment variable {key} is not set; a worker group sets it for each worker")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {key} must be an integer, got {raw!r}") from None


def get_node_ip() -> str:
    """This node's IP as Ray sees it inside a Ray process, else 127.0.0.1 (a plain local process)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


def node_label() -> str:
    """This process's node for messages: `<ip> (host <hostname>, Ray node <id>)` (the id's first 8 digits; no id
    outside a Ray session). Several nodes on one machine share the IP and host name but not the id."""
    label = f"{get_node_ip()} (host {socket.gethostname()}"
    try:
        import ray

        if ray.is_initialized():
            label += f", Ray node {ray.get_runtime_context().get_node_id()[:8]}"
    except ImportError:
        pass
    return label + ")"


def get_free_port() -> int:
    """A TCP port free on this node right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def set_torch_threads_from_env() -> int | None:
    """Set torch's intra-op threads to `VERL_NUM_THREADS` when it is set; return the number set (or None)."""
    raw = os.environ.get(NUM_THREADS_ENV)
    if raw is None:
        return None
    num_threads = int(raw)
    if num_threads < 1:
        raise ValueError(f"{NUM_THREADS_ENV} must be a positive integer, got {raw!r}")
    import torch

    torch.set_num_threads(num_threads)
    return num_threads


_RAYLET_WATCH_S = 1.0
_raylet_watched = False


def exit_when_raylet_dies(rank: int) -> bool:
    """In a Ray worker process (its parent is the node's raylet), a daemon thread that ends the process once the
    raylet is gone (the process is then re-parented): a worker on a lost node must not outlive its driver, and Ray
    itself, with the raylet dead, never stops it. Returns whether the watch was started."""
    import threading

    global _raylet_watched
    if _raylet_watched:  # fused roles: several Workers in one process, one watch
        return True
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/comm", encoding="utf-8") as f:
            if f.read().strip() != "raylet":
                return False
    except OSError:  # no /proc (not Linux): no watch
        return False

    def watch() -> None:
        import sys
        import time

        while os.getppid() == parent:
            time.sleep(_RAYLET_WATCH_S)
        print(f"rank {rank}: the raylet of this node (pid {parent}) is gone; exiting", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="verl-raylet-watch", daemon=True).start()
    _raylet_watched = True
    return True


class Worker:
    """One rank of a worker group. Subclasses must call `super().__init__()` first in their `__init__`.

    Outside a worker group (no `RANK` and no `WORLD_SIZE` set) it is a single process: rank 0 of 1, on
    127.0.0.1; the variables it chose are written to `os.environ` so `init_distributed()` finds them.
    """

    def __init__(self) -> None:
        if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
            os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
        self._rank = _env_int("RANK")
        self._world_size = _env_int("WORLD_SIZE")
        if not 0 <= self._rank < self._world_size:
            raise ValueError(f"RANK must be in [0, WORLD_SIZE={self._world_size}), got {self._rank}")
        self._local_rank = _env_int("LOCAL_RANK", default=0)
        self._local_world_size = _env_int("LOCAL_WORLD_SIZE", default=1)
        if self._rank == 0 and "MASTER_ADDR" not in os.environ:
            os.environ["MASTER_ADDR"] = get_node_ip()
            os.environ["MASTER_PORT"] = str(get_free_port())
        self._master_addr = os.environ.get("MASTER_ADDR")
        self._master_port = os.environ.get("MASTER_PORT")
        if self._master_addr is None or self._master_port is None:
            raise RuntimeError(
                f"rank {self._rank}: MASTER_ADDR and MASTER_PORT must be set for ranks other than 0 "
                f"(got MASTER_ADDR={self._master_addr!r}, MASTER_PORT={self._master_port!r})"
            )
        self.fused_worker_dict: dict[str, Worker] = {}  # the roles of this process when fused (by role)
        self._num_threads = set_torch_threads_from_env()
        exit_when_raylet_dies(self._rank)
        # this device's speed-ups for the process (verl.cpu on a CPU: allocator, BLAS and thread policy; none on GPU)
        acceleration.enter(acceleration.worker_device(), self._num_threads)

    @property
    def rank(self) -> int:
        """This worker's global rank in its group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of workers in the group."""
        return self._world_size

    @property
    def local_rank(self) -> int:
        """This worker's index among the group's workers on its node."""
        return self._local_rank

    def get_fused_worker_by_name(self, worker_name: str) -> Worker | None:
        """The fused role `worker_name` of this process (None when there is no such role)."""
        return self.fused_worker_dict.get(worker_name)

    def get_master_addr_port(self) -> tuple[str, str]:
        """`(MASTER_ADDR, MASTER_PORT)` of the group, as chosen by rank 0."""
        if not hasattr(self, "_master_addr"):
            raise RuntimeError(f"{type(self).__name__}.__init__ must call Worker.__init__ (super().__init__())")
        return self._master_addr, self._master_port

    def get_env(self) -> dict[str, str | None]:
        """The distributed environment variables as this process sees them (for checks and debugging)."""
        return {key: os.environ.get(key) for key in (*ENV_KEYS, NUM_THREADS_ENV, acceleration.WORKER_DEVICE_ENV)}

    # -------------------------------------------------- nd dispatch (verl's make_nd_compute_dataproto_dispatch_fn)
    def _mesh_info(self) -> tuple[dict[str, int], dict[str, bool]]:
        if not hasattr(self, "_dispatch_dp_rank"):
            self._dispatch_dp_rank: dict[str, int] = {}
            self._collect_dp_rank: dict[str, bool] = {}
        return self._dispatch_dp_rank, self._collect_dp_rank

    def _register_dispatch_collect_info(self, mesh_name: str, dp_rank: int, is_collect: bool) -> None:
        """Say that this worker is data-parallel rank `dp_rank` of `mesh_name` and whether its output is
        collected; the group's nd dispatch for that mesh reads it."""
        dispatch, collect = self._mesh_info()
        if mesh_name in dispatch or mesh_name in collect:
            raise ValueError(f"mesh_name {mesh_name} has been registered")
        dispatch[mesh_name] = dp_rank
        collect[mesh_name] = is_collect

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _query_dispatch_info(self, mesh_name: str) -> int:
        """This worker's dp rank in `mesh_name` (one per rank through the group)."""
        dispatch, _ = self._mesh_info()
        if mesh_name not in dispatch:
            raise KeyError(
                f"{mesh_name} is not registered in {type(self).__name__}; call _register_dispatch_collect_info"
            )
        return dispatch[mesh_name]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _query_collect_info(self, mesh_name: str) -> bool:
        return self.query_collect_info(mesh_name)

    def query_collect_info(self, mesh_name: str) -> bool:
        """Whether this worker's output is collected for `mesh_name`."""
        _, collect = self._mesh_info()
        if mesh_name not in collect:
            raise KeyError(
                f"{mesh_name} is not registered in {type(self).__name__}; call _register_dispatch_collect_info"
            )
        return collect[mesh_name]

    def get_dispatch_collect(self) -> dict[str, dict]:
        """All registered meshes: `{"dispatch_dp_rank": {mesh: dp rank}, "collect_dp_rank": {mesh: bool}}`."""
        dispatch, collect = self._mesh_info()
        return {"dispatch_dp_rank": dispatch, "collect_dp_rank": collect}

    def set_dispatch_collect(
        self, mesh_name: str, dispatch_dp_rank: dict[str, int], collect_dp_rank: dict[str, bool]
    ) -> None:
        """Register `mesh_name` from another worker's `get_dispatch_collect()` values (fused workers); a mesh
        already registered raises AssertionError, as in verl."""
        dispatch, collect = self._mesh_info()
        if mesh_name in dispatch or mesh_name in collect:
            raise AssertionError(f"{mesh_name} is already registered, {list(dispatch)}")  # verl's error type
        for dp_rank in dispatch_dp_rank.values():
            dispatch[mesh_name] = dp_rank
        for is_collect in collect_dp_rank.values():
            collect[mesh_name] = is_collect

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_system_metrics(self) -> dict[str, float]:
        """This process's CPU %, resident memory and (with CUDA) GPU memory/utilisation; one dict per rank."""
        from verl.utils.system_metrics import process_metrics

        return process_metrics()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sees_path(self, path: str) -> dict[str, object]:
        """Whether `path` exists where this rank runs (a file another node wrote is there only on shared storage):
        `{"rank", "node", "exists"}`, one dict per rank."""
        return {"rank": self.rank, "node": node_label(), "exists": os.path.exists(path)}
