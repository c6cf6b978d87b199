"""Registry of reward managers by name: `@register_reward_manager(name)` and `get_reward_manager_cls(name)`.

Owns only the name -> class table (verl's extension point for reward managers). Layer 4: imports nothing
from verl.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["REWARD_MANAGER_REGISTRY", "get_reward_manager_cls", "register_reward_manager"]

REWARD_MANAGER_REGISTRY: dict[str, type] = {}


def register_reward_manager(name: str) -> Callable[[type], type]:
    """Class decorator: make the reward manager available as `reward_model.reward_manager=<name>`."""

    def decorator(cls: type) -> type:
        existing = REWARD_MANAGER_REGISTRY.get(name)
        if existing is not None and existing is not cls:
            raise ValueError(
                f"reward manager name {name!r} is already registered to {existing.__module__}.{existing.__qualname__}"
            )
        REWARD_MANAGER_REGISTRY[name] = cls
        return cls

    return decorator


def get_reward_manager_cls(name: str) -> type:
    """The class registered as `name`; ValueError listing the registered names otherwise."""
    if name not in REWARD_MANAGER_REGISTRY:
        raise ValueError(
            f"unknown reward manager {name!r}; registered: {sorted(REWARD_MANAGER_REGISTRY)} "
            "(register your own with @register_reward_manager(name) from verl.workers.reward_manager)"
        )
    return REWARD_MANAGER_REGISTRY[name]
