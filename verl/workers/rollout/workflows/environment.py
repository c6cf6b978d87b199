"""The `environment` workflow: a verifiers-style `Environment` drives each episode through the OpenAI API.

Per row the environment runs `env.run(...)` with a fresh in-process `OpenAIClient`, the row's `raw_prompt`
(`data.return_raw_chat=true`) and `reward_model["ground_truth"]`; the client's `trajectory()` becomes the training
row, the rubric's reward at the last model token. An episode without a request is rejected. workflow_kwargs:
`env` (dotted path, "file.py:Class" or an instance), `env_kwargs`, `sampling_args`. Layer 5: must not import Ray.
"""

from __future__ import annotations

from typing import Any

import torch

from verl.envs.environment import Environment
from verl.envs.openai_client import OpenAIClient
from verl.protocol import DataProto
from verl.utils.torch_functional import compute_position_id_with_mask
from verl.workers.rollout.async_engine import AsyncRolloutEngine
from verl.workers.rollout.workflows.base import RolloutWorkflow, load_callable, trajectory_row


def with_prompt(data: DataProto, prompt_ids: list[int], pad_token_id: int) -> DataProto:
    """`data` (one row) with its prompt replaced by `prompt_ids`, left-padded to the same width."""
    width = data.batch["input_ids"].shape[-1]
    if len(prompt_ids) > width:
        raise ValueError(
            f"the environment's prompt has {len(prompt_ids)} tokens, more than the batch's prompt width {width}; "
            "raise data.max_prompt_length"
        )
    ids = torch.full((1, width), pad_token_id, dtype=data.batch["input_ids"].dtype)
    mask = torch.zeros((1, width), dtype=data.batch["attention_mask"].dtype)
    if prompt_ids:
        ids[0, width - len(prompt_ids) :] = torch.tensor(prompt_ids, dtype=ids.dtype)
        mask[0, width - len(prompt_ids) :] = 1
    tensors = {"input_ids": ids, "attention_mask": mask, "position_ids": compute_position_id_with_mask(mask)}
    return DataProto.from_dict(tensors=tensors, non_tensors=dict(data.non_tensor_batch), meta_info=dict(data.meta_info))


class EnvironmentWorkflow(RolloutWorkflow):
    extra_output_keys = {"token_level_scores": "response"}

    def __init__(self, config: Any, tokenizer: Any, env: Any = None, env_kwargs: dict | None = None,
                 sampling_args: dict | None = None):  # fmt: skip
        super().__init__(config, tokenizer)
        if env is None:
            raise ValueError(
                "the environment workflow needs rollout.workflow_kwargs.env (e.g. 'verl.envs.gsm8k:GSM8KEnv')"
            )
        self.env = load_callable(env)(**(env_kwargs or {})) if isinstance(env, str) else env
        if not isinstance(self.env, Environment):
            raise TypeError(f"rollout.workflow_kwargs.env={env!r} is not a verl.envs.Environment")
        self.sampling_args = dict(sampling_args or {})

    async def arun_episode(self, engine: AsyncRolloutEngine, data: DataProto) -> DataProto | None:
        if "raw_prompt" not in data.non_tensor_batch:
            raise KeyError("the environment workflow needs the chat prompt: set data.return_raw_chat=true")
        prompt = list(data.non_tensor_batch["raw_prompt"][0])
        reward_model = data.non_tensor_batch.get("reward_model")
        answer = reward_model[0].get("ground_truth") if reward_model is not None else None
        info = data.non_tensor_batch["extra_info"][0] if "extra_info" in data.non_tensor_batch else None
        client = OpenAIClient(engine, self.tokenizer)
        result = await self.env.run(client, prompt, answer, self.sampling_args, info=info)
        trajectory = client.trajectory()
        if trajectory is None:
            return None
        row = trajectory_row(engine, with_prompt(data, trajectory.prompt_ids, engine.pad_token_id), trajectory.response_ids,
                             trajectory.loss_mask, trajectory.logprobs)  # fmt: skip
        scores = torch.zeros(row.batch["responses"].shape, dtype=torch.float32)
        trained = row.batch["response_mask"][0].nonzero()
        scores[0, int(trained[-1]) if trained.numel() else 0] = float(result.reward)
        row.batch["token_level_scores"] = scores
        return row
