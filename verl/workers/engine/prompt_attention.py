"""The attention of the shared-prompt forward (`model_forward`, `model.share_prompt_prefix`) for long responses on CPU.

Owns `PromptCache` (the prompts' keys and values as the prefill computed them, one row per distinct prompt),
`applies` (when the forward uses it) and the attention function registered with HF's `AttentionInterface` as
`ATTENTION_NAME`, which runs the response call of that forward in two parts joined by their logsumexp:

- the prompt part: the responses of one prompt's n rows are queries of one attention against that prompt's single
  copy of its keys and values (no per-row copy of the prompt, in forward or backward);
- the response part: each row's causal attention over its own response, in query blocks of `BLOCK` positions, each
  block against the keys up to its own end. torch's CPU flash kernel skips masked work only in whole blocks of 512
  keys, so one causal call at 512 response tokens computes all of its masked half; by blocks, (k + 1) / 2k of the
  square is computed (62.5% at k = 4 blocks).

Forward and backward use torch's CPU flash-attention kernels (`_scaled_dot_product_flash_attention_for_cpu` and its
backward): the backward of each part gets the joined output and logsumexp, which gives each part's exact gradient
(the same identity ring attention uses). Outputs and gradients equal sdpa's over the concatenated cache up to float
rounding (~1e-6).

Worth it only for long responses: against the prompt cache copied to every row and sdpa over it, it gains on a
micro-batch of the bench model at the longest responses and not at short ones (figures: benchmarks/README.md), so
`applies` starts at `MIN_RESPONSE_LENGTH`. That comparison was against HF's sdpa copying each KV head to its query
heads under a mask; since the copied path keeps them grouped on CPU (`model_forward._cpu_grouped_sdpa_applies`)
most of the gap is gone. It still reads each prompt once instead of once per row.
GPU runs keep HF's attention (flash-attention skips masked blocks itself).

Layer 5 (the engine's forward): torch, transformers and verl.utils.torch_functional; no Ray.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, Cache
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import AttentionMaskInterface

from verl.utils.torch_functional import plain_sdpa_attention

ATTENTION_NAME = "verl_prompt_blocks"
MIN_RESPONSE_LENGTH = 384  # response tokens from which the two-part attention is faster (module docstring)
BLOCK = 128  # response queries per block of the response part

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def applies(module: nn.Module, response_length: int, response_mask: torch.Tensor) -> bool:
    """Whether the shared-prompt forward of `module` runs its response call through this attention: on CPU, a
    plain-attention model under sdpa (`plain_sdpa_attention`) without attention dropout, responses of at least
    `MIN_RESPONSE_LENGTH` tokens, no gradient checkpointing, each row's response mask ones then zeros (right padding
    only: the response part's causal blocks do not mask keys)."""
    config = getattr(module, "config", None)
    if config is None or response_length < MIN_RESPONSE_LENGTH or response_mask.device.type != "cpu":
        return False
    if any(getattr(layer, "gradient_checkpointing", False) for layer in module.modules()):
        return False  # HF's per-layer flag: a recomputed layer would attend through sdpa, without the prompt cache
    plain = plain_sdpa_attention(config) and not getattr(config, "attention_dropout", 0.0)
    valid = response_mask.bool()
    return plain and torch.equal(valid, valid.cummin(dim=1).values)


class _PromptLayer(DynamicLayer):
    """One layer of a `PromptCache`: the first update (the prefill) keeps the prompts' keys and values; later ones
    (the response call) return their own keys and values, nothing concatenated."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.dtype, self.device = key_states.dtype, key_states.device
            self.keys, self.values = key_states, value_states
            self.is_initialized = True
        return key_states, value_states


class PromptCache(Cache):
    """The KV cache of one shared-prompt forward: prefill the distinct prompts into it (one row each), call
    `start_responses`, then run the response call on it with the model switched to `ATTENTION_NAME`
    (`torch_functional.attention_implementation`) and `prompt_attention=cache` among the model's keywords."""

    def __init__(self, num_layers: int):
        super().__init__(layers=[_PromptLayer() for _ in range(num_layers)])
        self.group_size = 0
        self.prompt_bias: torch.Tensor | None = None
        self._masks: dict[tuple, list] = {}

    def start_responses(self, group_size: int, prompt_mask: torch.Tensor) -> None:
        """group_size: rows per prompt, the rows being the prompts in order, `group_size` each. prompt_mask: the
        prefill's (prompts, P) attention mask (0 on padding)."""
        self.group_size = group_size
        pad = ~prompt_mask.bool()
        dtype = self.layers[0].keys.dtype
        bias = torch.zeros(pad.shape, dtype=dtype, device=pad.device).masked_fill_(pad, float("-inf"))
        self.prompt_bias = bias[:, None, None, :] if pad.any() else None  # (prompts, 1, 1, P)

    def block_masks(self, length: int, per_kv: int, dtype: torch.dtype, device: torch.device) -> list:
        """[(start, end, additive mask (1, 1, per_kv * (end - start), end))] of the response part's query blocks."""
        key = (length, per_kv, dtype, device)
        if key not in self._masks:
            blocks = []
            for start in range(0, length, BLOCK):
                end = min(length, start + BLOCK)
                query_pos = torch.arange(start, end, device=device).repeat(per_kv)[:, None]
                future = torch.arange(end, device=device)[None] > query_pos
                mask = torch.zeros(future.shape, dtype=dtype, device=device).masked_fill_(future, float("-inf"))
                blocks.append((start, end, mask[None, None]))
            self._masks[key] = blocks
        return self._masks[key]


def _to_groups(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(rows, kv_heads, per_kv, R, X) -> (groups, kv_heads, n * per_kv * R, X): each prompt's rows as queries."""
    rows, kv_heads, per_kv, length, last = x.shape
    n = rows // groups
    return x.view(groups, n, kv_heads, per_kv, length, last).transpose(1, 2).reshape(groups, kv_heads, -1, last)


def _to_rows(x: torch.Tensor, n: int, per_kv: int, length: int) -> torch.Tensor:
    """The inverse of `_to_groups`: (groups, kv_heads, n * per_kv * R, X) -> (rows, kv_heads, per_kv, R, X)."""
    groups, kv_heads, _, last = x.shape
    grid = x.view(groups, kv_heads, n, per_kv, length, last).transpose(1, 2)
    return grid.reshape(groups * n, kv_heads, per_kv, length, last)


class _TwoPartAttention(torch.autograd.Function):
    """query (rows, kv_heads, per_kv, R, D) against its prompt's keys/values (prompts, kv_heads, P, D) and its own
    response keys/values (rows, kv_heads, R, D), causal within the response. Returns (rows, kv_heads, per_kv, R, D)."""

    @staticmethod
    def forward(ctx, query, prompt_keys, prompt_values, keys, values, cache: PromptCache, scale: float):
        rows, kv_heads, per_kv, length, dim = query.shape
        groups, n = prompt_keys.shape[0], cache.group_size
        out_p, lse_p = _FLASH(
            _to_groups(query, groups), prompt_keys, prompt_values, attn_mask=cache.prompt_bias, scale=scale
        )
        out_p = _to_rows(out_p, n, per_kv, length)
        lse_p = _to_rows(lse_p.unsqueeze(-1), n, per_kv, length).squeeze(-1)
        out_r, lse_r = torch.empty_like(out_p), torch.empty_like(lse_p)
        blocks = cache.block_masks(length, per_kv, query.dtype, query.device)
        for start, end, mask in blocks:
            shape = (rows, kv_heads, per_kv * (end - start))
            out, lse = _FLASH(query[:, :, :, start:end].reshape(*shape, dim), keys[:, :, :end], values[:, :, :end],
                              attn_mask=mask, scale=scale)  # fmt: skip
            out_r[:, :, :, start:end] = out.view(rows, kv_heads, per_kv, end - start, dim)
            lse_r[:, :, :, start:end] = lse.view(rows, kv_heads, per_kv, end - start)
        lse = torch.logaddexp(lse_p, lse_r)
        joined = out_p.float() * (lse_p - lse).exp_().unsqueeze(-1) + out_r.float() * (lse_r - lse).exp_().unsqueeze(-1)
        joined = joined.to(query.dtype)
        if any(ctx.needs_input_grad):
            ctx.save_for_backward(query, prompt_keys, prompt_values, keys, values, joined, lse)
            ctx.cache, ctx.scale = cache, scale
        return joined

    @staticmethod
    def backward(ctx, grad):
        query, prompt_keys, prompt_values, keys, values, out, lse = ctx.saved_tensors
        rows, kv_heads, per_kv, length, dim = query.shape
        groups, cache, scale = prompt_keys.shape[0], ctx.cache, ctx.scale
        grad = grad.contiguous()
        in_groups = [_to_groups(x, groups) for x in (grad, query, out, lse.unsqueeze(-1))]
        grad_q, grad_pk, grad_pv = _FLASH_BACKWARD(*in_groups[:2], prompt_keys, prompt_values, in_groups[2],
                                                   in_groups[3].squeeze(-1), 0.0, False, attn_mask=cache.prompt_bias,
                                                   scale=scale)  # fmt: skip
        grad_q = _to_rows(grad_q, cache.group_size, per_kv, length)
        grad_k, grad_v = torch.zeros_like(keys), torch.zeros_like(values)
        for start, end, mask in cache.block_masks(length, per_kv, query.dtype, query.device):  # forward's, cached
            shape = (rows, kv_heads, per_kv * (end - start))
            part = [x[:, :, :, start:end].reshape(*shape, dim) for x in (grad, query, out)]
            gq, gk, gv = _FLASH_BACKWARD(part[0], part[1], keys[:, :, :end], values[:, :, :end], part[2],
                                         lse[:, :, :, start:end].reshape(shape), 0.0, False, attn_mask=mask,
                                         scale=scale)  # fmt: skip
            grad_q[:, :, :, start:end] += gq.view(rows, kv_heads, per_kv, end - start, dim)
            grad_k[:, :, :end] += gk
            grad_v[:, :, :end] += gv
        return grad_q, grad_pk, grad_pv, grad_k, grad_v, None, None


def _prompt_blocks_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    prompt_attention: PromptCache | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The response call's attention: query (rows, heads, R, D), key/value the response's own (rows, kv_heads, R, D);
    the prompt's from `prompt_attention`. Returns (rows, R, heads, D), as HF's sdpa."""
    if prompt_attention is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention runs only the response call of a PromptCache forward")
    layer = prompt_attention.layers[module.layer_idx]
    rows, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    grouped = query.reshape(rows, kv_heads, heads // kv_heads, length, dim)  # HF's repeat_kv order
    scale = dim**-0.5 if scaling is None else scaling
    out = _TwoPartAttention.apply(grouped, layer.keys, layer.values, key, value, prompt_attention, scale)
    return out.reshape(rows, heads, length, dim).transpose(1, 2), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The response call builds no mask: the attention above masks the prompt's padding and the future itself."""
    return None


AttentionInterface.register(ATTENTION_NAME, _prompt_blocks_attention)
AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
