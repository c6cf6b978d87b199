"""TensorDict helpers with verl's names (`from verl.utils import tensordict_utils as tu`): non-tensor values as
`NonTensorData` / `NonTensorStack`, jagged nested tensors kept jagged, dict-like get/pop/select, and raw-bytes
(de)serialisation of tensors and TensorDicts.

On import it restores two tensordict <= 0.10 rules that are verl's contract (`_keep_tensordict_010_rules`): concat
keeps the first part's NonTensorData, and `consolidate()` refuses a non-contiguous tensor. Layer 1.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from tensordict.tensorclass import NonTensorData, NonTensorStack

__all__ = [
    "assert_tensordict_eq",
    "assign_non_tensor",
    "assign_non_tensor_data",
    "assign_non_tensor_stack",
    "chunk_tensordict",
    "concat_nested_tensors",
    "concat_tensordict",
    "concat_tensordict_with_none_bsz",
    "contiguous",
    "deserialize_single_tensor",
    "deserialize_tensordict",
    "get",
    "get_keys",
    "get_non_tensor_data",
    "get_tensordict",
    "index_select_tensor_dict",
    "list_of_dict_to_tensordict",
    "make_iterator",
    "maybe_fix_3d_position_ids",
    "nested_tensor_from_tensor_list",
    "pad_to_divisor",
    "pop",
    "pop_keys",
    "serialize_single_tensor",
    "serialize_tensordict",
    "union_tensor_dict",
    "unpad",
    "unwrap_non_tensor_data",
]


# ------------------------------------------------------------------------------------ tensordict 0.10 rules
def _keep_tensordict_010_rules() -> None:
    """Patch NonTensorData's concatenation and TensorDict.consolidate back to tensordict 0.10 (module docstring)."""
    if getattr(TensorDict.consolidate, "_verl_contiguous_only", False):
        return
    cat_values = NonTensorData._cat_non_tensor.__func__

    def cat_keeping_first(cls, tensors, dim=0, out=None):
        tensors = list(tensors)
        if all(isinstance(t, NonTensorData) for t in tensors):  # batch-wide values: every part gets the first one
            first = tensors[0].data
            tensors = [NonTensorData(first, batch_size=t.batch_size, device=t.device) for t in tensors]
        return cat_values(cls, tensors, dim=dim, out=out)

    consolidate = TensorDict.consolidate

    def consolidate_contiguous_only(self, *args, **kwargs):
        if not self.is_consolidated():
            for key, value in self.items(include_nested=True, leaves_only=True):
                if isinstance(value, torch.Tensor) and not value.is_nested and not value.is_contiguous():
                    raise RuntimeError(f"consolidate: tensor {key!r} is not contiguous; use tu.contiguous(td) first")
        return consolidate(self, *args, **kwargs)

    consolidate_contiguous_only._verl_contiguous_only = True
    NonTensorData._cat_non_tensor = classmethod(cat_keeping_first)
    TensorDict.consolidate = consolidate_contiguous_only


_keep_tensordict_010_rules()


# ------------------------------------------------------------------------------------------ non-tensor values
def assign_non_tensor_data(tensor_dict: TensorDict, key: str, val: Any) -> None:
    """Store one value for the whole batch under `key` (wrapped in NonTensorData)."""
    assert isinstance(tensor_dict, TensorDict), "input dict must be a TensorDict"
    tensor_dict[key] = NonTensorData(val)


def assign_non_tensor_stack(tensor_dict: TensorDict, key: str, val: list) -> None:
    """Store one value per row under `key` (a NonTensorStack; rows may be lists, dicts, nested structures)."""
    assert isinstance(tensor_dict, TensorDict), "input dict must be a TensorDict"
    tensor_dict[key] = NonTensorStack.from_list([NonTensorData(item) for item in val])


def assign_non_tensor(tensor_dict: TensorDict, **kwargs: Any) -> TensorDict:
    """Assign each keyword: lists become per-row stacks, other values one batch-wide value."""
    assert isinstance(tensor_dict, TensorDict), "input dict must be a TensorDict"
    for key, val in kwargs.items():
        if isinstance(val, (NonTensorData, NonTensorStack)):
            tensor_dict[key] = val
        elif isinstance(val, list):
            assign_non_tensor_stack(tensor_dict, key, val)
        else:
            assign_non_tensor_data(tensor_dict, key, val)
    return tensor_dict


def unwrap_non_tensor_data(data: Any) -> Any:
    """The value inside a NonTensorData; anything else unchanged."""
    return data.data if isinstance(data, NonTensorData) else data


def get_non_tensor_data(data: TensorDict, key: str, default: Any) -> Any:
    """`data[key]` unwrapped, or `default` when absent."""
    return unwrap_non_tensor_data(data.get(key, default))


def _native(value: Any) -> Any:
    """A tensor as is, a NonTensorStack as a list, a NonTensorData as its value."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, NonTensorStack):
        return value.tolist()
    assert isinstance(value, NonTensorData), f"unexpected TensorDict value of type {type(value).__name__}"
    return value.data


def get(tensordict: TensorDict, key: str, default: Any = None) -> Any:
    """`tensordict[key]` in native form (tensor, list of rows, or plain value); `default` when absent."""
    if key not in tensordict.keys():
        return default
    return _native(tensordict.get(key))


def pop(tensordict: TensorDict, key: str, default: Any = None) -> Any:
    """Remove `key` and return its value in native form; `default` when absent."""
    sentinel = object()
    output = tensordict.pop(key, sentinel)
    return default if output is sentinel else _native(output)


def _split_native(tensordict: TensorDict, keys: Iterable[str], remove: bool) -> TensorDict:
    tensors, non_tensors = {}, {}
    for key in keys:
        if key not in tensordict.keys():
            raise KeyError(f"key {key} not in tensordict; keys: {sorted(tensordict.keys())}")
        value = tensordict.pop(key) if remove else tensordict.get(key)
        if isinstance(value, NonTensorData):
            non_tensors[key] = value.data
        else:
            tensors[key] = _native(value)
    return get_tensordict(tensors, non_tensors)


def get_keys(tensordict: TensorDict, keys: Iterable[str]) -> TensorDict:
    """A new TensorDict with only `keys` (KeyError for a missing one)."""
    return _split_native(tensordict, keys, remove=False)


def pop_keys(tensordict: TensorDict, keys: Iterable[str]) -> TensorDict:
    """Remove `keys` from `tensordict` and return them as a new TensorDict."""
    return _split_native(tensordict, keys, remove=True)


# -------------------------------------------------------------------------------------------- nested tensors
def nested_tensor_from_tensor_list(tensors: list[torch.Tensor], ragged_idx: int | None = None) -> torch.Tensor:
    """A jagged nested tensor of `tensors` (one per row), ragged along row dimension `ragged_idx - 1`
    (default: the last dimension)."""
    assert len(tensors) > 0, "Must provide at least one tensor"
    sample_dim = tensors[0].dim()
    ragged_idx = sample_dim if ragged_idx is None else ragged_idx
    assert 1 <= ragged_idx <= sample_dim, f"ragged_idx must be in [1, {sample_dim}]. Got {ragged_idx=}"
    if sample_dim == 1:
        return torch.nested.as_nested_tensor(tensors, layout=torch.jagged)
    cat_dim = ragged_idx - 1
    values = torch.cat(tensors, dim=cat_dim)
    lengths = torch.tensor([t.shape[cat_dim] for t in tensors], dtype=torch.long, device=values.device)
    offsets = torch.zeros(len(tensors) + 1, dtype=torch.long, device=values.device)
    torch.cumsum(lengths, dim=0, out=offsets[1:])
    nested = torch.nested.nested_tensor_from_jagged(values=values, offsets=offsets)
    nested._ragged_idx = ragged_idx
    return nested


def _ragged_idx(nested: torch.Tensor) -> int:
    return getattr(nested, "_ragged_idx", nested.dim() - 1)


def _rows(nested: torch.Tensor) -> list[torch.Tensor]:
    """The rows of a jagged nested tensor. `unbind` fails on some 3-D jagged tensors
    (pytorch/pytorch#153238); then rebuild the rows from the offsets."""
    try:
        return list(nested.unbind(dim=0))
    except RuntimeError:
        padded = nested.to_padded_tensor(0)
        lengths = nested.offsets().diff().tolist()
        return [padded[i, :length] for i, length in enumerate(lengths)]


def concat_nested_tensors(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate contiguous jagged nested tensors (>= 2 dims) along the batch dimension."""
    rows: list[torch.Tensor] = []
    for tensor in tensors:
        assert tensor.is_nested and tensor.is_contiguous(), "concat_nested_tensors needs contiguous nested tensors"
        assert tensor.dim() >= 2, f"nested tensor must have 2 or more dimensions. Got {tensor.shape}"
        rows.extend(tensor.unbind(0))
    return nested_tensor_from_tensor_list(rows, ragged_idx=_ragged_idx(tensors[0]))


# ---------------------------------------------------------------------------------------- build / combine
def get_tensordict(tensor_dict: dict[str, Any], non_tensor_dict: dict | None = None) -> TensorDict:
    """A TensorDict of per-row values (tensors, jagged nested tensors, lists / numpy arrays of objects) with
    batch size their common length, plus batch-wide values from `non_tensor_dict` (stored as NonTensorData)."""
    tensor_dict = dict(tensor_dict)
    non_tensor_dict = non_tensor_dict or {}
    batch_size = None
    for key, val in list(tensor_dict.items()):
        if isinstance(val, torch.Tensor) and val.is_nested:
            assert val.is_contiguous(), "Nested tensors must be contiguous. Try setting layout=torch.jagged"
            assert val.layout == torch.jagged, "Nested tensors must be jagged."
        if isinstance(val, NonTensorStack):
            length = len(val)
        else:
            assert isinstance(val, (torch.Tensor, list, np.ndarray)), (
                f"{key} -> {type(val)} isn't of 'torch.Tensor | list | np.ndarray' type"
            )
            if isinstance(val, (list, np.ndarray)):
                assert not any(isinstance(v, torch.Tensor) for v in val), (
                    "Passing a list makes the data NonTensorStack, which doesn't support torch.Tensor. "
                    "Please convert to numpy first"
                )
                tensor_dict[key] = NonTensorStack.from_list([NonTensorData(item) for item in val])
            length = val.size(0) if isinstance(val, torch.Tensor) else len(val)
        if batch_size is None:
            batch_size = length
        assert length == batch_size, (
            f"Batch size of {key} is not consistent with other tensors. Expected {batch_size}, got {length}"
        )
    for key, val in non_tensor_dict.items():
        assert key not in tensor_dict, f"key {key} is both a per-row and a batch-wide value"
        tensor_dict[key] = NonTensorData(val)
    return TensorDict(source=tensor_dict, batch_size=[] if batch_size is None else [batch_size])


def concat_tensordict_with_none_bsz(data: list[TensorDict]) -> TensorDict:
    """TensorDicts without a batch dimension (only batch-wide values): the first one."""
    for d in data:
        assert len(d.batch_size) == 0
    return data[0]


def concat_tensordict(data: list[TensorDict]) -> TensorDict:
    """Concatenate TensorDicts along dim 0; jagged nested tensors stay jagged."""
    assert len(data) > 0, "Must have at least one tensordict"
    nested_keys = {k for k, v in data[0].items() if isinstance(v, torch.Tensor) and v.is_nested}
    if not nested_keys:
        if len(data[0].batch_size) == 0:
            return concat_tensordict_with_none_bsz(data)
        return TensorDict.cat(data, dim=0)
    regular = []
    for td in data:
        keys = {k for k, v in td.items() if isinstance(v, torch.Tensor) and v.is_nested}
        assert keys == nested_keys, "All tensordicts must have the same set of nested tensors."
        items = {k: v for k, v in td.items() if k not in nested_keys}
        regular.append(TensorDict(items, batch_size=td.batch_size, device=td.device))
    output = TensorDict.cat(regular, dim=0)
    for key in nested_keys:
        output[key] = concat_nested_tensors([td[key] for td in data])
    return output


def chunk_tensordict(td: TensorDict, chunks: int) -> list[TensorDict]:
    """Split into `chunks` equal TensorDicts (len(td) must be divisible); jagged nested tensors stay jagged."""
    assert isinstance(td, TensorDict) and len(td) % chunks == 0, (
        f"expecting td with length divisible by chunks, but got {len(td)} and {chunks}"
    )
    size = len(td) // chunks
    nested_keys = {k for k, v in td.items() if isinstance(v, torch.Tensor) and v.is_nested}
    regular = TensorDict(
        {k: v for k, v in td.items() if k not in nested_keys}, batch_size=td.batch_size, device=td.device
    )
    parts = list(regular.chunk(chunks=chunks))
    for key in nested_keys:
        rows = _rows(td[key])
        for i, part in enumerate(parts):
            part[key] = nested_tensor_from_tensor_list(rows[i * size : (i + 1) * size], ragged_idx=_ragged_idx(td[key]))
    return parts


def index_select_tensor_dict(batch: TensorDict | None, indices: torch.Tensor | list[int]) -> TensorDict | None:
    """The rows `indices` (1-D) of `batch`: tensors indexed, nested tensors re-built, batch-wide values kept."""
    if isinstance(indices, list):
        indices = torch.tensor(indices)
    assert indices.dim() == 1, "indices must be a 1D tensor"
    if batch is None:
        return None
    data = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.is_nested:
            rows = value.unbind()
            data[key] = nested_tensor_from_tensor_list([rows[i] for i in indices], ragged_idx=_ragged_idx(value))
        elif isinstance(value, torch.Tensor) or value.shape:
            data[key] = value[indices]
        else:
            data[key] = value
    return TensorDict(source=data, batch_size=indices.shape[0])


def union_tensor_dict(tensor_dict1: TensorDict, tensor_dict2: TensorDict) -> TensorDict:
    """Add tensor_dict2's keys to tensor_dict1 in place; shared keys must hold equal values (AssertionError)."""
    assert tensor_dict1.batch_size == tensor_dict2.batch_size, (
        f"Two tensor dict must have identical batch size. Got {tensor_dict1.batch_size} and {tensor_dict2.batch_size}"
    )
    for key in tensor_dict2.keys():
        if key not in tensor_dict1.keys():
            tensor_dict1[key] = tensor_dict2.get(key)
        elif isinstance(tensor_dict2[key], torch.Tensor):
            assert tensor_dict1[key].equal(tensor_dict2[key]), (
                f"{key} in tensor_dict1 and tensor_dict2 are not the same object"
            )
        else:
            assert tensor_dict1[key] == tensor_dict2[key], (
                f"{key} in tensor_dict1 and tensor_dict2 are not the same object"
            )
    return tensor_dict1


def make_iterator(
    tensordict: TensorDict,
    mini_batch_size: int,
    epochs: int,
    seed: int | None = None,
    dataloader_kwargs: dict | None = None,
) -> Iterator[TensorDict]:
    """Mini-batches of `mini_batch_size` rows (which must divide the batch) for `epochs` passes; pass
    `dataloader_kwargs={"shuffle": True}` and a `seed` for a reproducible shuffled order."""
    from torch.utils.data import DataLoader

    assert tensordict.batch_size[0] % mini_batch_size == 0, f"{tensordict.batch_size[0]} % {mini_batch_size} != 0"
    dataloader_kwargs = dataloader_kwargs or {}
    assert isinstance(dataloader_kwargs, dict)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    loader = DataLoader(
        dataset=torch.arange(tensordict.shape[0]),
        batch_size=mini_batch_size,
        collate_fn=lambda x: torch.stack(x),
        generator=generator,
        **dataloader_kwargs,
    )

    def batches() -> Iterator[TensorDict]:
        for _ in range(epochs):
            for idx in loader:
                yield index_select_tensor_dict(tensordict, idx)

    return iter(batches())


def assert_tensordict_eq(tensordict1: TensorDict, tensordict2: TensorDict) -> None:
    """AssertionError unless both have the same keys and equal values (nested tensors row by row)."""
    keys1, keys2 = set(tensordict1.keys()), set(tensordict2.keys())
    assert keys1 == keys2, f"key set diffs. Got {keys2=} vs {keys1=}"
    for key in keys1:
        val, val2 = tensordict1[key], tensordict2[key]
        assert type(val) is type(val2), f"The type of {key} must be the same. Got {type(val)} vs {type(val2)}"
        if isinstance(val, torch.Tensor) and val.is_nested:
            assert val2.is_nested, f"{key}: both tensors must be nested"
            rows1, rows2 = val.unbind(), val2.unbind()
            assert len(rows1) == len(rows2), f"{key}: nested tensors have {len(rows1)} vs {len(rows2)} rows"
            for r1, r2 in zip(rows1, rows2):
                assert torch.equal(r1, r2), f"{key}: nested tensor rows differ: {r1=} vs {r2=}"
        elif isinstance(val, torch.Tensor):
            assert torch.all(torch.eq(val, val2)).item(), f"{key}: tensors differ"
        else:
            assert val == val2, f"{key}: values differ"


# ------------------------------------------------------------------------------------------ padding, layout
def pad_to_divisor(data: TensorDict, size_divisor: int) -> tuple[TensorDict, int]:
    """Pad to a multiple of `size_divisor` rows by appending copies of the first rows (cycling);
    returns `(padded, pad_size)`."""
    assert isinstance(data, TensorDict), "data must be a TensorDict"
    if len(data) % size_divisor == 0:
        if len(data) == 0:
            logging.warning("padding a TensorDict with no item, no changed made")
        return data, 0
    pad_size = size_divisor - len(data) % size_divisor
    parts, remaining = [data], pad_size
    while remaining > 0:
        take = min(remaining, len(data))
        parts.append(data[:take])
        remaining -= take
    return torch.cat(parts), pad_size


def unpad(data: TensorDict, pad_size: int) -> TensorDict:
    """Drop the last `pad_size` rows (undo `pad_to_divisor`)."""
    return data[:-pad_size] if pad_size != 0 else data


def contiguous(data: TensorDict) -> TensorDict:
    """A new TensorDict with contiguous tensors (keeping NonTensorData / NonTensorStack as they are)."""
    tensors, non_tensors = {}, {}
    for key in data.keys():
        val = data.get(key)
        if isinstance(val, NonTensorData):
            non_tensors[key] = val.data
        elif isinstance(val, NonTensorStack):
            tensors[key] = val
        else:
            assert isinstance(val, torch.Tensor), f"Expect val to be a torch.Tensor. Got {type(val)}"
            tensors[key] = val.contiguous()
    return get_tensordict(tensor_dict=tensors, non_tensor_dict=non_tensors)


def maybe_fix_3d_position_ids(data: TensorDict) -> None:
    """Restore `_ragged_idx = 2` of a 3-D jagged `position_ids` (lost through pickling, e.g. mRoPE ids)."""
    if "position_ids" in data.keys() and data["position_ids"].dim() == 3 and data["position_ids"].is_nested:
        data["position_ids"]._ragged_idx = 2


def list_of_dict_to_tensordict(list_of_dicts: list[dict[str, Any]]) -> TensorDict:
    """Rows given as dicts -> one TensorDict: same-shape tensors stacked, ragged tensors jagged, else a stack."""
    assert len(list_of_dicts) > 0
    columns = {key: [d[key] for d in list_of_dicts] for key in list_of_dicts[0]}
    data = {}
    for key, column in columns.items():
        if all(isinstance(item, torch.Tensor) for item in column):
            if all(item.shape == column[0].shape for item in column):
                data[key] = torch.stack(column)
            else:
                data[key] = torch.nested.as_nested_tensor(column, layout=torch.jagged)
        else:
            data[key] = NonTensorStack(*column)
    return TensorDict(data, batch_size=[len(list_of_dicts)])


# ------------------------------------------------------------------------------------------- serialisation
def serialize_single_tensor(obj: torch.Tensor) -> tuple[str, torch.Size, np.ndarray]:
    """`(dtype name, shape, raw bytes as a uint8 numpy array)` of a CPU tensor."""
    data = obj.flatten().contiguous().view(torch.uint8).numpy()
    return str(obj.dtype).removeprefix("torch."), obj.shape, data


def deserialize_single_tensor(arr: tuple[str, Any, Any]) -> torch.Tensor:
    """Inverse of `serialize_single_tensor` (a new tensor owning a copy of the bytes)."""
    dtype, shape, data = arr
    torch_dtype = getattr(torch, dtype)
    assert isinstance(torch_dtype, torch.dtype), f"{dtype!r} is not a torch dtype"
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(torch_dtype).view(shape)


def serialize_tensordict(batch: TensorDict) -> tuple[tuple[int, ...], str | None, dict[str, tuple]]:
    """`(batch_size, device, {key: encoded})`; a nested tensor is encoded as `(layout, [encoded rows])`."""
    encoded: dict[str, tuple] = {}
    for key, value in batch.items():
        if value.is_nested:
            layout = str(value.layout).removeprefix("torch.")
            encoded[key] = (layout, [serialize_single_tensor(t) for t in value.unbind()])
        else:
            encoded[key] = serialize_single_tensor(value)
    return tuple(batch.batch_size), (str(batch.device) if batch.device is not None else None), encoded


def deserialize_tensordict(arr: tuple) -> TensorDict:
    """Inverse of `serialize_tensordict`."""
    batch_size, device, encoded = arr
    decoded: dict[str, torch.Tensor] = {}
    for key, value in encoded.items():
        if len(value) == 3:
            decoded[key] = deserialize_single_tensor(value)
        elif len(value) == 2:
            layout, rows = value
            decoded[key] = torch.nested.as_nested_tensor(
                [deserialize_single_tensor(r) for r in rows], layout=getattr(torch, layout)
            )
        else:
            raise ValueError(f"Invalid tensor encoding format, expected length 2 or 3, got {len(value)}")
    return TensorDict(source=decoded, batch_size=batch_size, device=device)
