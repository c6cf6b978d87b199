"""Rollout workflows (AReaL-lite): `RolloutWorkflow`, `rollout_batch`, and the rows a workflow returns.

`RolloutWorkflow.arun_episode(engine, data) -> DataProto | None` turns one row of the generation batch into one
training row (an `EpisodeRow`; AReaL-style TensorDict results are converted by `episode_rows.py`) or None, which
rejects it. `rollout_batch` runs every row's episode concurrently on an `AsyncRolloutEngine` (`run_batch` when all
rows share one generate call) and returns one row per input with `rollout_accepted`. Row builders:
`single_turn_row(s)`, `trajectory_row`; `drop_rejected_rows` is the trainer's rule. Every accepted row carries
exactly the rollout fields plus the workflow's `extra_output_keys`, so all ranks' rows concatenate.
Layer 5: must not import Ray.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import os
import sys
from collections import Counter
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from verl.protocol import DataProto
from verl.workers.rollout.async_engine import AsyncRolloutEngine, ModelResponse, batching_options, run_sync
from verl.workers.rollout.base import build_rollout_output, pad_responses
from verl.workers.rollout.workflows.episode_rows import EpisodeRow, training_row

__all__ = [
    "ROLLOUT_FIELDS",
    "RolloutWorkflow",
    "arollout_batch",
    "drop_rejected_rows",
    "load_callable",
    "prompt_ids_of",
    "rollout_batch",
    "single_turn_row",
    "single_turn_rows",
    "trajectory_row",
]

ROLLOUT_FIELDS = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask")
ACCEPTED_KEY = "rollout_accepted"
_EXTRA_KINDS = ("response", "scalar", "object")


class RolloutWorkflow:
    """How one sample becomes one training row. Subclass it and implement `arun_episode`.

    config: the `actor_rollout_ref.rollout` section; tokenizer: the policy's tokenizer; keyword arguments
    come from `rollout.workflow_kwargs`.

    extra_output_keys: fields an accepted row adds beyond the rollout fields, name -> kind: "response"
    (a float tensor (1, response_length)), "scalar" (a float tensor (1,)) or "object" (a non-tensor field).
    Rows with a `token_level_scores` field are not re-scored by the trainer's reward function.
    """

    extra_output_keys: dict[str, str] = {}

    def __init__(self, config: Any, tokenizer: Any, **kwargs: Any):
        if kwargs:
            raise TypeError(
                f"workflow {type(self).__name__} got unknown rollout.workflow_kwargs {sorted(kwargs)}; it takes none"
            )
        self.config = config
        self.tokenizer = tokenizer

    async def arun_episode(self, engine: AsyncRolloutEngine, data: DataProto) -> DataProto | None:
        """One training row for the one-row `data`, or None to reject the sample."""
        raise NotImplementedError

    def run_batch(self, engine: AsyncRolloutEngine, data: DataProto) -> DataProto | None:
        """Optional: every row's training row at once, when all rows' episodes run in one batch (no concurrency
        cap, an engine that takes them in one generate call). It must give exactly the rows `arun_episode` on each
        row would, all accepted. None (the default): the episodes run row by row."""
        return None


def load_callable(spec: str) -> Any:
    """The object named by `spec`: "pkg.module:name", "pkg.module.name" or "path/to/file.py:name"."""
    module_name, _, attr = spec.rpartition(":") if ":" in spec else spec.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{spec!r} is not a dotted path like 'pkg.module:name' or 'file.py:name'")
    if module_name.endswith(".py"):
        if not os.path.isfile(module_name):
            raise FileNotFoundError(f"{spec!r}: {module_name} is not a file")
        name = "verl_user_" + hashlib.sha1(os.path.abspath(module_name).encode()).hexdigest()[:12]
        module = sys.modules.get(name)
        if module is None:
            file_spec = importlib.util.spec_from_file_location(name, module_name)
            module = importlib.util.module_from_spec(file_spec)
            sys.modules[name] = module
            file_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    if not hasattr(module, attr):
        raise AttributeError(f"{spec!r}: {module_name} has no attribute {attr!r}")
    return getattr(module, attr)


# ----------------------------------------------------------------------------------------------- rows
def prompt_ids_of(data: DataProto) -> list[int]:
    """The unpadded prompt ids of a one-row DataProto."""
    ids, mask = data.batch["input_ids"][0], data.batch["attention_mask"][0]
    return ids[mask.bool()].tolist()


def _prompt_part(data: DataProto) -> DataProto:
    return data.select(batch_keys=["input_ids", "attention_mask", "position_ids"])


def _want_log_probs(engine: AsyncRolloutEngine) -> bool:
    return bool(engine.config.get("calculate_log_probs", False))


def single_turn_row(engine: AsyncRolloutEngine, data: DataProto, resp: ModelResponse) -> DataProto:
    """The row `generate_sequences` would give for `data` with `resp` as its response (same fields and
    values: response cut after the first eos unless `rollout.ignore_eos`, `rollout_log_probs` only with
    `rollout.calculate_log_probs`)."""
    return single_turn_rows(engine, data, [resp])


def single_turn_rows(engine: AsyncRolloutEngine, data: DataProto, resps: list[ModelResponse]) -> DataProto:
    """`single_turn_row` of every row of `data` at once (`resps[i]` is row i's response), built in one go."""
    responses = pad_responses([torch.tensor(r.output_tokens, dtype=torch.long) for r in resps],
                              engine.response_length, engine.pad_token_id)  # fmt: skip
    log_probs = None
    if _want_log_probs(engine):
        log_probs = torch.zeros(responses.shape, dtype=torch.float32)
        for i, resp in enumerate(resps):
            log_probs[i, : len(resp.output_logprobs)] = torch.tensor(resp.output_logprobs, dtype=torch.float32)
    # with rollout.ignore_eos every generated token is in the response, as the engine's own rows have it
    stop_ids = [] if engine.config.get("ignore_eos", False) else engine.eos_token_id
    return build_rollout_output(_prompt_part(data), responses, stop_ids, engine.pad_token_id, log_probs)


def trajectory_row(
    engine: AsyncRolloutEngine,
    data: DataProto,
    response_ids: list[int],
    loss_mask: list[int],
    log_probs: list[float] | None = None,
) -> DataProto:
    """A row whose response is a token trajectory (model turns and tool/observation tokens).

    response_ids, loss_mask, log_probs: one entry per response token (loss_mask 1 on model-generated
    tokens, 0 on tokens the environment inserted); cut to `rollout.response_length`, then right-padded.
    Fields: `responses`, `response_mask` = loss mask, `attention_mask` (prompt mask ++ 1 on every response
    token), `input_ids`, `position_ids` (continuing from the prompt), `prompts`, and `rollout_log_probs`
    (0 where the loss mask is 0) with `rollout.calculate_log_probs`. Non-tensor fields pass through.
    """
    if len(loss_mask) != len(response_ids) or (log_probs is not None and len(log_probs) != len(response_ids)):
        raise ValueError(
            f"trajectory lengths differ: {len(response_ids)} ids, {len(loss_mask)} mask values, "
            f"{None if log_probs is None else len(log_probs)} log-probs"
        )
    length = engine.response_length
    n = min(len(response_ids), length)
    prompt_ids = data.batch["input_ids"]
    prompt_mask = data.batch["attention_mask"]
    prompt_pos = data.batch["position_ids"]
    responses = torch.full((1, length), engine.pad_token_id, dtype=prompt_ids.dtype)
    responses[0, :n] = torch.tensor(response_ids[:n], dtype=prompt_ids.dtype)
    attended = torch.zeros((1, length), dtype=prompt_mask.dtype)
    attended[0, :n] = 1
    response_mask = torch.zeros((1, length), dtype=prompt_mask.dtype)
    response_mask[0, :n] = torch.tensor([1 if m else 0 for m in loss_mask[:n]], dtype=prompt_mask.dtype)
    delta = torch.arange(1, length + 1, dtype=prompt_pos.dtype)
    tensors = {
        "prompts": prompt_ids,
        "responses": responses,
        "input_ids": torch.cat([prompt_ids, responses], dim=-1),
        "attention_mask": torch.cat([prompt_mask, attended], dim=-1),
        "position_ids": torch.cat([prompt_pos, prompt_pos[:, -1:] + delta.unsqueeze(0)], dim=-1),
        "response_mask": response_mask,
    }
    if _want_log_probs(engine):
        lps = torch.zeros((1, length), dtype=torch.float32)
        if log_probs is not None and n:
            lps[0, :n] = torch.tensor(log_probs[:n], dtype=torch.float32)
        tensors["rollout_log_probs"] = lps * response_mask
    return DataProto.from_dict(tensors=tensors, non_tensors=dict(data.non_tensor_batch))


def _placeholder_row(engine: AsyncRolloutEngine, data: DataProto, extra_output_keys: dict[str, str]) -> DataProto:
    """The row standing in for a rejected sample: empty response, zeros/None for the extra keys."""
    row = trajectory_row(engine, data, [], [], None)
    for key, kind in extra_output_keys.items():
        if kind == "response":
            row.batch[key] = torch.zeros((1, engine.response_length), dtype=torch.float32)
        elif kind == "scalar":
            row.batch[key] = torch.zeros((1,), dtype=torch.float32)
        else:
            row.non_tensor_batch[key] = np.array([None], dtype=object)
    return row


def _check_row(row: Any, data: DataProto, workflow: RolloutWorkflow, engine: AsyncRolloutEngine, index: int):
    """A workflow's accepted row must be one row with exactly the expected fields (see the module docstring)."""
    name = type(workflow).__name__
    if not isinstance(row, DataProto) or len(row) != 1 or row.batch is None:
        seen = f"{len(row)} rows" if isinstance(row, DataProto) else type(row).__name__
        raise TypeError(f"{name}.arun_episode must return a one-row DataProto or None; row {index} gave {seen}")
    for kind in workflow.extra_output_keys.values():
        if kind not in _EXTRA_KINDS:
            raise ValueError(f"{name}.extra_output_keys: kind {kind!r} is not one of {_EXTRA_KINDS}")
    want = set(ROLLOUT_FIELDS) | {k for k, v in workflow.extra_output_keys.items() if v != "object"}
    if _want_log_probs(engine):
        want.add("rollout_log_probs")
    have = set(row.batch.keys())
    if have != want:
        raise KeyError(
            f"{name}.arun_episode row {index}: tensor fields {sorted(have)}, expected {sorted(want)} "
            "(rollout fields, rollout_log_probs with rollout.calculate_log_probs, and extra_output_keys)"
        )
    if row.batch["responses"].shape[-1] != engine.response_length:
        raise ValueError(
            f"{name}.arun_episode row {index}: responses have {row.batch['responses'].shape[-1]} columns, "
            f"expected rollout.response_length={engine.response_length}"
        )
    if row.batch["prompts"].shape[-1] != data.batch["input_ids"].shape[-1]:
        raise ValueError(f"{name}.arun_episode row {index}: the prompt part must keep the input's padded width")
    want_objects = set(data.non_tensor_batch) | {k for k, v in workflow.extra_output_keys.items() if v == "object"}
    if set(row.non_tensor_batch) != want_objects:
        raise KeyError(
            f"{name}.arun_episode row {index}: non-tensor fields {sorted(row.non_tensor_batch)}, expected "
            f"{sorted(want_objects)} (the input row's plus extra_output_keys of kind 'object')"
        )


# ----------------------------------------------------------------------------------------------- running
async def arollout_batch(
    engine: AsyncRolloutEngine, data: DataProto, workflow: RolloutWorkflow, max_concurrent: int | None = None
) -> DataProto:
    """Run one episode per row of `data` concurrently (at most `max_concurrent` at once; None = all), or all rows
    in one go by `workflow.run_batch` when it builds them and they would share one generate call anyway.

    Returns one row per input row, in order, with `rollout_accepted` (bs,) bool, and an empty meta_info.
    """
    if max_concurrent is not None and int(max_concurrent) < 1:
        raise ValueError(f"rollout.max_concurrent_episodes must be a positive int or null, got {max_concurrent}")
    uncapped = max_concurrent is None or int(max_concurrent) >= len(data)
    if len(data) and uncapped and engine.takes_all_at_once(len(data)):
        out = workflow.run_batch(engine, data)
        if out is not None:
            out.batch[ACCEPTED_KEY] = torch.ones(len(data), dtype=torch.bool)
            out.meta_info = {}
            return out
    semaphore = asyncio.Semaphore(int(max_concurrent)) if max_concurrent else None

    async def episode(i: int) -> Any:
        row = EpisodeRow.of(data[i : i + 1])
        if semaphore is None:
            return await workflow.arun_episode(engine, row)
        async with semaphore:
            return await workflow.arun_episode(engine, row)

    results = await asyncio.gather(*(episode(i) for i in range(len(data))))
    rows: list[DataProto | None] = []
    extra_keys = dict(workflow.extra_output_keys)
    for i, result in enumerate(results):
        row_in = data[i : i + 1]
        if result is None:
            rows.append(None)
        elif isinstance(result, DataProto):
            _check_row(result, row_in, workflow, engine, i)
            rows.append(result)
        elif isinstance(result, TensorDict | dict):  # an AReaL-lite-style episode
            row = training_row(engine, row_in, result, i)
            if "token_level_scores" in row.batch.keys():
                extra_keys["token_level_scores"] = "response"
            rows.append(row)
        else:
            raise TypeError(
                f"{type(workflow).__name__}.arun_episode row {i} returned {type(result).__name__}; expected a "
                "one-row DataProto, a TensorDict (AReaL-lite style) or None"
            )
    _check_same_fields(rows, workflow)
    for i, row in enumerate(rows):
        if row is None:
            row = rows[i] = _placeholder_row(engine, data[i : i + 1], extra_keys)
        row.batch[ACCEPTED_KEY] = torch.tensor([results[i] is not None])
    out = DataProto.concat(rows)
    out.meta_info = {}  # as the engine's generate_sequences (the engine counts its calls: num_generate_calls)
    return out


def _check_same_fields(rows: list[DataProto | None], workflow: RolloutWorkflow) -> None:
    """Every accepted row of one call has the same tensor fields (e.g. all or none carry rewards)."""
    accepted = [(i, set(row.batch.keys())) for i, row in enumerate(rows) if row is not None]
    for i, fields in accepted[1:]:
        if fields != accepted[0][1]:
            raise KeyError(
                f"{type(workflow).__name__}.arun_episode: row {i} has fields {sorted(fields)}, row {accepted[0][0]} "
                f"has {sorted(accepted[0][1])}; every episode must return the same fields"
            )


def run_episodes_sync(
    engine: AsyncRolloutEngine, data: DataProto, workflow: RolloutWorkflow, max_concurrent: int | None = None
) -> DataProto:
    return run_sync(arollout_batch(engine, data, workflow, max_concurrent))


def rollout_batch(
    rollout: Any, data: DataProto, workflow: RolloutWorkflow, max_concurrent: Any = "config"
) -> DataProto:
    """Run `workflow` on every row of `data` with the engine `rollout` (a `BaseRollout`).

    The requests of one call share an `AsyncRolloutEngine` whose generate calls get `data.meta_info`
    (eos/pad ids, seed, validate, do_sample), batching window `rollout.agenerate_window_ms` and cap
    `rollout.agenerate_max_batch_size`. max_concurrent: episodes at once; default
    `rollout.max_concurrent_episodes` (null = all rows).
    """
    if max_concurrent == "config":
        max_concurrent = rollout.config.get("max_concurrent_episodes", None)
    engine = AsyncRolloutEngine(rollout, data.meta_info, **batching_options(rollout.config))
    return run_episodes_sync(engine, data, workflow, max_concurrent)


# ----------------------------------------------------------------------------------------------- trainer rule
def drop_rejected_rows(batch: DataProto, n: int) -> tuple[DataProto, dict[str, float]]:
    """The trainer's rule for samples a workflow rejected; pops `rollout_accepted` from `batch`.

    A rejected row is dropped. With `rollout.n` >= 2 (group estimators) a group (same `uid`) left with a
    single row is dropped as well, because a one-sample group has no baseline; the rest of a group stays
    and its statistics are computed over the rows left. Returns (batch, metrics `rollout/rejected_samples`,
    `rollout/dropped_samples`). Raises when nothing is left.
    """
    if batch.batch is None or ACCEPTED_KEY not in batch.batch.keys():
        return batch, {}
    accepted = batch.batch.pop(ACCEPTED_KEY).bool()
    keep = accepted.clone()
    if n >= 2 and "uid" in batch.non_tensor_batch:
        uids = batch.non_tensor_batch["uid"]
        counts = Counter(uids[keep.numpy()].tolist())
        keep &= torch.tensor([counts[u] >= 2 for u in uids.tolist()], dtype=torch.bool)
    metrics = {"rollout/rejected_samples": float((~accepted).sum()), "rollout/dropped_samples": float((~keep).sum())}
    if not keep.any():
        raise RuntimeError(
            f"the rollout workflow rejected every sample of this step ({len(batch)} rows, "
            f"{int((~accepted).sum())} rejected, groups of one dropped); check the workflow or its data"
        )
    if keep.all():
        return batch, metrics
    return batch[keep], metrics
