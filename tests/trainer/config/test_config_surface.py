"""The whole verl 0.9.1 `ppo_trainer` config surface: every key at verl's default, refused features named,
types checked, unknown keys rejected, legacy keys converted as verl does.

tests/fixtures/verl_0_9_1_ppo_trainer_defaults.json lists verl 0.9.1's 898 keys and their defaults, read from
the wheel's `_generated_ppo_trainer.yaml` (`pip download verl==0.9.1 --no-deps`).
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from verl.trainer.config import CONFIG_YAML, check_config, migrate_legacy_keys, prepare_config
from verl.trainer.config.key_policy import ALSO_ALLOWED, NO_EFFECT, REFUSED

VERL_DEFAULTS = json.loads((Path(__file__).parents[2] / "fixtures" / "verl_0_9_1_ppo_trainer_defaults.json").read_text())


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(Path(CONFIG_YAML).parent), version_base=None):
        return compose("ppo_trainer", overrides=list(overrides))


def _raw(config, path):
    node = config
    for part in path.split("."):
        node = node._get_node(part)
    return OmegaConf.to_container(node, resolve=False) if OmegaConf.is_config(node) else node._value()


def test_every_verl_key_composes_at_verls_default():
    config = _compose()
    wrong = {k: (_raw(config, k), v) for k, v in VERL_DEFAULTS.items() if _raw(config, k) != v}
    assert not wrong, wrong
    check_config(config)  # verl's defaults pass the start-up checks


def _other_value(default):
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 3
    if isinstance(default, float):
        return default + 0.5
    if isinstance(default, str):
        return "an_other_value"
    if isinstance(default, list):
        return [*default, "an_other_value"]
    if isinstance(default, dict):
        return {"an_other_key": 1}
    return 7  # a null default


def _refused_keys():
    """Each pattern of `REFUSED` with the first verl key it matches, and that key's (resolved) default."""
    resolved = OmegaConf.create(OmegaConf.to_container(OmegaConf.load(CONFIG_YAML), resolve=True))
    keys = []
    for patterns in REFUSED.values():
        for pattern in patterns:
            derived = [k for k in VERL_DEFAULTS if isinstance(VERL_DEFAULTS[k], str) and VERL_DEFAULTS[k].startswith("${")]
            path = next((k for k in VERL_DEFAULTS if fnmatch.fnmatchcase(k, pattern) and k not in derived), None)
            if path is not None:
                default = OmegaConf.select(resolved, path, throw_on_missing=False)
                keys.append((path, OmegaConf.to_container(default) if OmegaConf.is_config(default) else default))
    return keys


REFUSED_KEYS = _refused_keys()


def test_the_refused_set_is_large_and_every_refusal_names_its_key():
    matched = [k for k in VERL_DEFAULTS if any(fnmatch.fnmatchcase(k, p) for ps in REFUSED.values() for p in ps)]
    assert len(matched) > 300  # profilers, Megatron, Ulysses, QAT, multi-modal, ... (verl has 898 keys)
    assert len(REFUSED_KEYS) > 150  # every pattern matches a verl key; one key per pattern is tried
    failures = []
    base = OmegaConf.load(CONFIG_YAML)
    for path, default in REFUSED_KEYS:
        value = _other_value(default)
        if value in ALSO_ALLOWED.get(path, ()):
            continue
        config = base.copy()
        OmegaConf.update(config, path, value, force_add=True, merge=False)
        try:
            check_config(config, notify=lambda _msg: None)
            failures.append((path, "accepted"))
        except ValueError as err:
            if not str(err).startswith(f"{path}") or "not supported" not in str(err):
                failures.append((path, str(err)))
    assert not failures, failures[:10]


def test_refusal_and_notice_messages_on_the_command_line():
    with pytest.raises(ValueError, match=r"actor_rollout_ref.actor.ulysses_sequence_parallel_size=2 is not supported: "
                                         r"Ulysses sequence parallelism .*only verl's default 1"):  # fmt: skip
        prepare_config(_compose("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"))
    with pytest.raises(ValueError, match="actor_rollout_ref.actor.strategy='megatron' is not supported"):
        prepare_config(_compose("actor_rollout_ref.actor.strategy=megatron"))
    with pytest.raises(ValueError, match="actor_rollout_ref.rollout.mode='sync' is not supported: verl 0.9.1 removed"):
        prepare_config(_compose("actor_rollout_ref.rollout.mode=sync"))
    prepare_config(_compose("actor_rollout_ref.actor.strategy=fsdp2"))  # both FSDP spellings run FSDP2
    notices = []
    prepare_config(_compose("actor_rollout_ref.actor.use_torch_compile=false"), notify=notices.append)
    assert notices == [
        "actor_rollout_ref.actor.use_torch_compile=False has no effect here: " + next(
            reason for reason, keys in NO_EFFECT.items() if "actor_rollout_ref.actor.use_torch_compile" in keys)
    ]  # fmt: skip


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.train_batch_size=eight", "data.train_batch_size='eight' has type str; expected int"),
        ("actor_rollout_ref.actor.use_kl_loss=3", "actor_rollout_ref.actor.use_kl_loss=3 has type int; expected bool"),
        ("actor_rollout_ref.actor.optim.lr=fast", "actor_rollout_ref.actor.optim.lr='fast' has type str; expected float"),
        ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2.5", "ppo_micro_batch_size_per_gpu=2.5 has type float"),
        ("+trainer.no_such_key=1", "trainer.no_such_key is not a config key of verl 0.9.1"),
    ],
)
def test_types_and_unknown_keys_fail_with_the_keys_name(override, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        prepare_config(_compose(override))


def test_float_keys_written_as_int_defaults_take_floats():
    # verl types these float; its YAML writes the default as 0 (ReMax/ToolRL scripts pass 1.0 or -0.03)
    config = prepare_config(
        _compose("actor_rollout_ref.rollout.val_kwargs.temperature=0.7", "actor_rollout_ref.actor.entropy_coeff=-0.03")
    )
    assert config.actor_rollout_ref.rollout.val_kwargs.temperature == 0.7
    assert config.actor_rollout_ref.actor.entropy_coeff == -0.03
    with pytest.raises(ValueError, match="val_kwargs.temperature='hot' has type str; expected int or float"):
        prepare_config(_compose("actor_rollout_ref.rollout.val_kwargs.temperature=hot"))


def test_free_form_mappings_take_new_keys():
    prepare_config(_compose("+actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4", "+data.apply_chat_template_kwargs.enable_thinking=false"))  # fmt: skip


def test_legacy_keys_convert_as_verl_did():
    notices = []
    config = _compose(
        "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size=8",
        "critic.ppo_micro_batch_size=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size=6",
        "actor_rollout_ref.actor.fsdp_config.grad_offload=true",
        "critic.model.fsdp_config.param_offload=true",
        "reward_model.enable=true",
        "reward_model.model.path=/rm",
        "reward_model.reward_manager=dapo",
        "custom_reward_function.path=/r.py",
        "sandbox_fusion.url=http://127.0.0.1:1/run_code",
        "actor_rollout_ref.actor.optim.warmup_style=cosine",
        "trainer.logger=console",
        "trainer.ray_init.num_cpus=3",
    )
    prepare_config(config, notify=notices.append)
    OmegaConf.resolve(config)
    assert config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 4  # 8 // 2 workers, as verl's workers do
    assert config.critic.ppo_micro_batch_size_per_gpu == 4 and config.critic.forward_micro_batch_size_per_gpu == 4
    assert config.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu == 3
    assert config.critic.fsdp.param_offload is True and "fsdp_config" not in config.critic.model
    assert "grad_offload" not in config.actor_rollout_ref.actor.fsdp_config
    assert config.reward.reward_model.enable is True and config.reward.reward_model.model_path == "/rm"
    assert config.reward.reward_manager.name == "dapo" and config.reward.custom_reward_function.path == "/r.py"
    assert config.reward.sandbox_fusion.url == "http://127.0.0.1:1/run_code"
    assert config.actor_rollout_ref.actor.optim.lr_scheduler_type == "cosine"
    assert list(config.trainer.logger) == ["console"] and config.ray_kwargs.ray_init.num_cpus == 3
    assert any("grad_offload" in n for n in notices) and any("reward_model.enable is deprecated" in n for n in notices)
    with pytest.raises(ValueError, match="both actor_rollout_ref.actor.ppo_micro_batch_size=8 and"):
        migrate_legacy_keys(_compose("actor_rollout_ref.actor.ppo_micro_batch_size=8",
                                     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"), 1, lambda _m: None)  # fmt: skip


def test_a_resolved_config_keeps_derived_values_and_still_refuses_a_changed_one():
    """After `OmegaConf.resolve` a derived key holds a value, not its interpolation: the check accepts it when it
    is what the interpolation gives in this config, for several keys in one pass, and refuses one set apart."""
    config = _compose("trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.n=4")
    OmegaConf.resolve(config)
    assert config.actor_rollout_ref.rollout.n_gpus_per_node == 1 and config.actor_rollout_ref.ref.rollout_n == 4
    check_config(config)  # every derived value follows its source key
    check_config(config)  # and the check left the config as it was
    assert config.actor_rollout_ref.actor.rollout_n == 4
    config.actor_rollout_ref.rollout.n_gpus_per_node = 2
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.rollout\.n_gpus_per_node=2 is not supported"):
        check_config(config)


def test_keys_of_older_verl_launch_scripts_are_honoured_or_said_to_have_no_effect():
    notices = []
    config = prepare_config(
        _compose(
            "reward_model.use_reward_loop=True",
            "trainer.use_legacy_worker_impl=disable",
            "reward_model.sandbox_fusion.url=http://127.0.0.1:1/run_code",
            "reward_model.sandbox_fusion.max_concurrent=32",
            "reward_model.model.use_remove_padding=True",
            "reward_model.model.fsdp_config.param_offload=True",
            "actor_rollout_ref.nccl_timeout=1200",
        ),
        notify=notices.append,
    )
    assert config.reward.sandbox_fusion.url == "http://127.0.0.1:1/run_code"
    assert config.reward.sandbox_fusion.max_concurrent == 32
    said = sorted(n.split("=")[0] for n in notices if "has no effect here" in n)
    assert said == ["actor_rollout_ref.nccl_timeout", "reward_model.model.fsdp_config.param_offload",
                    "reward_model.model.use_remove_padding", "trainer.use_legacy_worker_impl"]  # fmt: skip
    notices.clear()
    prepare_config(_compose("reward_model.use_reward_loop=False"), notify=notices.append)
    assert notices == ["reward_model.use_reward_loop=False has no effect here: " + next(
        reason for reason, keys in NO_EFFECT.items() if "reward_model.use_reward_loop" in keys)]  # fmt: skip
    with pytest.raises(ValueError, match="trainer.use_legacy_worker_impl='sometimes' is not supported: verl's worker"):
        prepare_config(_compose("trainer.use_legacy_worker_impl=sometimes"))
    with pytest.raises(ValueError, match="actor_rollout_ref.hybrid_engine=False is not supported: verl 0.9.1's PPO"):
        prepare_config(_compose("actor_rollout_ref.hybrid_engine=false"))


def test_gen_batch_size_is_the_dataloader_batch_or_dapos_generation_round():
    notices = []
    config = prepare_config(_compose("data.train_batch_size=8", "data.gen_batch_size=12"), notify=notices.append)
    assert config.data.train_batch_size == 12  # verl trains each step on its dataloader's gen_batch_size prompts
    assert any(n.startswith("data.gen_batch_size=12 without algorithm.filter_groups.enable") for n in notices)
    dapo = prepare_config(_compose("data.train_batch_size=8", "data.gen_batch_size=24",
                                   "algorithm.filter_groups.enable=true"))  # fmt: skip
    assert dapo.data.train_batch_size == 8 and dapo.data.gen_batch_size == 24  # read by the dynamic sampler
    with pytest.raises(ValueError, match=r"data.gen_batch_size=0 must be a positive integer \(null = data.train_"):
        prepare_config(_compose("data.gen_batch_size=0"))
