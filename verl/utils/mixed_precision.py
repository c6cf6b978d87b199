"""Mixed precision of one FSDP module: verl's `fsdp_config.mixed_precision` and `fsdp_config.dtype`.

Owns `resolve_mixed_precision(fsdp_cfg, where)` -> `MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)`
(canonical names float32 | bfloat16 | float16, or None = leave as the parameters/buffers are) and
`canonical_dtype`. The driver's start-up check (`verl.trainer.config.checks`) and the FSDP workers
(`verl.utils.fsdp_utils.fsdp_mixed_precision`) read the same rules. Pure Python: must not import torch.

Semantics (verl 0.9.1, `verl/workers/engine/fsdp/transformer_impl.py` `_build_fsdp_module`):
- The master weights and the optimizer state are in `fsdp_config.model_dtype` (verl: fp32); these settings
  only change what the forward/backward computes in and how gradients are reduced.
- `mixed_precision` (verl's default null) is a mapping of `param_dtype` (compute dtype: FSDP2 casts the
  gathered parameters to it), `reduce_dtype` (gradient reduce-scatter; default fp32) and `buffer_dtype` (default
  fp32). Spellings: fp32 | bf16 | fp16, float32 | bfloat16 | float16, 32 | 16 (verl's `PrecisionType`).
- Precedence: `mixed_precision.param_dtype` wins over `fsdp_config.dtype` (verl's FSDP engine reads only the
  mapping; `dtype` is its Megatron engine's key). A mapping without `param_dtype` and a null mapping compute in
  `fsdp_config.dtype` (whose default, bfloat16, equals verl's default of the mapping).
- Null mapping: a low-precision `dtype` computes in it with float32 gradient reduction; float32 sets no policy.
- `buffer_dtype`: FSDP2 (`MixedPrecisionPolicy`) has no buffer dtype, unlike FSDP1's `MixedPrecision`: buffers
  are not sharded and FSDP2 never casts them. `apply_fsdp2` casts the module's floating-point buffers (e.g. the
  rotary `inv_freq`) to it once, before sharding; with a null mapping buffers stay as loaded (verl's FSDP2 path
  ignores `buffer_dtype` altogether).
- On CPU the driver turns the implicit default `dtype: bfloat16` into float32 (`resolve_cpu_dtypes`), but a
  `mixed_precision.param_dtype` is an explicit request and is honoured: bf16 compute runs on CPU too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

KEYS = ("param_dtype", "reduce_dtype", "buffer_dtype")
_CANONICAL = {
    "fp32": "float32", "float32": "float32", "32": "float32",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "16": "float16",
}  # fmt: skip
ALLOWED = "fp32, bf16, fp16 (or float32, bfloat16, float16)"


@dataclass(frozen=True)
class MixedPrecision:
    """Canonical dtype names; None leaves that part as the module holds it (no cast)."""

    param_dtype: str | None
    reduce_dtype: str | None
    buffer_dtype: str | None


def canonical_dtype(value: Any, key: str) -> str:
    """float32 | bfloat16 | float16 for any of verl's spellings; ValueError naming `key` otherwise."""
    name = _CANONICAL.get(str(value).removeprefix("torch.")) if isinstance(value, (str, int)) else None
    if name is None:  # also True/False: str(True) is not a spelling
        raise ValueError(f"{key}={value!r} is not a supported dtype; allowed: {ALLOWED}")
    return name


def resolve_mixed_precision(fsdp_cfg: Any, where: str = "fsdp_config") -> MixedPrecision:
    """The mixed precision of the FSDP module configured by `fsdp_cfg` (a mapping or None; `where` is its config
    path, for messages). Raises ValueError (one line) for a bad value or an unknown key of the mapping."""
    fsdp_cfg = fsdp_cfg or {}
    mp = fsdp_cfg.get("mixed_precision")
    dtype = fsdp_cfg.get("dtype") or "float32"
    if mp is None:
        compute = canonical_dtype(dtype, f"{where}.dtype")
        if compute == "float32":
            return MixedPrecision(None, None, None)
        return MixedPrecision(compute, "float32", None)
    if not isinstance(mp, Mapping):
        raise ValueError(f"{where}.mixed_precision={mp!r} must be a mapping of {', '.join(KEYS)} or null")
    unknown = sorted(str(k) for k in mp if k not in KEYS)
    if unknown:
        raise ValueError(f"{where}.mixed_precision has unknown key(s) {unknown}; allowed: {', '.join(KEYS)}")
    param = mp.get("param_dtype")
    return MixedPrecision(
        param_dtype=canonical_dtype(dtype, f"{where}.dtype") if param is None else _entry(mp, "param_dtype", where),
        reduce_dtype=_entry(mp, "reduce_dtype", where),
        buffer_dtype=_entry(mp, "buffer_dtype", where),
    )


def _entry(mp: Mapping, key: str, where: str) -> str:
    """`mp[key]` in canonical form; verl's default fp32 when unset."""
    value = mp.get(key)
    return "float32" if value is None else canonical_dtype(value, f"{where}.mixed_precision.{key}")


def explicit_param_dtype(fsdp_cfg: Any) -> bool:
    """Whether `fsdp_cfg` sets `mixed_precision.param_dtype` (then `fsdp_config.dtype` is not read)."""
    mp = (fsdp_cfg or {}).get("mixed_precision")
    return isinstance(mp, Mapping) and mp.get("param_dtype") is not None
