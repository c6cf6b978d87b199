"""ResourcePoolManager checks Ray's resources before any worker starts and names the shortage."""

import pytest

from verl.trainer.ppo.ray_trainer import ResourcePoolManager, Role

pytestmark = pytest.mark.ray


def _manager(spec, cpus_per_process=1):
    mapping = {Role.ActorRollout: "global_pool", Role.Critic: "global_pool"}
    return ResourcePoolManager(resource_pool_spec=spec, mapping=mapping, cpus_per_process=cpus_per_process)


def test_pools_that_fit_pass_the_check(ray_session):
    _manager({"global_pool": [2]}).check_resource_available()
    _manager({"global_pool": [1], "critic_pool": [1]}, cpus_per_process=2).check_resource_available()


@pytest.mark.parametrize(
    "spec, cpus, expected",
    [
        ({"global_pool": [8]}, 1, "asked 8 CPU"),  # more processes than CPUs
        ({"global_pool": [2]}, 3, "asked 6 CPU"),  # too many CPUs per process
        ({"global_pool": [3], "critic_pool": [2]}, 1, "asked 5 CPU"),  # two pools that do not fit together
    ],
)
def test_shortage_is_one_message_with_asked_and_available(ray_session, spec, cpus, expected):
    with pytest.raises(ValueError) as err:
        _manager(spec, cpus).check_resource_available()
    message = str(err.value)
    assert "\n" not in message
    assert expected in message and "Ray has 4 CPU available" in message
    assert "trainer.n_gpus_per_node" in message


def test_first_fit_places_each_node_share_on_one_node():
    from verl.trainer.ppo.resource_pool import _first_fit

    assert _first_fit([2, 2], [4])  # two pools share one node
    assert not _first_fit([3], [2, 2])  # one placement group cannot span nodes
    assert _first_fit([3, 1, 2, 2], [4, 4])
    assert _first_fit([3, 3], [4, 4, 1])  # one per node


@pytest.mark.parametrize(
    "spec, node_cpus, expected",
    [
        ({"global_pool": [1]}, [2, 2], 2),  # nnodes=1 on 2 nodes x 2 CPUs: one node's 2, not the cluster's 4
        ({"global_pool": [1, 1]}, [2, 2], 2),  # one worker per node
        ({"global_pool": [2]}, [4], 2),  # one node: its CPUs over its workers (the single-node figure)
        ({"global_pool": [1], "rollout_pool": [1]}, [2], 1),  # async: actor and rollout rank 0 share slot 0
        ({"global_pool": [1, 1]}, [8, 2, 16], 8),  # the two biggest nodes host the slots: the smaller of them
        ({"global_pool": [3]}, [2], 1),  # never below 1
    ],
)
def test_default_cpus_per_worker_is_a_nodes_share(monkeypatch, spec, node_cpus, expected):
    import ray

    nodes = [{"Alive": True, "Resources": {"CPU": float(c)}} for c in node_cpus] + [{"Alive": False, "Resources": {}}]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    assert _manager(spec).default_cpus_per_process() == expected
