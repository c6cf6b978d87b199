"""`DataProto`: the one batch type passed between the driver, the workers and the algorithm code (verl's API).

N rows in three parts: `batch` (a TensorDict with `batch_size=[N]`, or None), `non_tensor_batch` (numpy arrays of
length N) and `meta_info` (a dict shared by the batch). Also owns `DataProtoItem`, `DataProtoFuture`, `collate_fn`
and pickling; re-exports under verl's import paths the padding, folding and gathering helpers and `DataProtoError`
(`verl.protocol_utils`: an AssertionError and a ValueError, raised where verl asserts) and the (de)serialisation
helpers. Layer 2: Ray is imported only inside `DataProtoFuture.get`.
"""

from __future__ import annotations

import copy
import io
import os
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from verl.protocol_utils import (
    PADDING_ROWS_KEY,
    DataProtoConfig,
    DataProtoError,
    _as_index,
    _check_keys,
    _padding_size_key,  # noqa: F401  (verl's dispatch code imports it from verl.protocol)
    _require,
    _to_object_array,
    _type_info,
    all_gather_data_proto,
    fold_batch_dim,
    pad_dataproto_to_divisor,
    real_row_mask,
    unfold_batch_dim,
    unpad_dataproto,
)
from verl.utils import tensordict_utils as tu
from verl.utils.py_functional import list_of_dict_to_dict_of_list, union_numpy_dict, union_two_dict
from verl.utils.tensordict_utils import (
    deserialize_single_tensor,
    deserialize_tensordict,
    serialize_single_tensor,
    serialize_tensordict,
    union_tensor_dict,
)

__all__ = [
    "DataProto",
    "DataProtoConfig",
    "DataProtoError",
    "DataProtoFuture",
    "DataProtoItem",
    "PADDING_ROWS_KEY",
    "all_gather_data_proto",
    "collate_fn",
    "deserialize_single_tensor",
    "deserialize_tensordict",
    "fold_batch_dim",
    "pad_dataproto_to_divisor",
    "real_row_mask",
    "serialize_single_tensor",
    "serialize_tensordict",
    "unfold_batch_dim",
    "union_numpy_dict",
    "union_tensor_dict",
    "unpad_dataproto",
]


def collate_fn(x: list[DataProtoItem]) -> DataProto:
    """Stack DataProtoItems back into a DataProto (the collate function of `DataProto.make_iterator`)."""
    batch = torch.stack([item.batch for item in x]).contiguous()
    non_tensor = list_of_dict_to_dict_of_list([item.non_tensor_batch for item in x])
    return DataProto(batch=batch, non_tensor_batch={k: np.array(v, dtype=object) for k, v in non_tensor.items()})


# ------------------------------------------------------------------------------------------- the classes
@dataclass
class DataProtoItem:
    """One row of a `DataProto`: `batch` is a TensorDict with batch_size [] (or None), values unbatched."""

    batch: TensorDict | None = None
    non_tensor_batch: dict = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)


@dataclass
class DataProto:
    """A batch of N rows: tensors in `batch`, per-row Python objects in `non_tensor_batch`, shared `meta_info`."""

    batch: TensorDict | None = None
    non_tensor_batch: dict = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.batch is not None and not isinstance(self.batch, TensorDict):
            raise TypeError(f"DataProto.batch must be a tensordict.TensorDict or None, got {type(self.batch).__name__}")
        self.non_tensor_batch = {k: _to_object_array(v) for k, v in (self.non_tensor_batch or {}).items()}
        if self.meta_info is None:
            self.meta_info = {}
        self.check_consistency()

    def check_consistency(self) -> None:
        """DataProtoError unless the batch has one batch dim and every array has the same number of rows N."""
        sizes: dict[str, int] = {}
        if self.batch is not None:
            _require(
                len(self.batch.batch_size) == 1, f"only support num_batch_dims=1, got {list(self.batch.batch_size)}"
            )
            sizes["batch"] = self.batch.batch_size[0]
        for key, val in self.non_tensor_batch.items():
            if not isinstance(val, np.ndarray):
                raise TypeError(f"non_tensor_batch[{key!r}] must be a numpy array, got {type(val).__name__}")
            _require(val.ndim > 0, f"non_tensor_batch[{key!r}] is a 0-d array; it needs one entry per row")
            sizes[key] = val.shape[0]
        _require(len(set(sizes.values())) <= 1, f"DataProto parts have different numbers of rows: {sizes}")

    def __len__(self) -> int:
        if self.batch is not None:
            return self.batch.batch_size[0]
        for val in self.non_tensor_batch.values():
            return val.shape[0]
        return 0

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_single_dict(
        cls, data: dict[str, Any], meta_info: dict | None = None, auto_padding: bool = False
    ) -> DataProto:
        """Split one dict by value type: tensors go to `batch`, numpy arrays / lists to `non_tensor_batch`."""
        tensors, non_tensors = {}, {}
        for key, val in data.items():
            if isinstance(val, torch.Tensor):
                tensors[key] = val
            elif isinstance(val, (np.ndarray, list, tuple)):
                non_tensors[key] = val
            else:
                raise TypeError(
                    f"value of {key!r} has type {type(val).__name__}; allowed: torch.Tensor, numpy array, list, tuple"
                )
        return cls.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info, auto_padding=auto_padding)

    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict | None = None,
        num_batch_dims: int = 1,
        auto_padding: bool = False,
    ) -> DataProto:
        """Build from `{name: tensor (N, ...)}` and `{name: array/list of N objects}`; no tensors -> `batch=None`.

        A list is turned into `np.array(list, dtype=object)` as verl does (equal-length inner lists give a 2-D
        array; pass a 1-D object array to keep one object per row). `auto_padding` marks the batch so that
        `chunk` may cut unequal parts.
        """
        _require(num_batch_dims > 0, "num_batch_dims must be greater than zero")
        if non_tensors is not None:
            _require(num_batch_dims == 1, "only support num_batch_dims=1 when non_tensors is not None.")
        tensors, non_tensors = tensors or {}, dict(non_tensors or {})
        meta_info = meta_info if meta_info is not None else {}
        batch_size, pivot = None, None
        for key, val in tensors.items():
            if not isinstance(val, torch.Tensor):
                raise TypeError(f"tensors[{key!r}] must be a torch.Tensor, got {type(val).__name__}")
            if val.dim() < num_batch_dims:
                raise DataProtoError(f"tensors[{key!r}] has {val.dim()} dims; it needs {num_batch_dims} batch dims")
            if batch_size is None:
                batch_size, pivot = val.shape[:num_batch_dims], key
            _require(
                val.shape[:num_batch_dims] == batch_size,
                f"all tensors must have the same number of rows, got {pivot!r}: {list(batch_size)}, "
                f"{key!r}: {list(val.shape[:num_batch_dims])}",
            )
        for key, val in non_tensors.items():
            if not isinstance(val, np.ndarray):
                non_tensors[key] = np.array(val, dtype=object)
        batch = TensorDict(source=dict(tensors), batch_size=batch_size) if tensors else None
        if auto_padding:
            meta_info[DataProtoConfig.auto_padding_key] = True
        return cls(batch=batch, non_tensor_batch=non_tensors, meta_info=meta_info)

    @classmethod
    def from_tensordict(
        cls, tensor_dict: TensorDict, meta_info: dict | None = None, num_batch_dims: int = 1
    ) -> DataProto:
        """Inverse of `to_tensordict`: tensors -> batch, NonTensorStack -> non_tensor_batch, NonTensorData -> meta_info."""
        from tensordict import NonTensorData, NonTensorStack

        _require(num_batch_dims > 0, "num_batch_dims must be greater than zero")
        meta_info = dict(meta_info or {})
        batch, non_tensor, batch_size = {}, {}, None
        for key, val in tensor_dict.items():
            if isinstance(val, torch.Tensor):
                batch[key] = val
                batch_size = batch_size if batch_size is not None else val.shape[:num_batch_dims]
            elif isinstance(val, NonTensorStack):
                arr = np.empty(len(val), dtype=object)
                for i, elem in enumerate(val):
                    arr[i] = elem.data
                non_tensor[key] = arr
            elif isinstance(val, NonTensorData):
                meta_info[key] = val.data
        return cls(batch=TensorDict(batch, batch_size=batch_size), non_tensor_batch=non_tensor, meta_info=meta_info)

    def to_tensordict(self) -> TensorDict:
        """One TensorDict: tensors, per-row objects as NonTensorStack, meta_info as NonTensorData."""
        from tensordict.tensorclass import NonTensorData, NonTensorStack

        tensors = self.batch.to_dict() if self.batch is not None else {}
        common = set(tensors) & set(self.non_tensor_batch)
        _require(not common, f"tensor_batch and non_tensor_batch have common keys {common}")
        for key, val in self.non_tensor_batch.items():
            tensors[key] = NonTensorStack.from_list([NonTensorData(item) for item in val])
        return tu.get_tensordict(tensor_dict=tensors, non_tensor_dict=self.meta_info)

    # ------------------------------------------------------------------ indexing
    def __getitem__(self, item: Any) -> DataProtoItem | DataProto:
        """int -> `DataProtoItem`; slice, list/numpy/tensor of ints, or boolean mask -> `DataProto`."""
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if isinstance(item, (list, tuple, np.ndarray, torch.Tensor)):
            return self.select_idxs(item)
        if isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            n = len(self)
            if not -n <= int(item) < n:
                raise IndexError(f"index {int(item)} out of range for a DataProto of {n} rows")
            return DataProtoItem(
                batch=self.batch[int(item)] if self.batch is not None else None,
                non_tensor_batch={k: v[int(item)] for k, v in self.non_tensor_batch.items()},
                meta_info=self.meta_info,
            )
        raise TypeError(f"DataProto index must be an int, slice, int array or boolean mask, got {type(item).__name__}")

    def select_idxs(self, idxs: Any) -> DataProto:
        """The rows `idxs` (ints or a boolean mask; list, numpy array or tensor) as a new DataProto."""
        idx = _as_index(idxs, len(self))
        batch = None
        if self.batch is not None:
            batch = TensorDict(
                {key: tensor[idx.to(tensor.device)] for key, tensor in self.batch.items()},
                batch_size=(idx.numel(),),
                device=self.batch.device,
            )
        non_tensor = {key: val[idx.numpy()] for key, val in self.non_tensor_batch.items()}
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(self.meta_info))

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> DataProto:
        """Rows `start:end:step` as a new DataProto (what `data[start:end]` returns)."""
        item = slice(start, end, step)
        batch = self.batch[item] if self.batch is not None else None
        non_tensor = {key: val[item] for key, val in self.non_tensor_batch.items()}
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(self.meta_info))

    # ------------------------------------------------------------------ key selection
    def select(
        self,
        batch_keys: list[str] | None = None,
        non_tensor_batch_keys: list[str] | None = None,
        meta_info_keys: list[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """A new DataProto with only the given keys (None keeps all of that part); tensors are shared unless deepcopy."""
        batch = self.batch
        if batch_keys is not None:
            _check_keys("batch", list(batch_keys), list(self.batch.keys()) if self.batch is not None else [])
            batch = self.batch.select(*batch_keys)
        non_tensor = dict(self.non_tensor_batch)
        if non_tensor_batch_keys is not None:
            _check_keys("non_tensor_batch", list(non_tensor_batch_keys), self.non_tensor_batch.keys())
            non_tensor = {k: self.non_tensor_batch[k] for k in non_tensor_batch_keys}
        meta = dict(self.meta_info)
        if meta_info_keys is not None:
            _check_keys("meta_info", list(meta_info_keys), self.meta_info.keys())
            meta = {k: self.meta_info[k] for k in meta_info_keys}
        if deepcopy:
            batch, non_tensor, meta = copy.deepcopy(batch), copy.deepcopy(non_tensor), copy.deepcopy(meta)
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    def pop(
        self,
        batch_keys: list[str] | None = None,
        non_tensor_batch_keys: list[str] | None = None,
        meta_info_keys: list[str] | None = None,
    ) -> DataProto:
        """Remove the given keys from self and return them as a new DataProto (None pops nothing of that part)."""
        batch_keys, non_tensor_batch_keys = list(batch_keys or []), list(non_tensor_batch_keys or [])
        meta_info_keys = list(meta_info_keys or [])
        _check_keys("batch", batch_keys, list(self.batch.keys()) if self.batch is not None else [])
        _check_keys("non_tensor_batch", non_tensor_batch_keys, self.non_tensor_batch.keys())
        _check_keys("meta_info", meta_info_keys, self.meta_info.keys())
        batch = None
        if batch_keys:
            batch = TensorDict({k: self.batch.pop(k) for k in batch_keys}, batch_size=self.batch.batch_size)
        non_tensor = {k: self.non_tensor_batch.pop(k) for k in non_tensor_batch_keys}
        meta = {k: self.meta_info.pop(k) for k in meta_info_keys}
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    def rename(self, old_keys: str | list[str] | None = None, new_keys: str | list[str] | None = None) -> DataProto:
        """Rename tensor keys of `batch` in place and return self."""
        old_keys = [old_keys] if isinstance(old_keys, str) else list(old_keys or [])
        new_keys = [new_keys] if isinstance(new_keys, str) else list(new_keys or [])
        if len(new_keys) != len(old_keys):
            raise ValueError(
                f"new_keys and old_keys must have the same length, got {len(new_keys)} and {len(old_keys)}"
            )
        self.batch.rename_key_(tuple(old_keys), tuple(new_keys))
        return self

    def union(self, other: DataProto) -> DataProto:
        """Add other's keys to self in place and return self. A key in both must hold equal values and the two
        batches must have the same size (AssertionError otherwise, as in verl)."""
        if self.batch is not None and other.batch is not None:
            self.batch = union_tensor_dict(self.batch, other.batch)
        elif other.batch is not None:
            assert not self.non_tensor_batch or len(self) == len(other), (
                f"cannot union DataProtos of {len(self)} and {len(other)} rows"
            )
            self.batch = other.batch
        self.non_tensor_batch = union_numpy_dict(self.non_tensor_batch, other.non_tensor_batch)
        self.meta_info = union_two_dict(self.meta_info, other.meta_info)
        self.check_consistency()
        return self

    # ------------------------------------------------------------------ iterating
    def make_iterator(
        self, mini_batch_size: int, epochs: int, seed: int | None = None, dataloader_kwargs: dict | None = None
    ) -> Iterator[DataProto]:
        """Mini-batches of `mini_batch_size` rows (which must divide len(self)) for `epochs` passes; shuffle with
        `dataloader_kwargs={"shuffle": True}` (reproducible with `seed`). Each carries self's meta_info."""
        from torch.utils.data import DataLoader

        _require(len(self) % mini_batch_size == 0, f"{len(self)} % {mini_batch_size} != 0")
        dataloader_kwargs = dataloader_kwargs or {}
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        loader = DataLoader(
            dataset=self, batch_size=mini_batch_size, collate_fn=collate_fn, generator=generator, **dataloader_kwargs
        )

        def batches() -> Iterator[DataProto]:
            for _ in range(epochs):
                for mini_batch in loader:
                    mini_batch.meta_info = self.meta_info
                    yield mini_batch

        return iter(batches())

    # ------------------------------------------------------------------ padding
    def is_padding_enabled(self) -> bool:
        """Whether `chunk` may cut unequal parts (meta_info flag from `auto_padding=True`, or DataProtoConfig)."""
        return bool(self.meta_info.get(DataProtoConfig.auto_padding_key, False)) or DataProtoConfig.auto_padding

    def padding(self, padding_size: int, padding_candidate: str = "") -> None:
        """Append `padding_size` copies of the first ("first") or else the last row, in place."""
        if padding_size == 0:
            return
        row = self.select_idxs([0 if padding_candidate == "first" else len(self) - 1])
        padded = DataProto.concat([self, row.repeat(padding_size)])
        self.batch, self.non_tensor_batch = padded.batch, padded.non_tensor_batch

    # ------------------------------------------------------------------ combining and splitting
    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into `chunks` parts along the rows, each with (a copy of) self's meta_info. len(self) must be
        divisible by `chunks` unless padding is enabled (then the last parts may be shorter)."""
        if not isinstance(chunks, int) or chunks <= 0:
            raise ValueError(f"chunks must be a positive int, got {chunks!r}")
        if not self.is_padding_enabled():
            _require(
                len(self) % chunks == 0,
                f"only support equal chunk. Got size of DataProto {len(self)} and chunk {chunks}; "
                "pad it first with pad_dataproto_to_divisor",
            )
        bounds = np.cumsum([0] + [len(part) for part in np.array_split(np.arange(len(self)), chunks)])
        if self.batch is not None:
            sizes = [len(part) for part in self.batch.chunk(chunks=chunks, dim=0)]
            sizes += [0] * (chunks - len(sizes))
            bounds = np.cumsum([0] + sizes)
        return [self.slice(int(bounds[i]), int(bounds[i + 1])) for i in range(chunks)]

    def split(self, split_size: int) -> list[DataProto]:
        """Split into consecutive pieces of `split_size` rows; the last piece may be smaller."""
        if not isinstance(split_size, int) or split_size <= 0:
            raise ValueError(f"split_size must be a positive int, got {split_size!r}")
        return [self[i : i + split_size] for i in range(0, len(self), split_size)]

    @staticmethod
    def concat(data: list[DataProto]) -> DataProto:
        """Concatenate rows. meta_info is merged: keys of every item, a key in several items must hold equal
        values (AssertionError otherwise); `metrics` (a dict, or a list of dicts, per item) become one
        `{name: [value per dict]}` in item order. The result has the type of the first item."""
        if not data:
            raise ValueError("DataProto.concat needs at least one DataProto, got an empty list")
        has_batch = [d.batch is not None for d in data]
        if any(has_batch) and not all(has_batch):
            raise ValueError(f"cannot concat DataProtos with and without a tensor batch (has batch: {has_batch})")
        batch = torch.cat([d.batch for d in data], dim=0) if all(has_batch) else None
        keys = set(data[0].non_tensor_batch)
        for i, d in enumerate(data):
            if set(d.non_tensor_batch) != keys:
                raise ValueError(
                    f"cannot concat: item {i} has non_tensor_batch keys {sorted(d.non_tensor_batch)}, "
                    f"item 0 has {sorted(keys)}"
                )
        non_tensor = {k: np.concatenate([d.non_tensor_batch[k] for d in data], axis=0) for k in keys}
        merged: dict = {}
        all_metrics: list = []
        for d in data:
            for key, val in d.meta_info.items():
                if key == "metrics":
                    if val is not None:
                        all_metrics.extend(val if isinstance(val, list) else [val])
                elif key in merged:
                    assert merged[key] == val, f"Conflicting values for meta_info key '{key}'"
                else:
                    merged[key] = val
        if all_metrics:
            merged["metrics"] = list_of_dict_to_dict_of_list(all_metrics)
        return type(data[0])(batch=batch, non_tensor_batch=non_tensor, meta_info=merged)

    def reorder(self, indices: torch.Tensor | np.ndarray | list[int]) -> None:
        """Permute the rows in place: row i becomes old row `indices[i]`; `indices` must be a permutation of 0..N-1."""
        idx = _as_index(indices, len(self))
        if idx.numel() != len(self) or not torch.equal(torch.sort(idx).values, torch.arange(len(self))):
            raise ValueError(f"reorder needs a permutation of 0..{len(self) - 1}, got {idx.tolist()}")
        if self.batch is not None:
            self.batch = self.batch[idx]
        self.non_tensor_batch = {k: v[idx.numpy()] for k, v in self.non_tensor_batch.items()}

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Repeat every row. interleave=True: [a, a, b, b]; interleave=False: [a, b, a, b]."""
        if not isinstance(repeat_times, int) or repeat_times <= 0:
            raise ValueError(f"repeat_times must be a positive int, got {repeat_times!r}")
        rows = np.arange(len(self))
        return self.select_idxs(np.repeat(rows, repeat_times) if interleave else np.tile(rows, repeat_times))

    def sample_level_repeat(self, repeat_times: list[int] | tuple | np.ndarray | torch.Tensor) -> DataProto:
        """Repeat row i `repeat_times[i]` times, keeping rows together: [a, a, a, b, c, c]."""
        counts = np.asarray(repeat_times.tolist() if isinstance(repeat_times, torch.Tensor) else list(repeat_times))
        _require(counts.ndim == 1 and len(counts) == len(self), f"repeat_times needs {len(self)} counts, got {counts}")
        return self.select_idxs(np.repeat(np.arange(len(self)), counts.astype(np.int64)))

    def unfold_column_chunks(self, n_split: int, split_keys: list[str] | None = None) -> DataProto:
        """Split the second dim of each key in `split_keys` into `n_split` pieces that become rows (row i gives
        rows i*n_split ...); every other key is repeated `n_split` times (interleaved) to match."""
        split_keys = split_keys or []

        def unfold(val: Any) -> Any:
            shape = list(val.shape)
            shape[0], shape[1] = shape[0] * n_split, shape[1] // n_split
            return val.reshape(*shape)

        batch = None
        if self.batch is not None:
            columns = {
                key: unfold(val) if key in split_keys else torch.repeat_interleave(val, n_split, dim=0)
                for key, val in self.batch.items()
            }
            batch = TensorDict(columns, batch_size=(len(self) * n_split,), device=self.batch.device)
        non_tensor = {
            key: unfold(val) if key in split_keys else np.repeat(val, n_split, axis=0)
            for key, val in self.non_tensor_batch.items()
        }
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(self.meta_info))

    def group_by(self, key: str) -> tuple[dict[Any, DataProto], np.ndarray]:
        """Split rows by the value of `key` (a non-tensor key, or a 1-D tensor key) for per-group processing.

        Returns `(groups, restore_indices)`. `groups` maps each value to the DataProto of its rows, keys in order
        of first appearance, rows in their original order. Concatenating the groups in that key order and indexing
        with `restore_indices` gives back the original order:

            groups, restore = data.group_by("data_source")
            out = {k: process(g) for k, g in groups.items()}   # same keys, same row counts
            merged = DataProto.concat(list(out.values()))[restore]
        """
        if key in self.non_tensor_batch:
            values = list(self.non_tensor_batch[key])
        elif self.batch is not None and key in self.batch.keys():
            column = self.batch[key]
            if column.dim() != 1:
                raise ValueError(f"group_by on tensor key {key!r} needs a 1-D tensor, got shape {tuple(column.shape)}")
            values = column.tolist()
        else:
            available = sorted(self.non_tensor_batch) + (sorted(self.batch.keys()) if self.batch is not None else [])
            raise KeyError(f"group_by key {key!r} not found; available keys: {available}")
        rows_of: dict[Any, list[int]] = {}
        for row, value in enumerate(values):
            try:
                rows_of.setdefault(value, []).append(row)
            except TypeError as err:
                raise TypeError(f"group_by key {key!r} has an unhashable value at row {row}: {value!r}") from err
        order = np.array([row for rows in rows_of.values() for row in rows], dtype=np.int64)
        restore = np.empty_like(order)
        restore[order] = np.arange(len(order))
        groups = {value: self.select_idxs(np.array(rows, dtype=np.int64)) for value, rows in rows_of.items()}
        return groups, restore

    # ------------------------------------------------------------------ device and inspection
    def to(self, device: str | torch.device) -> DataProto:
        """Move the tensor batch to `device` (in place) and return self."""
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    def print_size(self, prefix: str = "") -> None:
        """Print the size in GB of the tensors and of the numpy arrays."""
        tensor_gb = (
            sum(t.element_size() * t.numel() for t in self.batch.values()) / 1024**3 if self.batch is not None else 0
        )
        numpy_gb = sum(a.nbytes for a in self.non_tensor_batch.values()) / 1024**3
        message = f"Size of tensordict: {tensor_gb} GB, size of non_tensor_batch: {numpy_gb} GB"
        print(f"{prefix}, {message}" if prefix else message)

    def get_data_info(self) -> str:
        """Keys with shapes, dtypes and devices of batch and non_tensor_batch, and the types of meta_info."""
        lines = ["batch"]
        for key, tensor in self.batch.items() if self.batch is not None else []:
            lines.append(f"  {key}: {tuple(tensor.shape)} ({tensor.dtype}) {tensor.device}")
        lines.append("non_tensor_batch")
        lines += [f"  {key}: ndarray{arr.shape} ({arr.dtype})" for key, arr in self.non_tensor_batch.items()]
        lines.append("meta_info")
        lines += [f"  {key}: {_type_info(val)}" for key, val in self.meta_info.items()]
        return "\n".join(lines)

    # ------------------------------------------------------------------ pickling and files
    def __getstate__(self) -> tuple:
        """Tensors as torch.save bytes (consolidated), or as raw numpy bytes with
        VERL_DATAPROTO_SERIALIZATION_METHOD=numpy; per-row objects and meta_info pickled as they are."""
        if os.getenv("VERL_DATAPROTO_SERIALIZATION_METHOD") == "numpy":
            batch = serialize_tensordict(self.batch) if self.batch is not None else None
            return batch, self.non_tensor_batch, self.meta_info
        batch = self.batch
        if batch is not None and len(batch.keys()) > 0:
            batch = batch.contiguous().consolidate()
        buffer = io.BytesIO()
        torch.save(batch, buffer)
        return buffer.getvalue(), self.non_tensor_batch, self.meta_info

    def __setstate__(self, data: tuple) -> None:
        batch, non_tensor_batch, meta_info = data
        if os.getenv("VERL_DATAPROTO_SERIALIZATION_METHOD") == "numpy":
            self.batch = deserialize_tensordict(batch) if batch is not None else None
        else:
            map_location = None if torch.cuda.is_available() else "cpu"
            self.batch = torch.load(io.BytesIO(batch), weights_only=False, map_location=map_location)
        self.non_tensor_batch = non_tensor_batch
        self.meta_info = meta_info

    def save_to_disk(self, filepath: str) -> None:
        """Pickle to `filepath` (via a temporary name, then os.replace); read back with `load_from_disk`."""
        tmp_path = f"{filepath}.tmp.{os.getpid()}"
        with open(tmp_path, "wb") as f:
            pickle.dump(self, f)
        os.replace(tmp_path, filepath)

    @staticmethod
    def load_from_disk(filepath: str) -> DataProto:
        """Read a DataProto written by `save_to_disk` (a trusted file: this unpickles)."""
        if not os.path.isfile(filepath):
            raise FileNotFoundError(f"no saved DataProto at {filepath}")
        with open(filepath, "rb") as f:
            return pickle.load(f)


# ---------------------------------------------------------------------------------------------- futures
@dataclass
class DataProtoFuture:
    """A DataProto still being computed by a worker group: `futures` (Ray object refs, one per rank) are
    reduced by `collect_fn` (default `DataProto.concat`) and, when set, cut by `dispatch_fn` (e.g. this rank's
    chunk). Passed as an argument to another group's method, each worker fetches it itself, so the data does
    not pass through the driver. No other operation is possible on it in the driver.
    """

    collect_fn: Callable
    futures: list
    dispatch_fn: Callable | None = None

    @staticmethod
    def concat(data: list) -> DataProtoFuture:
        return DataProtoFuture(collect_fn=DataProto.concat, futures=data)

    def chunk(self, chunks: int) -> list[DataProtoFuture]:
        def take(x: DataProto, i: int, chunks: int) -> DataProto:
            return x.chunk(chunks=chunks)[i]

        return [
            DataProtoFuture(collect_fn=self.collect_fn, dispatch_fn=_Partial(take, i, chunks), futures=self.futures)
            for i in range(chunks)
        ]

    def get(self) -> Any:
        import ray

        outputs = ray.get(self.futures)
        for out in outputs:
            _require(isinstance(out, (DataProto, TensorDict)), f"expected DataProto or TensorDict, got {type(out)}")
        output = DataProto.concat(outputs) if isinstance(outputs[0], DataProto) else tu.concat_tensordict(outputs)
        return self.dispatch_fn(output) if self.dispatch_fn is not None else output


class _Partial:
    """`fn(x, i, chunks)` with `i` and `chunks` bound (picklable, unlike a closure)."""

    def __init__(self, fn: Callable, i: int, chunks: int) -> None:
        self.fn, self.i, self.chunks = fn, i, chunks

    def __call__(self, x: Any) -> Any:
        return self.fn(x, self.i, self.chunks)
