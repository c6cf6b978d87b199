"""Tests of `verl.utils.registry.LazyRegistry` through the two registries built on it: rollout engines and
rollout workflows (what a user sees: the class returned, errors that list the allowed names)."""

import sys

import pytest

from verl.utils.registry import LazyRegistry
from verl.workers.rollout import ROLLOUT_REGISTRY, BaseRollout, get_rollout_class, register_rollout


def test_builtin_is_imported_only_when_asked_for():
    registry = LazyRegistry("thing", "a.key", {"ordered": "collections:OrderedDict", "fake": "no_such_module_xyz:X"})
    assert registry.names() == ["fake", "ordered"]
    from collections import OrderedDict

    assert registry.get("ordered") is OrderedDict
    assert "no_such_module_xyz" not in sys.modules  # never imported: nobody asked for "fake"
    with pytest.raises(ModuleNotFoundError):
        registry.get("fake")


def test_unknown_and_duplicate_names_are_errors_naming_the_allowed_ones():
    with pytest.raises(
        ValueError,
        match=r"unknown rollout engine 'trtllm' \(actor_rollout_ref.rollout.name\); "
        r"allowed: \['hf', 'sglang', 'vllm'",
    ):
        get_rollout_class("trtllm")
    with pytest.raises(ValueError, match="rollout engine 'hf' is already registered"):
        register_rollout("hf")(BaseRollout)


def test_registered_engine_is_returned(monkeypatch):
    monkeypatch.setattr(ROLLOUT_REGISTRY, "_registered", {})  # the process-wide registry is left as it was

    @register_rollout("test_registry_engine")
    class MyEngine(BaseRollout):
        pass

    assert get_rollout_class("test_registry_engine") is MyEngine
    assert get_rollout_class("hf").__name__ == "HFRollout"
    with pytest.raises(ValueError, match="'test_registry_engine' is already registered"):
        register_rollout("test_registry_engine")(MyEngine)
