"""Write verl's per-component config files (`verl/trainer/config/<group>/<name>.yaml`) from `ppo_trainer.yaml`.

`ppo_trainer.yaml` is the one source of the PPO config; verl 0.9.1 also ships each section as a file of its own
(e.g. `rollout/rollout.yaml`), which code written for verl loads directly. This script cuts those sections out of
`ppo_trainer.yaml`, comments included, and writes them; `tests/trainer/config/test_config_components.py` fails
when a written file differs from what this script makes. Usage: python scripts/generate_config_components.py
"""

from __future__ import annotations

import sys
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parents[1] / "verl" / "trainer" / "config"
# verl's file -> the section of ppo_trainer.yaml it holds
COMPONENTS = {
    "rollout/rollout.yaml": "actor_rollout_ref.rollout",
    "actor/dp_actor.yaml": "actor_rollout_ref.actor",
    "ref/dp_ref.yaml": "actor_rollout_ref.ref",
    "model/hf_model.yaml": "actor_rollout_ref.model",
    "critic/dp_critic.yaml": "critic",
    "data/legacy_data.yaml": "data",
    "algorithm/rollout_correction.yaml": "algorithm.rollout_correction",
}
HEADER = (
    "# Generated from ppo_trainer.yaml (section {section}) by scripts/generate_config_components.py: edit that file.\n"
)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def section_text(text: str, section: str) -> str:
    """The lines of `section` (a dotted path of mappings) in the YAML `text`, dedented, comments kept."""
    lines = text.splitlines()
    start, depth = 0, -2
    for key in section.split("."):
        depth += 2
        for i in range(start, len(lines)):
            if _indent(lines[i]) == depth and lines[i].strip().startswith(f"{key}:"):
                start = i + 1
                break
        else:
            raise KeyError(f"section {section!r}: no key {key!r} at indent {depth}")
    body = []
    for line in lines[start:]:
        if line.strip() and _indent(line) <= depth and not line.lstrip().startswith("#"):
            break
        body.append(line)
    while body and (not body[-1].strip() or _indent(body[-1]) <= depth):  # trailing blanks, next section's comments
        body.pop()
    return "\n".join(line[depth + 2 :] for line in body) + "\n"


def rendered() -> dict[str, str]:
    """Each component file's expected content."""
    text = (CONFIG_DIR / "ppo_trainer.yaml").read_text()
    return {name: HEADER.format(section=section) + section_text(text, section) for name, section in COMPONENTS.items()}


def main() -> int:
    for name, content in rendered().items():
        path = CONFIG_DIR / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(content)
        print(f"wrote {path.relative_to(CONFIG_DIR.parents[2])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
