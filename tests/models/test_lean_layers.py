"""The memory-lean RMSNorm / SwiGLU backward (verl/models/lean_layers.py): same forward and gradients as HF's
layers, fewer saved activations, HF's code wherever the lean path does not apply, and the engine's switch."""

import copy

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from verl.models.lean_layers import LeanRMSNorm, LeanSwiGLU, apply_lean_layers


def _tiny(config_cls, **extra):
    config = config_cls(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=88,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        **extra,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()


def _loss_and_grads(model, ids):
    model.zero_grad()
    logits = model(input_ids=ids).logits
    loss = torch.log_softmax(logits, -1).gather(-1, ids.unsqueeze(-1)).mean()
    loss.backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _saved_bytes(model, ids) -> int:
    """Bytes of the activations the forward keeps for backward (storages other than the parameters)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids)
    return sum(saved.values())


@pytest.mark.parametrize("config_cls", [Qwen2Config, Qwen3Config, LlamaConfig])
def test_lean_model_gives_hf_logits_and_gradients_with_a_third_less_saved(config_cls):
    hf = _tiny(config_cls)
    lean = copy.deepcopy(hf)
    layers = hf.config.num_hidden_layers
    norms_per_layer = 4 if config_cls is Qwen3Config else 2  # qwen3 also normalises q and k
    assert apply_lean_layers(lean) == layers * (norms_per_layer + 1) + 1  # + the final norm
    assert apply_lean_layers(lean) == 0  # idempotent
    ids = torch.randint(0, 96, (3, 40))
    logits_hf, grads_hf = _loss_and_grads(hf, ids)
    logits_lean, grads_lean = _loss_and_grads(lean, ids)
    assert torch.equal(logits_hf, logits_lean)
    for name, grad in grads_hf.items():
        torch.testing.assert_close(grads_lean[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    hf_bytes, lean_bytes = _saved_bytes(hf, ids), _saved_bytes(lean, ids)
    assert lean_bytes < 0.75 * hf_bytes, (lean_bytes, hf_bytes)


def test_rms_norm_function_against_autograd_of_the_formula_in_bfloat16_and_float32():
    torch.manual_seed(1)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2)):
        x = torch.randn(2, 5, 16, dtype=dtype, requires_grad=True)
        w = (1 + 0.1 * torch.randn(16)).to(dtype).requires_grad_(True)
        dy = torch.randn(2, 5, 16, dtype=dtype)
        xf = x.float()
        ref = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
        ref_dx, ref_dw = torch.autograd.grad(ref, (x, w), dy)
        out = LeanRMSNorm.apply(x, w, 1e-6)
        dx, dw = torch.autograd.grad(out, (x, w), dy)
        assert torch.equal(out, ref)
        torch.testing.assert_close(dx, ref_dx, rtol=tol, atol=tol)
        torch.testing.assert_close(dw, ref_dw, rtol=tol, atol=tol)
        # one gradient at a time: a frozen weight (LoRA), an input that needs none (the first layer's norm
        # under a frozen embedding)
        (dx_only,) = torch.autograd.grad(LeanRMSNorm.apply(x, w.detach(), 1e-6), (x,), dy)
        (dw_only,) = torch.autograd.grad(LeanRMSNorm.apply(x.detach(), w, 1e-6), (w,), dy)
        torch.testing.assert_close(dx_only, ref_dx, rtol=tol, atol=tol)
        torch.testing.assert_close(dw_only, ref_dw, rtol=tol, atol=tol)


def test_swiglu_function_against_autograd_of_the_formula_and_only_needed_gradients():
    torch.manual_seed(2)
    x = torch.randn(7, 12, dtype=torch.float64, requires_grad=True)
    wg, wu = torch.randn(20, 12, dtype=torch.float64), torch.randn(20, 12, dtype=torch.float64, requires_grad=True)
    wd = torch.randn(12, 20, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: LeanSwiGLU.apply(a, wg, b, c), (x, wu, wd))
    ref = nn.functional.linear(nn.functional.silu(x @ wg.T) * (x @ wu.T), wd)
    torch.testing.assert_close(LeanSwiGLU.apply(x, wg, wu, wd), ref)


def test_hf_code_runs_without_autograd_and_for_wrapped_or_biased_projections():
    model = _tiny(LlamaConfig, mlp_bias=True)
    apply_lean_layers(model)
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 3, 32, requires_grad=True)
    calls = []
    original = LeanSwiGLU.apply
    LeanSwiGLU.apply = lambda *args: calls.append(1) or original(*args)
    try:
        mlp(x).sum().backward()  # biased projections: HF's forward (the lean function has no bias)
        mlp.gate_proj.bias, mlp.up_proj.bias, mlp.down_proj.bias = None, None, None
        with torch.no_grad():
            mlp(x)  # nothing recorded: HF's forward
        assert calls == []
        mlp(x).sum().backward()
        assert calls == [1]
        inner = mlp.gate_proj
        mlp.gate_proj = nn.Sequential(inner)  # what an adapter wrapper looks like to the check
        torch.testing.assert_close(mlp(x), mlp._hf_forward(x))
        assert calls == [1]
    finally:
        LeanSwiGLU.apply = original


def test_unsupported_model_type_is_refused_with_its_name():
    model = nn.Linear(2, 2)
    model.config = type("Config", (), {"model_type": "gemma"})()
    with pytest.raises(ValueError, match="'gemma'.*lean_activations=false"):
        apply_lean_layers(model)


@pytest.mark.usefixtures("own_process_group")  # the engine starts a one-process group here
def test_engine_switch_trains_the_same_step_as_hf_layers(tiny_model_dir):
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    data = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    grads = {}
    for lean in (False, True):
        engine = FSDPEngine(
            model_config={"path": tiny_model_dir, "lean_activations": lean}, optimizer_config={"lr": 1e-2}
        )
        engine.initialize()
        assert any(hasattr(m, "_hf_forward") for m in engine.module.modules()) == lean
        engine.train_batch(data, lambda logits, mb: logits.logsumexp(-1).mean(), lambda mb: 1.0)
        grads[lean] = {name: p.grad.full_tensor().clone() for name, p in engine.module.named_parameters()}
    for name, value in grads[False].items():  # the step's gradients (AdamW's step turns rounding into +-lr)
        torch.testing.assert_close(grads[True][name], value, rtol=1e-4, atol=1e-7, msg=name)
    frozen = FSDPEngine(model_config={"path": tiny_model_dir, "lean_activations": True}, forward_only=True)
    frozen.initialize()  # a frozen reference keeps HF's layers: nothing to save for
    assert not any(hasattr(m, "_hf_forward") for m in frozen.module.modules())


def test_value_model_loader_switches_its_layers(tiny_model_dir):
    from verl.utils.fsdp_utils import load_token_classification_model

    lean = load_token_classification_model(tiny_model_dir, lean_activations=True)
    plain = load_token_classification_model(tiny_model_dir)
    assert sum(hasattr(m, "_hf_forward") for m in lean.modules()) == 3 * lean.config.num_hidden_layers + 1
    assert not any(hasattr(m, "_hf_forward") for m in plain.modules())
