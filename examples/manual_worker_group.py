"""Drive an `ActorRolloutRefWorker` group by hand on CPU over Ray: generate, log-probs, one GRPO update,
weight sync, generate again.

    python examples/manual_worker_group.py --n_ranks 2
    python examples/manual_worker_group.py --n_ranks 1 --model_path /path/to/hf_model

Without `--model_path` a tiny random Qwen2 model is built with `verl.models.tiny` in a temporary folder.
The reward is a toy (the share of response tokens with an even id) so that the group advantages are not zero;
the point is the worker-group calls, not learning. `training/rollout_probs_diff_max` after the update shows
that the rollout engine of every rank samples from the updated weights.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import ray
import torch
from omegaconf import OmegaConf

import verl
from verl.protocol import DataProto
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.trainer.ppo import core_algos
from verl.utils.torch_functional import compute_position_id_with_mask
from verl.workers.fsdp_workers import ActorRolloutRefWorker

QUESTIONS = [
    "What is the weather in Zurich?",
    "Convert 12 dollars to euro.",
    "How many apples does Weng have?",
    "Find a restaurant near me.",
]


def build_config(model_path: str, prompt_length: int, response_length: int, n: int):
    cfg = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), "trainer", "config", "ppo_trainer.yaml"))
    cfg.data.max_prompt_length, cfg.data.max_response_length = prompt_length, response_length
    arr = cfg.actor_rollout_ref
    arr.model.path = model_path
    arr.rollout.n = n
    arr.rollout.calculate_log_probs = True
    arr.actor.ppo_mini_batch_size = len(QUESTIONS)
    arr.actor.ppo_micro_batch_size_per_gpu = 4
    arr.actor.optim.lr = 1e-3
    return arr


def make_prompts(tokenizer, prompt_length: int, n: int, seed: int) -> DataProto:
    """Chat-templated questions, left-padded to `prompt_length`, each repeated `n` times (interleaved)."""
    ids = torch.full((len(QUESTIONS), prompt_length), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, question in enumerate(QUESTIONS):
        messages = [{"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        tokens = tokenizer(text)["input_ids"][-prompt_length:]
        ids[i, prompt_length - len(tokens) :] = torch.tensor(tokens)
        mask[i, prompt_length - len(tokens) :] = 1
    prompts = DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": mask, "position_ids": compute_position_id_with_mask(mask)},
        non_tensors={"uid": np.array([f"q{i}" for i in range(len(QUESTIONS))], dtype=object)},
        meta_info={"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, "seed": seed},
    )
    return prompts.repeat(n, interleave=True)


def toy_scores(batch: DataProto) -> torch.Tensor:
    """(bs, response_len) token-level scores: the share of even token ids, placed on the last response token."""
    responses, mask = batch.batch["responses"], batch.batch["response_mask"]
    share_even = ((responses % 2 == 0) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    scores = torch.zeros(responses.shape)
    scores[torch.arange(len(scores)), mask.sum(-1).clamp(min=1) - 1] = share_even.float()
    return scores


def timed(label: str, fn):
    start = time.perf_counter()
    out = fn()
    print(f"[{time.perf_counter() - start:6.2f} s] {label}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n_ranks", type=int, default=2, choices=[1, 2], help="worker processes (FSDP2 ranks)")
    parser.add_argument("--model_path", default=None, help="HF model directory (default: build a tiny Qwen2)")
    parser.add_argument("--n", type=int, default=2, help="samples per prompt")
    parser.add_argument("--prompt_length", type=int, default=32)
    parser.add_argument("--response_length", type=int, default=8)
    args = parser.parse_args()

    model_path = args.model_path
    if model_path is None:
        from verl.models.tiny import build_tiny_model

        model_path = timed("built a tiny Qwen2 model", lambda: build_tiny_model(tempfile.mkdtemp(prefix="tiny_qwen2_")))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    config = build_config(model_path, args.prompt_length, args.response_length, args.n)

    ray.init(num_cpus=max(2, args.n_ranks), include_dashboard=False, log_to_driver=False)
    pool = RayResourcePool(process_on_nodes=[args.n_ranks], use_gpu=False)
    worker_cls = RayClassWithInitArgs(ActorRolloutRefWorker, config=config, role="actor_rollout_ref")
    wg = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=worker_cls)
    print(f"worker group: {wg.world_size} rank(s) of ActorRolloutRefWorker (actor + hf rollout + reference), CPU")
    timed("init_model on every rank (FSDP2 actor, rollout copy, reference)", wg.init_model)

    batch = timed(
        "generate_sequences", lambda: wg.generate_sequences(make_prompts(tokenizer, args.prompt_length, args.n, 0))
    )
    lengths = batch.batch["response_mask"].sum(-1).tolist()
    print(f"  {len(batch)} responses, lengths {lengths}")
    print(f"  first response: {tokenizer.decode(batch.batch['responses'][0], skip_special_tokens=False)!r}")

    old = timed("compute_log_prob (actor)", lambda: wg.compute_log_prob(batch))
    diff = max(old.meta_info["metrics"]["training/rollout_probs_diff_max"])
    print(f"  training/rollout_probs_diff_max before the update: {diff:.2e}")
    entropys = old.batch.pop("entropys")
    batch = batch.union(old)
    batch = batch.union(timed("compute_ref_log_prob (reference)", lambda: wg.compute_ref_log_prob(batch)))
    kl = (batch.batch["old_log_probs"] - batch.batch["ref_log_prob"]).abs().max().item()
    print(f"  mean entropy {entropys[batch.batch['response_mask'].bool()].mean():.3f}, max |actor - ref| {kl:.2e}")

    batch.batch["token_level_rewards"] = toy_scores(batch)
    batch = core_algos.compute_advantage(batch, adv_estimator="grpo", num_repeat=args.n)
    out = timed("update_actor (one GRPO step, then weights pushed to the rollout)", lambda: wg.update_actor(batch))
    metrics = out.meta_info["metrics"]
    print(f"  actor/pg_loss {np.mean(metrics['actor/pg_loss']):.4f}  actor/grad_norm "
          f"{np.mean(metrics['actor/grad_norm']):.4f}  actor/lr {metrics['actor/lr'][0]:.1e}")  # fmt: skip

    before = batch.batch["old_log_probs"]
    after = timed("compute_log_prob on the same responses", lambda: wg.compute_log_prob(batch).batch["old_log_probs"])
    moved = (after - before)[batch.batch["response_mask"].bool()].abs().max().item()
    print(f"  the update moved the log-probs by up to {moved:.2e}")

    batch2 = timed(
        "generate_sequences again",
        lambda: wg.generate_sequences(make_prompts(tokenizer, args.prompt_length, args.n, 1)),
    )
    old2 = timed("compute_log_prob", lambda: wg.compute_log_prob(batch2))
    diff2 = max(old2.meta_info["metrics"]["training/rollout_probs_diff_max"])
    mask2 = batch2.batch["response_mask"].bool()
    lp_diff = (batch2.batch["rollout_log_probs"] - old2.batch["old_log_probs"])[mask2].abs().max().item()
    print(f"  training/rollout_probs_diff_max after the update: {diff2:.2e}, max |rollout - actor log-prob| "
          f"{lp_diff:.2e} (~0: every rank's rollout engine has the new weights)")  # fmt: skip
    pool.remove_placement_groups()
    ray.shutdown()


if __name__ == "__main__":
    main()
