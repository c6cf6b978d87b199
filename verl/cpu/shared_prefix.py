"""Decode attention that reads each prompt's keys and values once for all the rows sampled from it.

Owns `SharedPrefixCache` (the distinct prompts' prefill once, plus a per-row buffer for response tokens), the
attention function registered with HF's `AttentionInterface` as `ATTENTION_NAME` (one softmax over prompt and
response parts: sdpa's result up to ~1e-7) and `decode_attention`, which switches a model to it for decode steps.
Applies to full-attention decoders under `sdpa` (`applies_to`); float32 uses `decode_kernel` where built.
Layer 2: torch, transformers, verl.utils.torch_functional and verl.cpu.decode_kernel.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, Cache
from transformers.cache_utils import DynamicLayer

from verl.cpu import decode_kernel
from verl.utils.torch_functional import attention_implementation, plain_sdpa_attention, write_in_place

ATTENTION_NAME = "verl_shared_prefix"


def applies_to(config: Any) -> bool:
    """Whether a model with this config decodes through the shared-prefix attention: `plain_sdpa_attention`."""
    return plain_sdpa_attention(config)


class _SharedPrefixLayer(DynamicLayer):
    """One layer's cache: the distinct prompts' keys/values (G, kv_heads, P, head_dim) as the prefill computed
    them, and a per-row buffer of `capacity` positions for the response tokens, written in place.

    Where the fused kernel decodes (`fused`: float32 on the CPU, `decode_kernel`), the prompts' keys and the response
    key buffer are held in the kernel's tiled layout (`prefix_key_tiles`, `key_buffer` (rows, kv_heads, tiles,
    head_dim, TILE)) and `update` returns no keys (the kernel reads the buffers)."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0  # response positions written
        self.prefix_keys: torch.Tensor | None = None
        self.fused = False

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:  # the prefill of the distinct prompts
            self.dtype, self.device = key_states.dtype, key_states.device
            self.prefix_keys, self.prefix_values = key_states, value_states
            self.keys, self.values = key_states, value_states
            self.is_initialized = True
            return key_states, value_states
        if not self.fused:
            return write_in_place(self, key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache of {self.capacity} positions is full (needs {end})")
        for offset in range(key_states.shape[-2]):
            decode_kernel.write_tiled(self.key_buffer, self.length + offset, key_states[:, :, offset : offset + 1])
        self.value_buffer[:, :, self.length : end] = value_states
        self.length = end
        return None, self.value_buffer[:, :, :end]

    def start_decode(self, rows: int) -> None:
        _, heads, _, dim = self.prefix_keys.shape
        self.fused = decode_kernel.applies(dim, self.dtype, self.device)
        # laid out once as the decode reads them (the prefill's copies are freed): tiles of keys for the fused
        # kernel, keys transposed for torch's matmuls (else every step copies them)
        if self.fused:
            self.prefix_key_tiles = decode_kernel.tile_keys(self.prefix_keys)
            capacity = decode_kernel.tiled_capacity(self.capacity)
            self.key_buffer = self.prefix_keys.new_empty(rows, heads, capacity // decode_kernel.TILE, dim,
                                                         decode_kernel.TILE)  # fmt: skip
        else:
            self.prefix_keys_t = self.prefix_keys.transpose(-1, -2).contiguous()
            self.prefix_keys = self.keys = self.prefix_keys_t.transpose(-1, -2)
            capacity = self.capacity
            self.key_buffer = self.prefix_keys.new_empty(rows, heads, capacity, dim)
        self.value_buffer = self.prefix_values.new_empty(rows, heads, capacity, dim)
        self.prefix_values = self.values = self.prefix_values.contiguous()
        if self.fused:
            self.prefix_keys = self.keys = None  # the tiles hold them
            self.values = self.prefix_values

    def get_seq_length(self) -> int:
        return self.prefix_values.shape[-2] + self.length if self.is_initialized else 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.key_buffer, self.value_buffer = self.key_buffer[indices], self.value_buffer[indices]


class SharedPrefixCache(Cache):
    """The KV cache of one micro-batch's generation: prefill the distinct prompts into it, then `start_decode`
    with each row's prompt index; rows leave it by `batch_select_indices` (rows that finished)."""

    def __init__(self, num_layers: int, capacity: int):
        super().__init__(layers=[_SharedPrefixLayer(capacity) for _ in range(num_layers)])

    def start_decode(self, groups: torch.Tensor, prompt_mask: torch.Tensor) -> None:
        """groups: (rows,) index of each row's prompt among the prefilled ones. prompt_mask: (distinct prompts, P)
        the prefill's attention mask (0 on left padding)."""
        counts = torch.bincount(groups)
        self.group_size = int(counts.max())
        self.num_prompts = len(counts)
        # each row's place among its prompt's rows: the rows of the packed (prompts, group_size) query grid
        order = torch.sort(groups, stable=True).indices
        starts = torch.cumsum(counts, 0) - counts
        slots = torch.empty_like(groups)
        slots[order] = torch.arange(len(groups), device=groups.device) - starts[groups[order]]
        self._set_rows(groups * self.group_size + slots)
        for layer in self.layers:
            layer.start_decode(len(groups))
        if self.layers[0].fused:  # the fused kernel's form of the prompts' padding: a bias of whole tiles of keys
            self.prefix_bias = decode_kernel.prompt_bias(prompt_mask)
            self._check_fused_layout()
            return
        # the prompts' padding as an additive -inf bias of the packed scores, (prompts * kv_heads, 1, P): `attend`'s
        # matmul adds it (baddbmm) instead of masking the scores in a pass of its own
        kv_heads = self.layers[0].prefix_keys.shape[1]
        bias = torch.zeros(prompt_mask.shape, dtype=self.layers[0].dtype, device=prompt_mask.device)
        bias.masked_fill_(~prompt_mask.bool(), -math.inf)
        self.prefix_bias = bias.repeat_interleave(kv_heads, dim=0)[:, None, :]

    def _set_rows(self, places: torch.Tensor) -> None:
        """places: (rows,) each row's place in the (prompts * group_size) grid. When the rows fill the grid in its
        order (GRPO's n samples of each prompt, before any row finished), packing is a transpose, no scatter."""
        self.places = places
        self.groups = torch.div(places, self.group_size, rounding_mode="floor").to(torch.int64).contiguous()
        grid = self.num_prompts * self.group_size
        self.fills_grid = len(places) == grid and bool((places == torch.arange(grid, device=places.device)).all())

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._set_rows(self.places[indices])
        for layer in self.layers:
            layer.batch_select_indices(indices)
        if self.layers[0].fused:
            self._check_fused_layout()

    def _check_fused_layout(self) -> None:
        for layer in self.layers:
            decode_kernel.check_layout(layer.prefix_key_tiles, layer.prefix_values, self.prefix_bias,
                                       layer.key_buffer, layer.value_buffer)  # fmt: skip

    def _pack(self, rows: torch.Tensor) -> torch.Tensor:
        """(rows, kv_heads, q, x) -> (prompts, kv_heads, group_size * q, x): each prompt's rows as extra queries
        (zeros where the grid has no row)."""
        _, kv_heads, q, x = rows.shape
        if not self.fills_grid:  # each row to its place; places without a row stay zero
            rows = rows.new_zeros(self.num_prompts * self.group_size, kv_heads, q, x).index_copy_(0, self.places, rows)
        grid = rows.view(self.num_prompts, self.group_size, kv_heads, q, x).transpose(1, 2)
        return grid.reshape(self.num_prompts, kv_heads, self.group_size * q, x)

    def _unpack(self, packed: torch.Tensor, q: int) -> torch.Tensor:
        """The inverse of `_pack`: (prompts, kv_heads, group_size * q, x) -> (rows, kv_heads, q, x)."""
        prompts, kv_heads, _, x = packed.shape
        grid = packed.view(prompts, kv_heads, self.group_size, q, x).transpose(1, 2)
        grid = grid.reshape(prompts * self.group_size, kv_heads, q, x)
        return grid if self.fills_grid else grid.index_select(0, self.places)


def _shared_prefix_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    shared_prefix: SharedPrefixCache | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """One decode step's attention: query (rows, heads, 1, head_dim) against the row's prompt (shared) and its own
    response keys `key`/`value` (rows, kv_heads, L, head_dim). Returns (rows, 1, heads, head_dim), as HF's sdpa."""
    if shared_prefix is None or query.shape[2] != 1:
        raise RuntimeError(f"{ATTENTION_NAME} attention runs only decode steps of a SharedPrefixCache")
    out = attend(shared_prefix, shared_prefix.layers[module.layer_idx], query, key, value, scaling)
    return out.reshape(len(query), 1, query.shape[1], query.shape[-1]), None


def attend(
    cache: SharedPrefixCache,
    layer: _SharedPrefixLayer,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None = None,
) -> torch.Tensor:
    """The attention of one decode step at one layer of `cache`: query (rows, heads, 1, head_dim) against each row's
    prompt (the layer's shared copy) and its own response keys/values `key`/`value` (rows, kv_heads, L, head_dim),
    one softmax over both. Returns (rows, kv_heads, heads // kv_heads, head_dim): the heads in HF's order.

    `key`/`value` are the written part of the layer's response buffers (what its `update` returned); where the
    layer decodes through the fused kernel (`decode_kernel`, float32 on CPU) it reads the buffers themselves and
    `key` is None."""
    rows, heads, _, dim = query.shape
    kv_heads = value.shape[1]
    per_kv = heads // kv_heads  # query heads sharing one KV head (HF's repeat_kv order)
    q = query.reshape(rows, kv_heads, per_kv, dim) * (dim**-0.5 if scaling is None else scaling)
    if layer.fused:
        return decode_kernel.shared_prefix_attention(
            q, layer.prefix_key_tiles, layer.prefix_values, cache.prefix_bias, cache.groups,
            layer.key_buffer, layer.value_buffer, layer.length,
        )  # fmt: skip
    prompt_len = layer.prefix_keys.shape[2]
    packed = cache._pack(q)  # (prompts, kv_heads, group_size * per_kv, dim)
    # the padding masked once per prompt, before its scores are copied to its rows
    prefix_scores = torch.baddbmm(cache.prefix_bias, packed.flatten(0, 1), layer.prefix_keys_t.flatten(0, 1))
    prefix_scores = prefix_scores.view(*packed.shape[:3], prompt_len)
    scores = torch.cat([cache._unpack(prefix_scores, per_kv), torch.matmul(q, key.transpose(-1, -2))], dim=-1)
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    out = cache._unpack(torch.matmul(cache._pack(probs[..., :prompt_len]), layer.prefix_values), per_kv)
    return out + torch.matmul(probs[..., prompt_len:], value)


def decode_step(
    cache: SharedPrefixCache,
    layer: _SharedPrefixLayer,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """One decode step of a fused layer (`layer.fused`) from its projections, in one kernel call
    (`decode_kernel.shared_prefix_decode`): the rotary embedding of query (rows, heads * head_dim) and key (rows,
    kv_heads * head_dim) at `positions` (rows of the `cos`/`sin` tables), the step's key and value written into the
    layer's buffers, and the attention over the prompt and the response so far. Returns (rows, heads * head_dim).
    What `update` and `attend` do for one step, without the rotated, written and scaled copies between them."""
    if layer.length >= layer.capacity:
        raise RuntimeError(f"KV cache of {layer.capacity} positions is full (needs {layer.length + 1})")
    out = decode_kernel.shared_prefix_decode(
        query, key, value, cos, sin, positions, scaling, layer.prefix_key_tiles, layer.prefix_values,
        cache.prefix_bias, cache.groups, layer.key_buffer, layer.value_buffer, layer.length,
    )  # fmt: skip
    layer.length += 1
    return out


AttentionInterface.register(ATTENTION_NAME, _shared_prefix_attention)


def decode_attention(module: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Within the block, `module` attends through the shared-prefix attention (its forward must be called with
    `shared_prefix=<SharedPrefixCache>`); its own implementation is back afterwards, also on an error."""
    return attention_implementation(module, ATTENTION_NAME)
