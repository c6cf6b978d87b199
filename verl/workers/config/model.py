"""Typed model section (`actor_rollout_ref.model`, `critic.model`): verl's `HFModelConfig` and `MtpConfig`.

Names and defaults are verl 0.9.1's plus three extension keys (`attn_implementation`, `share_prompt_prefix`,
`lean_activations`). `path` may be a folder or a hub id resolved from the local Hugging Face cache
(`verl.utils.model_path`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from verl.base_config import BaseConfig

__all__ = ["HFModelConfig", "MtpConfig"]


@dataclass
class MtpConfig(BaseConfig):
    """Multi-token prediction (training and speculative rollout); not supported here, verl's default only."""

    enable: bool = False
    enable_train: bool = False
    enable_rollout: bool = False
    detach_encoder: bool = False
    mtp_loss_scaling_factor: float = 0.1
    speculative_algorithm: str = "EAGLE"
    speculative_num_steps: int = 3
    speculative_eagle_topk: int = 1
    speculative_num_draft_tokens: int = 4
    method: str = "mtp"
    num_speculative_tokens: int = 1


@dataclass
class HFModelConfig(BaseConfig):
    """Which Hugging Face model, its tokenizer and template, LoRA and the memory options of its forward."""

    path: str = "~/models/deepseek-llm-7b-chat"
    hf_config_path: Optional[str] = None
    tokenizer_path: Optional[str] = None
    use_shm: bool = False
    trust_remote_code: bool = False
    custom_chat_template: Optional[str] = None
    external_lib: Optional[str] = None
    override_config: dict[str, Any] = field(default_factory=dict)
    enable_gradient_checkpointing: bool = True
    enable_activation_offload: bool = False
    use_remove_padding: bool = True
    lora_rank: int = 0
    lora_alpha: int = 16
    target_modules: Any = "all-linear"
    exclude_modules: Optional[Any] = None
    lora_adapter_path: Optional[str] = None
    use_liger: bool = False
    use_fused_kernels: bool = False
    fused_kernel_options: dict[str, Any] = field(default_factory=dict)
    tiled_mlp: dict[str, Any] = field(default_factory=dict)
    mtp: MtpConfig = field(default_factory=MtpConfig)
    lora: dict[str, Any] = field(default_factory=dict)
    attn_implementation: str = "sdpa"  # extension
    share_prompt_prefix: bool = False  # extension
    lean_activations: bool = False  # extension
    fsdp_config: dict[str, Any] = field(default_factory=dict)  # the critic model's own (verl's legacy layout)

    def __post_init__(self):
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank={self.lora_rank}: 0 (no LoRA) or a positive rank")
        if self.attn_implementation not in ("sdpa", "eager", "flash_attention_2"):
            raise ValueError(f"attn_implementation={self.attn_implementation!r}: sdpa, eager or flash_attention_2")
