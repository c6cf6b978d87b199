"""Token-budget batching and length balancing: which samples go into which micro-batch or to which rank.

Owns `get_seqlen_balanced_partitions` (split items into k groups of near-equal total length, optionally of
equal size), `rearrange_micro_batches` (dynamic batch size: micro-batches of at most `max_token_len` tokens,
first-fit decreasing) and `balanced_rank_order` (a row order that gives each data-parallel rank an equal
number of rows and a near-equal number of tokens), applied to a DataProto by `balance_batch`. The functions
take plain lengths and return index lists; they never touch tensors' contents. Layer 1 (see docs/architecture.md#layers): imports nothing of the package.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

__all__ = ["balance_batch", "balanced_rank_order", "get_seqlen_balanced_partitions", "rearrange_micro_batches"]


def _check_lengths(seqlens: Sequence[int]) -> list[int]:
    lengths = [int(n) for n in seqlens]
    bad = [n for n in lengths if n < 0]
    if bad:
        raise ValueError(f"sequence lengths must be >= 0, got {bad[:5]}")
    return lengths


def get_seqlen_balanced_partitions(seqlens: Sequence[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """Split item indices into `k_partitions` lists whose summed lengths are as equal as the greedy rule gets.

    Longest-processing-time rule: items in decreasing length go to the partition with the smallest sum so far
    (among those not yet full when `equal_size`, which needs len(seqlens) % k_partitions == 0). The largest
    sum is at most 4/3 of the optimum. Each returned list is sorted by index.
    """
    lengths = _check_lengths(seqlens)
    if k_partitions < 1:
        raise ValueError(f"k_partitions must be >= 1, got {k_partitions}")
    if len(lengths) < k_partitions:
        raise ValueError(f"cannot split {len(lengths)} items into {k_partitions} non-empty partitions")
    if equal_size and len(lengths) % k_partitions != 0:
        raise ValueError(f"equal_size needs the item count ({len(lengths)}) divisible by k_partitions ({k_partitions})")
    capacity = len(lengths) // k_partitions if equal_size else len(lengths)
    partitions: list[list[int]] = [[] for _ in range(k_partitions)]
    heap = [(0, p) for p in range(k_partitions)]  # (sum, partition); full partitions leave the heap
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    for i in order:
        total, p = heapq.heappop(heap)
        partitions[p].append(i)
        if len(partitions[p]) < capacity:
            heapq.heappush(heap, (total + lengths[i], p))
    return [sorted(p) for p in partitions]


def rearrange_micro_batches(
    seqlens: Sequence[int],
    max_token_len: int,
    groups: Sequence[Sequence[int]] | None = None,
    min_num_micro_batches: int = 1,
) -> list[list[int]]:
    """Micro-batches (lists of item indices) of at most `max_token_len` summed length: dynamic batch size.

    First-fit decreasing bin packing. With `groups` (lists of indices that must stay together, e.g. the
    samples sharing one prompt) a group is packed as one unit of its summed length. A unit longer than the
    budget gets a micro-batch of its own (a group is then split sample by sample). When that gives fewer
    than `min_num_micro_batches` (data-parallel ranks must all run the same number, FSDP's collectives
    pair up forward by forward), the units are split into exactly that many length-balanced micro-batches
    instead (groups are split only if there are fewer groups than micro-batches). Each micro-batch is sorted
    by index; every index appears exactly once.
    """
    lengths = _check_lengths(seqlens)
    if max_token_len is None or int(max_token_len) <= 0:
        raise ValueError(f"max_token_len must be a positive int (tokens per micro-batch), got {max_token_len!r}")
    budget = int(max_token_len)
    units = [list(g) for g in groups] if groups is not None else [[i] for i in range(len(lengths))]
    seen = sorted(i for unit in units for i in unit)
    if seen != list(range(len(lengths))):
        raise ValueError("groups must hold every index 0..len(seqlens)-1 exactly once")
    split_units = []
    for unit in units:  # a group over the budget is packed sample by sample
        if len(unit) > 1 and sum(lengths[i] for i in unit) > budget:
            split_units.extend([i] for i in unit)
        else:
            split_units.append(unit)
    split_units.sort(key=lambda unit: (-sum(lengths[i] for i in unit), unit[0]))
    bins: list[list[int]] = []
    loads: list[int] = []
    for unit in split_units:
        size = sum(lengths[i] for i in unit)
        for b, load in enumerate(loads):
            if load + size <= budget:
                bins[b].extend(unit)
                loads[b] += size
                break
        else:
            bins.append(list(unit))
            loads.append(size)
    if len(bins) < min_num_micro_batches:
        if min_num_micro_batches > len(lengths):
            raise ValueError(f"cannot make {min_num_micro_batches} non-empty micro-batches of {len(lengths)} samples")
        if len(split_units) < min_num_micro_batches:
            split_units = [[i] for i in range(len(lengths))]
        unit_lengths = [sum(lengths[i] for i in unit) for unit in split_units]
        parts = get_seqlen_balanced_partitions(unit_lengths, min_num_micro_batches, equal_size=False)
        bins = [[i for u in part for i in split_units[u]] for part in parts]
    return [sorted(b) for b in bins]


def balanced_rank_order(seqlens: Sequence[int], world_size: int) -> list[int]:
    """A permutation of the rows such that cutting it into `world_size` equal consecutive chunks (what the
    dispatch does) gives every rank a near-equal number of tokens. Needs len(seqlens) % world_size == 0."""
    partitions = get_seqlen_balanced_partitions(seqlens, world_size, equal_size=True)
    return [i for partition in partitions for i in partition]


def balance_batch(batch: Any, world_size: int) -> Any:
    """`batch` (a DataProto) reordered by `balanced_rank_order` of its rows' real token counts
    (`attention_mask` sums), or unchanged when its length is not a multiple of `world_size` (the dispatch
    pads such batches) or there is one rank."""
    if world_size <= 1 or len(batch) % world_size != 0:
        return batch
    order = balanced_rank_order(batch.batch["attention_mask"].sum(-1).tolist(), world_size)
    return batch[order]
