"""Rotary position embedding in fewer passes, bit for bit HF's `apply_rotary_pos_emb`.

With x = [x1, x2]: out1 = x1 * cos1 - x2 * sin1, out2 = x2 * cos2 + x1 * sin2 (backward the transposed rotation),
the same floating-point operations as HF's in the same order. `use_lean_rotary(model)` points the modeling module
of each qwen2/qwen3/llama attention class at it (process-wide); uncovered inputs go to HF's function.
Layer 1: torch only.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["LeanRotary", "use_lean_rotary"]

_ATTENTION_CLASSES = frozenset({"Qwen2Attention", "Qwen3Attention", "LlamaAttention"})


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = t.shape[-1] // 2
    return t[..., :half], t[..., half:]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transpose: bool) -> torch.Tensor:
    """[x1 c1 - x2 s1, x2 c2 + x1 s2], or with `transpose` [x1 c1 + x2 s2, x2 c2 - x1 s1] (the backward)."""
    (x1, x2), (c1, c2), (s1, s2) = _halves(x), _halves(cos), _halves(sin)
    # forward keeps x's memory layout, as HF's products do; the gradient comes out contiguous, as autograd's sum of
    # HF's branches does (a norm before the rotation, Qwen3's, then sums its weight's gradient in the same order)
    out = torch.empty_like(x, memory_format=torch.contiguous_format if transpose else torch.preserve_format)
    o1, o2 = _halves(out)
    torch.mul(x1, c1, out=o1)
    torch.mul(x2, c2, out=o2)
    if transpose:
        o1.add_(x2 * s2)
        o2.sub_(x1 * s1)
    else:
        o1.sub_(x2 * s1)
        o2.add_(x1 * s2)
    return out


class LeanRotary(torch.autograd.Function):
    """x rotated by (cos, sin) (broadcast to x), as `x * cos + rotate_half(x) * sin`; see the module docstring."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, transpose=False)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, transpose=True), None, None


def _covered(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Inputs the lean rotation computes exactly as HF: an even head size that cos and sin share, one dtype, and
    no gradient wanted for cos or sin."""
    width = x.shape[-1]
    return (
        width % 2 == 0
        and cos.shape[-1] == width == sin.shape[-1]
        and x.dtype == cos.dtype == sin.dtype
        and not (cos.requires_grad or sin.requires_grad)
    )


def _lean_with_fallback(hf_apply: Callable) -> Callable:
    def lean_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        """HF's `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)` in fewer passes, same results."""
        if not (_covered(q, cos, sin) and _covered(k, cos, sin)):
            return hf_apply(q, k, cos, sin, unsqueeze_dim)
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
            return LeanRotary.apply(q, cos, sin), LeanRotary.apply(k, cos, sin)
        return _rotate(q, cos, sin, transpose=False), _rotate(k, cos, sin, transpose=False)

    lean_apply_rotary_pos_emb.hf_apply = hf_apply
    return lean_apply_rotary_pos_emb


def use_lean_rotary(model: nn.Module) -> int:
    """Point the rotary function of the modeling module of every qwen2/qwen3/llama attention class in `model` at
    the lean one (idempotent); returns how many modules were switched now."""
    switched = 0
    for module in model.modules():
        if type(module).__name__ not in _ATTENTION_CLASSES:
            continue
        modeling = sys.modules[type(module).__module__]
        current = getattr(modeling, "apply_rotary_pos_emb", None)
        if current is None or hasattr(current, "hf_apply"):
            continue
        modeling.apply_rotary_pos_emb = _lean_with_fallback(current)
        switched += 1
    return switched
