"""verl's multi-turn tool RL through `python -m verl.trainer.main_ppo`: the gsm8k_tool_agent example (its tool YAML
of two `BaseTool` subclasses, its parquet rows with `agent_name: tool_agent` and `tools_kwargs`) trains 2 GRPO
steps with verl's config keys (`rollout.multi_turn.enable`, `tool_config_path`, `max_assistant_turns`,
`max_parallel_calls`, `max_tool_response_length`, `tool_response_truncate_side`), colocated and one-step-off async.

The tiny model is first warm-started by the example's `warm_start.py` so that it calls the tools. A reward-manager
plugin (the documented `reward.reward_manager.name` extension point, registered by the custom reward file) records
the batch the trainer scores and trains on; the test checks that every tool-result token in it has response_mask 0
and every model token 1, that the tools ran (the `agent_loop/*` tool metrics) and that the run ends with rc 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.ppo_e2e import grpo_args, run_ppo, step_metrics
from tests.workers.rollout.test_agent_loop_workflow import expected_mask

pytestmark = [pytest.mark.slow, pytest.mark.ray]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gsm8k_tool_agent"
MT = "actor_rollout_ref.rollout.multi_turn"
RECORDER = '''
import json, os

from verl.utils.reward_score import default_compute_score
from verl.workers.reward_manager import REWARD_MANAGER_REGISTRY, NaiveRewardManager


class MaskRecorder(NaiveRewardManager):
    """The naive manager, writing each row's response ids and response_mask to $MASK_RECORD first."""

    def __call__(self, data, return_dict=False):
        width = data.batch["responses"].shape[-1]
        with open(os.environ["MASK_RECORD"], "a") as out:
            for i in range(len(data)):
                n = int(data.batch["attention_mask"][i, -width:].sum())
                row = {"ids": data.batch["responses"][i, :n].tolist(), "mask": data.batch["response_mask"][i, :n].tolist()}
                out.write(json.dumps(row) + "\\n")
        return super().__call__(data, return_dict=return_dict)


REWARD_MANAGER_REGISTRY.setdefault("mask_recorder", MaskRecorder)


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
'''


def _run(args: list[str]) -> None:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def prepared(tiny_model_dir, tmp_path_factory) -> Path:
    """The example's data (4 train rows) and the tiny model warm-started on them by the example's script."""
    out = tmp_path_factory.mktemp("gsm8k_tool_agent")
    _run([str(EXAMPLE / "prepare_data.py"), "--local_dir", str(out / "data"), "--n_train", "4", "--n_test", "2"])
    _run([str(EXAMPLE / "warm_start.py"), "--model", tiny_model_dir, "--data", str(out / "data" / "train.parquet"),
          "--out", str(out / "model"), "--target_loss", "0.1"])  # fmt: skip
    return out


ASYNC = ["trainer.rollout_mode=async", "async_training.max_staleness=1", "trainer.cpus_per_worker=1",
         "trainer.ray_init.num_cpus=2"]  # fmt: skip


@pytest.mark.parametrize("mode", ["sync", "one_step_off_async"])
def test_two_grpo_steps_with_verls_tool_agent_loop(prepared, tmp_path, mode):
    """Colocated (sync), and one-step-off async: the agent loops run in the standalone rollout group, a step ahead
    of the actor, with its weights streamed over between steps."""
    recorder, record, run_dir = tmp_path / "mask_recorder.py", tmp_path / "masks.jsonl", tmp_path / "run"
    recorder.write_text(RECORDER)
    args = grpo_args(str(prepared / "model"), prepared / "data", run_dir,
                     "data.max_prompt_length=160", "data.max_response_length=256", "data.return_raw_chat=true",
                     f"{MT}.enable=true", f"{MT}.tool_config_path={EXAMPLE / 'tool_config.yaml'}",
                     f"{MT}.max_assistant_turns=4", f"{MT}.max_parallel_calls=1", f"{MT}.max_tool_response_length=128",
                     f"{MT}.tool_response_truncate_side=left", "trainer.total_training_steps=2", "trainer.save_freq=-1",
                     f"reward.custom_reward_function.path={recorder}", "reward.custom_reward_function.name=compute_score",
                     "reward.reward_manager.name=mask_recorder", *(ASYNC if mode != "sync" else []))  # fmt: skip
    python_path = os.pathsep.join([str(EXAMPLE), os.environ.get("PYTHONPATH", "")])
    start = time.monotonic()
    proc = run_ppo(args, tmp_path, timeout=600, PYTHONPATH=python_path, MASK_RECORD=str(record))
    print(f"main_ppo wall time: {time.monotonic() - start:.1f} s")
    assert "rollout.workflow=agent_loop (verl's agent loops)" in proc.stderr

    metrics = step_metrics(run_dir)
    assert set(metrics) == {1, 2}
    for step in (1, 2):
        assert "actor/pg_loss" in metrics[step] and "agent_loop/tool_reward/mean" in metrics[step], metrics[step]
        assert metrics[step]["agent_loop/num_tool_calls/mean"] > 0 and metrics[step]["num_turns/max"] >= 4
    if mode != "sync":  # step 2 trained on answers generated by the policy of step 1, ahead of time
        assert [metrics[step]["rollout/staleness/max"] for step in (1, 2)] == [0, 1]

    tokenizer = AutoTokenizer.from_pretrained(prepared / "model")
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(rows) == 2 * 4 * 2  # steps x prompts x samples, every row scored once
    with_tools = 0
    for row in rows:
        assert row["mask"] == expected_mask(tokenizer, row["ids"]), tokenizer.decode(row["ids"])
        with_tools += 0 in row["mask"]
    assert with_tools > 0  # some rows hold tool results, all of them masked
