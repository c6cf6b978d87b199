"""End to end through `python -m verl.trainer.main_ppo` with `reward.reward_model.enable=true`: the trainer starts a
reward-model worker group and its scores become the reward of training (`critic/score/*`) and validation steps.

The reward model gives every sequence the same score `c` (all its token embeddings are equal, so every position
carries the same hidden state), computed here with an independent HF forward. Run 1 (in process, the reward model
colocated with the actor): rows whose data source has no rule scorer train on `c`. Run 2 (Ray, the reward model in a
pool of its own): a custom reward function gets the score in `extra_info["rm_score"]` and returns `2 * c + 1`.
`test_placement_settings` (fast) checks the pool settings and their start-up errors.
"""

import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, Qwen2ForSequenceClassification

from tests.ppo_e2e import grpo_args, run_ppo, step_metrics, write_data
from verl.trainer.main_ppo import _check_single_process
from verl.trainer.ppo.utils import need_reward_model, reward_model_pool_spec

CUSTOM_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return 2 * extra_info["rm_score"] + 1
"""


@pytest.fixture(scope="module")
def constant_rm(tiny_model_dir, tmp_path_factory) -> tuple[str, float]:
    """(path, c): a Qwen2ForSequenceClassification that scores every sequence c, with the policy's tokenizer."""
    out = str(tmp_path_factory.mktemp("constant_rm"))
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.num_labels, config.architectures = 1, ["Qwen2ForSequenceClassification"]
    torch.manual_seed(3)
    model = Qwen2ForSequenceClassification(config)
    with torch.no_grad():
        embeddings = model.model.embed_tokens.weight
        embeddings.copy_(torch.randn(embeddings.shape[-1]).expand_as(embeddings))
        torch.nn.init.normal_(model.score.weight, std=1.0)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    reference = AutoModelForSequenceClassification.from_pretrained(out).eval()
    reference.config.pad_token_id = None
    with torch.no_grad():
        scores = [reference(input_ids=torch.tensor([ids])).logits[0, 0].item() for ids in ([5], [9, 14, 3, 77])]
    assert scores[0] == pytest.approx(scores[1], abs=1e-5) and abs(scores[0]) > 0.05
    return out, scores[0]


def _metrics_of(run_dir, steps: int) -> list[dict]:
    metrics = step_metrics(run_dir)
    assert sorted(metrics) == list(range(1, steps + 1))
    return [metrics[step] for step in sorted(metrics)]


def test_placement_settings():
    def config(**reward_model):
        return OmegaConf.create({"trainer": {"single_process": True, "n_gpus_per_node": 1, "nnodes": 1},
                                 "reward": {"reward_model": reward_model}})  # fmt: skip

    assert not need_reward_model(OmegaConf.create({})) and reward_model_pool_spec(OmegaConf.create({})) == {}
    assert reward_model_pool_spec(config(enable=True, n_gpus_per_node=8, nnodes=0)) == {}  # shares the global pool
    own = config(enable=True, enable_resource_pool=True, n_gpus_per_node=2, nnodes=3)
    assert need_reward_model(own) and reward_model_pool_spec(own) == {"reward_pool": [2, 2, 2]}
    assert reward_model_pool_spec(config(enable=False, enable_resource_pool=True, n_gpus_per_node=2, nnodes=1)) == {}
    with pytest.raises(ValueError, match=r"reward.reward_model.nnodes=0 must be a positive integer"):
        reward_model_pool_spec(config(enable=True, enable_resource_pool=True, n_gpus_per_node=8, nnodes=0))
    _check_single_process(config(enable=True), None, {})  # colocated: runs in the one process
    with pytest.raises(ValueError, match="single_process=true cannot give the reward model processes of its own"):
        _check_single_process(own, None, {})


@pytest.mark.slow
def test_reward_model_scores_train_and_validation_without_a_rule_scorer(tiny_model_dir, constant_rm, tmp_path):
    rm_path, c = constant_rm
    data_dir = write_data(tmp_path, n_train=4, n_val=2)
    for split in ("train", "test"):  # a data source without a built-in reward function: only the RM can score it
        frame = pd.read_parquet(data_dir / f"{split}.parquet")
        frame["data_source"] = "no_rule_scorer"
        frame.to_parquet(data_dir / f"{split}.parquet")
    args = grpo_args(tiny_model_dir, data_dir, tmp_path / "run", "trainer.single_process=true") + [
        f"data.val_files={data_dir}/test.parquet",
        "trainer.total_training_steps=1",
        "trainer.save_freq=-1",
        "++reward.reward_model.enable=true",
        f"++reward.reward_model.model_path={rm_path}",
        "++reward.reward_model.micro_batch_size_per_gpu=3",
    ]
    run_ppo(args, tmp_path)
    (step,) = _metrics_of(tmp_path / "run", 1)
    for key in ("critic/score/mean", "critic/score/max", "critic/score/min", "val/reward/mean"):
        assert step[key] == pytest.approx(c, rel=1e-5), key  # float32 rounding differs by machine
    assert "timing_s/reward" in step

    # the same run without the reward model stops at start-up: nothing could score these rows
    no_rm = [a for a in args if not a.startswith("++reward.reward_model.")]
    proc = run_ppo(no_rm, tmp_path, check=False)
    assert proc.returncode == 1 and "data_source='no_rule_scorer' has no built-in reward function" in proc.stderr


@pytest.mark.slow
@pytest.mark.ray
def test_custom_reward_function_decides_with_the_rm_score_in_its_own_pool(tiny_model_dir, constant_rm, tmp_path):
    rm_path, c = constant_rm
    data_dir = write_data(tmp_path, n_train=4, n_val=0)
    reward_file = tmp_path / "reward.py"
    reward_file.write_text(CUSTOM_REWARD)
    args = [a for a in grpo_args(tiny_model_dir, data_dir, tmp_path / "run") if "num_cpus" not in a] + [
        "trainer.ray_init.num_cpus=2",  # one process for the actor, one for the reward model
        "trainer.total_training_steps=1",
        "trainer.save_freq=-1",
        f"++reward.custom_reward_function.path={reward_file}",
        "++reward.reward_model.enable=true",
        f"++reward.reward_model.model_path={rm_path}",
        "++reward.reward_model.enable_resource_pool=true",
        "++reward.reward_model.n_gpus_per_node=1",
        "++reward.reward_model.nnodes=1",
    ]
    run_ppo(args, tmp_path)
    (step,) = _metrics_of(tmp_path / "run", 1)
    for key in ("critic/score/mean", "critic/score/max", "critic/score/min"):
        assert step[key] == pytest.approx(2 * c + 1, rel=1e-5), key  # float32 rounding differs by machine
