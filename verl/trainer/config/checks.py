"""Start-up checks of the PPO config against `ppo_trainer.yaml`: types, unknown keys, refused features.

Owns `check_config(config)`, called by `main_ppo` after `migrate_legacy_keys` and before anything starts:
- every leaf must have the type of its default in `ppo_trainer.yaml` (bool, int, float, str, list, dict; a float
  key takes an int; a null default takes the type in `NULLABLE_TYPES` or anything), else ValueError naming it;
- a key the YAML does not have (added with Hydra's `+key=...`) is refused unless it sits under a free-form
  mapping (a default of `{}` or null, e.g. `override_config`, `engine_kwargs`, `data.domains`);
- keys of features this project does not implement (`key_policy.REFUSED`) accept verl's default only; keys
  without effect here (`key_policy.NO_EFFECT`) print one notice when set to another value;
- the FSDP sections' `dtype` and `mixed_precision` {param_dtype, reduce_dtype, buffer_dtype} must name dtypes
  (`verl.utils.mixed_precision`).
The YAML holds verl 0.9.1's defaults, so "the default" is verl's. Must not import torch, Ray or worker code.
"""

from __future__ import annotations

import fnmatch
import os
import sys
from functools import lru_cache
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from verl.trainer.config.key_policy import ALSO_ALLOWED, FSDP, NO_EFFECT, REFUSED
from verl.utils.mixed_precision import resolve_mixed_precision

CONFIG_YAML = os.path.join(os.path.dirname(__file__), "ppo_trainer.yaml")
_MISSING = object()

# Types of keys whose default is null (anything else with a null default takes any value).
NULLABLE_TYPES: dict[str, tuple[type, ...]] = {
    "*.ppo_micro_batch_size": (int,),
    "*.ppo_micro_batch_size_per_gpu": (int,),
    "*.log_prob_micro_batch_size": (int,),
    "*.log_prob_micro_batch_size_per_gpu": (int,),
    "*.forward_micro_batch_size": (int,),
    "*.forward_micro_batch_size_per_gpu": (int,),
    "data.seed": (int,),
    "data.gen_batch_size": (int,),
    "data.val_batch_size": (int,),
    "data.train_files": (str, list),
    "data.val_files": (str, list),
    "trainer.total_training_steps": (int,),
    "trainer.max_actor_ckpt_to_keep": (int,),
    "trainer.max_critic_ckpt_to_keep": (int,),
    "trainer.resume_from_path": (str,),
    "critic.enable": (bool,),
    "reward.timeout_s": (int, float),
    "reward.reward_model.model_path": (str,),
    "*sandbox_fusion.url": (str,),
    "*sandbox_fusion.max_concurrent": (int,),
    "*sandbox_fusion.memory_limit_mb": (int,),
    "actor_rollout_ref.rollout.max_model_len": (int,),
    "actor_rollout_ref.actor.policy_loss.dro_beta": (float,),
    "ray_kwargs.ray_init.num_cpus": (int,),
    "trainer.ray_init.num_cpus": (int,),
    "trainer.cpus_per_worker": (int,),
    "algorithm.rollout_correction.rollout_is": (str,),
    "algorithm.rollout_correction.rollout_rs": (str,),
    "algorithm.rollout_correction.rollout_rs_threshold": (str, float),
    "*.fsdp_config.mixed_precision": (dict,),
    "critic.fsdp.mixed_precision": (dict,),
    "algorithm.gdpo_reward_keys": (list,),
    "algorithm.gdpo_reward_weights": (list,),
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": (int,),
    "actor_rollout_ref.rollout.multi_turn.max_user_turns": (int,),
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": (str,),
    "actor_rollout_ref.rollout.multi_turn.function_tool_path": (str,),
    "actor_rollout_ref.rollout.agent.agent_loop_config_path": (str,),
}
# Keys that take a second type besides their default's (verl accepts both forms). The float ones: verl's
# dataclass types them float while the YAML default is written as an int (0 or 1).
EXTRA_TYPES: dict[str, tuple[type, ...]] = {
    "actor_rollout_ref.actor.entropy_coeff": (float,),
    "actor_rollout_ref.rollout.over_sample_rate": (float,),
    "actor_rollout_ref.rollout.val_kwargs.temperature": (float,),
    "reward.reward_model.rollout.top_p": (float,),
    "trainer.logger": (str,),
    "data.train_files": (str, list),
    "data.val_files": (str, list),
    "actor_rollout_ref.model.target_modules": (list,),
    "actor_rollout_ref.rollout.top_p": (float,),
    "algorithm.filter_groups.metric": (str,),
    "algorithm.rollout_correction.rollout_is_threshold": (str,),  # "lower_upper" (IcePop) besides a number
}


@lru_cache(maxsize=1)
def default_config() -> DictConfig:
    """`ppo_trainer.yaml` as shipped (verl's defaults plus this project's extension keys), unresolved."""
    return OmegaConf.load(CONFIG_YAML)


def _walk(node: DictConfig, prefix: str = ""):
    """(path, child node) for every leaf of `node`; an empty mapping counts as a leaf."""
    for key in node.keys():
        path = f"{prefix}.{key}" if prefix else str(key)
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing() and len(child):
            yield from _walk(child, path)
        else:
            yield path, child


def _lookup(table: dict[str, Any], path: str) -> Any:
    for pattern, value in table.items():
        if fnmatch.fnmatchcase(path, pattern):
            return value
    return None


def _policy(table: dict[str, list[str]], path: str) -> str | None:
    for reason, patterns in table.items():
        if any(fnmatch.fnmatchcase(path, p) for p in patterns):
            return reason
    return None


def _node_at(config: DictConfig, path: str) -> Any:
    node: Any = config
    for part in path.split("."):
        child = node._get_node(part) if isinstance(node, DictConfig) and not node._is_none() else None
        if child is None:
            return _MISSING
        node = child
    return node


def _plain(node: Any) -> Any:
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True)
    return node._value() if hasattr(node, "_value") else node


def _value(node: Any) -> Any:
    """The resolved value of a leaf node (a container for list/dict nodes)."""
    if isinstance(node, (DictConfig, ListConfig)):
        return None if node._is_none() else OmegaConf.to_container(node, resolve=True)
    resolved = node._dereference_node() if node._is_interpolation() else node
    return None if resolved is None else resolved._value()


def _same_interpolation(node: Any, default: Any) -> bool:
    return (
        not isinstance(node, (DictConfig, ListConfig))
        and node._is_interpolation()
        and default._is_interpolation()
        and node._value() == default._value()
    )


class _InterpolationProbe:
    """Whether a resolved value is what the key's default interpolation gives in this config: one unresolved copy of
    the config (made on first use) in which the key is set back to its interpolation, read, then restored; a copy
    per key would be slow on verl's full config."""

    def __init__(self, config: DictConfig):
        self.config, self.copy = config, None

    def follows(self, path: str, default: Any, value: Any) -> bool:
        if self.copy is None:
            self.copy = OmegaConf.create(OmegaConf.to_container(self.config, resolve=False))
        parent_path, _, key = path.rpartition(".")
        parent = OmegaConf.select(self.copy, parent_path) if parent_path else self.copy
        original = OmegaConf.to_container(parent, resolve=False)[key]
        OmegaConf.update(self.copy, path, default._value(), force_add=True)
        try:
            return _value(_node_at(self.copy, path)) == value
        except Exception:  # an interpolation that does not resolve in this config
            return False
        finally:
            OmegaConf.update(self.copy, path, original, merge=False, force_add=True)


def _type_ok(value: Any, allowed: tuple[type, ...]) -> bool:
    if value is None:
        return True
    for t in allowed:
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if t in (bool, str, list, dict) and isinstance(value, t):
            return True
    return False


def _types_of(default_value: Any) -> tuple[type, ...]:
    for t in (bool, int, float, str, list, dict):
        if isinstance(default_value, t):
            return (t,)
    return ()


def _free_form_ancestor(defaults: DictConfig, path: str) -> str | None:
    """The nearest ancestor of `path` present in the defaults when it is a free-form mapping ({} or null) or an
    interpolation (a resolved copy of the section it is derived from, checked there); None otherwise."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        ancestor = ".".join(parts[:i])
        node = _node_at(defaults, ancestor)
        if node is _MISSING:
            continue
        if not isinstance(node, (DictConfig, ListConfig)) and node._is_interpolation():
            return ancestor
        free = (isinstance(node, DictConfig) and (node._is_none() or len(node) == 0)) or _value(node) is None
        return ancestor if free else None
    return None


def check_config(config: DictConfig, notify=None) -> None:
    """Raise ValueError (one line) for a bad type, an unknown key or a refused feature; print notices."""
    notify = notify or (lambda msg: print(f"notice: {msg}", file=sys.stderr))
    defaults = default_config()
    probe = _InterpolationProbe(config)
    for path, node in _walk(config):
        default = _node_at(defaults, path)
        if default is _MISSING:
            ancestor = _free_form_ancestor(defaults, path)
            if ancestor is None:
                raise ValueError(
                    f"{path} is not a config key of verl 0.9.1 nor of this project (added with '+'?); "
                    "see verl/trainer/config/ppo_trainer.yaml for the keys"
                )
            reason = _policy(REFUSED, ancestor)
            if reason and not _node_at(defaults, ancestor)._is_interpolation():
                raise ValueError(
                    f"{ancestor}.{path[len(ancestor) + 1 :]}={_value(node)!r} is not supported: {reason}; only "
                    f"verl's default {_value(_node_at(defaults, ancestor))!r} of {ancestor} is accepted"
                )
            continue
        if _same_interpolation(node, default):
            continue  # still follows the key it is derived from, which is checked itself
        value, default_value = _value(node), _value(default)
        _check_type(path, value, default_value)
        if value == default_value or (isinstance(value, str) and str(default_value) == value):
            continue
        reason = _policy(REFUSED, path)
        if reason and default._is_interpolation() and probe.follows(path, default, value):
            continue  # a resolved config: the value is what verl derives from the other key
        if reason and value not in ALSO_ALLOWED.get(path, ()):
            others = "".join(f", {v!r}" for v in ALSO_ALLOWED.get(path, ()) if v != default_value)
            raise ValueError(
                f"{path}={value!r} is not supported: {reason}; only verl's default {default_value!r}{others} is accepted"
            )
        reason = _policy(NO_EFFECT, path)
        if reason:
            notify(f"{path}={value!r} has no effect here: {reason}")
    for section in FSDP:  # dtype names of `dtype` / `mixed_precision` (verl.utils.mixed_precision)
        resolve_mixed_precision(OmegaConf.select(config, section), section)


def _check_type(path: str, value: Any, default_value: Any) -> None:
    allowed = _types_of(default_value) if default_value is not None else _lookup(NULLABLE_TYPES, path)
    if not allowed:
        return
    allowed = tuple(allowed) + tuple(_lookup(EXTRA_TYPES, path) or ())
    if not _type_ok(value, allowed):
        names = " or ".join(t.__name__ for t in allowed)
        raise ValueError(f"{path}={value!r} has type {type(value).__name__}; expected {names}")


def default_of(path: str) -> Any:
    """verl's (the YAML's) default of `path`, resolved; KeyError for an unknown path."""
    node = _node_at(default_config(), path)
    if node is _MISSING:
        raise KeyError(path)
    return _plain(node) if not node._is_interpolation() else OmegaConf.select(default_config(), path)
