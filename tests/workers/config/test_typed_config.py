"""verl's typed config: `BaseConfig`, `omega_conf_to_dataclass`, the dataclasses of `verl.workers.config` against
`ppo_trainer.yaml` (every key a field, the same defaults), and the start-up checks that use them."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from verl.base_config import BaseConfig
from verl.trainer.config import CONFIG_YAML, AlgoConfig
from verl.trainer.config.typed import build_typed_config
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import FSDPActorConfig, FSDPOptimizerConfig, PolicyLossConfig, RolloutConfig


def _yaml():
    config = OmegaConf.load(CONFIG_YAML)
    config.actor_rollout_ref.rollout.name = "hf"
    config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 2
    return config


@dataclasses.dataclass
class _Point(BaseConfig):
    _mutable_fields = frozenset({"y"})
    x: int = 1
    y: int = 2


def test_base_config_reads_like_a_mapping_and_freezes_its_fields():
    p = _Point()
    assert p["x"] == 1 and p.get("x") == 1 and p.get("nope", 7) == 7
    assert dict(p) == {"_target_": "", "x": 1, "y": 2} and len(p) == 3 and "x" in p and "nope" not in p
    with pytest.raises(AttributeError):
        p["nope"]
    with pytest.raises(TypeError, match="config keys are strings"):
        p[3]
    with pytest.raises(dataclasses.FrozenInstanceError, match="_Point.x is frozen"):
        p.x = 5
    p.y = 9  # listed as mutable
    assert p.y == 9


def test_conversion_resolves_interpolations_and_fills_defaults():
    config = _yaml()
    config.actor_rollout_ref.rollout.n = 4
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)  # by its _target_
    assert isinstance(actor, FSDPActorConfig) and actor.rollout_n == 4  # ${oc.select:actor_rollout_ref.rollout.n}
    assert isinstance(actor.policy_loss, PolicyLossConfig) and isinstance(actor.optim, FSDPOptimizerConfig)
    assert actor.engine is actor.fsdp_config
    partial = omega_conf_to_dataclass({"lr": 3e-4}, FSDPOptimizerConfig)
    assert partial.lr == 3e-4 and partial.betas == [0.9, 0.999] and partial.weight_decay == 0.01
    assert omega_conf_to_dataclass({}, AlgoConfig) == AlgoConfig() and omega_conf_to_dataclass(None) is None
    assert omega_conf_to_dataclass(partial) is partial  # already typed


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("actor.ppo_epochs", "two", r"actor_rollout_ref\.actor\.ppo_epochs='two': Value 'two' of type 'str' could not"),
        ("actor.policy_loss.bogus", 1, r"actor_rollout_ref\.actor\.policy_loss\.bogus: Key 'bogus' not in"),
        ("actor.loss_agg_mode", "mean", r"actor_rollout_ref\.actor\.loss_agg_mode='mean': one of \['token-mean'"),
        ("actor.optim.lr_scheduler_type", "linear", r"actor_rollout_ref\.actor\.optim\.lr_scheduler_type='linear'"),
        ("rollout.top_p", 1.5, r"actor_rollout_ref\.rollout\.temperature=1\.0, top_p=1\.5"),
        ("ref.log_prob_max_token_len_per_gpu", "x", r"actor_rollout_ref\.ref\.log_prob_max_token_len_per_gpu='x'"),
    ],
)
def test_a_bad_value_fails_at_start_up_naming_the_key(key, value, message):
    config = _yaml()
    OmegaConf.update(config, f"actor_rollout_ref.{key}", value, force_add=True)
    with pytest.raises(ValueError, match=message):
        build_typed_config(config)


def test_algorithm_and_critic_errors_name_their_section():
    config = _yaml()
    config.algorithm.kl_ctrl.type = "pid"
    with pytest.raises(ValueError, match=r"algorithm\.kl_ctrl\.type='pid': the KL controller is fixed or adaptive"):
        build_typed_config(config)
    config = _yaml()
    config.critic.cliprange_value = -1.0
    with pytest.raises(ValueError, match=r"critic\.cliprange_value=-1\.0"):
        build_typed_config(config)


def _literal_leaves(node, path=""):
    """(dotted key, value) of every leaf that is written as a literal (not an interpolation) in the YAML."""
    for key in node.keys():
        child = node._get_node(key)
        full = f"{path}.{key}" if path else str(key)
        if OmegaConf.is_dict(child):
            yield from _literal_leaves(child, full)
        elif not OmegaConf.is_interpolation(node, key) and not OmegaConf.is_missing(node, key):
            yield full, node[key]


@pytest.mark.parametrize(
    "section, cls",
    [
        ("actor_rollout_ref.actor", FSDPActorConfig),
        ("actor_rollout_ref.rollout", RolloutConfig),
        ("algorithm", AlgoConfig),
        ("critic", None),
        ("actor_rollout_ref.model", None),
    ],
)
def test_every_yaml_key_is_a_field_with_the_same_default(section, cls):
    """The dataclasses and ppo_trainer.yaml cannot drift apart: each literal YAML leaf of a typed section (free-form
    dicts aside) is a field whose default equals the YAML's."""
    raw = OmegaConf.select(OmegaConf.load(CONFIG_YAML), section)
    typed = omega_conf_to_dataclass(OmegaConf.select(_yaml(), section))  # fails on a YAML key without a field
    cls = cls or type(typed)
    defaults = OmegaConf.to_container(OmegaConf.structured(cls))
    checked = 0
    for key, value in _literal_leaves(raw):
        parts = key.split(".")
        if parts[-1] == "_target_":
            continue
        node, default = defaults, None
        for part in parts:
            if not isinstance(node, dict) or part not in node:
                break
            node = default = node[part]
        else:
            field_types = {f.name: f.type for f in dataclasses.fields(cls)}
            if "dict" in str(field_types.get(parts[0], "")):
                continue  # free-form mapping: its content is the YAML's
            assert default == value, f"{section}.{key}: dataclass default {default!r} != YAML default {value!r}"
            checked += 1
    assert checked > 5
