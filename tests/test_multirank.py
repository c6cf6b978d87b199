"""The 2-rank helper every multi-process test uses: ranks run, a rank's error fails the test, a hang is cut off."""

import os
import time

import pytest
from torch.multiprocessing import ProcessRaisedException

from tests.multirank import run_ranks


def _write_rank(rank: int, world_size: int, port: int, out_dir: str) -> None:
    import torch

    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write(f"{world_size} {port} {torch.__version__} {os.getpid()}")


def _fail_on_rank_1(rank: int, world_size: int, port: int) -> None:
    if rank == 1:
        raise ValueError(f"rank {rank} of {world_size} failed")


def _sleep(rank: int, world_size: int, port: int) -> None:
    time.sleep(60)


def test_every_rank_runs_in_its_own_process(tmp_path):
    run_ranks(_write_rank, 2, 1234, str(tmp_path))
    written = [(tmp_path / f"rank{r}").read_text().split() for r in range(2)]
    assert [w[:2] for w in written] == [["2", "1234"], ["2", "1234"]]
    assert len({w[3] for w in written} | {str(os.getpid())}) == 3


def test_a_rank_that_raises_fails_the_run_with_its_error():
    with pytest.raises(ProcessRaisedException, match="rank 1 of 2 failed"):
        run_ranks(_fail_on_rank_1, 2, 0)


def test_ranks_that_do_not_finish_are_killed_and_fail_the_test():
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="did not finish within 2 s"):
        run_ranks(_sleep, 2, 0, timeout_s=2)
    assert time.monotonic() - start < 10
