"""The benchmarks' process-tree sampler (benchmarks/tree_memory.py): the name and kind it gives each process of
the tree, including a child caught between fork and exec (it still shows its parent's command line), which must
take its program's name once it has exec'd. The scale benchmark's per-process table relies on it (it looks for
the raylet by name)."""

import os
import subprocess
import sys
import textwrap
import time

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
)
from tree_memory import TreeMemory, identity  # noqa: E402

RAYLET = "/venv/lib/python3.12/site-packages/ray/core/src/ray/raylet/raylet --node_ip_address=10.0.0.1"
DRIVER = "/venv/bin/python -m verl.trainer.main_ppo trainer.total_training_steps=1"


def test_a_daemon_first_seen_before_exec_gets_its_own_name():
    kind, name = identity(False, DRIVER, ("", ""))  # forked by the driver, not yet exec'd
    assert (kind, name) == ("ray daemons", "python")
    assert identity(False, RAYLET, (kind, name)) == ("ray daemons", "raylet")


def test_a_ray_worker_becomes_an_actor_and_stays_one():
    seen = identity(False, "/venv/bin/python /venv/ray/_private/workers/default_worker.py --node-ip=1", ("", ""))
    assert seen == ("ray daemons", "python")
    seen = identity(False, "ray::IDLE", seen)
    assert seen == ("ray daemons", "ray::IDLE")
    seen = identity(False, "ray::WorkerDict.actor_rollout_generate_sequences", seen)
    assert seen == ("workers", "ray::WorkerDict")
    assert identity(False, "ray::IDLE", seen) == seen  # an actor keeps its class name
    assert identity(False, "", seen) == seen  # an exiting process's command line empties


def test_the_root_is_the_driver():
    assert identity(True, DRIVER, ("", "")) == ("driver", "driver")


def test_sampler_renames_a_child_after_exec():
    # the child sleeps with the parent's command line (fork, no exec), then becomes `sleep`
    script = textwrap.dedent(
        """
        import os, time
        pid = os.fork()
        if pid == 0:
            time.sleep(1.0)
            os.execv("/bin/sleep", ["sleep", "2"])
        os.waitpid(pid, 0)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        time.sleep(0.3)
        memory = TreeMemory(parent.pid, interval=0.05, pss_every=2)
        parent.wait(timeout=30)
        memory.stop()
    finally:
        parent.kill()
    names = {name for _, name, _ in memory.peak_by_process.values()}
    assert names == {"driver", "sleep"}, memory.peak_by_process
    assert memory.peak_by_kind["driver"] > 0 and memory.peak_mb > 0
