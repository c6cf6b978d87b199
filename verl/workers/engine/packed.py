"""AReaL-lite's way of training: a loss over packed sequences, micro-batch losses combined by a weight.

`train_batch(engine, data, loss_fn, loss_weight_fn)`: the padded batch is cut into micro-batches (the same number
on every rank; an empty one is a zero-weight dummy), each packed (`pack_tensor_dict`), `loss_fn(logits, packed)`
weighted by `loss_weight_fn(packed) / total weight over all micro-batches and ranks` (times dp size), then one
clipped optimizer step; returns `{"loss", "grad_norm", "lr", "update_successful"}`. `eval_batch` is the same
without gradients; `forward` returns logits (or `post_hook`'s result) in the padded layout.
Layer 5: torch and the engine utilities.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from tensordict import TensorDict

from verl.protocol import DataProto
from verl.utils import tensordict_utils as tu
from verl.utils.packing import pack_tensor_dict, unpack_to_padded
from verl.workers.engine.model_forward import packed_logits
from verl.workers.engine.utils import _max_over_ranks, all_reduce_sum, micro_batch_plan, module_device

__all__ = ["eval_batch", "forward", "train_batch"]

_SETTING_KEYS = ("micro_batch_size_per_gpu", "use_dynamic_bsz", "max_token_len_per_gpu")


def _as_tensordict(data: Any) -> tuple[TensorDict, dict[str, Any]]:
    """(the tensors of `data` as a TensorDict of batch size [bs], the micro-batch settings found in it)."""
    if isinstance(data, TensorDict):
        settings = {key: tu.get_non_tensor_data(data, key, None) for key in _SETTING_KEYS if key in data.keys()}
        tensors = {key: data[key] for key in data.keys() if isinstance(data.get(key), torch.Tensor)}
    elif isinstance(data, Mapping):
        settings = {key: data[key] for key in _SETTING_KEYS if key in data}
        tensors = {key: value for key, value in data.items() if isinstance(value, torch.Tensor)}
    else:
        raise TypeError(f"train_batch/forward take a TensorDict or a dict of tensors, got {type(data).__name__}")
    if "attention_mask" not in tensors or "input_ids" not in tensors:
        raise KeyError(f"a packed-loss batch needs input_ids and attention_mask; got {sorted(tensors)}")
    bs = tensors["attention_mask"].shape[0]
    return TensorDict(tensors, batch_size=[bs]), settings


def _micro_batches(engine: Any, data: Any) -> list[tuple[TensorDict, torch.Tensor]]:
    """(micro-batch, its row indices in `data`) pairs; as many on every rank (see the module docstring)."""
    batch, settings = _as_tensordict(data)
    bs = batch.batch_size[0]
    rows = torch.arange(bs)
    if bool(settings.get("use_dynamic_bsz", False)):
        max_tokens = settings.get("max_token_len_per_gpu", engine.max_token_len_per_gpu)
        proto = DataProto(batch=TensorDict({"attention_mask": batch["attention_mask"], "row": rows}, batch_size=[bs]))
        parts = [part.batch["row"] for part in micro_batch_plan(proto, None, True, max_tokens)[0]]
    else:
        size = settings.get("micro_batch_size_per_gpu", engine.micro_batch_size_per_gpu) or max(bs, 1)
        if int(size) <= 0:
            raise ValueError(f"micro_batch_size_per_gpu must be a positive int, got {size!r}")
        count = _max_over_ranks(max(math.ceil(bs / int(size)), 1))
        parts = list(torch.tensor_split(rows, count)) if bs else [rows] * count
    return [(batch[index], index) for index in parts]


def _dummy(batch_like: TensorDict) -> TensorDict:
    """A one-token row for a rank that has no row in a micro-batch another rank fills (weight 0)."""
    ids = torch.zeros((1, 1), dtype=batch_like["input_ids"].dtype)
    return TensorDict({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, batch_size=[1])


def _logits(engine: Any, packed: Mapping[str, Any]) -> torch.Tensor:
    return packed_logits(engine.module, packed["input_ids"], packed["position_ids"], packed["cu_seqlens"]).float()


def _packed_on(micro: TensorDict, device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in pack_tensor_dict(micro).items()}


def _weighted_losses(
    engine: Any, data: Any, loss_fn: Callable, loss_weight_fn: Callable, backward: bool
) -> tuple[float, float]:
    """Run every micro-batch; return (the weighted mean loss over all ranks, the total weight over all ranks)."""
    device = module_device(engine.module)
    micro_batches = _micro_batches(engine, data)
    packed = []
    for micro, _ in micro_batches:
        empty = micro.batch_size[0] == 0
        packed.append((_packed_on(_dummy(micro) if empty else micro, device), empty))
    weights = [0.0 if empty else float(loss_weight_fn(mb)) for mb, empty in packed]
    if any(w < 0 or not math.isfinite(w) for w in weights):
        raise ValueError(f"loss_weight_fn must give finite weights >= 0, got {weights}")
    total = all_reduce_sum([sum(weights)])[0]
    if total <= 0:
        raise ValueError(
            "loss_weight_fn gave a total weight of 0 over all micro-batches and ranks: nothing to train on"
        )
    dp_size = engine.get_data_parallel_size()
    weighted = 0.0
    for (mb, _), weight in zip(packed, weights):
        logits = _logits(engine, mb)
        # a micro-batch of weight 0 adds nothing (its loss_fn may even be 0/0): only its forward and backward run
        loss = logits.sum() * 0.0 if weight == 0 else loss_fn(logits, mb)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TypeError(
                f"loss_fn must return a scalar tensor, got {type(loss).__name__} {getattr(loss, 'shape', '')}"
            )
        scaled = loss * (weight / total * dp_size)
        if backward:
            scaled.backward()
        weighted += float(loss.detach()) * weight / total
    return all_reduce_sum([weighted])[0], total


def train_batch(engine: Any, data: Any, loss_fn: Callable, loss_weight_fn: Callable) -> dict[str, float]:
    """One optimizer step of the weighted packed loss; see the module docstring."""
    engine.optimizer_zero_grad()
    loss, _ = _weighted_losses(engine, data, loss_fn, loss_weight_fn, backward=True)
    grad_norm = engine.optimizer_step()
    return {
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": float(engine.optimizer.param_groups[0]["lr"]),
        "update_successful": float(math.isfinite(grad_norm)),
    }


def eval_batch(engine: Any, data: Any, loss_fn: Callable, loss_weight_fn: Callable) -> float:
    """The weighted packed loss over the global batch, without gradients."""
    with torch.no_grad():
        return _weighted_losses(engine, data, loss_fn, loss_weight_fn, backward=False)[0]


def forward(engine: Any, data: Any, post_hook: Callable | None = None, aggregate_fn: Callable = torch.cat) -> Any:
    """Logits (bs, L, vocab) of `data`'s rows in its padded layout (0 at padding), or, with `post_hook`, what
    `post_hook(logits (nnz, vocab), packed)` returns: a per-token tensor (nnz, ...) comes back as (bs, L, ...), any
    other value is passed on per micro-batch. `aggregate_fn` joins the micro-batches' results (rows in `data`'s
    order when they are tensors)."""
    device = module_device(engine.module)
    results, order = [], []
    with torch.no_grad():
        for micro, index in _micro_batches(engine, data):
            if micro.batch_size[0] == 0:  # keeps the forwards of all ranks paired; nothing to return
                _logits(engine, _packed_on(_dummy(micro), device))
                continue
            packed = _packed_on(micro, device)
            out = _logits(engine, packed)
            if post_hook is not None:
                out = post_hook(out, packed)
            nnz = int(packed["cu_seqlens"][-1])
            if isinstance(out, torch.Tensor) and out.dim() >= 1 and out.shape[0] == nnz:
                out = unpack_to_padded(out, micro["attention_mask"].to(out.device))
            results.append(out)
            order.append(index)
    joined = aggregate_fn(results)
    if isinstance(joined, torch.Tensor) and joined.shape[0] == sum(len(i) for i in order):
        rows = torch.cat(order)
        if not torch.equal(rows, torch.arange(len(rows))):
            restored = torch.empty_like(joined)
            restored[rows.to(joined.device)] = joined
            joined = restored
    return joined
