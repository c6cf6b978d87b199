"""verl/utils/stats_tracker.py: scopes prefix keys, scalars export their mean, masked stats their avg/min/max over
the true elements, timings land under timeperf/, export clears what it returned, bad input is refused, and on two
gloo ranks an export aggregates over both (a key recorded on one rank only included)."""

import time

import pytest
import torch
import torch.distributed as dist

from tests.multirank import run_ranks
from verl.utils import stats_tracker
from verl.utils.fsdp_utils import free_port
from verl.utils.stats_tracker import StatsTracker


def test_scopes_scalars_stats_and_timings_export_their_aggregates():
    tracker = StatsTracker()
    with tracker.scope("actor"):
        tracker.scalar(loss=1.0, lr=torch.tensor(0.5))
        tracker.scalar(loss=3.0)
        with tracker.scope("ppo"), tracker.record_timing("step"):
            tracker.scalar(clip=0.25)
            time.sleep(0.01)
        tracker.denominator(n_tokens=torch.tensor([[True, True, False], [True, False, False]]))
        tracker.stat(denominator="n_tokens", reward=torch.tensor([[1.0, 2.0, 99.0], [-4.0, 99.0, 99.0]]))
    tracker.denominator(empty=torch.zeros(3, dtype=torch.bool))
    tracker.stat(denominator="empty", unseen=torch.ones(3))
    out = tracker.export()
    timing = out.pop("timeperf/step")  # not under the scopes it ran in
    assert 0.01 <= timing < 5
    assert out == {"actor/loss": 2.0, "actor/lr": 0.5, "actor/ppo/clip": 0.25, "actor/n_tokens": 3.0,
                   "actor/reward/avg": -1 / 3, "actor/reward/min": -4.0, "actor/reward/max": 2.0,
                   "empty": 0.0}  # fmt: skip
    assert tracker.export() == {}  # reset by the export


def test_export_of_one_key_keeps_the_others_and_the_module_functions_share_one_tracker():
    tracker = StatsTracker()
    tracker.scalar(a=1.0, b=2.0)
    with tracker.scope("actor"):
        tracker.scalar(loss=4.0)
        assert tracker.export("loss", reset=False) == {"actor/loss": 4.0}
        assert tracker.export("loss") == {"actor/loss": 4.0}
    assert tracker.export("a") == {"a": 1.0}
    assert tracker.export() == {"b": 2.0}
    with stats_tracker.scope("t"):
        stats_tracker.scalar(x=2)
    assert stats_tracker.export() == {"t/x": 2.0} and stats_tracker.DEFAULT_TRACKER.export() == {}


def test_bad_input_is_refused_naming_it():
    tracker = StatsTracker()
    with pytest.raises(TypeError, match="scalar: loss='high' is not a number"):
        tracker.scalar(loss="high")
    with pytest.raises(TypeError, match="scalar: loss=.* is not a number"):
        tracker.scalar(loss=torch.ones(2))
    with pytest.raises(TypeError, match="denominator: mask must be a bool tensor, got a torch.int64 tensor"):
        tracker.denominator(mask=torch.ones(2, dtype=torch.long))
    with pytest.raises(KeyError, match="no denominator 'mask' recorded"):
        tracker.stat(denominator="mask", x=torch.ones(2))
    tracker.denominator(mask=torch.ones(2, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"x must be a float tensor of the shape of 'mask' \(2,\), got .*\(3,\)"):
        tracker.stat(denominator="mask", x=torch.ones(3))
    with pytest.raises(ValueError, match="'mask' was recorded as a sum, now as a mean"):
        tracker.scalar(mask=1.0)
    with pytest.raises(ValueError, match="non-empty string"), tracker.scope("/"):
        pass


def run_reduce_rank(rank: int, world_size: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        tracker = StatsTracker()
        tracker.scalar(loss=float(rank + 1))  # 1 and 2
        if rank == 1:
            tracker.scalar(only_on_one=5.0)
        mask = torch.tensor([True, rank == 1])
        tracker.denominator(n=mask)
        tracker.stat(denominator="n", x=torch.tensor([10.0 * (rank + 1), -7.0]))  # rank 0: 10; rank 1: 20, -7
        out = tracker.export(reduce_group=dist.group.WORLD)
        assert out == {"loss": 1.5, "only_on_one": 5.0, "n": 3.0, "x/avg": 23 / 3, "x/min": -7.0, "x/max": 20.0}, out
    finally:
        dist.destroy_process_group()


def test_export_over_two_ranks_aggregates_both():
    run_ranks(run_reduce_rank, 2, free_port())
