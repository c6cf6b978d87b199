"""Importing user modules named in the config: verl's `model.external_lib` (a module that registers a custom model
architecture with transformers' Auto classes, imported before the model is built).

Owns `import_external_libs(external_libs, key)`. Layer 1: importlib only.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["import_external_libs"]


def import_external_libs(external_libs: Any = None, key: str | None = None) -> None:
    """Import each module named by `external_libs` (None, one module name or a list of them), as verl does.

    A module that fails to import raises ImportError naming the config key `key` (when given), the module and
    the cause."""
    if external_libs is None:
        return
    names = [external_libs] if isinstance(external_libs, str) else list(external_libs)
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as err:
            where = f"{key}={name!r}" if key else f"module {name!r}"
            raise ImportError(f"{where}: the module cannot be imported ({type(err).__name__}: {err})") from err
