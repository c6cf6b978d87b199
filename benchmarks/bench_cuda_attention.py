"""Attention on CUDA at the shapes RL meets: why the workers turn cuDNN's SDPA off (needs a CUDA GPU).

An RL step attends over new shapes all the time: each micro-batch's padded length, each packed sequence's length,
each prefill. This times, per SDPA backend set, 32 causal calls over 32 lengths no earlier call used (a plan or a
kernel chosen per new shape shows here), then the same 32 calls twice more (shapes now known); a padded, masked call
at three new lengths; and the packed layout's single varlen flash call (`model_forward._flash_varlen`) over the same
32 sequences. The backend sets: torch's default choice, the default with cuDNN off (what the workers run,
`verl.utils.device.set_attention_backends`), and each backend alone. Milliseconds, CUDA-synchronized.

    python benchmarks/bench_cuda_attention.py                  # bf16, 4 heads of 32 (the tiny model)
    python benchmarks/bench_cuda_attention.py --dtype float16 --head-dim 64
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKEND_SETS = {
    "default": None,
    "cuDNN off": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "cuDNN only": [SDPBackend.CUDNN_ATTENTION],
    "flash only": [SDPBackend.FLASH_ATTENTION],
    "efficient only": [SDPBackend.EFFICIENT_ATTENTION],
}


def backends(choice: list[SDPBackend] | None):
    return contextlib.nullcontext() if choice is None else sdpa_kernel(choice)


def timed_ms(fn, *args) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def bounds_of(lengths: list[int]) -> list[int]:
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return bounds


def packed_inputs(lengths, heads, kv_heads, head_dim, dtype, grad):
    total = sum(lengths)
    make = lambda h: torch.randn(1, h, total, head_dim, device="cuda", dtype=dtype, requires_grad=grad)  # noqa: E731
    return make(heads), make(kv_heads), make(kv_heads)


def causal_per_sequence(q, k, v, bounds, choice, grad) -> None:
    with backends(choice):
        outs = [
            F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True)
            for s, e in zip(bounds[:-1], bounds[1:])
        ]
    if grad:
        torch.cat(outs, dim=2).float().square().sum().backward()


def masked(q, mask, choice) -> None:
    with backends(choice):
        F.scaled_dot_product_attention(q, q, q, attn_mask=mask)


def varlen_forward_backward(q, k, v, bounds, max_len) -> None:
    from verl.workers.engine.model_forward import _flash_varlen

    _flash_varlen(q, k, v, bounds, max_len, None).float().square().sum().backward()


def per_sequence_calls(args, grad: bool, first_length: int) -> None:
    """32 causal calls, one per sequence, per backend set; each set gets lengths no earlier set used."""
    for name, choice in BACKEND_SETS.items():
        lengths = list(range(first_length, first_length + 32))
        first_length += 40
        bounds = bounds_of(lengths)
        q, k, v = packed_inputs(lengths, args.heads, args.heads, args.head_dim, args.dtype, grad)

        try:
            call = (causal_per_sequence, q, k, v, bounds, choice, grad)
            new, known = timed_ms(*call), min(timed_ms(*call), timed_ms(*call))
            print(f"  {name:15s} new shapes {new:9.1f} ms   known shapes {known:7.1f} ms")
        except RuntimeError as error:
            print(f"  {name:15s} not available: {str(error).splitlines()[0][:100]}")


def padded_calls(args) -> None:
    for name in ("default", "cuDNN off"):
        for length in (150, 151, 152) if name == "default" else (160, 161, 162):
            q = torch.randn(8, args.heads, length, args.head_dim, device="cuda", dtype=args.dtype)
            mask = torch.ones(8, 1, length, length, device="cuda", dtype=torch.bool).tril()
            mask[:3, :, :, :10] = False  # left padding of three rows

            call = (masked, q, mask, BACKEND_SETS[name])
            print(
                f"  {name:15s} length {length}: new shape {timed_ms(*call):7.1f} ms   known {timed_ms(*call):6.2f} ms"
            )


def varlen_call(args) -> None:
    from verl.workers.engine.model_forward import _flash_varlen_applies

    for first_length in (300, 100):
        lengths = list(range(first_length, first_length + 32))
        q, k, v = packed_inputs(lengths, args.heads, args.kv_heads, args.head_dim, args.dtype, True)
        if not _flash_varlen_applies(q, 0.0):
            print(
                "  the varlen flash call does not apply here (needs compute capability 8+, half precision, torch 2.10+)"
            )
            return
        bounds = torch.tensor(bounds_of(lengths), device="cuda", dtype=torch.int32)
        call = (varlen_forward_backward, q, k, v, bounds, max(lengths))
        new, known = timed_ms(*call), min(timed_ms(*call), timed_ms(*call))
        print(f"  lengths {first_length}-{first_length + 31}: new {new:6.1f} ms   known {known:6.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2, help="for the varlen call (grouped-query attention)")
    parser.add_argument("--head-dim", type=int, default=32)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_cuda_attention.py needs a CUDA GPU; torch sees none")
    args.dtype = getattr(torch, args.dtype)
    cudnn = torch.backends.cudnn.version()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, cuDNN {cudnn}, {args.dtype},"
          f" {args.heads} heads of {args.head_dim}")  # fmt: skip
    warm = torch.randn(1, 1, 7, args.head_dim, device="cuda", dtype=args.dtype)  # CUDA context and libraries
    F.scaled_dot_product_attention(warm, warm, warm, is_causal=True)
    torch.cuda.synchronize()
    print("32 causal calls, one per sequence, forward:")
    per_sequence_calls(args, grad=False, first_length=20)
    print("the same, forward + backward:")
    per_sequence_calls(args, grad=True, first_length=300)
    print("one padded, masked call (8 rows):")
    padded_calls(args)
    print(f"the packed layout's varlen flash call ({args.kv_heads} kv heads), forward + backward of 32 sequences:")
    varlen_call(args)


if __name__ == "__main__":
    main()
