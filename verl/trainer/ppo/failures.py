"""How a PPO run fails: the errors that end a started run, and the one line each is reported with.

Owns `NonFiniteStepsError` and `count_nonfinite_steps` (stop after `trainer.max_nonfinite_steps`
non-finite updates in a row), `refuse_nonfinite_checkpoint` (turn a worker's `NonFiniteWeightsError`
into one clear driver-side error), `RUN_FAILURES` (what `main_ppo` reports as one `error:` line instead of
a traceback), `one_line(err)` and `at_step` (a worker group's failure names the training step it happened in).

Layer 8 helper: imports the exception types of the lower layers, never the trainer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from verl.single_controller.ray.base import WorkerDiedError
from verl.utils.checkpoint.errors import NonFiniteWeightsError
from verl.workers.reward_manager.base import RewardFunctionError

__all__ = [
    "RUN_FAILURES",
    "NonFiniteStepsError",
    "at_step",
    "count_nonfinite_steps",
    "one_line",
    "refuse_nonfinite_checkpoint",
    "unwrap",
]


class NonFiniteStepsError(RuntimeError):
    """Too many updates in a row had a NaN/inf loss or grad norm."""


# a started run ends with one `error:` line for these (a worker's exception arrives wrapped by Ray)
RUN_FAILURES = (RewardFunctionError, WorkerDiedError, NonFiniteStepsError, NonFiniteWeightsError, TimeoutError)


def count_nonfinite_steps(in_a_row: int, metrics: dict[str, float], limit: int | None, run_dir: str) -> int:
    """The new count of non-finite steps in a row after a step with `metrics`.

    A step counts when the actor or the critic skipped an optimizer step (`actor/nonfinite_steps`,
    `critic/nonfinite_steps` > 0); a clean step resets the count. Raises NonFiniteStepsError once the
    count reaches `limit` (<= 0 or None: never).
    """
    skipped = metrics.get("actor/nonfinite_steps", 0.0) + metrics.get("critic/nonfinite_steps", 0.0)
    in_a_row = in_a_row + 1 if skipped > 0 else 0
    if limit is not None and int(limit) > 0 and in_a_row >= int(limit):
        raise NonFiniteStepsError(
            f"{in_a_row} steps in a row had a non-finite loss or grad norm (trainer.max_nonfinite_steps={limit}); "
            f"stopping. The last complete checkpoint is kept in {run_dir}. Lower the learning rate or check the "
            "rewards for NaN/inf."
        )
    return in_a_row


def refuse_nonfinite_checkpoint(err: BaseException, latest: str | None) -> NonFiniteWeightsError:
    """The driver-side error for a checkpoint a worker refused because its weights hold NaN/inf."""
    message = str(unwrap(err)).strip().splitlines()[0]
    return NonFiniteWeightsError(f"{message}; the latest complete checkpoint stays {latest or 'none'}")


def unwrap(err: BaseException) -> BaseException:
    """The worker's own exception when Ray wrapped it (a RayTaskError's `.cause`), else `err`."""
    cause: Any = getattr(err, "cause", None)
    return cause if isinstance(cause, BaseException) else err


def one_line(err: BaseException) -> str:
    """`Type: first line of the message` of `err` (of the worker's own exception for one Ray wrapped)."""
    err = unwrap(err)
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


@contextlib.contextmanager
def at_step(step: int) -> Iterator[None]:
    """Inside the block, a `WorkerDiedError` (a worker or its node lost) is raised again as `step N: <message>`."""
    try:
        yield
    except WorkerDiedError as err:
        raise WorkerDiedError(f"step {step}: {err}") from err
