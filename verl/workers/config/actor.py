"""Typed actor and reference sections: verl's `PolicyLossConfig`, `ActorConfig` and `FSDPActorConfig`.

Names, defaults and start-up checks are verl 0.9.1's, plus this project's extension keys (marked). The reference
section (`actor_rollout_ref.ref`) is read as `FSDPActorConfig` too, with its `log_prob_*` keys and `role="ref"`,
which skips the checks only a trained actor needs. Each key's meaning is commented in `ppo_trainer.yaml`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from verl.base_config import BaseConfig
from verl.trainer.config.algorithm import CheckpointConfig, RolloutCorrectionConfig
from verl.workers.config.engine import FSDPEngineConfig
from verl.workers.config.optimizer import FSDPOptimizerConfig, OptimizerConfig

__all__ = ["ActorConfig", "FSDPActorConfig", "PolicyLossConfig"]

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_LOSS_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full")


@dataclass
class PolicyLossConfig(BaseConfig):
    """Which registered policy loss (`core_algos.get_policy_loss_fn`) and the parameters of the variants."""

    loss_mode: str = "vanilla"
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    dro_beta: Optional[float] = None
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


@dataclass
class ActorConfig(BaseConfig):
    """PPO update of the policy: batch sizes, clipping, loss aggregation, entropy and KL terms, epochs."""

    _mutable_fields = frozenset(
        {
            "ppo_mini_batch_size",
            "ppo_micro_batch_size",
            "ppo_micro_batch_size_per_gpu",
            "log_prob_micro_batch_size",
            "log_prob_micro_batch_size_per_gpu",
            "ppo_infer_micro_batch_size_per_gpu",
            "engine",
            "model_config",
            "global_batch_info",
        }
    )
    strategy: str = "fsdp"
    role: str = "actor"  # extension: actor | ref (not a key of the YAML; set by the worker)
    rollout_n: int = 1
    ppo_mini_batch_size: int = 256
    ppo_micro_batch_size: Optional[int] = None
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    ppo_infer_micro_batch_size_per_gpu: Optional[int] = None
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    ppo_infer_max_token_len_per_gpu: int = 16384
    clip_ratio: float = 0.2
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    freeze_vision_tower: bool = False
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: Optional[int] = None
    entropy_coeff: float = 0.0
    calculate_entropy: bool = False
    calculate_sum_pi_squared: bool = False
    use_kl_loss: bool = False
    use_prefix_grouper: bool = False
    use_torch_compile: bool = True
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    ppo_epochs: int = 1
    shuffle: bool = False
    data_loader_seed: Optional[int] = 42
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    use_fused_kernels: bool = False
    profiler: dict[str, Any] = field(default_factory=dict)
    qat: dict[str, Any] = field(default_factory=dict)
    global_batch_info: dict[str, Any] = field(default_factory=dict)  # set by the loss for each mini-batch
    # the reference policy's forward (ref section; verl's legacy names)
    log_prob_micro_batch_size: Optional[int] = None
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    log_prob_use_dynamic_bsz: bool = False
    log_prob_max_token_len_per_gpu: int = 16384

    def __post_init__(self):
        if self.role not in ("actor", "ref"):
            raise ValueError(f"role={self.role!r}: actor or ref")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode={self.loss_agg_mode!r}: one of {list(LOSS_AGG_MODES)}")
        if self.kl_loss_type not in KL_LOSS_TYPES and not self.kl_loss_type.endswith("+"):
            raise ValueError(f"kl_loss_type={self.kl_loss_type!r}: one of {list(KL_LOSS_TYPES)} (a '+' suffix allowed)")
        if self.rollout_n < 1 or self.ppo_epochs < 1:
            raise ValueError(f"rollout_n={self.rollout_n}, ppo_epochs={self.ppo_epochs}: both must be >= 1")
        if self.role == "actor" and not self.use_dynamic_bsz:
            if self.ppo_micro_batch_size is not None and self.ppo_micro_batch_size_per_gpu is not None:
                raise ValueError(
                    "ppo_micro_batch_size and ppo_micro_batch_size_per_gpu are both set: remove ppo_micro_batch_size "
                    "(deprecated; only the per-GPU size is supported)"
                )
            if self.ppo_micro_batch_size is None and self.ppo_micro_batch_size_per_gpu is None:
                raise ValueError("ppo_micro_batch_size_per_gpu=None: set it (or use_dynamic_bsz=true)")

    def validate(self, n_gpus: int, train_batch_size: int, model_config: Optional[dict] = None) -> None:
        """Checks against the run's size (verl's): a mini-batch fits in the batch and splits into micro-batches."""
        if self.use_dynamic_bsz:
            return
        if train_batch_size < self.ppo_mini_batch_size:
            raise ValueError(
                f"train_batch_size ({train_batch_size}) must be >= actor.ppo_mini_batch_size ({self.ppo_mini_batch_size})"
            )
        if self.ppo_micro_batch_size is not None:
            if self.ppo_mini_batch_size % self.ppo_micro_batch_size != 0:
                raise ValueError(
                    f"ppo_mini_batch_size ({self.ppo_mini_batch_size}) must be divisible by "
                    f"ppo_micro_batch_size ({self.ppo_micro_batch_size})"
                )
            if self.ppo_micro_batch_size < n_gpus:
                raise ValueError(f"ppo_micro_batch_size ({self.ppo_micro_batch_size}) must be >= n_gpus ({n_gpus})")


@dataclass
class FSDPActorConfig(ActorConfig):
    """The actor (or reference) on the FSDP2 engine: gradient clipping, the engine section, padding options."""

    strategy: str = "fsdp"
    optim: FSDPOptimizerConfig = field(default_factory=FSDPOptimizerConfig)
    grad_clip: float = 1.0
    ulysses_sequence_parallel_size: int = 1
    entropy_from_logits_with_chunking: bool = False
    entropy_from_logits_chunk_size: int = 2048
    entropy_checkpointing: bool = False
    pad_to_length: bool = False
    fsdp_config: FSDPEngineConfig = field(default_factory=FSDPEngineConfig)
    use_remove_padding: bool = False
    share_prompt_prefix: bool = False  # extension: copied from the model section by the worker
    use_rollout_log_probs: bool = False
    recompute_old_log_prob: bool = True  # extension
    tis_imp_ratio_cap: float = -1  # extension
    use_decoupled_loss: Optional[bool] = None  # extension
    behav_imp_weight_cap: float = 5.0  # extension
    topr_positive_weight: float = 1.0  # extension
    topr_negative_weight: float = 1.0  # extension

    def __post_init__(self):
        super().__post_init__()
        if self.grad_clip <= 0:
            raise ValueError(f"grad_clip={self.grad_clip}: must be > 0")
        if self.ulysses_sequence_parallel_size > 1:
            self.fsdp_config.ulysses_sequence_parallel_size = self.ulysses_sequence_parallel_size

    @property
    def engine(self) -> FSDPEngineConfig:
        """verl's generic name of the engine section."""
        return self.fsdp_config
