"""Dispatch and collect of `@register`ed methods, without Ray: per-rank argument splitting, DataProto padding."""

import numpy as np
import pytest
import torch

from verl.protocol import DataProto
from verl.single_controller.base.decorator import (
    MAGIC_ATTR,
    Dispatch,
    Execute,
    collect_outputs,
    dispatch_calls,
    get_register_attrs,
    register,
    runs_on_rank_zero_only,
)


def _proto(n: int) -> DataProto:
    return DataProto.from_dict(
        tensors={"x": torch.arange(n, dtype=torch.float32)},
        non_tensors={"uid": np.array([f"u{i}" for i in range(n)], dtype=object)},
        meta_info={"temperature": 0.5},
    )


def test_register_stores_settings_and_wraps_the_function():
    def f(self, x):
        return x + 1

    g = register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, execute_mode=Execute.RANK_ZERO, blocking=False)(f)
    assert g.__wrapped__ is f and g.__name__ == "f" and g(None, 1) == 2
    assert getattr(g, MAGIC_ATTR) == {
        "dispatch_mode": Dispatch.DP_COMPUTE_PROTO,
        "execute_mode": Execute.RANK_ZERO,
        "blocking": False,
    }
    attrs = get_register_attrs(g)
    assert (attrs.dispatch_mode, attrs.execute_mode, attrs.blocking) == (
        Dispatch.DP_COMPUTE_PROTO,
        Execute.RANK_ZERO,
        False,
    )
    assert runs_on_rank_zero_only(attrs)
    assert get_register_attrs(lambda: None) is None
    default = get_register_attrs(register()(lambda self: None))
    assert (default.dispatch_mode, default.execute_mode, default.blocking) == (Dispatch.ALL_TO_ALL, Execute.ALL, True)
    assert not runs_on_rank_zero_only(default)
    assert runs_on_rank_zero_only(get_register_attrs(register(Dispatch.RANK_ZERO)(lambda self: None)))


def test_register_rejects_bad_modes():
    with pytest.raises(TypeError, match="dispatch_mode must be a Dispatch member or a dict .*, got 'ONE_TO_ALL'"):
        register(dispatch_mode="ONE_TO_ALL")
    with pytest.raises(TypeError, match=r"missing \['collect_fn'\]"):
        register(dispatch_mode={"dispatch_fn": print})
    with pytest.raises(TypeError, match="execute_mode"):
        register(execute_mode=Dispatch.ONE_TO_ALL)
    with pytest.raises(TypeError, match="blocking must be a bool"):
        register(blocking=1)


def test_one_to_all_gives_every_rank_the_same_arguments():
    calls = dispatch_calls(Dispatch.ONE_TO_ALL, 3, (7, "a"), {"k": [1]})
    assert calls.args == [(7, "a")] * 3
    assert calls.kwargs == [{"k": [1]}] * 3
    assert collect_outputs(Dispatch.ONE_TO_ALL, [1, 2, 3], calls) == [1, 2, 3]


@pytest.mark.parametrize("mode", [Dispatch.ALL_TO_ALL, Dispatch.DP_COMPUTE])
def test_per_rank_lists_give_rank_i_item_i(mode):
    calls = dispatch_calls(mode, 2, ([10, 11], ("a", "b")), {"k": [0.1, 0.2]})
    assert calls.args == [(10, "a"), (11, "b")]
    assert calls.kwargs == [{"k": 0.1}, {"k": 0.2}]
    assert collect_outputs(mode, ["r0", "r1"], calls) == ["r0", "r1"]


@pytest.mark.parametrize("mode", [Dispatch.ALL_TO_ALL, Dispatch.DP_COMPUTE])
def test_per_rank_lists_of_the_wrong_length_are_rejected(mode):
    with pytest.raises(ValueError, match=r"positional argument 0 must be a list with one item per rank \(2 items\)"):
        dispatch_calls(mode, 2, ([1, 2, 3],), {})
    with pytest.raises(ValueError, match="keyword argument 'k' .* got 5"):
        dispatch_calls(mode, 2, (), {"k": 5})


def test_dp_compute_proto_pads_an_uneven_batch_and_removes_the_padding():
    data = _proto(5)
    calls = dispatch_calls(Dispatch.DP_COMPUTE_PROTO, 2, (data,), {})
    assert (calls.pad_size, calls.padded_len) == (1, 6)
    # padding appends a copy of row 0: chunks are rows [0, 1, 2] and [3, 4, 0]
    assert calls.args[0][0].batch["x"].tolist() == [0.0, 1.0, 2.0]
    assert calls.args[1][0].batch["x"].tolist() == [3.0, 4.0, 0.0]
    assert list(calls.args[1][0].non_tensor_batch["uid"]) == ["u3", "u4", "u0"]
    assert calls.args[1][0].meta_info["temperature"] == 0.5

    outputs = [
        DataProto.from_dict(
            tensors={"y": 10 * chunk.batch["x"], "rank": torch.full((3,), rank)},
            non_tensors={"uid": chunk.non_tensor_batch["uid"]},
        )
        for rank, ((chunk,), _) in enumerate(zip(calls.args, calls.kwargs))
    ]
    merged = collect_outputs(Dispatch.DP_COMPUTE_PROTO, outputs, calls)
    assert merged.batch["y"].tolist() == [0.0, 10.0, 20.0, 30.0, 40.0]
    assert merged.batch["rank"].tolist() == [0, 0, 0, 1, 1]
    assert list(merged.non_tensor_batch["uid"]) == ["u0", "u1", "u2", "u3", "u4"]


def test_dp_compute_proto_keyword_arguments_and_no_padding_when_even():
    calls = dispatch_calls(Dispatch.DP_COMPUTE_PROTO, 3, (), {"data": _proto(6)})
    assert (calls.pad_size, calls.padded_len) == (0, 6)
    assert [kw["data"].batch["x"].tolist() for kw in calls.kwargs] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]


def test_dp_compute_proto_non_dataproto_outputs_come_back_as_a_list():
    calls = dispatch_calls(Dispatch.DP_COMPUTE_PROTO, 2, (_proto(3),), {})
    metrics = [{"loss": 1.0}, {"loss": 2.0}]
    assert collect_outputs(Dispatch.DP_COMPUTE_PROTO, metrics, calls) == metrics
    # a DataProto with only meta_info (no rows) is kept as is, padding or not
    empty = [DataProto(meta_info={"metrics": {"loss": 1.0}}), DataProto(meta_info={"metrics": {"loss": 2.0}})]
    merged = collect_outputs(Dispatch.DP_COMPUTE_PROTO, empty, calls)
    assert len(merged) == 0 and merged.meta_info["metrics"] == {"loss": [1.0, 2.0]}


def test_dp_compute_proto_rejects_bad_arguments_and_outputs():
    with pytest.raises(TypeError, match="positional argument 1 is a int"):
        dispatch_calls(Dispatch.DP_COMPUTE_PROTO, 2, (_proto(2), 3), {})
    with pytest.raises(ValueError, match=r"one length, got lengths \[2, 3\]"):
        dispatch_calls(Dispatch.DP_COMPUTE_PROTO, 2, (_proto(2), _proto(3)), {})
    calls = dispatch_calls(Dispatch.DP_COMPUTE_PROTO, 2, (_proto(3),), {})
    with pytest.raises(TypeError, match="some ranks returned a DataProto"):
        collect_outputs(Dispatch.DP_COMPUTE_PROTO, [_proto(2), {"a": 1}], calls)
    with pytest.raises(ValueError, match="padded the input to 4 rows .* returned 6 rows"):
        collect_outputs(Dispatch.DP_COMPUTE_PROTO, [_proto(3), _proto(3)], calls)


class _Group:
    """A worker group stand-in for nd dispatch: world size 4, ranks 0/1 are dp 0, ranks 2/3 are dp 1."""

    world_size = 4

    def __init__(self):
        self._dispatch_info, self._collect_info = {}, {}

    def _query_dispatch_info(self, mesh_name):
        return [0, 0, 1, 1]

    def _query_collect_info(self, mesh_name):
        return [True, False, True, False]


def test_nd_dispatch_sends_a_dp_chunk_to_every_rank_of_it_and_collects_the_marked_ones():
    from verl.single_controller.base.decorator import make_nd_compute_dataproto_dispatch_fn

    mode = make_nd_compute_dataproto_dispatch_fn(mesh_name="train")
    group = _Group()
    calls = dispatch_calls(mode, 4, (_proto(4),), {}, worker_group=group)
    assert [a[0].batch["x"].tolist() for a in calls.args] == [[0.0, 1.0], [0.0, 1.0], [2.0, 3.0], [2.0, 3.0]]
    merged = collect_outputs(mode, [a[0] for a in calls.args], calls)
    assert merged.batch["x"].tolist() == [0.0, 1.0, 2.0, 3.0] and group._dispatch_info == {"train": [0, 0, 1, 1]}


def test_dp_compute_proto_marks_the_padding_rows_of_each_chunk():
    from verl.protocol import PADDING_ROWS_KEY, real_row_mask

    calls = dispatch_calls(Dispatch.DP_COMPUTE_PROTO, 4, (_proto(5),), {})  # 5 rows -> 8: 3 padding rows
    assert [a[0].meta_info[PADDING_ROWS_KEY] for a in calls.args] == [0, 0, 1, 2]
    assert real_row_mask(calls.args[2][0]).tolist() == [True, False]
    merged = collect_outputs(Dispatch.DP_COMPUTE_PROTO, [a[0] for a in calls.args], calls)
    assert len(merged) == 5 and PADDING_ROWS_KEY not in merged.meta_info
