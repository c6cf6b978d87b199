"""Prompt-index samplers for RL training: TRL's `RepeatSampler`, seeded per epoch and resumable.

Owns `ResumableSampler` (RandomSampler's orders with a saved place), `RepeatSampler` (its subclass) and
`epoch_permutation`, the seeded order of one epoch. The trainer draws its prompt
batches from a `RepeatSampler` (`RayPPOTrainer._train_batches`), so the data order has one definition here.
Layer 4 (docs/architecture.md#layers): imports torch only; never Ray or trainer code.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch.utils.data import Sampler

__all__ = ["RepeatSampler", "ResumableSampler", "epoch_permutation"]


def epoch_permutation(num_samples: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """The order of `range(num_samples)` in `epoch`: a permutation seeded by (seed, epoch), or the identity.

    Depending only on (seed, epoch) makes any epoch reproducible on its own, which is what lets a resumed run
    see the same order as an uninterrupted one.
    """
    if not shuffle:
        return list(range(num_samples))
    generator = torch.Generator().manual_seed(int(seed) * 100003 + int(epoch))
    return torch.randperm(num_samples, generator=generator).tolist()


class ResumableSampler(Sampler[int]):
    """Sequential or seeded-shuffled indices whose place (epoch, position) can be saved and restored exactly.

    With `shuffle=True` the orders are exactly those `RandomSampler(dataset, generator=g)` yields over
    successive epochs for a generator `g` seeded once with `seed` (torch 2.x draws two `randperm` per epoch;
    a test checks the match). Epoch e is recomputed from the seed, so (epoch, position) is the whole state.
    Each `__iter__` call continues the current epoch from `position`; running to the end moves to the next
    epoch. `position` counts indices handed out, so with `DataLoader(num_workers=0)` it equals (batches
    consumed) x batch_size; with worker prefetching it runs ahead of what was consumed.

    Subclasses change only `_epoch_order` (every index one epoch emits) and `_settings` (what the order
    depends on, checked when a state is loaded); iteration and save/restore live here once.
    """

    def __init__(self, num_samples: int, shuffle: bool = True, seed: int = 1):
        if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 1:
            raise ValueError(f"{type(self).__name__} num_samples must be a positive int, got {num_samples!r}")
        self.num_samples = num_samples
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0
        self._cached_epoch: int | None = None
        self._cached_order: list[int] = []

    def __len__(self) -> int:
        return self.num_samples

    def _epoch_order(self, epoch: int) -> list[int]:
        """RandomSampler's order in `epoch` (replaying the draws of earlier epochs), or the identity."""
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator().manual_seed(self.seed)
        # Each RandomSampler epoch draws its permutation and then a second one for the (empty) tail
        # `randperm(n)[: num_samples % n]`.
        for _ in range(2 * epoch):
            torch.randperm(self.num_samples, generator=generator)
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def _settings(self) -> dict:
        return {"num_samples": self.num_samples, "seed": self.seed, "shuffle": self.shuffle}

    def epoch_indices(self, epoch: int) -> list[int]:
        """Every index `epoch` emits, in order (`len(self)` of them); the last epoch asked for is cached."""
        if self._cached_epoch != epoch:
            self._cached_order, self._cached_epoch = self._epoch_order(epoch), epoch
        return self._cached_order

    def __iter__(self) -> Iterator[int]:
        indices = self.epoch_indices(self.epoch)
        while self.position < len(indices):
            index = indices[self.position]
            self.position += 1
            yield index
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> dict:
        """`{"epoch", "position"}` plus the settings the order depends on (checked on load)."""
        epoch, position = self.epoch, self.position
        if position >= len(self):  # an exhausted epoch reads as the start of the next one
            epoch, position = epoch + 1, 0
        return {"epoch": epoch, "position": position, **self._settings()}

    def load_state_dict(self, state: Mapping) -> None:
        """Continue from a `state_dict()` (or a plain `{"epoch", "position"}`); the settings must match."""
        for key, value in self._settings().items():
            if key in state and state[key] != value:
                raise ValueError(
                    f"sampler state was saved with {key}={state[key]!r} but this {type(self).__name__} has "
                    f"{key}={value!r}; resume with the same data files and data/sampler settings"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self):
            raise ValueError(
                f"sampler state epoch={epoch}, position={position} is invalid: need epoch >= 0 and a position "
                f"in [0, {len(self)}]"
            )
        self.epoch, self.position = epoch, position


class RepeatSampler(ResumableSampler):
    """Dataset indices in TRL's `RepeatSampler` layout, epoch after epoch, with a resumable position.

    Each epoch takes `epoch_permutation(num_samples, epoch, seed, shuffle)`, cuts it into chunks of
    `batch_size` indices (an incomplete last chunk is dropped), and emits every chunk `repeat_count` times in a
    row, each index of the chunk `mini_repeat_count` times consecutively. For example, with 7 samples,
    batch_size=3, mini_repeat_count=2, repeat_count=2 and the epoch order [4, 3, 0, 1, 2, 6, 5]:

        4 4 3 3 0 0  4 4 3 3 0 0  1 1 2 2 6 6  1 1 2 2 6 6        (5 is dropped)

    `mini_repeat_count` is the group size (TRL's num_generations, verl's rollout.n): a group's copies stay
    adjacent. `repeat_count` reuses one batch of prompts for several iterations or accumulation steps (TRL:
    num_iterations * steps_per_generation).

    Iteration continues the current epoch from `position` (the number of indices of this epoch already
    handed out) and, once the epoch is exhausted, moves on to the next one; each `iter()` covers the rest of
    one epoch. `state_dict()`/`load_state_dict()` save and restore (epoch, position) exactly (`ResumableSampler`).
    """

    def __init__(
        self,
        num_samples: int,
        mini_repeat_count: int = 1,
        batch_size: int = 1,
        repeat_count: int = 1,
        shuffle: bool = True,
        seed: int = 1,
    ):
        for name, value in (
            ("num_samples", num_samples),
            ("mini_repeat_count", mini_repeat_count),
            ("batch_size", batch_size),
            ("repeat_count", repeat_count),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"RepeatSampler {name} must be a positive int, got {value!r}")
        if batch_size > num_samples:
            raise ValueError(
                f"RepeatSampler batch_size={batch_size} is larger than num_samples={num_samples}: every epoch "
                f"would be empty"
            )
        super().__init__(num_samples, shuffle=shuffle, seed=seed)
        self.mini_repeat_count = mini_repeat_count
        self.batch_size = batch_size
        self.repeat_count = repeat_count

    def __len__(self) -> int:
        """Indices in one epoch: complete chunks only, each index repeated."""
        complete = (self.num_samples // self.batch_size) * self.batch_size
        return complete * self.mini_repeat_count * self.repeat_count

    def _epoch_order(self, epoch: int) -> list[int]:
        order = epoch_permutation(self.num_samples, epoch, self.seed, self.shuffle)
        out: list[int] = []
        for start in range(0, len(order) - self.batch_size + 1, self.batch_size):
            chunk = order[start : start + self.batch_size]
            for _ in range(self.repeat_count):
                for index in chunk:
                    out.extend([index] * self.mini_repeat_count)
        return out

    def _settings(self) -> dict:
        return {
            **super()._settings(),
            "mini_repeat_count": self.mini_repeat_count,
            "batch_size": self.batch_size,
            "repeat_count": self.repeat_count,
        }
