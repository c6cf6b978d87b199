"""The CPU speed-ups' boundary (verl/utils/acceleration.py, verl/cpu/): no generic module imports the CPU package, a
GPU worker never enters it while a CPU worker does, its hooks match the generic ones, switching it off gives the same
generations, and the allocator policy it applies (retained freed memory) does what it says."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import verl
from tests.workers.test_hf_rollout import make_prompts, rollout_config
from verl.cpu import RETAIN_FREED_MEMORY_ENV, retain_freed_memory_from_env
from verl.utils import acceleration
from verl.workers.rollout.hf_rollout import HFRollout

ROOT = Path(verl.__file__).parent


def _imports_of(path: Path) -> set[str]:
    """Every verl module a file imports, at module level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_no_generic_module_imports_the_cpu_package():
    """Only the boundary (verl/utils/acceleration.py) and the package itself name `verl.cpu`; the single-controller
    layer, the workers, the trainer and everything else go through the boundary's hooks."""
    offenders = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("cpu/") or rel == "utils/acceleration.py":
            continue
        hits = sorted(name for name in _imports_of(path) if name == "verl.cpu" or name.startswith("verl.cpu."))
        if hits:
            offenders.append(f"{rel}: {hits}")
    assert offenders == []
    assert "verl.cpu" in _imports_of(ROOT / "utils" / "acceleration.py")  # the one door exists (a control)


def test_the_cpu_hooks_are_the_generic_ones():
    cpu = acceleration.for_device("cpu")
    hooks = {name for name in vars(acceleration.Generic) if not name.startswith("_")}
    assert hooks <= set(dir(cpu)) and cpu.name == "cpu"
    assert acceleration.for_device("cuda") is acceleration.GENERIC
    assert acceleration.GENERIC.worker_env() == {} and acceleration.GENERIC.lean_decoder(None, 8) is None


_WORKER_IN_A_FRESH_PROCESS = """
import json, sys
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.base.worker import Worker
from verl.single_controller.local import LocalWorkerGroup
from verl.single_controller.ray.base import RayClassWithInitArgs, RayResourcePool
from verl.utils import acceleration

class Probe(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def where(self):
        return acceleration.current().name

group = LocalWorkerGroup(RayResourcePool([1], use_gpu=sys.argv[1] == "gpu"), RayClassWithInitArgs(Probe))
name = group.where()[0]
entered = "verl.cpu" in sys.modules
group.close()
print(json.dumps({"name": name, "cpu_package_imported": entered, "after_close": acceleration.current().name}))
"""


@pytest.mark.parametrize("placement", ["gpu", "cpu"])
def test_a_gpu_worker_never_enters_the_cpu_speed_ups_and_a_cpu_worker_does(placement):
    """A worker of a GPU pool (its group sets VERL_WORKER_DEVICE=cuda; no GPU is needed to build it) starts, takes a
    call and closes without `verl.cpu` ever being imported: nothing of it ran. A CPU pool's worker (the control)
    enters it."""
    env = {**os.environ, "VERL_WORKER_DEVICE": ""}
    out = subprocess.run([sys.executable, "-c", _WORKER_IN_A_FRESH_PROCESS, placement], env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout  # fmt: skip
    import json

    seen = json.loads(out.strip().splitlines()[-1])
    if placement == "gpu":
        assert seen == {"name": "generic", "cpu_package_imported": False, "after_close": "generic"}
    else:
        assert seen == {"name": "cpu", "cpu_package_imported": True, "after_close": "generic"}


def test_switched_off_the_cpu_generates_what_its_speed_ups_generate(model, tokenizer, monkeypatch):
    """VERL_CPU_ACCELERATION=0 runs the plain HF loop (per-row cache, HF's forward, torch's sampling): the same tokens
    and log-probs (within 1e-5) as the CPU speed-ups on the same seed; a bad value is refused."""
    prompts = make_prompts(tokenizer, seed=3).repeat(4)

    def generate():
        rollout = HFRollout(model, rollout_config(calculate_log_probs=True, response_length=10), tokenizer)
        return rollout.generate_sequences(prompts)

    fast = generate()
    monkeypatch.setenv(acceleration.SWITCH_ENV, "0")
    assert acceleration.for_device("cpu") is acceleration.GENERIC
    plain = generate()
    assert torch.equal(fast.batch["responses"], plain.batch["responses"])
    torch.testing.assert_close(fast.batch["rollout_log_probs"], plain.batch["rollout_log_probs"], atol=1e-5, rtol=0)
    monkeypatch.setenv(acceleration.SWITCH_ENV, "yes")
    with pytest.raises(ValueError, match="VERL_CPU_ACCELERATION must be 0 or 1, got 'yes'"):
        acceleration.for_device("cpu")


_FAULTS_OF_A_REPEATED_ALLOCATION = """
import resource, sys, torch
from verl.cpu import retain_freed_memory_from_env
applied = retain_freed_memory_from_env()
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(16 << 20)  # 64 MiB written: 16384 pages of 4 KiB when they are fresh
    del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
counts = [faults() for _ in range(9)]
print(applied, sum(counts[4:]))
"""


@pytest.mark.parametrize("setting", ["1", "0"])
def test_retained_freed_memory_serves_the_next_step_without_page_faults(setting):
    """With VERL_RETAIN_FREED_MEMORY=1 (the default) a block freed and allocated again, step after step, reuses
    pages the heap keeps; with 0, glibc unmaps it and every allocation faults all its pages in again (the control).
    Counted over 5 steps after 4 warm-up steps, and at most one fresh block in all (against five without): a small
    allocation can land in the freed block and split it, so in some processes one step still takes fresh pages at
    the heap's top (mostly among the warm-up steps, rarely later)."""
    import subprocess
    import sys

    env = {**os.environ, RETAIN_FREED_MEMORY_ENV: setting}
    out = subprocess.run([sys.executable, "-c", _FAULTS_OF_A_REPEATED_ALLOCATION], env=env, capture_output=True,
                         text=True, check=True).stdout.split()  # fmt: skip
    applied, faults = out[0] == "True", int(out[1])
    if setting == "1":
        assert applied and faults < 1.5 * 16384
    else:
        assert not applied and faults > 5 * 16000


def test_a_bad_retain_setting_is_refused(monkeypatch):
    monkeypatch.setenv(RETAIN_FREED_MEMORY_ENV, "yes")
    with pytest.raises(ValueError, match="VERL_RETAIN_FREED_MEMORY must be 0 or 1, got 'yes'"):
        retain_freed_memory_from_env()
