"""Tests of the lean decode step (verl/cpu/lean_decode.py): the `hf` rollout decoding through it gives
HF's forward's samples and log-probs on Qwen2, Qwen3 and Llama models (biases, per-head norms, scaled rotary
embeddings), in the shared-prompt and the per-row cache, and the models it cannot run keep HF's forward."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from tests.workers.test_hf_rollout import full_forward_log_probs, make_prompts, recorded_forwards, rollout_config
from verl.cpu import decode_kernel, lean_decode
from verl.workers.rollout.hf_rollout import HFRollout

SHAPE = dict(vocab_size=2048, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, max_position_embeddings=256)  # fmt: skip


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "qwen2":  # biases on q, k, v
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **SHAPE))
    elif kind == "qwen2_head32":  # a head size the fused decode kernel takes: its one-call step (`_fused_step`)
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **{**SHAPE, "hidden_size": 128}))
    elif kind == "qwen3":  # per-head q/k norms, a head_dim that is not hidden / heads
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=32, **SHAPE))
    else:  # biases everywhere, llama3's rotary scaling
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
        model = LlamaForCausalLM(LlamaConfig(attention_bias=True, mlp_bias=True, rope_parameters=rope, **SHAPE))
    with torch.no_grad():  # norms away from 1 and non-zero biases, so a norm or a bias left out shows
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
    model.config._attn_implementation = "sdpa"
    return model.eval()


@pytest.mark.parametrize("kind", ["qwen2", "qwen2_head32", "qwen3", "llama"])
@pytest.mark.parametrize("samples", [3, 1], ids=["shared_prefix", "per_row_cache"])
def test_lean_steps_sample_what_hfs_forward_samples(kind, samples, tokenizer, monkeypatch):
    """Sampling with log-probs, rows stopping at an eos: the lean steps give HF's forward's tokens
    and log-probs (within 1e-5), which equal a full forward over prompt + response. With the shared-prompt cache
    and a head size of 32 (qwen2_head32, qwen3) the steps run through the fused kernel's one-call step."""
    model = _model(kind)
    assert lean_decode.applies_to(model)
    fused_steps = []
    fused_step = lean_decode.LeanDecoder._fused_step
    monkeypatch.setattr(lean_decode.LeanDecoder, "_fused_step",
                        lambda self, *a: fused_steps.append(1) or fused_step(self, *a))  # fmt: skip

    def generate(lean: bool, eos: int | list[int]):
        rollout = HFRollout(model, rollout_config(calculate_log_probs=True, response_length=12), tokenizer)
        rollout.lean_decode = lean
        with recorded_forwards(model) as calls:
            out = rollout.generate_sequences(make_prompts(tokenizer, seed=5, eos_token_id=eos).repeat(samples))
        return out, calls

    free, _ = generate(False, 2047)
    eos = [int(free.batch["responses"][0, 3]), int(free.batch["responses"][-1, 6])]  # two rows stop early
    hf, hf_calls = generate(False, eos)
    lean, lean_calls = generate(True, eos)
    lengths = lean.batch["response_mask"].sum(-1)
    assert lengths.min() < lengths.max() == 12
    assert torch.equal(lean.batch["responses"], hf.batch["responses"])
    torch.testing.assert_close(lean.batch["rollout_log_probs"], hf.batch["rollout_log_probs"], atol=1e-5, rtol=0)
    ref = full_forward_log_probs(model, lean, 1.0) * lean.batch["response_mask"]
    torch.testing.assert_close(lean.batch["rollout_log_probs"], ref, atol=1e-5, rtol=0)
    # the same rows per step both ways; with the lean steps the model's own forward runs only the prefills
    assert sorted(c[1:] for c in lean_calls) == sorted(c[1:] for c in hf_calls)
    assert lean_calls[0][2] > 1 and len(lean_calls) > 1  # the prefill, then the lean steps as recorded calls
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    fused = samples > 1 and head_dim % 32 == 0 and decode_kernel.available()
    assert bool(fused_steps) == fused


def test_models_it_cannot_run_keep_hfs_forward(tokenizer):
    eager = _model("qwen2")
    eager.config._attn_implementation = "eager"
    gelu = Qwen2ForCausalLM(Qwen2Config(hidden_act="gelu", **SHAPE))
    gelu.config._attn_implementation = "sdpa"
    dynamic = Qwen2ForCausalLM(Qwen2Config(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                            "rope_theta": 10000.0}, **SHAPE))  # fmt: skip
    dynamic.config._attn_implementation = "sdpa"
    assert not any(lean_decode.applies_to(m) for m in (eager, gelu, dynamic))
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(_model("qwen2"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert not lean_decode.applies_to(lora) and not lean_decode.applies_to(lora.base_model.model)
    # a LoRA model still generates (through HF's forward), with its adapters
    rollout = HFRollout(lora.base_model.model, rollout_config(), tokenizer)
    with recorded_forwards(lora.base_model.model) as calls:
        rollout.generate_sequences(make_prompts(tokenizer))
    assert len(calls) == rollout.response_length and all(length == 1 for _, _, length in calls[1:])
