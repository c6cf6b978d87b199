"""LocalWorkerGroup (trainer.single_process): the worker runs in this process, group calls dispatch and collect
as on Ray (one rank), non-blocking calls return a finished future, fused roles spawn handles, and `close` puts
back the environment variables the group set."""

import os

import pytest

from verl.cpu import threads as cpu_share
from verl.single_controller import (
    LocalWorkerGroup,
    RayClassWithInitArgs,
    RayResourcePool,
    Worker,
    create_colocated_worker_cls,
)
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.local import close_local_worker_groups


class _Echo(Worker):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def env(self):
        return os.environ["RANK"], os.environ["WORLD_SIZE"], self.scale

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def later(self, x):
        return x * self.scale


def test_local_worker_group_calls_the_worker_in_process_and_restores_the_environment(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "7")
    monkeypatch.delenv("VERL_ADAPTIVE_THREADS", raising=False)
    group = LocalWorkerGroup(RayResourcePool([1]), RayClassWithInitArgs(_Echo, 3))
    assert group.world_size == 1
    assert group.env() == [("0", "1", 3)]  # ONE_TO_ALL: one output per rank, as on Ray
    assert cpu_share._POLICY is not None  # a CPU worker's calls follow the machine's load (cpu_share)
    future = group.later(5)
    assert future.done() and future.get() == [15]
    group.close()
    assert "RANK" not in os.environ and os.environ["WORLD_SIZE"] == "7"
    assert cpu_share._POLICY is None and "VERL_ADAPTIVE_THREADS" not in os.environ
    with pytest.raises(ValueError, match=r"exactly one worker.*\[2\] processes per node"):
        LocalWorkerGroup(RayResourcePool([2]), RayClassWithInitArgs(_Echo, 3))


class _Doubler(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def double(self, x):
        return 2 * x


def test_fused_roles_share_one_in_process_worker_and_close_once(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    fused = create_colocated_worker_cls(
        {"echo": RayClassWithInitArgs(_Echo, 4), "doubler": RayClassWithInitArgs(_Doubler)}
    )
    handles = LocalWorkerGroup(RayResourcePool([1]), fused).spawn(prefix_set=["echo", "doubler"])
    assert handles["echo"].later(2).get() == [8] and handles["doubler"].double(21) == [42]
    assert handles["echo"].workers == handles["doubler"].workers  # one worker object for both roles
    with pytest.raises(ValueError, match="unknown role 'critic'"):
        LocalWorkerGroup(RayResourcePool([1]), fused).spawn(prefix_set=["critic"])
    close_local_worker_groups()
    assert "RANK" not in os.environ
    handles["doubler"].close()  # already closed by close_local_worker_groups: nothing to do
