"""`main_ppo.init_ray` starts a local Ray session with what a training run needs: Ray's GCS, raylet, agents and
log monitor, but not the dashboard head nor the autoscaler monitor (stopped once `ray.init` returns), and the
session still runs an actor and shuts down. Runs in a subprocess: the test session has its own Ray."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ray

SCRIPT = """
import json, psutil, ray
from omegaconf import OmegaConf
from verl.trainer.main_ppo import init_ray
init_ray(OmegaConf.create({"ray_kwargs": {"ray_init": {"num_cpus": 1}}}))
answer = ray.get(ray.remote(lambda: 42).remote())
cmds = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)]
ray.shutdown()
print(json.dumps({"answer": answer, "cmds": cmds}))
"""


def test_local_session_runs_without_dashboard_and_autoscaler_monitor():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    cmds = " ".join(out["cmds"])
    assert out["answer"] == 42
    assert "gcs_server" in cmds and "raylet" in cmds and "log_monitor.py" in cmds
    assert "dashboard/dashboard.py" not in cmds and "autoscaler/_private/monitor.py" not in cmds
