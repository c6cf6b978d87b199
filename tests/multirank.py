"""Run a test's function on several ranks, each in its own child process, and wait for all of them.

The children come from multiprocessing's fork server: one clean process, started once per test session, that has
torch, transformers and verl's worker modules imported (`PRELOAD`), and forks a child per rank. So a child starts
in well under a second (a spawned one re-imports all of it, ~5-8 s on 2 cores), and it inherits nothing of the
pytest process: no Ray session and its logging threads, no process group an earlier test left, no lock some thread
held at the moment of a fork (a child forked from the pytest process itself hung that way in CI, once in a while).
"""

import multiprocessing
import os
import sys
import time

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRELOAD = [
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "transformers",
    "transformers.models.qwen2.modeling_qwen2",
    "verl.protocol",
    "verl.utils.fsdp_utils",
    "verl.workers.actor.dp_actor",
    "verl.workers.engine",
]


def preload_fork_server() -> None:
    """Have the fork server import `PRELOAD` and see the repository (takes effect only before the server starts:
    tests/conftest.py calls this at session start, so a reward manager's pool that starts it first gets it too)."""
    if REPO_ROOT not in sys.path:  # the server takes this process's sys.path when it starts; children import tests.*
        sys.path.insert(0, REPO_ROOT)
    multiprocessing.set_forkserver_preload(PRELOAD)


def run_ranks(fn, world_size: int, port: int, *args, timeout_s: float = 120) -> None:
    """Run fn(rank, world_size, port, *args) for every rank; fail the test if a rank raises or they all take longer
    than timeout_s (a rank that waits for a dead peer would otherwise hang the suite). The fork server's preload is
    set once, by tests/conftest.py at session start."""
    import torch.multiprocessing as mp

    context = mp.start_processes(fn, args=(world_size, port, *args), nprocs=world_size, join=False,
                                 start_method="forkserver")  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1):  # raises ProcessRaisedException / ProcessExitedException if a rank failed
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {world_size}-rank run of {fn.__name__} did not finish within {timeout_s:.0f} s")


def shard_on_cpu(model, **root_kwargs) -> None:
    """FSDP2-shard each decoder layer of `model`, then its root (`root_kwargs` go to the root's `fully_shard`), on a
    CPU mesh over the started gloo group. Without a mesh FSDP2 takes the accelerator when one is visible: the
    parameters then go to the GPU and gloo's collectives on them crash the rank (seen on an H200)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh, **root_kwargs)
