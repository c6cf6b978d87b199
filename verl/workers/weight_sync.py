"""Weight sync from the FSDP2 actor to a rollout engine (`model_update`), streamed from the shards.

Owns `actor_weights` / `actor_weight_buckets` (gathered lazily, one tensor or one bucket of
`update_weights_bucket_megabytes` alive at once), `sync_rollout_weights` (called after every actor update; an
engine exposing `in_place_module()` gets each rank's rows broadcast into its parameters, nothing gathered), the
name mapping and LoRA merge (`engine_name`, `merged_lora_name`, `merge_lora_weight`: `full`, `adapters` or
`merged` weights under the engine's names, a tied weight once) and `GatherStats`. A collective: every rank runs
the same sync and reads the stream to its end. Layer 5 helper: torch only, never Ray.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

__all__ = [
    "DEFAULT_BUCKET_MEGABYTES",
    "GatherStats",
    "actor_weight_buckets",
    "actor_weights",
    "bucket_bytes",
    "engine_name",
    "merge_lora_weight",
    "merged_lora_name",
    "sync_mode",
    "sync_in_place",
    "sync_rollout_weights",
]

SyncMode = Literal["full", "adapters", "merged"]
SYNC_MODES = ("full", "adapters", "merged")
DEFAULT_BUCKET_MEGABYTES = 2048  # verl 0.9.1's rollout.checkpoint_engine.update_weights_bucket_megabytes
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
PEFT_PREFIX = "base_model.model."
Bucket = list[tuple[str, torch.Tensor]]


# ---------------------------------------------------------------- configuration
def bucket_bytes(rollout_cfg: Any) -> int:
    """`rollout.checkpoint_engine.update_weights_bucket_megabytes` (verl's key, default 2048) in bytes."""
    section = (rollout_cfg or {}).get("checkpoint_engine", None) or {}
    value = section.get("update_weights_bucket_megabytes", DEFAULT_BUCKET_MEGABYTES)
    if value is None or float(value) <= 0:
        raise ValueError(
            f"actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes must be > 0, got {value!r}"
        )
    return int(float(value) * (1 << 20))


def sync_mode(engine: Any, use_lora: bool) -> SyncMode:
    """What a rollout engine (instance or class) gets from a LoRA or plain actor: `full`, `adapters` (an engine
    holding the same peft adapters) or `merged` (an engine built from model.path, `builds_from_path`)."""
    if not use_lora:
        return "full"
    return "merged" if getattr(engine, "builds_from_path", False) else "adapters"


# ---------------------------------------------------------------- names
def engine_name(name: str) -> str:
    """A parameter name without FSDP1 / activation-checkpoint / torch.compile wrapper prefixes (FSDP2 adds none)."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def merged_lora_name(name: str) -> str:
    """The plain HF name of a peft model's weight: `base_model.model.model.layers.0.q_proj.base_layer.weight` ->
    `model.layers.0.q_proj.weight` (wrapper prefixes stripped too)."""
    name = engine_name(name)
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX) :]
    return name.replace(".base_layer.", ".")


# ---------------------------------------------------------------- LoRA merge
def merge_lora_weight(
    weight: torch.Tensor,
    adapters: list[tuple[torch.Tensor, torch.Tensor, float]],
    fan_in_fan_out: bool = False,
    inplace: bool = False,
) -> torch.Tensor:
    """W + sum_i s_i * B_i @ A_i in float32: a peft Linear's merged weight (peft's `get_delta_weight`).

    weight: (out, in), or (in, out) for a `fan_in_fan_out` layer (GPT-2's Conv1D), whose delta is transposed.
    adapters: (A (r, in), B (out, r), scaling) per active adapter. With `inplace` the sum accumulates into `weight`
    itself (it must be a float32 tensor the caller owns); otherwise `weight` is left alone.
    """
    if inplace and weight.dtype != torch.float32:
        raise ValueError(f"merge_lora_weight(inplace=True) needs a float32 weight, got {weight.dtype}")
    merged = weight if inplace else weight.to(torch.float32, copy=True)
    for lora_a, lora_b, scaling in adapters:
        a, b = lora_a.to(merged.device, torch.float32), lora_b.to(merged.device, torch.float32)
        if fan_in_fan_out:
            merged.addmm_(a.T, b.T, alpha=float(scaling))
        else:
            merged.addmm_(b, a, alpha=float(scaling))
    return merged


def _is_lora_layer(module: nn.Module) -> bool:
    return hasattr(module, "base_layer") and hasattr(module, "lora_A") and hasattr(module, "scaling")


# ---------------------------------------------------------------- gathering
@dataclass
class GatherStats:
    """Bytes of gathered tensors (new memory, not views of the actor's own shards) alive during a sync: `peak` is
    the most alive at once, `largest` the largest single tensor, `tensors` / `buckets` how many were sent."""

    alive: int = 0
    peak: int = 0
    largest: int = 0
    tensors: int = 0
    buckets: int = 0

    def track(self, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.alive += nbytes
        self.peak = max(self.peak, self.alive)
        self.largest = max(self.largest, nbytes)
        weakref.finalize(tensor, self._free, nbytes)

    def _free(self, nbytes: int) -> None:
        self.alive -= nbytes


def _target_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _gather(tensor: torch.Tensor, dtype: torch.dtype | None, stats: GatherStats | None) -> tuple[torch.Tensor, bool]:
    """The full tensor of a sharded (DTensor) or plain one in `dtype` (floating only), on the mesh's device, and
    whether it is new memory (False: a view of the live parameter, e.g. on one rank; treat it as read-only)."""
    source = tensor.detach()
    out = source
    if isinstance(out, DTensor):
        if out.device.type != out.device_mesh.device_type:  # CPUOffloadPolicy: gather where the collectives run
            out = out.to(out.device_mesh.device_type)
        out = out.to(_target_dtype(out, dtype)).full_tensor()  # cast the shard first: less to move
    else:
        out = out.to(_target_dtype(out, dtype))
    fresh = out.untyped_storage().data_ptr() != _local(source).untyped_storage().data_ptr()
    if fresh and stats is not None:
        stats.track(out)
    return out, fresh


@dataclass
class _Entry:
    name: str
    nbytes: int  # in the dtype sent, known before anything is gathered
    make: Callable[[], torch.Tensor]
    source: torch.Tensor | None = None  # the actor's own (sharded) tensor, for a plain entry


def _own_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A module's direct parameters and persistent buffers (what its state dict holds)."""
    yield from module.named_parameters(recurse=False)
    skip = getattr(module, "_non_persistent_buffers_set", set())
    for name, buf in module.named_buffers(recurse=False):
        if name not in skip:
            yield name, buf


def _nbytes(tensor: torch.Tensor, dtype: torch.dtype | None) -> int:
    return tensor.numel() * _target_dtype(tensor, dtype).itemsize


def _plain_entry(name: str, tensor: torch.Tensor, dtype: torch.dtype | None, stats: GatherStats | None) -> _Entry:
    return _Entry(name, _nbytes(tensor, dtype), lambda: _gather(tensor, dtype, stats)[0], tensor)


def _merged_entries(
    prefix: str, layer: nn.Module, dtype: torch.dtype | None, stats: GatherStats | None, seen: set[int]
) -> Iterator[_Entry]:
    """The base weights of one peft LoRA layer, its `weight` merged with the active adapters, under HF names."""
    base = layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer.base_layer
    adapters = []
    if not getattr(layer, "merged", False) and not getattr(layer, "disable_adapters", False):
        for adapter in layer.active_adapters:
            if adapter in getattr(layer, "lora_embedding_A", {}) or getattr(layer, "use_dora", {}).get(adapter):
                raise NotImplementedError(
                    f"merging LoRA layer {prefix!r} for the rollout engine: only Linear LoRA adapters can be merged "
                    "(no DoRA, no embedding adapters); drop that module from model.target_modules"
                )
            if adapter in layer.lora_A:
                adapters.append((layer.lora_A[adapter].weight, layer.lora_B[adapter].weight, layer.scaling[adapter]))
    seen.update(id(t) for a, b, _ in adapters for t in (a, b))
    fan_in_fan_out = bool(getattr(layer, "fan_in_fan_out", False))
    for local, tensor in _own_tensors(base):
        seen.add(id(tensor))
        name = merged_lora_name(f"{prefix}.{local}")
        if local != "weight" or not adapters:
            yield _plain_entry(name, tensor, dtype, stats)
            continue

        def make(weight: torch.Tensor = tensor) -> torch.Tensor:
            full, fresh = _gather(weight, torch.float32, stats)
            pairs = [(_gather(a, None, stats)[0], _gather(b, None, stats)[0], s) for a, b, s in adapters]
            merged = merge_lora_weight(full, pairs, fan_in_fan_out, inplace=fresh)  # fresh: into the gathered copy
            if not fresh and stats is not None:
                stats.track(merged)
            del full, pairs
            out = merged.to(_target_dtype(merged, dtype))
            if out is not merged and stats is not None:
                stats.track(out)
            return out

        yield _Entry(name, _nbytes(tensor, dtype), make)


def _entries(
    module: nn.Module, mode: SyncMode, dtype: torch.dtype | None, stats: GatherStats | None
) -> Iterator[_Entry]:
    """What `mode` sends of `module`, in module order, without gathering anything yet."""
    for sub in module.modules():  # sharded DTensors of the master weights, also after a forward without reshard
        if isinstance(sub, FSDPModule):
            sub.reshard()
    seen: set[int] = set()  # tied weights go once
    merged_layers: list[str] = []
    for prefix, sub in module.named_modules():
        if any(prefix.startswith(done) for done in merged_layers):
            continue
        if mode == "merged" and _is_lora_layer(sub):
            yield from _merged_entries(prefix, sub, dtype, stats, seen)
            merged_layers.append(prefix + ".")
            continue
        for local, tensor in _own_tensors(sub):
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            name = f"{prefix}.{local}" if prefix else local
            if mode == "adapters" and "lora_" not in name:
                continue
            name = merged_lora_name(name) if mode == "merged" else engine_name(name)
            yield _plain_entry(name, tensor, dtype, stats)


def _check(module: nn.Module, mode: SyncMode) -> None:
    if mode not in SYNC_MODES:
        raise ValueError(f"unknown weight sync mode {mode!r}; allowed: {list(SYNC_MODES)}")
    if mode == "adapters" and not any("lora_" in name for name, _ in module.named_parameters()):
        raise ValueError(
            "weight sync mode 'adapters': the actor has no lora_ parameters; was it built with apply_lora?"
        )


def actor_weights(
    module: nn.Module, dtype: torch.dtype | None = None, mode: SyncMode = "full", stats: GatherStats | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights of a plain or FSDP2-sharded model as `(name, full tensor)` pairs, each gathered when it is asked
    for: floating ones in `dtype` (None: as they are), on the mesh's device. A reader that drops each tensor before
    asking for the next keeps one alive. `mode`: see the module docstring. A collective under FSDP2: every rank must
    read the stream to its end. `stats` counts gathered bytes alive."""
    _check(module, mode)
    for entry in _entries(module, mode, dtype, stats):
        if stats is not None:
            stats.tensors += 1
        yield entry.name, entry.make()


def actor_weight_buckets(
    module: nn.Module,
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
    mode: SyncMode = "full",
    stats: GatherStats | None = None,
) -> Iterator[Bucket]:
    """`actor_weights` grouped in buckets (lists of pairs) of at most `bucket_bytes` in the dtype sent (a larger
    tensor travels alone), gathered as the bucket fills. The generator drops a bucket as soon as the next one is
    asked for, so a reader that drops it too (as `named_tensor_stream` does) keeps one bucket alive."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    _check(module, mode)
    bucket: Bucket = []
    size = 0
    for entry in _entries(module, mode, dtype, stats):
        if bucket and size + entry.nbytes > bucket_bytes:
            if stats is not None:
                stats.buckets += 1
            yield bucket
            bucket, size = [], 0  # drop ours before gathering more
        bucket.append((entry.name, entry.make()))
        size += entry.nbytes
        if stats is not None:
            stats.tensors += 1
    if bucket:
        if stats is not None:
            stats.buckets += 1
        yield bucket


# ---------------------------------------------------------------- in place: no gathered tensor at all
def _row_shards(tensor: torch.Tensor, target: torch.Tensor) -> bool:
    """Whether `tensor` is sharded by rows over a 1-D mesh (FSDP2's layout) whose device `target` is on."""
    return (
        isinstance(tensor, DTensor)
        and tensor.device_mesh.ndim == 1
        and tensor.placements[0].is_shard(0)
        and target.device.type == tensor.device_mesh.device_type
        and target.is_contiguous()
        and tuple(target.shape) == tuple(tensor.shape)
    )


def _write_into(target: torch.Tensor, tensor: torch.Tensor, stats: GatherStats | None) -> None:
    """Write the full value of the actor's `tensor` into the engine's `target` (same shape). Sharded by rows: mesh
    rank r copies its rows (FSDP2 cuts dim 0 as `torch.chunk`) into `target`'s rows and broadcasts them from there,
    so nothing is gathered (a shard-sized copy only when dtype or device differ). Otherwise the gathered tensor is
    copied in (one tensor alive)."""
    source = tensor.detach()
    if not _row_shards(source, target):
        full, _ = _gather(source, target.dtype, stats)
        target.copy_(full)
        return
    mesh = source.device_mesh
    group, world, me = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    local = source.to_local()
    converted = local.to(device=target.device, dtype=target.dtype)
    if stats is not None and converted.untyped_storage().data_ptr() != local.untyped_storage().data_ptr():
        stats.track(converted)
    rows = source.shape[0]
    chunk = -(-rows // world)
    for r in range(world):
        lo, hi = r * chunk, min((r + 1) * chunk, rows)
        if lo >= hi:
            continue
        view = target[lo:hi]
        if r == me:
            view.copy_(converted)
        dist.broadcast(view, src=dist.get_global_rank(group, r), group=group)


@torch.no_grad()
def sync_in_place(actor_module: nn.Module, engine_module: nn.Module, stats: GatherStats | None = None) -> None:
    """Write the actor's weights (mode `full`) straight into the parameters and persistent buffers of an engine's
    own model (same names after the wrapper prefixes, same shapes), each by `_write_into`: the rise in memory during
    the sync is a shard-sized cast copy at most, never a gathered tensor (gloo's all-gather would also allocate a
    second full-size buffer). Every engine tensor must be written (tied ones once) and every actor name known, else
    KeyError, raised after all collectives are done. Collective: every rank of the actor's mesh calls it."""
    _check(actor_module, "full")
    targets = dict(engine_module.named_parameters(remove_duplicate=False))
    targets.update((name, buf) for name, buf in engine_module.named_buffers(remove_duplicate=False))
    written, unknown = set(), []
    for entry in _entries(actor_module, "full", None, stats):
        target = targets.get(entry.name)
        if target is None:  # every rank sees the same names: all skip it together
            unknown.append(entry.name)
            continue
        _write_into(target, entry.source, stats)
        written.add(id(target))
        if stats is not None:
            stats.tensors += 1
    missing = [n for n, p in engine_module.named_parameters(remove_duplicate=False) if id(p) not in written]
    if unknown or missing:
        raise KeyError(
            f"in-place weight sync: actor names the engine lacks {unknown[:5]}, engine weights not sent {missing[:5]}"
        )


# ---------------------------------------------------------------- what the worker calls
def sync_rollout_weights(
    actor_module: nn.Module, rollout: Any, rollout_cfg: Any, use_lora: bool, stats: GatherStats | None = None
) -> None:
    """model_update: the actor's weights into the engine: written in place into an engine that exposes its own model
    (`in_place_module()`: the `hf` engine without LoRA; `sync_in_place`, nothing gathered), else streamed into
    `rollout.update_weights` in the engine's dtype (`rollout.weight_dtype`; LoRA adapters in the actor's): tensor by
    tensor, or in buckets of `rollout.checkpoint_engine.update_weights_bucket_megabytes` for an engine with
    `takes_buckets`. Collective: every actor rank calls it."""
    mode = sync_mode(rollout, use_lora)
    dtype = None if mode == "adapters" else getattr(rollout, "weight_dtype", None)
    size = bucket_bytes(rollout_cfg)  # checked whatever the engine
    in_place = rollout.in_place_module() if mode == "full" and hasattr(rollout, "in_place_module") else None
    if in_place is not None:
        sync_in_place(actor_module, in_place, stats)
    elif getattr(rollout, "takes_buckets", False):
        rollout.update_weights(actor_weight_buckets(actor_module, size, dtype, mode, stats))
    else:
        rollout.update_weights(actor_weights(actor_module, dtype, mode, stats))
