"""The data-parallel PPO critic: value predictions of responses and the value-function update of one rank.

Owns `DataParallelPPOCritic` (verl's API: `compute_values`, `update_critic`): the batch keys an update needs, the
per-step shuffle, mini-batches and the critic's metrics. Forwards, backwards and the clipped optimizer step run on a
training engine (`verl.workers.engine.FSDPEngineWithValueHead`) with `verl.workers.utils.losses.value_loss`: the
worker's engine when it passes one, otherwise one made around the module and optimizer given (verl's constructor).
The module may be plain or FSDP2-wrapped; gradients are assumed averaged over data-parallel ranks.
Layer 5 (docs/architecture.md#layers): no Ray here.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import nn

from verl.protocol import DataProto
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass, plain_config
from verl.utils.py_functional import append_to_dict
from verl.workers.actor.dp_actor import positive_int, shuffled, step_generator
from verl.workers.config import FSDPCriticConfig
from verl.workers.engine.fsdp import FSDPEngineWithValueHead
from verl.workers.engine.utils import mask_padding_rows
from verl.workers.utils.losses import value_loss

__all__ = ["DataParallelPPOCritic"]


def response_mask_of(batch: Any) -> torch.Tensor:
    """`response_mask` (bs, response_len), or the response part of `attention_mask` when it is absent."""
    if "response_mask" in batch.keys():
        return batch["response_mask"]
    return batch["attention_mask"][:, -batch["responses"].shape[-1] :]


class DataParallelPPOCritic:
    """Value model of one data-parallel rank.

    `config`: the `critic` config (a `CriticConfig` or a mapping of its keys; verl's defaults for the rest) after the worker's normalisation (`ppo_mini_batch_size`,
    `ppo_micro_batch_size_per_gpu` in samples per rank; `model.use_remove_padding` / `model.share_prompt_prefix`
    pick the forward layout). `critic_module`: e.g. an `AutoModelForTokenClassification` with `num_labels=1`, or
    any module whose output has `.logits` of shape (bs, seq_len, 1). `engine`: the training engine owning module
    and optimizer (the worker's), else one is made around them.
    """

    def __init__(
        self,
        config: Any,
        critic_module: nn.Module,
        critic_optimizer: torch.optim.Optimizer,
        engine: FSDPEngineWithValueHead | None = None,
    ):
        self.config = config = omega_conf_to_dataclass(plain_config(config), FSDPCriticConfig)
        self.critic_module = critic_module
        self.critic_optimizer = critic_optimizer
        self.loss_agg_mode = config.loss_agg_mode
        self.engine = FSDPEngineWithValueHead.owning(
            engine, critic_module, critic_optimizer, config.model, config.grad_clip, "DataParallelPPOCritic"
        )

    def compute_values(self, data: DataProto) -> torch.Tensor:
        """Values (bs, response_len) of the responses, zero outside the response mask.

        `data.batch`: `input_ids`, `attention_mask`, `position_ids`, `responses` (and `response_mask`).
        `data.meta_info`: `micro_batch_size` (default `forward_micro_batch_size_per_gpu`), optional
        `use_dynamic_bsz` with `max_token_len`.
        """
        keys = [
            k
            for k in ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
            if k in data.batch.keys()
        ]
        batch = data.select(batch_keys=keys).batch
        if data.meta_info.get("use_dynamic_bsz", False):
            tu.assign_non_tensor(batch, use_dynamic_bsz=True, max_token_len_per_gpu=data.meta_info.get("max_token_len"))
        else:
            size = data.meta_info.get("micro_batch_size", self.config.forward_micro_batch_size_per_gpu)
            tu.assign_non_tensor(batch, micro_batch_size_per_gpu=size)
        with self.engine.eval_mode():
            values = self.engine.infer_batch(batch)["model_output"]["values"]
        return values * response_mask_of(batch).to(values.device)

    def update_critic(self, data: DataProto) -> dict[str, list[float] | float]:
        """Run `ppo_epochs` passes of mini-batch value updates with verl's clipped value loss.

        `data.batch`: `input_ids`, `attention_mask`, `position_ids`, `responses`, `response_mask`, `values`
        (old predictions) and `returns` (targets), the last three (bs, response_len).
        Each mini-batch is one `engine.train_batch` with `value_loss`, aggregated with the mini-batch's global sample
        and token counts and scaled by `dp_size` (as in the actor), so the gradient is that of the loss over the
        whole global mini-batch.
        Metrics: `critic/vf_loss` (one per mini-batch: this rank's share times `dp_size`, whose mean over ranks is
        the global mini-batch loss), `critic/vf_clipfrac`, `critic/vpred_mean` (per micro-batch),
        `critic/grad_norm` (per mini-batch), `critic/nonfinite_steps` (steps skipped for a non-finite norm).
        """
        config = self.config
        mini_batch_size = positive_int(config, "ppo_mini_batch_size")
        if not config.use_dynamic_bsz:
            positive_int(config, "ppo_micro_batch_size_per_gpu")
        keys = ["input_ids", "attention_mask", "position_ids", "responses", "response_mask", "values", "returns"]
        missing = [key for key in keys if key not in data.batch.keys()]
        if missing:
            raise KeyError(f"update_critic needs batch keys {missing}; present: {sorted(data.batch.keys())}")
        data = mask_padding_rows(data.select(batch_keys=keys))
        generator = step_generator(config, data.meta_info)
        loss_function = functools.partial(value_loss, config)
        if config.use_dynamic_bsz:
            settings = {"use_dynamic_bsz": True, "max_token_len_per_gpu": config.ppo_max_token_len_per_gpu}
        else:
            settings = {"micro_batch_size_per_gpu": config.ppo_micro_batch_size_per_gpu}

        metrics: dict[str, list[float] | float] = {}
        nonfinite_steps = 0
        with self.engine.train_mode():
            for _ in range(config.ppo_epochs):
                for mini_batch in shuffled(data, generator).split(mini_batch_size):
                    batch = mini_batch.batch
                    tu.assign_non_tensor(batch, **settings)
                    micro = dict(self.engine.train_batch(batch, loss_function)["metrics"])
                    grad_norm = micro.pop("grad_norm")
                    vf_loss = float(sum(micro.pop("critic/vf_loss")))
                    for key, values in micro.items():
                        metrics.setdefault(key, []).extend(values)
                    append_to_dict(metrics, {"critic/vf_loss": vf_loss, "critic/grad_norm": grad_norm})
                    nonfinite_steps += int(not math.isfinite(grad_norm))
        metrics["critic/nonfinite_steps"] = float(nonfinite_steps)
        return metrics
