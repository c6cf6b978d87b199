"""The PPO driver: `Role`, `ResourcePoolManager` and `RayPPOTrainer.fit`, which runs the step of
docs/architecture.md#one-training-step (generate -> reward -> log-probs -> advantages -> critic/actor updates) over colocated
worker groups, with validation (validation.py), metrics, checkpoint/resume and a final summary.

Layer 8: calls the algorithm maths in core_algos and the workers through their worker groups.
"""

from __future__ import annotations

import math
import os
import shutil
import time
import uuid
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
from verl.trainer.ppo import async_rollout, core_algos, failures, generation_dump, rlvr, run_options, validation
from verl.trainer.ppo import checkpoint as ckpt
from verl.trainer.ppo import rollout_corr_helper as corr_helper
from verl.trainer.ppo.checkpoint_callback import build_checkpoint_callback
from verl.trainer.ppo.metric_utils import (
    SPEC_DECODE_KEYS,
    compute_data_metrics,
    compute_domain_metrics,
    compute_gdpo_metrics,
    compute_spec_decode_metrics,
    compute_throughout_metrics,
    compute_timing_metrics,
    marked_timer,
    reduce_metrics,
)
from verl.trainer.ppo.resource_pool import ResourcePoolManager, Role
from verl.trainer.ppo.reward import compute_reward
from verl.trainer.ppo.utils import (
    check_trainer_config,
    need_critic,
    need_reference_policy,
    need_reward_model,
    reward_model_section,
)
from verl.utils.checkpoint.errors import NonFiniteWeightsError
from verl.utils.dataset.prompt_loader import iter_train_batches
from verl.utils.plot import read_metrics
from verl.utils.seqlen_balancing import balance_batch
from verl.utils.system_metrics import prefixed, process_metrics
from verl.utils.tracking import Tracking
from verl.workers.rollout.workflows import drop_rejected_rows


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

    rm_wg: Any = None  # the reward model's worker group (reward.reward_model.enable), started by init_workers

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
        # fit() returns before drawing the plot and printing the summary; the caller runs `finish_run` (run_ppo
        # does, once the workers have stopped)
        self.finish_after_workers_stop = False
        self.reward_fn = reward_fn
        self.val_reward_fn = val_reward_fn
        self.train_dataset = train_dataset
        self.val_dataset = val_dataset
        self.collate_fn = collate_fn
        self.use_reference_policy = need_reference_policy(config)
        self.use_critic = need_critic(config)
        self.use_rm = need_reward_model(config)
        self.kl_ctrl_in_reward = (
            core_algos.get_kl_controller(config.algorithm.kl_ctrl) if config.algorithm.use_kl_in_reward else None
        )
        self.global_steps = 0
        self.epoch = 0
        self.batch_in_epoch = 0
        self.nonfinite_in_a_row = 0
        self._resumed_step_metrics = None  # the checkpoint's step record, when resumed
        self.val_generations: list[dict] = []  # rows of the last validation's generations table
        self.domain_sampler = rlvr.make_domain_sampler(config, train_dataset)  # data.domains: an order per domain
        self.rlvr = rlvr.build_rlvr_step(config)  # None without domains, sample mask, filter_groups, reward processing
        self.reward_pool = None  # data.domains' reward workers (set by build_trainer), polled for system metrics
        self.run_dir = config.trainer.default_local_dir
        self._check_config()
        run_options.check_run_options(config)  # dumps, val_only, retention, ESI, dataloader workers
        self.checkpoint_callback = build_checkpoint_callback(config)  # trainer.checkpoint_callback_class
        self.num_workers = int(config.data.dataloader_num_workers)  # DataLoader processes per loader
        self.max_steps_duration, self.reward_extra_keys = 0.0, set()  # for the ESI save / the rollout dump
        async_rollout.resolve_async_config(config)
        corr_helper.resolve_rollout_correction_config(config)  # algorithm.rollout_correction: checks, bypass
        self.total_training_steps = self._compute_total_training_steps()
        for section in (config.actor_rollout_ref.actor.optim, config.critic.optim):
            with open_dict(section):
                section.total_training_steps = self.total_training_steps

    # ---------------------------------------------------------------- set-up
    def _check_config(self) -> None:
        pools = self.resource_pool_manager
        n_proc = sum(pools.resource_pool_spec[pools.mapping[Role.ActorRollout]])  # the actor's processes
        check_trainer_config(self.config, n_proc, len(self.train_dataset))

    def _compute_total_training_steps(self) -> int:
        steps_per_epoch = len(self.train_dataset) // self.config.data.train_batch_size
        total = steps_per_epoch * self.config.trainer.total_epochs
        if self.config.trainer.total_training_steps is not None:
            total = int(self.config.trainer.total_training_steps)
        return total

    def init_workers(self) -> None:
        """Create the resource pools, fuse the roles of each pool into one Ray actor per process, and
        initialise the models."""
        if getattr(self.ray_worker_group_cls, "requires_ray", True):
            self.resource_pool_manager.check_resource_available()
        self.resource_pool_manager.create_resource_pool()
        pool_to_classes: dict[RayResourcePool, dict[str, RayClassWithInitArgs]] = {}
        role_name = async_rollout.actor_role(self.config, self.use_reference_policy)
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
        if self.use_rm:  # colocated in the global pool unless reward.reward_model.enable_resource_pool
            rm_config = OmegaConf.create(OmegaConf.to_container(reward_model_section(self.config), resolve=True))
            rm_config.device = self.config.actor_rollout_ref.get("device", "auto")
            model = self.config.actor_rollout_ref.model  # the policy's tokenizer, as main_ppo loads it
            rm_config.input_tokenizer = self.config.data.tokenizer or model.tokenizer_path or model.path
            pools = self.resource_pool_manager
            pool = pools.resource_pool_dict[pools.mapping.get(Role.RewardModel, pools.mapping[Role.ActorRollout])]
            pool_to_classes.setdefault(pool, {})["rm"] = RayClassWithInitArgs(
                self.role_worker_mapping[Role.RewardModel], config=rm_config
            )
        if async_rollout.is_async(self.config):  # a standalone rollout group in its own pool
            pool = self.resource_pool_manager.get_resource_pool(Role.Rollout)
            rollout_cls = self.role_worker_mapping.get(Role.Rollout, actor_cls)
            pool_to_classes.setdefault(pool, {})["rollout"] = RayClassWithInitArgs(
                rollout_cls, config=self.config.actor_rollout_ref, role="rollout"
            )
        self.all_wgs: dict[str, Any] = {}
        for pool, class_dict in pool_to_classes.items():
            fused_cls = create_colocated_worker_cls(class_dict=class_dict)
            wg_dict = self.ray_worker_group_cls(resource_pool=pool, ray_cls_with_init=fused_cls)
            self.all_wgs.update(wg_dict.spawn(prefix_set=class_dict.keys()))
        self.actor_rollout_wg = self.all_wgs[role_name]
        self.critic_wg = self.all_wgs.get("critic")
        self.rm_wg = self.all_wgs.get("rm")
        if self.rm_wg is not None:
            self.rm_wg.init_model()
        if self.critic_wg is not None:
            self.critic_wg.init_model()
        self.actor_rollout_wg.init_model()
        self.n_workers = self.actor_rollout_wg.world_size
        self.rollout_wg = self.all_wgs.get("rollout", self.actor_rollout_wg)  # where every generation runs
        self.async_rollout = None
        ckpt.check_shared_storage(self.config.trainer, self.run_dir, [self.actor_rollout_wg, self.critic_wg])
        if self.rollout_wg is not self.actor_rollout_wg:
            self.rollout_wg.init_model()
            staleness = self.config.async_training.max_staleness
            self.async_rollout = async_rollout.AsyncRollout(self, staleness, self.total_training_steps)

    # ---------------------------------------------------------------- data
    def _batch_from_rows(self, rows: list[int], dataset) -> DataProto:
        return DataProto.from_single_dict(self.collate_fn([dataset[i] for i in rows]))

    def _data_seed(self) -> int:
        """verl's `data.seed`; null (verl's default) = `trainer.seed`."""
        seed = self.config.data.seed
        return int(seed) if seed is not None else int(self.config.trainer.seed)

    def _train_batches(self):
        """Yield (epoch, batch index, DataProto) from the resume position on; the order is a `RepeatSampler`'s
        (seeded by data.seed and the epoch, an incomplete last batch dropped)."""
        bs = self.config.data.train_batch_size
        if self.domain_sampler is not None:  # data.domains: each batch takes every domain's quota from its own order
            yield from self._domain_batches(len(self.train_dataset) // bs)
            return
        data = self.config.data
        for epoch, b, batch in iter_train_batches(self.train_dataset, self.collate_fn, bs, shuffle=data.shuffle,
                                                  seed=self._data_seed(), epoch=self.epoch, batch_in_epoch=self.batch_in_epoch,
                                                  num_workers=self.num_workers):  # fmt: skip
            self._data_position = (epoch, b + 1)  # where a resume continues once this batch is used
            yield epoch, b, DataProto.from_single_dict(batch)

    def _domain_batches(self, batches_per_epoch: int):
        while True:
            epoch, b = divmod(self.domain_sampler.batches, batches_per_epoch)
            rows = self.train_dataset.global_rows(self.domain_sampler.draw())
            self._data_position = divmod(self.domain_sampler.batches, batches_per_epoch)
            yield epoch, b, self._batch_from_rows(rows, self.train_dataset)

    def _draw_prompts(self, counts: dict[str, int]) -> DataProto:
        """More prompts for dynamic sampling: `counts` rows of each named domain, or the next batch."""
        if self.domain_sampler is None:
            return next(self._batch_iter)[2]
        rows = self.train_dataset.global_rows(self.domain_sampler.draw(counts))
        return self._batch_from_rows(rows, self.train_dataset)

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
        output = self.rollout_wg.generate_sequences(gen_input)
        batch.pop(batch_keys=["input_ids", "attention_mask", "position_ids"])
        output.meta_info.pop("metrics", None)
        return batch.union(output)

    def _score_with_reward_model(self, batch: DataProto) -> DataProto:
        """`batch` with the reward model's `rm_scores` (bs, response_length) added, when a reward model is used;
        the reward manager then returns them as the scores (or hands them to a custom reward function)."""
        if self.rm_wg is None or "rm_scores" in batch.batch.keys():
            return batch
        return batch.union(self.rm_wg.compute_rm_score(batch))

    # ---------------------------------------------------------------- validation
    def _validate(self) -> dict[str, float]:
        """verl's validation pass: n sampled answers per validation prompt (and a greedy one with
        `trainer.val_greedy`), scored; the metrics `validation.validate` returns."""
        return validation.validate(self)

    # ---------------------------------------------------------------- checkpoints
    def _step_record(self, metrics: dict[str, Any], timing: dict[str, float], epoch: int) -> dict[str, Any]:
        """The step's line of the log: its metrics plus timing, throughput and system metrics."""
        record = {**metrics, **self._timing_metrics(timing)}
        record.update(self._system_metrics())
        record["training/epoch"] = epoch
        return record

    def _timing_metrics(self, timing: dict[str, float]) -> dict[str, float]:
        """verl's timing and throughput metrics of the step from its phase timings."""
        return {
            **compute_timing_metrics(self._last_batch, timing),
            **compute_throughout_metrics(self._last_batch, timing, self.n_workers),
        }

    def _save_checkpoint(self, step_metrics: dict[str, Any] | None = None) -> str:
        """Save the actor (and critic) and the trainer's state into a staging folder, then commit it. `step_metrics`
        (the step's log line) is kept in the state, so a run killed after the commit but before the line reached the
        log gets it back when it resumes (`_restore_lost_step_metrics`)."""
        root = self.run_dir
        staging = ckpt.begin_checkpoint(root, self.global_steps)
        save_hf = "hf_model" in list(self.config.actor_rollout_ref.actor.checkpoint.save_contents)
        try:
            parts = {"actor": self.actor_rollout_wg.save_checkpoint(
                os.path.join(staging, "actor"), global_step=self.global_steps, save_hf=save_hf
            )}  # fmt: skip
            if self.use_critic:
                parts["critic"] = self.critic_wg.save_checkpoint(
                    os.path.join(staging, "critic"), global_step=self.global_steps
                )
        except NonFiniteWeightsError as err:  # NaN/inf weights are never saved; the last checkpoint stays latest
            shutil.rmtree(staging, ignore_errors=True)
            raise failures.refuse_nonfinite_checkpoint(err, ckpt.find_latest_checkpoint(root)) from None
        state = {
            "global_steps": self.global_steps,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
            "kl_coef": None if self.kl_ctrl_in_reward is None else self.kl_ctrl_in_reward.value,
            "domain_sampler": None if self.domain_sampler is None else self.domain_sampler.state_dict(),
            "rlvr": None if self.rlvr is None else self.rlvr.state_dict(),  # running reward moments per domain
            "step_metrics": step_metrics,
        }
        ckpt.check_parts_visible(staging, parts, self.global_steps, root)  # every rank's files where we commit
        torch.save(state, os.path.join(staging, "trainer_state.pt"))
        keep_actor, keep_critic = ckpt.retention_limits(self.config.trainer)
        final = ckpt.commit_checkpoint(root, self.global_steps, max_to_keep=keep_actor, max_critic_to_keep=keep_critic)
        self.checkpoint_callback.on_save(trainer=self, global_step=self.global_steps, checkpoint_dir=final)
        return final

    def _restore_lost_step_metrics(self, logger: Tracking, log_dir: str) -> None:
        """Log the resumed step's metrics again when `<log_dir>/metrics.jsonl` lacks them: the run that saved the
        checkpoint died between committing it and writing the step's line."""
        record, path = self._resumed_step_metrics, os.path.join(log_dir, "metrics.jsonl")
        if not record or not os.path.isfile(path):
            return
        if all(row.get("step") != self.global_steps for row in read_metrics(path)):
            logger.log(record, step=self.global_steps)

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
        ckpt.check_resumable(path, need_critic=self.use_critic)
        print(f"resuming from {path}")
        self.actor_rollout_wg.load_checkpoint(os.path.join(path, "actor"))
        if self.use_critic:
            self.critic_wg.load_checkpoint(os.path.join(path, "critic"))
        state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
        self.global_steps = state["global_steps"]
        self.epoch, self.batch_in_epoch = state["epoch"], state["batch_in_epoch"]
        self.nonfinite_in_a_row = state.get("nonfinite_in_a_row", 0)
        self._resumed_step_metrics = state.get("step_metrics")
        if self.kl_ctrl_in_reward is not None and state.get("kl_coef") is not None:
            self.kl_ctrl_in_reward.value = state["kl_coef"]
        if self.domain_sampler is not None and state.get("domain_sampler") is not None:
            self.domain_sampler.load_state_dict(state["domain_sampler"])
        if self.rlvr is not None and state.get("rlvr") is not None:
            self.rlvr.load_state_dict(state["rlvr"])
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
        prompts, batch = batch, batch.repeat(n, interleave=True)
        with marked_timer("gen", timing):
            batch = self._generate(batch, validate=False, seed=cfg.actor_rollout_ref.rollout.seed + self.global_steps)
        batch, rejected = drop_rejected_rows(batch, n)  # samples a rollout workflow rejected (see its rule)
        metrics.update(rejected)
        remax = cfg.algorithm.adv_estimator == core_algos.AdvantageEstimator.REMAX
        if remax and "reward_baselines" not in batch.batch.keys():  # (the remax workflow gives its own)
            with marked_timer("gen_max", timing):  # the greedy response's reward is the baseline (per uid)
                greedy = self._score_with_reward_model(self._generate(prompts, validate=False, seed=0, do_sample=False))
                scores = compute_reward(greedy, self.reward_fn)[0].sum(-1).tolist()
            baseline = dict(zip(greedy.non_tensor_batch["uid"], scores))
            batch.batch["reward_baselines"] = torch.tensor([baseline[u] for u in batch.non_tensor_batch["uid"]])
        if "response_mask" not in batch.batch.keys():
            resp_len = batch.batch["responses"].shape[-1]
            batch.batch["response_mask"] = batch.batch["attention_mask"][:, -resp_len:]
        if "token_level_scores" not in batch.batch.keys():  # a rollout workflow may score its own episodes
            with marked_timer("reward", timing):
                batch = self._score_with_reward_model(batch)
                reward_tensor, reward_extra = compute_reward(batch, self.reward_fn)
                batch.batch["token_level_scores"] = reward_tensor
                for key, values in (reward_extra or {}).items():
                    if len(values) == len(batch):
                        batch.non_tensor_batch[key] = np.array(values, dtype=object)
                        self.reward_extra_keys.add(key)  # columns of the rollout dump
                        metrics.update(_mean_metric(f"reward_extra/{key}", values))
        return batch

    def _rollout_score_and_filter(self, batch: DataProto, timing: dict[str, float], metrics: dict) -> DataProto:
        """`_rollout_and_score`, then (when `self.rlvr` is set) the sample mask, dynamic sampling (calling it again
        on new prompts) and per-domain reward processing of verl/trainer/ppo/rlvr.py."""
        if self.rlvr is None:
            return self._rollout_and_score(batch, timing, metrics)
        rollout = lambda prompts: self._rollout_and_score(prompts, timing, metrics)  # noqa: E731
        return self.rlvr.run(batch, rollout, self._draw_prompts, metrics)

    def _system_metrics(self) -> dict[str, float]:
        """`system/{worker}/{cpu_percent,rss_gb,...}` of the driver, each actor/rollout rank and the reward workers."""
        metrics = prefixed("driver", process_metrics())
        for rank, values in enumerate(self.actor_rollout_wg.get_system_metrics()):
            metrics.update(prefixed(f"actor_rollout_rank{rank}", values))
        if self.reward_pool is not None:
            metrics.update(self.reward_pool.system_metrics())
        return metrics

    def _train_step(self, batch: DataProto, timing: dict[str, float]) -> dict[str, float]:
        cfg = self.config
        metrics: dict[str, float] = {}
        n = cfg.actor_rollout_ref.rollout.n
        if self.async_rollout is not None:  # generated earlier on the rollout group; starts a later step's batch
            batch = self.async_rollout.begin_step(batch, self.global_steps, timing, metrics)
        else:
            batch = self._rollout_score_and_filter(batch, timing, metrics)
        if cfg.trainer.balance_batch:  # equal token counts per rank (verl's balance_batch)
            batch = balance_batch(batch, self.actor_rollout_wg.world_size)
        rollout_corr = cfg.algorithm.rollout_correction  # verl: bypass reuses the rollout's log-probs
        bypass = rollout_corr is not None and bool(rollout_corr.bypass_mode)
        with marked_timer("old_log_prob", timing):
            if bypass:
                corr_helper.apply_bypass_mode(batch, rollout_corr, cfg.actor_rollout_ref.actor.policy_loss)
            elif not cfg.actor_rollout_ref.actor.recompute_old_log_prob and self.async_rollout is None:
                # the hf rollout sampled with the actor's own weights and dtype (the worker checks it), so its
                # log-probs are the old policy's: no forward pass (actor/entropy then comes from the update)
                batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
            else:
                old = self.actor_rollout_wg.compute_log_prob(batch)
                metrics.update(reduce_metrics(old.meta_info.pop("metrics", {})))
                if "entropys" in old.batch.keys():
                    ent = old.batch.pop("entropys")
                    metrics["actor/entropy"] = core_algos.agg_loss(
                        ent, batch.batch["response_mask"], "token-mean"
                    ).item()
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
            if not bypass:  # decoupled mode: IS weights, rejection and rollout_corr/* metrics against old_log_probs
                batch, corr_metrics = corr_helper.compute_rollout_correction_and_add_to_batch(batch, rollout_corr)
                metrics.update(corr_metrics)
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
        if self.async_rollout is not None:  # waits for the background generation, then sends the new weights
            self.async_rollout.end_step(self.global_steps, timing)
        metrics.update(compute_data_metrics(batch, use_critic=self.use_critic))
        metrics.update(compute_spec_decode_metrics(*(batch.non_tensor_batch.get(k) for k in SPEC_DECODE_KEYS)))
        if cfg.algorithm.adv_estimator == "gdpo":  # each reward component GDPO normalised on its own
            metrics.update(compute_gdpo_metrics(batch, cfg.algorithm.gdpo_reward_keys or []))
        if self.rlvr is not None:  # verifier scores as critic/score/*, every data metric per domain
            metrics.update(compute_domain_metrics(batch, self.use_critic, self.rlvr.extra_keys, self.rlvr.domain_key))
        self._last_batch = batch
        return metrics

    def _check_nonfinite(self, metrics: dict[str, float]) -> None:
        limit = self.config.trainer.max_nonfinite_steps
        self.nonfinite_in_a_row = failures.count_nonfinite_steps(self.nonfinite_in_a_row, metrics, limit, self.run_dir)

    # ---------------------------------------------------------------- the loop
    def _train_loop(self, logger: Tracking, bar: tqdm, summary: dict[str, Any]) -> dict[str, float]:
        """Steps from the resume point to `total_training_steps`, validating, saving and logging at their
        intervals; returns the last validation metrics."""
        cfg = self.config
        last_val: dict[str, float] = {}
        save_freq, test_freq = cfg.trainer.save_freq, cfg.trainer.test_freq
        if self.global_steps < self.total_training_steps:
            self._batch_iter = self._train_batches()  # dynamic sampling draws more prompts from the same iterator
            batches = self._batch_iter if self.async_rollout is None else self.async_rollout.lookahead(self._batch_iter)
            for epoch, _, batch in batches:
                self.global_steps += 1
                timing: dict[str, float] = {}
                with failures.at_step(self.global_steps), marked_timer("step", timing):
                    metrics = self._train_step(batch, timing)
                self.epoch, self.batch_in_epoch = self._data_position
                self.max_steps_duration = max(self.max_steps_duration, timing["step"])
                self._check_nonfinite(metrics)
                generation_dump.dump_rollout(cfg.trainer, self.tokenizer, self._last_batch, self.reward_extra_keys,
                                             self.global_steps)  # fmt: skip
                is_last = self.global_steps >= self.total_training_steps
                if self.val_reward_fn is not None and (
                    (test_freq > 0 and self.global_steps % test_freq == 0) or is_last
                ):
                    with marked_timer("testing", timing):
                        last_val = self._validate()
                    metrics.update(last_val)
                    logger.log_generations(self.val_generations, step=self.global_steps)
                expiring = ckpt.esi_save_due(cfg.trainer, self.max_steps_duration)  # verl's ESI: save before expiry
                record = self._step_record(metrics, timing, epoch)
                if (
                    save_freq is not None
                    and save_freq >= 0
                    and ((save_freq > 0 and self.global_steps % save_freq == 0) or is_last or expiring)
                ):
                    with (
                        failures.at_step(self.global_steps),
                        marked_timer("save_checkpoint", timing),
                    ):  # all but its own time
                        summary["last_checkpoint"] = self._save_checkpoint(record)
                    record.update(self._timing_metrics(timing))  # now with the save's time
                logger.log(record, step=self.global_steps)
                bar.update(1)
                if is_last:
                    break
        return last_val

    def fit(self) -> dict[str, Any]:
        """Train for `total_training_steps` steps; return a summary dict (also printed)."""
        cfg = self.config
        log_dir = cfg.trainer.log_dir or os.path.join(self.run_dir, "logs")
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
        try:
            resumed_from = self._load_checkpoint()
            if resumed_from is not None:
                self._restore_lost_step_metrics(logger, log_dir)
            bar.update(self.global_steps)
            summary: dict[str, Any] = {"resumed_from": resumed_from, "log_dir": log_dir, "run_dir": self.run_dir}
            val, val_only = {}, bool(cfg.trainer.val_only and cfg.trainer.val_before_train)
            if self.val_reward_fn is not None and cfg.trainer.val_before_train and (self.global_steps == 0 or val_only):
                val = self._validate()
                summary["val_before"] = val.get("val/reward/mean")
                summary["val_core_before"] = {k: v for k, v in val.items() if k.startswith("val-core/")}
                logger.log(val, step=self.global_steps)
                logger.log_generations(self.val_generations, step=self.global_steps)
            last_val = val if val_only else self._train_loop(logger, bar, summary)  # val_only: validate and exit
        finally:  # an exception or Ctrl-C still closes the bar and flushes the logs
            if getattr(self, "_batch_iter", None) is not None:
                self._batch_iter.close()  # stops the DataLoader workers
            bar.close()
            logger.finish()
        summary.update(
            {
                "steps": self.global_steps,
                "wall_time_s": round(time.time() - start_time, 1),
                "val_after": last_val.get("val/reward/mean"),
                "val_core_after": {k: v for k, v in last_val.items() if k.startswith("val-core/")},
            }
        )
        if self.finish_after_workers_stop:  # main_ppo.run_ppo calls finish_run once the workers are gone
            return summary
        return finish_run(summary)


def finish_run(summary: dict[str, Any]) -> dict[str, Any]:
    """The end of a run: its curves drawn into a PNG beside the logs (`summary["plot"]`), and the summary printed.
    `main_ppo.run_ppo` calls it after Ray has stopped the workers: matplotlib's memory then never adds to the
    run's peak memory, which the workers' retained memory sets until they stop."""
    try:
        from verl.utils.plot import plot_run

        summary["plot"] = plot_run(summary["log_dir"])
    except Exception as e:  # a plot must never cost a finished run
        summary["plot"] = f"not drawn: {e}"
    validation.print_summary(summary)
    return summary


def _mean_metric(key: str, values) -> dict[str, float]:
    nums = [
        float(v) for v in values if isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool)
    ]
    nums = [v for v in nums if math.isfinite(v)]
    return {f"{key}/mean": float(np.mean(nums))} if nums else {}
