"""The PRIME reward manager: score samples in parallel processes, each with a time limit.

Owns `PrimeRewardManager`, registered as "prime". Each sample is scored in its own process (at most
`num_processes` at a time) started from a forkserver that has already imported `verl.utils.reward_score`
(so a process costs a fork, not an interpreter start); a sample still running after `timeout_s` has its
process killed and counts as failed (`on_error` decides: error or 0). A process that dies (e.g. killed
for memory) fails its sample the same way. The score function and its results cross process
boundaries, so they must pickle: module-level functions, `functools.partial` of them, or a
`custom_reward_function.path` handle (see verl/trainer/ppo/reward.py). `start_method="fork"` skips the
forkserver (faster, but unsafe when the caller runs threads).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any

from verl.utils.reward_score.rlla import FLAG_NAMES
from verl.workers.reward_manager.base import RewardManagerBase, RewardSample, ScoreFailure
from verl.workers.reward_manager.registry import register_reward_manager

__all__ = ["PrimeRewardManager"]

START_METHODS = ("forkserver", "spawn", "fork")
FORKSERVER_PRELOAD = ["verl.utils.reward_score"]
CALL_TIME_ENV = FLAG_NAMES  # environment variables that scorers read at call time


def _score_in_child(conn: Connection, compute_score: Any, call: dict[str, Any], env: dict[str, str | None]) -> None:
    """Child process body: send ("ok", result) or ("error", message) back, then exit.

    `env` carries the caller's current values of the variables scorers read at call time (the rlla
    flags): a forkserver child would otherwise see the environment of when the forkserver started.
    """
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        payload = ("ok", compute_score(**call))
    except BaseException as err:  # everything, including SystemExit from the scorer, becomes a message
        payload = ("error", f"{type(err).__name__}: {err}")
    try:
        conn.send(payload)
    except Exception as err:  # an unpicklable result
        conn.send(("error", f"result could not be sent back: {type(err).__name__}: {err}"))
    conn.close()


@register_reward_manager("prime")
class PrimeRewardManager(RewardManagerBase):
    """Per-sample processes with a per-sample timeout.

    Args (beyond RewardManagerBase's):
        num_processes: samples scored at the same time (default: the CPU count, at most 8).
        timeout_s: wall-time limit of one sample, seconds (verl's default 300).
        start_method: "forkserver" (default), "spawn" or "fork".
    """

    def __init__(
        self,
        tokenizer: Any,
        num_examine: int,
        compute_score=None,
        reward_fn_key: str = "data_source",
        num_processes: int | None = None,
        timeout_s: float = 300.0,
        start_method: str = "forkserver",
        **kwargs: Any,
    ) -> None:
        super().__init__(tokenizer, num_examine, compute_score, reward_fn_key, **kwargs)
        if start_method not in START_METHODS:
            raise ValueError(f"prime start_method={start_method!r}; allowed: {START_METHODS}")
        if timeout_s <= 0:
            raise ValueError(f"prime timeout_s={timeout_s}; must be > 0")
        self.num_processes = int(num_processes or min(8, os.cpu_count() or 1))
        self.timeout_s = float(timeout_s)
        self.context = mp.get_context(start_method)
        if start_method == "forkserver":
            self.context.set_forkserver_preload(FORKSERVER_PRELOAD)
        if start_method != "fork":
            self._check_picklable()

    def _check_picklable(self) -> None:
        try:
            pickle.dumps(self.compute_score)
        except Exception as err:
            raise ValueError(
                f"prime reward manager needs a picklable compute_score, got {self.compute_score!r} ({err}); use a "
                "module-level function or custom_reward_function.path, or start_method='fork'"
            ) from err

    def _start(self, sample: RewardSample, kwargs: dict[str, Any]) -> tuple[Connection, Any]:
        receiver, sender = self.context.Pipe(duplex=False)
        call = dict(
            kwargs,
            data_source=sample.data_source,
            solution_str=sample.response_str,
            ground_truth=sample.ground_truth,
            extra_info=sample.extra_info,
        )
        env = {name: os.environ.get(name) for name in CALL_TIME_ENV}
        process = self.context.Process(
            target=_score_in_child, args=(sender, self.compute_score, call, env), daemon=True
        )
        process.start()
        sender.close()
        return receiver, process

    def score_samples(self, samples: list[RewardSample], kwargs: dict[str, Any]) -> list[Any]:
        outcomes: list[Any] = [None] * len(samples)
        pending = deque(range(len(samples)))
        running: dict[Connection, tuple[int, Any, float]] = {}
        try:
            while pending or running:
                while pending and len(running) < self.num_processes:
                    index = pending.popleft()
                    receiver, process = self._start(samples[index], kwargs)
                    running[receiver] = (index, process, time.monotonic() + self.timeout_s)
                next_deadline = min(deadline for _, _, deadline in running.values())
                for receiver in wait(list(running), timeout=max(0.0, next_deadline - time.monotonic())):
                    index, process, _ = running.pop(receiver)
                    outcomes[index] = self._receive(receiver, process)
                now = time.monotonic()
                for receiver, (index, process, deadline) in list(running.items()):
                    if now >= deadline:
                        del running[receiver]
                        process.kill()
                        process.join()
                        receiver.close()
                        outcomes[index] = ScoreFailure(f"TimeoutError: scoring took longer than {self.timeout_s} s")
        finally:
            for receiver, (_, process, _) in running.items():
                process.kill()
                process.join()
                receiver.close()
        for sample, outcome in zip(samples, outcomes):
            if isinstance(outcome, ScoreFailure) and self.on_error == "raise":
                raise self._error(sample, outcome.message)
        return outcomes

    @staticmethod
    def _receive(receiver: Connection, process: Any) -> Any:
        try:
            status, value = receiver.recv()
        except EOFError:  # the process died before answering
            process.join()
            return ScoreFailure(f"scoring process died with exit code {process.exitcode}")
        finally:
            receiver.close()
        process.join()
        return value if status == "ok" else ScoreFailure(value)
