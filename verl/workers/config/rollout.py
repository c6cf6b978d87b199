"""Typed rollout section (`actor_rollout_ref.rollout`): verl's `RolloutConfig` and its sub-sections.

`SamplingConfig` (val_kwargs), `MultiTurnConfig` (tool agent loop), `AgentLoopConfig`, `CustomAsyncServerConfig`,
`CheckpointEngineConfig` (weight-sync bucket), `TraceConfig`, `PrometheusConfig`. Names and defaults are verl
0.9.1's plus this project's extension keys (marked); each key's meaning is commented in `ppo_trainer.yaml`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from verl.base_config import BaseConfig
from verl.workers.config.model import MtpConfig

__all__ = [
    "AgentLoopConfig",
    "CheckpointEngineConfig",
    "CustomAsyncServerConfig",
    "MultiTurnConfig",
    "PrometheusConfig",
    "RolloutConfig",
    "SamplingConfig",
    "TraceConfig",
]

TRUNCATE_SIDES = ("left", "right", "middle")


@dataclass
class SamplingConfig(BaseConfig):
    """Sampling of validation answers."""

    top_k: int = -1
    top_p: float = 1.0
    temperature: float = 0.0
    n: int = 1
    do_sample: bool = False


@dataclass
class MultiTurnConfig(BaseConfig):
    """Multi-turn tool use: verl's agent loop keys plus the multi_turn_tool workflow's (extension)."""

    enable: bool = False
    max_assistant_turns: Optional[int] = None
    tool_config_path: Optional[str] = None
    function_tool_path: Optional[str] = None
    max_user_turns: Optional[int] = None
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = "middle"
    use_inference_chat_template: bool = False
    tokenization_sanity_check_mode: str = "strict"
    format: str = "hermes"
    num_repeat_rollouts: Optional[int] = None
    max_turns: int = 4  # extension
    tool_modules: list[str] = field(default_factory=list)  # extension
    tools: Optional[list[str]] = None  # extension
    tool_timeout_s: float = 30  # extension

    def __post_init__(self):
        if self.tool_response_truncate_side not in TRUNCATE_SIDES:
            raise ValueError(
                f"tool_response_truncate_side={self.tool_response_truncate_side!r}: one of {list(TRUNCATE_SIDES)}"
            )
        if self.max_parallel_calls < 1 or self.max_tool_response_length < 1:
            raise ValueError(
                f"max_parallel_calls={self.max_parallel_calls}, max_tool_response_length={self.max_tool_response_length}:"
                " both must be >= 1"
            )


@dataclass
class CustomAsyncServerConfig(BaseConfig):
    """A user's async rollout server class (verl's server mode); not supported here, verl's default only."""

    path: Optional[str] = None
    name: Optional[str] = None


@dataclass
class AgentLoopConfig(BaseConfig):
    """verl's agent loops: the loop of rows without `agent_name`, and a YAML of more loops."""

    num_workers: int = 8
    default_agent_loop: str = "single_turn_agent"
    agent_loop_config_path: Optional[str] = None
    custom_async_server: CustomAsyncServerConfig = field(default_factory=CustomAsyncServerConfig)


@dataclass
class CheckpointEngineConfig(BaseConfig):
    """Weight transfer from the actor to the rollout engine: the bucket size is what is read here."""

    backend: str = "naive"
    update_weights_bucket_megabytes: int = 2048
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    custom_backend_module: Optional[str] = None

    def __post_init__(self):
        if self.update_weights_bucket_megabytes < 1:
            raise ValueError(f"update_weights_bucket_megabytes={self.update_weights_bucket_megabytes}: must be >= 1")


@dataclass
class TraceConfig(BaseConfig):
    """Rollout tracing (verl); not supported here, verl's default only."""

    project_name: Optional[str] = None
    experiment_name: Optional[str] = None
    backend: Optional[str] = None
    token2text: bool = False
    max_samples_per_step_per_worker: Optional[int] = None


@dataclass
class PrometheusConfig(BaseConfig):
    """The rollout server's Prometheus metrics (verl's server mode); not supported here, verl's default only."""

    enable: bool = False
    port: int = 9090
    file: str = "/tmp/ray/session_latest/metrics/prometheus/prometheus.yml"
    served_model_name: Optional[str] = None


@dataclass
class RolloutConfig(BaseConfig):
    """The rollout engine and sampling of training answers, its log-prob pass, agent loops and workflows."""

    name: Optional[str] = None
    mode: str = "async"
    nnodes: int = 0
    n_gpus_per_node: int = 8
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    full_determinism: bool = False
    seed: int = 42
    prompt_length: int = 512
    response_length: int = 512
    dtype: str = "bfloat16"
    gpu_memory_utilization: float = 0.5
    ignore_eos: bool = False
    enforce_eager: bool = False
    cudagraph_capture_sizes: Optional[list[int]] = None
    free_cache_engine: bool = True
    tensor_model_parallel_size: int = 2
    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    max_num_batched_tokens: int = 8192
    max_model_len: Optional[int] = None
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    logprobs_mode: str = "processed_logprobs"
    scheduling_policy: str = "fcfs"
    load_format: str = "dummy"
    layered_summon: bool = False
    log_prob_micro_batch_size: Optional[int] = None
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    log_prob_use_dynamic_bsz: bool = False
    log_prob_max_token_len_per_gpu: int = 16384
    disable_log_stats: bool = True
    do_sample: bool = True
    n: int = 1
    over_sample_rate: float = 0
    multi_stage_wake_up: bool = False
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    val_kwargs: SamplingConfig = field(default_factory=SamplingConfig)
    router_config_path: Optional[str] = None
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    calculate_log_probs: bool = True
    agent: AgentLoopConfig = field(default_factory=AgentLoopConfig)
    checkpoint_engine: CheckpointEngineConfig = field(default_factory=CheckpointEngineConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    skip_tokenizer_init: bool = True
    enable_rollout_routing_replay: bool = False
    moe_load_balance_metrics_interval: int = 0
    profiler: dict[str, Any] = field(default_factory=dict)
    prometheus: PrometheusConfig = field(default_factory=PrometheusConfig)
    quantization: Optional[str] = None
    quantization_config_file: Optional[str] = None
    mtp: Optional[MtpConfig] = None
    qat: Optional[dict[str, Any]] = None
    disaggregation: dict[str, Any] = field(default_factory=dict)
    engine_fallback: bool = True  # extension
    micro_batch_size: Optional[int] = None  # extension
    workflow: str = "rlvr"  # extension
    workflow_kwargs: dict[str, Any] = field(default_factory=dict)  # extension
    max_concurrent_episodes: Optional[int] = None  # extension
    agenerate_window_ms: float = 5  # extension
    agenerate_max_batch_size: Optional[int] = None  # extension

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"n={self.n}: at least one response per prompt")
        if self.temperature < 0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"temperature={self.temperature}, top_p={self.top_p}: temperature >= 0, 0 < top_p <= 1")
        if self.prompt_length < 1 or self.response_length < 1:
            raise ValueError(f"prompt_length={self.prompt_length}, response_length={self.response_length}: both >= 1")
