"""Start-up checks of the `trainer.*` / `data.*` keys that steer the driver's loop around the PPO step: generation
dumps, val_only, checkpoint retention and callbacks, the expiring-instance save, DataLoader workers, and the keys
that verl 0.9.1 itself reads but never acts on for local FSDP runs (a notice says so, rather than nothing).

`check_run_options(config)` raises ValueError naming key, value and what is allowed, and returns the notices it
printed. Layer 8 helper: reads the config only.
"""

from __future__ import annotations

import os
from numbers import Real

from verl.trainer.ppo import checkpoint as ckpt
from verl.utils.dataset.prompt_loader import check_num_workers


def _notice(lines: list[str], text: str) -> None:
    lines.append(text)
    print(f"notice: {text}")


def check_run_options(config) -> list[str]:
    trainer, data = config.trainer, config.data
    notices: list[str] = []
    for key in ("rollout_data_dir", "validation_data_dir"):
        value = trainer.get(key, None)
        if value is not None and not isinstance(value, str):
            raise ValueError(
                f"trainer.{key}={value!r} must be null or a folder path (one <global_step>.jsonl per dump)"
            )
    esi = trainer.get("esi_redundant_time", 0)
    if isinstance(esi, bool) or not isinstance(esi, Real) or esi < 0:
        raise ValueError(f"trainer.esi_redundant_time={esi!r} must be a number of seconds >= 0")
    ckpt.retention_limits(trainer)
    workers = check_num_workers(data.get("dataloader_num_workers", 8))
    cpus = os.cpu_count() or 1
    if workers > cpus:
        _notice(notices, f"data.dataloader_num_workers={workers} worker processes per loader on {cpus} CPUs")
    if workers and data.get("domains"):
        _notice(
            notices,
            f"data.dataloader_num_workers={workers} loads validation prompts only: with data.domains each training "
            "batch is drawn from the domain sampler when it is needed (dynamic sampling draws more), so it loads in "
            "the driver",
        )
    if trainer.get("val_only", False) and not trainer.get("val_before_train", True):
        _notice(
            notices, "trainer.val_only=true acts only with trainer.val_before_train=true (as in verl): training runs"
        )
    if trainer.get("del_local_ckpt_after_load", False):
        _notice(
            notices,
            "trainer.del_local_ckpt_after_load=true keeps local checkpoints, as verl 0.9.1 does: its checkpoint managers "
            "delete only files of hdfs:// paths, which this trainer does not use",
        )
    timeout = trainer.get("ray_wait_register_center_timeout", 300)
    if timeout != 300:
        _notice(
            notices,
            f"trainer.ray_wait_register_center_timeout={timeout} has no effect, as in verl 0.9.1 (RayWorkerGroup stores "
            "it and never reads it); workers here get rank 0's address from rank 0 itself",
        )
    return notices
