"""Import tensordict without importing torch._dynamo (`import_tensordict`, called first by `verl/__init__`): its
`torch.compiler` marks are recorded and applied the moment torch._dynamo finishes loading (a `sys.meta_path`
finder), so a process that never compiles does not pay for the compiler frontend. Layer 1: standard library and
torch only.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable

import torch.compiler

_MARKS = ("allow_in_graph", "assume_constant_result")
_pending: list[tuple[str, Callable]] = []  # (mark, function) made before torch._dynamo was loaded
_dynamo_ready = False  # torch._dynamo has finished loading and the pending marks are applied


def _apply_pending_marks(dynamo) -> None:
    global _dynamo_ready
    for mark, fn in _pending:
        getattr(dynamo, mark)(fn)
    _pending.clear()
    _dynamo_ready = True


class _MarkAfterDynamoLoads(importlib.abc.MetaPathFinder):
    """Finds nothing itself: on the first import of torch._dynamo it takes the spec the other finders give and
    runs the pending marks right after the module has executed; then it leaves `sys.meta_path`."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch._dynamo":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _apply_pending_marks(module)

        spec.loader.exec_module = exec_module
        return spec


def _deferred(mark: str, real: Callable) -> Callable:
    def defer(fn):
        if _dynamo_ready:
            return real(fn)
        _pending.append((mark, fn))
        return fn  # both marks return the function they mark

    return defer


def import_tensordict() -> None:
    """Import tensordict, deferring its torch.compile marks until torch._dynamo is loaded (see the module doc)."""
    if "tensordict" in sys.modules or "torch._dynamo" in sys.modules:
        importlib.import_module("tensordict")
        return
    real = {mark: getattr(torch.compiler, mark) for mark in _MARKS}
    sys.meta_path.insert(0, _MarkAfterDynamoLoads())
    for mark in _MARKS:
        setattr(torch.compiler, mark, _deferred(mark, real[mark]))
    try:
        importlib.import_module("tensordict")
    finally:
        for mark in _MARKS:  # tensordict keeps the deferring functions it bound; everyone else gets torch's
            setattr(torch.compiler, mark, real[mark])
