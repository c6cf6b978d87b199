"""verl's per-component config files (`verl/trainer/config/rollout/rollout.yaml`, ...) are the sections of
`ppo_trainer.yaml`, written by `scripts/generate_config_components.py`: each file is what the script makes now, and
loads to the same mapping as its section (so code written for verl that loads a component file sees our keys)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from omegaconf import OmegaConf

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "generate_config_components.py"
spec = importlib.util.spec_from_file_location("generate_config_components", SCRIPT)
generator = importlib.util.module_from_spec(spec)
spec.loader.exec_module(generator)


@pytest.mark.parametrize("name", sorted(generator.COMPONENTS))
def test_component_file_is_the_section_of_ppo_trainer_yaml(name):
    path = generator.CONFIG_DIR / name
    assert path.read_text() == generator.rendered()[name], (
        f"{name} is stale: python {SCRIPT.relative_to(SCRIPT.parents[1])}"
    )
    section = OmegaConf.select(OmegaConf.load(generator.CONFIG_DIR / "ppo_trainer.yaml"), generator.COMPONENTS[name])
    assert OmegaConf.to_container(OmegaConf.load(path)) == OmegaConf.to_container(section)


def test_rollout_component_has_the_agent_loop_keys():
    rollout = OmegaConf.load(generator.CONFIG_DIR / "rollout" / "rollout.yaml")
    assert rollout.multi_turn.function_tool_path is None and rollout.agent.default_agent_loop == "single_turn_agent"


def test_a_missing_section_is_named():
    with pytest.raises(KeyError, match="no key 'nope'"):
        generator.section_text("a:\n  b: 1\n", "a.nope")
