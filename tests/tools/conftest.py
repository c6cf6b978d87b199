"""Fixtures of the verl.tools tests: the process-wide function-tool registry restored around every test, and
a scratch directory on sys.path for tool modules a test writes (removed from sys.modules afterwards)."""

import sys

import pytest

from verl.tools import function_tool as function_tool_mod


@pytest.fixture(autouse=True)
def _restore_function_tool_registry():
    registry = dict(function_tool_mod.FUNCTION_TOOL_REGISTRY)
    loaded = dict(function_tool_mod._LOADED_FUNCTION_TOOL_PATHS)
    function_tool_mod.FUNCTION_TOOL_REGISTRY.clear()
    function_tool_mod._LOADED_FUNCTION_TOOL_PATHS.clear()
    yield
    function_tool_mod.FUNCTION_TOOL_REGISTRY.clear()
    function_tool_mod.FUNCTION_TOOL_REGISTRY.update(registry)
    function_tool_mod._LOADED_FUNCTION_TOOL_PATHS.clear()
    function_tool_mod._LOADED_FUNCTION_TOOL_PATHS.update(loaded)


@pytest.fixture
def module_dir(tmp_path, monkeypatch):
    """`write(name, source)` puts module `name` in a directory on sys.path; the module is forgotten after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written = []

    def write(name: str, source: str):
        (tmp_path / f"{name}.py").write_text(source)
        written.append(name)
        return tmp_path / f"{name}.py"

    yield write
    for name in written:
        sys.modules.pop(name, None)
