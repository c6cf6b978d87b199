"""RepeatSampler (verl/utils/dataset/samplers.py): TRL's index layout, seeded epochs, exact resume."""

import itertools

import pytest
import torch
from torch.utils.data import DataLoader

from verl.utils.dataset.samplers import RepeatSampler, epoch_permutation


def take(sampler, count):
    """The next `count` indices of `sampler`, crossing epoch ends the way a training loop does."""
    out = []
    while len(out) < count:
        out.extend(itertools.islice(iter(sampler), count - len(out)))
    return out


def test_order_without_shuffle_is_trls_layout():
    sampler = RepeatSampler(7, mini_repeat_count=2, batch_size=3, repeat_count=2, shuffle=False)
    # chunks [0,1,2] and [3,4,5]; index 6 is an incomplete chunk and is dropped
    assert list(sampler) == [0, 0, 1, 1, 2, 2] * 2 + [3, 3, 4, 4, 5, 5] * 2
    assert len(sampler) == 24


def test_shuffled_order_repeats_groups_consecutively_after_a_seeded_permutation():
    sampler = RepeatSampler(10, mini_repeat_count=3, batch_size=4, repeat_count=2, shuffle=True, seed=7)
    epoch0 = list(sampler)
    # the permutation of epoch 0, written out independently of the sampler
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(7 * 100003 + 0)).tolist()
    expected = []
    for chunk in (perm[0:4], perm[4:8]):  # perm[8:] is dropped
        expected += [i for i in chunk for _ in range(3)] * 2
    assert epoch0 == expected
    assert perm != list(range(10))  # the shuffle did something, so the comparison above could fail
    # groups: every run of 3 is one index; each kept index appears mini * repeat = 6 times in the epoch
    assert all(len(set(epoch0[i : i + 3])) == 1 for i in range(0, len(epoch0), 3))
    assert sorted(set(epoch0)) == sorted(perm[:8])
    assert all(epoch0.count(i) == 6 for i in perm[:8])


def test_epochs_differ_and_seeds_reproduce():
    a = RepeatSampler(12, mini_repeat_count=2, batch_size=4, seed=3)
    b = RepeatSampler(12, mini_repeat_count=2, batch_size=4, seed=3)
    c = RepeatSampler(12, mini_repeat_count=2, batch_size=4, seed=4)
    a0, a1 = list(a), list(a)
    assert a.epoch == 2 and a0 != a1
    assert list(b) == a0 and list(c) != a0


def test_matches_the_trainers_historic_epoch_order():
    """With no repetition the stream is the old trainer order: randperm seeded by seed * 100003 + epoch."""
    sampler = RepeatSampler(9, batch_size=4, shuffle=True, seed=1)
    for epoch in range(3):
        old = torch.randperm(9, generator=torch.Generator().manual_seed(1 * 100003 + epoch)).tolist()
        assert list(sampler) == old[:8]
        assert epoch_permutation(9, epoch, 1, True) == old
    assert epoch_permutation(5, 0, 1, False) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("stop_after", [1, 5, 24, 30])
def test_resume_mid_epoch_and_across_epochs_is_exact(stop_after):
    settings = dict(mini_repeat_count=2, batch_size=3, repeat_count=2, shuffle=True, seed=11)
    uninterrupted = take(RepeatSampler(8, **settings), 60)
    first = RepeatSampler(8, **settings)
    head = take(first, stop_after)
    resumed = RepeatSampler(8, **settings)
    resumed.load_state_dict(first.state_dict())
    assert head + take(resumed, 60 - stop_after) == uninterrupted


def test_dataloader_batches_hold_whole_groups():
    sampler = RepeatSampler(6, mini_repeat_count=4, batch_size=2, shuffle=True, seed=2)
    loader = DataLoader(list(range(100, 106)), batch_size=8, sampler=sampler)
    batches = [b.tolist() for b in loader]
    assert len(batches) == 3
    for batch in batches:  # 2 prompts x 4 copies, copies adjacent
        assert batch[0:4] == [batch[0]] * 4 and batch[4:8] == [batch[4]] * 4 and batch[0] != batch[4]


def test_bad_settings_and_states_are_rejected():
    with pytest.raises(ValueError, match="mini_repeat_count must be a positive int, got 0"):
        RepeatSampler(4, mini_repeat_count=0)
    with pytest.raises(ValueError, match="batch_size=5 is larger than num_samples=4"):
        RepeatSampler(4, batch_size=5)
    state = RepeatSampler(8, batch_size=2, seed=1).state_dict()
    with pytest.raises(ValueError, match="saved with seed=1 but this RepeatSampler has seed=2"):
        RepeatSampler(8, batch_size=2, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match=r"position=9 is invalid.*\[0, 8\]"):
        RepeatSampler(8, batch_size=2).load_state_dict({"epoch": 0, "position": 9})
    exhausted = RepeatSampler(4, batch_size=2)
    list(itertools.islice(iter(exhausted), 4))
    assert exhausted.state_dict()["epoch"] == 1 and exhausted.state_dict()["position"] == 0
