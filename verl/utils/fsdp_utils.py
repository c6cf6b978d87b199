"""FSDP2 and training helpers shared by the SFT trainer and the FSDP workers: `init_distributed`, `apply_fsdp2` (one
`fully_shard` per decoder layer plus the root, verl's `wrap_policy`, `fsdp_size`, `forward_prefetch`),
`fsdp_mixed_precision`, `offload_settings` (CUDA only), full state dicts in and out, gradient clipping on DTensors,
model loading and the worker's thread count; re-exports `verl.utils.optim`. Only FSDP2 (FSDP1 segfaults on CPU with
this torch), over gloo on CPU and nccl on GPU. Layer 1: no Ray.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from verl.utils.device import get_device_name, get_dist_backend, set_attention_backends
from verl.utils.mixed_precision import resolve_mixed_precision
from verl.utils.model_path import override_model_config
from verl.utils.optim import LR_SCHEDULE_STYLES, build_lr_scheduler, build_optimizer  # noqa: F401 (re-exported)

__all__ = [
    "init_distributed",
    "apply_fsdp2",
    "fsdp_device_mesh",
    "fsdp_mixed_precision",
    "offload_settings",
    "optimizer_state_on",
    "get_full_state_dict",
    "unsharded",
    "load_full_state_dict",
    "build_optimizer",
    "build_lr_scheduler",
    "clip_grad_norm_",
    "load_causal_lm",
    "load_token_classification_model",
    "set_torch_threads_from_env",
]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
_DTYPES.update({"float16": torch.float16, "fp16": torch.float16})


# ---------------------------------------------------------------- process group
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(backend: str | None = None) -> tuple[int, int]:
    """Start torch.distributed once per process and return `(rank, world_size)`.

    With env RANK and WORLD_SIZE set (torchrun, Ray workers) it joins that group through MASTER_ADDR/MASTER_PORT;
    without them it starts a single-process group on a free local port. If a group already exists, its rank and
    size are returned unchanged. `backend` defaults to gloo on CPU, nccl when CUDA is available. On CUDA it also
    turns cuDNN attention off for the process (`device.set_attention_backends`: a plan per new shape is too slow).
    """
    device_name = get_device_name("auto")
    set_attention_backends(device_name)
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    backend = backend or get_dist_backend(device_name)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(f"RANK and WORLD_SIZE are set but {missing} are not; set them to rank 0's address/port")
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if device_name == "cuda" and backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        dist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=world_size)
    else:
        if device_name == "cuda" and backend == "nccl":
            torch.cuda.set_device(0)
        # one process: an in-memory store, no TCP port to race another process for
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def destroy_distributed() -> None:
    """Tear down the process group, after a barrier so no rank leaves while a peer still talks to it.

    Gloo aborts the process ("terminate called without an active exception") when one rank destroys its group
    while another is still inside a collective or has not yet reached its own teardown.
    """
    if not dist.is_initialized():
        return
    if dist.get_world_size() > 1:
        dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- FSDP2 wrapping
def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks to shard one by one.

    First choice: modules whose class is named in HF's `_no_split_modules` (e.g. `Qwen2DecoderLayer`), looked up
    on the model or, for a peft model, on the wrapped base model. Fallback: the children of any `nn.ModuleList`
    named `layers`, `h` or `blocks`.
    """
    no_split: set[str] = set()
    for module in model.modules():
        no_split.update(getattr(module, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in no_split]
    if layers:
        return layers
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "h", "blocks"):
            layers.extend(module)
    return layers


def _tied_outside(prefix: str, param_paths: dict[int, list[str]], own: list[tuple[str, nn.Parameter]]) -> bool:
    """True when a parameter of the module at `prefix` is also reached by a path outside it (tied weights)."""
    for _, param in own:
        if any(not path.startswith(prefix + ".") for path in param_paths[id(param)]):
            return True
    return False


def _size_based_targets(model: nn.Module, min_num_params: int) -> list[nn.Module]:
    """verl/FSDP1's size-based auto-wrap for FSDP2: in post-order, every sub-module whose parameters not already in
    a wrapped descendant number at least `min_num_params` (modules holding a tied weight are left to the root)."""
    param_paths: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        param_paths.setdefault(id(param), []).append(name)
    targets: list[nn.Module] = []

    def visit(prefix: str, module: nn.Module) -> int:
        remaining = sum(visit(f"{prefix}.{name}" if prefix else name, child) for name, child in module.named_children())
        remaining += sum(p.numel() for p in module.parameters(recurse=False))
        own = [(f"{prefix}.{n}", p) for n, p in module.named_parameters(remove_duplicate=False)]
        if prefix and remaining >= min_num_params and not _tied_outside(prefix, param_paths, own):
            targets.append(module)
            return 0
        return remaining

    visit("", model)
    return targets


def _wrap_targets(model: nn.Module, wrap_policy: Any) -> list[nn.Module]:
    """The sub-modules that get their own `fully_shard`, children before parents.

    verl's `fsdp_config.wrap_policy`: `min_num_params` > 0 wraps by size (as FSDP1's size-based policy);
    otherwise `transformer_layer_cls_to_wrap` (class names; default: the model's decoder layers).
    """
    wrap_policy = wrap_policy or {}
    min_num_params = int(wrap_policy.get("min_num_params", 0) or 0)
    if min_num_params > 0:
        return _size_based_targets(model, min_num_params)
    names = wrap_policy.get("transformer_layer_cls_to_wrap", None)
    if not names:
        return _decoder_layers(model)
    names = {names} if isinstance(names, str) else set(names)
    targets = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if not targets:
        raise ValueError(
            f"fsdp_config.wrap_policy.transformer_layer_cls_to_wrap={sorted(names)} matches no module of "
            f"{type(model).__name__}; its decoder layer class is e.g. {sorted({type(m).__name__ for m in _decoder_layers(model)})}"
        )
    return targets


def fsdp_device_mesh(device_type: str, world_size: int, fsdp_size: int = -1) -> Any:
    """verl's mesh: 1-D ("fsdp",) over all ranks when `fsdp_size` is -1 or >= world_size, else 2-D
    ("ddp", "fsdp") of shape (world_size // fsdp_size, fsdp_size): FSDP2 shards within groups of `fsdp_size` ranks
    and replicates across them (hybrid sharding). world_size must be divisible by fsdp_size."""
    fsdp_size = int(fsdp_size)
    if fsdp_size == 0 or fsdp_size < -1:
        raise ValueError(f"fsdp_config.fsdp_size must be -1 (all ranks) or a positive int, got {fsdp_size}")
    if fsdp_size < 0 or fsdp_size >= world_size:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("fsdp",))
    if world_size % fsdp_size != 0:
        raise ValueError(f"fsdp_config.fsdp_size={fsdp_size} does not divide the world size {world_size}")
    return init_device_mesh(device_type, (world_size // fsdp_size, fsdp_size), mesh_dim_names=("ddp", "fsdp"))


def apply_fsdp2(
    model: nn.Module,
    device_mesh: Any = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
    offload_policy: OffloadPolicy | None = None,
    forward_prefetch: bool = False,
    fsdp_size: int = -1,
    wrap_policy: Any = None,
    buffer_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Shard `model` with FSDP2: `fully_shard` on every wrap target (`_wrap_targets`: decoder layers by default),
    then on the root; returns the same object.

    `device_mesh` defaults to `fsdp_device_mesh(device type, world size, fsdp_size)` (the process group is started
    with `init_distributed` if needed). `param_dtype` / `reduce_dtype` set a `MixedPrecisionPolicy` (e.g. bf16
    compute with fp32 gradient reduction); None keeps the parameters' dtype. FSDP2 has no buffer dtype (buffers are
    not sharded and never cast): `buffer_dtype` casts the floating-point buffers (e.g. rotary `inv_freq`) once,
    here; None leaves them as loaded. `offload_policy` (FSDP2's
    `CPUOffloadPolicy`, see `offload_settings`) keeps the sharded parameters, gradients and optimizer step on the
    CPU. `forward_prefetch` makes each wrapped layer prefetch the next one's all-gather in forward (depth 1, as
    verl). Parameters move to the mesh's device unless offloaded. A model without recognisable decoder layers is
    sharded as one unit (root only).
    """
    if device_mesh is None:
        _, world_size = init_distributed()
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        device_mesh = fsdp_device_mesh(device_type, world_size, fsdp_size)
    kwargs: dict[str, Any] = {"mesh": device_mesh, "reshard_after_forward": reshard_after_forward}
    if buffer_dtype is not None:
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                if buf.is_floating_point():
                    setattr(module, name, buf.to(buffer_dtype))
    if param_dtype is not None or reduce_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    targets = _wrap_targets(model, wrap_policy)
    for layer in targets:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    for unit in model.modules():  # what `unsharded` restores after a generation
        if isinstance(unit, FSDPModule):
            unit._verl_reshard_after_forward = reshard_after_forward
    if forward_prefetch:
        sharded = [m for m in targets if isinstance(m, FSDPModule)]
        for layer, following in zip(sharded, sharded[1:]):
            layer.set_modules_to_forward_prefetch([following])
    return model


@contextmanager
def unsharded(module: nn.Module, through_backward: bool = False) -> Iterator[None]:
    """The block runs `module`'s forwards on its full weights: every FSDP2 unit is gathered once on entry and kept
    gathered (no resharding after a forward), then resharded on exit. No collective runs inside the block, so the
    ranks may make different numbers of forwards (a generation whose rows stop at different lengths). With
    `through_backward` the units also stay gathered after each backward (FSDP2's gradient reduction still runs in
    every backward, a collective as usual). A plain module is left as it is. Collective on entry and exit: every
    rank of the mesh enters together."""
    units = [unit for unit in module.modules() if isinstance(unit, FSDPModule)]
    for unit in units:
        unit.set_reshard_after_forward(False)
        if through_backward:
            unit.set_reshard_after_backward(False, recurse=False)
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            if through_backward:
                unit.set_reshard_after_backward(True, recurse=False)  # FSDP2's default; verl never changes it
            unit.reshard()
            unit.set_reshard_after_forward(getattr(unit, "_verl_reshard_after_forward", True))


@contextmanager
def concurrent_forwards(module: nn.Module) -> Iterator[None]:
    """Within `unsharded(module)`: the block may run forwards of `module` in several threads at once.

    FSDP2's forward hooks keep per-unit state (the training state, the root's per-iteration context, prefetches)
    that forwards running side by side corrupt (an all-gather wait on a unit another thread left unsharded). With
    every unit gathered and kept gathered the hooks have nothing to do, so for the block each unit's state is the
    one in which FSDP's hooks only cast inputs and outputs to the mixed-precision dtypes (what FSDP itself uses when
    activation checkpointing recomputes a forward), and its own state is put back afterwards. A plain module is left
    as it is. No gradients: the block's forwards must run without autograd."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    states = [unit._get_fsdp_state() for unit in module.modules() if isinstance(unit, FSDPModule)]
    before = [state._training_state for state in states]
    for state in states:
        state._training_state = TrainingState.PRE_BACKWARD
    try:
        yield
    finally:
        for state, training_state in zip(states, before):
            state._training_state = training_state


def fsdp_mixed_precision(fsdp_cfg: Any, where: str) -> dict[str, torch.dtype | None]:
    """`apply_fsdp2`'s `param_dtype`, `reduce_dtype`, `buffer_dtype` for an `fsdp_config` (verl's `mixed_precision`
    mapping over `dtype`; rules in `verl.utils.mixed_precision`). ValueError (one line, naming `where`) for a bad
    value."""
    resolved = resolve_mixed_precision(fsdp_cfg, where)
    return {key: None if name is None else _DTYPES[name] for key, name in asdict(resolved).items()}


# ---------------------------------------------------------------- CPU offload
_NOTICES_PRINTED: set[str] = set()


def notice_once(key: str, message: str) -> bool:
    """Print `message` on stderr the first time `key` is seen in this process; True when it was printed."""
    if key in _NOTICES_PRINTED:
        return False
    _NOTICES_PRINTED.add(key)
    print(message, file=sys.stderr, flush=True)
    return True


def offload_settings(fsdp_cfg: Any, device_type: str, where: str) -> tuple[OffloadPolicy | None, bool]:
    """(FSDP2 offload policy, whether to move the optimizer state to CPU between updates) for an `fsdp_config`.

    On CUDA: `param_offload` (or verl's `offload_policy`) gives `CPUOffloadPolicy(pin_memory=True)`: sharded
    parameters, gradients and the optimizer step live on the CPU and each layer is copied to the GPU for its
    compute; the optimizer state is then on the CPU already, so `optimizer_offload` only acts without it. On CPU
    both flags have nothing to move: one notice per process (naming `where`, e.g.
    "actor_rollout_ref.actor.fsdp_config") and (None, False).
    """
    fsdp_cfg = fsdp_cfg or {}
    param = bool(fsdp_cfg.get("param_offload", False)) or bool(fsdp_cfg.get("offload_policy", False))
    optimizer = bool(fsdp_cfg.get("optimizer_offload", False))
    if device_type != "cuda":
        flags = [k for k in ("param_offload", "offload_policy", "optimizer_offload") if fsdp_cfg.get(k, False)]
        if flags:
            notice_once(
                "cpu-offload",
                f"notice: {where}.{'/'.join(flags)}=true has no effect on CPU: parameters and optimizer state "
                "already live in host memory",
            )
        return None, False
    return (CPUOffloadPolicy(pin_memory=True) if param else None), optimizer and not param


@torch.no_grad()
def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Move every tensor of the optimizer's state (e.g. AdamW's exp_avg, exp_avg_sq) to `device`, in place."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = value.to(device, non_blocking=True)


@contextmanager
def optimizer_state_on(optimizer: torch.optim.Optimizer, device: torch.device | str, offload: bool) -> Iterator[None]:
    """With `offload` (fsdp_config.optimizer_offload on CUDA): the optimizer state is on `device` inside the block
    and back on the CPU after it, as verl's load_fsdp_optimizer / offload_fsdp_optimizer; else a no-op."""
    if not offload:
        yield
        return
    move_optimizer_state(optimizer, device)
    try:
        yield
    finally:
        move_optimizer_state(optimizer, "cpu")
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


# ---------------------------------------------------------------- full state dicts
def _on_mesh_device(value: DTensor) -> DTensor:
    """`value` with its local shard on its mesh's device type, where the collectives run (with FSDP2's
    CPUOffloadPolicy the shards of a CUDA mesh live on the CPU, which nccl cannot all-gather)."""
    return value if value.device.type == value.device_mesh.device_type else value.to(value.device_mesh.device_type)


def get_full_state_dict(model: nn.Module, cpu_offload: bool = True) -> dict[str, torch.Tensor]:
    """The unsharded `{name: tensor}` of `model`, on every rank (a collective: all ranks must call it).

    Names are the HF ones (no FSDP prefixes). Sharded parameters are gathered one at a time and, with
    `cpu_offload`, copied to CPU right away, so the device never holds more than one extra full parameter; the
    result is then an independent snapshot. Without `cpu_offload` a tensor may alias the live parameter (world
    size 1): treat it as read-only.
    """
    sharded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
    full = {}
    for name, value in sharded.items():
        tensor = _on_mesh_device(value).full_tensor() if isinstance(value, DTensor) else value
        full[name] = tensor.detach().to("cpu", copy=True) if cpu_offload else tensor.detach()
    return full


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load an unsharded state dict (every rank passes the full tensors) into a plain or FSDP2-sharded model.

    Strict: a missing or unexpected key raises ValueError (torch's loader would silently keep the current value of
    a missing key). `state_dict` itself is not modified (torch's loader rewrites the dict it is given).
    """
    expected = set(get_model_state_dict(model, options=StateDictOptions(full_state_dict=False)))
    missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise ValueError(f"state dict does not match the model: missing keys {missing}, unexpected keys {unexpected}")
    set_model_state_dict(model, dict(state_dict), options=StateDictOptions(full_state_dict=True, strict=True))


# ---------------------------------------------------------------- clipping
def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the gradients of `model` to total L2 norm `max_norm`; returns the norm before clipping (a 0-d tensor).

    Works with FSDP2 DTensor gradients (the norm is reduced over all shards; every rank gets the same value).
    A non-finite norm (inf/nan) is returned as is and the gradients are left untouched, so the caller can skip
    the optimizer step.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    grads = [p.grad for p in params]
    total_norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(total_norm, DTensor):
        total_norm = _on_mesh_device(total_norm)  # CPUOffloadPolicy: the gradients' shards live on the CPU
    full_norm = total_norm.full_tensor() if isinstance(total_norm, DTensor) else total_norm
    if torch.isfinite(full_norm):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm)
    return full_norm.detach()


# ---------------------------------------------------------------- HF model loading
def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; allowed: {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def _load_config(path: str, trust_remote_code: bool):
    from transformers import AutoConfig

    if not os.path.isdir(path):
        raise ValueError(f"model path {path!r} does not exist or is not a directory")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model path {path!r} has no config.json; expected a HF model directory")
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (ValueError, OSError, KeyError) as err:
        raise ValueError(f"cannot read the model config in {path!r}: {err}") from err


def _finish(model: nn.Module, gradient_checkpointing: bool, lean_activations: bool = False) -> nn.Module:
    if lean_activations:  # RMSNorm/MLP keep only their inputs for backward (verl/models/lean_layers.py)
        from verl.models.lean_layers import apply_lean_layers

        apply_lean_layers(model)
    if gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def load_causal_lm(
    path: str,
    dtype: str | torch.dtype = "float32",
    attn_implementation: str = "sdpa",
    gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
    model_cls: type | None = None,
    lean_activations: bool = False,
    override_config: Any = None,
) -> nn.Module:
    """Load a HF causal LM from a local directory onto the CPU (`model_cls` default: AutoModelForCausalLM).

    A missing path, a directory without config.json, or a config that is not a causal LM raise ValueError naming
    the path. With `gradient_checkpointing`, non-reentrant activation checkpointing is enabled; with
    `lean_activations`, the RMSNorm and MLP modules save only their inputs for backward (`apply_lean_layers`).
    """
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoModelForCausalLM

    config = _load_config(path, trust_remote_code)
    override_model_config(config, override_config, "model.override_config")
    if model_cls is None:
        has_remote_class = "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
        if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING and not (trust_remote_code and has_remote_class):
            raise ValueError(
                f"model at {path!r} has config type {type(config).__name__} (model_type "
                f"{getattr(config, 'model_type', None)!r}), which is not a causal LM"
            )
        model_cls = AutoModelForCausalLM
    model = model_cls.from_pretrained(
        path,
        config=config,
        dtype=_torch_dtype(dtype),
        attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code,
    )
    return _finish(model, gradient_checkpointing, lean_activations)


def materialize_parameters(module: nn.Module) -> nn.Module:
    """Give every parameter and buffer of `module` memory of its own, one tensor at a time (tied weights stay tied).

    `from_pretrained` may leave weights as views of the memory-mapped safetensors file: clean file pages the kernel
    drops under memory pressure and reads back on the next touch, and copies on first write. A model whose weights
    are written in place (the `hf` rollout copy, refreshed after every update) would then grow by its whole size at
    its first weight sync, in the middle of a step; materialised, it costs that memory once, at start-up."""
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            tensor.data = tensor.data.clone()
    return module


def load_token_classification_model(
    path: str,
    dtype: str | torch.dtype = "float32",
    attn_implementation: str = "sdpa",
    gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
    lean_activations: bool = False,
    override_config: Any = None,
) -> nn.Module:
    """Load a value model (critic): AutoModelForTokenClassification with `num_labels=1` and no dropout, on CPU.

    From a causal-LM checkpoint the `score` head (hidden -> 1) is new; it is zero-initialised so that the first
    values are 0 instead of random. Output logits are (bs, seq_len, 1).
    """
    from transformers import AutoModelForTokenClassification

    config = _load_config(path, trust_remote_code)
    override_model_config(config, override_config, "critic.model.override_config")
    config.num_labels = 1
    config.classifier_dropout = 0.0
    try:
        model, info = AutoModelForTokenClassification.from_pretrained(
            path,
            config=config,
            dtype=_torch_dtype(dtype),
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
        )
    except ValueError as err:
        raise ValueError(f"cannot load a token-classification (value) model from {path!r}: {err}") from err
    new_keys = set(info.get("missing_keys", []))
    head = getattr(model, "score", None)
    if isinstance(head, nn.Linear) and any(k.startswith("score.") for k in new_keys):
        with torch.no_grad():
            head.weight.zero_()
            if head.bias is not None:
                head.bias.zero_()
    return _finish(model, gradient_checkpointing, lean_activations)


# ---------------------------------------------------------------- threads
def set_torch_threads_from_env() -> int:
    """Set torch's intra-op thread count from the worker's CPU share and return the count in use.

    `VERL_NUM_THREADS` (any value >= 1) wins; else `OMP_NUM_THREADS` if it is > 1 (Ray sets it to the actor's
    num_cpus); otherwise torch's current setting is kept.
    """
    for var, minimum in (("VERL_NUM_THREADS", 1), ("OMP_NUM_THREADS", 2)):
        raw = os.environ.get(var)
        if raw is None or raw == "":
            continue
        try:
            value = int(raw)
        except ValueError as err:
            raise ValueError(f"environment variable {var} must be a positive integer, got {raw!r}") from err
        if value >= minimum:
            torch.set_num_threads(value)
            break
    return torch.get_num_threads()
