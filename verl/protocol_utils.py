"""The parts of `DataProto`'s contract that need no `DataProto` class: the error type, the process-wide switches
(`DataProtoConfig.auto_padding`), row padding and unpadding for dispatch (`pad_dataproto_to_divisor`,
`unpad_dataproto`, `real_row_mask`), folding (`fold_batch_dim` / `unfold_batch_dim`), the index and key checks of
row selection, and `all_gather_data_proto`. `verl.protocol` re-exports all of it (verl's import paths).

Layer 2 (docs/architecture.md#layers), below `verl.protocol`: imports torch, tensordict and numpy only; functions take any
DataProto-like object and build results with `type(data)`.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tensordict import TensorDict

if TYPE_CHECKING:
    from verl.protocol import DataProto


class DataProtoError(AssertionError, ValueError):
    """A broken DataProto contract (verl raises AssertionError here; ValueError for everyone else)."""


def _require(condition: Any, message: str) -> None:
    if not condition:
        raise DataProtoError(message)


class _DataProtoConfigMeta(type):
    _config: dict = {}
    auto_padding_key = "_verl_auto_padding"

    @property
    def auto_padding(cls) -> bool:
        """On when env VERL_AUTO_PADDING is TRUE/1 or it was set: `chunk` may then cut unequal parts."""
        enabled_by_env = os.getenv("VERL_AUTO_PADDING", "FALSE").upper() in ("TRUE", "1")
        return enabled_by_env or cls._config.get(cls.auto_padding_key, False)

    @auto_padding.setter
    def auto_padding(cls, enabled: bool) -> None:
        assert isinstance(enabled, bool), f"enabled must be a boolean, got {enabled} as {type(enabled)}"
        cls._config[cls.auto_padding_key] = enabled


class DataProtoConfig(metaclass=_DataProtoConfigMeta):
    """Process-wide DataProto switches (`DataProtoConfig.auto_padding = True`)."""


# meta_info key verl's dispatch uses for the number of padding rows of a call
_padding_size_key = "_padding_size_key_x123d"

# meta_info key of a chunk that DP_COMPUTE_PROTO padded: how many of its last rows are padding (copies of real
# rows). Workers must not train on them: see `real_row_mask`.
PADDING_ROWS_KEY = "_verl_padding_rows"


def real_row_mask(data: DataProto) -> torch.Tensor:
    """(N,) bool: False for the padding rows a dispatch appended (the last `meta_info[PADDING_ROWS_KEY]` rows)."""
    pad_rows = int(data.meta_info.get(PADDING_ROWS_KEY, 0))
    if not 0 <= pad_rows <= len(data):
        raise ValueError(f"meta_info[{PADDING_ROWS_KEY!r}]={pad_rows} for a DataProto of {len(data)} rows")
    mask = torch.ones(len(data), dtype=torch.bool)
    if pad_rows:
        mask[len(data) - pad_rows :] = False
    return mask


# ---------------------------------------------------------------------------------------------- padding
def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Pad `data` to a multiple of `size_divisor` rows by appending copies of its first rows (cycling if needed).

    Returns `(padded, pad_size)`; `unpad_dataproto(padded, pad_size)` drops the padding again. The padded
    DataProto keeps `data.meta_info` as is (the padding rows do not repeat its metrics).
    """
    if not isinstance(size_divisor, int) or size_divisor <= 0:
        raise ValueError(f"size_divisor must be a positive int, got {size_divisor!r}")
    n = len(data)
    if n % size_divisor == 0:
        if n == 0:
            logging.warning("padding a DataProto with no item, no changed made")
        return data, 0
    pad_size = size_divisor - n % size_divisor
    padded = type(data).concat([data.select_idxs(np.arange(n)), data.select_idxs(np.arange(pad_size) % n)])
    padded.meta_info = data.meta_info
    return padded, pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the last `pad_size` rows added by `pad_dataproto_to_divisor` (`data[:-pad_size]`)."""
    if pad_size < 0 or pad_size > len(data):
        raise ValueError(f"pad_size must be in [0, {len(data)}] for a DataProto of {len(data)} rows, got {pad_size}")
    return data[: len(data) - pad_size] if pad_size else data


# ---------------------------------------------------------------------------------------------- folding
def fold_batch_dim(data: DataProto, new_batch_size: int) -> DataProto:
    """Reshape rows (bsz, ...) into (new_batch_size, bsz // new_batch_size, ...); batch dims stay 1."""
    batch_size = data.batch.batch_size[0]
    _require(batch_size % new_batch_size == 0, f"batch size {batch_size} is not divisible by {new_batch_size}")
    tensor = data.batch.view(new_batch_size, -1)
    tensor.auto_batch_size_(batch_dims=1)
    non_tensor = {k: np.reshape(v, (new_batch_size, -1, *v.shape[1:])) for k, v in data.non_tensor_batch.items()}
    return type(data)(batch=tensor, non_tensor_batch=non_tensor, meta_info=data.meta_info)


def unfold_batch_dim(data: DataProto, batch_dims: int = 2) -> DataProto:
    """Undo `fold_batch_dim`: merge the first `batch_dims` dims into the row dim."""
    tensor = data.batch
    tensor.auto_batch_size_(batch_dims=batch_dims)
    tensor = tensor.view(-1)
    batch_size = tensor.batch_size[0]
    non_tensor = {k: np.reshape(v, (batch_size, *v.shape[batch_dims:])) for k, v in data.non_tensor_batch.items()}
    return type(data)(batch=tensor, non_tensor_batch=non_tensor, meta_info=data.meta_info)


def _to_object_array(value: Any) -> Any:
    """A list/tuple as a 1-D object array, one element per row (even equal-length inner lists)."""
    if isinstance(value, (list, tuple)):
        out = np.empty(len(value), dtype=object)
        for i, item in enumerate(value):
            out[i] = item
        return out
    return value


def _check_keys(kind: str, wanted: list[str], available: Any) -> None:
    missing = [k for k in wanted if k not in available]
    if missing:
        raise KeyError(f"{kind} keys {missing} not found; available {kind} keys: {sorted(available)}")


def _as_index(idxs: Any, length: int) -> torch.Tensor:
    """A list / numpy array / tensor of ints, or a boolean mask of `length`, as a 1-D int64 tensor."""
    if isinstance(idxs, torch.Tensor):
        idx = idxs.detach().cpu()
    else:
        arr = np.asarray(idxs)
        if arr.dtype == object:
            raise TypeError(f"index array must hold ints or bools, got dtype {arr.dtype}")
        idx = torch.from_numpy(arr) if arr.size else torch.zeros(0, dtype=torch.long)
    if idx.dim() != 1:
        raise IndexError(f"index array must be 1-D, got shape {tuple(idx.shape)}")
    if idx.dtype == torch.bool:
        if idx.numel() != length:
            raise IndexError(f"boolean mask has length {idx.numel()} but the DataProto has {length} rows")
        return torch.nonzero(idx, as_tuple=False).flatten()
    if idx.is_floating_point() or idx.is_complex():
        raise IndexError(f"index array must hold ints or bools, got dtype {idx.dtype}")
    idx = idx.long()
    if idx.numel() and (idx.max() >= length or idx.min() < -length):
        raise IndexError(f"index out of range for a DataProto of {length} rows: {idx.tolist()}")
    return idx


def _type_info(value: Any) -> str:
    """A short description of a nested value's types, e.g. `list[int|str]` or `dict[str: float]`."""
    if isinstance(value, list):
        types = {_type_info(v) for v in value[:3]}
        return f"list[{'|'.join(sorted(types)) if types else '...'}]"
    if isinstance(value, tuple):
        return f"tuple({', '.join(_type_info(v) for v in value)})"
    if isinstance(value, dict):
        if not value:
            return "dict"
        key, val = next(iter(value.items()))
        return f"dict[{_type_info(key)}: {_type_info(val)}]"
    if isinstance(value, np.ndarray):
        return f"ndarray{value.shape} ({value.dtype})"
    return type(value).__name__


def all_gather_data_proto(data: DataProto, process_group: Any) -> None:
    """All-gather `data` over `process_group` in place (rows of every rank, in rank order)."""
    import torch.distributed as dist

    group_size = dist.get_world_size(group=process_group)
    gathered_batch = {}
    for key, tensor in data.batch.items():
        parts = [torch.empty_like(tensor) for _ in range(group_size)]
        dist.all_gather(parts, tensor.contiguous(), group=process_group)
        gathered_batch[key] = torch.cat(parts, dim=0)
    data.batch = TensorDict(gathered_batch, batch_size=[len(data) * group_size], device=data.batch.device)
    all_non_tensor: list = [None] * group_size
    dist.all_gather_object(all_non_tensor, data.non_tensor_batch, group=process_group)
    data.non_tensor_batch = {k: np.concatenate([d[k] for d in all_non_tensor]) for k in data.non_tensor_batch}
