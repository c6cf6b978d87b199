"""The FSDP2 training engine (verl 0.9.1's `FSDPEngine`, `FSDPEngineWithLMHead`, `FSDPEngineWithValueHead`).

`FSDPEngine(model_config, engine_config, optimizer_config, checkpoint_config)` (or one `config` holding them, verl's
or AReaL's shape: `engine_config.py`) + `initialize()` builds one rank's model (LoRA with `lora_rank` > 0), shards it
with FSDP2 by verl's `fsdp_config` keys and makes AdamW and its LR schedule from verl's `optim` keys;
`from_module(...)` adopts a model and optimizer built elsewhere (what `DataParallelPPOActor(config, module,
optimizer)` does). Two ways to train on it, one engine: verl's `train_batch(data, loss_function)` / `infer_batch`
with settings as non-tensor entries of `data` (the PPO actor and critic run their updates through exactly this
path), and AReaL-lite's `train_batch(data, loss_fn=..., loss_weight_fn=...)`, `eval_batch`, `forward`, `save`/`load`,
`upload_weights` over packed 1-D sequences (`verl.workers.engine.packed`). `initialize()` joins torch.distributed
(gloo on CPU, nccl on GPU). Layer 5: no Ray, no trainer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from tensordict import TensorDict
from torch import nn

from verl.protocol import DataProto
from verl.utils import acceleration, fsdp_utils
from verl.utils import tensordict_utils as tu
from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
from verl.utils.device import get_device_name
from verl.utils.py_functional import append_to_dict
from verl.workers import weight_sync
from verl.workers.engine.base import BaseEngine, EngineRegistry
from verl.workers.engine.engine_config import engine_sections
from verl.workers.engine.io_struct import FinetuneSpec, SaveLoadMeta, WeightUpdateMeta
from verl.workers.engine.model_forward import HeadSpec, response_outputs, scatter_to_responses
from verl.workers.engine.packed import eval_batch as packed_eval_batch
from verl.workers.engine.packed import forward as packed_forward
from verl.workers.engine.packed import train_batch as packed_train_batch
from verl.workers.engine.utils import (
    REAL_ROW_KEY,
    clip_grad_and_step,
    data_parallel_size,
    global_batch_counts,
    micro_batch_plan,
    module_device,
    one_rank_fsdp2,
    restore_order,
)
from verl.workers.lora import apply_lora, disabled_adapters, is_lora_module, lora_rank

__all__ = [
    "FSDPEngine",
    "FSDPEngineWithLMHead",
    "FSDPEngineWithValueHead",
    "attn_implementation",
    "model_dtype",
    "wrap_fsdp2",
]


# ----------------------------------------------------------------------------------------------- building
def _section(config: Any) -> DictConfig:
    """A writable DictConfig copy of a config section (DictConfig, dict or None)."""
    if config is None:
        return OmegaConf.create({})
    if isinstance(config, DictConfig):
        return OmegaConf.create(OmegaConf.to_container(config, resolve=True))
    return OmegaConf.create(dict(config))


def attn_implementation(model_cfg: Any, device_name: str) -> str:
    """`model.attn_implementation` (default sdpa); flash_attention_2 becomes sdpa on CPU, with a warning."""
    attn = model_cfg.get("attn_implementation", "sdpa") or "sdpa"
    if attn == "flash_attention_2" and device_name != "cuda":
        print("warning: attn_implementation=flash_attention_2 needs a GPU; using sdpa on CPU")
        return "sdpa"
    return attn


def model_dtype(fsdp_cfg: Any) -> str:
    """verl's `fsdp_config.model_dtype` (fp32 | bf16 | fp16 or the long names): the dtype the FSDP module's
    parameters are loaded and kept in (the master weights of a trained model)."""
    return str((fsdp_cfg or {}).get("model_dtype", "fp32") or "fp32")


def wrap_fsdp2(module: nn.Module, fsdp_cfg: Any, device_name: str = "cpu", where: str = "fsdp_config"):
    """FSDP2-shard `module` by its `fsdp_config` (see the module docstring; `mixed_precision` over `dtype` for the
    compute, gradient-reduction and buffer dtypes, `fsdp_utils.fsdp_mixed_precision`). Returns `(module,
    offload_optimizer)`: whether the optimizer state moves to CPU between updates (`optimizer_offload` on CUDA;
    `fsdp_utils.offload_settings` prints the CPU notice)."""
    fsdp_cfg = fsdp_cfg or {}
    precision = fsdp_utils.fsdp_mixed_precision(fsdp_cfg, where)
    offload_policy, offload_optimizer = fsdp_utils.offload_settings(fsdp_cfg, device_name, where)
    module = fsdp_utils.apply_fsdp2(
        module,
        **precision,
        reshard_after_forward=bool(fsdp_cfg.get("reshard_after_forward", True)),
        offload_policy=offload_policy,
        forward_prefetch=bool(fsdp_cfg.get("forward_prefetch", False)),
        fsdp_size=int(fsdp_cfg.get("fsdp_size", -1)),
        wrap_policy=fsdp_cfg.get("wrap_policy"),
    )
    return module, offload_optimizer


def _split_settings(data: TensorDict) -> tuple[TensorDict, dict[str, Any]]:
    """(the tensor entries of `data`, its non-tensor entries as plain values)."""
    tensors, settings = {}, {}
    for key in data.keys():
        value = data.get(key)
        if isinstance(value, torch.Tensor):
            tensors[key] = value
        else:
            settings[key] = tu.get_non_tensor_data(data, key, None)
    return TensorDict(tensors, batch_size=data.batch_size), settings


def _detached(tree: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value.detach() for key, value in tree.items()}


# ----------------------------------------------------------------------------------------------- the engine
class FSDPEngine(BaseEngine):
    """One rank's FSDP2 model, optimizer and LR schedule; see the module docstring.

    model_config: `path` (HF folder), `trust_remote_code`, `enable_gradient_checkpointing`, `use_remove_padding`,
        `share_prompt_prefix`, `lora_rank`/`lora_alpha`/`target_modules`, `attn_implementation` (verl's `model`),
        `lean_activations` (ours: verl/models/lean_layers.py; a training engine only).
    engine_config: verl's `fsdp_config`. optimizer_config: verl's `optim` (`lr`, `betas`, `weight_decay`, warmup and
        schedule keys, `total_training_steps`) plus `clip_grad` (default 1.0). checkpoint_config: verl's
        `checkpoint` (unused by the engine itself). Each may be a dict or a DictConfig.
    config: all four in one object instead (`engine_config.engine_sections`; also taken positionally).
    device: auto | cpu | cuda. tokenizer: saved beside HF exports. where: the config path named in errors.
    micro_batch_size_per_gpu / max_token_len_per_gpu: defaults when a batch does not carry its own.
    forward_only: build no optimizer (a frozen reference).
    """

    model_type = "language_model"

    def __init__(
        self,
        model_config: Any = None,
        engine_config: Any = None,
        optimizer_config: Any = None,
        checkpoint_config: Any = None,
        *,
        config: Any = None,
        device: str = "auto",
        tokenizer: Any = None,
        where: str = "fsdp_config",
        micro_batch_size_per_gpu: int | None = None,
        max_token_len_per_gpu: int | None = None,
        forward_only: bool = False,
    ):
        sections = engine_sections(config, model_config, engine_config, optimizer_config, checkpoint_config)
        model_config, engine_config, optimizer_config, checkpoint_config = sections
        self.model_config = _section(model_config)
        self.engine_config = _section(engine_config)
        self.optimizer_config = _section(optimizer_config)
        self.checkpoint_config = _section(checkpoint_config)
        self.device_name = get_device_name(device)
        self.tokenizer = tokenizer
        self.where = where
        self.micro_batch_size_per_gpu = micro_batch_size_per_gpu
        self.max_token_len_per_gpu = max_token_len_per_gpu
        self.forward_only = forward_only
        self.use_lora = lora_rank(self.model_config) > 0
        self.module: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.checkpoint_manager: FSDPCheckpointManager | None = None
        self._offload_optimizer = False
        self._version = 0
        self.mode: str | None = None

    @classmethod
    def from_module(
        cls,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any = None,
        *,
        model_config: Any = None,
        optimizer_config: Any = None,
        offload_optimizer: bool = False,
        tokenizer: Any = None,
    ) -> FSDPEngine:
        """An engine around a model (plain or FSDP2-sharded) and optimizer built elsewhere; `initialize` is not
        called. model_config: the forward-layout flags (`use_remove_padding`, `share_prompt_prefix`);
        optimizer_config: `clip_grad`."""
        engine = cls(model_config or {}, None, optimizer_config, None, tokenizer=tokenizer)
        engine.device_name = module_device(module).type
        engine.module, engine.optimizer, engine.lr_scheduler = module, optimizer, lr_scheduler
        engine.forward_only = optimizer is None
        engine.use_lora = is_lora_module(module)
        engine._offload_optimizer = offload_optimizer
        engine.checkpoint_manager = FSDPCheckpointManager(module, optimizer, lr_scheduler, tokenizer)
        return engine

    @classmethod
    def owning(
        cls, engine: FSDPEngine | None, module: nn.Module, optimizer: Any, layout: Any, grad_clip: float, owner: str
    ) -> FSDPEngine:
        """`engine` when it owns `module` and `optimizer` (else ValueError naming `owner`); without one, a new engine
        around them (`from_module`) with the forward-layout flags (`use_remove_padding`, `share_prompt_prefix`) of
        `layout` and `clip_grad=grad_clip`. What the PPO actor and critic do with their constructor arguments."""
        if engine is not None:
            if engine.module is not module or engine.optimizer is not optimizer:
                raise ValueError(f"{owner}: engine must own the module and optimizer given with it")
            return engine
        flags = {key: bool((layout or {}).get(key, False)) for key in ("use_remove_padding", "share_prompt_prefix")}
        return cls.from_module(module, optimizer, model_config=flags, optimizer_config={"clip_grad": grad_clip})

    def _load_module(self, dtype: str, path: str | None = None) -> nn.Module:
        """The HF model of `path` (default `model_config.path`) in `dtype` (`model_type`'s loader)."""
        cfg = self.model_config
        loader = {"value_model": fsdp_utils.load_token_classification_model}.get(
            self.model_type, fsdp_utils.load_causal_lm
        )
        return loader(
            path or cfg.path,
            dtype=dtype,
            attn_implementation=attn_implementation(cfg, self.device_name),
            gradient_checkpointing=bool(cfg.get("enable_gradient_checkpointing", False)) and not self.forward_only,
            trust_remote_code=bool(cfg.get("trust_remote_code", False)),
            override_config=cfg.get("override_config"),
            lean_activations=bool(cfg.get("lean_activations", False)) and not self.forward_only,
        )

    def initialize(self, addr: Any = None, ft_spec: FinetuneSpec | None = None) -> None:
        """Join torch.distributed and build the model, optimizer, LR schedule and checkpoint manager.
        `addr` (AReaL-lite's argument) must be None: the process group comes from the environment. `ft_spec` sets
        the schedule's length when `optimizer_config.total_training_steps` does not."""
        if addr is not None:
            raise ValueError(
                f"FSDPEngine.initialize(addr={addr!r}): set MASTER_ADDR/MASTER_PORT (torchrun does) instead"
            )
        if not self.model_config.get("path"):
            raise ValueError(f"{type(self).__name__} needs model_config.path (an HF model folder)")
        fsdp_utils.init_distributed()
        module = self._load_module(model_dtype(self.engine_config))
        if self.use_lora:  # only the adapters train; the optimizer holds no state for the base weights
            module = apply_lora(module, self.model_config)
        if self.forward_only:
            module.requires_grad_(False)
        self.module, self._offload_optimizer = wrap_fsdp2(module, self.engine_config, self.device_name, self.where)
        if not self.forward_only:
            self.optimizer = fsdp_utils.build_optimizer(self.module, self.optimizer_config)
            total = int(self.optimizer_config.get("total_training_steps", -1) or -1)
            if total <= 0 and ft_spec is not None:
                total = ft_spec.total_train_steps
            self.lr_scheduler = fsdp_utils.build_lr_scheduler(self.optimizer, self.optimizer_config, total)
        self.checkpoint_manager = FSDPCheckpointManager(
            self.module, self.optimizer, self.lr_scheduler, self.tokenizer, checkpoint_config=self.checkpoint_config
        )

    # ------------------------------------------------------------------ modes and optimizer
    @property
    def device(self) -> torch.device:
        """Where the model's parameters are (the `device` asked for before `initialize`)."""
        return module_device(self.module) if self.module is not None else torch.device(self.device_name)

    @property
    def is_param_offload_enabled(self) -> bool:
        return bool(self.engine_config.get("param_offload", False))

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return self._offload_optimizer

    @contextlib.contextmanager
    def train_mode(self, zero_grad_on_exit: bool = True, **kwargs: Any) -> Iterator[None]:
        """Train mode; the optimizer state on the device for the block when it is offloaded between updates."""
        self.module.train()
        self.mode = "train"
        try:
            if self.optimizer is None:
                yield
            else:
                with fsdp_utils.optimizer_state_on(self.optimizer, self.device_name, self._offload_optimizer):
                    yield
                if zero_grad_on_exit:
                    self.optimizer.zero_grad()
        finally:
            self.mode = None

    @contextlib.contextmanager
    def eval_mode(self, **kwargs: Any) -> Iterator[None]:
        self.module.eval()
        self.mode = "eval"
        try:
            yield
        finally:
            self.mode = None

    def _require_optimizer(self, what: str) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise RuntimeError(f"{what} needs an optimizer; this engine was built forward-only (or without one)")
        return self.optimizer

    def optimizer_zero_grad(self) -> None:
        self._require_optimizer("optimizer_zero_grad").zero_grad()

    def optimizer_step(self) -> float:
        """Clip to `optimizer_config.clip_grad` (default 1.0), step; a non-finite norm skips the step."""
        optimizer = self._require_optimizer("optimizer_step")
        grad_norm, _ = clip_grad_and_step(self.module, optimizer, float(self.optimizer_config.get("clip_grad", 1.0)))
        return grad_norm

    def lr_scheduler_step(self) -> float:
        if self.lr_scheduler is None:
            raise RuntimeError("lr_scheduler_step: this engine has no LR schedule (built forward-only)")
        self.lr_scheduler.step()
        return float(self.lr_scheduler.get_last_lr()[0])

    # ------------------------------------------------------------------ verl's batch API
    def forward_backward_batch(
        self, data: TensorDict, loss_function: Callable | None, forward_only: bool = False
    ) -> dict[str, Any]:
        """See the module docstring. Rows keep `data`'s order in `model_output`, whatever the micro-batching."""
        tensors, settings = _split_settings(data)
        proto = DataProto(batch=tensors)
        dynamic = bool(settings.get("use_dynamic_bsz", False))
        if "micro_batch_size_per_gpu" in settings:  # given (None is an error of the caller's, unless dynamic)
            size = settings["micro_batch_size_per_gpu"]
        else:  # the engine's default, else one micro-batch
            size = self.micro_batch_size_per_gpu or len(proto)
        max_tokens = settings.get("max_token_len_per_gpu", self.max_token_len_per_gpu)
        if loss_function is not None and "global_batch_size" not in settings and "response_mask" in tensors.keys():
            samples, tokens = global_batch_counts(tensors["response_mask"], None, tensors.get(REAL_ROW_KEY, None))
            settings.update(global_batch_size=samples, batch_num_tokens=tokens)
        settings.setdefault("dp_size", self.get_data_parallel_size())
        share = bool(self.model_config.get("share_prompt_prefix", False))
        micro_batches, order = micro_batch_plan(proto, size, dynamic, max_tokens, group_prompts=share)
        device = module_device(self.module)
        outputs = []
        # one CPU rank: every unit gathered once for all micro-batches, not per forward call and backward (below)
        gathered = not forward_only and one_rank_fsdp2(self.module) and device.type == "cpu"
        gathering = fsdp_utils.unsharded(self.module, through_backward=True) if gathered else contextlib.nullcontext()
        with gathering, acceleration.for_device(device.type).products():  # on CPU maybe OpenBLAS (verl.cpu.blas)
            for micro_batch in micro_batches:
                batch = micro_batch.batch.to(device)
                tu.assign_non_tensor(batch, **settings)
                loss, output = self.forward_step(batch, loss_function, forward_only)
                if not forward_only:
                    loss.backward()
                outputs.append(output)
        model_output = {}
        for key in outputs[0]["model_output"] if outputs else ():
            model_output[key] = restore_order(torch.cat([o["model_output"][key] for o in outputs]), order)
        metrics: dict[str, list] = {}
        for output in outputs:
            append_to_dict(metrics, output["metrics"])
        return {"model_output": model_output, "loss": [o["loss"] for o in outputs], "metrics": metrics}

    def infer_batch(self, data: TensorDict, loss_function: Callable | None = None) -> dict[str, Any]:
        """`BaseEngine.infer_batch`; on one FSDP2 rank (`one_rank_fsdp2`) the units are gathered once for the pass
        and FSDP2's hooks idled, as the rollout generates (not gathered again per micro-batch; one copy of the weights,
        less than generation holds). Several ranks: unchanged."""
        if not one_rank_fsdp2(self.module):
            return super().infer_batch(data, loss_function)
        with fsdp_utils.unsharded(self.module), fsdp_utils.concurrent_forwards(self.module):
            return super().infer_batch(data, loss_function)

    def compute_model_output(self, micro_batch: TensorDict) -> dict[str, torch.Tensor]:
        """The model's output on one micro-batch, per response token (with autograd when it is on); the
        head-specific engines define it."""
        raise NotImplementedError(
            f"{type(self).__name__} has no model head for verl's loss functions: use FSDPEngineWithLMHead or "
            "FSDPEngineWithValueHead, or train_batch(data, loss_fn=..., loss_weight_fn=...) on packed logits"
        )

    def forward_step(self, micro_batch: TensorDict, loss_function: Callable | None, forward_only: bool):
        """One micro-batch: (loss, {"model_output" (detached), "loss", "metrics"}); the loss is 0 without a loss
        function."""
        model_output = self.compute_model_output(micro_batch)
        if loss_function is None:
            loss, metrics = torch.zeros((), device=module_device(self.module)), {}
        else:
            loss, metrics = loss_function(
                model_output=model_output, data=micro_batch, dp_group=self.get_data_parallel_group()
            )
        return loss, {"model_output": _detached(model_output), "loss": float(loss.detach()), "metrics": metrics}

    def train_batch(
        self,
        data: Any,
        loss_function: Callable | None = None,
        loss_weight_fn: Callable | None = None,
        *,
        loss_fn: Callable | None = None,
    ) -> dict[str, Any]:
        """verl's `train_batch(data, loss_function)`, or, with `loss_weight_fn`, AReaL-lite's
        `train_batch(data, loss_fn=..., loss_weight_fn=...)` over packed sequences (`verl.workers.engine.packed`)."""
        if loss_fn is not None and loss_function is not None:
            raise TypeError("train_batch: give the loss once, as loss_function (verl) or loss_fn (AReaL-lite)")
        loss = loss_fn if loss_fn is not None else loss_function
        if loss is None:
            raise TypeError(
                "train_batch needs a loss: train_batch(data, loss_function) or (data, loss_fn, loss_weight_fn)"
            )
        if loss_weight_fn is None:
            if loss_fn is not None:
                raise TypeError(
                    "train_batch(loss_fn=...) over packed logits needs loss_weight_fn (e.g. loss-token count)"
                )
            return super().train_batch(data, loss)
        return packed_train_batch(self, data, loss, loss_weight_fn)

    # ------------------------------------------------------------------ AReaL-lite's API
    def train(self, mode: bool = True) -> FSDPEngine:
        """The model in train (True) or eval mode; returns the engine."""
        self.module.train(mode)
        return self

    def eval_batch(self, data: Any, loss_fn: Callable, loss_weight_fn: Callable) -> float:
        """The weighted packed loss of `data` without a gradient step."""
        return packed_eval_batch(self, data, loss_fn, loss_weight_fn)

    def forward(
        self,
        data: Any,
        output_seqlens: Any = None,
        post_hook: Callable | None = None,
        aggregate_fn: Callable = torch.cat,
    ) -> Any:
        """Logits (or `post_hook`'s results) of `data`'s rows, in `data`'s padded layout (`packed.forward`)."""
        if output_seqlens is not None:
            raise ValueError("forward(output_seqlens=...) is not supported: outputs come back in the input's layout")
        return packed_forward(self, data, post_hook, aggregate_fn)

    def step_lr_scheduler(self) -> float:
        return self.lr_scheduler_step()

    def set_version(self, version: int) -> None:
        self._version = int(version)

    def get_version(self) -> int:
        return self._version

    def save(self, meta: SaveLoadMeta) -> None:
        """`hf`: an HF model folder at meta.path (gathered once: checkpoint export); `dcp`: the sharded checkpoint."""
        if meta.tokenizer is not None:
            self.checkpoint_manager.processing_class = meta.tokenizer
        if meta.weight_format == "hf":
            self.checkpoint_manager.save_hf_model(meta.path)
        else:
            manager = self.checkpoint_manager if meta.with_optim else FSDPCheckpointManager(self.module)
            with self._optimizer_on_device():
                manager.save_checkpoint(meta.path)

    def load(self, meta: SaveLoadMeta) -> None:
        """`hf`: the weights of an HF folder into this rank's shards; `dcp`: what `save` wrote (with_optim: the
        optimizer, schedule and RNG too)."""
        if meta.weight_format == "hf":
            if self.use_lora:
                raise ValueError("load(SaveLoadMeta(weight_format='hf')) of a LoRA model: use weight_format='dcp'")
            state = self._load_module(model_dtype(self.engine_config), meta.path).state_dict()
            fsdp_utils.load_full_state_dict(self.module, state)
        else:
            manager = self.checkpoint_manager if meta.with_optim else FSDPCheckpointManager(self.module)
            with self._optimizer_on_device():
                manager.load_checkpoint(meta.path)

    def upload_weights(self, meta: WeightUpdateMeta) -> None:
        """`colocated`: stream the parameters into `meta.engine` (this process's inference engine) from the FSDP2
        shards, one gathered tensor at a time; `disk`: write an HF folder at `meta.path` for the engine to load.
        Collective: every rank calls it."""
        if meta.type == "colocated":
            engine = meta.engine
            weight_sync.sync_rollout_weights(self.module, engine.rollout, engine.config, self.use_lora)
        else:
            self.save(SaveLoadMeta(path=meta.path, weight_format="hf"))

    update_weights = upload_weights  # the name AReaL-lite's engines also answer to

    # ------------------------------------------------------------------ weights, parallelism, checkpoints
    def get_per_tensor_param(self, **kwargs: Any) -> tuple[Iterator[tuple[str, torch.Tensor]], dict | None]:
        """The weights under the HF model's names, gathered one tensor at a time (with LoRA: merged into the base
        weights, what an engine without adapters loads), and None for the peft config. Collective."""
        mode = "merged" if self.use_lora else "full"
        return weight_sync.actor_weights(self.module, None, mode), None

    def get_data_parallel_size(self) -> int:
        return data_parallel_size()

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def get_data_parallel_group(self) -> Any:
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        """Move the optimizer state (and, without FSDP2's CPU offload policy, the parameters) to `device`."""
        if grad and not model:
            raise ValueError("gradients move with the model: to(grad=True) needs model=True")
        if model and not self.is_param_offload_enabled:
            self.module.to(device)
        if optimizer and self.optimizer is not None:
            fsdp_utils.move_optimizer_state(self.optimizer, device)

    @contextlib.contextmanager
    def _optimizer_on_device(self) -> Iterator[None]:
        if self.optimizer is None:
            yield
            return
        with fsdp_utils.optimizer_state_on(self.optimizer, self.device_name, self._offload_optimizer):
            yield

    def save_checkpoint(
        self,
        local_path: str,
        hdfs_path: str | None = None,
        global_step: int = 0,
        max_ckpt_to_keep: int | None = None,
        save_hf: bool = False,
        **kwargs: Any,
    ) -> None:
        """This rank's sharded model, optimizer, schedule and RNG under `local_path` (+ an HF copy with save_hf)."""
        if hdfs_path is not None or max_ckpt_to_keep is not None:
            raise ValueError(
                "FSDPEngine.save_checkpoint saves to local_path only: hdfs_path is not supported and old checkpoints "
                "are rotated by the trainer (trainer.max_actor_ckpt_to_keep), not by the engine"
            )
        with self._optimizer_on_device():
            self.checkpoint_manager.save_checkpoint(local_path, global_step=global_step, save_hf=save_hf)

    def load_checkpoint(
        self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = True, **kwargs: Any
    ) -> None:
        """Restore what `save_checkpoint` wrote (same world size); the files stay where they are."""
        if hdfs_path is not None:
            raise ValueError("FSDPEngine.load_checkpoint reads local_path only: hdfs_path is not supported")
        with self._optimizer_on_device():
            self.checkpoint_manager.load_checkpoint(local_path)

    def disable_adapter(self) -> contextlib.AbstractContextManager:
        return disabled_adapters(self.module) if self.use_lora else contextlib.nullcontext()


@EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device=["cpu", "cuda"])
class FSDPEngineWithLMHead(FSDPEngine):
    """A causal LM: `model_output` holds `log_probs` of the response tokens at `temperature`, plus `entropy`
    (`calculate_entropy`) and `sum_pi_squared` (`calculate_sum_pi_squared`), all (bs, response_len). The LM head
    runs in vocabulary chunks (no full logits of a micro-batch)."""

    def compute_model_output(self, micro_batch: TensorDict) -> dict[str, torch.Tensor]:
        def setting(key: str, default: Any) -> Any:
            return tu.get_non_tensor_data(micro_batch, key, default)

        spec = HeadSpec(
            float(setting("temperature", 1.0)),
            bool(setting("calculate_entropy", False)),
            bool(setting("entropy_grad", True)),
            bool(setting("calculate_sum_pi_squared", False)),
        )
        stats, where = response_outputs(
            self.module,
            micro_batch,
            micro_batch["responses"].shape[-1],
            is_lm=True,
            use_remove_padding=bool(self.model_config.get("use_remove_padding", False)),
            share_prompt_prefix=bool(self.model_config.get("share_prompt_prefix", False)),
            head=spec,
        )
        columns = iter(stats.unbind(-1))  # log-prob, then entropy and sum pi^2 when asked for
        model_output = {"log_probs": scatter_to_responses(next(columns), where)}
        if spec.entropy:
            entropy = scatter_to_responses(next(columns), where)
            model_output["entropy"] = entropy if spec.entropy_grad else entropy.detach()
        if spec.sum_pi_squared:
            model_output["sum_pi_squared"] = scatter_to_responses(next(columns).detach(), where)
        return model_output


@EngineRegistry.register(model_type="value_model", backend=["fsdp", "fsdp2"], device=["cpu", "cuda"])
class FSDPEngineWithValueHead(FSDPEngine):
    """A value model (a token-classification head with one output): `model_output["values"]` (bs, response_len),
    the value of response token t read at the position that predicts it, as verl does."""

    model_type = "value_model"

    def compute_model_output(self, micro_batch: TensorDict) -> dict[str, torch.Tensor]:
        values, where = response_outputs(
            self.module,
            micro_batch,
            micro_batch["responses"].shape[-1],
            is_lm=False,
            use_remove_padding=bool(self.model_config.get("use_remove_padding", False)),
            share_prompt_prefix=bool(self.model_config.get("share_prompt_prefix", False)),
        )
        if values.dim() != 2 or values.shape[-1] != 1:
            raise ValueError(
                f"a value model's .logits must have shape (bs, seq_len, 1), got last dim {values.shape[-1]}"
            )
        return {"values": scatter_to_responses(values[:, 0].float(), where)}
