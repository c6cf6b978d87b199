"""Model FLOPs utilisation (MFU) estimates: a decoder-only transformer's training FLOPs for a batch of sequences
(6 x dense parameters per token plus 12 * sum(seq_len^2) attention terms, counted as verl does) and the device's
peak FLOP/s (a table of bf16 GPU figures; on CPU a float32 matmul measured once per process). Layer 1: torch only.
"""

from __future__ import annotations

import time
from functools import cache
from typing import Any

import torch

# dense bf16 tensor-core peak (FLOP/s) by a substring of torch.cuda.get_device_name()
GPU_PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "A10": 125e12,
    "4090": 165e12,
    "3090": 71e12,
    "V100": 125e12,
    "T4": 65e12,
}


def _attr(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def estimate_training_flops(config: Any, seqlens: list[int]) -> float:
    """FLOPs of one forward + backward pass of a decoder-only model over sequences of lengths `seqlens`.

    `config`: an HF config with hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads (optional), head_dim (optional), vocab_size.
    """
    hidden = int(_attr(config, "hidden_size", "n_embd"))
    layers = int(_attr(config, "num_hidden_layers", "n_layer"))
    heads = int(_attr(config, "num_attention_heads", "n_head"))
    kv_heads = int(_attr(config, "num_key_value_heads", default=heads))
    head_dim = int(_attr(config, "head_dim", default=hidden // heads))
    intermediate = int(_attr(config, "intermediate_size", "n_inner", default=4 * hidden))
    vocab = int(config.vocab_size)
    mlp_params = 3 * hidden * intermediate  # gate, up, down (SwiGLU)
    attn_params = hidden * (heads * head_dim + 2 * kv_heads * head_dim) + heads * head_dim * hidden
    dense_params = layers * (mlp_params + attn_params) + 2 * vocab * hidden
    tokens = sum(int(s) for s in seqlens)
    square_sum = sum(int(s) ** 2 for s in seqlens)
    return 6.0 * dense_params * tokens + 12.0 * square_sum * heads * head_dim * layers


@cache
def _measured_cpu_flops(size: int = 512, repeats: int = 8) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / max(best, 1e-9)


def device_peak_flops(device: str) -> float:
    """Peak FLOP/s of one worker's device: the GPU table (inf for an unknown GPU, so MFU reads 0), or the
    matmul throughput measured on this CPU process."""
    if device == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, flops in GPU_PEAK_FLOPS.items():
            if key in name:
                return flops
        return float("inf")
    return _measured_cpu_flops()


def compute_mfu(config: Any, seqlens: list[int], elapsed_s: float, device: str, passes: int = 1) -> float:
    """MFU of `passes` training passes over `seqlens` that took `elapsed_s` seconds on one worker."""
    if elapsed_s <= 0 or not seqlens:
        return 0.0
    achieved = estimate_training_flops(config, seqlens) * passes / elapsed_s
    return achieved / device_peak_flops(device)
