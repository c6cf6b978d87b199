"""The rotary embedding in fewer passes (verl/models/lean_rotary.py): forward and gradients equal bit for bit to
HF's `apply_rotary_pos_emb`, on its own and inside qwen2/qwen3/llama models, and HF's function for what it does
not cover."""

import copy
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config
from transformers.models.qwen2 import modeling_qwen2

from verl.models.lean_layers import apply_lean_layers
from verl.models.lean_rotary import LeanRotary, use_lean_rotary


def _hf_apply(modeling=modeling_qwen2):
    current = modeling.apply_rotary_pos_emb
    return getattr(current, "hf_apply", current)  # HF's own, whether or not a test switched it already


def _cos_sin(tokens: int, head_dim: int, dtype=torch.float32):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(tokens).float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos()[None].to(dtype), emb.sin()[None].to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_and_its_gradient_equal_hfs_bit_for_bit(dtype):
    torch.manual_seed(0)
    cos, sin = _cos_sin(50, 16, dtype)
    # queries as the attention makes them: (batch, tokens, heads, dim) viewed as (batch, heads, tokens, dim)
    q = torch.randn(1, 50, 4, 16, dtype=dtype).transpose(1, 2).requires_grad_()
    grad = torch.randn(1, 4, 50, 16, dtype=dtype)
    hf_q, _ = _hf_apply()(q, q.detach(), cos, sin)
    (hf_grad,) = torch.autograd.grad(hf_q, q, grad)
    lean_q = LeanRotary.apply(q, cos.unsqueeze(1), sin.unsqueeze(1))
    (lean_grad,) = torch.autograd.grad(lean_q, q, grad)
    assert torch.equal(lean_q, hf_q) and torch.equal(lean_grad, hf_grad)
    assert lean_q.stride() == hf_q.stride()  # the same memory layout for the attention after it
    assert lean_grad.stride() == hf_grad.stride()  # and for the layer before it
    assert not torch.equal(lean_grad, grad)  # a rotation, not the identity


def _loss_and_grads(model, ids):
    model.zero_grad()
    logits = model(input_ids=ids).logits
    torch.log_softmax(logits, -1).gather(-1, ids.unsqueeze(-1)).mean().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("config_cls", [Qwen2Config, Qwen3Config, LlamaConfig])
def test_models_with_the_lean_rotary_give_hfs_logits_and_gradients(config_cls, monkeypatch):
    config = config_cls(vocab_size=96, hidden_size=32, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()
    modeling = sys.modules[type(model.model.layers[0].self_attn).__module__]
    hf_apply = _hf_apply(modeling)
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", hf_apply)  # HF's, restored after the test
    ids = torch.randint(0, 96, (3, 20))
    hf_logits, hf_grads = _loss_and_grads(model, ids)
    lean_model = copy.deepcopy(model)
    assert use_lean_rotary(lean_model) == 1 and use_lean_rotary(lean_model) == 0  # once per modeling module
    assert modeling.apply_rotary_pos_emb.hf_apply is hf_apply
    calls = []
    original_apply = LeanRotary.apply
    monkeypatch.setattr(LeanRotary, "apply", lambda *args: calls.append(1) or original_apply(*args))
    lean_logits, lean_grads = _loss_and_grads(lean_model, ids)
    assert len(calls) == 2 * config.num_hidden_layers  # queries and keys of every layer
    assert torch.equal(lean_logits, hf_logits)
    assert all(torch.equal(lean_grads[name], hf_grads[name]) for name in hf_grads)
    with torch.no_grad():  # no autograd: the same rotation without the Function
        assert torch.equal(lean_model(input_ids=ids).logits, hf_logits)
    assert len(calls) == 2 * config.num_hidden_layers


def test_apply_lean_layers_switches_the_rotary_and_other_inputs_go_to_hf(monkeypatch):
    monkeypatch.setattr(modeling_qwen2, "apply_rotary_pos_emb", _hf_apply())
    config = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=88, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    apply_lean_layers(AutoModelForCausalLM.from_config(config))
    lean_apply = modeling_qwen2.apply_rotary_pos_emb
    assert lean_apply.hf_apply is _hf_apply()
    calls = []
    original_apply = LeanRotary.apply
    monkeypatch.setattr(LeanRotary, "apply", lambda *args: calls.append(1) or original_apply(*args))
    q = torch.randn(1, 4, 10, 16, requires_grad=True)
    cos, sin = _cos_sin(10, 16, torch.float64)  # another dtype than q: HF's promotion, not the lean path
    out, _ = lean_apply(q, q, cos, sin)
    assert not calls and out.dtype == torch.float64
    assert torch.equal(out, _hf_apply()(q, q, cos, sin)[0])
