"""FSDP2 workers: the actor/rollout/reference, the critic and the reward model of one rank, as `Worker`s.

Owns `ActorRolloutRefWorker`, `CriticWorker` (`RewardModelWorker` lives in reward_model_worker.py and is
re-exported here, verl's import path): loading models from `model.path`, FSDP2 wrapping, AdamW + LR schedule,
the worker-side config normalisation (mini/micro batch sizes per rank; the checks live in `worker_config.py`),
weight sync from the actor to the rollout engine after every update (`model_update`), checkpoints, and the
`@register`ed methods a worker group calls. The maths lives in layer 5 (`DataParallelPPOActor`,
`DataParallelPPOCritic`, the rollout engines); this file only wires it up.

Design choices:
- The `hf` rollout engine generates with the actor's own FSDP2 module (gathered for the call) when it computes in
  the actor's dtype: no second copy, no weight sync. Otherwise (another `rollout.dtype`) it gets its own copy,
  which the actor's weights are written into after every update (and after loading a checkpoint) from the FSDP2
  shards (`verl.workers.weight_sync`: in place, no gather). `vllm`/`sglang` (`builds_from_path`) load
  `model.path` themselves (with `rollout.load_format`, verl's default `dummy`: random weights) and receive the
  weights in buckets of `rollout.checkpoint_engine.update_weights_bucket_megabytes` right after `init_model` and
  after every update.
- `fsdp_config` (verl's keys): `model_dtype` is the dtype of the FSDP module's parameters (the actor's master
  weights; verl fp32), `reshard_after_forward`, `fsdp_size` (hybrid sharding), `forward_prefetch`, `wrap_policy`
  (`min_num_params` / `transformer_layer_cls_to_wrap`); on CUDA `param_offload` is FSDP2's `CPUOffloadPolicy` and
  `optimizer_offload` moves the optimizer state to CPU between updates (on CPU both print one notice). The
  critic reads `critic.fsdp`, then `critic.fsdp_config`, then `critic.model.fsdp_config`.
- Async mode (`trainer.rollout_mode=async`): the actor group has role `actor`/`actor_ref` (no engine) and a
  standalone `rollout` group generates; the trainer streams the weights bucket by bucket
  (`export_actor_weight_bucket` on the actor group, `begin_rollout_weight_load` / `load_rollout_weight_bucket` /
  `finish_rollout_weight_load(version)` on the rollout group; `verl.workers.weight_stream`), after which every
  generated token carries `rollout_versions` = version (-1 on padding).
- LoRA (`model.lora_rank` > 0, `verl.workers.lora`): peft adapters on the actor and on the rollout copy; only
  the adapters train and are synced (vllm/sglang get the merged weights instead); the reference policy is the
  actor with its adapters disabled.
- `training/rollout_probs_diff_max` / `_mean` (|exp(rollout_log_probs) - exp(old_log_probs)| over response
  tokens, reduced over all ranks) are returned by `compute_log_prob` in `meta_info["metrics"]` when the batch
  holds `rollout_log_probs`: that is where the rollout's and the actor's log-probs of the same weights meet.
- Mixed precision (verl's `fsdp_config.mixed_precision` {param_dtype, reduce_dtype, buffer_dtype}, over
  `fsdp_config.dtype`; rules in `verl.utils.mixed_precision`): the actor and critic keep master weights and
  optimizer state in `model_dtype` (fp32) and compute in the param dtype through FSDP2's `MixedPrecisionPolicy`;
  the reference is loaded in a low-precision compute dtype, the `hf` rollout copy in `rollout.dtype`. An explicit
  `mixed_precision.param_dtype=bf16` computes in bf16 on CPU too.
- Torch threads follow `VERL_NUM_THREADS` (set by the worker group; read by `Worker.__init__`).

Layer 7: imports layers 1-6; must not import trainer code.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn

from verl.protocol import DataProto
from verl.single_controller.base import Dispatch, Worker, register
from verl.single_controller.base.worker import node_label
from verl.utils.config import omega_conf_to_dataclass, plain_config
from verl.utils.device import get_device_name
from verl.utils.flops_counter import compute_mfu
from verl.utils.import_utils import import_external_libs
from verl.utils.mixed_precision import canonical_dtype
from verl.utils.system_metrics import phase_memory
from verl.workers.config import FSDPActorConfig, FSDPCriticConfig, HFModelConfig, RolloutConfig
from verl.workers.lora import apply_lora, disabled_adapters, lora_rank
from verl.workers.rollout import BaseRollout, get_rollout_class, resolve_rollout_engine
from verl.workers.rollout.workflows import RolloutWorkflow, build_workflow, rollout_batch
from verl.workers.worker_config import (
    check_old_log_prob_reuse,
    check_supported,
    compute_dtype,
    critic_fsdp_config,
    normalize_batch_sizes,
    private_config,
    require_dir_on_node,
    require_positive_int,
)

# The training stack (FSDP2 and DTensor, the engines, the PPO actor and critic, HF's model code, the weight
# streams) is imported by the methods that build or use it, which run in the worker processes: the driver imports
# this module for the worker classes only, and would otherwise hold ~110 MB of those imports for the whole run.
if TYPE_CHECKING:
    from verl.workers.actor.dp_actor import DataParallelPPOActor
    from verl.workers.critic.dp_critic import DataParallelPPOCritic
    from verl.workers.weight_stream import BucketExporter

ACTOR_ROLLOUT_REF_ROLES = ("actor", "rollout", "ref", "actor_rollout", "actor_rollout_ref", "actor_ref")

__all__ = ["ACTOR_ROLLOUT_REF_ROLES", "ActorRolloutRefWorker", "CriticWorker", "RewardModelWorker"]


def _accepts(cls: type, keyword: str) -> bool:
    """Whether `cls(...)` takes the keyword argument `keyword` (by name or through **kwargs)."""
    import inspect

    params = inspect.signature(cls).parameters.values()
    return any(p.name == keyword or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def saved_files(local_path: str, rank: int) -> dict[str, Any]:
    """What `rank` wrote into a checkpoint folder, as seen where it runs: its `*_rank_{rank}.pt` files and, on rank
    0, `huggingface/`; `{"rank", "node", "files"}` (the driver checks that it sees them before committing)."""
    import os

    names = (
        sorted(f for f in os.listdir(local_path) if f.endswith(f"_rank_{rank}.pt")) if os.path.isdir(local_path) else []
    )
    if rank == 0 and os.path.isdir(os.path.join(local_path, "huggingface")):
        names.append("huggingface")
    return {"rank": rank, "node": node_label(), "files": names}


def _freeze(module: nn.Module) -> nn.Module:
    module.requires_grad_(False)
    return module.eval()


def _metrics_output(metrics: dict) -> DataProto:
    """A DataProto with no rows that carries `meta_info["metrics"]` (what the update methods return)."""
    return DataProto.from_dict(meta_info={"metrics": metrics})


def rollout_probs_diff_metrics(
    rollout_log_probs: torch.Tensor, actor_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """max and mean of |exp(rollout_log_probs) - exp(actor_log_probs)| over response tokens of all ranks.

    All tensors (bs, response_len). A collective when torch.distributed is initialised: every rank calls it.
    """
    mask = response_mask.bool()
    diff = (rollout_log_probs.float().exp() - actor_log_probs.float().exp()).abs()
    diff_max = torch.tensor([diff[mask].max().item() if mask.any() else 0.0], dtype=torch.float64)
    sums = torch.tensor([diff[mask].sum().item(), float(mask.sum().item())], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        diff_max, sums = diff_max.to(device), sums.to(device)
        dist.all_reduce(diff_max, op=dist.ReduceOp.MAX)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    return {
        "training/rollout_probs_diff_max": float(diff_max[0]),
        "training/rollout_probs_diff_mean": float(sums[0] / max(sums[1].item(), 1.0)),
    }


def _response_mask(data: DataProto) -> torch.Tensor:
    if "response_mask" in data.batch.keys():
        return data.batch["response_mask"]
    return data.batch["attention_mask"][:, -data.batch["responses"].shape[-1] :]


def _with_meta(data: DataProto, **meta: Any) -> DataProto:
    """The same rows with `meta` added to a copy of meta_info (the caller's DataProto is left alone)."""
    return DataProto(batch=data.batch, non_tensor_batch=data.non_tensor_batch, meta_info={**data.meta_info, **meta})


# ----------------------------------------------------------------------------------------------- actor
class ActorRolloutRefWorker(Worker):
    """Actor, rollout engine and/or reference policy of one rank, sharing one process.

    config: the `actor_rollout_ref` section (model, actor, ref, rollout). role: one of
    `ACTOR_ROLLOUT_REF_ROLES`. Call `init_model` (all ranks) before anything else.
    """

    def __init__(self, config: Any, role: str):
        super().__init__()
        if role not in ACTOR_ROLLOUT_REF_ROLES:
            raise ValueError(f"unknown ActorRolloutRefWorker role {role!r}; allowed: {list(ACTOR_ROLLOUT_REF_ROLES)}")
        self.role = role
        self._is_actor = role in ("actor", "actor_rollout", "actor_rollout_ref", "actor_ref")
        self._is_rollout = role in ("rollout", "actor_rollout", "actor_rollout_ref")
        self._is_ref = role in ("ref", "actor_rollout_ref", "actor_ref")
        self.config = private_config(config)
        self.device_name = get_device_name(self.config.get("device") or "auto")
        check_supported(self.config.model)
        # verl's typed sections (defaults in one place); the DictConfig stays for what the worker writes back
        self.model_config = omega_conf_to_dataclass(self.config.model, HFModelConfig)
        self.rollout_config = omega_conf_to_dataclass(self.config.rollout, RolloutConfig)
        self.ref_config = omega_conf_to_dataclass(
            {**plain_config(self.config.get("ref")), "role": "ref"}, FSDPActorConfig
        )
        self.use_lora = lora_rank(self.config.model) > 0
        if self._is_actor:
            check_old_log_prob_reuse(self.config)
            n = require_positive_int(self.rollout_config.n, "rollout.n")
            normalize_batch_sizes(self.config.actor, n, self.world_size, "actor")
            key = "rollout.log_prob_micro_batch_size_per_gpu"
            require_positive_int(self.rollout_config.log_prob_micro_batch_size_per_gpu, key)
        if self._is_ref:
            key = "ref.log_prob_micro_batch_size_per_gpu"
            require_positive_int(self.ref_config.log_prob_micro_batch_size_per_gpu, key)
        self.tokenizer = None
        self.actor: DataParallelPPOActor | None = None
        self.rollout: BaseRollout | None = None
        self.workflow: RolloutWorkflow | None = None  # rollout.workflow (null: call the engine directly)
        self.ref_policy: DataParallelPPOActor | None = None
        self.rollout_version: int | None = None  # policy version of a standalone rollout's weights (async mode)
        self._weight_exporter: BucketExporter | None = None  # async mode: the actor's side of the weight stream

    # ------------------------------------------------------------------ building
    def _load_policy(self, dtype: str) -> nn.Module:
        from verl.utils import fsdp_utils
        from verl.workers.engine.fsdp.transformer_impl import attn_implementation

        model_cfg = self.config.model
        return fsdp_utils.load_causal_lm(
            model_cfg.path,
            dtype=dtype,
            attn_implementation=attn_implementation(model_cfg, self.device_name),
            trust_remote_code=self.model_config.trust_remote_code,
            override_config=self.model_config.override_config,
        )

    def _forward_config(self, section: Any, role: str = "actor") -> DictConfig:
        """`section` (actor or ref config) with the model's forward-layout flags copied in, and its role."""
        section = private_config(section or {})
        for key in ("use_remove_padding", "share_prompt_prefix"):
            section[key] = getattr(self.model_config, key)
        section["role"] = role
        return section

    def _build_actor(self) -> None:
        """The actor's training engine (`FSDPEngineWithLMHead`: master weights and optimizer state in
        `fsdp_config.model_dtype`, compute in `mixed_precision.param_dtype`/`dtype`, LoRA, AdamW + schedule) and the
        PPO actor that runs its updates on it."""
        from verl.workers.actor.dp_actor import DataParallelPPOActor
        from verl.workers.engine.fsdp import FSDPEngineWithLMHead

        actor_cfg = self.config.actor = self._forward_config(self.config.actor)
        typed = omega_conf_to_dataclass(actor_cfg, FSDPActorConfig)
        optim_cfg = {**private_config(actor_cfg.optim), "clip_grad": typed.grad_clip}
        self.actor_engine = FSDPEngineWithLMHead(
            self.config.model,
            actor_cfg.fsdp_config,
            optim_cfg,
            actor_cfg.checkpoint,
            device=self.device_name,
            tokenizer=self.tokenizer,
            where="actor_rollout_ref.actor.fsdp_config",
        )
        self.actor_engine.initialize()
        self.actor_module = self.actor_engine.module
        self.actor_optimizer = self.actor_engine.optimizer
        self.actor_lr_scheduler = self.actor_engine.lr_scheduler
        self.offload_actor_optimizer = self.actor_engine.is_optimizer_offload_enabled
        self.actor = DataParallelPPOActor(actor_cfg, self.actor_module, self.actor_optimizer, engine=self.actor_engine)

    def _rollout_engine_name(self, announce: bool = False) -> str:
        """The rollout engine this worker runs (or, for an actor without one, the engine its rollout group runs on
        the same kind of machine): `rollout.name`, or `hf` where that engine cannot run on this worker's device
        (`resolve_rollout_engine`; a ValueError with `rollout.engine_fallback=false`). Written back into the
        config; with `announce`, rank 0 prints the notices."""
        updates, notices = resolve_rollout_engine(self.config.rollout, self.device_name)
        if announce and self.rank == 0:
            for line in notices:
                print(line, file=sys.stderr, flush=True)
        self.config.rollout.name = updates["name"]
        return updates["name"]

    def _build_rollout(self) -> BaseRollout:
        from verl.utils import fsdp_utils

        rollout_cfg = self.config.rollout
        rollout_cls = get_rollout_class(self._rollout_engine_name(announce=True))
        if getattr(rollout_cls, "builds_from_path", False):  # vllm, sglang: the engine loads model.path itself
            trust = self.model_config.trust_remote_code
            extra = {"device": self.device_name} if _accepts(rollout_cls, "device") else {}  # a user's may not
            engine = rollout_cls(self.config.model.path, rollout_cfg, self.tokenizer, trust_remote_code=trust, **extra)
            if self.rank == 0 and hasattr(engine, "print_notices"):
                engine.print_notices()
            return engine
        actor_dtype = compute_dtype(self.config.actor.fsdp_config) if self.actor is not None else None
        dtype = canonical_dtype(self.rollout_config.dtype or actor_dtype or "float32", "rollout.dtype")
        if self.actor is not None and dtype == actor_dtype and getattr(rollout_cls, "accepts_sharded_module", False):
            return rollout_cls(self.actor_module, rollout_cfg, self.tokenizer)  # no copy, no sync: hf_rollout.py
        module = self._load_policy(dtype)
        if self.use_lora:  # the same adapters; `_sync_rollout_weights` sends only them
            module = apply_lora(module, self.config.model)
        module = fsdp_utils.materialize_parameters(_freeze(module)).to(self.device_name)  # rewritten by every sync
        return rollout_cls(module, rollout_cfg, self.tokenizer)

    def _build_ref(self) -> None:
        from verl.workers.actor.dp_actor import DataParallelPPOActor
        from verl.workers.engine.fsdp import FSDPEngineWithLMHead
        from verl.workers.engine.fsdp.transformer_impl import model_dtype

        if self.use_lora and self.actor is not None:  # the reference is the actor's base: adapters disabled
            self.ref_policy = DataParallelPPOActor(
                self._forward_config(self.config.get("ref"), "ref"), self.actor_module
            )
            return
        ref_section = self.config.get("ref") or {}
        fsdp_cfg = private_config(ref_section.get("fsdp_config") or self.config.actor.fsdp_config)
        dtype = compute_dtype(fsdp_cfg)
        # frozen: loading in the low-precision one of (model_dtype, compute dtype) gives the same forward
        fsdp_cfg.model_dtype = dtype if dtype != "float32" else model_dtype(fsdp_cfg)  # compute_dtype: canonical
        model_cfg = {**private_config(self.config.model), "lora_rank": 0}  # the reference has no adapters
        engine = FSDPEngineWithLMHead(
            model_cfg, fsdp_cfg, device=self.device_name, where="actor_rollout_ref.ref.fsdp_config", forward_only=True
        )
        engine.initialize()
        self.ref_module = _freeze(engine.module)
        self.ref_policy = DataParallelPPOActor(
            self._forward_config(self.config.get("ref"), "ref"), self.ref_module, engine=engine
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Start torch.distributed and load the models of this worker's role (all ranks together)."""
        from transformers import AutoTokenizer

        from verl.utils import fsdp_utils
        from verl.workers.weight_stream import BucketLoader

        model_cfg = self.config.model
        import_external_libs(self.model_config.external_lib, "actor_rollout_ref.model.external_lib")
        require_dir_on_node(model_cfg.path, "actor_rollout_ref.model.path", self.rank)
        fsdp_utils.init_distributed()
        self.tokenizer = AutoTokenizer.from_pretrained(
            model_cfg.path, trust_remote_code=self.model_config.trust_remote_code
        )
        if self._is_actor:
            self._build_actor()
        if self._is_rollout:
            self.rollout = self._build_rollout()
            self._weight_loader = BucketLoader(self.rollout)
            self.workflow = build_workflow(self.config.rollout, self.tokenizer)
        if self._is_ref:
            self._build_ref()
        engine_loads_path = getattr(self.rollout, "builds_from_path", False)
        if (self.use_lora or engine_loads_path) and self.actor is not None and self.rollout is not None:
            # LoRA: the two copies' fresh adapters differ (B = 0 in both, A random); vllm/sglang: built with
            # rollout.load_format (verl's default `dummy` = random weights) until they get the actor's
            self._sync_rollout_weights()

    def _require(self, part: Any, method: str, roles: str) -> None:
        if part is None:
            raise RuntimeError(
                f"{method} needs a worker of role {roles}, initialised with init_model; this worker has role "
                f"{self.role!r}" + (" and init_model was not called" if self.tokenizer is None else "")
            )

    def _sync_rollout_weights(self) -> None:
        """model_update: the actor's weights into the rollout engine's copy (with LoRA only the adapters, or the
        merged weights for vllm/sglang; `verl.workers.weight_sync`); nothing when the engine generates with the
        actor's own module. Collective."""
        from verl.workers import weight_sync

        if getattr(self.rollout, "module", None) is self.actor_module:
            return
        weight_sync.sync_rollout_weights(self.actor_module, self.rollout, self.config.rollout, self.use_lora)

    def _temperature(self) -> float:
        return float(self.rollout_config.temperature)

    # ------------------------------------------------------------------ group methods
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """One response per prompt row (the trainer repeats prompts `rollout.n` times first); see
        `verl.workers.rollout.base.build_rollout_output` for the fields. Returned on CPU."""
        self._require(self.rollout, "generate_sequences", "rollout, actor_rollout or actor_rollout_ref")
        if self.workflow is None:
            output = self.rollout.generate_sequences(prompts).to("cpu")
        else:  # one episode per row, batched requests (verl.workers.rollout.workflows); may add rollout_accepted
            data = _with_meta(prompts, policy_version=self.rollout_version)
            output = rollout_batch(self.rollout, data, self.workflow).to("cpu")
        if self.rollout_version is not None:  # standalone rollout: every token carries its policy version
            output.batch["rollout_versions"] = token_versions(_response_mask(output), self.rollout_version)
        return output

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """`old_log_probs` and `entropys` (bs, response_len) under the current actor at `rollout.temperature`, plus
        `sum_pi_squared` (bs, response_len) when `actor.calculate_sum_pi_squared` (for optimal_token_baseline).

        meta_info["metrics"] gets `training/rollout_probs_diff_max`/`_mean` when `rollout_log_probs` is present.
        """
        self._require(self.actor, "compute_log_prob", "actor, actor_rollout or actor_rollout_ref")
        rollout_cfg = self.rollout_config
        data = _with_meta(
            data,
            temperature=self._temperature(),
            micro_batch_size=rollout_cfg.log_prob_micro_batch_size_per_gpu,
            use_dynamic_bsz=rollout_cfg.log_prob_use_dynamic_bsz,
            max_token_len=rollout_cfg.log_prob_max_token_len_per_gpu,
        )
        with_sum_pi_squared = self.actor.config.calculate_sum_pi_squared
        outputs = self.actor.compute_log_prob(
            data, calculate_entropy=True, calculate_sum_pi_squared=with_sum_pi_squared
        )
        tensors = dict(zip(("old_log_probs", "entropys", "sum_pi_squared"), (t.cpu() for t in outputs)))
        metrics = {}
        if "rollout_log_probs" in data.batch.keys():
            metrics = rollout_probs_diff_metrics(
                data.batch["rollout_log_probs"], tensors["old_log_probs"], _response_mask(data)
            )
        return DataProto.from_dict(tensors=tensors, meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """`ref_log_prob` (bs, response_len) under the frozen reference model at `rollout.temperature`."""
        self._require(self.ref_policy, "compute_ref_log_prob", "ref or actor_rollout_ref")
        ref_cfg = self.ref_config
        data = _with_meta(
            data,
            temperature=self._temperature(),
            micro_batch_size=ref_cfg.log_prob_micro_batch_size_per_gpu,
            use_dynamic_bsz=ref_cfg.log_prob_use_dynamic_bsz,
            max_token_len=ref_cfg.log_prob_max_token_len_per_gpu,
        )
        if self.use_lora and self.ref_policy.actor_module is getattr(self, "actor_module", None):
            with disabled_adapters(self.actor_module):
                log_probs, _ = self.ref_policy.compute_log_prob(data, calculate_entropy=False)
        else:
            log_probs, _ = self.ref_policy.compute_log_prob(data, calculate_entropy=False)
        return DataProto.from_dict(tensors={"ref_log_prob": log_probs.cpu()})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_actor(self, data: DataProto) -> DataProto:
        """One PPO update of the actor on `data`, then the rollout engine gets the new weights.

        Returns no rows; meta_info["metrics"] holds the actor's metrics plus `actor/lr` (the LR used).
        """
        self._require(self.actor, "update_actor", "actor, actor_rollout or actor_rollout_ref")
        start = time.perf_counter()
        metrics = self.actor.update_policy(_with_meta(data, temperature=self._temperature()))  # engine: train mode
        seqlens = data.batch["attention_mask"].sum(-1).tolist()
        passes = self.actor.config.ppo_epochs
        metrics["perf/mfu/actor"] = compute_mfu(
            self.actor_module.config, seqlens, time.perf_counter() - start, self.device_name, passes
        )
        metrics["actor/lr"] = float(self.actor_lr_scheduler.get_last_lr()[0])
        self.actor_lr_scheduler.step()
        if self.rollout is not None:
            with phase_memory("weight_sync"):  # logged as system/actor_rollout_rank{r}/weight_sync_peak_rss_gb
                self._sync_rollout_weights()
        return _metrics_output(metrics)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str, global_step: int = 0, save_hf: bool = False) -> dict[str, Any]:
        """Save the actor's sharded weights, optimizer, LR schedule and RNG (all ranks); HF copy with save_hf.
        Returns what this rank wrote (`saved_files`)."""
        self._require(self.actor, "save_checkpoint", "actor, actor_rollout or actor_rollout_ref")
        self.actor_engine.save_checkpoint(local_path, global_step=global_step, save_hf=save_hf)
        return saved_files(local_path, self.rank)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str) -> None:
        """Restore what `save_checkpoint` wrote (same world size), then push the weights to the rollout."""
        self._require(self.actor, "load_checkpoint", "actor, actor_rollout or actor_rollout_ref")
        self.actor_engine.load_checkpoint(local_path)
        if self.rollout is not None:
            self._sync_rollout_weights()

    # ------------------------------------------------------------------ async mode: a standalone rollout group
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_actor_weight_bucket(self) -> list[tuple[str, torch.Tensor]] | None:
        """The next bucket of the actor's weights for the standalone rollout group (what its engine needs: with
        LoRA the adapters or the merged weights), as CPU tensors on rank 0 (None elsewhere); `[]` once all have
        been sent (the next call starts a new stream). Collective: `verl.workers.weight_stream`."""
        from verl.workers import weight_sync
        from verl.workers.weight_stream import BucketExporter

        self._require(self.actor, "export_actor_weight_bucket", "actor, actor_ref, actor_rollout or actor_rollout_ref")
        if self._weight_exporter is None:
            mode = weight_sync.sync_mode(get_rollout_class(self._rollout_engine_name()), self.use_lora)
            size = weight_sync.bucket_bytes(self.config.rollout)
            self._weight_exporter = BucketExporter(self.actor_module, mode, size, keep=self.rank == 0)
        return self._weight_exporter.next_bucket()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def begin_rollout_weight_load(self) -> None:
        """Open a weight stream into this rollout engine (`load_rollout_weight_bucket`, then `finish_...`)."""
        self._require(self.rollout, "begin_rollout_weight_load", "rollout, actor_rollout or actor_rollout_ref")
        self._weight_loader.begin()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_rollout_weight_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of the stream (returns once the engine has it)."""
        self._weight_loader.put(bucket)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def finish_rollout_weight_load(self, version: int) -> None:
        """Close the stream (the engine checks that every weight arrived); the responses generated from now on
        carry `rollout_versions` = `version` (the number of updates in these weights)."""
        self._weight_loader.finish()
        self.rollout_version = int(version)


def token_versions(response_mask: torch.Tensor, version: int) -> torch.Tensor:
    """(bs, response_len) int64: `version` on response tokens, -1 on padding."""
    return torch.where(response_mask.bool(), torch.full_like(response_mask, version, dtype=torch.long), -1)


# ----------------------------------------------------------------------------------------------- critic
class CriticWorker(Worker):
    """The value model of one rank. config: the `critic` section (with `rollout_n` copied in by the trainer)."""

    def __init__(self, config: Any):
        super().__init__()
        self.config = private_config(config)
        self.device_name = get_device_name(self.config.get("device") or "auto")
        n = require_positive_int(omega_conf_to_dataclass(self.config, FSDPCriticConfig).rollout_n, "critic.rollout_n")
        normalize_batch_sizes(self.config, n, self.world_size, "critic")
        self.critic_config = omega_conf_to_dataclass(self.config, FSDPCriticConfig)  # typed, after normalisation
        require_positive_int(
            self.critic_config.forward_micro_batch_size_per_gpu, "critic.forward_micro_batch_size_per_gpu"
        )
        self.critic: DataParallelPPOCritic | None = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Load the value model (`load_token_classification_model`, fresh zero head), FSDP2, AdamW, schedule."""
        from transformers import AutoTokenizer

        from verl.utils import fsdp_utils
        from verl.workers.critic.dp_critic import DataParallelPPOCritic
        from verl.workers.engine.fsdp import FSDPEngineWithValueHead

        model_cfg = self.config.model
        import_external_libs(self.critic_config.model.external_lib, "critic.model.external_lib")
        require_dir_on_node(model_cfg.path, "critic.model.path", self.rank, absolute_only=True)
        typed = self.critic_config
        require_dir_on_node(typed.model.tokenizer_path, "critic.model.tokenizer_path", self.rank, True, None)
        fsdp_utils.init_distributed()
        self.tokenizer = AutoTokenizer.from_pretrained(
            typed.model.tokenizer_path or model_cfg.path, trust_remote_code=typed.model.trust_remote_code
        )
        optim_cfg = {**private_config(self.config.optim), "clip_grad": typed.grad_clip}
        self.critic_engine = FSDPEngineWithValueHead(
            model_cfg,
            critic_fsdp_config(self.config),
            optim_cfg,
            self.config.get("checkpoint"),
            device=self.device_name,
            tokenizer=self.tokenizer,
            where="critic.fsdp",
        )
        self.critic_engine.initialize()
        self.critic_module = self.critic_engine.module
        self.critic_optimizer = self.critic_engine.optimizer
        self.critic_lr_scheduler = self.critic_engine.lr_scheduler
        self.critic = DataParallelPPOCritic(
            self.config, self.critic_module, self.critic_optimizer, engine=self.critic_engine
        )

    def _check_ready(self, method: str) -> None:
        if self.critic is None:
            raise RuntimeError(f"CriticWorker.{method} called before init_model")

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        """`values` (bs, response_len), 0 outside the response mask."""
        self._check_ready("compute_values")
        data = _with_meta(
            data,
            micro_batch_size=self.critic_config.forward_micro_batch_size_per_gpu,
            use_dynamic_bsz=self.critic_config.use_dynamic_bsz,
            max_token_len=self.critic_config.forward_max_token_len_per_gpu,
        )
        return DataProto.from_dict(tensors={"values": self.critic.compute_values(data).cpu()})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_critic(self, data: DataProto) -> DataProto:
        """One value-function update; meta_info["metrics"] holds the critic metrics plus `critic/lr`."""
        self._check_ready("update_critic")
        metrics = self.critic.update_critic(data)  # the engine's train mode brings an offloaded optimizer state
        metrics["critic/lr"] = float(self.critic_lr_scheduler.get_last_lr()[0])
        self.critic_lr_scheduler.step()
        return _metrics_output(metrics)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str, global_step: int = 0, save_hf: bool = False) -> dict[str, Any]:
        """Save the critic's sharded weights, optimizer, LR schedule and RNG (all ranks); returns `saved_files`."""
        self._check_ready("save_checkpoint")
        self.critic_engine.save_checkpoint(local_path, global_step=global_step, save_hf=save_hf)
        return saved_files(local_path, self.rank)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str) -> None:
        """Restore what `save_checkpoint` wrote (same world size)."""
        self._check_ready("load_checkpoint")
        self.critic_engine.load_checkpoint(local_path)


from verl.workers.reward_model_worker import RewardModelWorker  # noqa: E402  (verl's import path; the worker lives there)
