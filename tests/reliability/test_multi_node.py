"""Training on a Ray cluster of several nodes, simulated on this machine: a head and a second node from Ray's
`ray.cluster_utils.Cluster`, or a second node started with `ray start` in a private mount namespace (`unshare -m`,
tmpfs mounted over folders) so that it has "a disk of its own". The driver is the real
`python -m verl.trainer.main_ppo` attached with RAY_ADDRESS, `trainer.nnodes=2`, one worker per node.

- two nodes: the workers land on both (the driver's `placement:` line, from Ray's placement groups, names both
  node ids), 2 GRPO steps, a checkpoint holding both ranks' shards, a resume to step 3; `trainer.nnodes=1` on
  the same cluster sizes its worker from one node (not the cluster's total, which no node has); `nnodes=4` on two
  nodes fails in seconds with one line naming what was asked and what each node has;
- a node without the checkpoint folder's storage: refused before training, naming the node, and nothing is marked
  complete; a node without the model folder: the error names the node and the folder;
- a node lost mid-run (its raylet killed): the driver names the node, the role, the ranks and the step within a
  bounded time and exits 1, the node's worker does not outlive it, the checkpoints already written stay complete,
  and on the restored cluster (a new node) `resume_mode=auto` ends with the uninterrupted run's samples and rewards
  exactly and its losses and weights to float rounding (two uninterrupted 2-rank runs differ that much here);
- a driver whose Ray authentication does not match the cluster's: the error says so (Ray's reason is otherwise
  only in its logs).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
import torch

from tests.cpu_overrides import CPU_OVERRIDES
from tests.ppo_e2e import NOT_COMPARED_PREFIXES, grpo_args, hf_weights, step_metrics, write_data
from verl.trainer.ppo import checkpoint as ckpt

pytestmark = [pytest.mark.slow, pytest.mark.ray]

RAY_CLI = os.path.join(os.path.dirname(sys.executable), "ray")
NODE_CPUS = 2


# ---------------------------------------------------------------------------------------------- clusters
class TwoNodes:
    """A head node (this machine's view of every folder) and node B, as Ray node ids."""

    def __init__(self, cluster, b_node_id: str, b_raylet_pid: int | None):
        self.cluster, self.address = cluster, cluster.address
        self.head_id, self.b_id, self.b_raylet_pid = cluster.head_node.node_id, b_node_id, b_raylet_pid

    def alive_nodes(self) -> list[str]:
        return [n["NodeID"] for n in self.cluster.global_state.node_table() if n["Alive"]]


def _wait_for_nodes(cluster, count: int, timeout_s: float = 60) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [n for n in cluster.global_state.node_table() if n["Alive"]]
        if len(alive) >= count:
            return alive
        time.sleep(0.5)
    pytest.fail(f"the cluster did not reach {count} alive nodes within {timeout_s} s")


def _kill_tree(pid: int) -> None:
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    procs = [root, *root.children(recursive=True)]
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


@contextmanager
def two_nodes(private: list[Path] | None = None):
    """A 2-node cluster of NODE_CPUS CPUs each. With `private`, node B runs in a mount namespace of its own where
    each of those folders is an empty tmpfs (its own disk there)."""
    from ray.cluster_utils import Cluster

    # Ray records a test cluster as the machine's "current" one under RAY_TMPDIR, where any ray.init() without an
    # address (other tests, running beside this one) would join it: the cluster gets a temp folder of its own
    saved_tmpdir = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="ray_mn_")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": NODE_CPUS})
    node_b = None
    try:
        if private is None:
            node = cluster.add_node(num_cpus=NODE_CPUS)
            _wait_for_nodes(cluster, 2)
            yield TwoNodes(cluster, node.node_id, node.all_processes["raylet"][0].process.pid)
            return
        mounts = " && ".join(f"mount -t tmpfs none {folder}" for folder in private)
        script = (f"mount --make-rprivate / && {mounts} && exec {RAY_CLI} start --address={cluster.address} "
                  f"--num-cpus={NODE_CPUS} --block")  # fmt: skip
        env = {**os.environ}  # RAY_TMPDIR: the cluster's own (see above)
        node_b = subprocess.Popen(["unshare", "-m", "sh", "-c", script], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True, env=env)  # fmt: skip
        alive = _wait_for_nodes(cluster, 2)
        b_id = next(n["NodeID"] for n in alive if n["NodeID"] != cluster.head_node.node_id)
        yield TwoNodes(cluster, b_id, None)
    finally:
        if node_b is not None:
            _kill_tree(node_b.pid)
        cluster.shutdown()
        if saved_tmpdir is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = saved_tmpdir


def run_driver(nodes: TwoNodes, args: list[str], cwd: Path, timeout: float = 400, **env: str):
    """main_ppo attached to the cluster (RAY_ADDRESS), to the end."""
    environ = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "RAY_ADDRESS": nodes.address, **env}
    return subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", *CPU_OVERRIDES, *args], cwd=cwd,
                          env=environ, capture_output=True, text=True, timeout=timeout)  # fmt: skip


def last_line(proc) -> str:
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("multi_node_data"), n_train=16)


def two_node_args(model: str, data: Path, run_dir: Path, *extra: str) -> list[str]:
    return grpo_args(model, data, run_dir, "trainer.nnodes=2", "trainer.n_gpus_per_node=1", *extra)


# ---------------------------------------------------------------------------------------------- tests
def test_two_nodes_train_checkpoint_resume_and_size_per_node(tiny_model_dir, data_dir, tmp_path):
    run_dir = tmp_path / "run"
    with two_nodes() as nodes:
        first = run_driver(nodes, two_node_args(tiny_model_dir, data_dir, run_dir, "trainer.total_training_steps=2"),
                           tmp_path)  # fmt: skip
        assert first.returncode == 0, first.stderr[-3000:]
        placement = [line for line in first.stderr.splitlines() if line.startswith("placement: role 'actor_rollout")]
        assert placement, first.stderr[-3000:]
        assert f"(Ray node {nodes.head_id[:8]})" in placement[0] and f"(Ray node {nodes.b_id[:8]})" in placement[0]
        step_2 = ckpt.step_dir(str(run_dir), 2)
        assert ckpt.is_complete(step_2)
        shards = sorted(f for f in os.listdir(os.path.join(step_2, "actor")) if f.startswith("model_world_size_2"))
        assert shards == ["model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt"]

        resumed = run_driver(nodes, two_node_args(tiny_model_dir, data_dir, run_dir, "trainer.total_training_steps=3"),
                             tmp_path)  # fmt: skip
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert set(step_metrics(run_dir)) == {1, 2, 3} and ckpt.is_complete(ckpt.step_dir(str(run_dir), 3))

        # one worker on a 2-node cluster: sized from one node (2 CPUs), not the cluster's 4 (no node has them)
        single = run_driver(nodes, grpo_args(tiny_model_dir, data_dir, tmp_path / "single", "trainer.nnodes=1",
                                             "trainer.total_training_steps=1", "trainer.save_freq=-1"), tmp_path)  # fmt: skip
        assert single.returncode == 0, single.stderr[-3000:]

        start = time.monotonic()
        too_many = run_driver(nodes, two_node_args(tiny_model_dir, data_dir, tmp_path / "four", "trainer.nnodes=4"),
                              tmp_path, timeout=120)  # fmt: skip
        assert too_many.returncode == 1 and time.monotonic() - start < 90
        line = last_line(too_many)
        assert line.startswith("error: ValueError: not enough Ray resources for the workers: asked 8 CPU"), line
        assert "per node ['2', '2']" in line


def test_a_node_without_the_shared_folders_is_named_before_training(tiny_model_dir, data_dir, tmp_path):
    private_runs, hidden_models = tmp_path / "runs", tmp_path / "models"
    private_runs.mkdir()
    hidden_models.mkdir()
    model = hidden_models / "tiny"
    shutil.copytree(tiny_model_dir, model)
    with two_nodes(private=[private_runs, hidden_models]) as nodes:
        run_dir = private_runs / "run"
        proc = run_driver(nodes, two_node_args(tiny_model_dir, data_dir, run_dir), tmp_path)
        assert proc.returncode == 1, proc.stderr[-3000:]
        line = last_line(proc)
        assert line.startswith(f"error: SharedStorageError: trainer.default_local_dir='{run_dir}' is not shared"), line
        assert f"Ray node {nodes.b_id[:8]})" in line and "storage every node shares" in line
        assert not any(name.startswith("global_step") for name in os.listdir(run_dir))  # nothing marked complete

        proc = run_driver(nodes, two_node_args(str(model), data_dir, tmp_path / "run2", "trainer.save_freq=-1"),
                          tmp_path)  # fmt: skip
        assert proc.returncode == 1, proc.stderr[-3000:]
        line = last_line(proc)
        assert f"actor_rollout_ref.model.path='{model}' is not a directory on node" in line, line
        assert f"Ray node {nodes.b_id[:8]})" in line and "every node of the cluster needs the model folder" in line


def test_a_lost_node_is_named_and_the_run_resumes_on_a_restored_cluster(tiny_model_dir, data_dir, tmp_path):
    steps = 4
    reference_dir, killed_dir = tmp_path / "reference", tmp_path / "killed"
    args = ["trainer.total_training_steps=4", "trainer.max_actor_ckpt_to_keep=2"]
    with two_nodes() as nodes:
        reference = run_driver(nodes, two_node_args(tiny_model_dir, data_dir, reference_dir, *args), tmp_path)
        assert reference.returncode == 0, reference.stderr[-3000:]

        environ = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "RAY_ADDRESS": nodes.address}
        log = open(tmp_path / "killed.log", "w")
        driver = subprocess.Popen(
            [sys.executable, "-m", "verl.trainer.main_ppo", *CPU_OVERRIDES,
             *two_node_args(tiny_model_dir, data_dir, killed_dir, *args)],
            cwd=tmp_path, env=environ, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        metrics = killed_dir / "logs" / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):  # step 2 logged, saved
            assert driver.poll() is None and time.monotonic() < deadline, (tmp_path / "killed.log").read_text()[-3000:]
            time.sleep(0.05)
        b_workers = [p.pid for p in psutil.Process(nodes.b_raylet_pid).children() if "FusedWorker" in p.name()
                     or "FusedWorker" in " ".join(p.cmdline())]  # fmt: skip
        assert b_workers
        os.kill(nodes.b_raylet_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        code = driver.wait(timeout=180)
        noticed_s = time.monotonic() - killed_at
        print(f"the driver ended {noticed_s:.1f} s after node B's raylet was killed")
        log.close()
        output = (tmp_path / "killed.log").read_text()
        line = [x for x in output.strip().splitlines() if x.strip()][-1]
        assert code == 1 and noticed_s < 120, output[-3000:]
        assert line.startswith("error: WorkerDiedError: step 3: lost node ") or line.startswith(
            "error: WorkerDiedError: step 4: lost node "
        ), line
        placed = next(x for x in output.splitlines() if x.startswith("placement: role 'actor_rollout"))
        b_ranks = placed.split(f"(Ray node {nodes.b_id[:8]}) ranks ")[1].split(";")[0].strip()  # e.g. "[1]"
        assert f"(Ray node {nodes.b_id[:8]}) with role 'actor_rollout" in line and f"rank(s) {b_ranks}" in line
        time.sleep(3)
        assert not [pid for pid in b_workers if psutil.pid_exists(pid)], "node B's worker outlived its driver"
        latest = ckpt.find_latest_checkpoint(str(killed_dir))
        assert latest is not None and ckpt.step_of(latest) >= 2 and ckpt.is_complete(latest)

        nodes.cluster.add_node(num_cpus=NODE_CPUS)  # the cluster restored: a new second node
        _wait_for_nodes(nodes.cluster, 2)
        resumed = run_driver(nodes, two_node_args(tiny_model_dir, data_dir, killed_dir, *args), tmp_path)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
    # Two uninterrupted runs of this 2-rank setup already differ in the 7th digit of their losses (float rounding
    # of the CPU kernels, run to run), so: the same samples and rewards exactly, the rest to float rounding
    expected, seen = step_metrics(reference_dir), step_metrics(killed_dir)
    for step in range(1, steps + 1):
        assert_close_step_metrics(expected[step], seen[step], step)
    for name, tensor in hf_weights(reference_dir, steps).items():
        torch.testing.assert_close(hf_weights(killed_dir, steps)[name], tensor, atol=1e-5, rtol=1e-4, msg=name)


EXACT_PREFIXES = ("critic/score/", "critic/rewards/", "response_length/", "prompt_length/")


def assert_close_step_metrics(expected: dict, seen: dict, step: int) -> None:
    keys = sorted(k for k in expected if not k.startswith(NOT_COMPARED_PREFIXES))
    assert keys == sorted(k for k in seen if not k.startswith(NOT_COMPARED_PREFIXES)), step
    for key in keys:
        if key.startswith(EXACT_PREFIXES) or not isinstance(expected[key], float):
            assert seen[key] == expected[key], (step, key, expected[key], seen[key])
        else:
            assert seen[key] == pytest.approx(expected[key], rel=1e-3, abs=1e-6), (step, key)


def test_an_authentication_mismatch_is_named(tiny_model_dir, data_dir, tmp_path):
    with two_nodes() as nodes:
        proc = run_driver(nodes, two_node_args(tiny_model_dir, data_dir, tmp_path / "run"), tmp_path, timeout=200,
                          RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0123456789abcdef0123456789abcdef")  # fmt: skip
    assert proc.returncode == 1
    line = last_line(proc)
    assert "the worker never started: Ray authentication mismatch between this driver (RAY_AUTH_MODE=token)" in line
