"""The `remax` workflow: a sampled and a greedy completion per row, the reward difference as the signal.

Both requests land in the same engine flush; the row trains on the sample with `token_level_scores` = r(sample)
and `reward_baselines` = r(greedy) (with `adv_estimator=remax`: ReMax, examples/remax_reinforce/). Validation
makes only the sampled completion (baseline 0). workflow_kwargs: `reward_fn` (dotted path or "file.py:name" of a
verl `compute_score`; default `default_compute_score`) and `reward_kwargs`. Layer 5: must not import Ray.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from verl.protocol import DataProto
from verl.utils.reward_score import default_compute_score
from verl.workers.reward_manager.base import accepts_keyword
from verl.workers.rollout.async_engine import AsyncRolloutEngine, ModelRequest, ModelResponse
from verl.workers.rollout.workflows.base import RolloutWorkflow, load_callable, prompt_ids_of, single_turn_row


class ReMaxWorkflow(RolloutWorkflow):
    extra_output_keys = {"token_level_scores": "response", "reward_baselines": "scalar"}

    def __init__(self, config: Any, tokenizer: Any, reward_fn: str | None = None, reward_kwargs: dict | None = None):
        super().__init__(config, tokenizer)
        self.compute_score = load_callable(reward_fn) if reward_fn else default_compute_score
        self.reward_kwargs = dict(reward_kwargs or {})

    def score(self, data: DataProto, resp: ModelResponse) -> float:
        """The reward of one completion, computed as the naive reward manager does (decoded without specials)."""
        reward_model = data.non_tensor_batch["reward_model"][0]
        extra_info = data.non_tensor_batch["extra_info"][0] if "extra_info" in data.non_tensor_batch else None
        kwargs = dict(self.reward_kwargs)
        step = data.meta_info.get("global_steps")
        if step is not None and accepts_keyword(self.compute_score, "step"):
            kwargs["step"] = int(step)
        result = self.compute_score(
            data_source=data.non_tensor_batch["data_source"][0],
            solution_str=self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True),
            ground_truth=reward_model["ground_truth"],
            extra_info=extra_info,
            **kwargs,
        )
        return float(result["score"] if isinstance(result, dict) else result)

    async def arun_episode(self, engine: AsyncRolloutEngine, data: DataProto) -> DataProto:
        for key in ("data_source", "reward_model"):
            if key not in data.non_tensor_batch:
                raise KeyError(f"the remax workflow scores rows itself and needs non_tensor_batch[{key!r}]")
        prompt = prompt_ids_of(data)
        gconfig = engine.default_gconfig()
        if data.meta_info.get("validate", False):
            sample, baseline = await engine.agenerate(ModelRequest(prompt, gconfig)), 0.0
        else:
            sample, greedy = await asyncio.gather(
                engine.agenerate(ModelRequest(prompt, gconfig)),
                engine.agenerate(ModelRequest(prompt, gconfig.new(greedy=True))),
            )
            baseline = self.score(data, greedy)
        row = single_turn_row(engine, data, sample)
        scores = torch.zeros(row.batch["responses"].shape, dtype=torch.float32)
        last = max(int(row.batch["response_mask"][0].sum()) - 1, 0)  # the reward manager's position
        scores[0, last] = self.score(data, sample)
        row.batch["token_level_scores"] = scores
        row.batch["reward_baselines"] = torch.tensor([baseline], dtype=torch.float32)
        return row
