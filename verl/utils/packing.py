"""Padded batches of variable-length sequences <-> packed 1-D sequences (AReaL-lite's data layout):
`concat_padded_tensors` (right-pads rows to the longest), `pack_tensor_dict` (per-token tensors -> (nnz, ...) with
`cu_seqlens` and `max_seqlen`) and `unpack_to_padded`. A tensor is per-token when its first two dims equal
`attention_mask`'s. Layer 1: torch and tensordict only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDict

__all__ = ["concat_padded_tensors", "pack_tensor_dict", "unpack_to_padded"]


def _per_token(tensor: Any, shape: torch.Size) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.dim() >= 2 and tensor.shape[:2] == shape


def concat_padded_tensors(rows: list[TensorDict], pad_values: Mapping[str, float] | None = None) -> TensorDict:
    """Stack TensorDicts of (n_i, L_i, ...) per-token tensors into (sum n_i, max L_i, ...), padding on the right.

    Every TensorDict must have the same keys and an `attention_mask` (n_i, L_i). Per-token tensors (first two
    dimensions equal to the attention mask's) are right-padded with `pad_values[key]` (default 0); other tensors
    (n_i, ...) are concatenated as they are. Returns a TensorDict of batch size [sum n_i].
    """
    if not rows:
        raise ValueError("concat_padded_tensors needs at least one TensorDict")
    keys = set(rows[0].keys())
    for i, row in enumerate(rows):
        if set(row.keys()) != keys:
            raise KeyError(f"row {i} has keys {sorted(row.keys())}, row 0 has {sorted(keys)}: all must have the same")
        if "attention_mask" not in row.keys():
            raise KeyError(f"row {i} has no attention_mask: it is what tells a token from padding")
    pad_values = dict(pad_values or {})
    width = max(int(row["attention_mask"].shape[1]) for row in rows)
    out: dict[str, torch.Tensor] = {}
    for key in sorted(keys):
        parts = []
        for row in rows:
            value = row[key]
            if _per_token(value, row["attention_mask"].shape) and value.shape[1] < width:
                pad_shape = (value.shape[0], width - value.shape[1], *value.shape[2:])
                fill = torch.full(pad_shape, pad_values.get(key, 0), dtype=value.dtype, device=value.device)
                value = torch.cat([value, fill], dim=1)
            parts.append(value)
        out[key] = torch.cat(parts, dim=0)
    return TensorDict(out, batch_size=[sum(int(row["attention_mask"].shape[0]) for row in rows)])


def pack_tensor_dict(data: Mapping[str, Any]) -> dict[str, Any]:
    """The real tokens of a padded batch, packed: see the module docstring.

    `data` needs `attention_mask` (bs, L); `position_ids` are made (0, 1, ... within each row) when absent.
    Returns a plain dict (its tensors have different first dimensions): per-token tensors (nnz, ...),
    per-row tensors unchanged, `cu_seqlens` (bs + 1,) int32 and `max_seqlen` (int).
    """
    mask = data["attention_mask"].bool()
    shape = mask.shape
    packed: dict[str, Any] = {}
    for key in data.keys():
        value = data[key]
        packed[key] = value[mask] if _per_token(value, shape) else value
    if "position_ids" not in packed:
        packed["position_ids"] = (torch.cumsum(mask.long(), dim=1) - 1)[mask]
    lengths = mask.sum(dim=1)
    packed["cu_seqlens"] = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]).to(torch.int32)
    packed["max_seqlen"] = int(lengths.max()) if lengths.numel() else 0
    return packed


def unpack_to_padded(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token `values` (nnz, ...) of the packed rows of `mask` (bs, L) -> (bs, L, ...), 0 at padding."""
    mask = mask.bool()
    out = values.new_zeros((*mask.shape, *values.shape[1:]))
    out[mask] = values
    return out
