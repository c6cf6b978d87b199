"""The batch reward manager: one call of the score function for the whole batch (verl's "batch").

Owns `BatchRewardManager`, registered as "batch", and `default_batch_compute_score` (the per-sample
default scorer applied to lists). The score function is called once as
`compute_score(data_sources=[...], solution_strs=[...], ground_truths=[...], extra_infos=[...], **kwargs)`
and must return one result per sample (a number, a dict with "score", or rlla's tuple); `timeout_s`
limits that one call.
"""

from __future__ import annotations

from typing import Any

from verl.utils.reward_score import default_compute_score
from verl.workers.reward_manager.base import (
    RewardFunctionError,
    RewardManagerBase,
    RewardSample,
    ScoreFailure,
    call_with_timeout,
)
from verl.workers.reward_manager.registry import register_reward_manager

__all__ = ["BatchRewardManager", "default_batch_compute_score"]


def default_batch_compute_score(
    data_sources: list, solution_strs: list[str], ground_truths: list, extra_infos: list, **kwargs: Any
) -> list[Any]:
    """`default_compute_score` over lists: the batch manager's scorer when none is given."""
    return [
        default_compute_score(source, solution, truth, extra, **kwargs)
        for source, solution, truth, extra in zip(data_sources, solution_strs, ground_truths, extra_infos)
    ]


@register_reward_manager("batch")
class BatchRewardManager(RewardManagerBase):
    """Scores the whole batch with a single `compute_score` call on lists."""

    default_scorer = staticmethod(default_batch_compute_score)

    def __init__(
        self, tokenizer: Any, num_examine: int, compute_score=None, reward_fn_key: str = "data_source", **kwargs: Any
    ) -> None:
        super().__init__(tokenizer, num_examine, compute_score, reward_fn_key, **kwargs)

    def score_samples(self, samples: list[RewardSample], kwargs: dict[str, Any]) -> list[Any]:
        where = f"a batch of {len(samples)} samples (data sources {sorted({str(s.data_source) for s in samples})})"
        name = getattr(self.compute_score, "__name__", type(self.compute_score).__name__)
        try:
            lists = {
                "data_sources": [s.data_source for s in samples],
                "solution_strs": [s.response_str for s in samples],
                "ground_truths": [s.ground_truth for s in samples],
                "extra_infos": [s.extra_info for s in samples],
            }
            results = call_with_timeout(self.timeout_s, self.compute_score, kwargs={**kwargs, **lists})
        except Exception as err:  # one failure covers the whole batch
            message = f"{type(err).__name__}: {err}"
            if self.on_error == "raise":
                raise RewardFunctionError(f"reward function {name} on {where}: {message}") from err
            return [ScoreFailure(message, err) for _ in samples]
        if not isinstance(results, (list, tuple)) or len(results) != len(samples):
            shown = (
                f"{type(results).__name__} of length {len(results)}" if hasattr(results, "__len__") else repr(results)
            )
            message = f"returned {shown:.200}; expected a list of {len(samples)} results"
            if self.on_error == "raise":
                raise RewardFunctionError(f"reward function {name} on {where}: {message}")
            return [ScoreFailure(message) for _ in samples]
        return list(results)
