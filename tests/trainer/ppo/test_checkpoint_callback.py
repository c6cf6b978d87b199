"""trainer.checkpoint_callback_class: a class named by dotted path, built from the config, called after each save."""

import pytest
from omegaconf import OmegaConf

from verl.trainer.ppo.checkpoint_callback import CheckpointCallback, build_checkpoint_callback

CALLS = []


class RecordingCallback(CheckpointCallback):
    def on_save(self, trainer, global_step, checkpoint_dir, async_save=False, **kwargs):
        CALLS.append((self.config.trainer.project_name, trainer, global_step, checkpoint_dir, async_save))


class NotACallback:
    def __init__(self, config=None):
        pass


def _config(path):
    return OmegaConf.create({"trainer": {"project_name": "p", "checkpoint_callback_class": path}})


def test_null_gives_a_no_op_and_a_dotted_path_is_built_with_the_config():
    assert type(build_checkpoint_callback(_config(None))) is CheckpointCallback
    build_checkpoint_callback(_config(None)).on_save(trainer=None, global_step=1, checkpoint_dir="x")
    callback = build_checkpoint_callback(_config(f"{__name__}.RecordingCallback"))
    assert isinstance(callback, RecordingCallback)
    callback.on_save(trainer="t", global_step=4, checkpoint_dir="/run/global_step_4")
    assert CALLS[-1] == ("p", "t", 4, "/run/global_step_4", False)


@pytest.mark.parametrize(
    "path, error, match",
    [
        ("NoDots", ValueError, "not a dotted path"),
        ("no_such_module_xyz.Cls", ImportError, "cannot import module 'no_such_module_xyz'"),
        (f"{__name__}.Missing", ValueError, "has no class 'Missing'"),
        (f"{__name__}.NotACallback", ValueError, "has no on_save method"),
    ],
)
def test_bad_paths_fail_at_start_up_naming_the_key(path, error, match):
    with pytest.raises(error, match=f"trainer.checkpoint_callback_class=.*{match}"):
        build_checkpoint_callback(_config(path))
