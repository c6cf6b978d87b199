"""The data-parallel PPO actor: log-probs of responses and the policy update of one rank.

Owns `DataParallelPPOActor` (verl's API: `compute_log_prob`, `update_policy`) and the small
helpers that the critic shares with it: mini/micro-batch splitting, the global (all-rank) count of
samples and tokens of a mini-batch, and the clipped optimizer step that skips non-finite gradients.

The module may be a plain `nn.Module` or one wrapped by FSDP2 (`fully_shard`); gradients are assumed to be
averaged over the data-parallel ranks (what FSDP does), which is why losses are scaled by `dp_size`.
Layer 5 of DESIGN.md: no Ray here.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn

from verl.protocol import DataProto
from verl.trainer.ppo import core_algos
from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

try:  # written by another engineer; fall back to torch's own clipping when it is not there
    from verl.utils.fsdp_utils import clip_grad_norm_ as _fsdp_clip_grad_norm
except ImportError:
    _fsdp_clip_grad_norm = None

__all__ = [
    "DataParallelPPOActor",
    "append_to_dict",
    "clip_grad_and_step",
    "data_parallel_size",
    "global_batch_counts",
    "module_device",
    "positive_int",
    "shuffled",
    "split_micro_batches",
]


# ---------------------------------------------------------------------------------------------- helpers
def append_to_dict(metrics: dict[str, list], new: dict[str, Any]) -> None:
    """Append each value of `new` to the list under the same key in `metrics` (verl's metric layout)."""
    for key, value in new.items():
        metrics.setdefault(key, []).append(value)


def data_parallel_size() -> int:
    """World size of the default process group, 1 when torch.distributed is not initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def module_device(module: nn.Module) -> torch.device:
    """Device of the module's (local shard of the) parameters."""
    for param in module.parameters():
        return param.device
    return torch.device("cpu")


def global_batch_counts(response_mask: torch.Tensor, device: torch.device) -> tuple[int, int]:
    """(samples, response tokens) of a mini-batch summed over all data-parallel ranks.

    `response_mask`: (bs, response_len) of this rank. Every rank must call this for each mini-batch.
    """
    counts = torch.tensor([response_mask.shape[0], int(response_mask.sum().item())], dtype=torch.float64, device=device)
    if data_parallel_size() > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    return int(counts[0].item()), int(counts[1].item())


def split_micro_batches(
    data: DataProto, micro_batch_size: int | None, use_dynamic_bsz: bool, max_token_len: int | None
) -> list[DataProto]:
    """Split `data` into consecutive micro-batches (order kept).

    With `use_dynamic_bsz` the micro-batch holds as many samples as fit in `max_token_len` padded tokens
    (at least one); inputs are not unpadded, so a sample costs its full padded length.
    """
    if use_dynamic_bsz:
        if max_token_len is None or max_token_len <= 0:
            raise ValueError(f"use_dynamic_bsz needs a positive max token length, got {max_token_len!r}")
        seq_len = data.batch["input_ids"].shape[-1]
        micro_batch_size = max(1, int(max_token_len) // seq_len)
    if micro_batch_size is None or int(micro_batch_size) <= 0:
        raise ValueError(f"micro batch size must be a positive int, got {micro_batch_size!r}")
    return data.split(int(micro_batch_size))


def clip_grad_and_step(module: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> tuple[float, bool]:
    """Clip the global grad norm to `max_norm`, then step; a non-finite norm zeroes the grads instead.

    Returns (grad norm before clipping, whether the optimizer stepped).
    """
    if _fsdp_clip_grad_norm is not None:
        grad_norm = _fsdp_clip_grad_norm(module, max_norm)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)
    if hasattr(grad_norm, "full_tensor"):  # a DTensor norm over FSDP2 shards
        grad_norm = grad_norm.full_tensor()
    grad_norm = float(grad_norm)
    if not math.isfinite(grad_norm):
        optimizer.zero_grad()
        return grad_norm, False
    optimizer.step()
    return grad_norm, True


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


# ---------------------------------------------------------------------------------------------- the actor
class DataParallelPPOActor:
    """PPO actor of one data-parallel rank.

    `config`: the `actor` config after the worker's normalisation (`ppo_mini_batch_size` and
    `ppo_micro_batch_size_per_gpu` in samples per rank). `actor_module`: a causal LM returning `.logits`
    of shape (bs, seq_len, vocab). `actor_optimizer` is needed only by `update_policy`.
    """

    def __init__(self, config: Any, actor_module: nn.Module, actor_optimizer: torch.optim.Optimizer | None = None):
        self.config = config
        self.actor_module = actor_module
        self.actor_optimizer = actor_optimizer
        loss_agg_mode = config.get("loss_agg_mode", "token-mean")
        if loss_agg_mode not in core_algos.LOSS_AGG_MODES:
            raise ValueError(f"actor.loss_agg_mode={loss_agg_mode!r}; allowed: {', '.join(core_algos.LOSS_AGG_MODES)}")
        self.loss_agg_mode = loss_agg_mode
        # the config handed to the policy loss: a private, writable copy that carries `global_batch_info`
        plain = OmegaConf.to_container(config, resolve=True) if isinstance(config, DictConfig) else dict(config)
        self.loss_config = OmegaConf.create(plain)

    # ------------------------------------------------------------------ forward
    def _forward_micro_batch(
        self, micro_batch: Any, temperature: float, calculate_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (bs, response_len) of the responses and optionally their entropies (bs, response_len).

        The token at response position t is predicted by the logits at position -response_len-1+t.
        """
        response_length = micro_batch["responses"].shape[-1]
        output = self.actor_module(
            input_ids=micro_batch["input_ids"],
            attention_mask=micro_batch["attention_mask"],
            position_ids=micro_batch["position_ids"],
            use_cache=False,
        )
        logits = output.logits[:, -response_length - 1 : -1, :].float() / temperature
        log_probs = logprobs_from_logits(logits, micro_batch["responses"])
        entropy = entropy_from_logits(logits) if calculate_entropy else None
        return log_probs, entropy

    def compute_log_prob(
        self, data: DataProto, calculate_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (bs, response_len) of `data.batch["responses"]`, and entropies or None.

        `data.batch`: `input_ids`, `attention_mask`, `position_ids`, `responses`. `data.meta_info`:
        `temperature`, `micro_batch_size` (samples per forward), optional `use_dynamic_bsz` with `max_token_len`.
        """
        temperature = require_temperature(data.meta_info)
        micro_batches = split_micro_batches(
            data.select(batch_keys=["responses", "input_ids", "attention_mask", "position_ids"]),
            data.meta_info.get("micro_batch_size"),
            bool(data.meta_info.get("use_dynamic_bsz", False)),
            data.meta_info.get("max_token_len"),
        )
        device = module_device(self.actor_module)
        self.actor_module.eval()
        log_probs, entropys = [], []
        with torch.no_grad():
            for micro_batch in micro_batches:
                log_prob, entropy = self._forward_micro_batch(
                    micro_batch.batch.to(device), temperature, calculate_entropy
                )
                log_probs.append(log_prob)
                if calculate_entropy:
                    entropys.append(entropy)
        return torch.cat(log_probs, dim=0), (torch.cat(entropys, dim=0) if calculate_entropy else None)

    # ------------------------------------------------------------------ update
    def update_policy(self, data: DataProto) -> dict[str, list[float] | float]:
        """Run `ppo_epochs` passes of mini-batch PPO updates on `data`; return verl's actor metrics.

        `data.batch`: `input_ids`, `attention_mask`, `position_ids`, `responses`, `response_mask`,
        `old_log_probs`, `advantages` (the response-shaped ones (bs, response_len)), plus `ref_log_prob` when
        `use_kl_loss` and `rollout_log_probs` when present. `data.meta_info["temperature"]` is required.

        Every loss term is aggregated with the mini-batch's global sample and token counts (summed over ranks)
        and scaled by `dp_size`, so that summing micro-batch gradients and averaging them over ranks gives
        the gradient of the loss over the whole global mini-batch, however it is split.
        Metrics: lists with one value per micro-batch for the policy loss's own metrics (`actor/pg_clipfrac`,
        `actor/ppo_kl`, ...) and one per mini-batch for `actor/grad_norm` and the losses (`actor/pg_loss`,
        `actor/kl_loss`, `actor/entropy`: this rank's share times `dp_size`, whose mean over ranks is the
        loss of the global mini-batch); `actor/nonfinite_steps` (float) counts the optimizer steps skipped
        because the grad norm was not finite.
        """
        if self.actor_optimizer is None:
            raise ValueError("update_policy needs an optimizer: construct DataParallelPPOActor with actor_optimizer")
        config = self.config
        temperature = require_temperature(data.meta_info)
        mini_batch_size = positive_int(config, "ppo_mini_batch_size")
        if not config.get("use_dynamic_bsz", False):
            positive_int(config, "ppo_micro_batch_size_per_gpu")

        keys = ["input_ids", "attention_mask", "position_ids", "responses", "response_mask"]
        keys += ["old_log_probs", "advantages"]
        if config.get("use_kl_loss", False):
            keys.append("ref_log_prob")
        if "rollout_log_probs" in data.batch.keys():
            keys.append("rollout_log_probs")
        missing = [key for key in keys if key not in data.batch.keys()]
        if missing:
            raise KeyError(f"update_policy needs batch keys {missing}; present: {sorted(data.batch.keys())}")
        data = data.select(batch_keys=keys)

        generator = None
        if config.get("shuffle", False):
            generator = torch.Generator().manual_seed(int(config.get("data_loader_seed", 1)))

        self.actor_module.train()
        metrics: dict[str, list[float] | float] = {}
        nonfinite_steps = 0
        for _ in range(int(config.get("ppo_epochs", 1))):
            for mini_batch in shuffled(data, generator).split(mini_batch_size):
                micro_metrics, mini_metrics = self._update_mini_batch(mini_batch, temperature)
                for key, values in micro_metrics.items():
                    metrics.setdefault(key, []).extend(values)
                append_to_dict(metrics, mini_metrics)
                nonfinite_steps += int(not math.isfinite(mini_metrics["actor/grad_norm"]))
        self.actor_optimizer.zero_grad()
        metrics["actor/nonfinite_steps"] = float(nonfinite_steps)
        return metrics

    def _update_mini_batch(self, mini_batch: DataProto, temperature: float) -> tuple[dict, dict]:
        """Accumulate the gradients of one mini-batch over its micro-batches, then take one optimizer step.

        Returns (lists of per-micro-batch metrics, per-mini-batch metrics).
        """
        config = self.config
        loss_agg_mode = self.loss_agg_mode
        entropy_coeff = float(config.get("entropy_coeff", 0.0))
        use_kl_loss = bool(config.get("use_kl_loss", False))
        kl_loss_coef = float(config.get("kl_loss_coef", 0.001))
        kl_loss_type = config.get("kl_loss_type", "low_var_kl")
        device = module_device(self.actor_module)

        global_batch_size, batch_num_tokens = global_batch_counts(mini_batch.batch["response_mask"], device)
        global_batch_info = {
            "dp_size": data_parallel_size(),
            "batch_num_tokens": batch_num_tokens,
            "global_batch_size": global_batch_size,
        }
        self.loss_config.global_batch_info = global_batch_info
        policy_loss_fn = core_algos.get_policy_loss_fn(config.get("policy_loss", {}).get("loss_mode", "vanilla"))
        micro_batches = split_micro_batches(
            mini_batch,
            config.get("ppo_micro_batch_size_per_gpu"),
            bool(config.get("use_dynamic_bsz", False)),
            config.get("ppo_max_token_len_per_gpu"),
        )

        self.actor_optimizer.zero_grad()
        micro_metrics: dict[str, list] = {}
        pg_loss_sum = kl_loss_sum = entropy_sum = 0.0
        for micro_batch in micro_batches:
            batch = micro_batch.batch.to(device)
            response_mask = batch["response_mask"]
            log_prob, entropy = self._forward_micro_batch(batch, temperature, calculate_entropy=entropy_coeff != 0)
            pg_loss, pg_metrics = policy_loss_fn(
                old_log_prob=batch["old_log_probs"],
                log_prob=log_prob,
                advantages=batch["advantages"],
                response_mask=response_mask,
                loss_agg_mode=loss_agg_mode,
                config=self.loss_config,
                rollout_log_probs=batch["rollout_log_probs"] if "rollout_log_probs" in batch.keys() else None,
            )
            loss = pg_loss
            pg_loss_sum += pg_loss.item()
            if entropy_coeff != 0:
                entropy_loss = core_algos.agg_loss(entropy, response_mask, loss_agg_mode, **global_batch_info)
                loss = loss - entropy_coeff * entropy_loss
                entropy_sum += entropy_loss.item()
            if use_kl_loss:
                kld = core_algos.kl_penalty(log_prob, batch["ref_log_prob"], kl_loss_type)
                kl_loss = core_algos.agg_loss(kld, response_mask, loss_agg_mode, **global_batch_info)
                loss = loss + kl_loss_coef * kl_loss
                kl_loss_sum += kl_loss.item()
            loss.backward()
            append_to_dict(micro_metrics, {key: float(value) for key, value in pg_metrics.items()})

        grad_norm, _ = clip_grad_and_step(self.actor_module, self.actor_optimizer, float(config.get("grad_clip", 1.0)))
        mini_metrics = {"actor/pg_loss": pg_loss_sum, "actor/grad_norm": grad_norm}
        if entropy_coeff != 0:
            mini_metrics["actor/entropy"] = entropy_sum
        if use_kl_loss:
            mini_metrics["actor/kl_loss"] = kl_loss_sum
            mini_metrics["actor/kl_coef"] = kl_loss_coef
        return micro_metrics, mini_metrics
