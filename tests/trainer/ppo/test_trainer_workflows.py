"""The trainer's side of rollout workflows (`RayPPOTrainer._rollout_and_score` in verl/trainer/ppo/ray_trainer.py),
run in process on the tiny model: the worker group is replaced by what the worker's `generate_sequences` does
(`rollout_batch` with the configured workflow, no Ray). Checks the rejected-sample rule (rejected rows and
groups left with one row are dropped, with metrics), that rows scored by a workflow are not re-scored, and
where the ReMax baseline comes from (the trainer's greedy pass per uid, or the `remax` workflow)."""

import os

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

import verl
from tests.cpu_overrides import CPU_OVERRIDES, cpu_config
from verl.protocol import DataProto
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.utils.torch_functional import compute_position_id_with_mask
from verl.workers.rollout.hf_rollout import HFRollout
from verl.workers.rollout.workflows import build_workflow, rollout_batch
from verl.workers.rollout.workflows.rlvr import RLVRWorkflow

CONFIG_YAML = os.path.join(os.path.dirname(verl.__file__), "trainer", "config", "ppo_trainer.yaml")
TEXTS = ["How many apples?", "Hi", "Convert 5 dollars to euro please"]


class RejectSome(RLVRWorkflow):
    """Rejects both samples of a row marked "all" and the first sample of a row marked "first"."""

    def __init__(self, config, tokenizer):
        super().__init__(config, tokenizer)
        self.seen = set()

    async def arun_episode(self, engine, data):
        mark, uid = data.non_tensor_batch["extra_info"][0]["reject"], data.non_tensor_batch["uid"][0]
        first = uid not in self.seen
        self.seen.add(uid)
        if mark == "all" or (mark == "first" and first):
            return None
        return await super().arun_episode(engine, data)


class LocalGroup:
    """The worker's `generate_sequences` with a workflow, without Ray: counts its calls."""

    def __init__(self, rollout, workflow):
        self.rollout, self.workflow, self.calls = rollout, workflow, 0

    def generate_sequences(self, data):
        self.calls += 1
        return rollout_batch(self.rollout, data, self.workflow)


def length_reward(data, return_dict=False):
    """A reward manager: the number of response tokens, at the last one."""
    mask = data.batch["response_mask"]
    scores = torch.zeros(mask.shape)
    scores[torch.arange(len(mask)), mask.sum(-1) - 1] = mask.sum(-1).float()
    return {"reward_tensor": scores, "reward_extra_info": {}} if return_dict else scores


@pytest.fixture(scope="module")
def parts(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return tokenizer, model


def make_trainer(parts, workflow_factory, adv_estimator="grpo", **rollout_overrides):
    tokenizer, model = parts
    config = cpu_config()
    config.algorithm.adv_estimator = adv_estimator
    rollout_cfg = config.actor_rollout_ref.rollout
    rollout_cfg.n, rollout_cfg.response_length, rollout_cfg.prompt_length = 2, 6, 16
    for key, value in rollout_overrides.items():
        OmegaConf.update(rollout_cfg, key, value)
    rollout = HFRollout(model, rollout_cfg, tokenizer)
    trainer = RayPPOTrainer.__new__(RayPPOTrainer)  # no Ray, no workers: only what _rollout_and_score reads
    trainer.config, trainer.tokenizer, trainer.reward_fn, trainer.global_steps = config, tokenizer, length_reward, 1
    trainer.rollout_wg = trainer.actor_rollout_wg = LocalGroup(rollout, workflow_factory(rollout_cfg, tokenizer))
    return trainer


def prompts(tokenizer, marks):
    ids = torch.full((len(TEXTS), 16), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, text in enumerate(TEXTS):
        tok = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids[i, 16 - len(tok) :], mask[i, 16 - len(tok) :] = torch.tensor(tok), 1
    return DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": mask, "position_ids": compute_position_id_with_mask(mask)},
        non_tensors={
            "data_source": np.array(["toy"] * 3, dtype=object),
            "reward_model": np.array([{"ground_truth": "x"}] * 3, dtype=object),
            "extra_info": np.array([{"reject": m} for m in marks], dtype=object),
        },
    )


def test_rejected_samples_and_lone_group_members_are_dropped(parts):
    trainer = make_trainer(parts, RejectSome)
    metrics = {}
    batch = trainer._rollout_and_score(prompts(parts[0], ["all", "first", "none"]), {}, metrics)
    assert metrics["rollout/rejected_samples"] == 3.0 and metrics["rollout/dropped_samples"] == 4.0
    assert len(batch) == 2 and "rollout_accepted" not in batch.batch.keys()
    assert len(set(batch.non_tensor_batch["uid"])) == 1  # the one intact group of two
    assert batch.batch["response_mask"].sum(-1).min() >= 1
    assert torch.equal(batch.batch["token_level_scores"], length_reward(batch))  # scored by the trainer


def response_chars(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return float(len(solution_str))


def test_workflow_scores_are_kept_and_remax_workflow_gives_the_baseline(parts):
    trainer = make_trainer(parts, build_workflow, adv_estimator="remax", workflow="remax",
                           workflow_kwargs={"reward_fn": f"{__file__}:response_chars"})  # fmt: skip
    timing, metrics = {}, {}
    batch = trainer._rollout_and_score(prompts(parts[0], ["none"] * 3), timing, metrics)
    assert trainer.rollout_wg.calls == 1 and "gen_max" not in timing and "reward" not in timing
    tokenizer = parts[0]
    for row in range(len(batch)):
        length = int(batch.batch["response_mask"][row].sum())
        text = tokenizer.decode(batch.batch["responses"][row, :length].tolist(), skip_special_tokens=True)
        assert batch.batch["token_level_scores"][row, length - 1] == len(
            text
        )  # the workflow's reward, not length_reward
    greedy = greedy_reference(trainer, tokenizer)
    lengths = greedy.batch["response_mask"].sum(-1).tolist()
    texts = [
        tokenizer.decode(r[: int(n)].tolist(), skip_special_tokens=True)
        for r, n in zip(greedy.batch["responses"], lengths)
    ]
    assert batch.batch["reward_baselines"].tolist() == [float(len(t)) for t in texts for _ in range(2)]


def greedy_reference(trainer, tokenizer) -> DataProto:
    """The engine's greedy answers to the three prompts, asked directly."""
    data = prompts(tokenizer, ["none"] * 3).select(batch_keys=["input_ids", "attention_mask", "position_ids"])
    data.meta_info = {
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "do_sample": False,
    }
    return trainer.rollout_wg.rollout.generate_sequences(data)


def test_trainer_greedy_pass_gives_the_remax_baseline_per_uid(parts):
    trainer = make_trainer(parts, build_workflow, adv_estimator="remax")  # the default rlvr workflow
    timing = {}
    batch = trainer._rollout_and_score(prompts(parts[0], ["none"] * 3), timing, {})
    assert trainer.rollout_wg.calls == 2 and "gen_max" in timing
    expected = length_reward(greedy_reference(trainer, parts[0])).sum(-1).repeat_interleave(2)  # n = 2
    assert torch.equal(batch.batch["reward_baselines"], expected)


@pytest.mark.slow
@pytest.mark.ray
def test_multi_turn_tool_workflow_trains_through_main_ppo(tiny_model_dir, tmp_path):
    """Through the real entry point: the workers import the tool module, run the multi_turn_tool workflow
    in the Ray worker and train on its rows; an unknown workflow name fails before Ray starts."""
    import json
    import subprocess
    import sys

    import pandas as pd

    from verl.utils.dataset.rlla_synthetic import generate_records, records_to_rows

    records = generate_records(6, seed=2)
    pd.DataFrame(records_to_rows(records[:4], "train")).to_parquet(tmp_path / "train.parquet")
    tools = tmp_path / "tools.py"
    tools.write_text(
        "from verl.envs.tools import tool\n\n@tool\ndef get_weather(city: str) -> str:\n    return 'sunny'\n"
    )
    args = [
        *CPU_OVERRIDES,
        f"data.train_files={tmp_path}/train.parquet", f"actor_rollout_ref.model.path={tiny_model_dir}",
        "data.max_prompt_length=384", "data.max_response_length=16", "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.workflow=multi_turn_tool",
        f"actor_rollout_ref.rollout.multi_turn.tool_modules=[{tools}]", "actor_rollout_ref.rollout.multi_turn.max_turns=2",
        "trainer.total_training_steps=1", "trainer.val_before_train=false", "trainer.logger=[console]",
        f"trainer.default_local_dir={tmp_path}/run", "trainer.ray_init.num_cpus=2",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    step = [json.loads(line) for line in open(tmp_path / "run" / "logs" / "metrics.jsonl")][-1]
    assert step["step"] == 1 and step["rollout/rejected_samples"] == 0.0 and "actor/pg_loss" in step

    bad = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", *args, "actor_rollout_ref.rollout.workflow=rlhf"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert bad.returncode != 0 and "unknown rollout workflow 'rlhf'" in bad.stderr
