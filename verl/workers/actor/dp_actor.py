"""The data-parallel PPO actor: log-probs of responses and the policy update of one rank.

Owns `DataParallelPPOActor` (verl's API: `compute_log_prob`, `update_policy`) and the small
helpers that the critic shares with it: mini/micro-batch splitting, masking the rows a dispatch padded
(`mask_padding_rows`: never trained on), the global (all-rank) count of samples and tokens of a mini-batch,
and the clipped optimizer step that skips non-finite gradients.

The module may be a plain `nn.Module` or one wrapped by FSDP2 (`fully_shard`); gradients are assumed to be
averaged over the data-parallel ranks (what FSDP does), which is why losses are scaled by `dp_size`.
Layer 5 of DESIGN.md: no Ray here.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn

from verl.protocol import DataProto, real_row_mask
from verl.trainer.ppo import core_algos
from verl.utils.py_functional import append_to_dict
from verl.utils.seqlen_balancing import rearrange_micro_batches
from verl.workers.actor.model_forward import (
    HeadSpec,
    prompt_group_order,
    prompt_groups,
    response_outputs,
    scatter_to_responses,
)

try:  # written by another engineer; fall back to torch's own clipping when it is not there
    from verl.utils.fsdp_utils import clip_grad_norm_ as _fsdp_clip_grad_norm
except ImportError:
    _fsdp_clip_grad_norm = None

__all__ = [
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


# ---------------------------------------------------------------------------------------------- helpers
REAL_ROW_KEY = "_real_row"  # (bs,) 1.0 for a real row, 0.0 for a row the dispatch padded (see mask_padding_rows)


def mask_padding_rows(data: DataProto) -> DataProto:
    """Make the rows a DP_COMPUTE_PROTO dispatch padded (`verl.protocol.real_row_mask`) train on nothing: their
    `response_mask` becomes 0 (no loss, no token count) and `REAL_ROW_KEY` (0.0) keeps them out of the sample
    count. The rows stay (every rank runs as many micro-batches, so FSDP's collectives pair up). In place."""
    real = real_row_mask(data)
    mask = data.batch["response_mask"]
    if not bool(real.all()):
        data.batch["response_mask"] = mask * real.to(device=mask.device, dtype=mask.dtype).unsqueeze(-1)
    data.batch[REAL_ROW_KEY] = real.to(device=mask.device, dtype=torch.float32)
    return data


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


def global_batch_counts(
    response_mask: torch.Tensor, device: torch.device, real_rows: torch.Tensor | None = None
) -> tuple[int, int]:
    """(samples, response tokens) of a mini-batch summed over all data-parallel ranks.

    `response_mask`: (bs, response_len) of this rank; `real_rows` (bs,): 1 for a sample, 0 for a padding row
    (`mask_padding_rows`), all rows count when None. Every rank must call this for each mini-batch. The token
    count is at least 1: a mini-batch whose samples are all masked out (the RLVR sample mask) gives a zero loss,
    not 0/0.
    """
    samples = response_mask.shape[0] if real_rows is None else int(real_rows.sum().item())
    counts = torch.tensor([samples, int(response_mask.sum().item())], dtype=torch.float64, device=device)
    if data_parallel_size() > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    return int(counts[0].item()), max(int(counts[1].item()), 1)


def micro_batch_plan(
    data: DataProto,
    micro_batch_size: int | None,
    use_dynamic_bsz: bool,
    max_token_len: int | None,
    group_prompts: bool = False,
) -> tuple[list[DataProto], torch.Tensor | None]:
    """Split `data` into micro-batches; return them and the row order they were cut from (None: unchanged).

    Fixed size: consecutive `micro_batch_size` rows. With `use_dynamic_bsz`: micro-batches of at most
    `max_token_len` real tokens (attention-mask ones; a longer sample gets one of its own), packed first-fit
    decreasing (`rearrange_micro_batches`); every data-parallel rank gets the largest count of any rank
    (a collective then: all ranks must call it together). With `group_prompts` rows of the same prompt are put next to each
    other first (and kept together by the token budget) so that `share_prompt_prefix` can run each prompt once.
    `torch.cat` of the micro-batches' rows equals `data[order]`.
    """
    order = None
    groups = None
    if group_prompts and "responses" in data.batch.keys():
        response_length = data.batch["responses"].shape[-1]
        groups = prompt_groups(data.batch["input_ids"], data.batch["attention_mask"], response_length)
    if use_dynamic_bsz:
        if max_token_len is None or int(max_token_len) <= 0:
            raise ValueError(f"use_dynamic_bsz needs a positive max token length per GPU, got {max_token_len!r}")
        lengths = data.batch["attention_mask"].sum(-1).tolist()
        units = None
        if groups is not None:
            units = [torch.nonzero(groups == g).flatten().tolist() for g in range(int(groups.max()) + 1)]
        index_lists = rearrange_micro_batches(lengths, int(max_token_len), units)
        count = _max_over_ranks(len(index_lists))  # every rank runs as many forwards (FSDP collectives pair up)
        if count > len(index_lists):
            index_lists = rearrange_micro_batches(lengths, int(max_token_len), units, min_num_micro_batches=count)
        order = torch.tensor([i for idx in index_lists for i in idx], dtype=torch.long)
        return [data[torch.tensor(idx, dtype=torch.long)] for idx in index_lists], order
    if micro_batch_size is None or int(micro_batch_size) <= 0:
        raise ValueError(f"micro batch size must be a positive int, got {micro_batch_size!r}")
    if groups is not None:
        response_length = data.batch["responses"].shape[-1]
        order = prompt_group_order(data.batch["input_ids"], data.batch["attention_mask"], response_length)
        if torch.equal(order, torch.arange(len(order))):
            order = None
        else:
            data = data[order]
    return data.split(int(micro_batch_size)), order


def _max_over_ranks(value: int) -> int:
    """The largest `value` over the data-parallel ranks (a collective when torch.distributed runs)."""
    if data_parallel_size() == 1:
        return value
    backend_device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    tensor = torch.tensor([value], dtype=torch.long, device=backend_device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def split_micro_batches(
    data: DataProto,
    micro_batch_size: int | None,
    use_dynamic_bsz: bool,
    max_token_len: int | None,
    group_prompts: bool = False,
) -> list[DataProto]:
    """The micro-batches of `micro_batch_plan` (for the update, where their order does not matter)."""
    return micro_batch_plan(data, micro_batch_size, use_dynamic_bsz, max_token_len, group_prompts)[0]


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


_OPTIONAL_LOSS_INPUTS = ("rollout_log_probs", "rollout_is_weights")  # batch keys a policy loss may take


def _optional_loss_inputs(policy_loss_fn: Any, batch: Any) -> dict[str, torch.Tensor | None]:
    """The keyword arguments of `_OPTIONAL_LOSS_INPUTS` that `policy_loss_fn` declares (or takes as **kwargs), from
    `batch` (None when absent), so a loss written against verl 0.9.1 (`rollout_is_weights`, no
    `rollout_log_probs`) runs unchanged. ValueError when the batch has `rollout_is_weights` and the loss cannot
    take them (they would be silently dropped)."""
    params = inspect.signature(policy_loss_fn).parameters
    any_kw = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {key: batch[key] if key in batch.keys() else None for key in _OPTIONAL_LOSS_INPUTS}
    if kwargs["rollout_is_weights"] is not None and not (any_kw or "rollout_is_weights" in params):
        name = getattr(policy_loss_fn, "__name__", policy_loss_fn)
        raise ValueError(
            f"policy loss {name} has no rollout_is_weights argument, but algorithm.rollout_correction.rollout_is "
            "produced IS weights; add `rollout_is_weights=None` to it (multiplying the token losses) or set "
            "rollout_is=null"
        )
    return {key: value for key, value in kwargs.items() if any_kw or key in params}


def require_temperature(meta_info: dict) -> float:
    """The sampling temperature from `meta_info`; logits are divided by it."""
    if "temperature" not in meta_info:
        raise KeyError("data.meta_info['temperature'] is required (the rollout's sampling temperature)")
    temperature = float(meta_info["temperature"])
    if temperature <= 0:
        raise ValueError(f"meta_info['temperature'] must be > 0 to divide the logits, got {temperature}")
    return temperature


def _restore_order(values: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """Undo a row permutation: `values` row i belongs to input row `order[i]`."""
    if order is None:
        return values
    restored = torch.empty_like(values)
    restored[order.to(values.device)] = values
    return restored


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
        self,
        micro_batch: Any,
        temperature: float,
        calculate_entropy: bool,
        entropy_grad: bool = True,
        calculate_sum_pi_squared: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Log-probs (bs, response_len) of the responses, optionally their entropies and sum_v pi_v^2 (no
        gradient), each (bs, response_len) or None, all from the temperature-scaled logits.

        The token at response position t is predicted by the logits at position -response_len-1+t. The layout
        of the forward (padded, packed, shared prompt) follows `use_remove_padding` / `share_prompt_prefix`
        (see `model_forward`); all give the same values. Positions a packed forward skips (after a response's
        end, masked everywhere) get 0. With `entropy_grad=False` the entropy is computed without autograd.
        The LM head runs in vocabulary chunks (`model_forward.HeadSpec`): no full (tokens x vocab) logits.
        """
        stats, where = response_outputs(
            self.actor_module,
            micro_batch,
            micro_batch["responses"].shape[-1],
            is_lm=True,
            use_remove_padding=bool(self.config.get("use_remove_padding", False)),
            share_prompt_prefix=bool(self.config.get("share_prompt_prefix", False)),
            head=HeadSpec(temperature, calculate_entropy, entropy_grad, calculate_sum_pi_squared),
        )
        columns = iter(stats.unbind(-1))  # log-prob, then entropy and sum pi^2 when asked for
        log_probs = scatter_to_responses(next(columns), where)
        entropy = scatter_to_responses(next(columns), where) if calculate_entropy else None
        if entropy is not None and not entropy_grad:
            entropy = entropy.detach()
        sum_pi_squared = scatter_to_responses(next(columns).detach(), where) if calculate_sum_pi_squared else None
        return log_probs, entropy, sum_pi_squared

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
        micro_batches, order = micro_batch_plan(
            data.select(batch_keys=["responses", "input_ids", "attention_mask", "position_ids"]),
            data.meta_info.get("micro_batch_size"),
            bool(data.meta_info.get("use_dynamic_bsz", False)),
            data.meta_info.get("max_token_len"),
            group_prompts=bool(self.config.get("share_prompt_prefix", False)),
        )
        device = module_device(self.actor_module)
        self.actor_module.eval()
        log_probs, entropys, sums_pi_squared = [], [], []
        with torch.no_grad():
            for micro_batch in micro_batches:
                log_prob, entropy, sum_pi_squared = self._forward_micro_batch(
                    micro_batch.batch.to(device),
                    temperature,
                    calculate_entropy,
                    calculate_sum_pi_squared=calculate_sum_pi_squared,
                )
                log_probs.append(log_prob)
                if calculate_entropy:
                    entropys.append(entropy)
                if calculate_sum_pi_squared:
                    sums_pi_squared.append(sum_pi_squared)
        log_prob = _restore_order(torch.cat(log_probs, dim=0), order)
        entropy = _restore_order(torch.cat(entropys, dim=0), order) if calculate_entropy else None
        if calculate_sum_pi_squared:
            return log_prob, entropy, _restore_order(torch.cat(sums_pi_squared, dim=0), order)
        return log_prob, entropy

    # ------------------------------------------------------------------ update
    def update_policy(self, data: DataProto) -> dict[str, list[float] | float]:
        """Run `ppo_epochs` passes of mini-batch PPO updates on `data`; return verl's actor metrics.

        `data.batch`: `input_ids`, `attention_mask`, `position_ids`, `responses`, `response_mask`,
        `old_log_probs`, `advantages` (the response-shaped ones (bs, response_len)), plus `ref_log_prob` when
        `use_kl_loss`, and `rollout_log_probs` / `rollout_is_weights` (verl's rollout-correction IS weights) when
        present. `data.meta_info["temperature"]` is required.

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
        keys += [key for key in _OPTIONAL_LOSS_INPUTS if key in data.batch.keys()]
        missing = [key for key in keys if key not in data.batch.keys()]
        if missing:
            raise KeyError(f"update_policy needs batch keys {missing}; present: {sorted(data.batch.keys())}")
        data = mask_padding_rows(data.select(batch_keys=keys))

        generator = None
        if config.get("shuffle", False):  # a new order each step (meta_info global_steps), the same after a resume
            step = int(data.meta_info.get("global_steps", 0))
            generator = torch.Generator().manual_seed(int(config.get("data_loader_seed", 1)) + 1_000_003 * step)

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

        global_batch_size, batch_num_tokens = global_batch_counts(
            mini_batch.batch["response_mask"], device, mini_batch.batch.get(REAL_ROW_KEY, None)
        )
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
            group_prompts=bool(config.get("share_prompt_prefix", False)),
        )
        # the entropy metric comes from the old-log-prob pass; without that pass (`recompute_old_log_prob`
        # false) it is measured here, without gradient when it is not part of the loss
        # (nor in verl's rollout-correction bypass mode, which reuses the rollout's log-probs too)
        bypass = config.get("policy_loss", {}).get("loss_mode", "vanilla") == "bypass_mode"
        entropy_metric = entropy_coeff != 0 or not bool(config.get("recompute_old_log_prob", True)) or bypass

        self.actor_optimizer.zero_grad()
        micro_metrics: dict[str, list] = {}
        pg_loss_sum = kl_loss_sum = entropy_sum = 0.0
        for micro_batch in micro_batches:
            batch = micro_batch.batch.to(device)
            response_mask = batch["response_mask"]
            log_prob, entropy, _ = self._forward_micro_batch(
                batch, temperature, calculate_entropy=entropy_metric, entropy_grad=entropy_coeff != 0
            )
            pg_loss, pg_metrics = policy_loss_fn(
                old_log_prob=batch["old_log_probs"],
                log_prob=log_prob,
                advantages=batch["advantages"],
                response_mask=response_mask,
                loss_agg_mode=loss_agg_mode,
                config=self.loss_config,
                **_optional_loss_inputs(policy_loss_fn, batch),
            )
            loss = pg_loss
            pg_loss_sum += pg_loss.item()
            if entropy_metric:
                entropy_loss = core_algos.agg_loss(entropy, response_mask, loss_agg_mode, **global_batch_info)
                if entropy_coeff != 0:
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
        if entropy_metric:
            mini_metrics["actor/entropy"] = entropy_sum
        if use_kl_loss:
            mini_metrics["actor/kl_loss"] = kl_loss_sum
            mini_metrics["actor/kl_coef"] = kl_loss_coef
        return micro_metrics, mini_metrics
