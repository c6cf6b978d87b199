"""The data-parallel PPO actor: `DataParallelPPOActor` (verl's API: `compute_log_prob`, `update_policy`).

Every forward and backward runs on a training engine (the worker's, or one made around the given module and
optimizer) with `verl.workers.utils.losses.ppo_loss`, the same path as `engine.train_batch(data, partial(ppo_loss,
config))`. Gradients are assumed averaged over dp ranks (FSDP), hence losses scaled by `dp_size`. Re-exports the
batch helpers of `verl.workers.engine.utils`. Layer 5: no Ray.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from tensordict import TensorDict
from torch import nn

from verl.protocol import DataProto
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass, plain_config
from verl.utils.py_functional import append_to_dict
from verl.workers.config import FSDPActorConfig
from verl.workers.engine.fsdp import FSDPEngineWithLMHead
from verl.workers.engine.utils import (
    REAL_ROW_KEY,
    clip_grad_and_step,
    data_parallel_size,
    global_batch_counts,
    mask_padding_rows,
    micro_batch_plan,
    module_device,
    split_micro_batches,
)
from verl.workers.utils.losses import OPTIONAL_LOSS_INPUTS, ppo_loss
from verl.workers.utils.losses import optional_loss_inputs as _optional_loss_inputs  # noqa: F401  (older import path)

__all__ = [
    "REAL_ROW_KEY",
    "DataParallelPPOActor",
    "clip_grad_and_step",
    "data_parallel_size",
    "global_batch_counts",
    "mask_padding_rows",
    "micro_batch_plan",
    "module_device",
    "positive_int",
    "shuffled",
    "split_micro_batches",
]

# the per-mini-batch losses: the loss function reports each micro-batch's share, the actor adds them up
_SUMMED_METRICS = ("actor/pg_loss", "actor/entropy", "actor/kl_loss")


def shuffled(data: DataProto, generator: torch.Generator | None) -> DataProto:
    """`data` in a random order drawn from `generator`, or unchanged when it is None."""
    if generator is None:
        return data
    return data[torch.randperm(len(data), generator=generator)]


def positive_int(config: Any, key: str) -> int:
    """`config[key]` as a positive int, or a ValueError naming the key and the value seen."""
    value = config.get(key, None)
    if value is None or int(value) <= 0 or int(value) != value:
        raise ValueError(f"{key} must be a positive int (samples per rank), got {value!r}")
    return int(value)


def require_temperature(meta_info: dict) -> float:
    """The sampling temperature from `meta_info`; logits are divided by it."""
    if "temperature" not in meta_info:
        raise KeyError("data.meta_info['temperature'] is required (the rollout's sampling temperature)")
    temperature = float(meta_info["temperature"])
    if temperature <= 0:
        raise ValueError(f"meta_info['temperature'] must be > 0 to divide the logits, got {temperature}")
    return temperature


def step_generator(config: Any, meta_info: dict) -> torch.Generator | None:
    """The per-step shuffle generator (`shuffle`): a new order each step (meta_info global_steps), the same order
    for a step after a resume; None without shuffling."""
    if not config.shuffle:
        return None
    step = int(meta_info.get("global_steps", 0))
    seed = 1 if config.data_loader_seed is None else config.data_loader_seed
    return torch.Generator().manual_seed(int(seed) + 1_000_003 * step)


# ---------------------------------------------------------------------------------------------- the actor
class DataParallelPPOActor:
    """PPO actor of one data-parallel rank.

    `config`: the `actor` (or `ref`) config, an `ActorConfig` or a mapping of its keys (missing keys take verl's
    defaults), after the worker's normalisation (`ppo_mini_batch_size` and
    `ppo_micro_batch_size_per_gpu` in samples per rank; `use_remove_padding` / `share_prompt_prefix` copied from
    the model config). `actor_module`: a causal LM returning `.logits` of shape (bs, seq_len, vocab).
    `actor_optimizer` is needed only by `update_policy`. `engine`: the training engine that owns this module and
    optimizer (the worker's); without it, one is made around them.
    """

    def __init__(
        self,
        config: Any,
        actor_module: nn.Module,
        actor_optimizer: torch.optim.Optimizer | None = None,
        engine: FSDPEngineWithLMHead | None = None,
    ):
        # typed (checks and defaults in one place); its own copy, since the loss sets `global_batch_info` on it
        self.config = config = omega_conf_to_dataclass(plain_config(config), FSDPActorConfig)
        self.actor_module = actor_module
        self.actor_optimizer = actor_optimizer
        self.loss_agg_mode = config.loss_agg_mode
        self.loss_config = config
        self.engine = FSDPEngineWithLMHead.owning(
            engine, actor_module, actor_optimizer, config, config.grad_clip, "DataParallelPPOActor"
        )

    # ------------------------------------------------------------------ forward
    def _forward_micro_batch(
        self,
        micro_batch: Any,
        temperature: float,
        calculate_entropy: bool,
        entropy_grad: bool = True,
        calculate_sum_pi_squared: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Log-probs (bs, response_len) of one micro-batch's responses, optionally their entropies and sum_v pi_v^2
        (no gradient), each (bs, response_len) or None, from the temperature-scaled logits (the engine's
        `forward_step`: the forward layout follows `use_remove_padding` / `share_prompt_prefix`, the LM head runs in
        vocabulary chunks). With `entropy_grad=False` the entropy is computed without autograd."""
        batch = TensorDict(dict(micro_batch.items()), batch_size=[micro_batch["input_ids"].shape[0]])
        tu.assign_non_tensor(
            batch,
            temperature=temperature,
            calculate_entropy=calculate_entropy,
            entropy_grad=entropy_grad,
            calculate_sum_pi_squared=calculate_sum_pi_squared,
        )
        out = self.engine.compute_model_output(batch)
        return out["log_probs"], out.get("entropy"), out.get("sum_pi_squared")

    def compute_log_prob(
        self, data: DataProto, calculate_entropy: bool = False, calculate_sum_pi_squared: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Log-probs (bs, response_len) of `data.batch["responses"]`, and entropies or None, in `data`'s row order.

        With `calculate_sum_pi_squared` a third tensor (bs, response_len) follows: per token, the sum over the
        vocabulary of softmax(logits / temperature)^2 (verl's `sum_pi_squared`, for optimal_token_baseline).

        `data.batch`: `input_ids`, `attention_mask`, `position_ids`, `responses`. `data.meta_info`:
        `temperature`, `micro_batch_size` (samples per forward), optional `use_dynamic_bsz` with `max_token_len`
        (real tokens per forward).
        """
        temperature = require_temperature(data.meta_info)
        batch = data.select(batch_keys=["responses", "input_ids", "attention_mask", "position_ids"]).batch
        settings = {
            "temperature": temperature,
            "use_dynamic_bsz": bool(data.meta_info.get("use_dynamic_bsz", False)),
            "calculate_entropy": calculate_entropy,
            "entropy_grad": False,
            "calculate_sum_pi_squared": calculate_sum_pi_squared,
        }
        if settings["use_dynamic_bsz"]:
            settings["max_token_len_per_gpu"] = data.meta_info.get("max_token_len")
        else:
            settings["micro_batch_size_per_gpu"] = data.meta_info.get("micro_batch_size")
        tu.assign_non_tensor(batch, **settings)
        with self.engine.eval_mode():
            out = self.engine.infer_batch(batch)["model_output"]
        log_prob = out["log_probs"]
        entropy = out["entropy"] if calculate_entropy else None
        if calculate_sum_pi_squared:
            return log_prob, entropy, out["sum_pi_squared"]
        return log_prob, entropy

    # ------------------------------------------------------------------ update
    def update_policy(self, data: DataProto) -> dict[str, list[float] | float]:
        """Run `ppo_epochs` passes of mini-batch PPO updates on `data`; return verl's actor metrics.

        `data.batch` needs `input_ids`, `attention_mask`, `position_ids`, `responses`, `response_mask`,
        `old_log_probs`, `advantages`, plus `ref_log_prob` with `use_kl_loss`; `rollout_log_probs` /
        `rollout_is_weights` are used when present; `meta_info["temperature"]` is required. Each mini-batch is one
        `engine.train_batch` with `ppo_loss`, aggregated with global counts, so the gradient is that of the loss
        over the global mini-batch however it is split. Metrics: per micro-batch lists for the policy loss's own
        metrics, per mini-batch for `actor/grad_norm` and the losses (this rank's share times `dp_size`), and
        `actor/nonfinite_steps` (skipped optimizer steps).
        """
        if self.actor_optimizer is None:
            raise ValueError("update_policy needs an optimizer: construct DataParallelPPOActor with actor_optimizer")
        config = self.config
        temperature = require_temperature(data.meta_info)
        mini_batch_size = positive_int(config, "ppo_mini_batch_size")
        if not config.use_dynamic_bsz:
            positive_int(config, "ppo_micro_batch_size_per_gpu")

        keys = ["input_ids", "attention_mask", "position_ids", "responses", "response_mask"]
        keys += ["old_log_probs", "advantages"]
        if config.use_kl_loss:
            keys.append("ref_log_prob")
        keys += [key for key in OPTIONAL_LOSS_INPUTS if key in data.batch.keys()]
        missing = [key for key in keys if key not in data.batch.keys()]
        if missing:
            raise KeyError(f"update_policy needs batch keys {missing}; present: {sorted(data.batch.keys())}")
        data = mask_padding_rows(data.select(batch_keys=keys))
        generator = step_generator(config, data.meta_info)
        loss_function = functools.partial(ppo_loss, self.loss_config)
        settings = self._update_settings(temperature)

        metrics: dict[str, list[float] | float] = {}
        nonfinite_steps = 0
        with self.engine.train_mode():
            for _ in range(config.ppo_epochs):
                for mini_batch in shuffled(data, generator).split(mini_batch_size):
                    batch = mini_batch.batch
                    tu.assign_non_tensor(batch, **settings)
                    out = self.engine.train_batch(batch, loss_function)
                    micro = dict(out["metrics"])
                    grad_norm = micro.pop("grad_norm")
                    mini_metrics = {key: float(sum(micro.pop(key))) for key in _SUMMED_METRICS if key in micro}
                    mini_metrics["actor/grad_norm"] = grad_norm
                    if config.use_kl_loss:
                        mini_metrics["actor/kl_coef"] = float(config.kl_loss_coef)
                    for key, values in micro.items():
                        metrics.setdefault(key, []).extend(values)
                    append_to_dict(metrics, mini_metrics)
                    nonfinite_steps += int(not math.isfinite(grad_norm))
        metrics["actor/nonfinite_steps"] = float(nonfinite_steps)
        return metrics

    def _update_settings(self, temperature: float) -> dict[str, Any]:
        """The engine settings of an update: micro-batching, temperature, and the entropy: computed when it is part
        of the loss (`entropy_coeff`) or the only measure of it (no old-log-prob pass: `recompute_old_log_prob`
        false, or verl's rollout-correction bypass mode), with a gradient only when it is in the loss."""
        config = self.config
        entropy_coeff = float(config.entropy_coeff)
        bypass = config.policy_loss.loss_mode == "bypass_mode"
        settings: dict[str, Any] = {
            "temperature": temperature,
            "use_dynamic_bsz": config.use_dynamic_bsz,
            "calculate_entropy": entropy_coeff != 0 or not config.recompute_old_log_prob or bypass,
            "entropy_grad": entropy_coeff != 0,
        }
        if settings["use_dynamic_bsz"]:
            settings["max_token_len_per_gpu"] = config.ppo_max_token_len_per_gpu
        else:
            settings["micro_batch_size_per_gpu"] = config.ppo_micro_batch_size_per_gpu
        return settings
