"""The RLVR step end to end on a scripted rollout: verifier scores kept, per-domain processing written into the
token-level scores, dropped samples loss-masked, and the per-domain / per-tag metrics with hand-computed values."""

import math
import os

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from tests.cpu_overrides import cpu_config
from verl.protocol import DataProto
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.metric_utils import compute_domain_metrics
from verl.trainer.ppo.reward_processing import EPS
from verl.trainer.ppo.rlvr import ALL, build_rlvr_step
from verl.trainer.ppo.validation_metrics import compute_val_correct_metrics

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "..", "verl", "trainer", "config", "ppo_trainer.yaml")
PROMPT, RESPONSE = 2, 4
# rows: math m1 (1, 0), math m2 (1, 1), tools t1 (3, 1); row 5 fills the whole response (truncated)
DOMAINS = ["math", "math", "math", "math", "tools", "tools"]
UIDS = ["m1", "m1", "m2", "m2", "t1", "t1"]
SCORES = [1.0, 0.0, 1.0, 1.0, 3.0, 1.0]
LENGTHS = [2, 3, 1, 2, 3, 4]


def base_config(**algorithm):
    cfg = cpu_config()
    cfg.data.train_batch_size = 3
    for key, value in algorithm.items():
        OmegaConf.update(cfg, f"algorithm.{key}", value)
    return cfg


def domain_config(**algorithm):
    cfg = base_config(**algorithm)
    cfg.data.domains = {
        "math": {"train_files": "m.parquet", "reward": "math_rule", "reward_norm": "group", "weight": 2.0},
        "tools": {"train_files": "t.parquet", "reward": "rlla", "reward_scale": 0.5, "correct_threshold": 2.0},
    }
    cfg.data.domain_interleave_probs = {"math": 2 / 3, "tools": 1 / 3}
    return cfg


def rollout(prompts):
    """The scored batch of the six rows above (prompts are ignored)."""
    mask = torch.zeros(6, RESPONSE, dtype=torch.long)
    token_scores = torch.zeros(6, RESPONSE)
    for row, (score, length) in enumerate(zip(SCORES, LENGTHS)):
        mask[row, :length] = 1
        token_scores[row, length - 1] = score
    return DataProto.from_single_dict(
        {
            "responses": torch.ones(6, RESPONSE, dtype=torch.long),
            "attention_mask": torch.cat([torch.ones(6, PROMPT, dtype=torch.long), mask], dim=1),
            "response_mask": mask.clone(),
            "token_level_scores": token_scores,
            "uid": np.array(UIDS, dtype=object),
            "domain": np.array(DOMAINS, dtype=object),
            "format": np.array([None, None, None, None, 1.0, 0.0], dtype=object),
        }
    )


def prompts():
    return DataProto.from_single_dict({"domain": np.array(["math", "math", "tools"], dtype=object)})


def test_plain_config_has_no_rlvr_step_and_algorithm_keys_turn_it_on():
    assert build_rlvr_step(base_config()) is None
    step = build_rlvr_step(base_config(reward_norm="batch"))
    assert list(step.specs) == [ALL] and step.specs[ALL].reward_norm == "batch" and step.scheduler is None
    step = build_rlvr_step(base_config(**{"filter_groups.enable": True, "filter_groups.max_num_gen_batches": 3}))
    assert step.scheduler.targets == {ALL: 3} and step.scheduler.max_rounds == 3


def test_step_processes_per_domain_masks_and_keeps_verifier_scores():
    step = build_rlvr_step(domain_config(overlong_mask="drop"))
    metrics = {}
    batch = step.run(prompts(), rollout, lambda counts: pytest.fail("no dynamic sampling"), metrics)
    assert batch.batch["raw_scores"].tolist() == SCORES
    # math: group norm then weight 2; m1 = (1, 0): mean 0.5, std sqrt(0.5); m2 all equal -> 0
    m1 = 0.5 / (math.sqrt(0.5) + EPS) * 2.0
    # tools: no norm, scale 0.5
    expected = [m1, -m1, 0.0, 0.0, 1.5, 0.5]
    torch.testing.assert_close(batch.batch["token_level_scores"].sum(-1), torch.tensor(expected))
    for row, length in enumerate(LENGTHS):  # the processed score sits on the last response token
        assert batch.batch["token_level_scores"][row, length - 1].item() == pytest.approx(expected[row], abs=1e-6)
    # row 5 (truncated) is dropped from the loss, everything else untouched
    assert batch.batch["response_mask"].sum(-1).tolist() == [2, 3, 1, 2, 3, 0]
    assert metrics["actor/final_mask_ratio"] == pytest.approx(5 / 6)
    assert metrics["math/actor/max_len_mask_ratio"] == 1.0 and metrics["tools/actor/max_len_mask_ratio"] == 0.5
    assert step.extra_keys == ["format"]  # the reward's extra field (non-tensor keys the prompts did not have)

    # the rest of the step: advantages, then the per-domain metrics
    batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
    batch = core_algos.compute_advantage(batch, "grpo")
    out = compute_domain_metrics(batch, use_critic=False, extra_keys=step.extra_keys, domain_key="domain")
    assert out["critic/score/mean"] == pytest.approx(sum(SCORES) / 6)  # verifier scores, not processed
    assert out["math/critic/score/mean"] == pytest.approx(0.75)
    assert out["tools/critic/score/mean"] == pytest.approx(2.0) and out["tools/critic/score/max"] == 3.0
    assert out["math/critic/score/zero_std_frac"] == 0.5  # m2
    assert out["math/critic/rewards/mean"] == pytest.approx(0.0, abs=1e-6)
    assert out["tools/critic/rewards/mean"] == pytest.approx(1.0)
    assert out["tools/response_length/mean"] == pytest.approx(3.5)  # from the attention mask: (3 + 4) / 2
    assert out["tools/reward_extra/format/mean"] == 0.5 and "math/reward_extra/format/mean" not in out
    # the dropped row has no advantage
    assert batch.batch["advantages"][5].abs().sum().item() == 0.0


def test_running_moments_are_saved_and_restored():
    cfg = domain_config()
    cfg.data.domains.tools.reward_norm = "running"
    step = build_rlvr_step(cfg)
    step.run(prompts(), rollout, None, {})
    state = step.state_dict()
    assert state["running"]["tools"] == {"count": 2, "mean": 2.0, "m2": 2.0}
    fresh = build_rlvr_step(cfg)
    fresh.load_state_dict(state)
    again, original = fresh.run(prompts(), rollout, None, {}), step.run(prompts(), rollout, None, {})
    torch.testing.assert_close(again.batch["token_level_scores"], original.batch["token_level_scores"])


def test_every_sample_dropped_falls_back_to_training_on_all(capsys):
    step = build_rlvr_step(domain_config(**{"filter_groups.enable": True}))
    step.scheduler = None  # the equal-group filter as a loss mask only; every score 0 makes every group equal
    equal = lambda p: _equal(rollout(p))  # noqa: E731
    metrics = {}
    batch = step.run(prompts(), equal, None, metrics)
    assert metrics["actor/mask_fallback"] == 1.0 and batch.batch["response_mask"].sum().item() == sum(LENGTHS)
    assert "every sample of this batch would be dropped" in capsys.readouterr().out


def _equal(batch):
    batch.batch["token_level_scores"].zero_()
    return batch


def test_validation_accuracy_overall_and_per_tag():
    metrics = compute_val_correct_metrics(["gsm8k", "gsm8k", "rlla", "rlla"], [1.0, 0.0, 2.5, 3.0], [1, 1, 3, 3])
    assert metrics == {"val_correct/all/mean": 0.5, "val_correct/gsm8k/mean": 0.5, "val_correct/rlla/mean": 0.5}
    assert compute_val_correct_metrics([], [], []) == {}
