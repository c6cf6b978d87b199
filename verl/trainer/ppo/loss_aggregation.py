"""Loss aggregation shared by the policy, value, entropy and KL losses: `agg_loss` and its modes.

Owns `LOSS_AGG_MODES`, `agg_loss` (verl 0.9.1's numbers) and `cfg_get`, the one reader of
algorithm config values (dict, DictConfig or dataclass) the algorithm modules share. Re-exported by core_algos.
Layer 3 (docs/architecture.md#layers): imports torch and `verl.utils.torch_functional` only, so `policy_loss`, `advantage` and
`core_algos` can all import it without a cycle.
"""

from __future__ import annotations

from typing import Any

import torch

import verl.utils.torch_functional as verl_F

__all__ = ["LOSS_AGG_MODES", "agg_loss", "cfg_get"]

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def cfg_get(config: Any, key: str, default: Any) -> Any:
    """config[key] for a dict / DictConfig / dataclass config; `default` when config, key or value is None."""
    if config is None:
        return default
    value = config.get(key, None) if hasattr(config, "get") else getattr(config, key, None)
    return default if value is None else value


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss (bs, response_length) of one micro-batch into a scalar.

    Correct under data parallelism: each rank passes the global counts and `dp_size`; the gradient all-reduce
    mean over ranks then yields the loss of the whole global batch.
      token-mean:              masked_sum / batch_num_tokens * dp_size  (batch_num_tokens: global token count)
      token-sum:               masked_sum * dp_size
      seq-mean-token-sum:      sum over sequences with any token of their token sums / global_batch_size * dp_size
      seq-mean-token-mean:     the same with per-sequence token means (denominator + 1e-8)
      seq-mean-token-sum-norm: seq-mean-token-sum / loss_scale_factor (default: loss_mask.shape[-1], Dr.GRPO)
    Without global counts (dp_size 1) the local ones are used; an empty micro-batch gives 0, not NaN.
    """
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError(f"token-mean with dp_size={dp_size} needs batch_num_tokens (the global token count)")
            batch_num_tokens = loss_mask.sum().clamp(min=1)
        return verl_F.masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    if loss_agg_mode == "token-sum":
        return verl_F.masked_sum(loss_mat, loss_mask) * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"):
        token_counts = loss_mask.sum(dim=-1)
        seq_losses = verl_F.masked_sum(loss_mat, loss_mask, axis=-1)
        if loss_agg_mode == "seq-mean-token-mean":
            seq_losses = seq_losses / (token_counts + 1e-8)
        seq_mask = (token_counts > 0).float()
        if global_batch_size is None:
            if dp_size > 1:
                raise ValueError(f"{loss_agg_mode} with dp_size={dp_size} needs global_batch_size (global sequences)")
            global_batch_size = seq_mask.sum().clamp(min=1)
        loss = verl_F.masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_scale_factor if loss_scale_factor is not None else loss_mask.shape[-1])
        return loss
    raise ValueError(f"Invalid loss_agg_mode {loss_agg_mode!r}; choose one of {list(LOSS_AGG_MODES)}")
