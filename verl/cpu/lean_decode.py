"""A decode step of a plain decoder computed straight from the model's weights, without HF's module calls.

Owns `applies_to` (Qwen2, Qwen3 and Llama causal LMs with SiLU MLPs, plain `nn.Linear` projections and a
position-only rotary embedding) and `LeanDecoder` (token ids and positions in, next-token logits out, keys and
values written into the rollout's KV cache). Logits equal HF's forward up to float rounding.
Layer 2: torch, verl.utils.torch_functional and verl.cpu's shared_prefix and decode_kernel.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from verl.cpu import decode_kernel, shared_prefix
from verl.utils.torch_functional import plain_sdpa_attention

_MODEL_TYPES = frozenset({"qwen2", "qwen3", "llama"})
_POSITION_ONLY_ROPE = frozenset({"default", "linear", "llama3", "yarn"})


def _decoder(model: nn.Module) -> nn.Module | None:
    """The model's decoder stack (`model.model` of a `*ForCausalLM`), or None."""
    inner = getattr(model, "model", None)
    return inner if inner is not None and hasattr(inner, "layers") and hasattr(inner, "rotary_emb") else None


def applies_to(model: nn.Module) -> bool:
    """Whether `LeanDecoder` can run `model`'s decode steps (see the module docstring)."""
    config = getattr(model, "config", None)
    inner = _decoder(model)
    if config is None or inner is None or hasattr(model, "peft_config") or not plain_sdpa_attention(config):
        return False
    if getattr(config, "model_type", None) not in _MODEL_TYPES or getattr(config, "hidden_act", None) != "silu":
        return False
    if getattr(inner.rotary_emb, "rope_type", "default") not in _POSITION_ONLY_ROPE:
        return False
    head = getattr(model, "lm_head", None)
    linears = [head] + [
        proj
        for layer in inner.layers
        for proj in (
            layer.self_attn.q_proj,
            layer.self_attn.k_proj,
            layer.self_attn.v_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_proj,
            layer.mlp.up_proj,
            layer.mlp.down_proj,
        )
    ]
    return all(type(linear) is nn.Linear for linear in linears)


def _layer(layer: nn.Module) -> list[Any]:
    """One HF decoder layer's tensors in the order `LeanDecoder.step` reads them: input norm, (weight, bias) of q, k,
    v, Qwen3's q and k norms (None elsewhere), o's (weight, bias), post-attention norm, gate's, up's, down's (weight,
    bias); biases None where the model has none. Views of the module's own parameters: nothing is copied."""
    attn, mlp = layer.self_attn, layer.mlp
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    return [
        layer.input_layernorm.weight,
        *((proj.weight, proj.bias) for proj in (attn.q_proj, attn.k_proj, attn.v_proj)),
        None if q_norm is None else q_norm.weight,
        None if k_norm is None else k_norm.weight,
        (attn.o_proj.weight, attn.o_proj.bias),
        layer.post_attention_layernorm.weight,
        *((proj.weight, proj.bias) for proj in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)),
    ]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm of Qwen2/Qwen3/Llama: normalized in float32, scaled in the input's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (rows, heads, 1, dim) at the rows' cos/sin (rows, 1, 1, dim), HF's half-rotation."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LeanDecoder:
    """The decode steps of one generation with `model` (see `applies_to`): build it with the weights the generation
    uses (inside `fsdp_utils.unsharded` for an FSDP2 module) and the number of positions the generation can reach,
    then call `step` once per new token. It holds the module's own parameters (no copy), so it must not outlive
    the block in which they are gathered."""

    def __init__(self, model: nn.Module, positions: int):
        inner = _decoder(model)
        config = model.config
        self.eps = config.rms_norm_eps
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.lm_head, self.lm_head_bias = model.lm_head.weight, model.lm_head.bias
        table = torch.arange(positions, device=self.embed.device)[None]
        # HF's own values, (1, positions, head_dim) in the weights' dtype
        cos, sin = inner.rotary_emb(self.embed[:1], table)
        self.cos, self.sin = cos[0], sin[0]
        self.layers = [_layer(layer) for layer in inner.layers]
        # the norm after each layer's MLP: the next layer's input norm, the final norm after the last
        self.next_norms = [layer[0] for layer in self.layers[1:]] + [self.norm]

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor, cache: Any, attention: torch.Tensor | None):
        """Logits (rows, vocab) of the next token after `tokens` (rows,) at `positions` (rows,).

        cache: the generation's KV cache, a `shared_prefix.SharedPrefixCache` or a per-row preallocated cache
            (`hf_rollout._kv_cache`); each layer's key and value of this step are written into it.
        attention: for the per-row cache, its (rows, length) mask including this step's column; None for the
            shared one."""
        if attention is None and getattr(cache.layers[0], "fused", False):
            return self._fused_step(tokens, positions, cache)
        rows = len(tokens)
        x = self.embed[tokens]
        cos, sin = self.cos[positions][:, None, None], self.sin[positions][:, None, None]
        mask = None
        if attention is not None:  # sdpa's boolean mask: True where a row may attend
            mask = attention.bool()[:, None, None, :]
        for index, (in_norm, q_proj, k_proj, v_proj, q_norm, k_norm, o_proj, post_norm, gate, up, down) in enumerate(
            self.layers
        ):
            h = _rms_norm(x, in_norm, self.eps)
            q = F.linear(h, *q_proj).view(rows, self.heads, 1, self.head_dim)
            k = F.linear(h, *k_proj).view(rows, self.kv_heads, 1, self.head_dim)
            v = F.linear(h, *v_proj).view(rows, self.kv_heads, 1, self.head_dim)
            if q_norm is not None:
                q, k = _rms_norm(q, q_norm, self.eps), _rms_norm(k, k_norm, self.eps)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            layer_cache = cache.layers[index]
            keys, values = layer_cache.update(k, v)
            if mask is None:
                out = shared_prefix.attend(cache, layer_cache, q, keys, values, self.scaling)
            else:
                out = F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=mask, scale=self.scaling, enable_gqa=self.kv_heads != self.heads
                )
            x = x + F.linear(out.reshape(rows, -1), *o_proj)
            h = _rms_norm(x, post_norm, self.eps)
            x = x + F.linear(F.silu(F.linear(h, *gate)) * F.linear(h, *up), *down)
        return F.linear(_rms_norm(x, self.norm, self.eps), self.lm_head, self.lm_head_bias)

    def _fused_step(self, tokens: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        """`step` against a shared-prompt cache whose layers decode through the fused kernel (float32 on the CPU,
        `decode_kernel`): per layer one kernel call for rotary embedding, cache write and attention
        (`shared_prefix.decode_step`) and one per residual add and the RMSNorm after it (`add_rms_norm`), instead
        of ~40 small torch ops. The same arithmetic up to float rounding."""
        rows = len(tokens)
        x = self.embed[tokens]  # a new tensor: the residual stream, added to in place below
        h = decode_kernel.add_rms_norm(x, None, self.layers[0][0], self.eps)
        for index, (layer, next_norm) in enumerate(zip(self.layers, self.next_norms)):
            _, q_proj, k_proj, v_proj, q_norm, k_norm, o_proj, post_norm, gate, up, down = layer
            q, k, v = F.linear(h, *q_proj), F.linear(h, *k_proj), F.linear(h, *v_proj)
            if q_norm is not None:  # Qwen3's per-head norms come before the rotary embedding
                q = _rms_norm(q.view(rows, self.heads, self.head_dim), q_norm, self.eps).view(rows, -1)
                k = _rms_norm(k.view(rows, self.kv_heads, self.head_dim), k_norm, self.eps).view(rows, -1)
            out = shared_prefix.decode_step(
                cache, cache.layers[index], q, k, v, self.cos, self.sin, positions, self.scaling
            )
            h = decode_kernel.add_rms_norm(x, F.linear(out, *o_proj), post_norm, self.eps)
            mlp = F.linear(F.silu(F.linear(h, *gate)) * F.linear(h, *up), *down)
            h = decode_kernel.add_rms_norm(x, mlp, next_norm, self.eps)
        return F.linear(h, self.lm_head, self.lm_head_bias)
