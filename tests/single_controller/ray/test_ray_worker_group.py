"""Worker groups on a local Ray: dispatch modes with 1 and 2 ranks, the environment each rank sees, a gloo
all_reduce between the actors, fused roles in one process, overlapping non-blocking calls, timeouts and dead
workers. Groups are module-scoped (each actor costs seconds to start) and their resources are given back at
the end of the module."""

import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from tests.load import time_scale
from verl.cpu import threads as cpu_share
from verl.protocol import DataProto
from verl.single_controller.base import Dispatch, Execute, Worker, register
from verl.single_controller.ray import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    WorkerDiedError,
    WorkerGroupFuture,
    create_colocated_worker_cls,
)
from verl.single_controller.ray.base import put_shared_arguments

pytestmark = pytest.mark.ray


class ToyWorker(Worker):
    def __init__(self, offset: int = 0):
        super().__init__()
        self.offset = offset

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def add_rank(self, x):
        return x + self.offset + 100 * self.rank

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def echo(self, x, tag=None):
        return (self.rank, x, tag)

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def square(self, x):
        return (self.rank, x * x)

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def whoami(self):
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def rank_zero_only(self, x):
        return (self.rank, x)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def double(self, data: DataProto) -> DataProto:
        n = len(data)
        return DataProto.from_dict(
            tensors={"y": 2 * data.batch["x"], "rank": torch.full((n,), self.rank)},
            non_tensors={"uid": data.non_tensor_batch["uid"]},
            meta_info={"metrics": {"rows": n}},
        )

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def chunk_stats(self, data: DataProto) -> dict:
        return {"rank": self.rank, "rows": len(data), "sum": float(data.batch["x"].sum())}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def env(self):
        env = {**self.get_env(), "pid": os.getpid(), "threads": torch.get_num_threads(), "flag": os.getenv("TOY_FLAG")}
        env.update({var: os.getenv(var) for var in ("OMP_WAIT_POLICY", "MALLOC_ARENA_MAX", "VERL_ADAPTIVE_THREADS")})
        return {**env, "nice": os.nice(0), "thread_policy": cpu_share._POLICY is not None}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce(self, value: float):
        import torch.distributed as dist

        dist.init_process_group(backend="gloo", init_method="env://")
        try:
            t = torch.tensor([value * (self.rank + 1)])
            dist.all_reduce(t)
            return dist.get_world_size(), t.item()
        finally:
            dist.destroy_process_group()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fail_on_rank(self, rank: int):
        if self.rank == rank:
            raise ValueError(f"bad input on rank {rank}")
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def sleep(self, seconds: float):
        time.sleep(seconds)
        return self.rank


class CriticRole(Worker):
    def __init__(self, width: int):
        super().__init__()
        self.width = width

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self):
        return os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def describe(self):
        return ("critic", self.rank, self.width)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def nap(self, seconds: float):
        time.sleep(seconds)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def exit_on_rank(self, rank: int, busy_s: float):
        if self.rank == rank:
            os._exit(1)
        time.sleep(busy_s)
        return self.rank


def _toy_proto(n: int) -> DataProto:
    return DataProto.from_dict(
        tensors={"x": torch.arange(n, dtype=torch.float32)},
        non_tensors={"uid": np.array([f"u{i}" for i in range(n)], dtype=object)},
    )


@pytest.fixture(scope="module")
def started(ray_session):
    """Two groups, started side by side (each actor takes seconds to start):
    - "fused": roles "toy" and "critic" fused into one process per rank, 2 ranks of half a CPU each;
    - "one": a plain 1-rank ToyWorker group with 2 CPUs and a runtime_env flag.
    The last tests of the module kill the fused group's workers."""
    fused_pool = RayResourcePool(process_on_nodes=[2], cpus_per_process=0.5, name_prefix="fused")
    class_dict = {
        "toy": RayClassWithInitArgs(ray_session.remote(ToyWorker)),
        "critic": RayClassWithInitArgs(CriticRole, width=8),
    }
    one_pool = RayResourcePool(process_on_nodes=[1], cpus_per_process=2, name_prefix="one")
    one_cls = RayClassWithInitArgs(ToyWorker, offset=5)
    one_cls.update_options({"runtime_env": {"env_vars": {"TOY_FLAG": "on"}}})
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            fused = pool.submit(RayWorkerGroup, fused_pool, create_colocated_worker_cls(class_dict), name_prefix="fz")
            one = pool.submit(RayWorkerGroup, one_pool, one_cls, name_prefix="toy1")
            started = {"fused": fused.result(), "one": one.result()}
        started["roles"] = started["fused"].spawn(prefix_set=class_dict.keys())
        yield started
    finally:
        fused_pool.remove_placement_groups()
        one_pool.remove_placement_groups()


@pytest.fixture(scope="module")
def fused(started):
    """(the fused group, {role: handle})."""
    return started["fused"], started["roles"]


@pytest.fixture(scope="module")
def groups(started):
    """{1: the plain 1-rank group, 2: the 2-rank "toy" role of the fused group}."""
    return {1: started["one"], 2: started["roles"]["toy"]}


@pytest.mark.parametrize("n", [1, 2])
def test_one_to_all_all_to_all_dp_compute_and_rank_zero(groups, n):
    wg = groups[n]
    assert wg.world_size == n and len(wg.workers) == n
    offset = 5 if n == 1 else 0
    assert wg.add_rank(1) == [1 + offset + 100 * r for r in range(n)]
    assert wg.echo([f"a{r}" for r in range(n)], tag=list(range(n))) == [(r, f"a{r}", r) for r in range(n)]
    assert wg.square(list(range(2, 2 + n))) == [(r, (2 + r) ** 2) for r in range(n)]
    assert wg.whoami() == 0
    assert wg.rank_zero_only("z") == (0, "z")
    with pytest.raises(ValueError, match=f"one item per rank \\({n} items\\)"):
        wg.echo(list(range(n + 1)))


def test_an_argument_every_rank_gets_is_put_in_the_object_store_once(groups, ray_session):
    big = {"w": torch.arange(10)}
    args, kwargs = put_shared_arguments([(big, 3)] * 2, [{"k": big, "s": "x"}] * 2, [0, 1])
    ref = args[0][0]
    assert isinstance(ref, ray_session.ObjectRef) and args[1][0] is ref and kwargs[0]["k"] is ref  # one put
    assert args[0][1] == 3 and kwargs[1]["s"] == "x"  # scalars travel inline
    assert torch.equal(ray_session.get(ref)["w"], big["w"])
    distinct, _ = put_shared_arguments([({"a": 1},), ({"a": 1},)], [{}, {}], [0, 1])  # equal, not the same
    assert not isinstance(distinct[0][0], ray_session.ObjectRef)
    one_rank, _ = put_shared_arguments([(big,)], [{}], [0])
    assert one_rank[0][0] is big
    # a ONE_TO_ALL call with a tensor hands the value (not the ref) to both ranks
    out = groups[2].add_rank(torch.ones(3))
    assert [o.tolist() for o in out] == [[1.0] * 3, [101.0] * 3]


@pytest.mark.parametrize("n", [1, 2])
def test_dp_compute_proto_uneven_batch_keeps_rows_and_order(groups, n):
    out = groups[n].double(_toy_proto(5))
    assert isinstance(out, DataProto) and len(out) == 5
    assert out.batch["y"].tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]
    assert list(out.non_tensor_batch["uid"]) == ["u0", "u1", "u2", "u3", "u4"]
    # 2 ranks: padded to 6 rows, rank 0 gets rows 0-2, rank 1 rows 3, 4 and a copy of row 0 (dropped)
    assert out.batch["rank"].tolist() == ([0] * 5 if n == 1 else [0, 0, 0, 1, 1])
    assert out.meta_info["metrics"] == {"rows": [5] if n == 1 else [3, 3]}
    expected = (
        [{"rank": 0, "rows": 5, "sum": 10.0}]
        if n == 1
        else [
            {"rank": 0, "rows": 3, "sum": 3.0},
            {"rank": 1, "rows": 3, "sum": 7.0},
        ]
    )
    assert groups[n].chunk_stats(_toy_proto(5)) == expected


def test_each_rank_sees_its_environment(groups, ray_session):
    envs = groups[2].env()
    node_ip = ray_session.util.get_node_ip_address()
    assert [e["RANK"] for e in envs] == ["0", "1"]
    assert [e["LOCAL_RANK"] for e in envs] == [e["RAY_LOCAL_RANK"] for e in envs] == ["0", "1"]
    assert {e["WORLD_SIZE"] for e in envs} == {"2"} and {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"}
    assert {e["MASTER_ADDR"] for e in envs} == {node_ip}
    assert len({e["MASTER_PORT"] for e in envs}) == 1 and 0 < int(envs[0]["MASTER_PORT"]) < 65536
    assert envs[0]["pid"] != envs[1]["pid"] != os.getpid()
    assert [(e["VERL_NUM_THREADS"], e["threads"]) for e in envs] == [("1", 1), ("1", 1)]
    assert [e["flag"] for e in envs] == [None, None]
    assert [e["nice"] for e in envs] == [0, 0]  # Ray's default for workers is nice 15 (preempted by everything)
    # CPU workers: OpenMP's own waiting (the driver's setting, if any), the thread count following the machine's
    # load (verl.cpu.threads), and one glibc heap for all threads
    expected = (os.environ.get("OMP_WAIT_POLICY"), os.environ.get("MALLOC_ARENA_MAX", "1"))
    assert {(e["OMP_WAIT_POLICY"], e["MALLOC_ARENA_MAX"]) for e in envs} == {expected}
    assert all(e["VERL_ADAPTIVE_THREADS"] == "1" and e["thread_policy"] for e in envs)

    (one,) = groups[1].env()
    assert (one["RANK"], one["WORLD_SIZE"], one["MASTER_ADDR"]) == ("0", "1", node_ip)
    assert (one["VERL_NUM_THREADS"], one["threads"]) == ("2", 2)  # 2 CPUs per process -> 2 torch threads
    assert one["flag"] == "on"  # update_options runtime_env reaches the actor alongside the group's env vars


def test_an_exception_in_a_method_keeps_its_type_and_names_the_rank(groups):
    with pytest.raises(ValueError, match="bad input on rank 1") as excinfo:
        groups[2].fail_on_rank(1)
    assert "raised by 'fail_on_rank' on role 'toy' (worker group 'fz') rank 1" in excinfo.value.__notes__
    assert groups[2].fail_on_rank(5) == [0, 1]  # the workers are still usable


def test_gloo_all_reduce_between_the_actors(groups):
    # rank r contributes 1.5 * (r + 1): 1.5 + 3.0
    assert groups[2].all_reduce(1.5) == [(2, 4.5), (2, 4.5)]


@pytest.mark.serial  # asserts wall time or CPU share: run alone (scripts/run_tests.sh)
def test_non_blocking_calls_on_two_groups_overlap(groups):
    # every rank's first call is slow (~5 s on a 2-core machine): make it before the clock starts, for when this
    # test runs first in its module (scripts/run_tests.sh's serial pass)
    assert groups[1].sleep(0.0).get() == [0] and groups[2].sleep(0.0).get() == [0, 1]
    scale = time_scale()  # the calls' overhead grows on a busy machine; the 1 s sleeps do not
    start = time.monotonic()
    fut1 = groups[1].sleep(1.0)
    fut2 = groups[2].sleep(1.0)
    assert isinstance(fut1, WorkerGroupFuture) and time.monotonic() - start < 0.5 * scale
    assert fut2.get() == [0, 1]
    assert fut1.get() == [0] and fut1.get() == [0] and fut1.done()
    assert time.monotonic() - start < 1.0 + 0.8 * scale  # side by side: one after another would be 2 s


def test_fused_roles_share_one_process_and_call_their_own_methods(fused):
    group, handles = fused
    toy, critic = handles["toy"], handles["critic"]
    assert sorted(handles) == ["critic", "toy"] and toy.world_size == critic.world_size == 2
    pids = critic.pid()
    assert [e["pid"] for e in toy.env()] == pids and pids[0] != pids[1]
    assert critic.describe() == [("critic", 0, 8), ("critic", 1, 8)]
    assert toy.add_rank(1) == [1, 101]
    assert not hasattr(toy, "nap") and not hasattr(critic, "add_rank")
    assert group.critic_describe() == critic.describe()  # the fused group has the prefixed names
    assert group.toy_whoami() == 0
    with pytest.raises(ValueError, match=r"unknown role 'ref'; this group's fused roles are \['critic', 'toy'\]"):
        group.spawn(prefix_set=["ref"])


@pytest.mark.serial  # asserts wall time or CPU share: run alone (scripts/run_tests.sh)
def test_call_timeout_names_method_role_and_rank(fused):
    _, handles = fused
    critic = handles["critic"]
    critic.call_timeout_s = 0.3
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"'nap' on role 'critic' \(worker group 'fz'\) rank 0 did not finish"):
            critic.nap(2.0)
        assert time.monotonic() - start < 1.5
    finally:
        critic.call_timeout_s = None


def test_a_worker_exiting_mid_call_fails_the_call_fast(fused):
    _, handles = fused
    start = time.monotonic()
    # rank 1 exits while rank 0 stays busy for 30 s: the call must not wait for rank 0
    with pytest.raises(WorkerDiedError, match=r"'exit_on_rank' on role 'critic' \(worker group 'fz'\) rank 1 failed"):
        handles["critic"].exit_on_rank(1, 30.0)
    assert time.monotonic() - start < 10.0


def test_a_killed_worker_fails_the_next_call_naming_role_and_rank(fused, ray_session):
    group, handles = fused
    ray_session.kill(group.workers[0])
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"'whoami' on role 'toy' \(worker group 'fz'\) rank 0 failed"):
        handles["toy"].whoami()
    assert time.monotonic() - start < 10.0


def test_bad_inputs_are_rejected_before_starting_anything(ray_session):
    with pytest.raises(ValueError, match=r"process_on_nodes must be a non-empty list of positive ints, got \[0\]"):
        RayResourcePool(process_on_nodes=[0])
    with pytest.raises(ValueError, match="cpus_per_process must be > 0, got 0"):
        RayResourcePool(process_on_nodes=[1], cpus_per_process=0)
    with pytest.raises(TypeError, match="needs a subclass of verl Worker"):
        RayWorkerGroup(RayResourcePool(process_on_nodes=[1]), RayClassWithInitArgs(dict))
    with pytest.raises(ValueError, match="role names must be Python identifiers"):
        create_colocated_worker_cls({"critic-1": RayClassWithInitArgs(CriticRole, width=8)})
