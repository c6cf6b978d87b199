"""Run-level checkpoint folders of the PPO trainer: `<root>/global_step_{N}/` holding `actor/`,
`critic/` and `trainer_state.pt`, plus verl's tracker file `latest_checkpointed_iteration.txt`.

Guarantees: a step folder is written under a temporary name and renamed only when every part is
complete (a crash mid-write never leaves a broken `global_step_N`), the tracker is replaced
atomically after that rename, and retention deletes old folders only after the new one is complete.

Layer 8 helper: file-system work only.
"""

from __future__ import annotations

import os
import re
import shutil

TRACKER_FILE = "latest_checkpointed_iteration.txt"
COMPLETE_MARKER = "COMPLETE"
STEP_DIR_RE = re.compile(r"^global_step_(\d+)$")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"global_step_{step}")


def staging_dir(root: str, step: int) -> str:
    return os.path.join(root, f".incomplete_global_step_{step}")


def begin_checkpoint(root: str, step: int) -> str:
    """Create (afresh) the staging folder for step `step` and return its path."""
    os.makedirs(root, exist_ok=True)
    path = staging_dir(root, step)
    if os.path.exists(path):
        shutil.rmtree(path)
    os.makedirs(path)
    return path


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def commit_checkpoint(root: str, step: int, max_to_keep: int | None = None) -> str:
    """Mark the staging folder complete, move it to `global_step_{step}`, update the tracker, and
    apply retention. Returns the final folder."""
    staging = staging_dir(root, step)
    _write_atomic(os.path.join(staging, COMPLETE_MARKER), str(step))
    final = step_dir(root, step)
    if os.path.exists(final):  # re-saving a step (e.g. after a resume): swap, then drop the old copy
        old = final + ".replaced"
        if os.path.exists(old):
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old)
    else:
        os.replace(staging, final)
    _write_atomic(os.path.join(root, TRACKER_FILE), str(step))
    if max_to_keep is not None and max_to_keep > 0:
        for old_step in complete_steps(root)[:-max_to_keep]:
            shutil.rmtree(step_dir(root, old_step), ignore_errors=True)
    return final


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, COMPLETE_MARKER))


def complete_steps(root: str) -> list[int]:
    """Steps with a complete folder under `root`, ascending."""
    if not os.path.isdir(root):
        return []
    steps = []
    for name in os.listdir(root):
        match = STEP_DIR_RE.match(name)
        if match and is_complete(os.path.join(root, name)):
            steps.append(int(match.group(1)))
    return sorted(steps)


def find_latest_checkpoint(root: str) -> str | None:
    """The newest complete step folder: the tracker's if it names a complete one, else the highest
    complete folder (the tracker can lag one rename behind a crash). None when there is none."""
    tracker = os.path.join(root, TRACKER_FILE)
    if os.path.isfile(tracker):
        with open(tracker, encoding="utf-8") as f:
            text = f.read().strip()
        if text.isdigit() and is_complete(step_dir(root, int(text))):
            candidate = int(text)
            newer = [s for s in complete_steps(root) if s > candidate]
            return step_dir(root, newer[-1] if newer else candidate)
    steps = complete_steps(root)
    return step_dir(root, steps[-1]) if steps else None


def step_of(path: str) -> int:
    match = STEP_DIR_RE.match(os.path.basename(os.path.normpath(path)))
    if not match:
        raise ValueError(f"checkpoint folder {path!r} is not named global_step_<N>")
    return int(match.group(1))
