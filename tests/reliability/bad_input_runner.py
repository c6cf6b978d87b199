"""The machinery of the bad-input corpus (test_bad_inputs.py): cases, how each entry point is started, the
earlier run whose files must survive, and the check every case must pass.

Owns `Case`/`Ctx` (a case: entry point, arguments, setup, expected words of the last stderr line),
`run_batch` (the non-isolated cases in one process through bad_input_batch.py) and `check_case`: exit code
non-zero, one `error` line last on stderr with the expected words, no traceback, and the earlier run's files
byte-for-byte and mtime-for-mtime unchanged. Not a test module: test_bad_inputs.py imports it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.cpu_overrides import CPU_OVERRIDES

REPO = Path(__file__).resolve().parents[2]
RLLA = str(REPO / "dataset" / "rlla_4k_raw" / "rlla.py")
GSM8K = str(REPO / "examples" / "data_preprocess" / "gsm8k.py")


def make_previous_run(prev: Path, good: dict[str, str]) -> None:
    """Files an earlier run left behind: output parquets, a checkpoint folder and a metrics log."""
    (prev / "data").mkdir(parents=True)
    shutil.copy(good["train"], prev / "data" / "train.parquet")
    shutil.copy(good["train"], prev / "data" / "test.parquet")
    step = prev / "grpo_tiny" / "global_step_1"
    step.mkdir(parents=True)
    (step / "model.safetensors").write_bytes(b"\x00weights-of-an-earlier-run" * 64)
    (step / "COMPLETE").write_text("1\n")
    (prev / "grpo_tiny" / "latest_checkpointed_iteration.txt").write_text("1\n")
    (prev / "logs").mkdir()
    (prev / "logs" / "metrics.jsonl").write_text(json.dumps({"step": 1, "actor/pg_loss": 0.5}) + "\n")


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(root.rglob("*")) if p.is_file()
    }


@dataclass
class Ctx:
    good: dict[str, str]
    inp: Path  # folder for this case's bad inputs
    prev: Path  # the earlier run's folder; every case writes its outputs here


@dataclass
class Case:
    id: str
    entry: str  # rlla | gsm8k | ppo | sft
    args: Callable[[Ctx], list[str]]
    expect: list[str]  # substrings of the last stderr line
    setup: Callable[[Ctx], None] = field(default=lambda ctx: None)
    isolated: bool = False  # run in a process of its own (starts Ray, or stands for its entry point's exit code)


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


ENTRY_POINTS = {  # how `_run` starts each entry point: a script path or a module for `python -m`
    "rlla": {"script": RLLA},
    "gsm8k": {"script": GSM8K},
    "ppo": {"module": "verl.trainer.main_ppo"},
    "sft": {"module": "verl.trainer.fsdp_sft_trainer"},
    "merger": {"module": "verl.model_merger"},
}


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("RAY_ADDRESS", None)
    env.pop("VERL_FULL_ERROR", None)
    return env


def _run(entry: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    point = ENTRY_POINTS[entry]
    command = [sys.executable, point["script"]] if "script" in point else [sys.executable, "-m", point["module"]]
    return subprocess.run(command + args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=180)


@dataclass
class Outcome:
    returncode: int
    stdout: str
    stderr: str
    ctx: Ctx
    before: dict[str, tuple[bytes, int]]  # the earlier run's files before the case ran


def prepare(case: Case, good: dict[str, str], root: Path) -> tuple[Ctx, list[str], dict]:
    ctx = Ctx(good=good, inp=root / "inputs", prev=root / "previous_run")
    ctx.inp.mkdir()
    make_previous_run(ctx.prev, good)
    case.setup(ctx)
    args = case.args(ctx)
    if case.entry == "ppo":  # the project's small-CPU settings first; the case's own arguments win
        args = [*CPU_OVERRIDES, *args]
    return ctx, args, snapshot(ctx.prev)


def run_batch(cases: list[Case], good: dict[str, str], mktemp: Callable[[str], Path]) -> dict[str, Outcome]:
    """Every case not marked `isolated`, run in one Python process (bad_input_batch.py): the entry points fail
    before starting Ray, so what they print and their exit codes are those of `python -m ...`, without paying
    for importing torch, transformers and Hydra ~70 times. `mktemp(name)` makes a fresh folder."""
    jobs, prepared = [], {}
    for case in cases:
        if case.isolated:
            continue
        root = mktemp(case.id)
        ctx, args, before = prepare(case, good, root)
        prepared[case.id] = (ctx, before)
        jobs.append({"id": case.id, **ENTRY_POINTS[case.entry], "args": args, "cwd": str(root)})
    jobs_path = mktemp("batch") / "jobs.json"
    jobs_path.write_text(json.dumps(jobs))
    results_path = jobs_path.with_name("results.json")
    runner = Path(__file__).with_name("bad_input_batch.py")
    proc = subprocess.run(
        [sys.executable, str(runner), str(jobs_path), str(results_path)],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"batch runner failed:\n{proc.stderr[-3000:]}"
    results = json.loads(results_path.read_text())
    return {cid: Outcome(**results[cid], ctx=ctx, before=before) for cid, (ctx, before) in prepared.items()}


def check_case(case: Case, good: dict[str, str], tmp_path: Path, batched: dict[str, Outcome]) -> None:
    if case.isolated:  # a real process of its own: it starts Ray, or it checks the real exit code
        ctx, args, before = prepare(case, good, tmp_path)
        proc = _run(case.entry, args, cwd=tmp_path)
        outcome = Outcome(proc.returncode, proc.stdout, proc.stderr, ctx, before)
    else:
        outcome = batched[case.id]
    stderr = outcome.stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert outcome.returncode != 0, f"{case.id}: exit 0\nstdout:{outcome.stdout[-2000:]}\nstderr:{stderr[-2000:]}"
    assert lines, f"{case.id}: empty stderr (rc={outcome.returncode})"
    last = lines[-1]
    assert "error" in last.lower(), f"{case.id}: last stderr line is not an error line: {stderr[-3000:]}"
    assert "Traceback" not in stderr, f"{case.id}: traceback on stderr: {stderr[-3000:]}"
    for text in case.expect:
        assert text in last, f"{case.id}: {text!r} not in the last stderr line {last!r}"
    assert snapshot(outcome.ctx.prev) == outcome.before, f"{case.id}: files of the earlier run changed or were added"
