"""Name -> class registries whose built-in entries are imported only when first asked for.

Owns `LazyRegistry`, shared by the rollout engines (`actor_rollout_ref.rollout.name`) and the rollout
workflows (`actor_rollout_ref.rollout.workflow`): built-ins are "module:Class" strings, so choosing `hf` never
imports vLLM; users add their own with the registry's `register(name)` decorator. Layer 1: standard library only.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


class LazyRegistry:
    """`builtins` maps names to "module:Class"; `register(name)` adds a class; `get(name)` returns one.

    `kind` ("rollout engine") and `config_key` ("actor_rollout_ref.rollout.name") only word the errors.
    """

    def __init__(self, kind: str, config_key: str, builtins: dict[str, str]):
        self.kind = kind
        self.config_key = config_key
        self._builtins = dict(builtins)
        self._registered: dict[str, Any] = {}

    def names(self) -> list[str]:
        return sorted(set(self._builtins) | set(self._registered))

    def __contains__(self, name: str) -> bool:
        return name in self._builtins or name in self._registered

    def register(self, name: str) -> Callable[[Any], Any]:
        """Class decorator adding `cls` under `name`; a name taken (built-in or registered) is a ValueError."""

        def decorator(cls: Any) -> Any:
            if name in self:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._registered[name] = cls
            return cls

        return decorator

    def check(self, name: str) -> None:
        """A ValueError listing the known names unless `name` is one; imports nothing (the driver checks the config
        with it, and the built-in classes' modules are for the workers)."""
        if name not in self:
            raise ValueError(f"unknown {self.kind} {name!r} ({self.config_key}); allowed: {self.names()}")

    def get(self, name: str) -> Any:
        """The class registered or built in as `name`; a ValueError listing the known names otherwise."""
        if name in self._registered:
            return self._registered[name]
        self.check(name)
        module_name, class_name = self._builtins[name].split(":")
        return getattr(importlib.import_module(module_name), class_name)
