"""Validation metrics: verl's `process_validation_metrics` (per data source, prompt and variable: mean@n, std@n and
bootstrapped best/worst/maj@k), its helpers `bootstrap_metric` and `calc_maj_val`, and the trainer's flat layout of
them (`compute_validation_metrics`: `val-core/*`, `val-aux/*`), the greedy-answer metrics, the generations table
rows and ROLL's `val_correct/*`.

Layer 8 helper: plain lists and numpy, no DataProto.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

N_BOOTSTRAP = 1000  # verl's number of bootstrap draws per prompt, variable and k


def numeric_value(value: Any) -> float | None:
    """`value` as a float when it is a finite int or float (bool excluded), else None."""
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_)):
        return float(value) if math.isfinite(float(value)) else None
    return None


def _bootstrap_indices(n_data: int, subset_size: int, n_bootstrap: int, seed: int) -> np.ndarray:
    """(n_bootstrap, subset_size) draws with replacement from range(n_data): the ones verl draws after
    `np.random.seed(seed)`, from a generator of their own (the global numpy state is left alone)."""
    if n_data == 0:
        raise ValueError("bootstrap needs at least one data point, got none")
    return np.random.RandomState(seed).choice(n_data, size=(n_bootstrap, subset_size), replace=True)


def bootstrap_metric(
    data: list[Any],
    subset_size: int,
    reduce_fns: list[Callable[[np.ndarray], float]],
    n_bootstrap: int = N_BOOTSTRAP,
    seed: int = 42,
) -> list[tuple[float, float]]:
    """For each function of `reduce_fns`, the (mean, std) over `n_bootstrap` draws of `subset_size` items of
    `data` (with replacement) of the function applied to the draw (an object array). Empty `data` raises."""
    idx = _bootstrap_indices(len(data), subset_size, n_bootstrap, seed)
    items = np.empty(len(data), dtype=object)
    items[:] = list(data)
    results = [np.array([fn(items[row]) for row in idx], dtype=np.float64) for fn in reduce_fns]
    return [(float(r.mean()), float(r.std())) for r in results]


def calc_maj_val(data: list[dict[str, Any]], vote_key: str, val_key: str) -> float:
    """The `val_key` of the first item carrying the most frequent `vote_key` (ties: the vote met first)."""
    first_val: dict[Any, Any] = {}
    counts: dict[Any, int] = defaultdict(int)
    for item in data:
        first_val.setdefault(item[vote_key], item[val_key])
        counts[item[vote_key]] += 1
    return first_val[max(counts, key=counts.get)]


def _subset_sizes(n: int) -> list[int]:
    """verl's k of best@k / worst@k / maj@k: 2, 4, 8, ... below n, then n (none for n < 2)."""
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return sizes + [n] if n > 1 else []


def _bootstrap_prompt(values: np.ndarray, votes: list[Any] | None, k: int, seed: int) -> dict[str, float]:
    """best@k, worst@k and (with votes) maj@k of one prompt: `bootstrap_metric` with np.max, np.min and
    `calc_maj_val` on the same draws, computed on all draws at once."""
    idx = _bootstrap_indices(len(values), k, N_BOOTSTRAP, seed)
    drawn = values[idx]
    out = {}
    for name, picked in (("best", drawn.max(axis=1)), ("worst", drawn.min(axis=1))):
        out[f"{name}@{k}/mean"], out[f"{name}@{k}/std"] = float(picked.mean()), float(picked.std())
    if votes is not None:
        code_of: dict[Any, int] = {}
        codes = np.array([code_of.setdefault(v, len(code_of)) for v in votes])[idx]  # (B, k)
        counts = np.zeros((len(idx), len(code_of)), dtype=np.int64)
        np.add.at(counts, (np.arange(len(idx))[:, None], codes), 1)
        is_top = counts == counts.max(axis=1, keepdims=True)
        first = np.argmax(np.take_along_axis(is_top, codes, axis=1), axis=1)  # first draw with a top vote
        picked = drawn[np.arange(len(idx)), first]
        out[f"maj@{k}/mean"], out[f"maj@{k}/std"] = float(picked.mean()), float(picked.std())
    return out


def process_validation_metrics(
    data_sources: list[str],
    sample_uids: list[Any],
    infos_dict: dict[str, list[Any]],
    seed: int = 42,
    expected_acc_counts: dict[tuple[str, Any], int] | None = None,
) -> dict[str, dict[str, dict[str, float]]]:
    """{data_source: {variable: {metric: value}}}, each metric averaged over the source's prompts (samples with the
    same uid). Per prompt and variable of `infos_dict` (None values dropped; variables whose values are strings
    skipped) over its n values: `mean@n`; for n > 1 `std@n` and, for k in 2, 4, ..., n, `best@k/mean|std`,
    `worst@k/mean|std` (`bootstrap_metric`) and, when `infos_dict["pred"]` has a vote for every value,
    `maj@k/mean|std` (`calc_maj_val`).

    `expected_acc_counts` {(data_source, uid): sessions}: in the sources that report `acc`, the missing sessions of
    a prompt count as `acc` 0, and `acc_success_only` keeps the accuracy over the sessions that ran.
    """
    grouped: dict[str, dict[Any, dict[str, list]]] = {}
    for i, (source, uid) in enumerate(zip(data_sources, sample_uids)):
        per_var = grouped.setdefault(source, {}).setdefault(uid, defaultdict(list))
        for name, values in infos_dict.items():
            per_var[name].append(values[i])
    if expected_acc_counts:
        acc_sources = {
            source
            for source, prompts in grouped.items()
            if any(v is not None for per_var in prompts.values() for v in per_var.get("acc", []))
        }
        for (source, uid), expected in expected_acc_counts.items():
            if source in acc_sources:
                per_var = grouped[source].setdefault(uid, defaultdict(list))
                observed = [v for v in per_var.get("acc", []) if v is not None]
                per_var["acc_success_only"] = observed
                per_var["acc"] = observed + [0.0] * max(expected - len(observed), 0)
    result: dict[str, dict[str, dict[str, float]]] = {}
    for source, prompts in grouped.items():
        per_metric: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for per_var in prompts.values():
            preds = per_var.get("pred")
            for name, raw in per_var.items():
                kept = [v for v in raw if v is not None]
                if not kept or isinstance(kept[0], str):
                    continue
                values = np.asarray(kept, dtype=np.float64)
                n = len(values)
                votes = preds if preds is not None and len(preds) == n and all(p is not None for p in preds) else None
                metrics = {f"mean@{n}": float(values.mean())}
                if n > 1:
                    metrics[f"std@{n}"] = float(values.std())
                for k in _subset_sizes(n):
                    metrics.update(_bootstrap_prompt(values, votes, k, seed))
                for metric, value in metrics.items():
                    per_metric[name][metric].append(value)
        result[source] = {
            name: {metric: float(np.mean(v)) for metric, v in metrics.items()} for name, metrics in per_metric.items()
        }
    return result


def _numbers(values: list[Any]) -> list[float | None]:
    return [numeric_value(v) for v in values]


def _numeric_fields(extra: dict[str, list] | None, length: int) -> dict[str, list[float | None]]:
    """The reward's extra fields with a value per sample (besides `reward` and `pred`) and at least one number;
    values that are not finite numbers become None."""
    fields = {}
    for name, values in (extra or {}).items():
        numbers = _numbers(values) if len(values) == length else []
        if name not in ("reward", "pred") and any(v is not None for v in numbers):
            fields[name] = numbers
    return fields


def compute_validation_metrics(
    data_sources: list[str],
    scores: list[float],
    n: int,
    extra: dict[str, list] | None = None,
    uids: list[Any] | None = None,
    votes: list[Any] | None = None,
    seed: int = 42,
) -> dict[str, float]:
    """The trainer's validation metrics: `process_validation_metrics` of the variables `reward` (the scores) and
    every numeric field of `extra`, samples grouped by `uids` (else runs of `n`), majority votes from `votes`
    (else `extra["pred"]`), laid out as verl's trainer logs them: `val-core/{source}/{var}/{metric}` for the
    source's headline variable (`acc` if it has one, else `reward`) and its mean, best and maj metrics at the
    largest n, `val-aux/...` for everything else; plus `val/reward/mean`, the mean score over all samples."""
    if uids is None:
        uids = [i // max(n, 1) for i in range(len(scores))]
    infos: dict[str, list[Any]] = {"reward": _numbers(scores), **_numeric_fields(extra, len(scores))}
    if votes is None and extra is not None and len(extra.get("pred", [])) == len(scores):
        votes = list(extra["pred"])
    if votes is not None:
        infos["pred"] = [None if v is None else str(v) for v in votes]
    metrics: dict[str, float] = {}
    for source, per_var in process_validation_metrics(data_sources, uids, infos, seed=seed).items():
        core_var = "acc" if "acc" in per_var else "reward"
        for var, per_metric in per_var.items():
            n_max = max(int(name.split("@")[-1].split("/")[0]) for name in per_metric)
            for name, value in per_metric.items():
                core = var == core_var and name.startswith(("mean", "maj", "best")) and f"@{n_max}" in name
                metrics[f"{'val-core' if core else 'val-aux'}/{source}/{var}/{name}"] = value
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
    variables = {"reward": _numbers(scores), **_numeric_fields(extra, len(scores))}
    core_var = "acc" if "acc" in variables else "reward"
    metrics: dict[str, float] = {}
    for source in dict.fromkeys(data_sources):
        rows = [i for i, s in enumerate(data_sources) if s == source]
        for var, values in variables.items():
            kept = [values[i] for i in rows if values[i] is not None]
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
