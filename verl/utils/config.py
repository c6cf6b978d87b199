"""`omega_conf_to_dataclass`: a Hydra/OmegaConf section (or a plain dict) into its typed config (verl's name).

The section is resolved (interpolations such as `${oc.select:...}` read the whole config it hangs from), then merged
onto the dataclass's structured schema: an unknown key, a value of the wrong type and a failed `__post_init__` check
all raise one `ValueError` naming the key by its full path (`actor_rollout_ref.actor.ppo_epochs=...`). Keys the
section leaves out take the dataclass's defaults, which are verl's.
"""

from __future__ import annotations

import dataclasses
import importlib
import typing
from dataclasses import fields, is_dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

__all__ = ["omega_conf_to_dataclass", "plain_config", "section_path"]


def section_path(config: Any) -> str:
    """The dotted path of a DictConfig section inside the config it belongs to ('' for a root or a dict)."""
    if isinstance(config, DictConfig) and config._get_parent() is not None:
        return config._get_full_key(None)
    return ""


def plain_config(config: Any) -> dict:
    """A config section (DictConfig, typed config, mapping or None) as a plain resolved dict of its own."""
    if not config:
        return {}
    if is_dataclass(config):
        return dataclasses.asdict(config)
    return OmegaConf.to_container(config, resolve=True) if isinstance(config, DictConfig) else dict(config)


def _import_target(target: Any, where: str) -> type:
    if not isinstance(target, str) or "." not in target:
        raise ValueError(f"{where or 'config'}._target_={target!r}: name the config class as module.Class")
    module, _, name = target.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{where or 'config'}._target_={target!r} cannot be imported: {e}") from e


def omega_conf_to_dataclass(config: DictConfig | dict | Any, dataclass_type: type | None = None) -> Any:
    """`config` as an instance of `dataclass_type` (or of the class its `_target_` names when that is None).

    An empty config gives the dataclass's defaults (None without a type); an object that is not a mapping (already
    typed) is returned as it is.
    """
    if not config:
        return None if dataclass_type is None else dataclass_type()
    if not isinstance(config, (DictConfig, dict)):
        return config
    where = section_path(config)
    data = OmegaConf.to_container(config, resolve=True) if isinstance(config, DictConfig) else dict(config)
    target = dataclass_type or _import_target(data.get("_target_"), where)
    if not is_dataclass(target):
        return target(**{k: v for k, v in data.items() if k != "_target_"})
    prefix = f"{where}." if where else ""
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(target), data))
    except OmegaConfBaseException as e:
        key = f"{prefix}{e.full_key}" if getattr(e, "full_key", None) else where or target.__name__
        value = f"={e.value!r}" if getattr(e, "value", None) is not None else ""
        reason = str(e.msg if hasattr(e, "msg") else e).splitlines()[0]
        raise ValueError(f"{key}{value}: {reason}") from None
    except (ValueError, TypeError, AssertionError) as e:  # a __post_init__ check: in a nested section?
        _raise_from_nested_section(target, data, prefix)
        raise ValueError(f"{prefix}{e}" if prefix else str(e)) from None


def _raise_from_nested_section(target: type, data: dict, prefix: str) -> None:
    """Re-raise the check of the first nested typed section that fails on its own, named by its full path."""
    hints = typing.get_type_hints(target)
    for f in fields(target):
        kind = hints.get(f.name)
        if isinstance(kind, type) and is_dataclass(kind) and isinstance(data.get(f.name), dict):
            try:
                omega_conf_to_dataclass(data[f.name], kind)
            except ValueError as e:
                raise ValueError(f"{prefix}{f.name}.{e}") from None
