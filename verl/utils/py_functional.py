"""Small pure-Python helpers shared across the package, with verl's names and behaviour.

Owns: dict helpers (`union_two_dict`, `rename_dict`, `append_to_dict`, `list_of_dict_to_dict_of_list`),
`DynamicEnum` (an enum whose members can be registered at run time: the dispatch and execute modes),
`NestedNamespace`, `temp_env_var`, `timeout_limit` and the converters `convert_to_regular_types` /
`convert_nested_value_to_list_recursive`. Layer 1 (docs/architecture.md#layers): imports only the standard library, numpy and
`verl.utils.metric` (for `append_to_dict`'s `Metric` lists); no torch models, no Ray.
"""

from __future__ import annotations

import functools
import importlib
import math
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import numpy as np

from verl.utils.metric import Metric

__all__ = [
    "DynamicEnum",
    "DynamicEnumMeta",
    "NestedNamespace",
    "append_to_dict",
    "convert_nested_value_to_list_recursive",
    "convert_to_regular_types",
    "list_of_dict_to_dict_of_list",
    "rename_dict",
    "temp_env_var",
    "timeout_limit",
    "deep_equal",
    "union_numpy_dict",
    "union_two_dict",
]


def union_two_dict(dict1: dict, dict2: dict) -> dict:
    """Add dict2's items to dict1 in place and return dict1; a key in both must hold equal values
    (AssertionError otherwise, as in verl)."""
    for key, val in dict2.items():
        if key in dict1:
            assert dict2[key] == dict1[key], f"{key} in meta_dict1 and meta_dict2 are not the same object"
        dict1[key] = val
    return dict1


def deep_equal(a: Any, b: Any, visited: set[int] | None = None) -> bool:
    """Equality of nested values of the same types: NaN equals NaN, numpy arrays compared element by element
    (object arrays recursively), self-referencing structures tolerated."""
    visited = set() if visited is None else visited
    if type(a) is not type(b):
        return False
    if id(a) in visited:
        return True
    visited.add(id(a))
    try:
        if isinstance(a, float) and math.isnan(a) and math.isnan(b):
            return True
        if isinstance(a, np.ndarray):
            if a.dtype != b.dtype or a.shape != b.shape:
                return False
            if a.dtype != object:
                return bool(np.array_equal(a, b, equal_nan=True))
            return all(deep_equal(x, y, visited) for x, y in zip(a.flat, b.flat))
        result = a == b
        return bool(result.all()) if hasattr(result, "all") else bool(result)
    finally:
        visited.discard(id(a))


def union_numpy_dict(tensor_dict1: dict[str, np.ndarray], tensor_dict2: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Add dict2's arrays to dict1 in place and return dict1; a key in both must hold equal arrays (`deep_equal`,
    AssertionError otherwise, as in verl)."""
    for key, val in tensor_dict2.items():
        if key in tensor_dict1:
            assert isinstance(val, np.ndarray) and isinstance(tensor_dict1[key], np.ndarray), f"`{key}` is not an array"
            assert deep_equal(tensor_dict1[key], val), (
                f"`{key}` in tensor_dict1 and tensor_dict2 are not the same object."
            )
        tensor_dict1[key] = val
    return tensor_dict1


def rename_dict(data: dict, prefix: str = "") -> dict:
    """A copy of `data` whose keys all start with `prefix` (keys that already do are kept)."""
    return {(key if key.startswith(prefix) else f"{prefix}{key}"): val for key, val in data.items()}


def append_to_dict(data: dict, new_data: dict, prefix: str = "") -> None:
    """Append each value of `new_data` to the list under the same (prefixed) key of `data`, in place.

    A list value is extended rather than appended. A `Metric` value starts a `Metric` of the same aggregation
    (instead of a list), so `reduce_metrics` later aggregates it by that rule (e.g. SUM over micro-batches).
    """
    for key, val in new_data.items():
        new_key = key if key.startswith(prefix) else f"{prefix}{key}"
        if new_key not in data:
            data[new_key] = val.init_list() if isinstance(val, Metric) else []
        if isinstance(val, list):
            data[new_key].extend(val)
        else:
            data[new_key].append(val)


def list_of_dict_to_dict_of_list(list_of_dict: list[dict]) -> dict[str, list]:
    """`[{k: v0}, {k: v1}]` -> `{k: [v0, v1]}`; every dict must only use keys of the first one."""
    if not list_of_dict:
        return {}
    output: dict[str, list] = {key: [] for key in list_of_dict[0]}
    for item in list_of_dict:
        for key, val in item.items():
            assert key in output, f"Key '{key}' is not present in the keys of the first dictionary in the list."
            output[key].append(val)
    return output


class NestedNamespace(SimpleNamespace):
    """A SimpleNamespace built from a dict, nested dicts becoming nested namespaces (`ns.a.b`)."""

    def __init__(self, dictionary: dict, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for key, value in dictionary.items():
            setattr(self, key, NestedNamespace(value) if isinstance(value, dict) else value)


class DynamicEnumMeta(type):
    """Iteration, `in`, `[name]`, `names()` and `values()` over a `DynamicEnum`'s registered members."""

    def __iter__(cls) -> Iterator[Any]:
        return iter(cls._registry.values())

    def __contains__(cls, item: Any) -> bool:
        if isinstance(item, str):
            return item in cls._registry
        return item in cls._registry.values()

    def __getitem__(cls, name: str) -> Any:
        return cls._registry[name]

    def __reduce_ex__(cls, protocol: int) -> Any:
        return getattr, (importlib.import_module(cls.__module__), cls.__name__)

    def names(cls) -> list[str]:
        return list(cls._registry.keys())

    def values(cls) -> list[Any]:
        return list(cls._registry.values())


class DynamicEnum(metaclass=DynamicEnumMeta):
    """An enum whose members are added with `register(name)` (upper-cased) and become class attributes.

    Subclasses must define their own `_registry = {}` and `_next_value = 0`. Members pickle by name, so a
    member sent to another process is that process's member of the same name.
    """

    _registry: dict[str, DynamicEnum] = {}
    _next_value: int = 0

    def __init__(self, name: str, value: int) -> None:
        self.name = name
        self.value = value

    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self.name}: {self.value}>"

    def __reduce_ex__(self, protocol: int) -> Any:
        enum_cls = getattr(importlib.import_module(type(self).__module__), type(self).__name__)
        return getattr, (enum_cls, self.name)

    @classmethod
    def register(cls, name: str) -> DynamicEnum:
        """Add member `name.upper()`; ValueError if it exists."""
        key = name.upper()
        if key in cls._registry:
            raise ValueError(f"{key} already registered")
        member = cls(key, cls._next_value)
        cls._registry[key] = member
        setattr(cls, key, member)
        cls._next_value += 1
        return member

    @classmethod
    def remove(cls, name: str) -> DynamicEnum:
        key = name.upper()
        member = cls._registry.pop(key)
        delattr(cls, key)
        return member

    @classmethod
    def from_name(cls, name: str) -> DynamicEnum | None:
        return cls._registry.get(name.upper())


@contextmanager
def temp_env_var(key: str, value: str) -> Iterator[None]:
    """Set environment variable `key` to `value` inside the block; restore (or remove) it afterwards."""
    original = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if original is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = original


def timeout_limit(seconds: float, use_signals: bool = False) -> Callable[[Callable], Callable]:
    """Decorator: the call raises TimeoutError when it runs longer than `seconds`.

    The call runs in a daemon thread that is abandoned (not killed) on timeout. `use_signals` is accepted for
    verl compatibility; signals work only in the main thread, so a thread is used either way.
    """

    def decorator(func: Callable) -> Callable:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result: dict[str, Any] = {}

            def target() -> None:
                try:
                    result["value"] = func(*args, **kwargs)
                except BaseException as err:  # re-raised in the caller's thread
                    result["error"] = err

            thread = threading.Thread(target=target, daemon=True)
            thread.start()
            thread.join(seconds)
            if thread.is_alive():
                raise TimeoutError(f"Function {func.__name__} timed out after {seconds} seconds")
            if "error" in result:
                raise result["error"]
            return result.get("value")

        return wrapper

    return decorator


def convert_to_regular_types(obj: Any) -> Any:
    """OmegaConf DictConfig/ListConfig (also nested in lists, tuples, dicts) to plain dicts and lists."""
    from omegaconf import DictConfig, ListConfig

    if isinstance(obj, DictConfig):
        return {k: convert_to_regular_types(v) for k, v in obj.items()}
    if isinstance(obj, ListConfig):
        return list(obj)
    if isinstance(obj, (list, tuple)):
        return [convert_to_regular_types(x) for x in obj]
    if isinstance(obj, dict):
        return {k: convert_to_regular_types(v) for k, v in obj.items()}
    return obj


def convert_nested_value_to_list_recursive(data_item: Any) -> Any:
    """numpy arrays (also nested in dicts and lists) to Python lists."""
    if isinstance(data_item, dict):
        return {k: convert_nested_value_to_list_recursive(v) for k, v in data_item.items()}
    if isinstance(data_item, list):
        return [convert_nested_value_to_list_recursive(elem) for elem in data_item]
    if isinstance(data_item, np.ndarray):
        return convert_nested_value_to_list_recursive(data_item.tolist())
    return data_item
