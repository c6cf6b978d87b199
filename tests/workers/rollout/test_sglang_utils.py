"""verl.workers.rollout.sglang_rollout.utils: weight buckets cut by size with fusion groups kept whole, sync and
async, and the sglang engine's `update_weights` using them for a DeepSeek-V4 model (a recording engine: no sglang
or GPU needed)."""

import asyncio

import pytest
import torch

from verl.workers.rollout.sglang_rollout import SGLangRollout
from verl.workers.rollout.sglang_rollout.utils import (
    DEEPSEEK_V4_FUSION_GROUPS,
    get_named_tensor_buckets,
    named_tensor_buckets,
)


def t(nbytes):
    return torch.zeros(nbytes, dtype=torch.uint8)


def names(buckets):
    return [[name for name, _ in bucket] for bucket in buckets]


def test_buckets_are_cut_by_size_and_a_large_tensor_travels_alone():
    items = [("a", t(40)), ("b", t(40)), ("c", t(40)), ("big", t(300)), ("d", t(10))]
    assert names(named_tensor_buckets(items, 100)) == [["a", "b"], ["c"], ["big"], ["d"]]
    with pytest.raises(ValueError, match="bucket_bytes must be greater than 0, got 0"):
        list(named_tensor_buckets(items, 0))


def test_a_fusion_group_is_cut_before_never_inside_and_may_wait_for_its_sibling():
    layer = "model.layers.0.attn"
    items = [("x", t(60)), (f"{layer}.wq_a.weight", t(30)), ("y", t(5)), (f"{layer}.wkv.weight", t(30))]
    # by size alone wq_a would join x; the group (60 bytes) does not fit beside x, so the cut comes before it,
    # and y, which arrived between the members, goes first
    assert names(named_tensor_buckets(items, 100, DEEPSEEK_V4_FUSION_GROUPS)) == [
        ["x", "y"],
        [f"{layer}.wq_a.weight", f"{layer}.wkv.weight"],
    ]
    assert names(named_tensor_buckets(items, 100)) == [["x", f"{layer}.wq_a.weight", "y"], [f"{layer}.wkv.weight"]]


def test_a_view_waiting_in_a_bucket_is_a_compact_copy():
    base = torch.arange(10.0)
    (bucket,) = named_tensor_buckets([("v", base[:2]), ("w", base)], 1 << 20)
    assert bucket[0][1]._base is None and bucket[0][1].untyped_storage().nbytes() == 8
    assert bucket[1][1] is base


def test_async_form_takes_sync_and_async_streams():
    items = [("a", t(60)), ("b", t(60))]

    async def stream():
        for item in items:
            yield item

    async def collect(source):
        return [bucket async for bucket in get_named_tensor_buckets(source, 100)]

    assert names(asyncio.run(collect(iter(items)))) == names(asyncio.run(collect(stream()))) == [["a"], ["b"]]


class RecordingEngine:
    def __init__(self):
        self.requests = []
        self.flushed = 0

    def update_weights_from_tensor(self, bucket, flush_cache):
        self.requests.append([name for name, _ in bucket])

    def flush_cache(self):
        self.flushed += 1


class NoMemory:
    def resume(self, *tags):
        pass


def sglang_rollout(fusion_groups):
    rollout = SGLangRollout.__new__(SGLangRollout)  # no sglang here: only what update_weights reads
    rollout.engine, rollout.memory, rollout.bucket_bytes = RecordingEngine(), NoMemory(), 100
    rollout.weight_dtype, rollout.fusion_groups = None, fusion_groups
    return rollout


def test_sglang_engine_keeps_deepseek_v4_groups_in_one_request():
    layer = "model.layers.3.self_attn"
    # the worker's buckets (cut by size on the actor's side) split the group
    buckets = [[("x", t(50)), (f"{layer}.wq_a.weight", t(40))], [(f"{layer}.wkv.weight", t(40)), ("y", t(10))]]
    rollout = sglang_rollout(DEEPSEEK_V4_FUSION_GROUPS)
    rollout.update_weights(iter(buckets))
    assert rollout.engine.requests == [["x"], [f"{layer}.wq_a.weight", f"{layer}.wkv.weight", "y"]]
    assert rollout.engine.flushed == 1
    other = sglang_rollout(())  # any other model: the worker's buckets as they come
    other.update_weights(iter(buckets))
    assert other.engine.requests == [["x", f"{layer}.wq_a.weight"], [f"{layer}.wkv.weight", "y"]]
