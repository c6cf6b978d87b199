"""Tests of the shared-prefix decode attention (verl/cpu/shared_prefix.py): the attention against an
independent sdpa over each row's full (prompt + response) cache, and the `hf` rollout with it against the rollout
with its per-row cache on the tiny Qwen2 model."""

import inspect

import pytest
import torch
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from tests.workers.test_hf_rollout import make_prompts, rollout_config
from verl.cpu import decode_kernel, shared_prefix
from verl.utils.torch_functional import cache_kwarg
from verl.workers.engine.model_forward import VARLEN_SDPA
from verl.workers.rollout.hf_rollout import HFRollout


class _Layer(torch.nn.Module):
    layer_idx = 0


def _reference_attention(q, prefix_k, prefix_v, prefix_pad, groups, suffix_k, suffix_v, scale=None):
    """sdpa over each row's own copy of its prompt's keys/values followed by its response's, heads repeated."""
    keys = torch.cat([prefix_k[groups], suffix_k], dim=2)
    values = torch.cat([prefix_v[groups], suffix_v], dim=2)
    per_kv = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(per_kv, dim=1), values.repeat_interleave(per_kv, dim=1)
    allowed = torch.cat([~prefix_pad[groups], torch.ones(len(groups), suffix_k.shape[2], dtype=torch.bool)], dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=allowed[:, None, None, :],
                                                         scale=scale)  # fmt: skip
    return out.transpose(1, 2)  # (rows, 1, heads, dim)


@pytest.mark.parametrize(
    "rows",
    [
        [0, 0, 0, 1, 2, 2],  # uneven groups: 3, 1 and 2 rows per prompt (rows scattered into the packed grid)
        [0, 0, 1, 1, 2, 2],  # GRPO's layout: 2 rows per prompt, in prompt order (the grid is the rows, transposed)
    ],
    ids=["uneven", "grid"],
)
@pytest.mark.parametrize(
    "heads,kv_heads,dim,fused",
    [
        (4, 2, 8, False),  # torch's ops (a head size the fused kernel does not take)
        (4, 2, 64, False),  # torch's ops, VERL_DECODE_KERNEL=0
        (4, 2, 64, True),  # the fused kernel: 2 query heads per KV head, 64 columns per block
        (3, 3, 32, True),  # one query head per KV head, a 32-column block
        (6, 2, 96, True),  # 3 per KV head (a pair and a single), 64 + 32 columns
    ],
)
def test_attention_equals_sdpa_over_each_rows_full_cache_also_after_rows_leave(rows, heads, kv_heads, dim, fused,
                                                                                monkeypatch):  # fmt: skip
    monkeypatch.setenv(decode_kernel.ENV_SWITCH, "1" if fused else "0")
    if fused and not decode_kernel.available():
        pytest.skip("no C compiler: the fused decode kernel cannot be built here")
    torch.manual_seed(0)
    prompt_len, steps = 37, 35  # more than one tile of keys (32) in both parts, the last ones partial
    groups = torch.tensor(rows)
    prompt_mask = torch.ones(3, prompt_len, dtype=torch.long)
    prompt_mask[1, :5], prompt_mask[2, :33] = 0, 0  # left padding, the last prompt's across a tile boundary
    prefix_k, prefix_v = torch.randn(3, kv_heads, prompt_len, dim), torch.randn(3, kv_heads, prompt_len, dim)
    cache = shared_prefix.SharedPrefixCache(num_layers=1, capacity=steps)
    cache.layers[0].update(prefix_k, prefix_v)  # the prefill
    cache.start_decode(groups, prompt_mask)
    assert cache.layers[0].fused == fused
    assert cache.fills_grid == (rows == [0, 0, 1, 1, 2, 2])
    assert cache.get_seq_length() == prompt_len
    suffix_k, suffix_v = torch.empty(6, kv_heads, 0, dim), torch.empty(6, kv_heads, 0, dim)
    for step in range(steps):
        if step == 2:  # rows 1 and 3 finish (uneven: row 3 was its prompt's only row)
            keep = torch.tensor([0, 2, 4, 5])
            cache.batch_select_indices(keep)
            assert not cache.fills_grid
            groups, suffix_k, suffix_v = groups[keep], suffix_k[keep], suffix_v[keep]
        new_k, new_v = torch.randn(len(groups), kv_heads, 1, dim), torch.randn(len(groups), kv_heads, 1, dim)
        keys, values = cache.layers[0].update(new_k, new_v)
        suffix_k, suffix_v = torch.cat([suffix_k, new_k], dim=2), torch.cat([suffix_v, new_v], dim=2)
        torch.testing.assert_close(values, suffix_v, rtol=0, atol=0)
        if fused:  # the keys went into the kernel's tiles: (rows, kv_heads, tiles, dim, TILE)
            assert keys is None
            tiles = cache.layers[0].key_buffer
            written = tiles.transpose(-1, -2).reshape(len(groups), kv_heads, -1, dim)[:, :, : step + 1]
            torch.testing.assert_close(written, suffix_k, rtol=0, atol=0)
        else:
            torch.testing.assert_close(keys, suffix_k, rtol=0, atol=0)
        q = torch.randn(len(groups), heads, 1, dim)
        out, _ = shared_prefix._shared_prefix_attention(_Layer(), q, keys, values, None, shared_prefix=cache)
        ref = _reference_attention(q, prefix_k, prefix_v, prompt_mask == 0, groups, suffix_k, suffix_v)
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=0)
    assert cache.get_seq_length() == prompt_len + steps
    with pytest.raises(RuntimeError, match="full"):
        cache.layers[0].update(new_k[:, :, :1], new_v[:, :, :1])


def _rotate(x, cos, sin):
    """HF's rotary embedding (half rotation) of x (rows, heads, dim) at cos/sin (rows, 1, dim)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@pytest.mark.parametrize("rows", [[0, 0, 0, 1, 2, 2], [0, 0, 1, 1, 2, 2]], ids=["uneven", "grid"])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 64), (3, 3, 32), (6, 2, 96)])
def test_decode_step_rotates_writes_and_attends_as_the_separate_ops_do(rows, heads, kv_heads, dim):
    """`decode_step` from raw projections (each row at its own position, a scaled rotary table, rows leaving) gives
    the rotary embedding + cache write + sdpa over each row's full cache, and writes the rotated keys and the values
    into the layer's buffers."""
    if not decode_kernel.available():
        pytest.skip("no C compiler: the fused decode kernel cannot be built here")
    torch.manual_seed(1)
    prompt_len, steps, table = 37, 35, 90
    groups = torch.tensor(rows)
    prompt_mask = torch.ones(3, prompt_len, dtype=torch.long)
    prompt_mask[1, :5], prompt_mask[2, :33] = 0, 0
    prefix_k, prefix_v = torch.randn(3, kv_heads, prompt_len, dim), torch.randn(3, kv_heads, prompt_len, dim)
    cache = shared_prefix.SharedPrefixCache(num_layers=1, capacity=steps)
    layer = cache.layers[0]
    layer.update(prefix_k, prefix_v)
    cache.start_decode(groups, prompt_mask)
    assert layer.fused
    angles = torch.rand(table, dim // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1) * 1.1, torch.cat([angles.sin()] * 2, -1) * 1.1  # yarn-like scale
    positions, scale = torch.tensor([3, 50, 7, 0, 20, 41]), dim**-0.5 * 1.3
    suffix_k, suffix_v = torch.empty(6, kv_heads, 0, dim), torch.empty(6, kv_heads, 0, dim)
    for step in range(steps):
        if step == 2:  # rows 1 and 3 finish
            keep = torch.tensor([0, 2, 4, 5])
            cache.batch_select_indices(keep)
            groups, positions, suffix_k, suffix_v = groups[keep], positions[keep], suffix_k[keep], suffix_v[keep]
        q, k, v = torch.randn(len(groups), heads * dim), torch.randn(len(groups), kv_heads * dim), torch.randn(
            len(groups), kv_heads * dim)  # fmt: skip
        c, s = cos[positions][:, None], sin[positions][:, None]
        q_rot = _rotate(q.view(-1, heads, dim), c, s)[:, :, None]
        suffix_k = torch.cat([suffix_k, _rotate(k.view(-1, kv_heads, dim), c, s)[:, :, None]], dim=2)
        suffix_v = torch.cat([suffix_v, v.view(-1, kv_heads, 1, dim)], dim=2)
        out = shared_prefix.decode_step(cache, layer, q, k, v, cos, sin, positions, scale)
        ref = _reference_attention(q_rot, prefix_k, prefix_v, prompt_mask == 0, groups, suffix_k, suffix_v, scale)
        assert out.shape == (len(groups), heads * dim)
        torch.testing.assert_close(out.view(-1, 1, heads, dim), ref, atol=3e-6, rtol=0)
        written = layer.key_buffer.transpose(-1, -2).reshape(len(groups), kv_heads, -1, dim)[:, :, : step + 1]
        torch.testing.assert_close(written, suffix_k, atol=1e-6, rtol=0)
        torch.testing.assert_close(layer.value_buffer[:, :, : step + 1], suffix_v, atol=0, rtol=0)
        positions = positions + 1
    assert layer.length == steps and cache.get_seq_length() == prompt_len + steps
    with pytest.raises(RuntimeError, match="KV cache of 35 positions is full"):
        shared_prefix.decode_step(cache, layer, q, k, v, cos, sin, positions, scale)


def test_decode_step_refuses_positions_outside_the_rotary_tables_and_writes_nothing():
    if not decode_kernel.available():
        pytest.skip("no C compiler: the fused decode kernel cannot be built here")
    cache = shared_prefix.SharedPrefixCache(num_layers=1, capacity=4)
    layer = cache.layers[0]
    layer.update(torch.randn(1, 2, 5, 32), torch.randn(1, 2, 5, 32))
    cache.start_decode(torch.tensor([0, 0]), torch.ones(1, 5, dtype=torch.long))
    cos = sin = torch.ones(10, 32)
    q, k, v = torch.randn(2, 128), torch.randn(2, 64), torch.randn(2, 64)
    before = layer.value_buffer.clone()
    with pytest.raises(ValueError, match=r"positions 3\.\.10 outside the rotary tables of 10: nothing written"):
        shared_prefix.decode_step(cache, layer, q, k, v, cos, sin, torch.tensor([3, 10]), 0.1)
    assert layer.length == 0 and torch.equal(layer.value_buffer, before)
    with pytest.raises(ValueError, match=r"query must be contiguous float32 \(2, 128\)"):
        shared_prefix.decode_step(cache, layer, q.double(), k, v, cos, sin, torch.tensor([3, 4]), 0.1)


def test_add_rms_norm_is_hfs_rmsnorm_after_the_residual_add():
    if not decode_kernel.available():
        pytest.skip("no C compiler: the fused decode kernel cannot be built here")
    torch.manual_seed(0)
    norm = Qwen2RMSNorm(100, eps=1e-6)  # 100 columns: whole vectors of 8 and a tail
    with torch.no_grad():
        norm.weight.add_(torch.randn(100))
    for rows in (3, 200):  # one thread and, above the kernel's size threshold, all of them
        x, delta = torch.randn(rows, 100) * 3, torch.randn(rows, 100)
        expected_x = x + delta
        h = decode_kernel.add_rms_norm(x, delta, norm.weight.detach(), 1e-6)
        torch.testing.assert_close(x, expected_x, atol=0, rtol=0)  # the residual stream, added to in place
        torch.testing.assert_close(h, norm(expected_x).detach(), atol=2e-6, rtol=1e-6)
        torch.testing.assert_close(decode_kernel.add_rms_norm(x, None, norm.weight.detach(), 1e-6), h, atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"weight must be contiguous float32 \(100,\)"):
        decode_kernel.add_rms_norm(x, None, torch.ones(99), 1e-6)


def test_attention_refuses_a_call_outside_a_decode_step():
    with pytest.raises(RuntimeError, match="decode steps of a SharedPrefixCache"):
        shared_prefix._shared_prefix_attention(_Layer(), torch.zeros(1, 2, 1, 4), torch.zeros(1, 1, 1, 4),
                                               torch.zeros(1, 1, 1, 4), None)  # fmt: skip


def test_applies_only_to_plain_full_attention_under_sdpa():
    config = Qwen2Config(num_hidden_layers=2, hidden_size=16, num_attention_heads=2, num_key_value_heads=1)
    config._attn_implementation = "sdpa"
    assert shared_prefix.applies_to(config)
    config._attn_implementation = VARLEN_SDPA  # the actor's packed sdpa, which the model keeps after a packed forward
    assert shared_prefix.applies_to(config)
    config._attn_implementation = "eager"
    assert not shared_prefix.applies_to(config)
    config._attn_implementation = "sdpa"
    config.layer_types = ["full_attention", "sliding_attention"]
    assert not shared_prefix.applies_to(config)
    config.layer_types = ["full_attention", "full_attention"]
    config.model_type = "gemma2"  # softcapped attention
    assert not shared_prefix.applies_to(config)


def _generate(model, tokenizer, prompts, shared: bool, monkeypatch, **cfg):
    started = []
    with monkeypatch.context() as patch:
        if not shared:
            patch.setattr(shared_prefix, "applies_to", lambda config: False)
        start = shared_prefix.SharedPrefixCache.start_decode
        patch.setattr(shared_prefix.SharedPrefixCache, "start_decode",
                      lambda self, *a: (started.append(True), start(self, *a))[1])  # fmt: skip
        out = HFRollout(model, rollout_config(**cfg), tokenizer).generate_sequences(prompts)
    assert bool(started) == shared
    assert model.config._attn_implementation == "sdpa"  # the model's own attention is back
    return out


def test_rollout_with_shared_prompts_equals_the_per_row_cache(model, tokenizer, monkeypatch):
    """n samples of each prompt, rows stopping at an eos at different steps: the same tokens and log-probs
    with the shared-prefix attention as with every row holding its own copy of its prompt."""

    def prompts(eos):
        batch = make_prompts(tokenizer, seed=3, eos_token_id=eos).repeat(3, interleave=True)
        batch.batch["input_ids"][1::3, -1] = 7  # the middle copy of each prompt differs: uneven groups
        return batch

    full = _generate(model, tokenizer, prompts(2047), False, monkeypatch)
    eos = [int(full.batch["responses"][0, 2]), int(full.batch["responses"][4, 1])]  # rows 0 and 4 stop early
    prompts = prompts(eos)
    per_row = _generate(model, tokenizer, prompts, False, monkeypatch, calculate_log_probs=True)
    shared = _generate(model, tokenizer, prompts, True, monkeypatch, calculate_log_probs=True)
    assert torch.equal(shared.batch["responses"], per_row.batch["responses"])
    assert torch.equal(shared.batch["response_mask"], per_row.batch["response_mask"])
    lengths = per_row.batch["response_mask"].sum(-1)
    assert lengths.min() < lengths.max()  # some rows did stop early
    torch.testing.assert_close(shared.batch["rollout_log_probs"], per_row.batch["rollout_log_probs"], atol=1e-5,
                               rtol=0)  # fmt: skip

    free = HFRollout(model, rollout_config(), tokenizer).generate_sequences(make_prompts(tokenizer, validate=True))
    greedy = make_prompts(tokenizer, validate=True).repeat(2, interleave=True)
    out = _generate(model, tokenizer, greedy, True, monkeypatch)
    assert torch.equal(out.batch["responses"][0::2], free.batch["responses"])
    assert torch.equal(out.batch["responses"][1::2], free.batch["responses"])


def test_decode_attention_puts_the_models_own_back_after_an_error(model):
    with pytest.raises(ValueError, match="boom"):
        with shared_prefix.decode_attention(model):
            assert model.config._attn_implementation == shared_prefix.ATTENTION_NAME
            raise ValueError("boom")
    assert model.config._attn_implementation == "sdpa"


def test_cache_kwarg_names_the_forwards_argument(model):
    params = inspect.signature(type(model).forward).parameters
    assert cache_kwarg(model) in params
    assert cache_kwarg(model) == ("cache" if "cache" in params else "past_key_values")
