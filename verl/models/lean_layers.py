"""Memory-lean RMSNorm and SwiGLU MLP for training (`model.lean_activations`, our extension): HF's forward, with a
backward that keeps only the layer's inputs (and gate/up outputs, 1/rms) and recomputes the element-wise rest, as
Liger's kernels do on GPU (figures: benchmarks/README.md).

`apply_lean_layers(model)` switches the matching modules of a qwen2, qwen3 or llama model (and their rotary, see
`lean_rotary.py`) and returns how many it switched. The lean path runs only while autograd records and, for the
MLP, while its projections are plain bias-free `nn.Linear` with SiLU.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from verl.models.lean_rotary import use_lean_rotary

__all__ = ["LeanRMSNorm", "LeanSwiGLU", "apply_lean_layers", "LEAN_MODEL_TYPES"]

LEAN_MODEL_TYPES = frozenset({"qwen2", "qwen3", "llama"})
_NORM_CLASSES = frozenset({"Qwen2RMSNorm", "Qwen3RMSNorm", "LlamaRMSNorm"})
_MLP_CLASSES = frozenset({"Qwen2MLP", "Qwen3MLP", "LlamaMLP"})
_SILU_CLASSES = frozenset({"SiLU", "SiLUActivation"})  # torch's and transformers' (`hidden_act: silu`)


class LeanRMSNorm(torch.autograd.Function):
    """y = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), the statistics in float32 (HF's RMSNorm).
    Saves x and 1/rms; backward: dx = r * (dn - n * mean(dn * n)) with n = x * r, dn = dy * weight, in float32.
    The row statistic comes from the product the weight's gradient sums anyway: mean(dn * n) = (dy * n) @ weight /
    hidden, so backward makes six passes over the activations where the formula as written makes nine."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        normed, dyf = x.float() * rstd, dy.float()
        dy_normed = dyf * normed
        dweight = None
        if ctx.needs_input_grad[1]:
            dweight = dy_normed.reshape(-1, dy.shape[-1]).sum(0).to(weight.dtype)
        dx = None
        if ctx.needs_input_grad[0]:
            wf = weight.float()
            neg_coeff = (dy_normed @ wf).unsqueeze(-1).mul_(rstd / -dy.shape[-1])  # -r * mean(dn * n), per row
            dx = torch.addcmul(normed.mul_(neg_coeff), dyf * wf, rstd).to(x.dtype)
        return dx, dweight, None


class LeanSwiGLU(torch.autograd.Function):
    """y = (silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T. Saves x, gate and up; backward recomputes
    silu(gate) * up for the down projection's weight gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, w_gate), F.linear(x, w_up)
        ctx.save_for_backward(x, w_gate, w_up, w_down, gate, up)
        return F.linear(F.silu(gate) * up, w_down)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w_gate, w_up, w_down, gate, up = ctx.saved_tensors
        need_x, need_gate, need_up, need_down = ctx.needs_input_grad
        silu_gate = F.silu(gate)
        dw_down = None
        if need_down:
            hidden = (silu_gate * up).reshape(-1, up.shape[-1])
            dw_down = dy.reshape(-1, dy.shape[-1]).t().mm(hidden).to(w_down.dtype)
            del hidden
        dh = dy.matmul(w_down)  # (..., intermediate)
        # in place where a buffer is not needed again (no new (tokens x intermediate) tensor to fill), and dx
        # accumulated by the second matmul: one MLP backward of an update micro-batch 23.6 against 25.2 ms
        d_up = silu_gate.mul_(dh).reshape(-1, up.shape[-1])
        d_gate = torch.ops.aten.silu_backward(dh.mul_(up), gate).reshape(-1, up.shape[-1])  # d silu(g)/dg, fused
        del dh
        x2 = x.reshape(-1, x.shape[-1])
        dw_gate = d_gate.t().mm(x2).to(w_gate.dtype) if need_gate else None
        dw_up = d_up.t().mm(x2).to(w_up.dtype) if need_up else None
        dx = d_gate.mm(w_gate).addmm_(d_up, w_up).view(x.shape) if need_x else None
        return dx, dw_gate, dw_up, dw_down


def _records(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _lean_norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    if _records(hidden_states, self.weight):
        return LeanRMSNorm.apply(hidden_states, self.weight, self.variance_epsilon)
    return self._hf_forward(hidden_states)


def _plain_linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear and module.bias is None


def _lean_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if not torch.is_grad_enabled():  # the rollout's decode steps: nothing to save, so no checks either
        return self._hf_forward(x)
    gate, up, down = self.gate_proj, self.up_proj, self.down_proj
    lean = (
        _plain_linear(gate)
        and _plain_linear(up)
        and _plain_linear(down)
        and type(self.act_fn).__name__ in _SILU_CLASSES
    )
    if lean and _records(x, gate.weight, up.weight, down.weight):
        return LeanSwiGLU.apply(x, gate.weight, up.weight, down.weight)
    return self._hf_forward(x)


def apply_lean_layers(model: nn.Module) -> int:
    """Switch the RMSNorm and MLP modules of a qwen2/qwen3/llama `model` to the lean backward (idempotent);
    returns the number of modules switched. Any other model type: ValueError naming it and what is supported."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in LEAN_MODEL_TYPES:
        raise ValueError(
            f"model.lean_activations=true supports model types {sorted(LEAN_MODEL_TYPES)}, not {model_type!r}; "
            "set model.lean_activations=false"
        )
    switched = 0
    for module in model.modules():
        name = type(module).__name__
        lean_forward = (
            _lean_norm_forward if name in _NORM_CLASSES else _lean_mlp_forward if name in _MLP_CLASSES else None
        )
        if lean_forward is None or hasattr(module, "_hf_forward"):
            continue
        module._hf_forward = module.forward
        module.forward = types.MethodType(lean_forward, module)
        switched += 1
    use_lean_rotary(model)  # the attention's rotary embedding in fewer passes, same results (lean_rotary.py)
    return switched
