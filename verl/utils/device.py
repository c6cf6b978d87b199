"""Device selection: which device ("cpu" or "cuda") a process trains on and which torch.distributed backend goes with it.

`trainer.device` in the config is one of `auto` (cuda if present, else cpu), `cpu`, `cuda`. CPU uses gloo,
CUDA uses nccl. Also the process-wide choice of attention kernels on CUDA (`set_attention_backends`). No Ray or model
code here (layer 1).
"""

from __future__ import annotations

import types

import torch

__all__ = ["get_device_name", "get_dist_backend", "get_torch_device", "set_attention_backends"]

_ALLOWED_PREFERENCES = ("auto", "cpu", "cuda")


def get_device_name(preference: str = "auto") -> str:
    """Resolve a device preference to "cpu" or "cuda".

    "auto" picks cuda when torch sees a GPU, else cpu; "cuda" without a GPU raises a RuntimeError.
    """
    if preference not in _ALLOWED_PREFERENCES:
        raise ValueError(f"device preference must be one of {list(_ALLOWED_PREFERENCES)}, got {preference!r}")
    if preference == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if preference == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "device 'cuda' was asked for but torch sees no CUDA GPU; use trainer.device=cpu or trainer.device=auto"
        )
    return preference


def get_dist_backend(device_name: str) -> str:
    """The torch.distributed backend for a device: "gloo" for cpu, "nccl" for cuda."""
    backends = {"cpu": "gloo", "cuda": "nccl"}
    if device_name not in backends:
        raise ValueError(f"device_name must be one of {list(backends)}, got {device_name!r}")
    return backends[device_name]


def get_torch_device(device_name: str | None = None) -> types.ModuleType:
    """The torch device module (`torch.cuda` or `torch.cpu`) for `device_name` (default: the auto-detected device).

    Lets code call `get_torch_device().synchronize()`, `.current_device()`, `.device_count()` the same way on both
    (CUDA-only calls such as `empty_cache` need a `hasattr` check).
    """
    name = device_name or get_device_name("auto")
    if name == "cuda":
        return torch.cuda
    if name == "cpu":
        return torch.cpu
    raise ValueError(f"device_name must be 'cpu' or 'cuda', got {name!r}")


def set_attention_backends(device_name: str) -> None:
    """On CUDA, turn cuDNN's scaled-dot-product attention off for this process; flash, memory-efficient and math
    attention stay on, and torch picks among them as before. No change on CPU.

    cuDNN builds an execution plan for every new input shape, which costs far more than the attention call itself.
    An RL step meets new shapes all the time (each micro-batch's padded length, each sequence of the packed layout,
    each prefill), so with cuDNN on, plan building was most of a bf16 step (`benchmarks/bench_cuda_attention.py`;
    figures in benchmarks/README.md). Every worker calls this when it starts torch.distributed
    (`fsdp_utils.init_distributed`)."""
    if device_name == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
