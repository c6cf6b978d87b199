"""Metrics of one PPO step under verl's names: data metrics (scores, rewards, advantages, lengths; turns and tool
rewards of agent-loop rows), timing (`timing_s/*`), throughput (`perf/*`), and validation aggregation per data source.

Layer 8 helper: reads a DataProto's tensors, holds no algorithm maths.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from verl.protocol import DataProto
from verl.utils.metric import Metric
from verl.utils.metric import reduce_metrics as verl_reduce_metrics


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
    metrics.update(compute_agent_loop_metrics(batch))
    return metrics


def compute_agent_loop_metrics(batch: DataProto) -> dict[str, float]:
    """Of rows made by verl's agent loops (the agent_loop workflow): verl's `num_turns/{min,max,mean}`;
    `agent_loop/tool_reward/{mean,max,min}` (per sample, the sum of the rewards its tool calls returned) and
    `agent_loop/num_tool_calls/mean` (calls that returned a reward, per sample); verl's seconds per sample
    `agent_loop/{generate_sequences,tool_calls}/{mean,max,min}`. Empty for other rows."""
    fields = batch.non_tensor_batch
    metrics: dict[str, float] = {}
    if "__num_turns__" in fields:
        metrics.update(_stats("num_turns", torch.tensor([float(t) for t in fields["__num_turns__"]])))
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


def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)


def subset_sizes(n: int) -> list[int]:
    """Sample counts k reported for best@k / worst@k / maj@k: 2, 4, 8, ... below n, then n itself (n > 1)."""
    if n < 2:
        return []
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return sizes + [n]


def bootstrap_best_worst(values: np.ndarray, k: int, rng: np.random.Generator, n_bootstrap: int) -> dict[str, float]:
    """Bootstrapped best@k and worst@k of one prompt's samples `values` (n,): draw k of them with
    replacement `n_bootstrap` times; report the mean and std over the draws of the max and of the min."""
    draws = values[rng.integers(0, len(values), size=(n_bootstrap, k))]
    best, worst = draws.max(axis=1), draws.min(axis=1)
    return {
        f"best@{k}/mean": float(best.mean()),
        f"best@{k}/std": float(best.std()),
        f"worst@{k}/mean": float(worst.mean()),
        f"worst@{k}/std": float(worst.std()),
    }


def bootstrap_majority(
    values: np.ndarray, votes: list[Any], k: int, rng: np.random.Generator, n_bootstrap: int
) -> dict[str, float]:
    """Bootstrapped maj@k: draw k samples with replacement, take the most frequent vote (ties go to the vote
    drawn first), and score the draw with the value of the first drawn sample carrying that vote."""
    codes = np.unique(np.asarray([str(v) for v in votes], dtype=object), return_inverse=True)[1].reshape(-1)
    idx = rng.integers(0, len(values), size=(n_bootstrap, k))
    drawn = codes[idx]  # (B, k) vote codes
    counts = np.zeros((n_bootstrap, int(codes.max()) + 1), dtype=np.int64)
    np.add.at(counts, (np.arange(n_bootstrap)[:, None], drawn), 1)
    is_top = counts == counts.max(axis=1, keepdims=True)  # (B, C) the tied majority votes
    first_top = np.argmax(np.take_along_axis(is_top, drawn, axis=1), axis=1)  # first draw holding a top vote
    picked = values[idx[np.arange(n_bootstrap), first_top]]
    return {f"maj@{k}/mean": float(picked.mean()), f"maj@{k}/std": float(picked.std())}


def process_validation_metrics(
    data_sources: list[str],
    scores: list[float],
    n: int,
    extra: dict[str, list] | None = None,
    uids: list[Any] | None = None,
    votes: list[Any] | None = None,
    n_bootstrap: int = 1000,
    seed: int = 42,
) -> dict[str, float]:
    """Validation metrics in verl's layout, per data source and per variable (`reward` = the score, plus
    every numeric field of `extra`), averaged over prompts (samples grouped by `uids`, else runs of `n`):

    - `{var}/mean@{n}`, and when n > 1 `{var}/std@{n}` and, for k in 2, 4, ..., n, bootstrapped
      `{var}/best@{k}/{mean,std}`, `{var}/worst@{k}/{mean,std}` and, with `votes` (e.g. the extracted answer,
      `pred`, or the response text), `{var}/maj@{k}/{mean,std}`;
    - names start with `val-core/{data_source}/` for the headline variable (`acc` if present, else `reward`)
      and the metrics mean@n, best@n/mean, maj@n/mean; everything else with `val-aux/{data_source}/`;
    - `val/reward/mean`: the mean score over all samples.
    """
    if uids is None:
        uids = [i // max(n, 1) for i in range(len(scores))]
    variables: dict[str, list[Any]] = {"reward": [float(s) for s in scores]}
    for name, values in (extra or {}).items():
        if len(values) == len(scores) and name not in ("reward", "pred") and any(_numeric(v) for v in values):
            variables[name] = list(values)
    if votes is None and extra is not None and len(extra.get("pred", [])) == len(scores):
        votes = list(extra["pred"])
    core_var = "acc" if "acc" in variables else "reward"
    groups: dict[tuple[str, Any], list[int]] = defaultdict(list)
    for i, (source, uid) in enumerate(zip(data_sources, uids)):
        groups[(source, uid)].append(i)
    rng = np.random.default_rng(seed)
    per_source: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for (source, _), rows in groups.items():
        for var, all_values in variables.items():
            keep = [i for i in rows if _numeric(all_values[i]) and math.isfinite(float(all_values[i]))]
            if not keep:
                continue
            values = np.asarray([float(all_values[i]) for i in keep])
            prompt_metrics = {f"mean@{n}": float(values.mean())}
            if n > 1:
                prompt_metrics[f"std@{n}"] = float(values.std())
                for k in subset_sizes(n):
                    prompt_metrics.update(bootstrap_best_worst(values, k, rng, n_bootstrap))
                    if votes is not None:
                        vote_keys = [votes[i] for i in keep]
                        prompt_metrics.update(bootstrap_majority(values, vote_keys, k, rng, n_bootstrap))
            for metric, value in prompt_metrics.items():
                per_source[source][f"{var}/{metric}"].append(value)
    metrics: dict[str, float] = {}
    core_names = {f"mean@{n}", f"best@{n}/mean", f"maj@{n}/mean"}
    for source, named in per_source.items():
        for name, values in named.items():
            var, metric = name.split("/", 1)
            section = "val-core" if var == core_var and metric in core_names else "val-aux"
            metrics[f"{section}/{source}/{name}"] = float(np.mean(values))
    metrics["val/reward/mean"] = float(np.mean(scores)) if len(scores) else float("nan")
    return metrics


def process_greedy_validation_metrics(
    data_sources: list[str], scores: list[float], extra: dict[str, list] | None = None
) -> dict[str, float]:
    """Metrics of one greedy answer per validation prompt (`trainer.val_greedy`), beside the sampled ones:

    - `val-core/{data_source}/{var}/greedy` for the headline variable (`acc` if the reward gives it, else
      `reward`) and `val-aux/{data_source}/{var}/greedy` for every other numeric field of `extra`: the mean over
      the data source's prompts;
    - `val/reward/greedy`: the mean score over all prompts.
    """
    variables: dict[str, list[Any]] = {"reward": [float(s) for s in scores]}
    for name, values in (extra or {}).items():
        if len(values) == len(scores) and name not in ("reward", "pred") and any(_numeric(v) for v in values):
            variables[name] = list(values)
    core_var = "acc" if "acc" in variables else "reward"
    metrics: dict[str, float] = {}
    for source in dict.fromkeys(data_sources):
        rows = [i for i, s in enumerate(data_sources) if s == source]
        for var, values in variables.items():
            kept = [float(values[i]) for i in rows if _numeric(values[i]) and math.isfinite(float(values[i]))]
            if kept:
                section = "val-core" if var == core_var else "val-aux"
                metrics[f"{section}/{source}/{var}/greedy"] = float(np.mean(kept))
    metrics["val/reward/greedy"] = float(np.mean(scores)) if len(scores) else float("nan")
    return metrics


def select_generations(inputs: list[str], outputs: list[str], scores: list[float], n: int, count: int) -> list[dict]:
    """The first sample of each of the first `count` prompts (the same prompts at every validation), as rows
    {input, output, score} for the generations table."""
    rows = []
    for i in range(0, min(len(outputs), count * max(n, 1)), max(n, 1)):
        rows.append({"input": inputs[i], "output": outputs[i], "score": float(scores[i])})
    return rows


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
            values = [float(v) for v in part.non_tensor_batch.get(key, []) if _numeric(v) and math.isfinite(float(v))]
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


def compute_val_correct_metrics(tags: list[Any], scores: list[float], thresholds: list[float]) -> dict[str, float]:
    """Validation accuracy as ROLL logs it: `val_correct/all/mean` (share of samples whose score >= their
    threshold) and `val_correct/{tag}/mean` per tag (the value of `data.val_tag_key`, default `data_source`)."""
    if not scores:
        return {}
    correct = [float(score >= threshold) for score, threshold in zip(scores, thresholds)]
    by_tag: dict[str, list[float]] = defaultdict(list)
    for tag, value in zip(tags, correct):
        by_tag[str(tag)].append(value)
    metrics = {"val_correct/all/mean": float(np.mean(correct))}
    metrics.update({f"val_correct/{tag}/mean": float(np.mean(values)) for tag, values in by_tag.items()})
    return metrics
