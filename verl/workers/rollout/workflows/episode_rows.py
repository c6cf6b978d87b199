"""The one adapter between the trainer's DataProto rows and AReaL-lite-style workflows on plain rows.

In the trainer every workflow gets an `EpisodeRow`: a one-row DataProto that also reads like a dict row
(`row["messages"]` from `raw_prompt`, non-tensor fields, `keys()`, `get`, `**row`). A TensorDict result (`input_ids`,
`attention_mask`, `loss_mask`, optional `rewards`, `logprobs`, `versions`) becomes the training row by
`training_row`. Layer 5: must not import Ray.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from verl.protocol import DataProto
from verl.utils.torch_functional import compute_position_id_with_mask

__all__ = ["EpisodeRow", "training_row"]


class EpisodeRow(DataProto):
    """A one-row DataProto that also answers `row["<field>"]` like AReaL-lite's dict rows (module docstring)."""

    @classmethod
    def of(cls, row: DataProto) -> EpisodeRow:
        return cls(batch=row.batch, non_tensor_batch=row.non_tensor_batch, meta_info=row.meta_info)

    def keys(self) -> list[str]:
        """The row's plain fields: its non-tensor fields, plus `messages` when the raw chat is kept."""
        fields = list(self.non_tensor_batch)
        if "raw_prompt" in self.non_tensor_batch and "messages" not in fields:
            fields.append("messages")
        return fields

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self.keys() else default

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self.keys()

    def __getitem__(self, item: Any) -> Any:
        if not isinstance(item, str):
            return super().__getitem__(item)
        if item in self.non_tensor_batch:
            return self.non_tensor_batch[item][0]
        if item == "messages" and "raw_prompt" in self.non_tensor_batch:
            return list(self.non_tensor_batch["raw_prompt"][0])
        hint = " (the chat is kept with data.return_raw_chat=true)" if item == "messages" else ""
        raise KeyError(f"row has no field {item!r}{hint}; fields: {self.keys()}")


def _prompt_part(prompt_ids: list[int], width: int, pad_token_id: int, template: DataProto) -> DataProto:
    """`prompt_ids` left-padded to `width` (the generation batch's prompt width) as a one-row prompt DataProto."""
    if len(prompt_ids) > width:
        raise ValueError(
            f"the workflow's prompt has {len(prompt_ids)} tokens, more than the batch's prompt width {width} "
            "(data.max_prompt_length)"
        )
    dtype = template.batch["input_ids"].dtype
    ids = torch.full((1, width), pad_token_id, dtype=dtype)
    mask = torch.zeros((1, width), dtype=template.batch["attention_mask"].dtype)
    if prompt_ids:
        ids[0, width - len(prompt_ids) :] = torch.tensor(prompt_ids, dtype=dtype)
        mask[0, width - len(prompt_ids) :] = 1
    tensors = {"input_ids": ids, "attention_mask": mask, "position_ids": compute_position_id_with_mask(mask)}
    return DataProto.from_dict(tensors=tensors, non_tensors=dict(template.non_tensor_batch))


def training_row(engine: Any, data: DataProto, episode: TensorDict | dict, index: int) -> DataProto:
    """The trainer's row for an AReaL-lite-style result `episode` (batch size [1]) of the input row `data`.

    The prompt is `input_ids` before the first `loss_mask` token, the response the rest of the attended tokens
    (cut to `rollout.response_length`), `response_mask` the loss mask there. With `rewards`, `token_level_scores`
    holds the reward at the response's last loss token (what a reward manager writes); with
    `rollout.calculate_log_probs`, `rollout_log_probs` come from `logprobs` (required then).
    """
    from verl.workers.rollout.workflows.base import trajectory_row  # base imports this module

    for key in ("input_ids", "attention_mask", "loss_mask"):
        if key not in episode.keys():
            raise KeyError(
                f"arun_episode row {index}: a TensorDict episode needs {key!r}; has {sorted(episode.keys())}"
            )
    if episode["input_ids"].dim() != 2 or episode["input_ids"].shape[0] != 1:
        raise ValueError(f"arun_episode row {index}: input_ids must be (1, L), got {tuple(episode['input_ids'].shape)}")
    attended = episode["attention_mask"][0].bool()
    ids = episode["input_ids"][0][attended].tolist()
    loss_mask = episode["loss_mask"][0][attended].tolist()
    if not any(loss_mask):
        raise ValueError(f"arun_episode row {index}: loss_mask has no 1 (no completion token to train on)")
    start = next(i for i, m in enumerate(loss_mask) if m)
    width = data.batch["input_ids"].shape[-1]
    prompt = _prompt_part(ids[:start], width, engine.pad_token_id, data)
    log_probs = None
    if bool(engine.config.get("calculate_log_probs", False)):
        if "logprobs" not in episode.keys():
            raise KeyError(
                f"arun_episode row {index}: rollout.calculate_log_probs=true needs per-token 'logprobs' in the episode"
            )
        log_probs = episode["logprobs"][0][attended].tolist()[start:]
    row = trajectory_row(engine, prompt, ids[start:], loss_mask[start:], log_probs)
    if "rewards" in episode.keys():
        rewards = episode["rewards"].reshape(1, -1)[0][attended].tolist()[start:]
        response_mask = row.batch["response_mask"][0]
        scores = torch.zeros(response_mask.shape, dtype=torch.float32).unsqueeze(0)
        if response_mask.any():
            last = int(response_mask.nonzero().max())
            scores[0, last] = float(rewards[last])
        row.batch["token_level_scores"] = scores
    return row
