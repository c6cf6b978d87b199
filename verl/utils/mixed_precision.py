"""Mixed precision of one FSDP module: verl's `fsdp_config.mixed_precision` and `fsdp_config.dtype`.

Owns `resolve_mixed_precision(fsdp_cfg, where)` -> `MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)` and
`canonical_dtype`, read by the start-up checks and `fsdp_utils.fsdp_mixed_precision`. `mixed_precision.param_dtype`
wins over `fsdp_config.dtype`; reduce and buffer dtypes default to fp32; a null mapping computes in `dtype` (fp32:
no policy). FSDP2 never casts buffers, so `apply_fsdp2` casts floating buffers to `buffer_dtype` once.
Pure Python: must not import torch.
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
