"""FLOPs estimate against a hand count for a tiny config, and MFU bounds on this CPU."""

from types import SimpleNamespace

import pytest

from verl.utils.flops_counter import compute_mfu, device_peak_flops, estimate_training_flops


def _config(**overrides):
    base = dict(
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=10,
    )
    return SimpleNamespace(**{**base, **overrides})


def test_training_flops_match_a_hand_count():
    # per layer: q 8x8=64, k 8x4=32, v 32, o 64 -> 192; MLP 3*8*16=384; two layers -> 1152; embed+head 2*10*8=160
    dense = 1152 + 160
    seqlens = [3, 5]
    attention = 12 * (9 + 25) * 2 * 4 * 2  # 12 * sum(s^2) * heads * head_dim * layers
    assert estimate_training_flops(_config(), seqlens) == 6 * dense * 8 + attention


def test_explicit_head_dim_and_mha_default():
    # no num_key_value_heads: k and v as wide as q; head_dim given explicitly
    config = _config(num_key_value_heads=None, head_dim=2)
    attn = 8 * (2 * 2 * 3) + 2 * 2 * 8  # q,k,v: 8 -> 4 each; o: 4 -> 8
    dense = 2 * (attn + 384) + 160
    assert estimate_training_flops(config, [4]) == 6 * dense * 4 + 12 * 16 * 2 * 2 * 2


def test_mfu_on_cpu_is_a_fraction_of_the_measured_peak():
    peak = device_peak_flops("cpu")
    assert peak > 1e8  # any CPU does more than 0.1 GFLOP/s of float32 matmul
    flops = estimate_training_flops(_config(), [100] * 4)
    assert compute_mfu(_config(), [100] * 4, elapsed_s=flops / peak, device="cpu") == pytest.approx(1.0)
    assert compute_mfu(_config(), [100] * 4, elapsed_s=0.0, device="cpu") == 0.0
