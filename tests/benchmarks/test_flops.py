"""The FLOP count behind the benchmark's floor (benchmarks/flops.py) and the bars' arithmetic
(benchmarks/bench_report.py): counts checked by hand on a small shape, no timing asserted."""

import os
import sys

import pytest

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
)
import bench_report  # noqa: E402
import flops  # noqa: E402

SHAPE = flops.ModelShape(hidden=8, layers=2, heads=2, kv_heads=1, intermediate=16, vocab=32)


def test_model_counts_by_hand():
    # per layer: q 8x8, k 8x4, v 8x4, o 8x8, gate/up 8x16, down 16x8 = 64+32+32+64+128+128+128 = 576 weights
    assert SHAPE.projection_flops_per_token() == 2 * 2 * 576
    assert SHAPE.lm_head_flops() == 2 * 8 * 32
    assert SHAPE.attention_flops(10) == 4 * 2 * 8 * 10


def test_step_flops_by_hand_and_padded_count_is_larger():
    step = flops.StepShape(prompts=1, n=2, prompt_len=3, prompt_len_sq=9, response_len=2)
    proj, head, att = SHAPE.projection_flops_per_token(), SHAPE.lm_head_flops(), SHAPE.attention_flops
    prompt_pass = 3 * proj + att((9 + 3) / 2)  # one distinct prompt, causal over 1 + 2 + 3 positions
    response_pass = 2 * 2 * (proj + head + att(3 + 1.5))  # 2 rows x 2 tokens, attending 4 and 5 positions
    got = flops.step_flops(SHAPE, step)
    assert got["prefill"] == pytest.approx(prompt_pass + head)
    assert got["decode"] == pytest.approx(2 * 1 * (proj + head + att(4)))  # one decode step, 4 positions
    assert got["ref"] == pytest.approx(prompt_pass + response_pass)
    assert got["update"] == pytest.approx(3 * got["ref"])
    padded = flops.step_flops(SHAPE, step, padded_prompt_len=3)
    assert padded["ref"] > got["ref"] and padded["prefill"] > got["prefill"]
    assert padded["decode"] == pytest.approx(got["decode"])


def test_floor_seconds_use_each_phase_rate():
    seconds = flops.floor_seconds(
        {"prefill": 1e9, "decode": 2e9, "ref": 3e9, "update": 4e9}, {"decode": 1e9, "train": 2e9, "large_square": 1e10}
    )
    assert seconds["decode"] == pytest.approx(2.0) and seconds["update"] == pytest.approx(2.0)
    assert seconds["floor"] == pytest.approx(0.5 + 2 + 1.5 + 2)
    assert seconds["floor_large_square"] == pytest.approx(1.0)


def test_bars_compare_runs_of_one_script_run():
    summary = {
        "ours": {
            "kind": "ours",
            "step_s": 5.0,
            "peak_rss_mb": 1500.0,
            "orchestration_share": 0.01,
            "gen_tokens_per_s": 4000.0,
        },
        "ours-single_process": {"kind": "ours", "step_s": 4.9},
        "trl": {"kind": "trl", "step_s": 11.0, "peak_rss_mb": 1600.0},
        "bare-hf": {"kind": "bare-hf", "step_s": 10.0, "gen_tokens_per_s": 2000.0},
    }
    got = bench_report.bars(summary, {"ours/floor": 1.5})
    assert got["ray/single_process step time"] == pytest.approx(5.0 / 4.9)
    assert got["ray/trl peak RSS"] == pytest.approx(1500 / 1600)
    assert got["ray/floor step time"] == 1.5 and got["ray/bare-hf generation tokens/s"] == 2.0
    assert set(got) == {spec[0] for spec in bench_report.BAR_SPECS}
