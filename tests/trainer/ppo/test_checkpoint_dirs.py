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


# ---------------------------------------------------------------- actor / critic retention (verl's max_*_ckpt_to_keep)
def _save_parts(root, step, keep_actor=None, keep_critic=None, critic=True):
    staging = ckpt.begin_checkpoint(root, step)
    for part in ("actor", "critic") if critic else ("actor",):
        os.makedirs(os.path.join(staging, part))
        with open(os.path.join(staging, part, "model.pt"), "w") as f:
            f.write(f"{part}{step}")
    return ckpt.commit_checkpoint(root, step, max_to_keep=keep_actor, max_critic_to_keep=keep_critic)


def _critics(root):
    return [s for s in ckpt.complete_steps(root) if os.path.isdir(os.path.join(ckpt.step_dir(root, s), "critic"))]


def test_critic_limit_prunes_critic_folders_independently(tmp_path):
    root = str(tmp_path)
    for step in range(1, 6):
        _save_parts(root, step, keep_actor=3, keep_critic=1)
        assert _critics(root) == [step]  # the newest folder always keeps its critic
    assert ckpt.complete_steps(root) == [3, 4, 5]
    assert ckpt.find_latest_checkpoint(root) == ckpt.step_dir(root, 5)
    ckpt.check_resumable(ckpt.step_dir(root, 5), need_critic=True)
    for step in (3, 4):  # actor kept, critic gone: resumable only by a run without a critic
        assert os.path.isfile(os.path.join(ckpt.step_dir(root, step), "actor", "model.pt"))
        ckpt.check_resumable(ckpt.step_dir(root, step), need_critic=False)
        with pytest.raises(FileNotFoundError, match="no critic/ folder.*max_critic_ckpt_to_keep"):
            ckpt.check_resumable(ckpt.step_dir(root, step), need_critic=True)
    assert not [n for n in os.listdir(root) if n.startswith(ckpt.DELETING_PREFIX)]


def test_critic_limit_alone_keeps_every_actor_and_larger_critic_limit_is_bounded_by_actor(tmp_path):
    only_critic, both = str(tmp_path / "a"), str(tmp_path / "b")
    for step in range(1, 5):
        _save_parts(only_critic, step, keep_critic=2)
        _save_parts(both, step, keep_actor=2, keep_critic=3)
    assert ckpt.complete_steps(only_critic) == [1, 2, 3, 4] and _critics(only_critic) == [3, 4]
    assert ckpt.complete_steps(both) == [3, 4] and _critics(both) == [3, 4]


def test_null_or_zero_limits_keep_everything(tmp_path):
    root = str(tmp_path)
    for step in (1, 2, 3):
        _save_parts(root, step, keep_actor=0 if step % 2 else None, keep_critic=None if step % 2 else 0)
    assert ckpt.complete_steps(root) == [1, 2, 3] and _critics(root) == [1, 2, 3]


def test_crash_during_pruning_never_leaves_a_half_deleted_part(tmp_path, monkeypatch):
    root = str(tmp_path)
    _save_parts(root, 1)
    _save_parts(root, 2)
    # a crash right after the rename that starts a deletion: the part is gone from its real name, whole elsewhere
    monkeypatch.setattr(ckpt.shutil, "rmtree", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        _save_parts(root, 3, keep_actor=2, keep_critic=1)
    monkeypatch.undo()
    assert ckpt.complete_steps(root) == [2, 3]  # step 1 was renamed away before anything was deleted
    assert ckpt.find_latest_checkpoint(root) == ckpt.step_dir(root, 3)
    ckpt.check_resumable(ckpt.step_dir(root, 3), need_critic=True)
    assert os.path.isdir(os.path.join(root, f"{ckpt.DELETING_PREFIX}global_step_1"))
    _save_parts(root, 4, keep_actor=2, keep_critic=1)  # the next checkpoint clears the leftovers
    assert ckpt.complete_steps(root) == [3, 4] and _critics(root) == [4]
    assert not [n for n in os.listdir(root) if n.startswith(ckpt.DELETING_PREFIX)]


def test_retention_limits_read_like_verl(capsys):
    assert ckpt.retention_limits({}) == (None, None)
    assert ckpt.retention_limits({"max_actor_ckpt_to_keep": 3, "max_critic_ckpt_to_keep": 1}) == (3, 1)
    assert ckpt.retention_limits({"max_actor_ckpt_to_keep": 3, "remove_previous_ckpt_in_save": True}) == (1, 1)
    assert "deprecated" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"trainer.max_critic_ckpt_to_keep='2'.*integer"):
        ckpt.retention_limits({"max_critic_ckpt_to_keep": "2"})


def test_esi_save_due_only_near_expiry_and_with_save_freq(monkeypatch, capsys):
    import time

    for var in (
        "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP",
        "SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP",
    ):
        monkeypatch.delenv(var, raising=False)
    assert not ckpt.should_save_ckpt_esi(100.0)  # no cloud instance: never
    monkeypatch.setenv("MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP", str(time.time() + 200))
    assert ckpt.should_save_ckpt_esi(max_steps_duration=150)  # 200 s left <= 60 (save) + 150 (step)
    assert not ckpt.should_save_ckpt_esi(max_steps_duration=100)
    assert ckpt.should_save_ckpt_esi(max_steps_duration=100, redundant_time=50)  # esi_redundant_time widens it
    assert not ckpt.should_save_ckpt_esi(max_steps_duration=0, redundant_time=500)  # no step timed yet
    assert ckpt.esi_save_due({"save_freq": 5, "esi_redundant_time": 50}, 100.0)
    assert "ESI instance expiration approaching" in capsys.readouterr().out
    assert not ckpt.esi_save_due({"save_freq": -1, "esi_redundant_time": 50}, 100.0)  # verl: only with save_freq > 0
    monkeypatch.setenv("MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP", str(time.time() - 5))
    assert not ckpt.should_save_ckpt_esi(max_steps_duration=100)  # already expired
    monkeypatch.delenv("MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP")
    monkeypatch.setenv("SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP", str(int(time.time()) + 100))
    assert ckpt.should_save_ckpt_esi(max_steps_duration=60) and not ckpt.should_save_ckpt_esi(max_steps_duration=10)


class ProbeGroup:
    """A worker group whose ranks see the driver's file system (`shared`) or a disk of their own."""

    def __init__(self, shared: list[bool]):
        self.shared = shared

    def sees_path(self, path):
        import os

        return [
            {"rank": r, "node": f"10.0.0.{r}", "exists": s and os.path.exists(path)} for r, s in enumerate(self.shared)
        ]


def test_shared_storage_probe_names_the_ranks_that_do_not_see_the_folder(tmp_path):
    from verl.trainer.ppo.checkpoint import SharedStorageError, check_shared_storage

    root = tmp_path / "run"
    saves = {"save_freq": 1, "resume_mode": "auto"}
    check_shared_storage(saves, str(root), [ProbeGroup([True, True]), ProbeGroup([True]), None])
    assert os.listdir(root) == []  # the probe file is gone
    with pytest.raises(
        SharedStorageError,
        match=r"is not shared: a file the driver wrote there on node .* is missing for rank 1 on node 10.0.0.1;",
    ) as err:
        check_shared_storage(saves, str(root), [ProbeGroup([True, False])])
    assert "trainer.default_local_dir must be storage every node shares" in str(err.value)
    assert os.listdir(root) == []
    # a run that neither saves nor resumes does not care
    check_shared_storage({"save_freq": -1, "resume_mode": "disable"}, str(root), [ProbeGroup([False])])


def test_a_step_whose_parts_the_driver_does_not_see_is_not_committed(tmp_path):
    """Rank 1 wrote its shards on a disk of its own: the commit is refused naming the part, the rank, its node and
    the files; the last complete checkpoint stays latest."""
    from verl.trainer.ppo.checkpoint import SharedStorageError, check_parts_visible

    root = str(tmp_path)
    _save(root, 1)
    staging = ckpt.begin_checkpoint(root, 2)
    actor = os.path.join(staging, "actor")
    os.makedirs(actor)
    open(os.path.join(actor, "model_world_size_2_rank_0.pt"), "w").close()
    reports = [
        {"rank": 0, "node": "10.0.0.1 (host a)", "files": ["model_world_size_2_rank_0.pt"]},
        {
            "rank": 1,
            "node": "10.0.0.2 (host b)",
            "files": ["model_world_size_2_rank_1.pt", "optim_world_size_2_rank_1.pt"],
        },
    ]
    with pytest.raises(SharedStorageError) as err:
        check_parts_visible(staging, {"actor": reports}, 2, root)
    message = str(err.value)
    assert "checkpoint of step 2 not committed" in message and "actor rank 1 on node 10.0.0.2 (host b)" in message
    assert "optim_world_size_2_rank_1.pt" in message and "rank 0" not in message
    assert message.endswith(f"stays {ckpt.step_dir(root, 1)}")
    assert ckpt.find_latest_checkpoint(root) == ckpt.step_dir(root, 1)
    check_parts_visible(staging, {"actor": reports[:1]}, 2, root)  # what rank 0 wrote is there
    check_parts_visible(staging, {"actor": [None, None], "critic": None}, 2, root)  # reports nothing: not checked
