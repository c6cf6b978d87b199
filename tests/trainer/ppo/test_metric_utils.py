"""Metric helpers of the trainer's step (verl/trainer/ppo/metric_utils.py) against hand-computed values."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from verl.protocol import DataProto
from verl.trainer.ppo import metric_utils
from verl.trainer.ppo.metric_utils import (
    RolloutMoELoadBalanceMetricsAccumulator,
    compute_data_metrics,
    compute_moe_lb_metrics,
    compute_rollout_moe_load_balance_metrics,
    compute_spec_decode_metrics,
    compute_throughout_metrics,
    compute_timing_metrics,
    infer_rollout_moe_num_experts,
    reduce_metrics,
    zero_std_fraction,
)


def test_zero_std_fraction_counts_flat_groups():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0])
    uids = ["a", "a", "b", "b", "c", "c"]
    assert zero_std_fraction(scores, uids) == pytest.approx(2 / 3)


def test_reduce_metrics_sums_counters_and_averages_the_rest():
    out = reduce_metrics({"actor/pg_loss": [1.0, 3.0], "actor/nonfinite_steps": [1, 0, 1], "x": 2})
    assert out == {"actor/pg_loss": 2.0, "actor/nonfinite_steps": 2.0, "x": 2.0}


def _batch():
    # 3 rows, prompt width 2, response width 3; row 2 was aborted (empty response)
    attention = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    response_mask = attention[:, 2:].float()
    scores = torch.tensor([[0.0, 0.0, 2.0], [0.0, 4.0, 0.0], [9.0, 0.0, 0.0]])
    return DataProto.from_dict(
        tensors={
            "attention_mask": attention,
            "responses": torch.zeros(3, 3, dtype=torch.long),
            "response_mask": response_mask,
            "token_level_scores": scores,
            "token_level_rewards": scores - 1.0,
            "advantages": torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]),
            "returns": torch.ones(3, 3),
        },
        non_tensors={"tool_call_counts": np.array([2, 0, 1])},
    )


def test_data_metrics_leave_aborted_rows_out_of_scores_and_lengths():
    m = compute_data_metrics(_batch(), use_critic=False)
    assert m["critic/score/mean"] == pytest.approx(3.0)  # rows 0 and 1 only: 2 and 4
    assert m["critic/rewards/mean"] == pytest.approx(0.0)  # row sums 2 - 3 and 4 - 3 (row 2 would add 6)
    assert m["critic/advantages/mean"] == pytest.approx((1 + 2 + 3 + 4) / 4)  # response tokens only
    assert m["response_length/mean"] == pytest.approx(4 / 3) and m["response_length/clip_ratio"] == pytest.approx(1 / 3)
    assert m["response_length_non_aborted/mean"] == pytest.approx(2.0)
    assert m["response_length_non_aborted/clip_ratio"] == pytest.approx(0.5)
    assert m["response/aborted_ratio"] == pytest.approx(1 / 3)
    assert m["prompt_length/mean"] == pytest.approx(5 / 3) and m["prompt_length/clip_ratio"] == pytest.approx(2 / 3)
    assert (m["tool_call_counts/min"], m["tool_call_counts/max"], m["tool_call_counts/mean"]) == (0.0, 2.0, 1.0)
    assert "critic/values/mean" not in m


def test_data_metrics_of_an_all_aborted_batch_are_nan():
    batch = _batch().select_idxs([2])
    m = compute_data_metrics(batch, use_critic=False)
    assert np.isnan(m["critic/score/mean"]) and np.isnan(m["critic/advantages/max"])
    assert np.isnan(m["response_length_non_aborted/clip_ratio"]) and m["response/aborted_ratio"] == 1.0


def test_timing_per_token_of_verls_phases_only():
    timing = {"gen": 0.4, "update_actor": 0.9, "reward": 5.0, "step": 2.0}
    m = compute_timing_metrics(_batch(), timing)
    assert m["timing_s/reward"] == 5.0 and m["timing_s/step"] == 2.0
    assert m["timing_per_token_ms/gen"] == pytest.approx(400 / 4)  # 4 response tokens
    assert m["timing_per_token_ms/update_actor"] == pytest.approx(900 / 9)  # 5 prompt + 4 response tokens
    assert "timing_per_token_ms/reward" not in m and "timing_per_token_ms/step" not in m
    empty = _batch().select_idxs([2])
    empty.batch["attention_mask"].zero_()
    assert compute_timing_metrics(empty, {"gen": 1.0})["timing_per_token_ms/gen"] == 0.0


def test_throughput_prefers_global_token_num():
    batch = _batch()
    m = compute_throughout_metrics(batch, {"step": 2.0}, 3)
    assert m["perf/total_num_tokens"] == 9 and m["perf/throughput"] == pytest.approx(9 / 6)
    batch.meta_info["global_token_num"] = [10, 20]
    assert compute_throughout_metrics(batch, {"step": 5.0}, 2)["perf/throughput"] == pytest.approx(3.0)


def test_spec_decode_metrics_by_hand():
    m = compute_spec_decode_metrics([4, 2, 0], [2, 2, 0], [2, 1, 0])
    assert m["rollout/spec_accept_rate"] == pytest.approx((0.5 + 1.0 + 0.0) / 3)
    assert m["rollout/spec_accept_length"] == pytest.approx((2.0 + 3.0 + 0.0) / 3)
    masked = compute_spec_decode_metrics([4, 2, 0], [2, 2, 0], [2, 1, 0], non_padding_mask=[False, True, False])
    assert masked == {"rollout/spec_accept_rate": 1.0, "rollout/spec_accept_length": 3.0}
    assert compute_spec_decode_metrics(None, None, None) == {}
    with pytest.raises(ValueError, match="spec_num_verify_steps"):
        compute_spec_decode_metrics([1], [1], None)


def test_moe_load_balance_by_hand():
    # one row, 4 response tokens (the last one's slot is filler), 2 layers, top-1 of 2 experts
    routed = torch.tensor([[[[0], [1]], [[0], [1]], [[1], [1]], [[1], [0]]]])
    m = compute_rollout_moe_load_balance_metrics(routed, torch.ones(1, 4), num_experts=2)
    # layer 0 loads [2, 1] -> shares * 2 - 1 = [1/3, -1/3]; layer 1 loads [0, 3] -> [-1, 1]
    assert m["rollout/moe/max_vio/layer_0"] == pytest.approx(1 / 3)
    assert m["rollout/moe/min_vio/layer_1"] == pytest.approx(-1.0)
    assert m["rollout/moe/avg_vio/avg"] == pytest.approx((1 / 3 + 1) / 2)
    assert m["rollout/moe/max_vio/max"] == pytest.approx(1.0)
    assert compute_rollout_moe_load_balance_metrics(routed, torch.ones(1, 4), num_experts=1) == {}  # ids >= 1


def test_moe_metrics_accumulate_over_the_interval():
    acc = RolloutMoELoadBalanceMetricsAccumulator()
    batch = SimpleNamespace(batch={"routed_experts": torch.tensor([[[[0]], [[1]]]]), "response_mask": torch.ones(1, 2)})
    for step in (1, 2):
        assert compute_moe_lb_metrics(batch, 3, step, acc) == {}  # counted, no num_experts: nothing added
    acc.num_experts_initialized, acc.num_experts = True, 2
    assert compute_moe_lb_metrics(batch, 2, 1, acc) == {}
    m = compute_moe_lb_metrics(batch, 2, 2, acc)
    assert m["rollout/moe/routed_expert_assignments"] == 2 and m["rollout/moe/max_vio/layer_0"] == pytest.approx(1.0)
    assert acc.total_assignments() == 0 and "num_experts_missing" in acc.warned_skip_keys


def test_rollout_num_experts_read_from_a_model_directory(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "mixtral", "num_local_experts": 8}')
    assert infer_rollout_moe_num_experts({"path": str(tmp_path)}) == 8
    override = {"path": str(tmp_path), "override_config": {"model_config": {"num_local_experts": 4}}}
    assert infer_rollout_moe_num_experts(override) == 4
    assert infer_rollout_moe_num_experts({"num_experts": 16, "path": "hdfs://x"}) == 16  # no file read
    with pytest.raises(ValueError, match="HDFS"):
        infer_rollout_moe_num_experts({"path": "hdfs://x"})
    assert metric_utils.AutoConfig.__name__ == "AutoConfig"
