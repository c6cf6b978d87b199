"""What every training engine does around the model call: `micro_batch_plan` / `split_micro_batches` (fixed rows or
a token budget, prompt groups side by side) and `restore_order`, `global_batch_counts` (verl's
`global_batch_size` / `batch_num_tokens` over the dp ranks), `clip_grad_and_step` (skips a non-finite step),
`mask_padding_rows` / `REAL_ROW_KEY`, and small helpers. Layer 5: no Ray, no trainer code.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from verl.protocol import DataProto, real_row_mask
from verl.utils.fsdp_utils import clip_grad_norm_
from verl.utils.seqlen_balancing import rearrange_micro_batches
from verl.utils.torch_functional import prompt_groups
from verl.workers.engine.model_forward import prompt_group_order

__all__ = [
    "REAL_ROW_KEY",
    "all_reduce_sum",
    "clip_grad_and_step",
    "data_parallel_size",
    "global_batch_counts",
    "mask_padding_rows",
    "micro_batch_plan",
    "module_device",
    "one_rank_fsdp2",
    "restore_order",
    "split_micro_batches",
]

REAL_ROW_KEY = "_real_row"  # (bs,) 1.0 for a real row, 0.0 for a row the dispatch padded (see mask_padding_rows)


def mask_padding_rows(data: DataProto) -> DataProto:
    """Make the rows a DP_COMPUTE_PROTO dispatch padded (`verl.protocol.real_row_mask`) train on nothing: their
    `response_mask` becomes 0 (no loss, no token count) and `REAL_ROW_KEY` (0.0) keeps them out of the sample
    count. The rows stay (every rank runs as many micro-batches, so FSDP's collectives pair up). In place."""
    real = real_row_mask(data)
    mask = data.batch["response_mask"]
    if not bool(real.all()):
        data.batch["response_mask"] = mask * real.to(device=mask.device, dtype=mask.dtype).unsqueeze(-1)
    data.batch[REAL_ROW_KEY] = real.to(device=mask.device, dtype=torch.float32)
    return data


def data_parallel_size() -> int:
    """World size of the default process group, 1 when torch.distributed is not initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def module_device(module: nn.Module) -> torch.device:
    """Device of the module's (local shard of the) parameters."""
    for param in module.parameters():
        return param.device
    return torch.device("cpu")


def one_rank_fsdp2(module: nn.Module) -> bool:
    """Whether `module` is FSDP2-sharded over a single rank with its parameters on the compute device (not
    CPU-offloaded): there gathering every unit at once costs one copy of the weights and no collective."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if not isinstance(module, FSDPModule):
        return False
    param = next(module.parameters(), None)
    if not isinstance(param, DTensor):
        return False
    mesh = param.device_mesh
    return mesh.size() == 1 and param.to_local().device.type == mesh.device_type


def _collective_device() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def all_reduce_sum(values: list[float]) -> list[float]:
    """`values` summed element-wise over the data-parallel ranks (unchanged in one process). Collective."""
    if data_parallel_size() == 1:
        return [float(v) for v in values]
    tensor = torch.tensor(values, dtype=torch.float64, device=_collective_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()


def global_batch_counts(
    response_mask: torch.Tensor, device: torch.device | None = None, real_rows: torch.Tensor | None = None
) -> tuple[int, int]:
    """(samples, response tokens) of a mini-batch summed over all data-parallel ranks.

    `response_mask`: (bs, response_len) of this rank; `real_rows` (bs,): 1 for a sample, 0 for a padding row
    (`mask_padding_rows`), all rows count when None. Every rank must call this for each mini-batch. The token
    count is at least 1: a mini-batch whose samples are all masked out (the RLVR sample mask) gives a zero loss,
    not 0/0. (`device` is accepted for older callers; the collective runs on the backend's device.)
    """
    samples = response_mask.shape[0] if real_rows is None else int(real_rows.sum().item())
    total_samples, total_tokens = all_reduce_sum([samples, int(response_mask.sum().item())])
    return int(total_samples), max(int(total_tokens), 1)


def _max_over_ranks(value: int) -> int:
    """The largest `value` over the data-parallel ranks (a collective when torch.distributed runs)."""
    if data_parallel_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.long, device=_collective_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def micro_batch_plan(
    data: DataProto,
    micro_batch_size: int | None,
    use_dynamic_bsz: bool,
    max_token_len: int | None,
    group_prompts: bool = False,
) -> tuple[list[DataProto], torch.Tensor | None]:
    """Split `data` into micro-batches; return them and the row order they were cut from (None: unchanged).

    Fixed size: consecutive `micro_batch_size` rows. With `use_dynamic_bsz`: micro-batches of at most
    `max_token_len` real tokens (attention-mask ones; a longer sample gets one of its own), packed first-fit
    decreasing (`rearrange_micro_batches`); every data-parallel rank gets the largest count of any rank
    (a collective then: all ranks must call it together). With `group_prompts` rows of the same prompt are put next to each
    other first (and kept together by the token budget) so that `share_prompt_prefix` can run each prompt once.
    `torch.cat` of the micro-batches' rows equals `data[order]`.
    """
    order = None
    groups = None
    if group_prompts and "responses" in data.batch.keys():
        response_length = data.batch["responses"].shape[-1]
        groups = prompt_groups(data.batch["input_ids"], data.batch["attention_mask"], response_length)
    if use_dynamic_bsz:
        if max_token_len is None or int(max_token_len) <= 0:
            raise ValueError(f"use_dynamic_bsz needs a positive max token length per GPU, got {max_token_len!r}")
        lengths = data.batch["attention_mask"].sum(-1).tolist()
        units = None
        if groups is not None:
            units = [torch.nonzero(groups == g).flatten().tolist() for g in range(int(groups.max()) + 1)]
        index_lists = rearrange_micro_batches(lengths, int(max_token_len), units)
        count = _max_over_ranks(len(index_lists))  # every rank runs as many forwards (FSDP collectives pair up)
        if count > len(index_lists):
            index_lists = rearrange_micro_batches(lengths, int(max_token_len), units, min_num_micro_batches=count)
        order = torch.tensor([i for idx in index_lists for i in idx], dtype=torch.long)
        return [data[torch.tensor(idx, dtype=torch.long)] for idx in index_lists], order
    if micro_batch_size is None or int(micro_batch_size) <= 0:
        raise ValueError(f"micro batch size must be a positive int, got {micro_batch_size!r}")
    if groups is not None:
        response_length = data.batch["responses"].shape[-1]
        order = prompt_group_order(data.batch["input_ids"], data.batch["attention_mask"], response_length)
        if torch.equal(order, torch.arange(len(order))):
            order = None
        else:
            data = data[order]
    return data.split(int(micro_batch_size)), order


def split_micro_batches(
    data: DataProto,
    micro_batch_size: int | None,
    use_dynamic_bsz: bool,
    max_token_len: int | None,
    group_prompts: bool = False,
) -> list[DataProto]:
    """The micro-batches of `micro_batch_plan` (for an update, where their order does not matter)."""
    return micro_batch_plan(data, micro_batch_size, use_dynamic_bsz, max_token_len, group_prompts)[0]


def restore_order(values: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """Undo a row permutation: `values` row i belongs to input row `order[i]`."""
    if order is None:
        return values
    restored = torch.empty_like(values)
    restored[order.to(values.device)] = values
    return restored


def clip_grad_and_step(module: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> tuple[float, bool]:
    """Clip the global grad norm to `max_norm`, then step; a non-finite norm zeroes the grads instead.

    Returns (grad norm before clipping, whether the optimizer stepped).
    """
    grad_norm = clip_grad_norm_(module, max_norm)
    if hasattr(grad_norm, "full_tensor"):  # a DTensor norm over FSDP2 shards
        grad_norm = grad_norm.full_tensor()
    grad_norm = float(grad_norm)
    if not math.isfinite(grad_norm):
        optimizer.zero_grad()
        return grad_norm, False
    optimizer.step()
    return grad_norm, True
