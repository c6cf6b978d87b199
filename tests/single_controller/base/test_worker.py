"""`Worker` reads its place in the group from the environment; outside a group it is rank 0 of 1."""

import os

import pytest
import torch

from verl.single_controller.base.worker import (
    NUM_THREADS_ENV,
    Worker,
    get_node_ip,
)


def test_outside_a_group_a_worker_is_rank_zero_of_one(clean_env):
    worker = Worker()
    assert (worker.rank, worker.world_size, worker.local_rank) == (0, 1, 0)
    addr, port = worker.get_master_addr_port()
    assert addr == get_node_ip() and 0 < int(port) < 65536  # 127.0.0.1, or Ray's node IP after another test's ray.init
    # written back so init_distributed() finds them
    assert os.environ["RANK"] == "0" and os.environ["WORLD_SIZE"] == "1"
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == (addr, port)


def test_a_worker_reads_the_group_environment(clean_env):
    env = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29511"}
    for key, val in env.items():
        clean_env.setenv(key, val)
    worker = Worker()
    assert (worker.rank, worker.world_size, worker.local_rank) == (2, 4, 0)
    assert worker.get_master_addr_port() == ("10.0.0.7", "29511")
    assert worker.get_env()["LOCAL_WORLD_SIZE"] is None


def test_rank_zero_keeps_a_given_master_and_other_ranks_need_one(clean_env):
    for key, val in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}.items():
        clean_env.setenv(key, val)
    assert Worker().get_master_addr_port() == ("10.0.0.1", "1234")
    clean_env.setenv("RANK", "1")
    clean_env.delenv("MASTER_ADDR")
    with pytest.raises(RuntimeError, match="rank 1: MASTER_ADDR and MASTER_PORT must be set"):
        Worker()


def test_bad_rank_values_are_rejected(clean_env):
    clean_env.setenv("RANK", "3")
    clean_env.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"RANK must be in \[0, WORLD_SIZE=2\), got 3"):
        Worker()
    clean_env.setenv("RANK", "one")
    with pytest.raises(ValueError, match="RANK must be an integer, got 'one'"):
        Worker()
    clean_env.delenv("RANK")
    with pytest.raises(RuntimeError, match="environment variable RANK is not set"):
        Worker()


def test_verl_num_threads_sets_torch_threads(clean_env):
    before = torch.get_num_threads()
    try:
        clean_env.setenv(NUM_THREADS_ENV, "3")
        Worker()
        assert torch.get_num_threads() == 3
        clean_env.setenv(NUM_THREADS_ENV, "0")
        with pytest.raises(ValueError, match="VERL_NUM_THREADS must be a positive integer, got '0'"):
            Worker()
    finally:
        torch.set_num_threads(before)


def test_a_subclass_that_skips_worker_init_gets_a_clear_error():
    class Broken(Worker):
        def __init__(self):
            pass

    with pytest.raises(RuntimeError, match=r"Broken.__init__ must call Worker.__init__"):
        Broken().get_master_addr_port()


def test_a_fused_role_copies_another_workers_meshes_once(clean_env):
    ref, actor, fused = Worker(), Worker(), Worker()
    ref._register_dispatch_collect_info("ref", dp_rank=0, is_collect=True)
    actor._register_dispatch_collect_info("actor", dp_rank=3, is_collect=False)
    fused.set_dispatch_collect("ref", **ref.get_dispatch_collect())
    fused.set_dispatch_collect("actor", **actor.get_dispatch_collect())
    assert fused.get_dispatch_collect() == {
        "dispatch_dp_rank": {"ref": 0, "actor": 3},
        "collect_dp_rank": {"ref": True, "actor": False},
    }
    assert fused._query_dispatch_info("actor") == 3 and fused._query_collect_info("ref") is True
    with pytest.raises(AssertionError, match=r"actor is already registered, \['ref', 'actor'\]"):
        fused.set_dispatch_collect("actor", **actor.get_dispatch_collect())
    with pytest.raises(ValueError, match="mesh_name ref has been registered"):
        ref._register_dispatch_collect_info("ref", dp_rank=1, is_collect=False)
    # not fused: no roles of its own
    assert fused.fused_worker_dict == {} and fused.get_fused_worker_by_name("actor") is None
