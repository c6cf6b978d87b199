"""Supervised fine-tuning with FSDP2: `python -m verl.trainer.fsdp_sft_trainer key=value ...` or `run_sft(config)`.

Owns the SFT loop: `SFTDataset` + `DistributedSampler`, token-mean cross-entropy on assistant tokens (packed rows by
default, `data.pad_mode=right` pads), gradient accumulation, validation loss, logging and HF-format checkpoints
`<trainer.default_local_dir>/global_step_<N>/` that the PPO trainer loads. One process trains on a 1-rank gloo
group; under torchrun every rank holds a shard, and the loss is normalised over the global batch's target tokens,
so N ranks compute one rank's update. Layer 8 (trainer entry): no Ray.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
from typing import Any

import hydra
import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch.utils.data import DataLoader, DistributedSampler
from tqdm import tqdm

from verl.utils import acceleration
from verl.utils.dataset.sft_dataset import SFTDataset
from verl.utils.device import get_device_name, get_dist_backend
from verl.utils.fsdp_utils import (
    apply_fsdp2,
    build_lr_scheduler,
    build_optimizer,
    clip_grad_norm_,
    destroy_distributed,
    get_full_state_dict,
    init_distributed,
    load_causal_lm,
)
from verl.utils.packing import pack_tensor_dict
from verl.utils.tokenizer import hf_tokenizer
from verl.workers.engine.model_forward import accepts_logits_to_keep, packed_logits

__all__ = ["run_sft", "sft_loss", "default_sft_config", "build_model"]

CONFIG_PATH = os.path.join(os.path.dirname(__file__), "config", "sft_trainer.yaml")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LR_SCHEDULERS = ("cosine", "constant")
PAD_MODES = ("no_padding", "right")


def default_sft_config() -> DictConfig:
    """The defaults of sft_trainer.yaml without Hydra's own keys."""
    config = OmegaConf.load(CONFIG_PATH)
    for key in ("defaults", "hydra"):
        config.pop(key, None)
    return config


def _check_config(config: DictConfig, world_size: int) -> None:
    if config.model.dtype not in DTYPES:
        raise ValueError(f"model.dtype={config.model.dtype!r} is not supported; allowed: {list(DTYPES)}")
    if config.data.pad_mode not in PAD_MODES:
        raise ValueError(f"data.pad_mode={config.data.pad_mode!r} is not supported; allowed: {list(PAD_MODES)}")
    if config.optim.lr_scheduler not in LR_SCHEDULERS:
        raise ValueError(f"optim.lr_scheduler={config.optim.lr_scheduler!r} is not supported; allowed: {LR_SCHEDULERS}")
    bs, micro = int(config.data.train_batch_size), int(config.data.micro_batch_size_per_gpu)
    if bs < 1 or micro < 1:
        raise ValueError(f"data.train_batch_size ({bs}) and data.micro_batch_size_per_gpu ({micro}) must be >= 1")
    if bs % world_size:
        raise ValueError(f"data.train_batch_size={bs} must be divisible by the number of ranks ({world_size})")
    if (bs // world_size) % micro:
        raise ValueError(
            f"per-rank batch train_batch_size/world_size={bs // world_size} must be divisible by "
            f"data.micro_batch_size_per_gpu={micro}"
        )


def sft_loss(
    logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy over target tokens, and the number of target tokens.

    Args:
        logits: (bs, seq_len, vocab) model outputs.
        input_ids: (bs, seq_len) tokens; token t is predicted from logits[:, t - 1].
        loss_mask: (bs, seq_len) 1 where token t is a target (aligned with input_ids, as SFTDataset builds it).

    Returns:
        (sum of -log p(token t) over targets, number of targets), both scalars.
    """
    targets = input_ids[:, 1:]
    mask = loss_mask[:, 1:].to(torch.float32)
    token_loss = F.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none"
    ).view_as(mask)
    return (token_loss * mask).sum(), mask.sum()


def _all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def _to_device(batch: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    """The batch on `device`, cut to its longest sequence: rows are right-padded to data.max_length, and for a
    causal model the padding columns after the last real token change neither the loss nor the gradients."""
    width = max(int(batch["attention_mask"].sum(-1).max()), 2)
    return {k: v[:, :width].to(device) for k, v in batch.items()}


def _forward(model: torch.nn.Module, batch: dict[str, torch.Tensor], logits_to_keep: int = 0) -> torch.Tensor:
    kwargs = {"logits_to_keep": logits_to_keep} if logits_to_keep else {}
    return model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        use_cache=False,
        **kwargs,
    ).logits


def micro_batch_loss(
    model: torch.nn.Module, micro: dict[str, torch.Tensor], trim: bool, packed: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sft_loss` of one micro-batch (summed token loss, number of target tokens).

    `packed` (`data.pad_mode=no_padding`): the rows' real tokens run as one packed row, attention kept inside each
    example (`model_forward.packed_logits`), and the LM head runs only at the positions that predict a target
    token: no compute on padding. Else the right-padded (bs, longest) batch; with `trim`, the LM head and the
    cross-entropy run only over the columns from the one predicting the batch's first target token to the end
    (`logits_to_keep`, as HF models take it): the prompt columns before it carry no loss, so loss and gradients are
    the same while the vocabulary projection of the prompt tokens (most of each SFT row's tokens) is skipped."""
    if packed:
        return _packed_loss(model, micro)
    if not trim:
        return sft_loss(_forward(model, micro), micro["input_ids"], micro["loss_mask"])
    targets = micro["loss_mask"][:, 1:].any(0).nonzero()
    first = int(targets[0]) if len(targets) else micro["input_ids"].size(1) - 2  # the column predicting it
    logits = _forward(model, micro, logits_to_keep=micro["input_ids"].size(1) - first)
    return sft_loss(logits, micro["input_ids"][:, first:], micro["loss_mask"][:, first:])


def _packed_loss(model: torch.nn.Module, micro: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """`sft_loss` over the micro-batch's real tokens packed into one row. Token t of a row is a target where its
    loss mask is set and t is not the row's first token (as `sft_loss` reads it); it is predicted at packed
    position t - 1, which lies in the same example."""
    packed = pack_tensor_dict(micro)
    cu_seqlens = packed["cu_seqlens"]
    is_target = packed["loss_mask"].bool()
    is_target[cu_seqlens[:-1][cu_seqlens.diff() > 0].long()] = False  # each example's first token
    targets = is_target.nonzero().squeeze(1)
    logits = packed_logits(model, packed["input_ids"], packed["position_ids"], cu_seqlens, keep=targets - 1)
    loss = F.cross_entropy(logits.float(), packed["input_ids"][targets], reduction="sum")
    return loss, torch.tensor(float(targets.numel()), device=loss.device)


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    micro_batch_size: int,
    clip_grad: float,
    world_size: int,
    packed: bool = False,
) -> dict[str, float]:
    """One optimizer step on this rank's share of the global batch (tensors of shape (local_bs, seq_len)).

    The loss of each micro-batch is its summed token loss divided by the global number of target tokens;
    FSDP2 averages gradients over ranks, so the loss is scaled by world_size to make the update a token-mean
    over the global batch.
    """
    global_tokens = _all_reduce_sum(batch["loss_mask"][:, 1:].sum().float()).clamp(min=1.0)
    optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), device=global_tokens.device)
    trim = accepts_logits_to_keep(model)
    for start in range(0, batch["input_ids"].size(0), micro_batch_size):
        micro = {k: v[start : start + micro_batch_size] for k, v in batch.items()}
        summed, _ = micro_batch_loss(model, micro, trim, packed)
        (summed / global_tokens * world_size).backward()
        loss_sum += summed.detach()
    grad_norm = float(clip_grad_norm_(model, clip_grad))
    if math.isfinite(grad_norm):
        optimizer.step()
    else:
        optimizer.zero_grad(set_to_none=True)
        print(f"warning: gradient norm is {grad_norm}; the optimizer step was skipped", flush=True)
    loss = _all_reduce_sum(loss_sum) / global_tokens
    return {"train/loss": loss.item(), "train/grad_norm": grad_norm, "train/tokens": global_tokens.item()}


@torch.no_grad()
def validation_loss(
    model: torch.nn.Module, loader: DataLoader, micro_batch_size: int, device: str, packed: bool = False
) -> float:
    """Token-mean cross-entropy over the validation set (summed over all ranks)."""
    model.eval()
    loss_sum = torch.zeros((), device=device)
    tokens = torch.zeros((), device=device)
    trim = accepts_logits_to_keep(model)
    for batch in loader:
        batch = _to_device(batch, device)
        for start in range(0, batch["input_ids"].size(0), micro_batch_size):
            micro = {k: v[start : start + micro_batch_size] for k, v in batch.items()}
            summed, count = micro_batch_loss(model, micro, trim, packed)
            loss_sum += summed
            tokens += count
    model.train()
    return (_all_reduce_sum(loss_sum) / _all_reduce_sum(tokens).clamp(min=1.0)).item()


def save_hf_checkpoint(model: torch.nn.Module, tokenizer: Any, root: str, step: int, rank: int) -> str:
    """Write the full weights and the tokenizer to `<root>/global_step_<step>/` in HF format.

    All ranks take part in gathering the weights; rank 0 writes to a `.tmp` folder and renames it when complete,
    so a reader never sees a half-written checkpoint. Returns the checkpoint path.
    """
    from transformers import AutoModelForCausalLM

    state = get_full_state_dict(model, cpu_offload=True)
    path = os.path.join(root, f"global_step_{step}")
    if rank == 0:
        # a clean (non-FSDP) model of the same class, so config.architectures names the HF class
        with torch.device("meta"):
            clean = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
        clean.load_state_dict(state, assign=True)
        clean.tie_weights()
        clean.generation_config = model.generation_config
        tmp = path + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        clean.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(step))
    dist.barrier()
    return path


def _build_loader(dataset: SFTDataset, batch_size: int, rank: int, world_size: int, shuffle: bool, seed: int):
    sampler = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=shuffle
    )
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=shuffle, num_workers=0)
    return loader, sampler


def _scheduler_config(optim: DictConfig) -> dict[str, Any]:
    """verl's SFT optimizer keys translated to the keys `build_lr_scheduler`/`build_optimizer` read."""
    return {
        "lr": float(optim.lr),
        "betas": list(optim.betas),
        "weight_decay": float(optim.weight_decay),
        "lr_warmup_steps": -1,
        "lr_warmup_steps_ratio": float(optim.warmup_steps_ratio),
        "warmup_style": optim.lr_scheduler,
        "min_lr_ratio": float(optim.get("min_lr_ratio", 0.0) or 0.0),
        "clip_grad": float(optim.clip_grad),
    }


def _console_line(step: int, total: int, metrics: dict[str, float]) -> str:
    parts = [f"step {step}/{total}", f"loss {metrics['train/loss']:.4f}"]
    parts += [f"lr {metrics['train/lr']:.3g}", f"gnorm {metrics['train/grad_norm']:.3g}"]
    if "val/loss" in metrics:
        parts.append(f"val_loss {metrics['val/loss']:.4f}")
    parts.append(f"s/step {metrics['timing_s/step']:.2f}")
    return " | ".join(parts)


def _due(step: int, freq: int, is_last: bool) -> bool:
    """Whether an every-`freq`-steps action runs at `step` (always at the last step; freq <= 0 = only then)."""
    return is_last or (int(freq) > 0 and step % int(freq) == 0)


def _make_tracker(config: DictConfig, rank: int):
    if rank != 0:
        return None
    from verl.utils.tracking import Tracking

    backends = [b for b in (config.trainer.logger or []) if b != "console"]
    return Tracking(
        project_name=config.trainer.project_name,
        experiment_name=config.trainer.experiment_name,
        default_backend=backends,
        log_dir=config.trainer.default_local_dir,
        config=OmegaConf.to_container(config, resolve=True),
    )


def run_sft(config: DictConfig | dict) -> str:
    """Fine-tune `model.partial_pretrain` on `data.train_files`; returns the final HF checkpoint's path.

    `config` holds any subset of sft_trainer.yaml's keys (the rest take their defaults). Creates (and afterwards
    destroys) a process group when none exists: 1 rank on its own, N ranks under torchrun.
    """
    config = OmegaConf.merge(default_sft_config(), OmegaConf.create(config) if isinstance(config, dict) else config)
    device = get_device_name(config.trainer.device)
    created_group = not dist.is_initialized()
    rank, world_size = init_distributed(backend=get_dist_backend(device))
    num_threads = torch.get_num_threads()  # the steps may compute with fewer (`enter_acceleration`)
    try:
        with enter_acceleration(device, num_threads).products():
            output_dir = _train(config, device, rank, world_size)
        if created_group:
            destroy_distributed()  # barrier first: gloo aborts when a rank leaves while its peer is still connected
        return output_dir
    finally:
        acceleration.leave()
        torch.set_num_threads(num_threads)
        if created_group and dist.is_initialized():  # after an error: no barrier, the peer may never reach it
            dist.destroy_process_group()


def build_model(model_cfg: DictConfig, device: str) -> torch.nn.Module:
    """The model to fine-tune (`model.*` keys): loaded in float32 onto `device`, sharded by FSDP2 (the compute in
    `model.dtype`), in training mode."""
    model = load_causal_lm(
        model_cfg.partial_pretrain,
        dtype=torch.float32,
        attn_implementation=model_cfg.attn_implementation,
        gradient_checkpointing=bool(model_cfg.enable_gradient_checkpointing),
        lean_activations=bool(model_cfg.lean_activations),
    ).to(device)
    compute_dtype = DTYPES[model_cfg.dtype]
    apply_fsdp2(
        model, param_dtype=None if compute_dtype == torch.float32 else compute_dtype, reduce_dtype=torch.float32
    )
    model.train()
    return model


def enter_acceleration(device: str, num_threads: int):
    """Enter this process's device speed-ups for the SFT steps as a trainer's worker does (`verl.utils.acceleration`;
    `acceleration.leave()` ends them) and return them: on the CPU, float32 products through OpenBLAS where faster,
    the allocator keeping freed memory, and each step computing with as many threads as the machine's other
    processes leave cores free, at most `num_threads` (`VERL_ADAPTIVE_THREADS`, default 1 as for the workers a group
    starts; 0 keeps torch's count); nothing on a GPU."""
    defaults = acceleration.for_device(device).worker_env(new_process=False)
    added = {key: value for key, value in defaults.items() if key not in os.environ}
    os.environ.update(added)
    try:
        return acceleration.enter(device, num_threads)
    finally:
        for key in added:
            del os.environ[key]


def _train(config: DictConfig, device: str, rank: int, world_size: int) -> str:
    _check_config(config, world_size)
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    seed = int(config.trainer.seed)
    torch.manual_seed(seed)
    data_cfg, trainer_cfg = config.data, config.trainer

    tokenizer = hf_tokenizer(config.model.partial_pretrain)
    local_bs = int(data_cfg.train_batch_size) // world_size
    micro_bs = int(data_cfg.micro_batch_size_per_gpu)
    packed = data_cfg.pad_mode == "no_padding"
    train_set = SFTDataset(data_cfg.train_files, tokenizer, data_cfg)
    train_loader, train_sampler = _build_loader(train_set, local_bs, rank, world_size, shuffle=True, seed=seed)
    val_loader = None
    if data_cfg.val_files:
        val_set = SFTDataset(data_cfg.val_files, tokenizer, data_cfg)
        val_loader, _ = _build_loader(val_set, local_bs, rank, world_size, shuffle=False, seed=seed)
    steps_per_epoch = len(train_loader)
    if steps_per_epoch == 0:
        raise ValueError(
            f"the training set has {len(train_set)} examples, fewer than data.train_batch_size="
            f"{data_cfg.train_batch_size}: nothing to train on"
        )
    total_steps = int(trainer_cfg.total_training_steps or steps_per_epoch * int(trainer_cfg.total_epochs))

    model = build_model(config.model, device)
    optim_cfg = _scheduler_config(config.optim)
    optimizer = build_optimizer(model, optim_cfg)
    lr_scheduler = build_lr_scheduler(optimizer, optim_cfg, total_steps)

    tracker = _make_tracker(config, rank)
    bar = tqdm(total=total_steps, desc="sft", disable=rank != 0, dynamic_ncols=True)
    if rank == 0:
        tqdm.write(
            f"SFT: {len(train_set)} examples, {world_size} rank(s) on {device}, {total_steps} steps of "
            f"{data_cfg.train_batch_size} examples, checkpoints in {trainer_cfg.default_local_dir}"
        )
    step, epoch, last_saved = 0, 0, None
    while step < total_steps:
        train_sampler.set_epoch(epoch)
        for batch in train_loader:
            start = time.perf_counter()
            step += 1
            with acceleration.current().call():
                metrics = train_step(
                    model, optimizer, _to_device(batch, device), micro_bs, optim_cfg["clip_grad"], world_size, packed
                )
            metrics["train/lr"] = optimizer.param_groups[0]["lr"]
            lr_scheduler.step()
            metrics["train/epoch"] = epoch
            is_last = step >= total_steps
            if val_loader is not None and _due(step, trainer_cfg.test_freq, is_last):
                metrics["val/loss"] = validation_loss(model, val_loader, micro_bs, device, packed)
            if _due(step, trainer_cfg.save_freq, is_last):
                last_saved = save_hf_checkpoint(model, tokenizer, trainer_cfg.default_local_dir, step, rank)
            metrics["timing_s/step"] = time.perf_counter() - start
            if rank == 0:
                tracker.log(metrics, step=step)
                bar.update(1)
                if _due(step, trainer_cfg.log_freq, is_last):
                    tqdm.write(_console_line(step, total_steps, metrics))
            if is_last:
                break
        epoch += 1
    bar.close()
    if tracker is not None:
        tracker.finish()
    return last_saved


# configuration and data mistakes: `main` prints them as one line and exits 1 (VERL_FULL_ERROR=1: traceback)
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, ImportError, OmegaConfBaseException)


@hydra.main(config_path="config", config_name="sft_trainer", version_base=None)
def main(config: DictConfig) -> None:
    try:
        path = run_sft(config)
    except USER_ERRORS as e:  # a configuration or data mistake: one line on stderr, exit code 1
        if os.environ.get("VERL_FULL_ERROR") == "1":
            raise
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: {type(e).__name__}: {message}", file=sys.stderr)
        sys.exit(1)
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"final checkpoint: {path}", flush=True)


if __name__ == "__main__":
    main()
