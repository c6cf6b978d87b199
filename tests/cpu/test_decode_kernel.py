"""Tests of the fused CPU decode kernels' build (verl/cpu/native_build.py), guards and one-pass sampler
(verl/cpu/decode_kernel.py). The attention's
numbers against an independent sdpa are checked in tests/workers/test_shared_prefix.py, and a whole generation
with it against the per-row cache there too."""

import logging
import os

import pytest
import torch

from verl.cpu import decode_kernel, native_build, shared_prefix
from verl.workers.rollout.hf_rollout import _logits_warpers, _next_tokens
from verl.workers.rollout.sampling import SamplingSettings


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """The module as in a new process, its build cache in tmp_path; the process's own state is put back after."""
    monkeypatch.setattr(decode_kernel, "_library", None)
    monkeypatch.setattr(decode_kernel, "_tried", False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(decode_kernel.ENV_SWITCH, raising=False)
    return tmp_path


def _cache(dim=32):
    cache = shared_prefix.SharedPrefixCache(num_layers=1, capacity=4)
    cache.layers[0].update(torch.randn(1, 2, 5, dim), torch.randn(1, 2, 5, dim))
    cache.start_decode(torch.tensor([0, 0]), torch.ones(1, 5, dtype=torch.long))
    return cache


def test_builds_once_into_the_users_cache_and_reuses_it(fresh_build):
    if native_build.compiler() is None:
        pytest.skip("no C compiler here")
    assert decode_kernel.available()
    built = list((fresh_build / "verl" / "kernels").glob("decode_attention_*.so"))
    assert len(built) == 1
    stamp = os.stat(built[0]).st_mtime_ns
    decode_kernel._tried = False  # a second process: it loads the same file, no new build
    assert decode_kernel.available()
    assert os.stat(built[0]).st_mtime_ns == stamp
    assert list((fresh_build / "verl" / "kernels").iterdir()) == built  # no temporary folder left behind
    assert _cache().layers[0].fused


def test_without_a_compiler_the_torch_path_decodes(fresh_build, monkeypatch):
    monkeypatch.setattr(native_build, "compiler", lambda: None)
    assert not decode_kernel.available()
    assert not _cache().layers[0].fused


def test_a_failed_build_warns_once_and_falls_back(fresh_build, monkeypatch, caplog):
    monkeypatch.setattr(native_build, "compiler", lambda: "false")  # a "compiler" that always fails
    with caplog.at_level(logging.WARNING, logger=native_build.__name__):
        assert not decode_kernel.available()
        assert not decode_kernel.available()
    assert [r.getMessage().startswith("decode_attention: false failed") for r in caplog.records] == [True]
    assert not _cache().layers[0].fused


def test_the_switch_turns_it_off_and_refuses_other_values(fresh_build, monkeypatch):
    monkeypatch.setenv(decode_kernel.ENV_SWITCH, "0")
    assert not decode_kernel.available() and not decode_kernel._tried  # nothing built
    monkeypatch.setenv(decode_kernel.ENV_SWITCH, "yes")
    with pytest.raises(ValueError, match=r"VERL_DECODE_KERNEL='yes': allowed are 0 .* and 1"):
        decode_kernel.available()


def test_applies_only_to_float32_cpu_heads_of_whole_32_column_blocks(monkeypatch):
    monkeypatch.setattr(decode_kernel, "available", lambda: True)
    cpu = torch.device("cpu")
    assert decode_kernel.applies(64, torch.float32, cpu) and decode_kernel.applies(96, torch.float32, cpu)
    assert not decode_kernel.applies(48, torch.float32, cpu)
    assert not decode_kernel.applies(64, torch.bfloat16, cpu)
    assert not decode_kernel.applies(64, torch.float32, torch.device("meta"))


def test_layouts_it_would_read_outside_of_are_refused():
    keys = decode_kernel.tile_keys(torch.randn(2, 2, 40, 32))
    assert keys.shape == (2, 2, 2, 32, decode_kernel.TILE)
    values, bias = torch.randn(2, 2, 40, 32), decode_kernel.prompt_bias(torch.ones(2, 40))
    key_buffer, value_buffer = torch.empty(3, 2, 2, 32, decode_kernel.TILE), torch.empty(3, 2, 64, 32)
    decode_kernel.check_layout(keys, values, bias, key_buffer, value_buffer)
    with pytest.raises(ValueError, match=r"key_buffer must have shape \(3, 2, 1, 32, 32\), got \(3, 2, 2, 32, 32\)"):
        decode_kernel.check_layout(keys, values, bias, key_buffer, torch.empty(3, 2, 32, 32))  # buffers disagree
    with pytest.raises(ValueError, match="bias must be contiguous float32 on the CPU, got torch.float64"):
        decode_kernel.check_layout(keys, values, bias.double(), key_buffer, value_buffer)
    with pytest.raises(ValueError, match="prefix_keys must be contiguous"):
        decode_kernel.check_layout(keys.transpose(0, 1), values, bias, key_buffer, value_buffer)
    query, groups = torch.randn(3, 2, 2, 32), torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"0 < length <= 64, got torch.int64 \(3,\), length 65"):
        decode_kernel.shared_prefix_attention(query, keys, values, bias, groups, key_buffer, value_buffer, 65)
    with pytest.raises(ValueError, match="query must be float32"):
        decode_kernel.shared_prefix_attention(query.double(), keys, values, bias, groups, key_buffer, value_buffer, 1)


def test_prompt_bias_is_zero_on_tokens_and_masked_elsewhere():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    bias = decode_kernel.prompt_bias(mask)
    assert bias.shape == (2, decode_kernel.TILE) and bias.dtype == torch.float32
    assert (bias[0, :2] == decode_kernel.MASKED).all() and bias[0, 2:5].tolist() == [0.0] * 3
    assert bias[1, :5].tolist() == [0.0] * 5
    assert (bias[:, 5:] == decode_kernel.MASKED).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sample_tokens_is_the_torch_ops_inverse_cdf_sampling_and_log_softmax(temperature):
    """The one-pass sampler against hf_rollout's torch ops (softmax, cumsum, searchsorted; log_softmax, gather) on
    2,000 rows of a 2,048-token vocabulary, sampled and greedy."""
    if not decode_kernel.available():
        pytest.skip("no C compiler: the fused decode kernel cannot be built here")
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2000, 2048, generator=gen) * 4
    logits[0, 7] = 100.0  # one row certain of its token
    draws = torch.rand(2000, generator=gen)
    draws[1] = 0.0  # the first token with any probability
    warpers = _logits_warpers(SamplingSettings(do_sample=True, temperature=temperature, top_k=-1, top_p=1.0))
    expected = _next_tokens(logits, warpers, draws)
    expected_lp = torch.log_softmax(logits / temperature, dim=-1).gather(-1, expected[:, None])[:, 0]
    tokens, log_probs = decode_kernel.sample_tokens(logits, temperature, draws, True)
    assert tokens.dtype == torch.int64 and tokens[0] == 7 and tokens[1] == 0
    assert (tokens != expected).sum() <= 1  # a draw within rounding of a boundary may pick the neighbour
    same = tokens == expected
    torch.testing.assert_close(log_probs[same], expected_lp[same], atol=2e-5, rtol=0)
    greedy, greedy_lp = decode_kernel.sample_tokens(logits, temperature, None, True)
    assert torch.equal(greedy, logits.argmax(-1))
    torch.testing.assert_close(greedy_lp, torch.log_softmax(logits / temperature, -1).gather(-1, greedy[:, None])[:, 0],
                               atol=2e-5, rtol=0)  # fmt: skip
    assert decode_kernel.sample_tokens(logits[:3], temperature, None, False)[1] is None
    with pytest.raises(ValueError, match=r"logits must be contiguous float32 \(3, 2048\)"):
        decode_kernel.sample_tokens(logits[:3].double(), temperature, None, False)
    with pytest.raises(ValueError, match=r"draws must be \(3,\), got \(2,\)"):
        decode_kernel.sample_tokens(logits[:3], temperature, draws[:2], False)
