"""The LM head's per-token statistics without the full logits: `head_token_stats`.

A causal LM's output layer over a real vocabulary (151,936 ids for Qwen2.5) makes (tokens x vocab) logits, 0.6 MB
per token in float32, several times over with the softmax and its autograd graph. `head_token_stats` turns hidden
states into what the losses need per token (the label's log-prob, the entropy, sum pi^2; `HeadSpec`),
`HEAD_CHUNK_ELEMENTS` logits at a time: under autograd forward keeps only each chunk's inputs and statistics and
backward recomputes its logits, so one chunk of logits is alive at a time. A plain `nn.Linear` head goes through
`_LinearHeadStats` (one log_softmax per chunk, a hand-written backward); any other head module (LoRA-wrapped,
hooked) is called under activation checkpointing. `model_forward` swaps a model's head for this during its calls.
Layer 5 (the engine's forward): torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from verl.utils.torch_functional import calculate_sum_pi_squared_from_logits, entropy_from_logits, logprobs_from_logits

__all__ = [
    "HEAD_CHUNK_ELEMENTS",
    "HeadSpec",
    "head_token_stats",
]

# Logits (rows x vocab) the LM head makes at once in `head_token_stats`: 2**24 float32 values are 64 MiB (110 rows at
# Qwen2.5's vocabulary of 151,936; a whole micro-batch at the tiny models' 2048).
HEAD_CHUNK_ELEMENTS = 2**24


@dataclass(frozen=True)
class HeadSpec:
    """What the LM head gives per response token (`response_outputs(head=...)`), from softmax(logits / temperature):
    column 0 the log-prob of the token, then its entropy when `entropy` (with gradient when `entropy_grad` and
    autograd is on), then sum_v pi_v^2 when `sum_pi_squared` (never a gradient)."""

    temperature: float = 1.0
    entropy: bool = False
    entropy_grad: bool = True
    sum_pi_squared: bool = False


def _at_least_float32(logits: torch.Tensor) -> torch.Tensor:
    """Logits in the statistics' dtype: float32, float64 kept (a no-op for float32 logits)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _chunk_stats(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, spec: HeadSpec) -> torch.Tensor:
    """The general path (any head module: a LoRA-wrapped or hooked head too), under `checkpoint` with autograd."""
    logits = _at_least_float32(head(hidden))
    if spec.temperature != 1.0:  # x / 1.0 is x: no copy of the chunk's logits (and none in backward)
        logits = logits / spec.temperature
    columns = [logprobs_from_logits(logits, labels)]
    if spec.entropy:
        with torch.set_grad_enabled(spec.entropy_grad and torch.is_grad_enabled()):
            columns.append(entropy_from_logits(logits))
    if spec.sum_pi_squared:
        columns.append(calculate_sum_pi_squared_from_logits(logits))
    return torch.stack(columns, dim=-1)


def _linear_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float):
    """A chunk's logits / temperature in float32 or float64 (a fresh tensor the caller may overwrite)."""
    logits = _at_least_float32(F.linear(hidden, weight, bias))
    return logits.div_(temperature) if temperature != 1.0 else logits


def _linear_stats(
    logits: torch.Tensor, labels: torch.Tensor, spec: HeadSpec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`spec`'s statistics (N, C) of one chunk from its float32/float64 logits (overwritten), plus each row's
    logsumexp and entropy (None unless `spec.entropy`) for backward. One log_softmax pass; the logsumexp is read
    off at each row's largest logit (log-prob in [-log V, 0] there, so no cancellation)."""
    log_probs = torch.log_softmax(logits, dim=-1)
    top, top_index = logits.max(dim=-1, keepdim=True)
    log_z = (top - log_probs.gather(-1, top_index)).squeeze(-1)
    columns = [log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)]
    entropy = None
    if spec.entropy or spec.sum_pi_squared:
        probs = torch.exp(log_probs, out=logits)  # the logits are no longer needed
        sum_pi_squared = torch.linalg.vector_norm(probs, dim=-1).square() if spec.sum_pi_squared else None
        if spec.entropy:
            entropy = probs.mul_(log_probs).sum(dim=-1).neg_()
            columns.append(entropy)
        if sum_pi_squared is not None:
            columns.append(sum_pi_squared)
    return torch.stack(columns, dim=-1), log_z, entropy


class _LinearHeadStats(torch.autograd.Function):
    """`spec`'s statistics of one chunk through a plain linear head, with a hand-written backward: forward keeps
    the chunk's inputs, each row's logsumexp and entropy, no logits; backward recomputes the logits once and
    forms d/d logits in place. Same result as `checkpoint(_chunk_stats)` with fewer passes over the (rows x
    vocab) chunk: one log_softmax for all statistics in forward, and backward does not redo the forward's
    statistics (checkpoint's recompute ran the whole chunk, entropy included, again)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, spec: HeadSpec):
        logits = _linear_logits(hidden, weight, bias, spec.temperature)
        stats, log_z, entropy = _linear_stats(logits, labels, spec)
        ctx.spec = spec
        ctx.entropy_grad = spec.entropy and spec.entropy_grad
        ctx.save_for_backward(hidden, weight, bias, labels, log_z, entropy if ctx.entropy_grad else None)
        return stats

    @staticmethod
    def backward(ctx, grad_stats):
        hidden, weight, bias, labels, log_z, entropy = ctx.saved_tensors
        spec = ctx.spec
        log_probs = _linear_logits(hidden, weight, bias, spec.temperature).sub_(log_z.unsqueeze(-1))
        probs = torch.exp(log_probs)
        grad_log_prob = grad_stats[:, :1].to(log_probs.dtype)
        if ctx.entropy_grad:  # d entropy / d z = -p * (log p + entropy)
            grad_entropy = grad_stats[:, 1:2].to(log_probs.dtype)
            grad = log_probs.add_(entropy.unsqueeze(-1)).mul_(grad_entropy).add_(grad_log_prob).mul_(probs).neg_()
        else:  # d log p_label / d z = onehot(label) - p
            grad = probs.mul_(grad_log_prob.neg())
        grad.scatter_add_(-1, labels.unsqueeze(-1), grad_log_prob)
        if spec.temperature != 1.0:
            grad.div_(spec.temperature)
        grad = grad.to(hidden.dtype)
        grad_hidden = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad.t() @ hidden if ctx.needs_input_grad[1] else None
        grad_bias = grad.sum(dim=0) if bias is not None and ctx.needs_input_grad[2] else None
        return grad_hidden, grad_weight, grad_bias, None, None


def _plain_linear_head(head: nn.Module, hidden: torch.Tensor) -> bool:
    """Whether `_LinearHeadStats` may stand in for calling `head`: an `nn.Linear` itself (no LoRA or other wrapper,
    no FSDP unit of its own), no hooks, the hidden states in its weight's dtype and no autocast."""
    return (
        type(head) is nn.Linear
        and not (head._forward_hooks or head._forward_pre_hooks)
        and hidden.dtype == head.weight.dtype
        and not torch.is_autocast_enabled(hidden.device.type)
    )


def head_token_stats(
    hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor, spec: HeadSpec, chunk_rows: int | None = None
) -> torch.Tensor:
    """`spec`'s statistics (N, C) of labels (N,) under head(hidden) for hidden states (N, H), `chunk_rows` rows at a
    time (default: `HEAD_CHUNK_ELEMENTS` // vocab). Equal to computing them from the full (N, vocab) logits. Under
    autograd no chunk's logits are kept: backward recomputes them, so at most one chunk of logits (and its
    softmax) is alive in forward and in backward. A plain `nn.Linear` head runs `_LinearHeadStats` (one softmax
    pass per chunk, a hand-written backward); any other head module is called under activation checkpointing."""
    if chunk_rows is None:
        vocab = getattr(head, "out_features", None) or head.weight.shape[0]
        chunk_rows = max(1, HEAD_CHUNK_ELEMENTS // int(vocab))
    labels = labels.long()
    linear = _plain_linear_head(head, hidden)
    outputs = []
    for start in range(0, hidden.shape[0], chunk_rows):
        rows, chunk_labels = hidden[start : start + chunk_rows], labels[start : start + chunk_rows]
        if linear and torch.is_grad_enabled():
            outputs.append(_LinearHeadStats.apply(rows, head.weight, head.bias, chunk_labels, spec))
        elif linear:
            logits = _linear_logits(rows, head.weight, head.bias, spec.temperature)
            outputs.append(_linear_stats(logits, chunk_labels, spec)[0])
        elif torch.is_grad_enabled():
            outputs.append(checkpoint(_chunk_stats, head, rows, chunk_labels, spec, use_reentrant=False))
        else:
            outputs.append(_chunk_stats(head, rows, chunk_labels, spec))
    if not outputs:
        columns = 1 + int(spec.entropy) + int(spec.sum_pi_squared)
        return hidden.new_zeros(0, columns, dtype=torch.float32)
    return torch.cat(outputs)
