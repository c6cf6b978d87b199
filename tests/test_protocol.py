"""Tests for verl.protocol: DataProto construction, indexing, key ops, combining, grouping, padding and I/O."""

import pickle

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from verl.protocol import DataProto, DataProtoItem, pad_dataproto_to_divisor, unpad_dataproto


def make_data(n: int = 4) -> DataProto:
    """Rows i = 0..n-1: ids[i] = [10i, 10i+1], score[i] = i, uid 'g{i//2}', reward_model {'ground_truth': i}."""
    ids = torch.tensor([[10 * i, 10 * i + 1] for i in range(n)])
    score = torch.arange(n, dtype=torch.float32)
    return DataProto.from_dict(
        tensors={"ids": ids, "score": score},
        non_tensors={"uid": [f"g{i // 2}" for i in range(n)], "reward_model": [{"ground_truth": i} for i in range(n)]},
        meta_info={"temperature": 1.0},
    )


# ---------------------------------------------------------------- construction and consistency
def test_from_dict_converts_lists_to_object_arrays_and_keeps_dicts_per_row():
    data = make_data(3)
    assert len(data) == 3
    assert data.batch.batch_size == torch.Size([3])
    rm = data.non_tensor_batch["reward_model"]
    assert isinstance(rm, np.ndarray) and rm.dtype == object and rm.shape == (3,)
    assert rm[2] == {"ground_truth": 2}
    # from_dict converts a list like verl (np.array(..., dtype=object)): equal-length inner lists give a 2-D array;
    # the constructor keeps one element per row
    nested = DataProto.from_dict(non_tensors={"x": [[1, 2], [3, 4]]})
    assert nested.non_tensor_batch["x"].shape == (2, 2) and list(nested.non_tensor_batch["x"][1]) == [3, 4]
    assert nested.batch is None and len(nested) == 2
    per_row = DataProto(non_tensor_batch={"x": [[1, 2], [3, 4]]})
    assert per_row.non_tensor_batch["x"].shape == (2,) and per_row.non_tensor_batch["x"][1] == [3, 4]
    numeric = DataProto.from_dict(non_tensors={"index": np.array([5, 6])})
    assert numeric.non_tensor_batch["index"].dtype == np.array([5, 6]).dtype  # arrays are kept as they are


def test_from_single_dict_splits_by_type():
    data = DataProto.from_single_dict(
        {"ids": torch.zeros(2, 3), "uid": np.array(["a", "b"], dtype=object), "src": ["s", "t"]}, meta_info={"k": 1}
    )
    assert list(data.batch.keys()) == ["ids"]
    assert sorted(data.non_tensor_batch) == ["src", "uid"]
    assert data.meta_info == {"k": 1}
    with pytest.raises(TypeError, match="'bad'.*int"):
        DataProto.from_single_dict({"bad": 3})


def test_inconsistent_lengths_raise_naming_keys_and_sizes():
    with pytest.raises(ValueError, match=r"'a': \[2\].*'b': \[3\]"):
        DataProto.from_dict(tensors={"a": torch.zeros(2), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"'batch': 2.*'uid': 3"):
        DataProto.from_dict(tensors={"a": torch.zeros(2)}, non_tensors={"uid": ["x", "y", "z"]})
    with pytest.raises(ValueError, match="'uid': 3"):
        DataProto(non_tensor_batch={"uid": ["x", "y", "z"], "src": ["a"]})


def test_empty_dataproto_has_length_zero():
    assert len(DataProto()) == 0


# ---------------------------------------------------------------- indexing
def test_int_index_returns_item():
    item = make_data(4)[-1]
    assert isinstance(item, DataProtoItem)
    assert item.batch["ids"].tolist() == [30, 31]
    assert item.non_tensor_batch == {"uid": "g1", "reward_model": {"ground_truth": 3}}
    assert item.meta_info == {"temperature": 1.0}
    with pytest.raises(IndexError, match="index 4 out of range.*4 rows"):
        make_data(4)[4]


@pytest.mark.parametrize(
    "index",
    [slice(1, 3), np.array([1, 2]), torch.tensor([1, 2]), [1, 2], np.array([False, True, True, False])],
    ids=["slice", "numpy", "tensor", "list", "bool-mask"],
)
def test_array_like_index_returns_dataproto(index):
    sub = make_data(4)[index]
    assert isinstance(sub, DataProto)
    assert sub.batch["score"].tolist() == [1.0, 2.0]
    assert list(sub.non_tensor_batch["uid"]) == ["g0", "g1"]
    assert sub.meta_info == {"temperature": 1.0}


def test_bad_indices_raise():
    data = make_data(4)
    with pytest.raises(IndexError, match="boolean mask has length 3.*4 rows"):
        data[np.array([True, False, True])]
    with pytest.raises(IndexError, match="out of range"):
        data[np.array([0, 7])]
    with pytest.raises(TypeError, match="str"):
        data["ids"]


# ---------------------------------------------------------------- select / pop / union
def test_select_keeps_only_named_keys_and_shares_tensors_unless_deepcopy():
    data = make_data(2)
    sub = data.select(batch_keys=["ids"], non_tensor_batch_keys=["uid"], meta_info_keys=[])
    assert list(sub.batch.keys()) == ["ids"] and list(sub.non_tensor_batch) == ["uid"] and sub.meta_info == {}
    sub.batch["ids"][0, 0] = -1
    assert data.batch["ids"][0, 0] == -1
    copied = data.select(batch_keys=["ids"], deepcopy=True)
    copied.batch["ids"][0, 0] = 99
    assert data.batch["ids"][0, 0] == -1
    everything = data.select()
    assert sorted(everything.batch.keys()) == ["ids", "score"] and sorted(everything.non_tensor_batch) == [
        "reward_model",
        "uid",
    ]


def test_select_and_pop_unknown_key_names_missing_and_available():
    data = make_data(2)
    with pytest.raises(KeyError, match=r"\['nope'\].*\['ids', 'score'\]"):
        data.select(batch_keys=["ids", "nope"])
    with pytest.raises(KeyError, match=r"\['nope'\].*\['reward_model', 'uid'\]"):
        data.pop(non_tensor_batch_keys=["nope"])
    with pytest.raises(KeyError, match=r"meta_info keys \['x'\]"):
        data.select(meta_info_keys=["x"])


def test_pop_removes_keys_from_self():
    data = make_data(3)
    popped = data.pop(batch_keys=["score"], non_tensor_batch_keys=["uid"], meta_info_keys=["temperature"])
    assert list(popped.batch.keys()) == ["score"] and popped.batch["score"].tolist() == [0.0, 1.0, 2.0]
    assert list(popped.non_tensor_batch) == ["uid"] and popped.meta_info == {"temperature": 1.0}
    assert list(data.batch.keys()) == ["ids"] and list(data.non_tensor_batch) == ["reward_model"]
    assert data.meta_info == {} and len(data) == 3
    only_non_tensor = make_data(3).pop(non_tensor_batch_keys=["uid"])
    assert only_non_tensor.batch is None and len(only_non_tensor) == 3


def test_union_merges_and_rejects_conflicts():
    data = make_data(2)
    other = DataProto.from_dict(
        tensors={"ids": data.batch["ids"].clone(), "values": torch.tensor([0.5, 0.25])},
        non_tensors={"uid": ["g0", "g0"], "extra": ["e0", "e1"]},
        meta_info={"temperature": 1.0, "step": 3},
    )
    out = data.union(other)
    assert out is data
    assert sorted(data.batch.keys()) == ["ids", "score", "values"]
    assert data.batch["values"].tolist() == [0.5, 0.25]
    assert sorted(data.non_tensor_batch) == ["extra", "reward_model", "uid"] and data.meta_info["step"] == 3

    # conflicts raise AssertionError, as in verl
    with pytest.raises(AssertionError, match="score in tensor_dict1 and tensor_dict2 are not the same"):
        make_data(2).union(DataProto.from_dict(tensors={"score": torch.tensor([9.0, 9.0])}))
    with pytest.raises(AssertionError, match="`uid` in tensor_dict1 and tensor_dict2 are not the same"):
        make_data(2).union(DataProto.from_dict(non_tensors={"uid": ["a", "b"]}))
    with pytest.raises(AssertionError, match="temperature in meta_dict1 and meta_dict2 are not the same"):
        make_data(2).union(DataProto(meta_info={"temperature": 0.5}))
    with pytest.raises(AssertionError, match=r"identical batch size. Got torch.Size\(\[2\]\) and torch.Size\(\[3\]\)"):
        make_data(2).union(make_data(3))


def test_union_into_non_tensor_only_dataproto_takes_the_batch():
    data = DataProto.from_dict(non_tensors={"uid": ["a", "b"]})
    data.union(DataProto.from_dict(tensors={"x": torch.tensor([1, 2])}))
    assert data.batch["x"].tolist() == [1, 2] and list(data.non_tensor_batch["uid"]) == ["a", "b"]


# ---------------------------------------------------------------- concat / chunk / split
def test_concat_rows_and_merge_metrics():
    a, b = make_data(2), make_data(3)
    a.meta_info["metrics"] = {"actor/pg_loss": [0.1, 0.2], "actor/lr": 1e-3}
    b.meta_info["metrics"] = {"actor/pg_loss": [0.3], "actor/lr": 1e-3}
    b.meta_info["step"] = 7
    out = DataProto.concat([a, b])
    assert len(out) == 5
    assert out.batch["score"].tolist() == [0.0, 1.0, 0.0, 1.0, 2.0]
    assert list(out.non_tensor_batch["uid"]) == ["g0", "g0", "g0", "g0", "g1"]
    assert out.meta_info["temperature"] == 1.0 and out.meta_info["step"] == 7  # keys of every item
    # one entry per item's metrics dict, as verl (a list value stays one entry)
    assert out.meta_info["metrics"] == {"actor/pg_loss": [[0.1, 0.2], [0.3]], "actor/lr": [1e-3, 1e-3]}
    b.meta_info["temperature"] = 7.0
    with pytest.raises(AssertionError, match="Conflicting values for meta_info key 'temperature'"):
        DataProto.concat([a, b])
    assert a.meta_info["metrics"] == {"actor/pg_loss": [0.1, 0.2], "actor/lr": 1e-3}  # inputs untouched


def test_concat_errors():
    with pytest.raises(ValueError, match="empty list"):
        DataProto.concat([])
    with pytest.raises(ValueError, match="with and without a tensor batch"):
        DataProto.concat([make_data(2), DataProto.from_dict(non_tensors={"uid": ["a"], "reward_model": [{}]})])
    with pytest.raises(ValueError, match=r"item 1 has non_tensor_batch keys \['uid'\]"):
        DataProto.concat([make_data(2), make_data(2).select(non_tensor_batch_keys=["uid"])])


def test_chunk_equal_parts_and_divisibility_error():
    parts = make_data(6).chunk(3)
    assert [p.batch["score"].tolist() for p in parts] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    assert list(parts[2].non_tensor_batch["uid"]) == ["g2", "g2"]
    with pytest.raises(ValueError, match="size of DataProto 5 and chunk 2"):
        make_data(5).chunk(2)
    with pytest.raises(AssertionError):  # verl's exception type
        make_data(5).chunk(2)
    # with auto padding enabled, unequal parts are allowed (verl's DataProtoConfig.auto_padding)
    padded = DataProto.from_dict(tensors={"x": torch.arange(5)}, auto_padding=True)
    assert [p.batch["x"].tolist() for p in padded.chunk(2)] == [[0, 1, 2], [3, 4]]


def test_split_last_piece_smaller():
    parts = make_data(5).split(2)
    assert [p.batch["score"].tolist() for p in parts] == [[0.0, 1.0], [2.0, 3.0], [4.0]]
    with pytest.raises(ValueError, match="split_size must be a positive int, got 0"):
        make_data(5).split(0)


# ---------------------------------------------------------------- repeat / reorder / group_by
def test_repeat_interleave_vs_tile():
    data = make_data(2)
    inter = data.repeat(3, interleave=True)
    assert inter.batch["score"].tolist() == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert [r["ground_truth"] for r in inter.non_tensor_batch["reward_model"]] == [0, 0, 0, 1, 1, 1]
    tiled = data.repeat(3, interleave=False)
    assert tiled.batch["ids"][:, 0].tolist() == [0, 10, 0, 10, 0, 10]
    assert [r["ground_truth"] for r in tiled.non_tensor_batch["reward_model"]] == [0, 1, 0, 1, 0, 1]
    with pytest.raises(ValueError, match="repeat_times"):
        data.repeat(0)


def test_reorder_in_place():
    data = make_data(4)
    data.reorder(torch.tensor([2, 0, 3, 1]))
    assert data.batch["score"].tolist() == [2.0, 0.0, 3.0, 1.0]
    assert [r["ground_truth"] for r in data.non_tensor_batch["reward_model"]] == [2, 0, 3, 1]
    with pytest.raises(ValueError, match="permutation of 0..3"):
        data.reorder([0, 0, 1, 2])


def test_group_by_and_restore_round_trip():
    data = DataProto.from_dict(
        tensors={"score": torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0])},
        non_tensors={"data_source": ["gsm8k", "rlla", "gsm8k", "math", "rlla"]},
    )
    groups, restore = data.group_by("data_source")
    assert list(groups) == ["gsm8k", "rlla", "math"]
    assert groups["gsm8k"].batch["score"].tolist() == [0.0, 2.0]
    assert groups["rlla"].batch["score"].tolist() == [1.0, 4.0]
    assert groups["math"].batch["score"].tolist() == [3.0]
    processed = {k: DataProto.from_dict(tensors={"score": g.batch["score"] * 10}) for k, g in groups.items()}
    merged = DataProto.concat(list(processed.values()))[restore]
    assert merged.batch["score"].tolist() == [0.0, 10.0, 20.0, 30.0, 40.0]

    by_tensor, restore_t = DataProto.from_dict(tensors={"k": torch.tensor([1, 0, 1])}).group_by("k")
    assert list(by_tensor) == [1, 0] and restore_t.tolist() == [0, 2, 1]
    with pytest.raises(KeyError, match="'nope' not found"):
        data.group_by("nope")
    with pytest.raises(TypeError, match="unhashable value at row 0"):
        make_data(2).group_by("reward_model")


# ---------------------------------------------------------------- padding
def test_pad_repeats_rows_from_start_and_unpad_restores():
    data = make_data(5)
    data.meta_info["metrics"] = {"m": 1.0}
    padded, pad_size = pad_dataproto_to_divisor(data, 4)
    assert pad_size == 3 and len(padded) == 8
    assert padded.batch["score"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 0.0, 1.0, 2.0]
    assert padded.meta_info == {"temperature": 1.0, "metrics": {"m": 1.0}}
    unpadded = unpad_dataproto(padded, pad_size)
    assert unpadded.batch["score"].tolist() == data.batch["score"].tolist()
    assert list(unpadded.non_tensor_batch["uid"]) == list(data.non_tensor_batch["uid"])
    # padding more than the data length cycles through the rows
    small, small_pad = pad_dataproto_to_divisor(make_data(2), 5)
    assert small_pad == 3 and small.batch["score"].tolist() == [0.0, 1.0, 0.0, 1.0, 0.0]
    same, zero = pad_dataproto_to_divisor(make_data(4), 2)
    assert zero == 0 and len(same) == 4 and len(unpad_dataproto(same, 0)) == 4
    with pytest.raises(ValueError, match="size_divisor"):
        pad_dataproto_to_divisor(data, 0)
    with pytest.raises(ValueError, match="pad_size must be in"):
        unpad_dataproto(data, 6)


# ---------------------------------------------------------------- device and serialisation
def test_to_device_returns_self():
    data = make_data(2)
    assert data.to("cpu") is data and data.batch.device == torch.device("cpu")


def assert_same(a: DataProto, b: DataProto) -> None:
    assert sorted(a.batch.keys()) == sorted(b.batch.keys())
    for key in a.batch.keys():
        assert torch.equal(a.batch[key], b.batch[key])
    assert sorted(a.non_tensor_batch) == sorted(b.non_tensor_batch)
    for key, val in a.non_tensor_batch.items():
        assert b.non_tensor_batch[key].dtype == object and list(val) == list(b.non_tensor_batch[key])
    assert a.meta_info == b.meta_info


def test_save_and_load_round_trip(tmp_path):
    data = make_data(3)
    path = str(tmp_path / "batch.pt")
    data.save_to_disk(path)
    assert_same(data, DataProto.load_from_disk(path))
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        DataProto.load_from_disk(str(tmp_path / "missing.pt"))


def test_pickle_round_trip():
    data = make_data(3)
    assert_same(data, pickle.loads(pickle.dumps(data)))
    only_non_tensor = DataProto.from_dict(non_tensors={"uid": ["a"]})
    assert list(pickle.loads(pickle.dumps(only_non_tensor)).non_tensor_batch["uid"]) == ["a"]


def test_batch_must_be_tensordict():
    with pytest.raises(TypeError, match="TensorDict or None, got dict"):
        DataProto(batch={"x": torch.zeros(2)})
    assert len(DataProto(batch=TensorDict({"x": torch.zeros(2)}, batch_size=[2]))) == 2


# ---------------------------------------------------------------- verl 0.9.1 API additions
def test_fold_unfold_and_column_chunks():
    from verl.protocol import fold_batch_dim, unfold_batch_dim

    data = make_data(4)
    folded = fold_batch_dim(data.select(batch_keys=["score"], non_tensor_batch_keys=["uid"]), new_batch_size=2)
    assert folded.batch["score"].tolist() == [[0.0, 1.0], [2.0, 3.0]] and folded.non_tensor_batch["uid"].shape == (2, 2)
    back = unfold_batch_dim(folded, batch_dims=2)
    assert back.batch["score"].tolist() == [0.0, 1.0, 2.0, 3.0] and list(back.non_tensor_batch["uid"]) == [
        "g0",
        "g0",
        "g1",
        "g1",
    ]
    wide = DataProto.from_dict(tensors={"a": torch.tensor([[1, 2], [3, 4]]), "b": torch.tensor([7, 8])})
    unfolded = wide.unfold_column_chunks(2, split_keys=["a"])
    assert unfolded.batch["a"].tolist() == [[1], [2], [3], [4]] and unfolded.batch["b"].tolist() == [7, 7, 8, 8]
    assert make_data(3).sample_level_repeat([2, 0, 1]).batch["score"].tolist() == [0.0, 0.0, 2.0]


def test_tensordict_round_trip_and_numpy_pickling(monkeypatch):
    data = make_data(2)
    td = data.to_tensordict()
    back = DataProto.from_tensordict(td)
    assert_same(data, back)
    monkeypatch.setenv("VERL_DATAPROTO_SERIALIZATION_METHOD", "numpy")
    assert_same(data, pickle.loads(pickle.dumps(data)))


def test_make_iterator_is_seeded_and_padding_helpers():
    from verl.protocol import PADDING_ROWS_KEY, real_row_mask

    data = make_data(4)
    kwargs = {"mini_batch_size": 2, "epochs": 1, "seed": 3, "dataloader_kwargs": {"shuffle": True}}
    first = [b.batch["score"].tolist() for b in data.make_iterator(**kwargs)]
    assert first == [b.batch["score"].tolist() for b in data.make_iterator(**kwargs)]
    assert sorted(sum(first, [])) == [0.0, 1.0, 2.0, 3.0]
    data.meta_info[PADDING_ROWS_KEY] = 1
    assert real_row_mask(data).tolist() == [True, True, True, False]
    grown = make_data(2)
    grown.padding(2, padding_candidate="first")
    assert grown.batch["score"].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert "batch" in data.get_data_info() and "temperature: float" in data.get_data_info()
