"""Driver-side checkpoint callback (verl's `trainer.checkpoint_callback_class`): a class named by its dotted path,
built once from the full config and called with `on_save(trainer=..., global_step=..., checkpoint_dir=...,
async_save=False)` after every checkpoint is complete (folder renamed, tracker written, retention applied).

An exception raised by the hook stops training, as in verl: a callback usually does something a checkpoint's
durability depends on (an upload, a registry entry), so a failure must not pass unnoticed.

Layer 8 helper: imports only the standard library.
"""

from __future__ import annotations

import importlib
from typing import Any


class CheckpointCallback:
    """Base class (and the no-op used when the key is null). Subclass it and override `on_save`; accept
    `**kwargs` so that later versions can pass more context."""

    def __init__(self, config: Any = None):
        self.config = config

    def on_save(self, trainer, global_step: int, checkpoint_dir: str, async_save: bool = False, **kwargs) -> None:
        """Called after the checkpoint of `global_step` is complete in `checkpoint_dir` (`global_step_{N}`)."""


def load_class(path: str, key: str) -> type:
    """The class at dotted `path` ("package.module.ClassName"); errors name `key`, the value and the fix."""
    module_name, _, class_name = str(path).rpartition(".")
    if not module_name:
        raise ValueError(f"{key}={path!r} is not a dotted path; give one like 'my_package.my_module.MyClass'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(f"{key}={path!r}: cannot import module {module_name!r} ({err})") from err
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise ValueError(f"{key}={path!r}: module {module_name!r} has no class {class_name!r}")
    return cls


def build_checkpoint_callback(config) -> CheckpointCallback:
    """The callback `config.trainer.checkpoint_callback_class` names, built with `config`; a no-op
    `CheckpointCallback` when the key is null or absent (so callers never check for None)."""
    path = config.trainer.get("checkpoint_callback_class", None)
    if not path:
        return CheckpointCallback(config=config)
    cls = load_class(path, "trainer.checkpoint_callback_class")
    if not callable(getattr(cls, "on_save", None)):
        raise ValueError(
            f"trainer.checkpoint_callback_class={path!r} has no on_save method; subclass "
            "verl.trainer.ppo.checkpoint_callback.CheckpointCallback"
        )
    return cls(config=config)
