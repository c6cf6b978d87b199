"""Validation of the PPO trainer and the run's closing summary: `validate` generates `val_kwargs.n` answers per
validation prompt (and, with `trainer.val_greedy`, one greedy answer), scores them with the validation reward and
returns verl's validation metrics; `print_summary` prints the validation reward before -> after (sampled and greedy
per data source), the wall time and where the logs are.

Layer 8 helper of `RayPPOTrainer` (ray_trainer.py), which calls it from `_validate` and `fit`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from verl.protocol import DataProto
from verl.trainer.ppo import generation_dump, rlvr
from verl.trainer.ppo.reward import compute_reward
from verl.trainer.ppo.validation_metrics import (
    compute_val_correct_metrics,
    compute_validation_metrics,
    process_greedy_validation_metrics,
    select_generations,
)
from verl.utils.dataset.prompt_loader import load_batches


def validate(trainer) -> dict[str, float]:
    """Generate `val_kwargs.n` answers per validation prompt with `trainer`'s rollout, score them, and return verl's
    validation metrics (see `compute_validation_metrics`); the first few generations are kept in
    `trainer.val_generations` for the table `Tracking.log_generations` writes. With `trainer.val_greedy`, also one
    greedy answer per prompt (`process_greedy_validation_metrics`; taken from the sampled pass when
    `val_kwargs.do_sample` is false)."""
    if trainer.val_dataset is None or trainer.val_reward_fn is None:
        return {}
    n = int(trainer.config.actor_rollout_ref.rollout.val_kwargs.n)
    greedy_pass = bool(trainer.config.trainer.get("val_greedy", False))
    sampled = bool(trainer.config.actor_rollout_ref.rollout.val_kwargs.do_sample)
    greedy_sources, greedy_scores, greedy_extras = [], [], {}
    rows = list(range(len(trainer.val_dataset)))
    if (trainer.config.data.get("val_max_samples") or -1) > 0:  # verl: -1 = all
        rows = rows[: int(trainer.config.data.val_max_samples)]
    bs = trainer.config.data.val_batch_size or len(rows)
    sources, scores, uids, inputs, outputs, extras, gts = [], [], [], [], [], {}, []
    tag_key, tags, thresholds = trainer.config.data.get("val_tag_key") or "data_source", [], []
    chunks = [rows[start : start + bs] for start in range(0, len(rows), bs)]
    loaded = load_batches(trainer.val_dataset, chunks, trainer.collate_fn, trainer.num_workers)
    for start, data in zip(range(0, len(rows), bs), loaded):
        if greedy_pass and sampled:  # one greedy answer per prompt, scored by the same reward
            greedy = trainer._score_with_reward_model(
                trainer._generate(DataProto.from_single_dict(data), validate=True, seed=0, do_sample=False)
            )
            reward_tensor, extra = compute_reward(greedy, trainer.val_reward_fn)
            greedy_scores.extend(reward_tensor.sum(-1).tolist())
            greedy_sources.extend(list(greedy.non_tensor_batch.get("data_source", ["unknown"] * len(greedy))))
            _append_extras(greedy_extras, extra)
        batch = DataProto.from_single_dict(data).repeat(n, interleave=True)
        batch = trainer._score_with_reward_model(trainer._generate(batch, validate=True, seed=10**6 + start))
        reward_tensor, extra = compute_reward(batch, trainer.val_reward_fn)
        scores.extend(reward_tensor.sum(-1).tolist())
        sources.extend(batch.non_tensor_batch.get("data_source", np.array(["unknown"] * len(batch))).tolist())
        uids.extend(start + i // n for i in range(len(batch)))
        tags.extend(batch.non_tensor_batch.get(tag_key, np.array(["unknown"] * len(batch))).tolist())
        thresholds.extend(rlvr.val_thresholds(trainer.config, batch))
        inputs.extend(trainer.tokenizer.batch_decode(batch.batch["prompts"], skip_special_tokens=True))
        outputs.extend(decode_responses(trainer.tokenizer, batch))
        gts.extend(generation_dump.ground_truths(batch))
        _append_extras(extras, extra)
    # majority votes: the reward's extracted answer (`pred`) when it gives one, else the response text
    votes = extras.get("pred") if len(extras.get("pred", [])) == len(scores) else [o.strip() for o in outputs]
    count = int(trainer.config.trainer.get("log_val_generations", 0) or 0)
    trainer.val_generations = select_generations(inputs, outputs, scores, n, count)
    generation_dump.dump_validation(trainer.config.trainer, inputs, outputs, gts, scores, extras, trainer.global_steps)
    metrics = compute_validation_metrics(sources, scores, n, extras, uids=uids, votes=votes)
    metrics.update(compute_val_correct_metrics(tags, scores, thresholds))  # val_correct/{all,<tag>}/mean
    if greedy_pass and not sampled:  # the n answers are greedy ones: the first of each prompt
        first = range(0, len(scores), n)
        greedy_sources, greedy_scores = [sources[i] for i in first], [scores[i] for i in first]
        greedy_extras = {k: [v[i] for i in first] for k, v in extras.items() if len(v) == len(scores)}
    if greedy_pass:
        metrics.update(process_greedy_validation_metrics(greedy_sources, greedy_scores, greedy_extras))
    return metrics


def _append_extras(dest: dict[str, list], extra: dict | None) -> None:
    """Append a scored batch's reward extras (one value per row per key) to the lists in `dest`."""
    for key, values in (extra or {}).items():
        dest.setdefault(key, []).extend(list(values))


def decode_responses(tokenizer, batch: DataProto) -> list[str]:
    """Each response's text up to its mask (eos and padding dropped)."""
    lengths = batch.batch["response_mask"].sum(-1).tolist()
    return [
        tokenizer.decode(ids[: int(length)], skip_special_tokens=True)
        for ids, length in zip(batch.batch["responses"], lengths)
    ]


def print_summary(summary: dict[str, Any]) -> None:
    lines = ["", "=" * 60, "training finished"]
    before, after = summary.get("val_before"), summary.get("val_after")
    fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
    if before is not None or after is not None:
        lines.append(f"validation reward: before {fmt(before)} -> after {fmt(after)}")
    core_before, core_after = summary.get("val_core_before") or {}, summary.get("val_core_after") or {}
    for key in dict.fromkeys([*core_before, *core_after]):  # per data source: sampled mean@n, best@n, greedy
        name = key.removeprefix("val-core/")
        lines.append(f"  {name}: before {fmt(core_before.get(key))} -> after {fmt(core_after.get(key))}")
    lines.append(f"steps: {summary.get('steps')}   wall time: {summary.get('wall_time_s')} s")
    lines.append(f"logs (tensorboard, metrics.jsonl): {summary.get('log_dir')}")
    lines.append(f"plot: {summary.get('plot')}")
    if summary.get("last_checkpoint"):
        lines.append(f"last checkpoint: {summary['last_checkpoint']}")
    lines.append("=" * 60)
    print("\n".join(lines), flush=True)
