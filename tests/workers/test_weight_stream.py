"""The rollout side of async mode's bucket stream (verl/workers/weight_stream.py) on a tiny random Qwen2: buckets
handed over one call at a time reach the `hf` engine as one ordinary `update_weights` stream (same weights, one
bucket alive at a time), and the engine's errors (a name it lacks, a weight never sent) come back from `finish()`
without leaving the worker stuck. The actor side (`BucketExporter`) is tested on 1 and 2 FSDP2 ranks in
test_weight_sync.py."""

import pytest
import torch

from verl.models.tiny import random_qwen2
from verl.workers.rollout.hf_rollout import HFRollout
from verl.workers.weight_stream import BucketLoader


def buckets_of(state: dict[str, torch.Tensor], per_bucket: int) -> list[list]:
    items = list(state.items())
    return [items[i : i + per_bucket] for i in range(0, len(items), per_bucket)]


def test_buckets_put_one_at_a_time_load_the_whole_model():
    target, source = random_qwen2(0), random_qwen2(1)
    rollout = HFRollout(target.eval(), {"response_length": 4})
    seen_alive = []  # buckets handed over and not yet loaded, right after each put
    loader = BucketLoader(rollout)
    for _ in range(2):  # a loader serves stream after stream
        loader.begin()
        for bucket in buckets_of(source.state_dict(), per_bucket=3):
            loader.put(bucket)
            seen_alive.append(loader._queue.unfinished_tasks)
        loader.finish()
        for name, value in source.state_dict().items():
            assert torch.equal(target.state_dict()[name], value), name
    assert set(seen_alive) == {0}  # put returned only after the engine had taken its bucket


def test_engine_errors_come_back_from_finish_and_nothing_hangs():
    target, source = random_qwen2(0), random_qwen2(1)
    loader = BucketLoader(HFRollout(target.eval(), {"response_length": 4}))
    loader.begin()
    for bucket in buckets_of(source.state_dict(), per_bucket=4)[:-1]:  # the last bucket never comes
        loader.put(bucket)
    with pytest.raises(KeyError, match="misses rollout model parameters"):
        loader.finish()
    loader.begin()
    loader.put([("no.such.weight", torch.zeros(2))])
    loader.put(buckets_of(source.state_dict(), per_bucket=1000)[0])
    with pytest.raises(KeyError, match="keys the rollout model does not"):
        loader.finish()
    with pytest.raises(RuntimeError, match="before begin"):
        loader.put([])
    loader.begin()
    with pytest.raises(RuntimeError, match="already open"):
        loader.begin()
    with pytest.raises(KeyError, match="misses"):  # an empty stream: nothing was loaded
        loader.finish()
