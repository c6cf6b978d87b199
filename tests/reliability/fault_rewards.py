"""Reward functions that inject faults into a real `main_ppo` run, loaded with `custom_reward_function.path`.

Each scores like the built-in reward (`default_compute_score`) until its fault fires; the fault is armed by
environment variables the test sets on the run (the reward runs in the driver process, which inherits them).
Not a test module: the tests in this folder point the trainer at this file.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time

from verl.trainer.ppo import checkpoint as ckpt
from verl.utils.reward_score import default_compute_score, sandbox

RUN_TAG_ENV = "VERL_TEST_RUN_TAG"  # tests/ppo_e2e.py sets it on every run it starts
_fired: set[str] = set()


def rlla_or_kill_driver(data_source, solution_str, ground_truth, extra_info=None, step=0, **kwargs):
    """The built-in score; at step $KILL_DRIVER_AT_STEP the driver SIGKILLs itself (mid-step: after generation,
    before the log-probs and the update)."""
    if os.environ.get("KILL_DRIVER_AT_STEP") == str(step):
        os.kill(os.getpid(), signal.SIGKILL)
    return default_compute_score(data_source, solution_str, ground_truth, extra_info, step=step, **kwargs)


def rlla_or_kill_worker(data_source, solution_str, ground_truth, extra_info=None, step=0, **kwargs):
    """The built-in score; at step $KILL_WORKER_AT_STEP, once: write the latest checkpoint's file hashes, the
    workers' pids and the time to $FAULT_LOG, then SIGKILL the run's worker processes (mid-step)."""
    if os.environ.get("KILL_WORKER_AT_STEP") == str(step) and "worker" not in _fired:
        _fired.add("worker")
        latest = ckpt.find_latest_checkpoint(os.environ["FAULT_RUN_DIR"])
        pids = worker_pids(os.environ[RUN_TAG_ENV])
        record = {"latest": latest, "hashes": tree_hashes(latest), "pids": pids, "killed_at": time.time()}
        with open(os.environ["FAULT_LOG"], "w") as f:
            json.dump(record, f)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
    return default_compute_score(data_source, solution_str, ground_truth, extra_info, step=step, **kwargs)


def nan_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return float("nan")


def string_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return "1.0"


def short_tuple(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return (1.0, 0.5)


# Programs a policy could write. The sandbox test is "read two numbers, print their sum": stdin "1 2", stdout 3.
# $CANARY_DIR holds secret.txt ("3") and must stay untouched: reading it would pass the test.
HOSTILE_PROGRAMS = {
    "infinite_loop": "while True:\n    pass\n",
    "sleep_past_limit": "import time\ntime.sleep(60)\n",
    "fork_bomb": "import os\nwhile True:\n    os.fork()\n",
    "memory_bomb": "chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 1024 * 1024))\n",
    "huge_stdout": "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n",
    "read_outside": "import os\nprint(open(os.path.join({canary!r}, 'secret.txt')).read())\n",
    "write_outside": "import os\nopen(os.path.join({canary!r}, 'pwned'), 'w').write('x')\nprint(3)\n",
    "socket": "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)\nprint(3)\n",
    "kill_parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint(3)\n",
    "detached_child": "import os\nif os.fork() == 0:\n    os.setsid()\n    import time\n    time.sleep(60)\nprint(3)\n",
}
ADD_TEST = {"inputs": ["1 2\n"], "outputs": ["3\n"]}


def hostile_or_hang(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """The n-th call in this process: n % (1 + len(HOSTILE_PROGRAMS)) == 0 hangs (sleeps an hour); the others
    score a hostile program (as if the policy had written it) in the code sandbox. Ignores the response."""
    n = _next_call()
    cycle = ["hang", *HOSTILE_PROGRAMS]
    name = cycle[n % len(cycle)]
    if name == "hang":
        time.sleep(3600)
    code = HOSTILE_PROGRAMS[name].format(canary=os.environ["CANARY_DIR"])
    response = f"```python\n{code}```"
    return sandbox.compute_score(response, ADD_TEST, timeout_s=1.0, memory_mb=256, max_output_bytes=1 << 20)


_calls = [0]


def _next_call() -> int:
    _calls[0] += 1
    return _calls[0] - 1


def worker_pids(tag: str) -> list[int]:
    """Pids of the Ray worker processes (`ray::FusedWorker...`) of the run tagged `tag`."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{name}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if cmdline.startswith(b"ray::FusedWorker") and f"{RUN_TAG_ENV}={tag}".encode() in environ:
            pids.append(int(name))
    return sorted(pids)


def tree_hashes(root: str | None) -> dict[str, str]:
    """{relative path: sha256} of every file under `root` ({} for None)."""
    if root is None:
        return {}
    hashes = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                hashes[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return hashes


class KillDriverAfterSave:
    """A `trainer.checkpoint_callback_class` whose `on_save` SIGKILLs the driver once the checkpoint of step
    $KILL_DRIVER_AFTER_SAVE_STEP is committed: after the commit, before the step's line reaches the log."""

    def __init__(self, config=None):
        self.config = config

    def on_save(self, trainer, global_step: int, checkpoint_dir: str, async_save: bool = False, **kwargs) -> None:
        if os.environ.get("KILL_DRIVER_AFTER_SAVE_STEP") == str(global_step):
            os.kill(os.getpid(), signal.SIGKILL)
