"""verl's agent-loop keys in the config: `rollout.multi_turn.*` and `rollout.agent.*` are accepted (values this
project does not implement refused with key, value and reason; keys without effect with a notice), and
`main_ppo` picks the `agent_loop` workflow for `multi_turn.enable`, a non-default `agent` setting or data with an
`agent_name` column, handing it the `data` section."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from verl.trainer.config import CONFIG_YAML, prepare_config
from verl.trainer.main_ppo import _pick_agent_loop_workflow

MT = "actor_rollout_ref.rollout.multi_turn"
AGENT = "actor_rollout_ref.rollout.agent"


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(Path(CONFIG_YAML).parent), version_base=None):
        return compose("ppo_trainer", overrides=list(overrides))


def test_verls_multi_turn_and_agent_keys_are_accepted():
    notices = []
    config = prepare_config(
        _compose(f"{MT}.enable=true", f"{MT}.max_assistant_turns=3", f"{MT}.max_user_turns=2",
                 f"{MT}.max_parallel_calls=2", f"{MT}.tool_config_path=/tools.yaml", f"{MT}.function_tool_path=/f.py",
                 f"{MT}.tool_response_truncate_side=left", f"{MT}.max_tool_response_length=64",
                 f"{AGENT}.default_agent_loop=tool_agent", f"{AGENT}.agent_loop_config_path=/loops.yaml"),
        notify=notices.append,
    )  # fmt: skip
    assert notices == []
    OmegaConf.resolve(config)
    assert config.data.tool_config_path == "/tools.yaml" and config.data.function_tool_path == "/f.py"  # they follow


@pytest.mark.parametrize(
    "override, message",
    [
        (f"{MT}.tool_response_truncate_side=up", f"{MT}.tool_response_truncate_side='up' is not supported: verl's tool "
         "agent loop truncates a tool response on one of these sides; only verl's default 'middle', 'left', 'right'"),
        (f"{AGENT}.custom_async_server.path=/srv.py", f"{AGENT}.custom_async_server.path='/srv.py' is not supported"),
        ("data.tool_config_path=/other.yaml", "data.tool_config_path='/other.yaml' is not supported: verl derives"),
        (f"{MT}.max_assistant_turns=many", f"{MT}.max_assistant_turns='many' has type str; expected int"),
    ],
)  # fmt: skip
def test_what_is_not_implemented_is_refused_naming_key_value_and_reason(override, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        prepare_config(_compose(override))


def test_keys_without_effect_print_a_notice():
    notices = []
    prepare_config(_compose(f"{AGENT}.num_workers=2", f"{MT}.use_inference_chat_template=true"), notify=notices.append)
    assert len(notices) == 2 and all("has no effect here" in n for n in notices)


def _picked(tmp_path, *overrides, columns=None):
    data = tmp_path / "train.parquet"
    pd.DataFrame([{"prompt": [{"role": "user", "content": "hi"}], **(columns or {})}]).to_parquet(data)
    config = _compose(f"data.train_files={data}", "data.return_raw_chat=false", *overrides)
    _pick_agent_loop_workflow(config)
    return config


def test_main_ppo_picks_the_agent_loop_workflow(tmp_path, capsys):
    config = _picked(tmp_path, f"{MT}.enable=true", "+data.apply_chat_template_kwargs.enable_thinking=false")
    rollout = config.actor_rollout_ref.rollout
    assert rollout.workflow == "agent_loop" and config.data.return_raw_chat is True  # verl always keeps the chat
    assert rollout.workflow_kwargs.data_config.apply_chat_template_kwargs == {"enable_thinking": False}
    assert "rollout.workflow=agent_loop (verl's agent loops) for actor_rollout_ref.rollout.multi_turn.enable=true" in (
        capsys.readouterr().err
    )
    assert _picked(tmp_path, columns={"agent_name": "tool_agent"}).actor_rollout_ref.rollout.workflow == "agent_loop"
    assert (
        _picked(tmp_path, f"{AGENT}.default_agent_loop=tool_agent").actor_rollout_ref.rollout.workflow == "agent_loop"
    )
    untouched = _picked(tmp_path)
    assert untouched.actor_rollout_ref.rollout.workflow == "rlvr" and untouched.data.return_raw_chat is False
    with pytest.raises(
        ValueError, match="multi_turn.enable=true runs verl's agent loops .*rollout.workflow='multi_turn_tool'"
    ):
        _picked(tmp_path, f"{MT}.enable=true", "actor_rollout_ref.rollout.workflow=multi_turn_tool")
