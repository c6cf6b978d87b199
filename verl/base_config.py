"""`BaseConfig`: the base of every typed config section (verl's `verl.base_config`).

A dataclass that also reads like a mapping (`cfg["key"]`, `cfg.get("key", default)`, `len`, iteration over field
names), so code written for a DictConfig section keeps working when it is handed the typed object. Fields are frozen
once set: assigning an existing field raises `dataclasses.FrozenInstanceError`, unless the class lists it in
`_mutable_fields` (the batch sizes a worker normalises per rank, for example).
"""

from __future__ import annotations

import collections.abc
from dataclasses import FrozenInstanceError, dataclass, fields
from typing import Any

__all__ = ["BaseConfig"]


@dataclass
class BaseConfig(collections.abc.Mapping):
    """Typed config section with a read-only mapping view; `_target_` names the class (as in the YAML)."""

    _mutable_fields = frozenset()
    _target_: str = ""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__ and name not in type(self)._mutable_fields:
            raise FrozenInstanceError(f"{type(self).__name__}.{name} is frozen and cannot be modified")
        super().__setattr__(name, value)

    def get(self, key: str, default: Any = None) -> Any:
        """The field's value, or `default` when there is no such field."""
        return getattr(self, key, default)

    def __getitem__(self, key: str) -> Any:
        if not isinstance(key, str):
            raise TypeError(f"config keys are strings, got {key!r} ({type(key).__name__})")
        return getattr(self, key)  # AttributeError for an unknown key, as verl's

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and any(f.name == key for f in fields(self))

    def __iter__(self):
        return (f.name for f in fields(self))

    def __len__(self) -> int:
        return len(fields(self))
