"""`DataProto`: the one batch type passed between the driver, the workers and the algorithm code.

A `DataProto` holds N rows in three parts (verl's contract):
- `batch`: a `tensordict.TensorDict` with `batch_size=[N]` (every tensor has N rows), or None;
- `non_tensor_batch`: dict of numpy object arrays of length N (strings, dicts, ... one per row);
- `meta_info`: a plain dict shared by the whole batch (temperatures, metrics, flags).

Every constructor path runs `check_consistency()`, so a `DataProto` always has one length N.
Also owns `pad_dataproto_to_divisor` / `unpad_dataproto` (pad a batch to a multiple of the
world size by repeating rows from the start, then drop the padding again).

Imports only torch, tensordict and numpy (layer 2 in DESIGN.md); `DataProtoFuture` lives in
`verl.single_controller`.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

__all__ = ["DataProto", "DataProtoItem", "pad_dataproto_to_divisor", "unpad_dataproto"]


def _to_object_array(key: str, value: Any) -> np.ndarray:
    """Turn a list/tuple/ndarray into a numpy object array whose first axis is the row axis.

    A list of dicts (or of lists) stays one element per row: we fill an empty object array instead of
    letting `np.array` build a 2-D array out of equal-length inner lists.
    """
    if isinstance(value, np.ndarray):
        return value if value.dtype == object else value.astype(object)
    if isinstance(value, (list, tuple)):
        out = np.empty(len(value), dtype=object)
        for i, item in enumerate(value):
            out[i] = item
        return out
    raise TypeError(
        f"non_tensor_batch[{key!r}] must be a numpy array, list or tuple with one entry per row, got {type(value).__name__}"
    )


def _values_equal(a: Any, b: Any) -> bool:
    """Equality that works for tensors, numpy arrays and plain Python values nested in object arrays."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a_arr, b_arr = np.asarray(a), np.asarray(b)
        if a_arr.shape != b_arr.shape:
            return False
        if a_arr.dtype == object or b_arr.dtype == object:
            return all(_values_equal(x, y) for x, y in zip(a_arr.ravel(), b_arr.ravel()))
        return bool(np.array_equal(a_arr, b_arr))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_values_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_values_equal(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


def _check_keys(kind: str, wanted: list[str], available) -> None:
    missing = [k for k in wanted if k not in available]
    if missing:
        raise KeyError(f"{kind} keys {missing} not found; available {kind} keys: {sorted(available)}")


def _as_index(idxs: Any, length: int) -> torch.Tensor:
    """Normalise a list / numpy array / tensor of ints, or a boolean mask of `length`, to a 1-D int64 tensor."""
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
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.batch is not None and not isinstance(self.batch, TensorDict):
            raise TypeError(f"DataProto.batch must be a tensordict.TensorDict or None, got {type(self.batch).__name__}")
        if self.non_tensor_batch is None:
            self.non_tensor_batch = {}
        if self.meta_info is None:
            self.meta_info = {}
        self.non_tensor_batch = {k: _to_object_array(k, v) for k, v in self.non_tensor_batch.items()}
        self.check_consistency()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict | None = None,
    ) -> DataProto:
        """Build from `{name: tensor (N, ...)}` and `{name: array/list of N objects}`; no tensors -> `batch=None`."""
        tensors = tensors or {}
        batch = None
        if tensors:
            for key, val in tensors.items():
                if not isinstance(val, torch.Tensor):
                    raise TypeError(f"tensors[{key!r}] must be a torch.Tensor, got {type(val).__name__}")
                if val.dim() == 0:
                    raise ValueError(f"tensors[{key!r}] is a 0-d tensor; every tensor needs a row axis of length N")
            sizes = {key: val.shape[0] for key, val in tensors.items()}
            if len(set(sizes.values())) != 1:
                raise ValueError(f"all tensors must have the same number of rows, got sizes {sizes}")
            batch = TensorDict(dict(tensors), batch_size=[next(iter(sizes.values()))])
        return cls(batch=batch, non_tensor_batch=dict(non_tensors or {}), meta_info=dict(meta_info or {}))

    @classmethod
    def from_single_dict(cls, data: dict[str, Any], meta_info: dict | None = None) -> DataProto:
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
        return cls.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info)

    def check_consistency(self) -> None:
        """Raise ValueError unless every tensor and non-tensor array has the same number of rows N."""
        sizes: dict[str, int] = {}
        if self.batch is not None:
            if len(self.batch.batch_size) != 1:
                raise ValueError(f"DataProto.batch must have a 1-D batch_size [N], got {list(self.batch.batch_size)}")
            sizes["batch"] = self.batch.batch_size[0]
        for key, val in self.non_tensor_batch.items():
            if val.ndim == 0:
                raise ValueError(f"non_tensor_batch[{key!r}] is a 0-d array; it needs one entry per row")
            sizes[key] = val.shape[0]
        if len(set(sizes.values())) > 1:
            raise ValueError(f"DataProto parts have different numbers of rows: {sizes}")

    # ------------------------------------------------------------------ size and indexing
    def __len__(self) -> int:
        if self.batch is not None:
            return self.batch.batch_size[0]
        for val in self.non_tensor_batch.values():
            return val.shape[0]
        return 0

    def __getitem__(self, item: Any) -> DataProtoItem | DataProto:
        """int -> `DataProtoItem`; slice, list/numpy/tensor of ints, or boolean mask -> `DataProto`."""
        if isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            n = len(self)
            if not -n <= int(item) < n:
                raise IndexError(f"index {int(item)} out of range for a DataProto of {n} rows")
            return DataProtoItem(
                batch=self.batch[int(item)] if self.batch is not None else None,
                non_tensor_batch={k: v[int(item)] for k, v in self.non_tensor_batch.items()},
                meta_info=self.meta_info,
            )
        if isinstance(item, slice):
            return self._take(item, item)
        if isinstance(item, (list, tuple, np.ndarray, torch.Tensor)):
            idx = _as_index(item, len(self))
            return self._take(idx, idx.numpy())
        raise TypeError(f"DataProto index must be an int, slice, int array or boolean mask, got {type(item).__name__}")

    def _take(self, tensor_index: Any, numpy_index: Any) -> DataProto:
        return DataProto(
            batch=self.batch[tensor_index] if self.batch is not None else None,
            non_tensor_batch={k: v[numpy_index] for k, v in self.non_tensor_batch.items()},
            meta_info=dict(self.meta_info),
        )

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
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    def pop(
        self,
        batch_keys: list[str] | None = None,
        non_tensor_batch_keys: list[str] | None = None,
        meta_info_keys: list[str] | None = None,
    ) -> DataProto:
        """Remove the given keys from self and return them as a new DataProto (None pops nothing of that part)."""
        batch_keys = list(batch_keys or [])
        non_tensor_batch_keys = list(non_tensor_batch_keys or [])
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

    def union(self, other: DataProto) -> DataProto:
        """Add other's keys to self in place and return self; a key present in both must hold equal values."""
        if self.batch is not None and other.batch is not None:
            if self.batch.batch_size != other.batch.batch_size:
                raise ValueError(
                    f"cannot union batches of sizes {list(self.batch.batch_size)} and {list(other.batch.batch_size)}"
                )
            for key, val in other.batch.items():
                if key in self.batch.keys() and not _values_equal(self.batch[key], val):
                    raise ValueError(f"cannot union: batch key {key!r} differs between the two DataProtos")
            for key, val in other.batch.items():
                self.batch[key] = val
        elif other.batch is not None:
            if self.non_tensor_batch and len(self) != len(other):
                raise ValueError(f"cannot union DataProtos of {len(self)} and {len(other)} rows")
            self.batch = other.batch
        for key, val in other.non_tensor_batch.items():
            if key in self.non_tensor_batch:
                if not _values_equal(self.non_tensor_batch[key], val):
                    raise ValueError(f"cannot union: non_tensor_batch key {key!r} differs between the two DataProtos")
            else:
                self.non_tensor_batch[key] = val
        for key, val in other.meta_info.items():
            if key in self.meta_info:
                if not _values_equal(self.meta_info[key], val):
                    raise ValueError(f"cannot union: meta_info key {key!r} differs between the two DataProtos")
            else:
                self.meta_info[key] = val
        self.check_consistency()
        return self

    # ------------------------------------------------------------------ combining and splitting
    @staticmethod
    def concat(data: list[DataProto]) -> DataProto:
        """Concatenate rows. meta_info is the first item's, except `metrics`: the items' `meta_info["metrics"]`
        dicts are merged into one `{name: [values...]}` (list values are extended, scalars appended, in item order).
        """
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
        non_tensor = {
            k: np.concatenate([d.non_tensor_batch[k] for d in data], axis=0) for k in data[0].non_tensor_batch
        }
        meta = dict(data[0].meta_info)
        metric_dicts = [d.meta_info["metrics"] for d in data if isinstance(d.meta_info.get("metrics"), dict)]
        if metric_dicts:
            merged: dict[str, list] = {}
            for metrics in metric_dicts:
                for name, val in metrics.items():
                    merged.setdefault(name, []).extend(val if isinstance(val, list) else [val])
            meta["metrics"] = merged
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into `chunks` equal parts; len(self) must be divisible by `chunks` (as in verl)."""
        if not isinstance(chunks, int) or chunks <= 0:
            raise ValueError(f"chunks must be a positive int, got {chunks!r}")
        n = len(self)
        if n % chunks != 0:
            raise ValueError(
                f"DataProto of length {n} cannot be chunked into {chunks} equal parts; "
                "pad it first with pad_dataproto_to_divisor"
            )
        size = n // chunks
        return [self[i * size : (i + 1) * size] for i in range(chunks)]

    def split(self, split_size: int) -> list[DataProto]:
        """Split into consecutive pieces of `split_size` rows; the last piece may be smaller."""
        if not isinstance(split_size, int) or split_size <= 0:
            raise ValueError(f"split_size must be a positive int, got {split_size!r}")
        return [self[start : start + split_size] for start in range(0, len(self), split_size)]

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Repeat every row. interleave=True: [a, a, b, b]; interleave=False: [a, b, a, b]."""
        if not isinstance(repeat_times, int) or repeat_times <= 0:
            raise ValueError(f"repeat_times must be a positive int, got {repeat_times!r}")
        rows = np.arange(len(self))
        index = np.repeat(rows, repeat_times) if interleave else np.tile(rows, repeat_times)
        return self[index]

    def reorder(self, indices: torch.Tensor | np.ndarray | list[int]) -> None:
        """Permute the rows in place: row i becomes old row `indices[i]`; `indices` must be a permutation of 0..N-1."""
        idx = _as_index(indices, len(self))
        if idx.numel() != len(self) or not torch.equal(torch.sort(idx).values, torch.arange(len(self))):
            raise ValueError(f"reorder needs a permutation of 0..{len(self) - 1}, got {idx.tolist()}")
        if self.batch is not None:
            self.batch = self.batch[idx]
        self.non_tensor_batch = {k: v[idx.numpy()] for k, v in self.non_tensor_batch.items()}

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
        groups = {value: self[np.array(rows, dtype=np.int64)] for value, rows in rows_of.items()}
        return groups, restore

    # ------------------------------------------------------------------ device and I/O
    def to(self, device: str | torch.device) -> DataProto:
        """Move the tensor batch to `device` (in place) and return self."""
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    def save_to_disk(self, path: str) -> None:
        """Write with torch.save (to a temporary name, then os.replace); read back with `load_from_disk`."""
        state = {
            "batch": self.batch.to_dict() if self.batch is not None else None,
            "batch_size": list(self.batch.batch_size) if self.batch is not None else None,
            "non_tensor_batch": self.non_tensor_batch,
            "meta_info": self.meta_info,
        }
        tmp_path = f"{path}.tmp.{os.getpid()}"
        torch.save(state, tmp_path)
        os.replace(tmp_path, path)

    @staticmethod
    def load_from_disk(path: str) -> DataProto:
        """Read a DataProto written by `save_to_disk` (a trusted file: numpy object arrays need full unpickling)."""
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no saved DataProto at {path}")
        state = torch.load(path, weights_only=False)
        batch = None
        if state["batch"] is not None:
            batch = TensorDict(state["batch"], batch_size=state["batch_size"])
        return DataProto(batch=batch, non_tensor_batch=state["non_tensor_batch"], meta_info=state["meta_info"])


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Pad `data` to a multiple of `size_divisor` rows by appending copies of its first rows (cycling if needed).

    Returns `(padded, pad_size)`; `unpad_dataproto(padded, pad_size)` drops the padding again.
    """
    if not isinstance(size_divisor, int) or size_divisor <= 0:
        raise ValueError(f"size_divisor must be a positive int, got {size_divisor!r}")
    n = len(data)
    pad_size = (size_divisor - n % size_divisor) % size_divisor
    if pad_size == 0:
        return data, 0
    if n == 0:
        raise ValueError("cannot pad an empty DataProto: there are no rows to repeat")
    padded = DataProto.concat([data, data[np.arange(pad_size) % n]])
    padded.meta_info = dict(data.meta_info)  # not concat's merge: the padding rows must not double the metrics
    return padded, pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the last `pad_size` rows added by `pad_dataproto_to_divisor`."""
    if pad_size < 0 or pad_size > len(data):
        raise ValueError(f"pad_size must be in [0, {len(data)}] for a DataProto of {len(data)} rows, got {pad_size}")
    return data[: len(data) - pad_size] if pad_size else data
