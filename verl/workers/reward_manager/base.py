"""What every reward manager shares: decode responses, call the score function, check what it returns, and place
each score at the last valid response token.

Owns `RewardManagerBase` (subclasses override `score_samples` or `final_rewards`), `RewardSample`, `ScoreFailure`,
`RewardFunctionError` and `normalize_result`. `timeout_s` interrupts a score call by SIGALRM (main thread, between
bytecodes). A failure (exception, timeout, or not a finite number / dict with "score" / rlla's 4-tuple) raises
`RewardFunctionError` naming row, data_source and value, or with `on_error="zero"` scores 0.0 and sets
`reward_extra_info["reward_errors"]`. Layer 4: never models or Ray.
"""

from __future__ import annotations

import inspect
import math
import numbers
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from verl.protocol import DataProto
from verl.utils.reward_score import default_compute_score

__all__ = [
    "RewardFunctionError",
    "RewardManagerBase",
    "RewardSample",
    "ScoreFailure",
    "call_with_timeout",
    "normalize_result",
]

ON_ERROR_CHOICES = ("raise", "zero")
FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # scores become a float32 tensor: larger ones turn into inf
RLLA_TUPLE_KEYS = ("score", "format", "correctness", "length")


class RewardFunctionError(RuntimeError):
    """A reward function failed or returned something that is not a score, for one named sample."""


@dataclass
class RewardSample:
    """One row to score: the decoded response and where its score goes."""

    row: int
    data_source: Any
    response_str: str
    ground_truth: Any
    extra_info: Any
    dataset_index: Any  # non_tensor_batch["index"][row] when present, else None
    response_length: int  # valid response tokens (up to the last one in the response mask)
    last_position: int  # column of the score in (bs, response_length); 0 for an empty response

    def describe(self) -> str:
        index = "" if self.dataset_index is None else f", index={self.dataset_index!r}"
        return f"row {self.row} (data_source={self.data_source!r}{index})"


@dataclass
class ScoreFailure:
    """Why one sample has no score: a message and, when there was one, the exception."""

    message: str
    error: BaseException | None = None


def _is_real(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.is_complex()
    return isinstance(value, numbers.Real)


def normalize_result(value: Any) -> tuple[float, dict[str, Any]]:
    """A score function's result -> (score, extra info); ValueError/TypeError naming a bad value.

    Allowed: a real number, a dict with a real "score" (all keys become extra info), or rlla's
    `(score, format, correctness, length)` tuple.
    """
    extra: dict[str, Any] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"returned a dict without 'score' (keys {sorted(map(str, value))})")
        score, extra = value["score"], dict(value)
    elif isinstance(value, tuple):
        if len(value) != len(RLLA_TUPLE_KEYS):
            raise ValueError(
                f"returned a tuple of length {len(value)}: {value!r:.200}; allowed: a number, a dict with "
                "'score', or rlla's (score, format, correctness, length)"
            )
        score, extra = value[0], dict(zip(RLLA_TUPLE_KEYS, value))
    else:
        score = value
    if not _is_real(score):
        raise TypeError(f"returned score {score!r:.200} of type {type(score).__name__}; expected a real number")
    score = float(score)
    if not math.isfinite(score):
        raise ValueError(f"returned a non-finite score {score}")
    if abs(score) > FLOAT32_MAX:
        raise ValueError(f"returned score {score} outside the float32 range (|score| <= {FLOAT32_MAX:.4g})")
    return score, extra


def call_with_timeout(timeout_s: float | None, fn: Callable, args: tuple = (), kwargs: dict | None = None) -> Any:
    """`fn(*args, **kwargs)`, interrupted by a TimeoutError after `timeout_s` seconds (None: no limit).

    Uses SIGALRM (main thread only); an alarm already set by the caller is restored afterwards.
    """
    kwargs = kwargs or {}
    if timeout_s is None:
        return fn(*args, **kwargs)
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "reward_model.timeout_s needs the reward manager to run in the main thread (it uses SIGALRM); "
            "use reward_model.reward_manager=prime for per-sample processes with a timeout"
        )

    def on_alarm(signum: int, frame: Any) -> None:
        raise TimeoutError(f"scoring took longer than {timeout_s} s (reward_model.timeout_s)")

    previous_handler = signal.signal(signal.SIGALRM, on_alarm)
    previous_delay, previous_interval = signal.setitimer(signal.ITIMER_REAL, timeout_s)
    start = time.monotonic()
    try:
        return fn(*args, **kwargs)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
        if previous_delay > 0:  # give the caller's alarm back, minus the time spent here
            left = max(previous_delay - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, previous_interval)


def accepts_keyword(fn: Callable, name: str) -> bool:
    """Whether `fn` takes a keyword argument `name` (explicitly or through **kwargs)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def response_mask_of(data: DataProto) -> torch.Tensor:
    """(bs, response_length) mask of valid response tokens: `response_mask`, else the attention mask's tail."""
    responses = data.batch["responses"]
    if "response_mask" in data.batch.keys():
        return data.batch["response_mask"]
    return data.batch["attention_mask"][:, -responses.shape[-1] :]


class RewardManagerBase:
    """verl's reward-manager contract: `manager(data, return_dict=False)` -> token-level scores.

    Args:
        tokenizer: decodes `responses` (`skip_special_tokens=True`).
        num_examine: responses printed per data_source per call (0 = none).
        compute_score: `fn(data_source, solution_str, ground_truth, extra_info, **kwargs)`; default
            `default_compute_score`.
        reward_fn_key: the non-tensor column naming each row's data source.
        on_error: "raise" or "zero" (see the module docstring).
        timeout_s: wall-time limit of one score call in seconds (None: no limit; see the module docstring).
        **score_kwargs: extra keyword arguments for every `compute_score` call (e.g. rlla flags).

    A batch holding a reward model's `rm_scores` (bs, response_length): without a custom score function those
    scores are the reward (verl); with one, the function decides and finds the row's reward-model score
    (`rm_scores` summed over the response) in `extra_info["rm_score"]`. A row of verl's agent loops
    (`tool_extra_fields`, `__num_turns__`) gets the loop's extra fields (`tool_rewards`, ...) and `num_turns` merged
    into its `extra_info`, as verl's reward loop passes them.
    """

    default_scorer = staticmethod(default_compute_score)  # the batch manager's takes lists

    def __init__(
        self,
        tokenizer: Any,
        num_examine: int,
        compute_score: Callable | None = None,
        reward_fn_key: str = "data_source",
        on_error: str = "raise",
        timeout_s: float | None = None,
        **score_kwargs: Any,
    ) -> None:
        if on_error not in ON_ERROR_CHOICES:
            raise ValueError(f"on_error={on_error!r}; allowed: {ON_ERROR_CHOICES}")
        if timeout_s is not None and not (isinstance(timeout_s, numbers.Real) and timeout_s > 0):
            raise ValueError(f"reward_model.timeout_s={timeout_s!r}; allowed: null (no limit) or seconds > 0")
        self.timeout_s = None if timeout_s is None else float(timeout_s)
        self.tokenizer = tokenizer
        self.num_examine = int(num_examine)
        self.compute_score = compute_score or self.default_scorer
        # a custom function: anything but the default scorer (also when bound to settings, e.g. a sandbox url)
        self.custom_score = getattr(compute_score, "func", compute_score) not in (None, self.default_scorer)
        self.reward_fn_key = reward_fn_key
        self.on_error = on_error
        self.score_kwargs = score_kwargs

    # ------------------------------------------------------------------ decoding
    def decode_samples(self, data: DataProto) -> list[RewardSample]:
        """One RewardSample per row: the response up to its last valid token, decoded without specials."""
        non_tensors = data.non_tensor_batch
        for key in (self.reward_fn_key, "reward_model"):
            if key not in non_tensors:
                raise KeyError(
                    f"reward manager needs non_tensor_batch[{key!r}]; the batch has {sorted(non_tensors)} "
                    "(the data source column is set by data.reward_fn_key)"
                )
        mask = response_mask_of(data)
        positions = torch.arange(1, mask.shape[-1] + 1, device=mask.device)
        lengths = (mask.bool() * positions).max(dim=-1).values.tolist()  # last valid position + 1, 0 if none
        responses = data.batch["responses"]
        rm_scores = data.batch["rm_scores"].sum(-1).tolist() if "rm_scores" in data.batch.keys() else None
        samples = []
        for row, length in enumerate(lengths):
            reward_model = non_tensors["reward_model"][row]
            if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
                raise KeyError(f"row {row}: reward_model must be a dict with 'ground_truth', got {reward_model!r:.200}")
            extra_info = non_tensors["extra_info"][row] if "extra_info" in non_tensors else None
            if rm_scores is not None:  # a reward model scored the row: the custom function gets its score
                extra_info = {**(extra_info or {}), "rm_score": rm_scores[row]}
            if "tool_extra_fields" in non_tensors:  # an agent loop's row: its extra fields, as verl's reward loop
                turns = non_tensors["__num_turns__"][row] if "__num_turns__" in non_tensors else None
                extra_info = {**(extra_info or {}), **(non_tensors["tool_extra_fields"][row] or {}), "num_turns": turns}
            samples.append(
                RewardSample(
                    row=row,
                    data_source=non_tensors[self.reward_fn_key][row],
                    response_str=self.tokenizer.decode(responses[row, :length].tolist(), skip_special_tokens=True),
                    ground_truth=reward_model["ground_truth"],
                    extra_info=extra_info,
                    dataset_index=non_tensors["index"][row] if "index" in non_tensors else None,
                    response_length=int(length),
                    last_position=max(int(length) - 1, 0),
                )
            )
        return samples

    def call_kwargs(self, data: DataProto) -> dict[str, Any]:
        """Keyword arguments of every score call: `score_kwargs`, plus `step` from meta_info["global_steps"]."""
        kwargs = dict(self.score_kwargs)
        step = data.meta_info.get("global_steps")
        if step is not None and accepts_keyword(self.compute_score, "step"):
            kwargs["step"] = int(step)
        return kwargs

    # ------------------------------------------------------------------ scoring (subclasses override)
    def score_one(self, sample: RewardSample, kwargs: dict[str, Any]) -> Any:
        return self.compute_score(
            data_source=sample.data_source,
            solution_str=sample.response_str,
            ground_truth=sample.ground_truth,
            extra_info=sample.extra_info,
            **kwargs,
        )

    def score_samples(self, samples: list[RewardSample], kwargs: dict[str, Any]) -> list[Any]:
        """Raw results, one per sample (a ScoreFailure where scoring failed); sequential by default."""
        outcomes: list[Any] = []
        for sample in samples:
            try:
                outcomes.append(call_with_timeout(self.timeout_s, self.score_one, (sample, kwargs)))
            except Exception as err:  # reported per sample below, by on_error
                if self.on_error == "raise":
                    raise self._error(sample, f"{type(err).__name__}: {err}") from err
                outcomes.append(ScoreFailure(f"{type(err).__name__}: {err}", err))
        return outcomes

    def final_rewards(self, samples: list[RewardSample], scores: list[float], extra: dict[str, list]) -> list[float]:
        """Per-sample rewards from the scores (DAPO adds its overlong penalty here)."""
        return scores

    # ------------------------------------------------------------------ assembling
    def _error(self, sample: RewardSample, message: str) -> RewardFunctionError:
        name = getattr(self.compute_score, "__name__", type(self.compute_score).__name__)
        return RewardFunctionError(f"reward function {name} on {sample.describe()}: {message}")

    def _collect(self, samples: list[RewardSample], outcomes: list[Any]) -> tuple[list[float], dict[str, list]]:
        scores, extras, errors = [], [], []
        for sample, outcome in zip(samples, outcomes):
            if not isinstance(outcome, ScoreFailure):
                try:
                    score, extra = normalize_result(outcome)
                except (TypeError, ValueError) as err:
                    outcome = ScoreFailure(str(err))
            if isinstance(outcome, ScoreFailure):
                if self.on_error == "raise":
                    raise self._error(sample, outcome.message) from outcome.error
                score, extra = 0.0, {}
            scores.append(score)
            extras.append(extra)
            errors.append(int(isinstance(outcome, ScoreFailure)))
        keys = list(dict.fromkeys(key for extra in extras for key in extra))
        extra_info = {key: [extra.get(key) for extra in extras] for key in keys}
        if self.on_error == "zero":
            extra_info["reward_errors"] = errors
            if any(errors):
                first = samples[errors.index(1)]
                print(f"reward: {sum(errors)}/{len(samples)} samples failed and scored 0; first: {first.describe()}")
        return scores, extra_info

    def _examine(self, samples: list[RewardSample], rewards: list[float]) -> None:
        printed: dict[Any, int] = {}
        for sample, reward in zip(samples, rewards):
            if printed.get(sample.data_source, 0) >= self.num_examine:
                continue
            printed[sample.data_source] = printed.get(sample.data_source, 0) + 1
            print(f"[{sample.data_source}] response: {sample.response_str!r:.500}")
            print(f"[{sample.data_source}] ground_truth: {sample.ground_truth!r:.300}  reward: {reward:.4f}")

    def __call__(self, data: DataProto, return_dict: bool = False) -> torch.Tensor | dict[str, Any]:
        """Token-level scores (bs, response_length): each reward at its response's last valid token.

        With `return_dict`: {"reward_tensor": that tensor, "reward_extra_info": {key: [one value per sample]}}.
        A batch that already has `rm_scores` (a reward model's output) is returned as is, unless a custom score
        function decides (see the class docstring).
        """
        if "rm_scores" in data.batch.keys() and not self.custom_score:
            tensor = data.batch["rm_scores"]
            return {"reward_tensor": tensor, "reward_extra_info": {}} if return_dict else tensor
        samples = self.decode_samples(data)
        outcomes = self.score_samples(samples, self.call_kwargs(data))
        scores, extra_info = self._collect(samples, outcomes)
        rewards = self.final_rewards(samples, scores, extra_info)
        responses = data.batch["responses"]
        tensor = torch.zeros(responses.shape, dtype=torch.float32, device=responses.device)
        rows = torch.arange(len(samples), device=responses.device)
        columns = torch.tensor([s.last_position for s in samples], dtype=torch.long, device=responses.device)
        tensor[rows, columns] = torch.tensor(rewards, dtype=torch.float32, device=responses.device)
        if self.num_examine > 0:
            self._examine(samples, rewards)
        return {"reward_tensor": tensor, "reward_extra_info": extra_info} if return_dict else tensor
