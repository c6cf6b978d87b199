"""data.dataloader_num_workers: prompts load through a torch DataLoader with that many worker processes, and the
batches (and their order, and where a resume continues) are those of loading in the driver."""

import os

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from verl.utils.dataset.prompt_loader import check_num_workers, iter_train_batches, load_batches
from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn


class IndexDataset(Dataset):
    """Item i: its index as a tensor, and the pid of the process that read it."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"input_ids": torch.tensor([i, i * i]), "index": i, "pid": os.getpid()}


def _take(iterator, k):
    out = []
    for epoch, b, batch in iterator:
        out.append((epoch, b, batch["index"].tolist(), batch["input_ids"][:, 0].tolist(), set(batch["pid"])))
        if len(out) == k:
            iterator.close()
            return out


@pytest.mark.parametrize("shuffle", [True, False])
def test_two_workers_give_the_driver_batches_across_epochs_and_after_a_resume(shuffle):
    data = IndexDataset(11)  # 11 // 3 = 3 batches an epoch, 2 prompts dropped
    kwargs = dict(shuffle=shuffle, seed=7)
    in_driver = _take(iter_train_batches(data, collate_fn, 3, num_workers=0, **kwargs), 8)
    in_workers = _take(iter_train_batches(data, collate_fn, 3, num_workers=2, **kwargs), 8)
    assert [row[:4] for row in in_driver] == [row[:4] for row in in_workers]
    assert [(e, b) for e, b, *_ in in_driver] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1)]
    assert all(row[2] == row[3] for row in in_driver)  # the collated tensors are the indices' rows
    assert in_driver[0][2] != in_driver[3][2] if shuffle else in_driver[0][2] == in_driver[3][2]
    assert {os.getpid()} == set().union(*(row[4] for row in in_driver))
    assert os.getpid() not in set().union(*(row[4] for row in in_workers))  # read in worker processes
    # a run that used batches (0, 0) and (0, 1) saved (epoch 0, batch 2): it resumes with the same batches
    resumed = _take(iter_train_batches(data, collate_fn, 3, epoch=0, batch_in_epoch=2, num_workers=2, **kwargs), 6)
    assert [row[:4] for row in resumed] == [row[:4] for row in in_driver[2:]]
    # a resume at an epoch's end goes on with the next epoch
    at_end = _take(iter_train_batches(data, collate_fn, 3, epoch=1, batch_in_epoch=3, num_workers=2, **kwargs), 1)
    assert at_end[0][:4] == in_driver[6][:4]


def test_load_batches_keeps_the_given_order_with_workers():
    data = IndexDataset(10)
    chunks = [[9, 0, 4], [1], [5, 5, 2, 8]]
    for workers in (0, 2, 8):
        got = [batch["index"].tolist() for batch in load_batches(data, chunks, collate_fn, workers)]
        assert got == chunks
    assert list(load_batches(data, [], collate_fn, 2)) == []


def test_rlhf_dataset_items_are_identical_from_workers(tokenizer, write_parquet):
    rows = [
        {
            "prompt": [{"role": "user", "content": f"question {i} " * (i + 1)}],
            "data_source": "s",
            "extra_info": {"index": i},
        }
        for i in range(6)
    ]
    dataset = RLHFDataset(write_parquet(rows), tokenizer, {"max_prompt_length": 64})
    chunks = [[3, 1], [0, 5, 2], [4]]
    driver = list(load_batches(dataset, chunks, collate_fn, 0))
    workers = list(load_batches(dataset, chunks, collate_fn, 2))
    for a, b in zip(driver, workers, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            if isinstance(a[key], torch.Tensor):
                assert torch.equal(a[key], b[key])
            else:
                assert a[key].dtype == b[key].dtype == np.dtype(object) and a[key].tolist() == b[key].tolist()
    assert [batch["index"].tolist() for batch in workers] == chunks


def test_num_workers_must_be_a_non_negative_int():
    assert check_num_workers(0) == 0 and check_num_workers(8) == 8
    for bad in (-1, 1.5, True, "2", None):
        with pytest.raises(ValueError, match="data.dataloader_num_workers=.* must be an integer >= 0"):
            check_num_workers(bad)
