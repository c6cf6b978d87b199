"""The data-parallel PPO critic: value predictions of responses and the value-function update of one rank.

Owns `DataParallelPPOCritic` (verl's API: `compute_values`, `update_critic`). Mini/micro-batch splitting, the
global counts and the clipped optimizer step are shared with the actor (`verl.workers.actor.dp_actor`).
The module may be plain or FSDP2-wrapped; gradients are assumed averaged over data-parallel ranks.
Layer 5 of DESIGN.md: no Ray here.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from verl.protocol import DataProto
from verl.trainer.ppo import core_algos
from verl.utils.py_functional import append_to_dict
from verl.utils.torch_functional import masked_mean
from verl.workers.actor.dp_actor import (
    REAL_ROW_KEY,
    clip_grad_and_step,
    data_parallel_size,
    global_batch_counts,
    mask_padding_rows,
    micro_batch_plan,
    module_device,
    positive_int,
    shuffled,
    split_micro_batches,
)
from verl.workers.actor.model_forward import response_outputs, scatter_to_responses

__all__ = ["DataParallelPPOCritic"]


def response_mask_of(batch: Any) -> torch.Tensor:
    """`response_mask` (bs, response_len), or the response part of `attention_mask` when it is absent."""
    if "response_mask" in batch.keys():
        return batch["response_mask"]
    return batch["attention_mask"][:, -batch["responses"].shape[-1] :]


class DataParallelPPOCritic:
    """Value model of one data-parallel rank.

    `config`: the `critic` config after the worker's normalisation (`ppo_mini_batch_size`,
    `ppo_micro_batch_size_per_gpu` in samples per rank). `critic_module`: e.g. an
    `AutoModelForTokenClassification` with `num_labels=1`, or any module whose output has `.logits` of
    shape (bs, seq_len, 1).
    """

    def __init__(self, config: Any, critic_module: nn.Module, critic_optimizer: torch.optim.Optimizer):
        self.config = config
        self.critic_module = critic_module
        self.critic_optimizer = critic_optimizer
        loss_agg_mode = config.get("loss_agg_mode", "token-mean")
        if loss_agg_mode not in core_algos.LOSS_AGG_MODES:
            raise ValueError(f"critic.loss_agg_mode={loss_agg_mode!r}; allowed: {', '.join(core_algos.LOSS_AGG_MODES)}")
        self.loss_agg_mode = loss_agg_mode

    def _forward_micro_batch(self, micro_batch: Any) -> torch.Tensor:
        """Value predictions (bs, response_len): the value of response token t is read at the position that
        predicts it (-response_len-1+t), as in verl. The forward's layout follows `model.use_remove_padding` /
        `model.share_prompt_prefix` (see `verl.workers.actor.model_forward`); positions a packed forward skips
        (after a response's end) get 0."""
        response_length = micro_batch["responses"].shape[-1]
        model_cfg = self.config.get("model", None) or {}
        values, where = response_outputs(
            self.critic_module,
            micro_batch,
            response_length,
            is_lm=False,
            use_remove_padding=bool(model_cfg.get("use_remove_padding", False)),
            share_prompt_prefix=bool(model_cfg.get("share_prompt_prefix", False)),
        )
        if values.dim() != 2 or values.shape[-1] != 1:
            raise ValueError(f"critic output .logits must have shape (bs, seq_len, 1), got last dim {values.shape[-1]}")
        return scatter_to_responses(values[:, 0].float(), where)

    def compute_values(self, data: DataProto) -> torch.Tensor:
        """Values (bs, response_len) of the responses, zero outside the response mask.

        `data.batch`: `input_ids`, `attention_mask`, `position_ids`, `responses` (and `response_mask`).
        `data.meta_info`: `micro_batch_size` (default `forward_micro_batch_size_per_gpu`), optional
        `use_dynamic_bsz` with `max_token_len`.
        """
        micro_batch_size = data.meta_info.get("micro_batch_size", self.config.get("forward_micro_batch_size_per_gpu"))
        micro_batches, order = micro_batch_plan(
            data,
            micro_batch_size,
            bool(data.meta_info.get("use_dynamic_bsz", False)),
            data.meta_info.get("max_token_len"),
            group_prompts=self._share_prompt_prefix(),
        )
        device = module_device(self.critic_module)
        self.critic_module.eval()
        values = []
        with torch.no_grad():
            for micro_batch in micro_batches:
                batch = micro_batch.batch.to(device)
                values.append(self._forward_micro_batch(batch) * response_mask_of(batch))
        values = torch.cat(values, dim=0)
        if order is None:
            return values
        restored = torch.empty_like(values)
        restored[order.to(values.device)] = values
        return restored

    def _share_prompt_prefix(self) -> bool:
        return bool((self.config.get("model", None) or {}).get("share_prompt_prefix", False))

    def update_critic(self, data: DataProto) -> dict[str, list[float] | float]:
        """Run `ppo_epochs` passes of mini-batch value updates with verl's clipped value loss.

        `data.batch`: `input_ids`, `attention_mask`, `position_ids`, `responses`, `response_mask`, `values`
        (old predictions) and `returns` (targets), the last three (bs, response_len).
        The loss is aggregated with the mini-batch's global sample and token counts and scaled by `dp_size`
        (as in the actor), so the gradient is that of the loss over the whole global mini-batch.
        Metrics: `critic/vf_loss` (one per mini-batch: this rank's share times `dp_size`, whose mean over ranks is
        the global mini-batch loss), `critic/vf_clipfrac`, `critic/vpred_mean` (per micro-batch),
        `critic/grad_norm` (per mini-batch), `critic/nonfinite_steps` (steps skipped for a non-finite norm).
        """
        config = self.config
        mini_batch_size = positive_int(config, "ppo_mini_batch_size")
        if not config.get("use_dynamic_bsz", False):
            positive_int(config, "ppo_micro_batch_size_per_gpu")
        keys = ["input_ids", "attention_mask", "position_ids", "responses", "response_mask", "values", "returns"]
        missing = [key for key in keys if key not in data.batch.keys()]
        if missing:
            raise KeyError(f"update_critic needs batch keys {missing}; present: {sorted(data.batch.keys())}")
        data = mask_padding_rows(data.select(batch_keys=keys))
        generator = None
        if config.get("shuffle", False):  # a new order each step (meta_info global_steps), the same after a resume
            step = int(data.meta_info.get("global_steps", 0))
            generator = torch.Generator().manual_seed(int(config.get("data_loader_seed", 1)) + 1_000_003 * step)

        self.critic_module.train()
        metrics: dict[str, list[float] | float] = {}
        nonfinite_steps = 0
        for _ in range(int(config.get("ppo_epochs", 1))):
            for mini_batch in shuffled(data, generator).split(mini_batch_size):
                micro_metrics, mini_metrics = self._update_mini_batch(mini_batch)
                for key, values in micro_metrics.items():
                    metrics.setdefault(key, []).extend(values)
                append_to_dict(metrics, mini_metrics)
                nonfinite_steps += int(not math.isfinite(mini_metrics["critic/grad_norm"]))
        self.critic_optimizer.zero_grad()
        metrics["critic/nonfinite_steps"] = float(nonfinite_steps)
        return metrics

    def _update_mini_batch(self, mini_batch: DataProto) -> tuple[dict[str, list], dict[str, float]]:
        """Accumulate the value-loss gradients of one mini-batch, then step.

        Returns (lists of per-micro-batch metrics, per-mini-batch metrics).
        """
        config = self.config
        device = module_device(self.critic_module)
        dp_size = data_parallel_size()
        global_batch_size, batch_num_tokens = global_batch_counts(
            mini_batch.batch["response_mask"], device, mini_batch.batch.get(REAL_ROW_KEY, None)
        )
        micro_batches = split_micro_batches(
            mini_batch,
            config.get("ppo_micro_batch_size_per_gpu"),
            bool(config.get("use_dynamic_bsz", False)),
            config.get("ppo_max_token_len_per_gpu"),
            group_prompts=self._share_prompt_prefix(),
        )
        self.critic_optimizer.zero_grad()
        metrics: dict[str, list] = {}
        vf_loss_sum = 0.0
        for micro_batch in micro_batches:
            batch = micro_batch.batch.to(device)
            response_mask = batch["response_mask"]
            vpreds = self._forward_micro_batch(batch)
            vf_loss, vf_clipfrac = core_algos.compute_value_loss(
                vpreds,
                batch["returns"],
                batch["values"],
                response_mask,
                float(config.get("cliprange_value", 0.5)),
                loss_agg_mode=self.loss_agg_mode,
                dp_size=dp_size,
                batch_num_tokens=batch_num_tokens,
                global_batch_size=global_batch_size,
            )
            vf_loss.backward()
            vf_loss_sum += vf_loss.item()
            append_to_dict(
                metrics,
                {
                    "critic/vf_clipfrac": float(vf_clipfrac),
                    "critic/vpred_mean": masked_mean(vpreds, response_mask).item(),
                },
            )
        grad_norm, _ = clip_grad_and_step(
            self.critic_module, self.critic_optimizer, float(config.get("grad_clip", 1.0))
        )
        return metrics, {"critic/vf_loss": vf_loss_sum, "critic/grad_norm": grad_norm}
