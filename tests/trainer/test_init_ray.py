"""`main_ppo.init_ray` starts a local Ray session with what a training run needs: Ray's GCS, raylet and agents,
but not the dashboard head, the autoscaler monitor nor the log monitor (stopped once started; with
VERL_LEAN_RAY_HEAD=1, which patches Ray's private Node class, never started); the session still runs an actor, the actor's stdout and stderr still reach the driver's with Ray's prefix (a thread
of the driver tails the worker files: `WorkerLogTail`), and it shuts down. Runs in a subprocess: the test session
has its own Ray."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ray

SCRIPT = """
import json, os, sys, psutil, ray
from omegaconf import OmegaConf
from verl.trainer.main_ppo import init_ray, shutdown_ray

@ray.remote
class Speaker:
    def say(self, n):
        print("to stdout", n, flush=True)
        print("to stderr", n, file=sys.stderr, flush=True)
        print("no newline at the end", end="", flush=True)
        return n

init_ray(OmegaConf.create({"ray_kwargs": {"ray_init": {"num_cpus": 1}}}))
answer = ray.get(ray.remote(lambda: 42).remote())
speaker = Speaker.remote()
said = ray.get(speaker.say.remote(7))
cmds = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)]
logs = sorted(os.listdir(ray._private.worker._global_node.get_logs_dir_path()))
shutdown_ray()
print(json.dumps({"answer": answer, "said": said, "cmds": cmds, "logs": logs}))
"""


@pytest.mark.parametrize("lean_head", ["0", "1"])
def test_local_session_runs_without_dashboard_and_monitors_and_prints_worker_output(lean_head):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["VERL_LEAN_RAY_HEAD"] = lean_head
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    cmds = " ".join(out["cmds"])
    assert out["answer"] == 42 and out["said"] == 7
    assert "gcs_server" in cmds and "raylet" in cmds
    assert "dashboard/dashboard.py" not in cmds and "autoscaler/_private/monitor.py" not in cmds
    assert "log_monitor.py" not in cmds
    # VERL_LEAN_RAY_HEAD=1: never started (each would have opened its log file), not started and stopped
    assert "raylet.out" in out["logs"] and "gcs_server.out" in out["logs"]
    started = [name for name in out["logs"] if name.split(".")[0] in ("dashboard", "monitor", "log_monitor")]
    assert (started == []) == (lean_head == "1"), started
    out_lines, err_lines = proc.stdout.splitlines(), proc.stderr.splitlines()
    speaker = [line for line in out_lines if line.startswith("(Speaker pid=")]
    assert [line.split(") ", 1)[1] for line in speaker] == ["to stdout 7", "no newline at the end"], proc.stdout
    assert any(line.startswith("(Speaker pid=") and line.endswith(") to stderr 7") for line in err_lines), proc.stderr
    assert not any(":actor_name:" in line or ":job_id:" in line for line in out_lines + err_lines)


def test_a_bad_lean_head_setting_is_refused(monkeypatch):
    from verl.trainer.main_ppo import _lean_head_wanted

    monkeypatch.setenv("VERL_LEAN_RAY_HEAD", "yes")
    with pytest.raises(ValueError, match="VERL_LEAN_RAY_HEAD must be 0 or 1, got 'yes'"):
        _lean_head_wanted()
    monkeypatch.delenv("VERL_LEAN_RAY_HEAD")
    assert _lean_head_wanted() is False  # off by default: Ray's private API is not patched
