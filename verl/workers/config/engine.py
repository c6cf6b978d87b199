"""Typed FSDP engine section (`actor.fsdp_config`, `ref.fsdp_config`, `critic.fsdp`): verl's `FSDPEngineConfig`.

Names and defaults are verl 0.9.1's. Which values this project supports, and which are refused or have no effect,
is `verl.trainer.config.key_policy`'s business, checked at start-up; this class types them and checks ranges.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from verl.base_config import BaseConfig

__all__ = ["FSDPEngineConfig"]


@dataclass
class FSDPEngineConfig(BaseConfig):
    """Sharding, offload and precision of one FSDP2-wrapped model."""

    _mutable_fields = frozenset({"strategy", "ulysses_sequence_parallel_size"})
    wrap_policy: dict[str, Any] = field(default_factory=dict)
    param_offload: bool = False
    optimizer_offload: bool = False
    offload_policy: bool = False
    reshard_after_forward: bool = True
    fsdp_size: int = -1
    forward_prefetch: bool = False
    model_dtype: str = "fp32"
    use_orig_params: bool = False
    seed: int = 42
    full_determinism: bool = False
    ulysses_sequence_parallel_size: int = 1
    entropy_from_logits_with_chunking: bool = False
    entropy_from_logits_chunk_size: int = 2048
    use_torch_compile: bool = True
    entropy_checkpointing: bool = False
    use_no_sync_for_gradient_accumulation: bool = False
    pad_to_length: bool = False
    pad_to_length_bucket: int = 1024
    forward_only: bool = False
    strategy: str = "fsdp"
    dtype: str = "bfloat16"
    mixed_precision: Optional[dict[str, Any]] = None
    qat: dict[str, Any] = field(default_factory=dict)
    turbo_config: dict[str, Any] = field(default_factory=dict)
    grad_offload: Optional[bool] = None

    def __post_init__(self):
        if self.strategy not in ("fsdp", "fsdp2"):
            raise ValueError(f"strategy={self.strategy!r}: fsdp or fsdp2 (both run FSDP2)")
        if self.fsdp_size == 0 or self.fsdp_size < -1:
            raise ValueError(f"fsdp_size={self.fsdp_size}: -1 (all ranks) or a positive group size")
