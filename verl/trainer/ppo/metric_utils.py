"""Metrics of one PPO step under verl's names: data metrics (scores, rewards, advantages, lengths),
timing (`timing_s/*`), throughput (`perf/*`), and validation aggregation per data source.

Layer 8 helper: reads a DataProto's tensors, holds no algorithm maths.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from verl.protocol import DataProto


@contextmanager
def marked_timer(name: str, timing_raw: dict[str, float]):
    """Add the wall time of the block to `timing_raw[name]` (seconds)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timing_raw[name] = timing_raw.get(name, 0.0) + time.perf_counter() - start


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    if values.numel() == 0:
        return {}
    return {
        f"{prefix}/mean": values.mean().item(),
        f"{prefix}/max": values.max().item(),
        f"{prefix}/min": values.min().item(),
    }


def _lengths(batch: DataProto) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    responses = batch.batch["responses"]
    response_len = responses.shape[-1]
    prompt_len = batch.batch["attention_mask"].shape[-1] - response_len
    attention_mask = batch.batch["attention_mask"]
    prompt_length = attention_mask[:, :prompt_len].sum(-1).float()
    response_length = attention_mask[:, prompt_len:].sum(-1).float()
    return prompt_length, response_length, prompt_len, response_len


def compute_data_metrics(batch: DataProto, use_critic: bool = True) -> dict[str, float]:
    """verl's data metrics: critic/score, critic/rewards, critic/advantages, critic/returns,
    critic/values (+ vf_explained_var), response_length and prompt_length (mean/max/min/clip_ratio)."""
    response_mask = batch.batch["response_mask"].bool()
    metrics: dict[str, float] = {}
    scores = batch.batch["token_level_scores"].sum(-1)
    metrics.update(_stats("critic/score", scores))
    if "uid" in batch.non_tensor_batch:
        metrics["critic/score/zero_std_frac"] = zero_std_fraction(scores, batch.non_tensor_batch["uid"])
    metrics.update(_stats("critic/rewards", batch.batch["token_level_rewards"].sum(-1)))
    metrics.update(_stats("critic/advantages", torch.masked_select(batch.batch["advantages"], response_mask)))
    returns = torch.masked_select(batch.batch["returns"], response_mask)
    metrics.update(_stats("critic/returns", returns))
    if use_critic and "values" in batch.batch.keys():
        values = torch.masked_select(batch.batch["values"], response_mask)
        metrics.update(_stats("critic/values", values))
        var_returns = torch.var(returns)
        metrics["critic/vf_explained_var"] = (1.0 - torch.var(returns - values) / (var_returns + 1e-5)).item()
    prompt_length, response_length, max_prompt, max_response = _lengths(batch)
    metrics.update(_stats("response_length", response_length))
    metrics["response_length/clip_ratio"] = (response_length == max_response).float().mean().item()
    metrics.update(_stats("prompt_length", prompt_length))
    metrics["prompt_length/clip_ratio"] = (prompt_length == max_prompt).float().mean().item()
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


def compute_timing_metrics(batch: DataProto, timing_raw: dict[str, float]) -> dict[str, float]:
    """`timing_s/{phase}` for every timed phase and `timing_per_token_ms/{phase}` for the token-bound ones."""
    prompt_length, response_length, _, _ = _lengths(batch)
    num_response_tokens = response_length.sum().item()
    num_all_tokens = num_response_tokens + prompt_length.sum().item()
    metrics = {f"timing_s/{name}": value for name, value in timing_raw.items()}
    tokens_of = {"gen": num_response_tokens}
    for name, value in timing_raw.items():
        if name == "step":
            continue
        tokens = tokens_of.get(name, num_all_tokens)
        if tokens > 0:
            metrics[f"timing_per_token_ms/{name}"] = value * 1000.0 / tokens
    return metrics


def compute_throughout_metrics(batch: DataProto, timing_raw: dict[str, float], n_workers: int) -> dict[str, float]:
    """`perf/total_num_tokens`, `perf/time_per_step`, `perf/throughput` (tokens per second per worker)."""
    total_tokens = int(batch.batch["attention_mask"].sum().item())
    step_time = timing_raw.get("step", 0.0)
    metrics = {
        "perf/total_num_tokens": total_tokens,
        "perf/time_per_step": step_time,
        "perf/max_memory_allocated_gb": peak_memory_gb(),  # of the driver; workers report their own
    }
    if step_time > 0:
        metrics["perf/throughput"] = total_tokens / step_time / max(1, n_workers)
    return metrics


def reduce_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """Mean of each list-valued metric (workers return lists per micro-batch and per rank)."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, (list, tuple, np.ndarray)):
            flat = np.asarray(value, dtype=np.float64).reshape(-1)
            if flat.size == 0:
                continue
            # counters are summed, everything else averaged
            out[key] = float(flat.sum() if key.endswith("nonfinite_steps") else flat.mean())
        elif isinstance(value, torch.Tensor):
            out[key] = float(value.float().mean().item())
        else:
            out[key] = float(value)
    return out


def process_validation_metrics(
    data_sources: list[str], scores: list[float], n: int, extra: dict[str, list] | None = None
) -> dict[str, float]:
    """Validation metrics: `val-core/{data_source}/reward/mean@{n}` (the mean over all samples),
    `val-aux/{data_source}/reward/best@{n}` (mean over prompts of the best of its n samples, when
    the samples of one prompt are consecutive), `val/reward/mean` overall, and the mean of every
    numeric extra field per data source (`val-aux/{data_source}/{field}/mean@{n}`)."""
    by_source: dict[str, list[float]] = defaultdict(list)
    for source, score in zip(data_sources, scores):
        by_source[source].append(float(score))
    metrics: dict[str, float] = {}
    for source, values in by_source.items():
        arr = np.asarray(values)
        metrics[f"val-core/{source}/reward/mean@{n}"] = float(arr.mean())
        if n > 1 and len(arr) % n == 0:
            metrics[f"val-aux/{source}/reward/best@{n}"] = float(arr.reshape(-1, n).max(axis=1).mean())
    metrics["val/reward/mean"] = float(np.mean(scores)) if scores else float("nan")
    for field, values in (extra or {}).items():
        if len(values) != len(data_sources):
            continue
        grouped: dict[str, list[float]] = defaultdict(list)
        for source, value in zip(data_sources, values):
            if isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool):
                grouped[source].append(float(value))
        for source, vals in grouped.items():
            metrics[f"val-aux/{source}/{field}/mean@{n}"] = float(np.mean(vals))
    return metrics
