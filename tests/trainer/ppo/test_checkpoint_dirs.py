"""Run-level checkpoint folders: atomic commit, tracker, retention, crash leftovers ignored."""

import os

import pytest

from verl.trainer.ppo import checkpoint as ckpt


def _save(root, step, keep=None, payload="x"):
    staging = ckpt.begin_checkpoint(root, step)
    with open(os.path.join(staging, "weights.txt"), "w") as f:
        f.write(payload)
    return ckpt.commit_checkpoint(root, step, max_to_keep=keep)


def test_commit_makes_complete_folder_and_tracker(tmp_path):
    root = str(tmp_path)
    final = _save(root, 3)
    assert final == os.path.join(root, "global_step_3")
    assert ckpt.is_complete(final)
    assert open(os.path.join(root, ckpt.TRACKER_FILE)).read() == "3"
    assert ckpt.find_latest_checkpoint(root) == final
    assert not os.path.exists(ckpt.staging_dir(root, 3))


def test_half_written_checkpoint_is_never_latest(tmp_path):
    root = str(tmp_path)
    _save(root, 2)
    staging = ckpt.begin_checkpoint(root, 4)  # crash before commit
    with open(os.path.join(staging, "weights.txt"), "w") as f:
        f.write("partial")
    assert ckpt.find_latest_checkpoint(root) == os.path.join(root, "global_step_2")
    # a folder renamed by hand without the marker does not count either
    os.makedirs(os.path.join(root, "global_step_9"))
    assert ckpt.complete_steps(root) == [2]
    assert ckpt.find_latest_checkpoint(root) == os.path.join(root, "global_step_2")


def test_tracker_lagging_behind_rename_still_finds_newest(tmp_path):
    root = str(tmp_path)
    _save(root, 1)
    _save(root, 2)
    with open(os.path.join(root, ckpt.TRACKER_FILE), "w") as f:
        f.write("1")  # crash between the rename and the tracker update
    assert ckpt.find_latest_checkpoint(root) == os.path.join(root, "global_step_2")


def test_retention_keeps_newest_and_only_after_commit(tmp_path):
    root = str(tmp_path)
    for step in (1, 2, 3):
        _save(root, step, keep=2)
    assert ckpt.complete_steps(root) == [2, 3]
    ckpt.begin_checkpoint(root, 4)  # staging a new one deletes nothing
    assert ckpt.complete_steps(root) == [2, 3]


def test_resaving_a_step_replaces_it(tmp_path):
    root = str(tmp_path)
    _save(root, 5, payload="old")
    final = _save(root, 5, payload="new")
    assert open(os.path.join(final, "weights.txt")).read() == "new"
    assert ckpt.complete_steps(root) == [5]


def test_step_of_rejects_bad_names():
    assert ckpt.step_of("/a/b/global_step_12/") == 12
    with pytest.raises(ValueError, match="global_step_<N>"):
        ckpt.step_of("/a/b/latest")


def test_empty_root_has_no_checkpoint(tmp_path):
    assert ckpt.find_latest_checkpoint(str(tmp_path / "missing")) is None
