"""Loading prompt batches through a torch DataLoader (verl's `data.dataloader_num_workers`), in an order fixed
before loading, so worker processes change only where items are read and tokenised, never which batches come.

Owns `load_batches` (given row lists -> collated batches, in order; used for validation) and
`iter_train_batches` (the training order of `RepeatSampler`, from a saved (epoch, batch) place on). The place a
resume continues from is the batch the trainer last *used*, never how far the workers prefetched, so a resume gives
the same batches with any number of workers (StatefulDataLoader is not needed).

Layer 4 (docs/architecture.md#layers): torch and the samplers only; never Ray or trainer code.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence

from torch.utils.data import DataLoader, Dataset

from verl.utils.dataset.samplers import RepeatSampler

__all__ = ["check_num_workers", "iter_train_batches", "load_batches"]


def check_num_workers(value) -> int:
    """`data.dataloader_num_workers` as an int >= 0 (0: items load in the calling process)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"data.dataloader_num_workers={value!r} must be an integer >= 0 (0 = load prompts in the driver process)"
        )
    return value


def load_batches(
    dataset: Dataset, batches: Sequence[Sequence[int]], collate_fn: Callable[[list], dict], num_workers: int
) -> Iterator[dict]:
    """`collate_fn([dataset[i] for i in rows])` for each `rows` of `batches`, in order. With `num_workers` > 0 the
    items are read in that many worker processes (at most one per batch), which prefetch ahead of the caller."""
    batches = [list(rows) for rows in batches]
    if not batches:
        return
    with warnings.catch_warnings():  # torch warns at every loader when workers > CPUs; run_options says it once
        warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
        loader = DataLoader(
            dataset,
            batch_sampler=batches,
            collate_fn=collate_fn,
            num_workers=min(check_num_workers(num_workers), len(batches)),
        )
        iterator = iter(loader)
    try:
        yield from iterator
    finally:  # a caller that stops early (or is closed) shuts the workers down now, not at garbage collection
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


def iter_train_batches(
    dataset: Dataset,
    collate_fn: Callable[[list], dict],
    batch_size: int,
    *,
    shuffle: bool,
    seed: int,
    epoch: int = 0,
    batch_in_epoch: int = 0,
    num_workers: int = 0,
) -> Iterator[tuple[int, int, dict]]:
    """Yield `(epoch, batch index in the epoch, collated batch)` forever, from batch `batch_in_epoch` of `epoch` on.

    Each epoch's order is `RepeatSampler(len(dataset), batch_size=batch_size, shuffle=shuffle, seed=seed)`'s (seeded
    by seed and epoch; an incomplete last batch dropped). A run saves `(epoch, index + 1)` of the last batch it used
    and passes them back here to resume; one DataLoader serves each epoch.
    """
    sampler = RepeatSampler(len(dataset), batch_size=batch_size, shuffle=shuffle, seed=seed)
    sampler.load_state_dict({"epoch": epoch, "position": batch_in_epoch * batch_size})
    while True:
        epoch, first = sampler.epoch, sampler.position // batch_size
        rows = list(sampler)  # the rest of this epoch
        chunks = [rows[b * batch_size : (b + 1) * batch_size] for b in range(len(rows) // batch_size)]
        for b, batch in enumerate(load_batches(dataset, chunks, collate_fn, num_workers)):
            yield epoch, first + b, batch
