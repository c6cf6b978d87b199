"""Metrics of one PPO step under verl's names: data metrics (scores, rewards, advantages, lengths; turns and tool
rewards of agent-loop rows), timing (`timing_s/*`), throughput (`perf/*`), speculative decoding
(`rollout/spec_accept_*`) and MoE routing load balance of the rollout (`rollout/moe/*`). The validation metrics
live in `validation_metrics.py`; verl's names of them are re-exported here, as verl's module has them.

Layer 8 helper: reads a DataProto's tensors, holds no algorithm maths.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from verl.protocol import DataProto
from verl.trainer.ppo.validation_metrics import (  # noqa: F401  (verl's names)
    bootstrap_metric,
    calc_maj_val,
    numeric_value,
    process_validation_metrics,
)
from verl.utils.metric import Metric
from verl.utils.metric import reduce_metrics as verl_reduce_metrics

logger = logging.getLogger(__name__)


@contextmanager
def marked_timer(name: str, timing_raw: dict[str, float]):
    """Add the wall time of the block to `timing_raw[name]` (seconds)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timing_raw[name] = timing_raw.get(name, 0.0) + time.perf_counter() - start


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    """`{prefix}/mean|max|min` of `values`; NaN when there are none (as verl logs an all-masked batch)."""
    values = values.float()
    if values.numel() == 0:
        return {f"{prefix}/{name}": float("nan") for name in ("mean", "max", "min")}
    return {
        f"{prefix}/mean": values.mean().item(),
        f"{prefix}/max": values.max().item(),
        f"{prefix}/min": values.min().item(),
    }


def _compute_response_info(batch: DataProto) -> dict[str, torch.Tensor]:
    """verl's per-row `prompt_length` and `response_length` (bs,): the batch's own columns of those names when it
    has both, else the attention mask's ones over the prompt part and over the last `responses.shape[-1]` tokens."""
    if "prompt_length" in batch.batch and "response_length" in batch.batch:
        return {"prompt_length": batch.batch["prompt_length"], "response_length": batch.batch["response_length"]}
    response_width = batch.batch["responses"].shape[-1]
    attention_mask = batch.batch["attention_mask"]
    return {
        "prompt_length": attention_mask[:, :-response_width].sum(-1).float(),
        "response_length": attention_mask[:, -response_width:].sum(-1).float(),
    }


def compute_data_metrics(batch: DataProto, use_critic: bool = True) -> dict[str, float]:
    """verl's data metrics: critic/score and critic/rewards (rows with a non-empty response), critic/advantages and
    critic/returns (response tokens), critic/values (+ vf_explained_var) with a critic, response_length and
    prompt_length (mean/max/min/clip_ratio), response_length_non_aborted/* and response/aborted_ratio (an aborted
    row has an empty response), and the agent-loop metrics. NaN where there is nothing to average."""
    response_mask = batch.batch["response_mask"].bool()
    info = _compute_response_info(batch)
    prompt_length, response_length = info["prompt_length"], info["response_length"]
    max_response = batch.batch["responses"].shape[-1]
    max_prompt = batch.batch["attention_mask"].shape[-1] - max_response
    kept = response_length > 0  # not aborted
    metrics: dict[str, float] = {}
    scores = batch.batch["token_level_scores"].sum(-1)
    metrics.update(_stats("critic/score", scores[kept]))
    if "uid" in batch.non_tensor_batch:
        metrics["critic/score/zero_std_frac"] = zero_std_fraction(scores, batch.non_tensor_batch["uid"])
    metrics.update(_stats("critic/rewards", batch.batch["token_level_rewards"].sum(-1)[kept]))
    metrics.update(_stats("critic/advantages", torch.masked_select(batch.batch["advantages"], response_mask)))
    returns = torch.masked_select(batch.batch["returns"], response_mask)
    metrics.update(_stats("critic/returns", returns))
    if use_critic and "values" in batch.batch.keys():
        values = torch.masked_select(batch.batch["values"], response_mask)
        metrics.update(_stats("critic/values", values))
        var_returns = torch.var(returns)
        metrics["critic/vf_explained_var"] = (1.0 - torch.var(returns - values) / (var_returns + 1e-5)).item()
    for prefix, lengths, width in (
        ("response_length", response_length, max_response),
        ("response_length_non_aborted", response_length[kept], max_response),
        ("prompt_length", prompt_length, max_prompt),
    ):
        metrics.update(_stats(prefix, lengths))
        clipped = (lengths == width).float()
        metrics[f"{prefix}/clip_ratio"] = clipped.mean().item() if clipped.numel() else float("nan")
    metrics["response/aborted_ratio"] = (~kept).float().mean().item()
    metrics.update(compute_agent_loop_metrics(batch))
    return metrics


def compute_agent_loop_metrics(batch: DataProto) -> dict[str, float]:
    """Of rows made by verl's agent loops (the agent_loop workflow): verl's `num_turns/{min,max,mean}` and
    `tool_call_counts/{min,max,mean}`;
    `agent_loop/tool_reward/{mean,max,min}` (per sample, the sum of the rewards its tool calls returned) and
    `agent_loop/num_tool_calls/mean` (calls that returned a reward, per sample); verl's seconds per sample
    `agent_loop/{generate_sequences,tool_calls}/{mean,max,min}`. Empty for other rows."""
    fields = batch.non_tensor_batch
    metrics: dict[str, float] = {}
    if "__num_turns__" in fields:
        metrics.update(_stats("num_turns", torch.tensor([float(t) for t in fields["__num_turns__"]])))
    if "tool_call_counts" in fields:
        metrics.update(_stats("tool_call_counts", torch.tensor([float(c) for c in fields["tool_call_counts"]])))
    if "tool_rewards" in fields:
        rewards = [list(r) if r is not None else [] for r in fields["tool_rewards"]]
        metrics.update(_stats("agent_loop/tool_reward", torch.tensor([float(sum(r)) for r in rewards])))
        metrics["agent_loop/num_tool_calls/mean"] = float(np.mean([len(r) for r in rewards])) if rewards else 0.0
    if "agent_loop_metrics" in fields:
        for key in ("generate_sequences", "tool_calls"):
            seconds = [float((m or {}).get(key, 0.0)) for m in fields["agent_loop_metrics"]]
            metrics.update(_stats(f"agent_loop/{key}", torch.tensor(seconds)))
    return metrics


def compute_gdpo_metrics(batch: DataProto, reward_keys: list[str]) -> dict[str, float]:
    """verl's `gdpo/{key}/mean|std|max|min` of each GDPO reward component found in `non_tensor_batch` (std over
    the batch, population form)."""
    metrics: dict[str, float] = {}
    for key in reward_keys:
        if key in batch.non_tensor_batch:
            values = np.asarray(batch.non_tensor_batch[key], dtype=np.float32)
            metrics[f"gdpo/{key}/mean"] = float(np.mean(values))
            metrics[f"gdpo/{key}/std"] = float(np.std(values))
            metrics[f"gdpo/{key}/max"] = float(np.max(values))
            metrics[f"gdpo/{key}/min"] = float(np.min(values))
    return metrics


def zero_std_fraction(scores: torch.Tensor, uids) -> float:
    """Share of prompt groups (same uid) whose samples all got the same score: such groups give GRPO
    zero advantages, the first thing to look at when the policy loss is 0."""
    groups: dict[Any, list[float]] = defaultdict(list)
    for uid, score in zip(uids, scores.tolist()):
        groups[uid].append(score)
    if not groups:
        return 0.0
    return sum(1 for values in groups.values() if max(values) == min(values)) / len(groups)


def peak_memory_gb() -> float:
    """Peak GPU memory allocated on this process when CUDA is used, else the process's peak RSS (GiB)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


# verl's per-token timings: generation per response token, the other phases per prompt + response token
_TOKEN_TIMED_PHASES = ("gen", "ref", "values", "adv", "update_critic", "update_actor")


def compute_timing_metrics(batch: DataProto, timing_raw: dict[str, float]) -> dict[str, float]:
    """`timing_s/{phase}` for every timed phase and `timing_per_token_ms/{phase}` for the phases of
    `_TOKEN_TIMED_PHASES` that were timed (0.0 when the batch has no tokens)."""
    info = _compute_response_info(batch)
    num_response_tokens = torch.sum(info["response_length"]).item()
    num_all_tokens = num_response_tokens + torch.sum(info["prompt_length"]).item()
    metrics = {f"timing_s/{name}": value for name, value in timing_raw.items()}
    for name in _TOKEN_TIMED_PHASES:
        if name in timing_raw:
            tokens = num_response_tokens if name == "gen" else num_all_tokens
            metrics[f"timing_per_token_ms/{name}"] = timing_raw[name] * 1000.0 / tokens if tokens > 0 else 0.0
    return metrics


def compute_throughout_metrics(batch: DataProto, timing_raw: dict[str, float], n_gpus: int) -> dict[str, float]:
    """`perf/total_num_tokens` (the sum of `meta_info["global_token_num"]` when the batch has it, else of its
    attention mask), `perf/time_per_step`, `perf/throughput` (tokens per second per GPU, or per worker on CPU) and
    the driver's `perf/max_memory_allocated_gb`."""
    if "global_token_num" in batch.meta_info:
        total_tokens = int(sum(batch.meta_info["global_token_num"]))
    else:
        total_tokens = int(batch.batch["attention_mask"].sum().item())
    step_time = timing_raw.get("step", 0.0)
    metrics = {
        "perf/total_num_tokens": total_tokens,
        "perf/time_per_step": step_time,
        "perf/max_memory_allocated_gb": peak_memory_gb(),  # of the driver; workers report their own
    }
    if step_time > 0:
        metrics["perf/throughput"] = total_tokens / (step_time * max(1, n_gpus))
    return metrics


SPEC_DECODE_KEYS = ("spec_num_draft_tokens", "spec_num_accepted_tokens", "spec_num_verify_steps")


def compute_spec_decode_metrics(spec_drafts, spec_accepts, spec_verifies, non_padding_mask=None) -> dict[str, float]:
    """Speculative decoding of a rollout, from per-request counts (the batch's `SPEC_DECODE_KEYS` columns) of
    drafted tokens, accepted tokens and verify steps: `rollout/spec_accept_rate` (accepted / drafted) and
    `rollout/spec_accept_length` (1 + accepted / verify steps), each computed per request (0.0 where its
    denominator is 0) and averaged over requests. `non_padding_mask` (bool per request) drops padding rows.
    Empty when all three counts are None (the rollout reports none) or no request is left."""
    counts = (spec_drafts, spec_accepts, spec_verifies)
    if all(c is None for c in counts):
        return {}
    if any(c is None for c in counts):
        missing = [name for name, c in zip(SPEC_DECODE_KEYS, counts) if c is None]
        raise ValueError(f"spec-decode metrics need all of {list(SPEC_DECODE_KEYS)}; missing {missing}")
    rows = [np.asarray(c, dtype=np.float64).reshape(-1) for c in counts]
    if non_padding_mask is not None:
        keep = np.asarray(non_padding_mask, dtype=bool).reshape(-1)
        if any(len(r) != len(keep) for r in rows):
            raise ValueError(f"non_padding_mask has {len(keep)} entries for {[len(r) for r in rows]} requests")
        rows = [r[keep] for r in rows]
    drafts, accepts, verifies = rows
    if len(drafts) == 0:
        return {}
    with np.errstate(divide="ignore", invalid="ignore"):
        rate = np.where(drafts > 0, accepts / drafts, 0.0)
        length = np.where(verifies > 0, 1.0 + accepts / verifies, 0.0)
    return {"rollout/spec_accept_rate": float(rate.mean()), "rollout/spec_accept_length": float(length.mean())}


# ---------------------------------------------------------------- MoE routing load balance of the rollout
_NUM_LOCAL_EXPERTS_MODEL_TYPES = ("gpt_oss", "mixtral")  # whose num_local_experts is the routed expert count


def __getattr__(name: str):
    """verl's `metric_utils.AutoConfig`, imported from transformers only when asked for (it is slow to import)."""
    if name == "AutoConfig":
        from transformers import AutoConfig

        return AutoConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def copy_to_local(src: str, use_shm: bool = False) -> str:
    """The path a model config is read from: `src` itself, a local directory or a Hugging Face model id in the
    local cache (`use_shm`, verl's copy into shared memory, changes nothing for a config). HDFS is refused."""
    if src.startswith("hdfs://"):
        raise ValueError(f"model path {src!r}: HDFS paths are not supported; use a local directory")
    return src


def update_model_config(module_config: Any, override_config_kwargs: dict[str, Any]) -> None:
    """Set each key of `override_config_kwargs` on the HF config; a dict value updates the sub-config of its key."""
    for key, value in override_config_kwargs.items():
        if isinstance(value, dict):
            update_model_config(getattr(module_config, key), value)
        else:
            setattr(module_config, key, value)


def _get(obj: Any, name: str, default: Any = None) -> Any:
    return obj.get(name, default) if hasattr(obj, "get") else getattr(obj, name, default)


def get_hf_config_override_kwargs(override_config: Any) -> dict[str, Any]:
    """The HF config fields of `model.override_config`: its `model_config` entry when it has one, else itself."""
    if isinstance(override_config, DictConfig):
        override_config = OmegaConf.to_container(override_config, resolve=True)
    if not override_config:
        return {}
    return override_config.get("model_config", override_config)


def infer_moe_num_experts(model_config: Any) -> int | None:
    """The number of routed experts named by a model config (dict or object): `num_experts` or `n_routed_experts`
    (or, for gpt_oss and mixtral, `num_local_experts`) of the config itself, its `hf_config` (and that one's
    `text_config`), its `text_config`, or its `override_config` (and that one's `model_config`, `text_config`),
    searched in that order; None when none has one."""
    candidates = [model_config]
    hf_config, override = _get(model_config, "hf_config"), _get(model_config, "override_config")
    if hf_config is not None:
        candidates += [hf_config, _get(hf_config, "text_config")]
    candidates.append(_get(model_config, "text_config"))
    if override is not None:
        candidates += [override, _get(override, "model_config"), _get(override, "text_config")]
    for candidate in (c for c in candidates if c is not None):
        for attr in ("num_experts", "n_routed_experts"):
            if _get(candidate, attr) is not None:
                return int(_get(candidate, attr))
        local = _get(candidate, "num_local_experts")
        if _get(candidate, "model_type") in _NUM_LOCAL_EXPERTS_MODEL_TYPES and local is not None:
            return int(local)
    return None


def infer_rollout_moe_num_experts(model_config: Any) -> int | None:
    """`infer_moe_num_experts` of the rollout's model config, else of the HF config it points at
    (`local_hf_config_path`, `hf_config_path` or `path`, with `override_config` applied); None without a path."""
    num_experts = infer_moe_num_experts(model_config)
    path = _get(model_config, "local_hf_config_path") or _get(model_config, "hf_config_path")
    path = path or _get(model_config, "path")
    if num_experts is not None or path is None:
        return num_experts
    from transformers import AutoConfig

    local_path = copy_to_local(path, use_shm=_get(model_config, "use_shm", False))
    hf_config = AutoConfig.from_pretrained(local_path, trust_remote_code=_get(model_config, "trust_remote_code", False))
    override = get_hf_config_override_kwargs(_get(model_config, "override_config", {}))
    if override:
        update_model_config(hf_config, override)
    return infer_moe_num_experts(hf_config)


def _compute_rollout_moe_load_counts(
    routed_experts: torch.Tensor | None, response_mask: torch.Tensor | None, num_experts: int | None
) -> torch.Tensor | None:
    """(num_layers, num_experts) counts of the experts routed_experts (bs, seq, num_layers, topk) names over the
    response tokens (the last response_mask.shape[1] positions). Each row's last valid response token is left out:
    it was sampled but never fed back through the model, so its slot holds filler. None (with a warning for a
    malformed input) when there is nothing to count."""
    if routed_experts is None or response_mask is None or not num_experts or num_experts <= 0:
        return None
    if (
        routed_experts.dim() != 4
        or response_mask.dim() != 2
        or response_mask.shape[0] != routed_experts.shape[0]
        or routed_experts.shape[1] < response_mask.shape[1]
    ):
        logger.warning(
            "rollout MoE metrics need routed_experts [bsz, seqlen, layers, topk] and a [bsz, response_len] response "
            "mask with response_len <= seqlen, got %s and %s",
            tuple(routed_experts.shape),
            tuple(response_mask.shape),
        )
        return None
    width = response_mask.shape[1]
    if width == 0:
        return None
    mask = response_mask.to(dtype=torch.bool, device=routed_experts.device)
    positions = torch.arange(width, device=mask.device)
    last_valid = torch.where(mask, positions, -1).amax(dim=-1, keepdim=True)
    selected = routed_experts[:, -width:][mask & (positions != last_valid)].detach().to("cpu", torch.long)
    if selected.numel() == 0:
        return None
    if selected.min() < 0 or selected.max() >= num_experts:
        logger.warning(
            "skipping rollout MoE load-balance metrics: routed expert ids outside [0, %s): min=%s max=%s",
            num_experts,
            selected.min().item(),
            selected.max().item(),
        )
        return None
    layers = range(selected.shape[1])
    return torch.stack([torch.bincount(selected[:, layer].flatten(), minlength=num_experts) for layer in layers])


def _compute_rollout_moe_load_balance_metrics_from_counts(
    load_counts: torch.Tensor | None, prefix: str = "rollout/moe"
) -> dict[str, float]:
    """Per layer, the violation load * num_experts - 1 of each expert's share of the layer's load (0 = balanced):
    `{prefix}/{max,min,avg}_vio/layer_{i}` (max, min and mean absolute over experts), and of those over layers
    `{prefix}/{max,min,avg}_vio/{max,avg}`."""
    if load_counts is None or load_counts.numel() == 0:
        return {}
    load = load_counts.float()
    deviation = load / load.sum(dim=1, keepdim=True).clamp_min(1.0) * load.shape[1] - 1.0
    per_layer = {
        "max_vio": deviation.max(dim=1).values,
        "min_vio": deviation.min(dim=1).values,
        "avg_vio": deviation.abs().mean(dim=1),
    }
    metrics: dict[str, float] = {}
    for name, values in per_layer.items():
        metrics.update({f"{prefix}/{name}/layer_{i}": v for i, v in enumerate(values.tolist())})
        metrics[f"{prefix}/{name}/max"] = values.max().item()
        metrics[f"{prefix}/{name}/avg"] = values.mean().item()
    return metrics


def compute_rollout_moe_load_balance_metrics(
    routed_experts: torch.Tensor | None,
    response_mask: torch.Tensor | None,
    num_experts: int | None,
    prefix: str = "rollout/moe",
) -> dict[str, float]:
    """Load-balance metrics (see `_compute_rollout_moe_load_balance_metrics_from_counts`) of the experts the
    rollout routed the response tokens to; empty when there are none."""
    counts = _compute_rollout_moe_load_counts(routed_experts, response_mask, num_experts)
    return _compute_rollout_moe_load_balance_metrics_from_counts(counts, prefix=prefix)


class RolloutMoELoadBalanceMetricsAccumulator:
    """Routed-expert counts of the rollout summed over the steps of a logging interval. `num_experts` comes from
    `model_config` (`infer_rollout_moe_num_experts`, once) unless `update` is given it; each skip reason is warned
    about once (`warn_skip_once`)."""

    def __init__(self, model_config: Any | None = None):
        self.model_config = model_config
        self.load_counts: torch.Tensor | None = None
        self.num_experts: int | None = None
        self.num_experts_initialized = False
        self.routed_experts_retry_after_step = 0  # after a batch without routed_experts, ask again from this step
        self.warned_skip_keys: set[str] = set()

    def should_request_routed_experts(self, global_steps: int) -> bool:
        return global_steps >= self.routed_experts_retry_after_step

    def defer_routed_experts_retry(self, global_steps: int, interval: int) -> None:
        self.routed_experts_retry_after_step = global_steps + max(interval, 1)

    def warn_skip_once(self, key: str, message: str) -> None:
        if key not in self.warned_skip_keys:
            logger.warning(message)
            self.warned_skip_keys.add(key)

    def _infer_num_experts(self) -> int | None:
        if not self.num_experts_initialized:
            self.num_experts_initialized = True
            if self.model_config is not None:
                try:
                    self.num_experts = infer_rollout_moe_num_experts(self.model_config)
                except Exception as exc:  # a config that cannot be read only costs the metric
                    self.warn_skip_once("num_experts_exception", f"cannot infer rollout MoE num_experts: {exc}")
            if self.num_experts is None:
                self.warn_skip_once(
                    "num_experts_missing",
                    "skipping rollout MoE load-balance metrics: num_experts is not in actor_rollout_ref.model "
                    "nor in the Hugging Face config",
                )
        return self.num_experts

    def update(self, routed_experts, response_mask, num_experts: int | None = None) -> bool:
        """Add a batch's counts; False when it has none to add. A change of shape restarts the sums."""
        if num_experts is None:
            num_experts = self._infer_num_experts()
        counts = _compute_rollout_moe_load_counts(routed_experts, response_mask, num_experts)
        if counts is None:
            return False
        if self.load_counts is not None and self.load_counts.shape == counts.shape:
            self.load_counts += counts
        else:
            if self.load_counts is not None:
                shapes = tuple(self.load_counts.shape), tuple(counts.shape)
                logger.warning("rollout MoE counts change shape %s -> %s: restarting the sums", *shapes)
            self.load_counts = counts
        return True

    def compute(self, prefix: str = "rollout/moe") -> dict[str, float]:
        return _compute_rollout_moe_load_balance_metrics_from_counts(self.load_counts, prefix=prefix)

    def total_assignments(self) -> int:
        return 0 if self.load_counts is None else int(self.load_counts.sum().item())

    def reset(self) -> None:
        self.load_counts = None

    def pop_metrics(self, prefix: str = "rollout/moe") -> dict[str, float]:
        metrics = self.compute(prefix=prefix)
        self.reset()
        return metrics


def get_metric_data_with_optional_routed_experts(
    keys: list[str],
    partition_id: str,
    fields: list[str],
    moe_lb_metrics_interval: int,
    global_steps: int,
    accumulator: RolloutMoELoadBalanceMetricsAccumulator,
    kv_batch_get: Callable[..., Any],
):
    """`kv_batch_get(keys=, partition_id=, select_fields=fields)`, asking for `routed_experts` too when the metric
    is on and the accumulator wants them; a ValueError naming routed_experts (the store has none) makes it ask
    again without them, and not before `moe_lb_metrics_interval` steps later."""
    if moe_lb_metrics_interval > 0 and accumulator.should_request_routed_experts(global_steps):
        try:
            return kv_batch_get(keys=keys, partition_id=partition_id, select_fields=[*fields, "routed_experts"])
        except ValueError as exc:
            if "routed_experts" not in str(exc):
                raise
            accumulator.defer_routed_experts_retry(global_steps, moe_lb_metrics_interval)
            accumulator.warn_skip_once("missing_routed_experts", f"skipping rollout MoE load-balance metrics: {exc}")
    return kv_batch_get(keys=keys, partition_id=partition_id, select_fields=fields)


def compute_moe_lb_metrics(
    metrics_batch: DataProto,
    moe_lb_metrics_interval: int,
    global_steps: int,
    accumulator: RolloutMoELoadBalanceMetricsAccumulator,
) -> dict[str, float]:
    """Add the batch's `routed_experts` to the accumulator; every `moe_lb_metrics_interval` steps return (and
    clear) its metrics with `rollout/moe/routed_experts_found` and `rollout/moe/routed_expert_assignments`.
    Empty when the interval is 0 (off) or between logging steps."""
    if moe_lb_metrics_interval <= 0:
        return {}
    updated = accumulator.update(
        routed_experts=metrics_batch.batch.get("routed_experts", None),
        response_mask=metrics_batch.batch.get("response_mask", None),
    )
    if global_steps % moe_lb_metrics_interval != 0:
        return {}
    assignments = accumulator.total_assignments()
    metrics = accumulator.pop_metrics()
    metrics["rollout/moe/routed_experts_found"] = float(assignments > 0)
    metrics["rollout/moe/routed_expert_assignments"] = assignments
    if not updated and assignments == 0:
        accumulator.warn_skip_once("no_routed_expert_counts", "skipping rollout MoE load-balance metrics: no counts")
    return metrics


def _flatten(value: Any) -> list:
    if isinstance(value, (list, tuple, np.ndarray)):
        return [x for item in value for x in _flatten(item)]
    return [value]


def reduce_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """One float per metric: a `verl.utils.metric.Metric` (or a list of them, one per rank) by its aggregation,
    a list (per micro-batch, nested per rank by `DataProto.concat`) by its mean, or its sum for the
    `*nonfinite_steps` counters."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, Metric) or (
            isinstance(value, list) and value and all(isinstance(v, Metric) for v in value)
        ):
            out[key] = float(verl_reduce_metrics({key: value})[key])
        elif isinstance(value, (list, tuple, np.ndarray)):
            flat = np.asarray(_flatten(value), dtype=np.float64).reshape(-1)
            if flat.size == 0:
                continue
            # counters are summed, everything else averaged
            out[key] = float(flat.sum() if key.endswith("nonfinite_steps") else flat.mean())
        elif isinstance(value, torch.Tensor):
            out[key] = float(value.float().mean().item())
        else:
            out[key] = float(value)
    return out


def compute_domain_metrics(
    batch: DataProto, use_critic: bool = True, extra_keys: list[str] | tuple = (), domain_key: str | None = "domain"
) -> dict[str, float]:
    """Metrics of a step run through the RLVR step (verl/trainer/ppo/rlvr.py).

    `critic/score/*` (and `critic/score/zero_std_frac`) from the verifier's scores `raw_scores` (bs,), before reward
    processing (the processed rewards are `critic/rewards/*`); and, when the batch has a `domain_key` column, every
    data metric of `compute_data_metrics` plus the mean of each numeric reward extra field in `extra_keys` per
    domain, as `{domain}/critic/score/mean`, `{domain}/response_length/mean`, `{domain}/reward_extra/{key}/mean`, ...
    """
    metrics = _verifier_score_metrics(batch)
    if domain_key is None or domain_key not in batch.non_tensor_batch:
        return metrics
    groups, _ = batch.group_by(domain_key)
    for domain, part in groups.items():
        sub = compute_data_metrics(part, use_critic=use_critic)
        sub.update(_verifier_score_metrics(part))
        for key in extra_keys:
            values = [v for v in map(numeric_value, part.non_tensor_batch.get(key, [])) if v is not None]
            if values:
                sub[f"reward_extra/{key}/mean"] = float(np.mean(values))
        metrics.update({f"{domain}/{name}": value for name, value in sub.items()})
    return metrics


def _verifier_score_metrics(batch: DataProto) -> dict[str, float]:
    if "raw_scores" not in batch.batch.keys():
        return {}
    scores = batch.batch["raw_scores"]
    metrics = _stats("critic/score", scores)
    if "uid" in batch.non_tensor_batch:
        metrics["critic/score/zero_std_frac"] = zero_std_fraction(scores, batch.non_tensor_batch["uid"])
    return metrics
