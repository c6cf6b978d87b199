"""Multi-domain training data (ROLL's RLVR pipeline): `data.domains` and `data.domain_interleave_probs`.

Owns the domain config and its checks (`DomainSpec`, `parse_domains`), the split of each step's batch across
domains (`split_batch_size`, largest remainder), one sampler per domain with its own saved state (`DomainSampler`:
a permutation seeded by data.seed, domain name and domain epoch, so a resumed run continues every domain where it
stopped) and `MultiDomainDataset` / `build_domain_datasets`. A domain's `reward` is a reward worker type or a data
source of `default_compute_score`. Layer 8 helper: no Ray, no models.
"""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from verl.utils.reward_score.reward_types import REWARD_TYPES, reward_type_of

__all__ = [
    "NORM_MODES",
    "DomainSampler",
    "DomainSpec",
    "MultiDomainDataset",
    "build_domain_datasets",
    "check_processing",
    "correct_thresholds",
    "parse_domains",
    "split_batch_size",
]

NORM_MODES = (None, "group", "batch", "running")
DOMAIN_KEYS = (
    "train_files",
    "val_files",
    "reward",
    "weight",
    "reward_norm",
    "reward_clip",
    "reward_scale",
    "correct_threshold",
)


@dataclass(frozen=True)
class DomainSpec:
    """One domain: its files, how its responses are scored, and how its rewards are processed."""

    name: str
    train_files: tuple[str, ...]
    val_files: tuple[str, ...]
    reward_type: str  # one of REWARD_TYPES
    data_source: str | None  # the data source every row is scored as (when `reward` named one), else None
    weight: float = 1.0
    reward_norm: str | None = None
    reward_clip: float | None = None
    reward_scale: float = 1.0
    correct_threshold: float = 1.0


def _files(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(str(v) for v in value)


def _number(value: Any, where: str, minimum: float | None = None, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}={value!r} must be a finite number")
    if minimum is not None and value < minimum:
        raise ValueError(f"{where}={value!r} must be >= {minimum}")
    return float(value)


def check_processing(values: Mapping, where: str) -> None:
    """reward_norm / reward_clip / reward_scale / weight of `values` (a domain or the algorithm section)."""
    norm = values.get("reward_norm")
    if norm not in NORM_MODES:
        raise ValueError(f"{where}.reward_norm={norm!r}; allowed: null, group, batch, running")
    clip = values.get("reward_clip")
    if clip is not None and _number(clip, f"{where}.reward_clip") <= 0:
        raise ValueError(f"{where}.reward_clip={clip!r} must be > 0 (rewards are clipped to [-c, c]) or null")
    for key in ("reward_scale", "weight", "correct_threshold"):
        if values.get(key) is not None:
            _number(values.get(key), f"{where}.{key}")


def _domain_spec(name: str, entry: Any, defaults: Mapping, check_files: bool) -> DomainSpec:
    where = f"data.domains.{name}"
    if not isinstance(entry, Mapping):
        raise ValueError(f"{where} must be a mapping with train_files and reward, got {entry!r:.200}")
    unknown = sorted(set(entry) - set(DOMAIN_KEYS))
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}; allowed: {list(DOMAIN_KEYS)}")
    train_files = _files(entry.get("train_files"))
    if not train_files:
        raise ValueError(f"{where}.train_files is missing; every domain needs its own training parquet file(s)")
    val_files = _files(entry.get("val_files"))
    if check_files:
        for key, files in (("train_files", train_files), ("val_files", val_files)):
            for path in files:
                if not os.path.isfile(path):
                    raise FileNotFoundError(f"{where}.{key}: no such file {path!r}")
    if entry.get("reward") is None:
        raise ValueError(f"{where}.reward is missing; allowed: a worker type {list(REWARD_TYPES)} or a data source")
    reward_type, data_source = reward_type_of(entry["reward"], f"{where}.reward")
    check_processing(entry, where)
    merged = {key: entry.get(key) if entry.get(key) is not None else defaults.get(key) for key in DOMAIN_KEYS}
    return DomainSpec(
        name=name,
        train_files=train_files,
        val_files=val_files,
        reward_type=reward_type,
        data_source=data_source,
        weight=float(merged["weight"] if merged["weight"] is not None else 1.0),
        reward_norm=merged["reward_norm"],
        reward_clip=None if merged["reward_clip"] is None else float(merged["reward_clip"]),
        reward_scale=float(merged["reward_scale"] if merged["reward_scale"] is not None else 1.0),
        correct_threshold=float(merged["correct_threshold"] if merged["correct_threshold"] is not None else 1.0),
    )


def _check_probs(probs: Mapping, names: list[str]) -> dict[str, float]:
    unknown = [name for name in probs if name not in names]
    if unknown:
        raise ValueError(f"data.domain_interleave_probs names {unknown}, which are not in data.domains {names}")
    missing = [name for name in names if name not in probs]
    if missing:
        raise ValueError(f"data.domain_interleave_probs has no probability for domain(s) {missing}")
    out = {name: _number(probs[name], f"data.domain_interleave_probs.{name}", minimum=0.0) for name in names}
    total = sum(out.values())
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"data.domain_interleave_probs must sum to 1, got {total:.6g} ({dict(probs)})")
    return out


def parse_domains(config: Any, check_files: bool = True) -> tuple[list[DomainSpec], dict[str, float]] | None:
    """The checked domains and their probabilities from `config.data`; None when `data.domains` is empty.

    Raises one clear ValueError (FileNotFoundError for a missing file) on: probabilities that do not sum to 1,
    a probability for an unknown domain or a domain without one, a domain without train_files or reward, an
    unknown reward, a bad processing value. Runs before Ray starts.
    """
    data = config.get("data") or {}
    domains = data.get("domains") or {}
    probs = data.get("domain_interleave_probs") or {}
    if not domains:
        if probs:
            raise ValueError(f"data.domain_interleave_probs={dict(probs)} is set but data.domains is empty")
        return None
    from verl.trainer.config import default_of

    for key in ("train_files", "val_files"):
        if data.get(key) and data.get(key) != default_of(f"data.{key}"):  # verl's default path counts as unset
            raise ValueError(
                f"data.{key} is set together with data.domains; with domains, give the files per domain "
                f"(data.domains.<name>.{key}) and leave data.{key} unset"
            )
    if not isinstance(domains, Mapping):
        raise ValueError(f"data.domains must map domain names to settings, got {domains!r:.200}")
    algorithm = config.get("algorithm") or {}
    reward = config.get("reward") or {}
    check_processing(algorithm, "algorithm")
    defaults = {
        "reward_norm": algorithm.get("reward_norm"),
        "reward_clip": algorithm.get("reward_clip"),
        "reward_scale": algorithm.get("reward_scale"),
        "correct_threshold": reward.get("correct_threshold"),
    }
    names = [str(name) for name in domains]
    specs = [_domain_spec(name, domains[name], defaults, check_files) for name in names]
    return specs, _check_probs(probs, names)


def correct_thresholds(config: Any, domain_column: Sequence | None, size: int) -> list[float]:
    """Each row's `correct_threshold` (score >= it counts as correct): its domain's when `domain_column` is given,
    else `reward.correct_threshold` (default 1.0)."""
    default = (config.get("reward") or {}).get("correct_threshold")
    default = 1.0 if default is None else float(default)
    parsed = parse_domains(config, check_files=False)
    if domain_column is None or parsed is None:
        return [default] * size
    by_domain = {spec.name: spec.correct_threshold for spec in parsed[0]}
    return [by_domain.get(domain, default) for domain in domain_column]


def split_batch_size(probs: Mapping[str, float], total: int) -> dict[str, int]:
    """Prompts per domain for a batch of `total`: floor(p * total) each, then one more for the domains with the
    largest remainders (ties: config order) until the counts sum to `total` exactly."""
    exact = {name: p * total for name, p in probs.items()}
    counts = {name: math.floor(value + 1e-9) for name, value in exact.items()}
    left = total - sum(counts.values())
    by_remainder = sorted(exact, key=lambda name: -(exact[name] - counts[name]))  # stable: config order on ties
    for name in by_remainder[:left]:
        counts[name] += 1
    return counts


def _domain_order(num_rows: int, epoch: int, seed: int, name: str, shuffle: bool) -> list[int]:
    if not shuffle:
        return list(range(num_rows))
    domain_seed = (int(seed) * 1_000_003 + zlib.crc32(name.encode("utf-8"))) * 100_003 + int(epoch)
    generator = torch.Generator().manual_seed(domain_seed % (2**63))
    return torch.randperm(num_rows, generator=generator).tolist()


class DomainSampler:
    """One resumable row order per domain: `draw({domain: k})` hands out each domain's next k rows, continuing into
    the domain's next epoch (a new permutation) when its current one runs out.

    State: `{"batches": batches drawn, "domains": {name: {"epoch", "position", "num_rows"}}}`.
    """

    def __init__(self, sizes: Mapping[str, int], quotas: Mapping[str, int], seed: int = 1, shuffle: bool = True):
        for name, size in sizes.items():
            if quotas.get(name, 0) > size:
                raise ValueError(
                    f"domain {name!r} has {size} training prompts, fewer than its share {quotas[name]} of "
                    "data.train_batch_size; add data or lower its data.domain_interleave_probs"
                )
        self.sizes = dict(sizes)
        self.quotas = dict(quotas)
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.epochs = {name: 0 for name in sizes}
        self.positions = {name: 0 for name in sizes}
        self.batches = 0

    def _take(self, name: str, count: int) -> list[int]:
        rows: list[int] = []
        while len(rows) < count:
            order = _domain_order(self.sizes[name], self.epochs[name], self.seed, name, self.shuffle)
            start = self.positions[name]
            piece = order[start : start + count - len(rows)]
            rows.extend(piece)
            self.positions[name] = start + len(piece)
            if self.positions[name] >= self.sizes[name]:
                self.epochs[name] += 1
                self.positions[name] = 0
        return rows

    def draw(self, counts: Mapping[str, int] | None = None) -> dict[str, list[int]]:
        """`{domain: local rows}` for `counts` (default: one batch, the quotas); domains in config order."""
        if counts is None:
            counts = self.quotas
            self.batches += 1
        return {name: self._take(name, int(counts[name])) for name in self.sizes if counts.get(name, 0) > 0}

    def state_dict(self) -> dict[str, Any]:
        return {
            "batches": self.batches,
            "domains": {
                name: {"epoch": self.epochs[name], "position": self.positions[name], "num_rows": self.sizes[name]}
                for name in self.sizes
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = state["domains"]
        if sorted(saved) != sorted(self.sizes):
            raise ValueError(
                f"the checkpoint's domains {sorted(saved)} differ from data.domains {sorted(self.sizes)}; "
                "resume with the same domains or start a new run (trainer.resume_mode=disable)"
            )
        for name, entry in saved.items():
            if int(entry["num_rows"]) != self.sizes[name]:
                raise ValueError(
                    f"domain {name!r} had {entry['num_rows']} training prompts when the checkpoint was saved and has "
                    f"{self.sizes[name]} now; resume with the same data files"
                )
            self.epochs[name], self.positions[name] = int(entry["epoch"]), int(entry["position"])
        self.batches = int(state.get("batches", 0))


class MultiDomainDataset:
    """The datasets of all domains side by side: global row = the domain's offset + its local row. Every item gets
    a `domain` column, and the keys any domain has (None where a domain lacks one), so domains batch together."""

    def __init__(self, datasets: Mapping[str, Any]):
        if not datasets:
            raise ValueError("MultiDomainDataset needs at least one domain")
        self.datasets = dict(datasets)
        self.offsets: dict[str, int] = {}
        offset = 0
        for name, dataset in self.datasets.items():
            if len(dataset) == 0:
                raise ValueError(f"domain {name!r} has no prompts (after filtering overlong ones)")
            self.offsets[name] = offset
            offset += len(dataset)
        self._length = offset
        keys: dict[str, None] = {}
        for dataset in self.datasets.values():
            keys.update(dict.fromkeys(dataset[0]))
        self.keys = list(keys) + ["domain"]

    def __len__(self) -> int:
        return self._length

    def sizes(self) -> dict[str, int]:
        return {name: len(dataset) for name, dataset in self.datasets.items()}

    def locate(self, row: int) -> tuple[str, int]:
        """(domain, local row) of a global row."""
        if not 0 <= row < self._length:
            raise IndexError(f"row {row} out of range for {self._length} prompts")
        for name, offset in reversed(self.offsets.items()):
            if row >= offset:
                return name, row - offset
        raise IndexError(row)  # unreachable: offsets start at 0

    def global_rows(self, local: Mapping[str, list[int]]) -> list[int]:
        """Global rows of `{domain: local rows}`, domains in the given order."""
        return [self.offsets[name] + row for name, rows in local.items() for row in rows]

    def __getitem__(self, row: int) -> dict[str, Any]:
        name, local = self.locate(int(row))
        item = dict(self.datasets[name][local])
        item = {key: item.get(key) for key in self.keys}
        item["domain"] = name
        return item


def build_domain_datasets(
    specs: list[DomainSpec], tokenizer: Any, data_config: Any
) -> tuple[MultiDomainDataset, MultiDomainDataset | None]:
    """(training set, validation set or None): one RLHFDataset per domain's files, side by side."""
    from verl.utils.dataset.rl_dataset import RLHFDataset

    train = MultiDomainDataset(
        {spec.name: RLHFDataset(list(spec.train_files), tokenizer, data_config) for spec in specs}
    )
    val_sets = {
        spec.name: RLHFDataset(list(spec.val_files), tokenizer, data_config) for spec in specs if spec.val_files
    }
    return train, (MultiDomainDataset(val_sets) if val_sets else None)
