"""Reward workers of the multi-domain RLVR pipeline (ROLL's reward clusters): one group of Ray actors per reward type.

Owns `RewardWorker`, `RewardWorkerGroup` (`reward.{type}.num_workers` actors, contiguous chunks), `DomainRewardFn`
(routes rows by their `domain` column, results in the original order), `RewardWorkerPool` and
`check_reward_config`. `reward.{type}.score_kwargs` go to every score call; actors reserve no Ray CPUs.
Layer 7.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import ray
import torch

from verl.protocol import DataProto
from verl.utils.reward_score.reward_types import make_compute_score
from verl.utils.system_metrics import prefixed, process_metrics
from verl.workers.reward_manager import NaiveRewardManager

__all__ = [
    "DomainRewardFn",
    "RewardWorker",
    "RewardWorkerGroup",
    "RewardWorkerPool",
    "check_reward_config",
]


def check_reward_config(config: Any, types: list[str]) -> None:
    """`reward.{type}.num_workers` must be a positive int and `score_kwargs` a mapping, for the types in use; the
    single-data-set reward settings the workers would ignore (a custom reward function, another manager) are errors."""
    reward = config.get("reward") or {}
    custom_path = _first_set(
        (reward.get("custom_reward_function") or {}).get("path"),
        (config.get("custom_reward_function") or {}).get("path"),  # a config not passed through prepare_config
    )
    if custom_path is not None:
        raise ValueError(
            "reward.custom_reward_function.path is set together with data.domains; domains are scored by their "
            "reward worker type (data.domains.<name>.reward), so drop one of the two"
        )
    manager = reward.get("reward_manager") or (config.get("reward_model") or {}).get("reward_manager") or "naive"
    manager = (manager.get("name") or "naive") if isinstance(manager, Mapping) else manager
    if manager != "naive":
        raise ValueError(
            f"reward.reward_manager.name={manager!r} with data.domains: the reward workers score with the naive "
            "manager; use reward.reward_manager.name=naive (and algorithm.overlong_mask for overlong responses)"
        )
    for reward_type in types:
        section = reward.get(reward_type) or {}
        workers = section.get("num_workers", 1)
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"reward.{reward_type}.num_workers={workers!r} must be a positive integer")
        kwargs = section.get("score_kwargs") or {}
        if not isinstance(kwargs, Mapping):
            raise ValueError(
                f"reward.{reward_type}.score_kwargs must be a mapping of keyword arguments, got {kwargs!r}"
            )


_TENSOR_KEYS = ("responses", "response_mask", "attention_mask", "rm_scores")
_NON_TENSOR_KEYS = ("domain", "reward_model", "extra_info", "index")


class RewardWorker:
    """One scoring process: decodes responses and scores them with its reward type (naive reward manager)."""

    def __init__(
        self,
        reward_type: str,
        tokenizer_path: str,
        score_kwargs: Mapping[str, Any] | None = None,
        reward_fn_key: str = "data_source",
        on_error: str = "raise",
        trust_remote_code: bool = False,
        timeout_s: float | None = None,
    ) -> None:
        from verl.utils.tokenizer import hf_tokenizer

        self.reward_type = reward_type
        tokenizer = hf_tokenizer(tokenizer_path, trust_remote_code=trust_remote_code)
        self.manager = NaiveRewardManager(
            tokenizer,
            num_examine=0,
            # bound to the scorer, not given to the manager: a scorer keyword such as the sandbox's timeout_s must
            # not be taken for the manager's own timeout_s (reward_model.timeout_s)
            compute_score=make_compute_score(reward_type, **dict(score_kwargs or {})),
            reward_fn_key=reward_fn_key,
            on_error=on_error,
            timeout_s=timeout_s,
        )
        process_metrics()  # start the CPU clock

    def ready(self) -> str:
        return self.reward_type

    def compute_reward(self, data: DataProto, num_examine: int = 0) -> dict[str, Any]:
        """`{"reward_tensor": (bs, response_length), "reward_extra_info": {key: [per row]}}` of `data`."""
        self.manager.num_examine = int(num_examine)
        return self.manager(data, return_dict=True)

    def system_metrics(self) -> dict[str, float]:
        return process_metrics()


class RewardWorkerGroup:
    """`num_workers` RewardWorker actors of one reward type; `submit` cuts a batch into contiguous chunks, one each."""

    def __init__(self, reward_type: str, num_workers: int, **worker_kwargs: Any) -> None:
        remote_cls = ray.remote(num_cpus=0)(RewardWorker)
        self.reward_type = reward_type
        self.workers = [remote_cls.remote(reward_type, **worker_kwargs) for _ in range(int(num_workers))]

    def wait_ready(self) -> None:
        ray.get([worker.ready.remote() for worker in self.workers])

    def submit(self, data: DataProto, num_examine: int = 0) -> list[tuple[np.ndarray, ray.ObjectRef]]:
        """(rows of `data`, future of their result) per chunk; at most one chunk per worker, none empty."""
        chunks = [rows for rows in np.array_split(np.arange(len(data)), len(self.workers)) if len(rows)]
        return [
            (rows, worker.compute_reward.remote(data[rows], num_examine if i == 0 else 0))
            for i, (rows, worker) in enumerate(zip(chunks, self.workers))
        ]

    def system_metrics(self) -> dict[str, float]:
        results = ray.get([worker.system_metrics.remote() for worker in self.workers])
        out: dict[str, float] = {}
        for i, metrics in enumerate(results):
            out.update(prefixed(f"reward_{self.reward_type}_{i}", metrics))
        return out


class DomainRewardFn:
    """A reward manager over the worker groups: rows go to the group of their domain's reward type (all groups at
    once), a domain whose `reward` named a data source is scored as that source, and the scores and extra fields
    come back in the batch's row order (extra fields a row's type does not produce are None)."""

    def __init__(
        self,
        groups: Mapping[str, RewardWorkerGroup],
        routes: Mapping[str, tuple[str, str | None]],
        reward_fn_key: str = "data_source",
        num_examine: int = 0,
    ) -> None:
        self.groups, self.routes = dict(groups), dict(routes)
        self.reward_fn_key, self.num_examine = reward_fn_key, int(num_examine)

    def _rows_by_type(self, data: DataProto) -> dict[str, list[int]]:
        if "domain" not in data.non_tensor_batch:
            raise KeyError("the multi-domain reward needs non_tensor_batch['domain'] (set by MultiDomainDataset)")
        rows: dict[str, list[int]] = {}
        for row, domain in enumerate(data.non_tensor_batch["domain"]):
            if domain not in self.routes:
                raise KeyError(f"row {row} has domain {domain!r}, not one of data.domains {sorted(self.routes)}")
            rows.setdefault(self.routes[domain][0], []).append(row)
        return rows

    def _part(self, data: DataProto, rows: list[int]) -> DataProto:
        """The rows' fields a reward manager reads (not the prompts' token ids), data sources forced by domain."""
        tensors = [key for key in _TENSOR_KEYS if key in data.batch.keys()]
        non_tensors = [key for key in (*_NON_TENSOR_KEYS, self.reward_fn_key) if key in data.non_tensor_batch]
        part = data.select(batch_keys=tensors, non_tensor_batch_keys=list(dict.fromkeys(non_tensors)))[np.array(rows)]
        domains = part.non_tensor_batch["domain"]
        if any(self.routes[d][1] for d in domains):
            sources = part.non_tensor_batch[self.reward_fn_key].copy()
            for i, domain in enumerate(domains):
                sources[i] = self.routes[domain][1] or sources[i]
            part.non_tensor_batch[self.reward_fn_key] = sources
        return part

    def __call__(self, data: DataProto, return_dict: bool = False) -> torch.Tensor | dict[str, Any]:
        responses = data.batch["responses"]
        if "rm_scores" in data.batch.keys():
            tensor = data.batch["rm_scores"]
            return {"reward_tensor": tensor, "reward_extra_info": {}} if return_dict else tensor
        futures = []
        for reward_type, rows in self._rows_by_type(data).items():
            for chunk_rows, ref in self.groups[reward_type].submit(self._part(data, rows), self.num_examine):
                futures.append((np.asarray(rows)[chunk_rows], ref))
        results = ray.get([ref for _, ref in futures])
        tensor = torch.zeros(responses.shape, dtype=torch.float32)
        extra: dict[str, list[Any]] = {}
        for (rows, _), result in zip(futures, results):
            tensor[torch.as_tensor(rows)] = result["reward_tensor"].float()
            for key, values in result["reward_extra_info"].items():
                column = extra.setdefault(key, [None] * len(data))
                for row, value in zip(rows, values):
                    column[row] = value
        tensor = tensor.to(responses.device)
        return {"reward_tensor": tensor, "reward_extra_info": extra} if return_dict else tensor


def _first_set(*values: Any) -> Any:
    """The first value that is not None (verl 0.9.1's `reward.*` key, then the legacy `reward_model.*` one)."""
    return next((v for v in values if v is not None), None)


class RewardWorkerPool:
    """The reward worker groups of a multi-domain run, one per reward type its domains use."""

    def __init__(self, config: Any, specs: list[Any], tokenizer_path: str) -> None:
        types = list(dict.fromkeys(spec.reward_type for spec in specs))
        check_reward_config(config, types)
        reward = config.get("reward") or {}
        reward_model = config.get("reward_model") or {}
        self.reward_fn_key = (config.get("data") or {}).get("reward_fn_key", "data_source")
        self.routes = {spec.name: (spec.reward_type, spec.data_source) for spec in specs}
        self.groups = {
            reward_type: RewardWorkerGroup(
                reward_type,
                (reward.get(reward_type) or {}).get("num_workers", 1),
                tokenizer_path=tokenizer_path,
                score_kwargs=dict((reward.get(reward_type) or {}).get("score_kwargs") or {}),
                reward_fn_key=self.reward_fn_key,
                on_error=reward.get("on_error") or reward_model.get("on_error") or "raise",
                timeout_s=_first_set(reward.get("timeout_s"), reward_model.get("timeout_s")),
                trust_remote_code=bool(config.actor_rollout_ref.model.get("trust_remote_code", False)),
            )
            for reward_type in types
        }

    def wait_ready(self) -> None:
        for group in self.groups.values():
            group.wait_ready()

    def reward_fn(self, num_examine: int = 0) -> DomainRewardFn:
        return DomainRewardFn(self.groups, self.routes, self.reward_fn_key, num_examine)

    def system_metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for group in self.groups.values():
            out.update(group.system_metrics())
        return out
