"""A Ray group of a subclass of a fused class (`create_colocated_worker_raw_cls`): `fuse` sets one handle per role
on the group, a method of the subclass combines the roles in the worker, `execute_*` call any method by name (a
role handle: that role's), and the caller's `worker_env` reaches every rank next to the group's own variables,
which it may not override. One 2-rank group for the module (each actor takes seconds to start)."""

import os

import pytest

from verl.single_controller.base import Dispatch, Worker, register
from verl.single_controller.ray import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    create_colocated_worker_raw_cls,
)

pytestmark = pytest.mark.ray


class Adder(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def add(self, x):
        return x + self.rank

    def rank_and(self, x):
        return (self.rank, x)


class Subtractor(Worker):
    def __init__(self, val):
        super().__init__()
        self.val = val

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def sub(self, x):
        return x - self.val


ROLES = {"adder": RayClassWithInitArgs(Adder), "subtractor": RayClassWithInitArgs(Subtractor, val=10)}


class Hybrid(create_colocated_worker_raw_cls(ROLES)):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def add_then_sub(self, x):
        return self.subtractor.sub(self.adder.add(x))

    def getenv(self, key):
        return os.getenv(key, f"{key} not set")


@pytest.fixture(scope="module")
def group(ray_session):
    pool = RayResourcePool(process_on_nodes=[2], cpus_per_process=0.5, name_prefix="hyb")
    cls = RayClassWithInitArgs(ray_session.remote(Hybrid))
    cls.fused_worker_used = True
    try:
        yield RayWorkerGroup(pool, cls, name_prefix="hy", worker_env={"HYBRID_FLAG": "on"})
    finally:
        pool.remove_placement_groups()


def test_fuse_gives_one_handle_per_role_and_the_subclass_combines_them(group):
    group.fuse(ROLES.keys())
    x = group.adder.add(0.5)
    assert x == [0.5, 1.5]
    assert group.subtractor.sub(x) == [-9.5, -8.5]  # ALL_TO_ALL: rank i gets x[i]
    assert group.add_then_sub(0.5) == [-9.5, -8.5]  # the same, inside each worker
    assert not hasattr(group.adder, "sub") and group.adder.world_size == 2
    group.fuse(["adder"])  # fusing again replaces the handle
    assert group.adder.add(1) == [1, 2]


def test_execute_calls_any_method_by_name_on_every_rank_or_rank_zero(group, ray_session):
    assert group.execute_all_sync("getenv", "HYBRID_FLAG") == ["on", "on"]
    assert group.execute_all_sync("getenv", key=["RANK", "WORLD_SIZE"]) == ["0", "2"]  # a list per rank: split
    assert group.execute_rank_zero_sync("getenv", key="RANK") == "0"
    refs = group.execute_all("getenv", "WG_PREFIX")  # the non-blocking forms return ObjectRefs
    assert ray_session.get(refs) == ["hy", "hy"] and ray_session.get(group.execute_rank_zero("getenv", "RANK")) == "0"
    # a role handle calls its role's method (unregistered ones too) through the fused worker's _fuw_execute
    adder = group.spawn(["adder"])["adder"]
    assert adder.execute_all_sync("rank_and", "z") == [(0, "z"), (1, "z")]
    assert adder.execute_all_sync("rank_and", [7, 8]) == [(0, 7), (1, 8)]
    assert adder.execute_all_sync("rank_and", [7, 8, 9]) == [(0, [7, 8, 9]), (1, [7, 8, 9])]  # not one per rank
    assert adder.execute_rank_zero_sync("rank_and", x=[1, 2]) == (0, [1, 2])  # rank zero: never split


def test_each_rank_gets_the_group_variables_and_the_callers_worker_env(group):
    keys = ["RAY_LOCAL_WORLD_SIZE", "LOCAL_WORLD_SIZE", "WG_PREFIX", "WG_BACKEND", "HYBRID_FLAG", "RANK"]
    assert [group.execute_all_sync("getenv", key) for key in keys] == [
        ["2", "2"],
        ["2", "2"],
        ["hy", "hy"],
        ["ray", "ray"],
        ["on", "on"],
        ["0", "1"],
    ]


def test_bad_worker_env_and_a_false_fused_flag_are_refused_before_starting_anything(ray_session):
    pool = RayResourcePool(process_on_nodes=[1], cpus_per_process=0.5)
    adder = RayClassWithInitArgs(Adder)
    with pytest.raises(ValueError, match=r"worker_env cannot override \['RANK', 'WG_PREFIX'\]"):
        RayWorkerGroup(pool, adder, worker_env={"WG_PREFIX": "x", "RANK": "3", "OK": "1"})
    with pytest.raises(TypeError, match=r"worker_env names and values must be strings, got \{'N': 1\}"):
        RayWorkerGroup(pool, adder, worker_env={"N": 1})
    adder.fused_worker_used = True
    with pytest.raises(TypeError, match="fused_worker_used is set but Adder is not a fused class"):
        RayWorkerGroup(pool, adder)
    assert pool._placement_groups is None  # nothing was reserved


def test_a_role_that_clashes_with_a_group_attribute_is_refused(group, monkeypatch):
    monkeypatch.setattr(group, "adder", group.add_then_sub, raising=False)  # e.g. a method named like the role
    with pytest.raises(ValueError, match="role 'adder' clashes with the worker group attribute of that name"):
        group.fuse(["adder"])
    with pytest.raises(
        ValueError, match=r"unknown role 'critic'; this group's fused roles are \['adder', 'subtractor'\]"
    ):
        group.fuse(["critic"])
