"""Hostile model output against the code sandbox: every hostile program scores 0 within the time bound, no
process it started survives, the host's files are untouched, and a training run that scores such programs
keeps running (a reward call that hangs in the same run is cut off by `reward_model.timeout_s`).

The programs: infinite loop, sleeping past the limit, fork bomb, memory bomb, a 1 TB allocation, endless stdout,
a socket, killing its parent, subprocess, ctypes, raw fork_exec, raising its own limits, writing outside its
temp dir (5 ways), reading outside it (a host file whose content would pass the test, /etc/passwd,
/proc/self/root, the supervisor's memory where the expected output is), and a detached (setsid, double-forked)
child. The sandbox's own unit tests are in tests/utils/reward_score/test_sandbox.py.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from tests.load import time_scale
from tests.ppo_e2e import file_snapshot, grpo_args, process_environ, run_ppo, wait_until_gone, write_data
from tests.reliability.fault_rewards import HOSTILE_PROGRAMS
from verl.utils.reward_score import sandbox
from verl.utils.reward_score.sandbox import namespaces_available, run_code_tests, run_tests

MODES = [pytest.param(False, id="process")]
if namespaces_available():
    MODES.append(pytest.param(True, id="namespaces"))
FAULT_REWARDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_rewards.py")
OWN_FAILURE_LIMIT_S = 60.0  # the time limit of programs that must end on their own (refused, crashed, printed)


def _processes_with(token: str) -> list[int]:
    """Pids whose command line contains `token`."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as handle:
                    if token.encode() in handle.read():
                        found.append(int(name))
            except OSError:
                continue
    return found


def _runner_processes(sandbox_root: Path) -> list[int]:
    """Sandbox processes (supervisor and program) of the sandboxes made under `sandbox_root`: their command line
    names the runner and their HOME is their sandbox's folder. Another test's sandboxes, running at the same time in
    another pytest worker, are not this test's business."""
    found = []
    for pid in _processes_with(sandbox.RUNNER_PATH):
        homes = [var[len(b"HOME=") :].decode() for var in process_environ(pid) or [] if var.startswith(b"HOME=")]
        if pid != os.getpid() and homes and Path(homes[0]).is_relative_to(sandbox_root):
            found.append(pid)
    return found


@pytest.fixture
def sandbox_root(tmp_path, monkeypatch):
    """The folder this test's sandboxes are made in (their temp dirs), so that `_runner_processes` sees only them."""
    root = tmp_path / "sandboxes"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


@pytest.fixture
def canary(tmp_path):
    """A host folder a hostile program must neither read nor change; secret.txt would pass the test if read."""
    folder = tmp_path / "host_files"
    folder.mkdir()
    (folder / "secret.txt").write_text("3\n")
    (folder / "notes.md").write_text("do not touch\n")
    return folder


HOSTILE = {
    "infinite_loop": "while True:\n    pass\n",
    "sleep_past_limit": "import time\ntime.sleep(60)\n",
    "fork_bomb": "import os\nwhile True:\n    os.fork()\n",
    "memory_bomb": "chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 1024 * 1024))\n",
    "huge_alloc": "x = bytearray(1 << 40)\n",
    "huge_stdout": "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n",
    "socket": "import socket\ns = socket.create_connection(('127.0.0.1', 22), timeout=1)\nprint(3)\n",
    "kill_parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint(3)\n",
    "subprocess": "import subprocess\nsubprocess.run(['sleep', '30'])\n",
    "ctypes": "import ctypes\nctypes.CDLL(None).fork()\n",
    "raw_fork_exec": "import _posixsubprocess\nprint(3)\n",  # fork_exec has no audit event of its own
    "raise_limits": "import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))\nprint(3)\n",
}

# every program under the default isolation; the ones that test process cleanup also without namespaces
HOSTILE_CASES = [pytest.param(name, None, id=name) for name in sorted(HOSTILE)] + [
    pytest.param(name, False, id=f"{name}-process") for name in ("fork_bomb", "infinite_loop", "kill_parent")
]


@pytest.mark.parametrize(("name", "use_ns"), HOSTILE_CASES)
def test_hostile_program_scores_zero_fast_and_leaves_nothing(name, use_ns, canary, sandbox_root):
    before = file_snapshot(canary)
    # the two that must be cut off get 1 s; the rest must fail on their own: their generous limit only keeps a
    # hang from blocking the suite, and their outcome class is what is asserted (a busy machine slows them down)
    timed_out = name in ("infinite_loop", "sleep_past_limit")
    timeout_s = 1.0 if timed_out else OWN_FAILURE_LIMIT_S
    scale = time_scale()
    start = time.monotonic()
    result = run_tests(
        HOSTILE[name],
        {"inputs": ["1 2\n"], "outputs": ["3\n"]},
        timeout_s=timeout_s,
        memory_mb=256,
        max_output_bytes=1 << 20,
        use_namespaces=use_ns,
    )
    elapsed = time.monotonic() - start
    assert result.pass_fraction == 0.0, result.details
    assert elapsed < timeout_s + (sandbox.PER_TEST_GRACE_S + sandbox.STARTUP_GRACE_S) * scale, (elapsed, scale)
    expected = {
        "infinite_loop": "timeout",
        "sleep_past_limit": "timeout",
        "huge_stdout": "output_limit",
    }.get(name, "runtime_error(1)")
    assert result.statuses == [expected], result.details
    assert _runner_processes(sandbox_root) == []
    assert file_snapshot(canary) == before


@pytest.mark.parametrize("use_ns", MODES)
def test_write_outside_temp_dir_is_refused(use_ns, canary):
    before = file_snapshot(canary)
    target = str(canary / f"escape_{uuid.uuid4().hex}")
    programs = [
        f"open({target!r}, 'w').write('x')\nprint(3)\n",
        f"import os\nos.close(os.open({target!r}, os.O_WRONLY | os.O_CREAT))\nprint(3)\n",
        "import os\nd = os.path.basename(os.getcwd())\nopen('../' + d + '_escape', 'w').write('x')\nprint(3)\n",
        f"import shutil\nshutil.copyfile('/etc/hostname', {target!r})\nprint(3)\n",
        f"import os\nos.symlink({str(canary)!r}, 'up')\nopen('up/x', 'w')\nprint(3)\n",
        f"import os\nos.remove({str(canary / 'notes.md')!r})\nprint(3)\n",
    ]
    for code in programs:
        result = run_tests(
            code, {"inputs": [""], "outputs": ["3"]}, timeout_s=OWN_FAILURE_LIMIT_S, use_namespaces=use_ns
        )
        assert result.statuses == ["runtime_error(1)"], (code, result.details)
        assert "PermissionError: sandbox" in result.details[0]["stderr_tail"]
        assert not os.path.exists(target)
    assert file_snapshot(canary) == before
    # writing inside the temp dir (cwd and HOME) is fine
    inside = "import os\nopen('a.txt', 'w').write('7')\nprint(open(os.path.expanduser('~/a.txt')).read())\n"
    assert (
        run_code_tests(inside, {"inputs": [""], "outputs": ["7"]}, timeout_s=OWN_FAILURE_LIMIT_S, use_namespaces=use_ns)
        == 1.0
    )


# Finds the supervisor by its command line, reads its memory through /proc/<pid>/mem and prints the first
# expected output it sees in the spec: without the read restriction this passes any stdin/stdout test.
STEAL_EXPECTED_OUTPUT = r"""
import os, re
found = None
for pid in os.listdir('/proc'):
    if not pid.isdigit() or int(pid) == os.getpid():
        continue
    try:
        if b'supervise' not in open(f'/proc/{pid}/cmdline', 'rb').read():
            continue
        mem = open(f'/proc/{pid}/mem', 'rb', 0)
        for line in open(f'/proc/{pid}/maps').read().splitlines():
            span, perms = line.split()[:2]
            if 'rw' in perms and found is None:
                lo, hi = (int(x, 16) for x in span.split('-'))
                mem.seek(lo)
                match = re.search(rb'"output": "([^"]*)"', mem.read(hi - lo))
                found = match and match.group(1).decode()
    except OSError:
        continue
print(found)
"""


@pytest.mark.parametrize("use_ns", MODES)
def test_read_outside_temp_dir_is_refused(use_ns, canary):
    before = file_snapshot(canary)
    secret = str(canary / "secret.txt")
    for code in (
        f"print(open({secret!r}).read())\n",  # would print 3: the right answer
        f"import os\nprint(os.read(os.open({secret!r}, os.O_RDONLY), 10).decode())\n",
        "print(open('/etc/passwd').read()[:20])\n",
        f"print(open('/proc/self/root{secret}').read())\n",
    ):
        result = run_tests(
            code, {"inputs": [""], "outputs": ["3"]}, timeout_s=OWN_FAILURE_LIMIT_S, use_namespaces=use_ns
        )
        assert result.statuses == ["runtime_error(1)"], (code, result.details)
        assert "PermissionError: sandbox: reading" in result.details[0]["stderr_tail"]
    stolen = run_tests(STEAL_EXPECTED_OUTPUT, {"inputs": [""], "outputs": ["s3cr3t-4242"]}, use_namespaces=use_ns)
    assert stolen.statuses == ["wrong_answer"] and stolen.pass_fraction == 0.0, stolen.details
    assert file_snapshot(canary) == before
    # the interpreter's own files stay readable: imports of the standard library and site-packages work
    ok = "import json, decimal, zoneinfo, numpy\nprint(json.dumps(int(numpy.arange(3).sum())))\n"
    assert (
        run_code_tests(ok, {"inputs": [""], "outputs": ["3"]}, timeout_s=OWN_FAILURE_LIMIT_S, use_namespaces=use_ns)
        == 1.0
    )


@pytest.mark.parametrize("use_ns", MODES)
def test_detached_grandchild_is_killed_when_processes_are_allowed(use_ns):
    token = f"{uuid.uuid4().int % 10**6}.4321"  # a unique `sleep` argument to find survivors by
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv('/bin/sleep', ['sleep', '{token}'])\n"
        "    os._exit(0)\n"
        "time.sleep(0.3)\n"
        "print(3)\n"
    )
    result = run_tests(
        code,
        {"inputs": [""], "outputs": ["3"]},
        timeout_s=OWN_FAILURE_LIMIT_S,
        allow_processes=True,
        use_namespaces=use_ns,
    )
    assert result.statuses == ["passed"], result.details  # the program itself is right; its detached child dies
    assert _processes_with(token) == []
    # with processes refused (the default) the same program fails at its first fork
    blocked = run_tests(code, {"inputs": [""], "outputs": ["3"]}, timeout_s=OWN_FAILURE_LIMIT_S, use_namespaces=use_ns)
    assert blocked.statuses == ["runtime_error(1)"] and _processes_with(token) == []


# ------------------------------------------------------------------------------------------ inside training
@pytest.mark.slow
@pytest.mark.ray
def test_training_run_survives_hostile_programs_and_a_hanging_reward(tiny_model_dir, tmp_path, canary):
    """One step of 16 samples scored by `fault_rewards.hostile_or_hang`: samples 0 and 11 hang (each cut off
    after 3 s, scored 0 by on_error=zero), the others run the hostile programs of HOSTILE_PROGRAMS in the
    sandbox."""
    before = file_snapshot(canary)
    data_dir = write_data(tmp_path, n_train=16)
    run_dir, tag = tmp_path / "run", uuid.uuid4().hex
    sandbox_root = tmp_path / "sandboxes"  # the workers' temp dir (TMPDIR), where their sandboxes are made
    sandbox_root.mkdir()
    os.utime(sandbox_root, ns=(0, 0))
    args = grpo_args(
        tiny_model_dir,
        data_dir,
        run_dir,
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "trainer.total_training_steps=1",
        f"custom_reward_function.path={FAULT_REWARDS}",
        "custom_reward_function.name=hostile_or_hang",
        "reward_model.timeout_s=3",
        "reward_model.on_error=zero",
    )
    start = time.monotonic()
    # Ray's own temp dir stays where it was (RAY_TMPDIR): its socket paths must stay short
    ray_tmp = os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()
    proc = run_ppo(args, cwd=tmp_path, tag=tag, CANARY_DIR=str(canary), TMPDIR=str(sandbox_root), RAY_TMPDIR=ray_tmp)
    assert time.monotonic() - start < 240
    assert "training finished" in proc.stdout
    (step,) = [json.loads(line) for line in open(run_dir / "logs" / "metrics.jsonl")]
    assert step["critic/score/max"] == 0.0  # no hostile program passed the 1 + 2 = 3 test
    hangs = sum(1 for n in range(16) if n % (1 + len(HOSTILE_PROGRAMS)) == 0)  # every program ran at least once
    assert len(HOSTILE_PROGRAMS) + 1 <= 16 and hangs == 2
    assert step["reward_extra/reward_errors/mean"] == hangs / 16  # only the hanging calls failed
    assert step["timing_s/reward"] >= 3.0 * hangs
    assert file_snapshot(canary) == before
    # sandboxes were made there (the folder changed) and every one removed
    assert sandbox_root.stat().st_mtime_ns > 0 and list(sandbox_root.iterdir()) == []
    assert _runner_processes(sandbox_root) == []
    assert wait_until_gone(tag) == [], "the run left processes behind"
