"""Start-up checks of the driver-loop keys (verl/trainer/ppo/run_options.py)."""

import pytest
from omegaconf import OmegaConf

from verl.trainer.ppo.run_options import check_run_options


def _config(trainer=None, data=None):
    return OmegaConf.create({"trainer": trainer or {}, "data": {"dataloader_num_workers": 0, **(data or {})}})


def test_verl_defaults_pass_silently(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    defaults = {
        "rollout_data_dir": None,
        "validation_data_dir": None,
        "esi_redundant_time": 0,
        "val_only": False,
        "val_before_train": True,
        "del_local_ckpt_after_load": False,
        "ray_wait_register_center_timeout": 300,
        "max_actor_ckpt_to_keep": None,
        "max_critic_ckpt_to_keep": None,
    }
    assert check_run_options(_config(defaults, {"dataloader_num_workers": 8})) == []


@pytest.mark.parametrize(
    "trainer, data, match",
    [
        ({"rollout_data_dir": 3}, {}, "trainer.rollout_data_dir=3 must be null or a folder"),
        ({"validation_data_dir": [1]}, {}, "trainer.validation_data_dir="),
        ({"esi_redundant_time": -1}, {}, "trainer.esi_redundant_time=-1 must be a number"),
        ({"max_actor_ckpt_to_keep": 1.5}, {}, "trainer.max_actor_ckpt_to_keep=1.5"),
        ({}, {"dataloader_num_workers": -1}, "data.dataloader_num_workers=-1 must be an integer >= 0"),
        ({}, {"dataloader_num_workers": "two"}, "data.dataloader_num_workers='two'"),
    ],
)
def test_bad_values_name_key_and_value(trainer, data, match):
    with pytest.raises(ValueError, match=match):
        check_run_options(_config(trainer, data))


def test_keys_verl_reads_without_acting_get_one_notice_each(capsys, monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    notices = check_run_options(
        _config(
            {"val_only": True, "val_before_train": False, "del_local_ckpt_after_load": True,
             "ray_wait_register_center_timeout": 600},
            {"dataloader_num_workers": 2, "domains": {"math": {"train_files": ["m.parquet"]}}},
        )
    )  # fmt: skip
    assert len(notices) == 4
    out = capsys.readouterr().out
    for text in ("val_only=true acts only with", "del_local_ckpt_after_load=true keeps", "=600 has no effect",
                 "dataloader_num_workers=2 loads validation prompts only"):  # fmt: skip
        assert text in out


def test_more_workers_than_cpus_is_said_once(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    (notice,) = check_run_options(_config({}, {"dataloader_num_workers": 8}))
    assert notice == "data.dataloader_num_workers=8 worker processes per loader on 2 CPUs"
