"""Generation dumps (verl's `trainer.rollout_data_dir` and `trainer.validation_data_dir`): every training step's
samples, and every validation's, written to `<dir>/<global_step>.jsonl`, one JSON object per sample with
verl's fields `input`, `output`, `gts` (the reward model's ground truth), `score` (summed token-level score),
`step`, plus each reward extra-info column whose length matches (training rows also carry `uid`).

Written in the driver, synchronously (verl uses a one-thread executor; a few hundred rows take milliseconds).
Layer 8 helper: numpy and the protocol only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from verl.protocol import DataProto


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def write_generations(
    inputs: Sequence[str],
    outputs: Sequence[str],
    gts: Sequence[Any],
    scores: Sequence[float],
    reward_extra_infos: Mapping[str, Sequence[Any]],
    dump_path: str,
    global_steps: int,
) -> str:
    """Write `<dump_path>/<global_steps>.jsonl` (replacing an earlier file of that step); returns its path.
    Extra columns whose length is not the number of samples are left out, as verl does."""
    os.makedirs(dump_path, exist_ok=True)
    filename = os.path.join(dump_path, f"{global_steps}.jsonl")
    n = len(inputs)
    columns: dict[str, Sequence[Any]] = {
        "input": inputs,
        "output": outputs,
        "gts": gts,
        "score": scores,
        "step": [global_steps] * n,
    }
    for key, values in reward_extra_infos.items():
        values = _plain(values)
        if len(values) == n and key not in columns:
            columns[key] = values
    with open(filename, "w", encoding="utf-8") as f:
        for i in range(n):
            row = {key: _plain(values[i]) for key, values in columns.items()}
            f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
    return filename


def ground_truths(batch: DataProto) -> list[Any]:
    """`reward_model["ground_truth"]` of each row (None where a row has none)."""
    column = batch.non_tensor_batch.get("reward_model")
    if column is None:
        return [None] * len(batch)
    return [rm.get("ground_truth") if isinstance(rm, Mapping) else None for rm in column]


def dump_rollout(trainer_config: Mapping, tokenizer, batch: DataProto, extra_keys, global_steps: int) -> str | None:
    """When `trainer.rollout_data_dir` is set, write this step's samples (prompt and response decoded without
    special tokens, score = sum of `token_level_scores`) with the reward extra-info columns `extra_keys` and
    `uid`; returns the file written, else None."""
    dump_dir = trainer_config.get("rollout_data_dir", None)
    if not dump_dir:
        return None
    inputs = tokenizer.batch_decode(batch.batch["prompts"], skip_special_tokens=True)
    outputs = tokenizer.batch_decode(batch.batch["responses"], skip_special_tokens=True)
    scores = batch.batch["token_level_scores"].sum(-1).tolist()
    extra = {key: batch.non_tensor_batch[key] for key in extra_keys if key in batch.non_tensor_batch}
    for key in ("uid", "request_id"):
        if key in batch.non_tensor_batch:
            extra.setdefault(key, batch.non_tensor_batch[key])
    return write_generations(inputs, outputs, ground_truths(batch), scores, extra, dump_dir, global_steps)


def dump_validation(
    trainer_config: Mapping,
    inputs: Sequence[str],
    outputs: Sequence[str],
    gts: Sequence[Any],
    scores: Sequence[float],
    reward_extra_infos: Mapping[str, Sequence[Any]],
    global_steps: int,
) -> str | None:
    """When `trainer.validation_data_dir` is set, write one validation's samples (verl adds the score as a
    `reward` column before the reward's own extra columns); returns the file written, else None."""
    dump_dir = trainer_config.get("validation_data_dir", None)
    if not dump_dir:
        return None
    extra = {"reward": list(scores), **reward_extra_infos}
    return write_generations(inputs, outputs, gts, scores, extra, dump_dir, global_steps)
