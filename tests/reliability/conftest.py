"""Fixtures of the reliability tests: one uninterrupted reference run that the fault-injected runs must match.

The reference is a 4-step GRPO run on the tiny model (one CPU worker, a checkpoint every step, only the
newest kept) scored by `fault_rewards.rlla_or_kill_driver` with its fault disarmed, i.e. the built-in rlla
reward. It is made once per session (about 25 s) and shared by test_kill_resume.py and test_nonfinite.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.ppo_e2e import grpo_args, run_ppo, step_metrics, write_data

FAULT_REWARDS = Path(__file__).resolve().parent / "fault_rewards.py"
REFERENCE_STEPS = 4


@dataclass
class Reference:
    model: str
    data_dir: Path
    run_dir: Path
    metrics: dict[int, dict]
    wall_s: float

    def args(self, run_dir: Path, *extra: str) -> list[str]:
        """The reference run's arguments, writing into `run_dir` (extra overrides last)."""
        return grpo_args(
            self.model,
            self.data_dir,
            run_dir,
            f"trainer.total_training_steps={REFERENCE_STEPS}",
            "trainer.max_actor_ckpt_to_keep=1",
            f"custom_reward_function.path={FAULT_REWARDS}",
            "custom_reward_function.name=rlla_or_kill_driver",
            *extra,
        )


@pytest.fixture(scope="session")
def reference_run(tiny_model_dir, tmp_path_factory) -> Reference:
    root = tmp_path_factory.mktemp("reference")
    data_dir = write_data(root, n_train=16)
    ref = Reference(tiny_model_dir, data_dir, root / "run", {}, 0.0)
    start = time.monotonic()
    run_ppo(ref.args(ref.run_dir), cwd=root)
    ref.wall_s = time.monotonic() - start
    ref.metrics = step_metrics(ref.run_dir)
    assert sorted(ref.metrics) == list(range(1, REFERENCE_STEPS + 1))
    return ref
