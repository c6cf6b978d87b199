"""The PPO driver: `Role`, `ResourcePoolManager` and `RayPPOTrainer.fit`, which runs the step of
DESIGN.md (generate -> reward -> log-probs -> advantages -> critic/actor updates) over colocated
worker groups, with validation, metrics, checkpoint/resume and a final summary.

Layer 8: calls the algorithm maths in core_algos and the workers through their worker groups.
"""

from __future__ import annotations

import math
import os
import time
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from tqdm import tqdm

from verl.protocol import DataProto
from verl.single_controller.ray import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    create_colocated_worker_cls,
)
from verl.trainer.ppo import checkpoint as ckpt
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.metric_utils import (
    compute_data_metrics,
    compute_throughout_metrics,
    compute_timing_metrics,
    marked_timer,
    process_validation_metrics,
    reduce_metrics,
)
from verl.trainer.ppo.reward import compute_reward
from verl.utils.tracking import Tracking


class Role(Enum):
    """Roles a worker process can play; fused roles share one process per rank."""

    Actor = 0
    Rollout = 1
    ActorRollout = 2
    Critic = 3
    RefPolicy = 4
    RewardModel = 5
    ActorRolloutRef = 6


@dataclass
class ResourcePoolManager:
    """Named resource pools (`{name: [processes per node, ...]}`) and which role lives in which pool."""

    resource_pool_spec: dict[str, list[int]]
    mapping: dict[Role, str]
    use_gpu: bool = False
    cpus_per_process: int = 1
    resource_pool_dict: dict[str, RayResourcePool] = field(default_factory=dict)

    def create_resource_pool(self) -> None:
        for name, process_on_nodes in self.resource_pool_spec.items():
            self.resource_pool_dict[name] = RayResourcePool(
                process_on_nodes=process_on_nodes,
                use_gpu=self.use_gpu,
                max_colocate_count=1,
                name_prefix=name,
                **({} if self.use_gpu else {"cpus_per_process": self.cpus_per_process}),
            )

    def get_resource_pool(self, role: Role) -> RayResourcePool:
        return self.resource_pool_dict[self.mapping[role]]

    def get_n_processes(self) -> int:
        return sum(sum(nodes) for nodes in self.resource_pool_spec.values())


def need_reference_policy(config: DictConfig) -> bool:
    return bool(config.algorithm.use_kl_in_reward or config.actor_rollout_ref.actor.use_kl_loss)


def need_critic(config: DictConfig) -> bool:
    enable = config.critic.get("enable", None)
    if enable is not None:
        return bool(enable)
    return config.algorithm.adv_estimator == core_algos.AdvantageEstimator.GAE


def epoch_order(num_rows: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """Row order of one epoch: a permutation seeded by (seed, epoch), so a resumed run sees the same order."""
    if not shuffle:
        return list(range(num_rows))
    generator = torch.Generator().manual_seed(int(seed) * 100003 + int(epoch))
    return torch.randperm(num_rows, generator=generator).tolist()


class RayPPOTrainer:
    """Drive PPO-family training with colocated Ray worker groups.

    Args:
        config: the full Hydra config (see verl/trainer/config/ppo_trainer.yaml).
        tokenizer: HF tokenizer of the policy.
        role_worker_mapping: {Role: worker class} (e.g. ActorRolloutRefWorker, CriticWorker).
        resource_pool_manager: where each role runs.
        reward_fn / val_reward_fn: reward managers (DataProto -> token-level scores).
        train_dataset / val_dataset: RLHFDataset-like (indexable, returning dicts); collate_fn batches them.
    """

    def __init__(
        self,
        config: DictConfig,
        tokenizer,
        role_worker_mapping: dict[Role, type],
        resource_pool_manager: ResourcePoolManager,
        ray_worker_group_cls=RayWorkerGroup,
        reward_fn=None,
        val_reward_fn=None,
        train_dataset=None,
        val_dataset=None,
        collate_fn=None,
    ):
        self.config = config
        self.tokenizer = tokenizer
        self.role_worker_mapping = role_worker_mapping
        self.resource_pool_manager = resource_pool_manager
        self.ray_worker_group_cls = ray_worker_group_cls
        self.reward_fn = reward_fn
        self.val_reward_fn = val_reward_fn
        self.train_dataset = train_dataset
        self.val_dataset = val_dataset
        self.collate_fn = collate_fn
        self.use_reference_policy = need_reference_policy(config)
        self.use_critic = need_critic(config)
        self.kl_ctrl_in_reward = (
            core_algos.get_kl_controller(config.algorithm.kl_ctrl) if config.algorithm.use_kl_in_reward else None
        )
        self.global_steps = 0
        self.epoch = 0
        self.batch_in_epoch = 0
        self.nonfinite_in_a_row = 0
        self.run_dir = config.trainer.default_local_dir
        self._check_config()
        self.total_training_steps = self._compute_total_training_steps()
        for section in (config.actor_rollout_ref.actor.optim, config.critic.optim):
            with open_dict(section):
                section.total_training_steps = self.total_training_steps

    # ---------------------------------------------------------------- set-up
    def _check_config(self) -> None:
        cfg = self.config
        core_algos.get_adv_estimator_fn(cfg.algorithm.adv_estimator)  # unknown name -> ValueError listing names
        core_algos.get_policy_loss_fn(cfg.actor_rollout_ref.actor.policy_loss.loss_mode)
        positive = {
            "data.train_batch_size": cfg.data.train_batch_size,
            "data.max_prompt_length": cfg.data.max_prompt_length,
            "data.max_response_length": cfg.data.max_response_length,
            "actor_rollout_ref.rollout.n": cfg.actor_rollout_ref.rollout.n,
            "actor_rollout_ref.actor.ppo_mini_batch_size": cfg.actor_rollout_ref.actor.ppo_mini_batch_size,
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu,
            "actor_rollout_ref.actor.ppo_epochs": cfg.actor_rollout_ref.actor.ppo_epochs,
            "trainer.total_epochs": cfg.trainer.total_epochs,
        }
        for key, value in positive.items():
            if value is None or int(value) <= 0:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        bs, mini = cfg.data.train_batch_size, cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        if bs % mini != 0:
            raise ValueError(
                f"data.train_batch_size={bs} must be divisible by actor_rollout_ref.actor.ppo_mini_batch_size={mini}"
            )
        n_proc = self.resource_pool_manager.get_n_processes()
        if (mini * cfg.actor_rollout_ref.rollout.n) % n_proc != 0:
            raise ValueError(
                f"ppo_mini_batch_size * rollout.n = {mini * cfg.actor_rollout_ref.rollout.n} samples must be divisible "
                f"by the number of worker processes ({n_proc} = trainer.nnodes * trainer.n_gpus_per_node)"
            )
        if cfg.algorithm.adv_estimator in ("grpo", "rloo", "grpo_passk", "opo") and cfg.actor_rollout_ref.rollout.n < 2:
            print(f"warning: adv_estimator={cfg.algorithm.adv_estimator} with rollout.n=1 gives zero advantages")
        if len(self.train_dataset) < bs:
            raise ValueError(
                f"the training set has {len(self.train_dataset)} prompts, fewer than data.train_batch_size={bs}"
            )
        if cfg.trainer.resume_mode not in ("auto", "disable", "resume_path"):
            raise ValueError(f"trainer.resume_mode={cfg.trainer.resume_mode!r}; allowed: auto, disable, resume_path")

    def _compute_total_training_steps(self) -> int:
        steps_per_epoch = len(self.train_dataset) // self.config.data.train_batch_size
        total = steps_per_epoch * self.config.trainer.total_epochs
        if self.config.trainer.total_training_steps is not None:
            total = int(self.config.trainer.total_training_steps)
        return total

    def init_workers(self) -> None:
        """Create the resource pools, fuse the roles of each pool into one Ray actor per process, and
        initialise the models."""
        self.resource_pool_manager.create_resource_pool()
        pool_to_classes: dict[RayResourcePool, dict[str, RayClassWithInitArgs]] = {}
        role_name = "actor_rollout_ref" if self.use_reference_policy else "actor_rollout"
        actor_cls = self.role_worker_mapping[Role.ActorRollout]
        pool = self.resource_pool_manager.get_resource_pool(Role.ActorRollout)
        pool_to_classes.setdefault(pool, {})[role_name] = RayClassWithInitArgs(
            actor_cls, config=self.config.actor_rollout_ref, role=role_name
        )
        if self.use_critic:
            critic_config = OmegaConf.create(OmegaConf.to_container(self.config.critic, resolve=True))
            critic_config.rollout_n = self.config.actor_rollout_ref.rollout.n
            pool = self.resource_pool_manager.get_resource_pool(Role.Critic)
            pool_to_classes.setdefault(pool, {})["critic"] = RayClassWithInitArgs(
                self.role_worker_mapping[Role.Critic], config=critic_config
            )
        self.all_wgs: dict[str, Any] = {}
        for pool, class_dict in pool_to_classes.items():
            fused_cls = create_colocated_worker_cls(class_dict=class_dict)
            wg_dict = self.ray_worker_group_cls(resource_pool=pool, ray_cls_with_init=fused_cls)
            self.all_wgs.update(wg_dict.spawn(prefix_set=class_dict.keys()))
        self.actor_rollout_wg = self.all_wgs[role_name]
        self.critic_wg = self.all_wgs.get("critic")
        if self.critic_wg is not None:
            self.critic_wg.init_model()
        self.actor_rollout_wg.init_model()
        self.n_workers = self.actor_rollout_wg.world_size

    # ---------------------------------------------------------------- data
    def _batch_from_rows(self, rows: list[int], dataset) -> DataProto:
        return DataProto.from_single_dict(self.collate_fn([dataset[i] for i in rows]))

    def _train_batches(self):
        """Yield (epoch, batch index, DataProto) from the resume position on."""
        bs = self.config.data.train_batch_size
        n_batches = len(self.train_dataset) // bs
        for epoch in range(self.epoch, self.config.trainer.total_epochs + 10**6):
            order = epoch_order(len(self.train_dataset), epoch, self.config.data.seed, self.config.data.shuffle)
            start = self.batch_in_epoch if epoch == self.epoch else 0
            for b in range(start, n_batches):
                yield epoch, b, self._batch_from_rows(order[b * bs : (b + 1) * bs], self.train_dataset)

    def _generate(self, batch: DataProto, validate: bool, seed: int, do_sample: bool | None = None) -> DataProto:
        """Generate one response per row (validation settings when `validate`; `do_sample=False`
        forces greedy) and merge the rollout outputs into the batch."""
        eos = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos
        if do_sample is None:
            rollout = self.config.actor_rollout_ref.rollout
            do_sample = bool(rollout.val_kwargs.do_sample if validate else rollout.do_sample)
        gen_input = batch.select(batch_keys=["input_ids", "attention_mask", "position_ids"])
        gen_input.meta_info.update(
            {"eos_token_id": eos, "pad_token_id": pad, "validate": validate, "seed": int(seed), "do_sample": do_sample}
        )
        output = self.actor_rollout_wg.generate_sequences(gen_input)
        batch.pop(batch_keys=["input_ids", "attention_mask", "position_ids"])
        output.meta_info.pop("metrics", None)
        return batch.union(output)

    # ---------------------------------------------------------------- validation
    def _validate(self) -> dict[str, float]:
        if self.val_dataset is None or self.val_reward_fn is None:
            return {}
        n = int(self.config.actor_rollout_ref.rollout.val_kwargs.n)
        rows = list(range(len(self.val_dataset)))
        if self.config.data.get("val_max_samples"):
            rows = rows[: int(self.config.data.val_max_samples)]
        bs = self.config.data.val_batch_size or len(rows)
        sources, scores, extras = [], [], {}
        for start in range(0, len(rows), bs):
            batch = self._batch_from_rows(rows[start : start + bs], self.val_dataset)
            batch = batch.repeat(n, interleave=True)
            batch = self._generate(batch, validate=True, seed=10**6 + start)
            reward_tensor, extra = compute_reward(batch, self.val_reward_fn)
            scores.extend(reward_tensor.sum(-1).tolist())
            sources.extend(batch.non_tensor_batch.get("data_source", np.array(["unknown"] * len(batch))).tolist())
            for key, values in (extra or {}).items():
                extras.setdefault(key, []).extend(list(values))
            self._last_val_batch = batch
        return process_validation_metrics(sources, scores, n, extras)

    # ---------------------------------------------------------------- checkpoints
    def _save_checkpoint(self) -> str:
        root = self.run_dir
        staging = ckpt.begin_checkpoint(root, self.global_steps)
        save_hf = "hf_model" in list(self.config.actor_rollout_ref.actor.checkpoint.get("save_contents", []))
        self.actor_rollout_wg.save_checkpoint(
            os.path.join(staging, "actor"), global_step=self.global_steps, save_hf=save_hf
        )
        if self.use_critic:
            self.critic_wg.save_checkpoint(os.path.join(staging, "critic"), global_step=self.global_steps)
        state = {
            "global_steps": self.global_steps,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
            "kl_coef": None if self.kl_ctrl_in_reward is None else self.kl_ctrl_in_reward.value,
        }
        torch.save(state, os.path.join(staging, "trainer_state.pt"))
        keep = self.config.trainer.max_actor_ckpt_to_keep
        return ckpt.commit_checkpoint(root, self.global_steps, max_to_keep=keep)

    def _load_checkpoint(self) -> str | None:
        mode = self.config.trainer.resume_mode
        if mode == "disable":
            return None
        if mode == "resume_path":
            path = self.config.trainer.resume_from_path
            if not path or not ckpt.is_complete(path):
                raise FileNotFoundError(
                    f"trainer.resume_from_path={path!r} holds no complete checkpoint (a global_step_N folder "
                    f"with a {ckpt.COMPLETE_MARKER} file); use trainer.resume_mode=auto or disable"
                )
        else:
            path = ckpt.find_latest_checkpoint(self.run_dir)
            if path is None:
                return None
        print(f"resuming from {path}")
        self.actor_rollout_wg.load_checkpoint(os.path.join(path, "actor"))
        if self.use_critic:
            self.critic_wg.load_checkpoint(os.path.join(path, "critic"))
        state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
        self.global_steps = state["global_steps"]
        self.epoch, self.batch_in_epoch = state["epoch"], state["batch_in_epoch"]
        self.nonfinite_in_a_row = state.get("nonfinite_in_a_row", 0)
        if self.kl_ctrl_in_reward is not None and state.get("kl_coef") is not None:
            self.kl_ctrl_in_reward.value = state["kl_coef"]
        return path

    # ---------------------------------------------------------------- one step
    def _rollout_and_score(self, batch: DataProto, timing: dict[str, float], metrics: dict[str, float]) -> DataProto:
        """Phases 1-4 of a step: give each prompt a `uid`, repeat it `rollout.n` times, generate, and score.

        Returns the batch with `responses`, `response_mask` and `token_level_scores` (plus the reward's extra
        per-sample fields); adds reward metrics to `metrics`.
        """
        cfg = self.config
        n = cfg.actor_rollout_ref.rollout.n
        batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
        batch.meta_info["global_steps"] = self.global_steps
        if cfg.algorithm.adv_estimator == core_algos.AdvantageEstimator.REMAX:
            with marked_timer("gen_max", timing):
                greedy = self._generate(batch.select(deepcopy=True), validate=False, seed=0, do_sample=False)
                baseline, _ = compute_reward(greedy, self.reward_fn)
                baseline = baseline.sum(-1)
        batch = batch.repeat(n, interleave=True)
        with marked_timer("gen", timing):
            batch = self._generate(batch, validate=False, seed=cfg.actor_rollout_ref.rollout.seed + self.global_steps)
        if cfg.algorithm.adv_estimator == core_algos.AdvantageEstimator.REMAX:
            batch.batch["reward_baselines"] = baseline.repeat_interleave(n)
        if "response_mask" not in batch.batch.keys():
            resp_len = batch.batch["responses"].shape[-1]
            batch.batch["response_mask"] = batch.batch["attention_mask"][:, -resp_len:]
        with marked_timer("reward", timing):
            reward_tensor, reward_extra = compute_reward(batch, self.reward_fn)
            batch.batch["token_level_scores"] = reward_tensor
            for key, values in (reward_extra or {}).items():
                if len(values) == len(batch):
                    batch.non_tensor_batch[key] = np.array(values, dtype=object)
                    metrics.update(_mean_metric(f"reward_extra/{key}", values))
        return batch

    def _train_step(self, batch: DataProto, timing: dict[str, float]) -> dict[str, float]:
        cfg = self.config
        metrics: dict[str, float] = {}
        n = cfg.actor_rollout_ref.rollout.n
        batch = self._rollout_and_score(batch, timing, metrics)
        with marked_timer("old_log_prob", timing):
            old = self.actor_rollout_wg.compute_log_prob(batch)
            metrics.update(reduce_metrics(old.meta_info.pop("metrics", {})))
            if "entropys" in old.batch.keys():
                ent = old.batch.pop("entropys")
                metrics["actor/entropy"] = core_algos.agg_loss(ent, batch.batch["response_mask"], "token-mean").item()
            batch = batch.union(old)
        if self.use_reference_policy:
            with marked_timer("ref", timing):
                batch = batch.union(self.actor_rollout_wg.compute_ref_log_prob(batch))
        if self.use_critic:
            with marked_timer("values", timing):
                batch = batch.union(self.critic_wg.compute_values(batch))
        with marked_timer("adv", timing):
            if self.kl_ctrl_in_reward is not None:
                batch, kl_metrics = core_algos.apply_kl_penalty(batch, self.kl_ctrl_in_reward, cfg.algorithm.kl_penalty)
                metrics.update(kl_metrics)
            else:
                batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
            batch = core_algos.compute_advantage(
                batch,
                adv_estimator=cfg.algorithm.adv_estimator,
                gamma=cfg.algorithm.gamma,
                lam=cfg.algorithm.lam,
                num_repeat=n,
                norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo,
                config=cfg.algorithm,
            )
        if self.use_critic:
            with marked_timer("update_critic", timing):
                out = self.critic_wg.update_critic(batch)
                metrics.update(reduce_metrics(out.meta_info["metrics"]))
        if cfg.trainer.critic_warmup <= self.global_steps:
            with marked_timer("update_actor", timing):
                out = self.actor_rollout_wg.update_actor(batch)
                metrics.update(reduce_metrics(out.meta_info["metrics"]))
        metrics.update(compute_data_metrics(batch, use_critic=self.use_critic))
        self._last_batch = batch
        return metrics

    def _check_nonfinite(self, metrics: dict[str, float]) -> None:
        skipped = metrics.get("actor/nonfinite_steps", 0.0) + metrics.get("critic/nonfinite_steps", 0.0)
        self.nonfinite_in_a_row = self.nonfinite_in_a_row + 1 if skipped > 0 else 0
        limit = self.config.trainer.get("max_nonfinite_steps", 5)
        if limit and self.nonfinite_in_a_row >= limit:
            raise RuntimeError(
                f"{self.nonfinite_in_a_row} steps in a row had a non-finite loss or grad norm "
                f"(trainer.max_nonfinite_steps={limit}); stopping. The last complete checkpoint is kept in "
                f"{self.run_dir}. Lower the learning rate or check the rewards for NaN/inf."
            )

    # ---------------------------------------------------------------- the loop
    def fit(self) -> dict[str, Any]:
        """Train for `total_training_steps` steps; return a summary dict (also printed)."""
        cfg = self.config
        log_dir = cfg.trainer.get("log_dir") or os.path.join(self.run_dir, "logs")
        bar = tqdm(total=self.total_training_steps, desc="training", unit="step", dynamic_ncols=True)
        logger = Tracking(
            cfg.trainer.project_name,
            cfg.trainer.experiment_name,
            cfg.trainer.logger,
            log_dir,
            config=OmegaConf.to_container(cfg, resolve=True),
            print_fn=tqdm.write,
        )
        start_time = time.time()
        resumed_from = self._load_checkpoint()
        bar.update(self.global_steps)
        summary: dict[str, Any] = {"resumed_from": resumed_from, "log_dir": log_dir, "run_dir": self.run_dir}
        if self.val_reward_fn is not None and cfg.trainer.val_before_train and self.global_steps == 0:
            val = self._validate()
            summary["val_before"] = val.get("val/reward/mean")
            logger.log(val, step=0)
        last_val: dict[str, float] = {}
        save_freq, test_freq = cfg.trainer.save_freq, cfg.trainer.test_freq
        if self.global_steps < self.total_training_steps:
            for epoch, b, batch in self._train_batches():
                self.global_steps += 1
                timing: dict[str, float] = {}
                with marked_timer("step", timing):
                    metrics = self._train_step(batch, timing)
                self.epoch, self.batch_in_epoch = epoch, b + 1
                self._check_nonfinite(metrics)
                is_last = self.global_steps >= self.total_training_steps
                if self.val_reward_fn is not None and (
                    (test_freq > 0 and self.global_steps % test_freq == 0) or is_last
                ):
                    with marked_timer("testing", timing):
                        last_val = self._validate()
                    metrics.update(last_val)
                if (
                    save_freq is not None
                    and save_freq >= 0
                    and ((save_freq > 0 and self.global_steps % save_freq == 0) or is_last)
                ):
                    with marked_timer("save_checkpoint", timing):
                        summary["last_checkpoint"] = self._save_checkpoint()
                metrics.update(compute_timing_metrics(self._last_batch, timing))
                metrics.update(compute_throughout_metrics(self._last_batch, timing, self.n_workers))
                metrics["training/epoch"] = epoch
                logger.log(metrics, step=self.global_steps)
                bar.update(1)
                if is_last:
                    break
        bar.close()
        logger.finish()
        summary.update(
            {
                "steps": self.global_steps,
                "wall_time_s": round(time.time() - start_time, 1),
                "val_after": last_val.get("val/reward/mean"),
            }
        )
        try:
            from verl.utils.plot import plot_run

            summary["plot"] = plot_run(log_dir)
        except Exception as e:  # a plot must never cost a finished run
            summary["plot"] = f"not drawn: {e}"
        print_summary(summary)
        return summary


def _mean_metric(key: str, values) -> dict[str, float]:
    nums = [
        float(v) for v in values if isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool)
    ]
    nums = [v for v in nums if math.isfinite(v)]
    return {f"{key}/mean": float(np.mean(nums))} if nums else {}


def print_summary(summary: dict[str, Any]) -> None:
    lines = ["", "=" * 60, "training finished"]
    before, after = summary.get("val_before"), summary.get("val_after")
    if before is not None or after is not None:
        fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
        lines.append(f"validation reward: before {fmt(before)} -> after {fmt(after)}")
    lines.append(f"steps: {summary.get('steps')}   wall time: {summary.get('wall_time_s')} s")
    lines.append(f"logs (tensorboard, metrics.jsonl): {summary.get('log_dir')}")
    lines.append(f"plot: {summary.get('plot')}")
    if summary.get("last_checkpoint"):
        lines.append(f"last checkpoint: {summary['last_checkpoint']}")
    lines.append("=" * 60)
    print("\n".join(lines), flush=True)
