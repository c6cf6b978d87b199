"""Tests of verl/utils/tensordict_utils.py: non-tensor values, jagged nested tensors, (de)serialisation, and the
tensordict 0.10 rules it keeps (concatenation keeps the first batch-wide value; consolidate wants contiguous tensors)."""

import pytest
import torch
from tensordict import TensorDict

from verl.utils import tensordict_utils as tu


def test_get_tensordict_stores_rows_and_batch_wide_values():
    td = tu.get_tensordict({"obs": torch.arange(3), "turns": [[], [1], [2, 3]]}, {"name": "run"})
    assert td.batch_size == torch.Size([3])
    assert tu.get(td, "turns") == [[], [1], [2, 3]] and tu.get(td, "name") == "run" and tu.get(td, "no", 7) == 7
    picked = tu.get_keys(td, ["obs", "name"])
    assert sorted(picked.keys()) == ["name", "obs"]
    assert tu.pop(td, "name") == "run" and "name" not in td.keys()


def test_chunk_concat_and_index_keep_jagged_rows():
    rows = [torch.arange(n).expand(2, n).contiguous() for n in (2, 3, 4, 5)]  # ragged along dim 1 of each row
    nested = tu.nested_tensor_from_tensor_list(rows, ragged_idx=2)
    td = TensorDict({"x": torch.arange(4), "pos": nested}, batch_size=[4])
    parts = tu.chunk_tensordict(td, 2)
    assert [p["x"].tolist() for p in parts] == [[0, 1], [2, 3]]
    merged = tu.concat_tensordict(parts)
    assert [r.shape[-1] for r in merged["pos"].unbind()] == [2, 3, 4, 5]
    picked = tu.index_select_tensor_dict(td, [3, 0])
    assert picked["x"].tolist() == [3, 0] and [r.shape[-1] for r in picked["pos"].unbind()] == [5, 2]


def test_pad_unpad_and_serialisation_round_trip():
    td = TensorDict({"x": torch.arange(3)}, batch_size=[3])
    padded, pad = tu.pad_to_divisor(td, 4)
    assert pad == 1 and padded["x"].tolist() == [0, 1, 2, 0] and tu.unpad(padded, pad)["x"].tolist() == [0, 1, 2]
    mixed = TensorDict({"b": torch.randn(3, 2).bfloat16(), "i": torch.arange(3)}, batch_size=[3])
    back = tu.deserialize_tensordict(tu.serialize_tensordict(mixed))
    tu.assert_tensordict_eq(mixed, back)
    batches = list(tu.make_iterator(td[:2], mini_batch_size=1, epochs=2))
    assert [b["x"].tolist() for b in batches] == [[0], [1], [0], [1]]


def test_concat_keeps_the_first_batch_wide_value_and_stacks_rows():
    first = tu.get_tensordict({"obs": torch.arange(2), "labels": ["a", "b"]}, {"temp": 1.0})
    second = tu.get_tensordict({"obs": torch.arange(2, 5), "labels": ["c", "d", "e"]}, {"temp": 2.0})
    for merged in (tu.concat_tensordict([first, second]), torch.cat([first, second], dim=0)):
        assert merged.batch_size == torch.Size([5]) and merged["obs"].tolist() == [0, 1, 2, 3, 4]
        assert tu.get(merged, "temp") == 1.0 and tu.get(merged, "labels") == ["a", "b", "c", "d", "e"]
    assert tu.get(second, "temp") == 2.0  # the parts are left as they were


def test_consolidate_refuses_a_non_contiguous_tensor_until_made_contiguous():
    base = torch.arange(12.0).view(3, 4)
    td = tu.get_tensordict({"strided": base[:, :3], "ok": base.clone()}, {"name": "x"})
    with pytest.raises(RuntimeError, match="'strided' is not contiguous"):
        td.consolidate()
    fixed = tu.contiguous(td)
    consolidated = fixed.consolidate()
    assert consolidated["strided"].tolist() == base[:, :3].tolist() and tu.get(consolidated, "name") == "x"
