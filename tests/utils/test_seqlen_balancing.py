"""Tests of verl/utils/seqlen_balancing.py: token-budget micro-batches and per-rank length balancing."""

import itertools
import random

import pytest
import torch

from verl.protocol import DataProto
from verl.utils.seqlen_balancing import (
    balance_batch,
    balanced_rank_order,
    get_seqlen_balanced_partitions,
    rearrange_micro_batches,
)


def sums(partitions, lengths):
    return [sum(lengths[i] for i in p) for p in partitions]


def best_max_sum(lengths, k, equal_size):
    """Brute force: the smallest possible largest partition sum."""
    best = float("inf")
    for labels in itertools.product(range(k), repeat=len(lengths)):
        counts = [labels.count(p) for p in range(k)]
        if min(counts) == 0 or (equal_size and len(set(counts)) > 1):
            continue
        best = min(best, max(sum(n for n, lab in zip(lengths, labels) if lab == p) for p in range(k)))
    return best


@pytest.mark.parametrize("equal_size", [False, True])
def test_partitions_cover_every_item_and_are_near_optimal(equal_size):
    rng = random.Random(0)
    for _ in range(20):
        lengths = [rng.randint(1, 50) for _ in range(8)]
        parts = get_seqlen_balanced_partitions(lengths, 2, equal_size)
        assert sorted(i for p in parts for i in p) == list(range(8))
        if equal_size:
            assert [len(p) for p in parts] == [4, 4]
        assert max(sums(parts, lengths)) <= 4 / 3 * best_max_sum(lengths, 2, equal_size) + 1e-9


def test_partition_by_hand():
    # LPT: 9 -> A, 7 -> B, 5 -> B (7 < 9), 4 -> A (12 > 9), 3 -> B (12 < 13), 2 -> A (13 < 15)
    assert get_seqlen_balanced_partitions([9, 7, 5, 4, 3, 2], 2, equal_size=False) == [[0, 3, 5], [1, 2, 4]]
    # equal size: 3 items each; sums 15 and 15
    parts = get_seqlen_balanced_partitions([9, 7, 5, 4, 3, 2], 2, equal_size=True)
    assert sums(parts, [9, 7, 5, 4, 3, 2]) == [15, 15] and [len(p) for p in parts] == [3, 3]


def test_partition_errors_name_the_values():
    with pytest.raises(ValueError, match="k_partitions must be >= 1, got 0"):
        get_seqlen_balanced_partitions([1, 2], 0, False)
    with pytest.raises(ValueError, match="cannot split 1 items into 2"):
        get_seqlen_balanced_partitions([1], 2, False)
    with pytest.raises(ValueError, match=r"item count \(3\) divisible by k_partitions \(2\)"):
        get_seqlen_balanced_partitions([1, 2, 3], 2, True)
    with pytest.raises(ValueError, match=r"must be >= 0, got \[-1\]"):
        get_seqlen_balanced_partitions([1, -1], 1, False)


def test_micro_batches_respect_the_budget_and_cover_everything():
    rng = random.Random(1)
    lengths = [rng.randint(10, 100) for _ in range(50)]
    bins = rearrange_micro_batches(lengths, 256)
    assert sorted(i for b in bins for i in b) == list(range(50))
    assert all(sum(lengths[i] for i in b) <= 256 for b in bins)
    # first-fit decreasing needs at most 11/9 OPT + 1 bins; OPT >= ceil(total / budget)
    assert len(bins) <= 11 / 9 * -(-sum(lengths) // 256) + 1


def test_micro_batches_by_hand_and_over_budget_samples():
    # decreasing: 7 -> [7], 6 -> new [6], 3 -> [7,3], 2 -> [6,2], 1 -> [6,2,1]
    assert rearrange_micro_batches([3, 7, 1, 6, 2], 10) == [[0, 1], [2, 3, 4]]
    assert rearrange_micro_batches([30, 4, 5], 10) == [[0], [1, 2]]  # 30 > budget: alone


def test_groups_stay_together_unless_over_budget():
    lengths = [4, 4, 3, 3, 5, 5]
    groups = [[0, 1], [2, 3], [4, 5]]
    bins = rearrange_micro_batches(lengths, 10, groups)
    for group in groups:
        assert sum(set(group) <= set(b) for b in bins) == 1
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    # a group over the budget is packed sample by sample
    bins = rearrange_micro_batches([8, 8, 1], 10, [[0, 1], [2]])
    assert sorted(i for b in bins for i in b) == [0, 1, 2] and len(bins) == 2


def test_micro_batch_errors():
    with pytest.raises(ValueError, match="max_token_len must be a positive int.*got 0"):
        rearrange_micro_batches([1, 2], 0)
    with pytest.raises(ValueError, match="every index"):
        rearrange_micro_batches([1, 2, 3], 10, [[0, 1]])


def test_rank_order_balances_tokens_per_rank():
    lengths = [100, 90, 10, 10, 80, 20, 15, 75]
    order = balanced_rank_order(lengths, 2)
    assert sorted(order) == list(range(8))
    first, second = sum(lengths[i] for i in order[:4]), sum(lengths[i] for i in order[4:])
    naive = abs(sum(lengths[:4]) - sum(lengths[4:]))
    assert abs(first - second) < naive and abs(first - second) <= 10


def test_balance_batch_reorders_a_dataproto_and_keeps_rows_whole():
    lengths = [6, 1, 6, 1]
    mask = torch.tensor([[1] * n + [0] * (6 - n) for n in lengths])
    data = DataProto.from_dict(tensors={"attention_mask": mask, "row": torch.arange(4)})
    balanced = balance_batch(data, 2)
    rows = balanced.batch["row"].tolist()
    assert sorted(rows) == [0, 1, 2, 3]
    assert sum(lengths[r] for r in rows[:2]) == sum(lengths[r] for r in rows[2:]) == 7
    assert torch.equal(balanced.batch["attention_mask"], mask[rows])
    assert balance_batch(data, 3) is data and balance_batch(data, 1) is data  # not divisible / one rank


def test_a_minimum_count_of_micro_batches_splits_by_balanced_length():
    """Data-parallel ranks must run as many micro-batches: a rank that needs fewer splits into more."""
    lengths = [5, 5, 7, 7]
    assert len(rearrange_micro_batches(lengths, 10)) == 3  # [7], [7], [5, 5]
    bins = rearrange_micro_batches(lengths, 10, min_num_micro_batches=4)
    assert sorted(bins) == [[0], [1], [2], [3]]
    bins = rearrange_micro_batches([1, 1, 1, 1, 2, 2], 100, [[0, 1], [2, 3], [4, 5]], min_num_micro_batches=3)
    assert sorted(bins) == [[0, 1], [2, 3], [4, 5]]  # whole groups while there are enough of them
    bins = rearrange_micro_batches([1, 1, 1, 1], 100, [[0, 1, 2, 3]], min_num_micro_batches=2)
    assert sorted(i for b in bins for i in b) == [0, 1, 2, 3] and len(bins) == 2  # one group: split
    with pytest.raises(ValueError, match="cannot make 5 non-empty micro-batches of 4 samples"):
        rearrange_micro_batches([1, 1, 1, 1], 100, min_num_micro_batches=5)
