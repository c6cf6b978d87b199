"""Run-level checkpoint folders of the PPO trainer: `<root>/global_step_{N}/` (`actor/`, `critic/`,
`trainer_state.pt`) and verl's tracker file `latest_checkpointed_iteration.txt`.

Guarantees: a step folder is written under a temporary name and renamed when complete, the tracker replaced
atomically after it, and retention (`max_actor_ckpt_to_keep` keeps whole folders, `max_critic_ckpt_to_keep` then
drops older `critic/` parts) deletes by renaming out of the way first. The folder must be on storage every node
shares: `check_shared_storage` and `check_parts_visible` refuse otherwise. Also owns `should_save_ckpt_esi`.
Layer 8 helper.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta

TRACKER_FILE = "latest_checkpointed_iteration.txt"
COMPLETE_MARKER = "COMPLETE"
STEP_DIR_RE = re.compile(r"^global_step_(\d+)$")
DELETING_PREFIX = ".deleting_"  # a folder renamed to this prefix is being removed (a crash may leave it)
CRITIC_DIR = "critic"


class SharedStorageError(FileNotFoundError):
    """The checkpoint folder is not the same storage on every node (a part some rank wrote is not where the
    driver commits it)."""


SHARED_STORAGE_HINT = (
    "every rank writes its checkpoint files where it runs and the driver commits the folder on its own node, so "
    "trainer.default_local_dir must be storage every node shares (NFS or a cluster file system); or set "
    "trainer.save_freq=-1 and trainer.resume_mode=disable"
)


def _driver_node() -> str:
    from verl.single_controller.base.worker import node_label

    return node_label()


def check_shared_storage(trainer_config: Mapping, root: str, groups: Iterable) -> None:
    """Before training, when the run saves or resumes checkpoints (`trainer.save_freq` > 0 or `resume_mode` not
    `disable`): every worker of `groups` (worker groups with `sees_path`; None entries skipped) must see a file
    written here into `root`, else SharedStorageError naming the nodes and ranks that do not."""
    saves = (trainer_config.get("save_freq") or 0) > 0
    if not saves and trainer_config.get("resume_mode", "auto") == "disable":
        return
    groups = [group for group in groups if group is not None]
    os.makedirs(root, exist_ok=True)
    probe = os.path.join(root, f".shared_storage_probe_{socket.gethostname()}_{uuid.uuid4().hex[:8]}")
    _write_atomic(probe, "written by the driver")
    try:
        reports = [report for group in groups for report in group.sees_path(probe)]
    finally:
        os.remove(probe)
    blind = [f"rank {r['rank']} on node {r['node']}" for r in reports if not r["exists"]]
    if blind:
        raise SharedStorageError(
            f"trainer.default_local_dir={root!r} is not shared: a file the driver wrote there on node "
            f"{_driver_node()} is missing for {', '.join(blind)}; {SHARED_STORAGE_HINT}"
        )


def check_parts_visible(staging: str, parts: Mapping[str, list | None], step: int, root: str) -> None:
    """Before a commit: every file a rank reported writing into a part of the staging folder (`parts`: part name
    -> per rank `{"rank", "node", "files"}`, what the workers' `save_checkpoint` returns) must be there as the
    driver sees it, else SharedStorageError naming the ranks, their nodes and the missing files, and the latest
    complete checkpoint under `root`. Reports of another shape (a worker class that returns nothing) are not
    checked."""
    missing = []
    for part, reports in parts.items():
        if not reports or not all(isinstance(r, dict) and "files" in r for r in reports):
            continue
        for report in reports:
            absent = [name for name in report["files"] if not os.path.exists(os.path.join(staging, part, name))]
            if absent:
                missing.append(f"{part} rank {report['rank']} on node {report['node']}: {absent[:4]}")
    if missing:
        raise SharedStorageError(
            f"checkpoint of step {step} not committed: files the ranks wrote are not in {staging} on the driver's "
            f"node {_driver_node()} ({'; '.join(missing)}); {SHARED_STORAGE_HINT}. The latest complete checkpoint "
            f"stays {find_latest_checkpoint(root) or 'none'}"
        )


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"global_step_{step}")


def staging_dir(root: str, step: int) -> str:
    return os.path.join(root, f".incomplete_global_step_{step}")


def begin_checkpoint(root: str, step: int) -> str:
    """Create (afresh) the staging folder for step `step` and return its path."""
    os.makedirs(root, exist_ok=True)
    for name in os.listdir(root):  # what a crash during an earlier deletion left
        if name.startswith(DELETING_PREFIX):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
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


def commit_checkpoint(
    root: str, step: int, max_to_keep: int | None = None, max_critic_to_keep: int | None = None
) -> str:
    """Mark the staging folder complete, move it to `global_step_{step}`, update the tracker, and
    apply retention (`max_to_keep` step folders, `max_critic_to_keep` critic sub-folders; None or 0 keeps
    all). Returns the final folder."""
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
    apply_retention(root, max_to_keep, max_critic_to_keep)
    return final


def _remove(path: str, hidden: str) -> None:
    """Rename `path` to `hidden` (atomic), then delete it: a crash leaves `path` whole or gone."""
    if os.path.exists(hidden):
        shutil.rmtree(hidden, ignore_errors=True)
    os.replace(path, hidden)
    shutil.rmtree(hidden, ignore_errors=True)


def apply_retention(root: str, max_actor_to_keep: int | None, max_critic_to_keep: int | None) -> None:
    """Keep the `max_actor_to_keep` newest complete step folders and `critic/` in only the `max_critic_to_keep`
    newest of them (None, 0 or a negative number: keep all, as in verl)."""
    steps = complete_steps(root)
    if max_actor_to_keep is not None and max_actor_to_keep > 0:
        for old in steps[:-max_actor_to_keep]:
            _remove(step_dir(root, old), os.path.join(root, f"{DELETING_PREFIX}global_step_{old}"))
        steps = steps[-max_actor_to_keep:]
    if max_critic_to_keep is not None and max_critic_to_keep > 0:
        for old in steps[:-max_critic_to_keep]:
            critic = os.path.join(step_dir(root, old), CRITIC_DIR)
            if os.path.isdir(critic):
                _remove(critic, os.path.join(step_dir(root, old), f"{DELETING_PREFIX}{CRITIC_DIR}"))


def retention_limits(trainer_config: Mapping) -> tuple[int | None, int | None]:
    """(max_actor_ckpt_to_keep, max_critic_ckpt_to_keep) as verl reads them: None (keep all) or an int; verl's
    deprecated `remove_previous_ckpt_in_save=true` means 1 and 1."""
    if trainer_config.get("remove_previous_ckpt_in_save", False):
        print(
            "warning: trainer.remove_previous_ckpt_in_save is deprecated (as in verl); it keeps 1 checkpoint: "
            "set max_actor_ckpt_to_keep=1 and max_critic_ckpt_to_keep=1 instead"
        )
        return 1, 1
    limits = []
    for key in ("max_actor_ckpt_to_keep", "max_critic_ckpt_to_keep"):
        value = trainer_config.get(key, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"trainer.{key}={value!r} must be null (keep all) or an integer number of checkpoints")
        limits.append(value)
    return limits[0], limits[1]


def check_resumable(path: str, need_critic: bool) -> None:
    """Raise if the complete folder `path` lacks a part this run loads (a critic pruned by
    max_critic_ckpt_to_keep, or a checkpoint saved by a run without a critic)."""
    if need_critic and not os.path.isdir(os.path.join(path, CRITIC_DIR)):
        raise FileNotFoundError(
            f"checkpoint {path} has no {CRITIC_DIR}/ folder (removed by trainer.max_critic_ckpt_to_keep, or saved "
            f"by a run without a critic); resume from a newer global_step_N or set trainer.resume_mode=disable"
        )


def should_save_ckpt_esi(max_steps_duration: float, save_ckpt_duration: float = 60, redundant_time: float = 0) -> bool:
    """verl's expiring-instance check: True when the capacity block this job runs on (Volcengine MLP:
    `MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP`, AWS SageMaker:
    `SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP`, Unix seconds) ends within one more step plus a save plus
    `redundant_time` (trainer.esi_redundant_time) seconds, so the trainer saves now. False without either variable."""
    exp_mlp = os.getenv("MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP")
    exp_aws = os.getenv("SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP")
    if exp_mlp:
        try:
            remaining = float(exp_mlp) - time.time()
        except ValueError:
            return False
        return (
            0 < remaining
            and max_steps_duration > 0
            and remaining <= save_ckpt_duration + max_steps_duration + redundant_time
        )
    if exp_aws:
        try:
            left = datetime.fromtimestamp(int(exp_aws)) - datetime.now()
        except ValueError:
            return False
        return left < timedelta(seconds=save_ckpt_duration + max_steps_duration + redundant_time)
    return False


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


def esi_save_due(trainer_config: Mapping, max_steps_duration: float) -> bool:
    """verl's forced save: with `trainer.save_freq` > 0, True (and one line printed) when `should_save_ckpt_esi`
    says the capacity block ends within the longest step so far, a save and `trainer.esi_redundant_time`."""
    due = (trainer_config.get("save_freq") or 0) > 0 and should_save_ckpt_esi(
        max_steps_duration, redundant_time=trainer_config.get("esi_redundant_time", 0)
    )
    if due:
        print("Force saving checkpoint: ESI instance expiration approaching.")
    return due
