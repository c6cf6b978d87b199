"""Tests of the `sglang` rollout engine (verl/workers/rollout/sglang_rollout/).

On CPU: the failure path (asking for SGLang without a GPU or without sglang names the problem and the CPU choice),
the pure functions that map the rollout config to `sglang.Engine(...)` keyword arguments and to one request's
sampling params, which memory may be released (weights only with a host backup) and the release/resume order
against a recording engine. The generation test needs CUDA and sglang and is marked `gpu`: it compares log-probs
with HF's, before and after a weight update, and across two generations without an update in between (released
weights must come back intact).
"""

import sys

import pytest
import torch
from omegaconf import OmegaConf

from verl.workers.rollout import GPU_ENGINE_KEY_DEFAULTS, get_rollout_class
from verl.workers.rollout.base import SamplingSettings
from verl.workers.rollout.gpu_engines import EngineMemory
from verl.workers.rollout.sglang_rollout import (
    MEMORY_TAGS,
    releasable_tags,
    sglang_engine_kwargs,
    sglang_sampling_params,
)

from .test_vllm_rollout import PROMPT_LEN, RESPONSE_LEN, TEXTS, hf_log_probs, make_prompts


def rollout_config(**overrides):
    cfg = dict(
        name="sglang", temperature=1.0, top_k=-1, top_p=1.0, do_sample=True, prompt_length=PROMPT_LEN,
        response_length=RESPONSE_LEN, calculate_log_probs=True, seed=0, dtype="float32",
        gpu_memory_utilization=0.3, tensor_model_parallel_size=1,
        val_kwargs=dict(n=1, do_sample=False, temperature=0, top_k=-1, top_p=1.0),
    )  # fmt: skip
    cfg.update(overrides)
    return OmegaConf.create(cfg)


# rollout key -> (a value other than verl's default, the sglang.Engine keyword, the value it must get)
SGLANG_KEYS = {
    "load_format": ("safetensors", "load_format", "safetensors"),
    "gpu_memory_utilization": (0.37, "mem_fraction_static", 0.37),
    "tensor_model_parallel_size": (3, "tp_size", 3),
    "enforce_eager": (True, "disable_cuda_graph", True),
    "max_num_batched_tokens": (4321, "chunked_prefill_size", 4321),
    "max_model_len": (999, "context_length", 999),
    "max_num_seqs": (17, "max_running_requests", 17),
    "enable_chunked_prefill": (False, "chunked_prefill_size", -1),
    "enable_prefix_caching": (False, "disable_radix_cache", True),
    "disable_log_stats": (False, "enable_metrics", True),
    "seed": (1234, "random_seed", 1234),
    "dtype": ("float16", "dtype", "float16"),
}


def test_engine_kwargs_carry_every_engine_key():
    # free_cache_engine is read by SGLangRollout (release/resume_memory_occupation), not by Engine(...)
    assert set(GPU_ENGINE_KEY_DEFAULTS) - {"free_cache_engine"} <= set(SGLANG_KEYS)
    for key, (value, kwarg, expected) in SGLANG_KEYS.items():
        got = sglang_engine_kwargs(rollout_config(**{key: value}), "/m")
        assert got[kwarg] == expected, (key, got[kwarg])
    defaults = sglang_engine_kwargs(OmegaConf.create(dict(prompt_length=16, response_length=8)), "/m", True)
    assert defaults == {
        "model_path": "/m", "dtype": "bfloat16", "load_format": "dummy", "trust_remote_code": True,
        "mem_fraction_static": 0.5, "disable_cuda_graph": False, "tp_size": 1, "context_length": 24,
        "max_running_requests": 256, "chunked_prefill_size": 8192, "disable_radix_cache": False,
        "enable_metrics": False, "random_seed": 0, "enable_memory_saver": True, "skip_tokenizer_init": True,
        "log_level": "error", "enable_weights_cpu_backup": True,
    }  # fmt: skip
    assert "enable_weights_cpu_backup" not in sglang_engine_kwargs(rollout_config(), "/m", knows_weights_backup=False)
    assert "enable_weights_cpu_backup" not in sglang_engine_kwargs(rollout_config(free_cache_engine=False), "/m")
    cfg = rollout_config(engine_kwargs={"sglang": {"attention_backend": "fa3", "tp_size": 2}, "vllm": {"x": 1}})
    got = sglang_engine_kwargs(cfg, "/m")
    assert got["attention_backend"] == "fa3" and got["tp_size"] == 2 and "x" not in got


def test_weights_are_released_only_with_a_host_backup_and_resumed_before_the_kv_cache():
    """Released weights without enable_weights_cpu_backup are gone: then only the KV cache and CUDA graphs are
    released. An update resumes the weights and leaves them resident; a generation resumes the rest and releases
    everything; two generations in a row resume everything, weights first."""
    assert releasable_tags({"enable_weights_cpu_backup": True}) == MEMORY_TAGS == ("weights", "kv_cache", "cuda_graph")
    assert releasable_tags({}) == ("kv_cache", "cuda_graph")
    calls = []
    memory = EngineMemory(lambda t: calls.append(("release", t)), lambda t: calls.append(("resume", t)), MEMORY_TAGS,
                          True)  # fmt: skip
    memory.release(), memory.resume("weights"), memory.resume(), memory.release(), memory.resume(), memory.release()
    assert calls == [
        ("release", list(MEMORY_TAGS)), ("resume", ["weights"]), ("resume", ["kv_cache", "cuda_graph"]),
        ("release", list(MEMORY_TAGS)), ("resume", list(MEMORY_TAGS)), ("release", list(MEMORY_TAGS)),
    ]  # fmt: skip
    calls.clear()
    memory = EngineMemory(lambda t: calls.append(("release", t)), lambda t: calls.append(("resume", t)),
                          releasable_tags({}), True)  # fmt: skip
    memory.release(), memory.resume("weights"), memory.resume(), memory.release()
    assert calls == [("release", ["kv_cache", "cuda_graph"]), ("resume", ["kv_cache", "cuda_graph"]),
                     ("release", ["kv_cache", "cuda_graph"])]  # fmt: skip


def test_sampling_params():
    sampling = SamplingSettings(do_sample=True, temperature=0.7, top_k=5, top_p=0.9)
    assert sglang_sampling_params(sampling, 8, [2, 3], seed=11) == {
        "temperature": 0.7, "top_k": 5, "top_p": 0.9, "max_new_tokens": 8, "stop_token_ids": [2, 3],
        "ignore_eos": False, "sampling_seed": 11, "skip_special_tokens": False,
    }  # fmt: skip
    greedy = SamplingSettings(do_sample=False, temperature=1.0, top_k=-1, top_p=1.0)
    got = sglang_sampling_params(greedy, 8, [2], seed=0, ignore_eos=True)
    assert got["temperature"] == 0.0 and got["ignore_eos"] is True and got["stop_token_ids"] == []


def test_registry_is_lazy_about_sglang():
    get_rollout_class("sglang")
    assert "sglang" not in sys.modules or torch.cuda.is_available()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU failure message")
def test_sglang_on_cpu_fails_with_a_clear_message(tmp_path):
    with pytest.raises(RuntimeError, match=r"'sglang' needs a CUDA GPU.*rollout\.name=hf"):
        get_rollout_class("sglang")(str(tmp_path), rollout_config())


@pytest.mark.gpu
def test_sglang_log_probs_follow_the_weights_across_release_and_resume(tiny_model_dir):
    """On a CUDA GPU with sglang: built from dummy weights, given the model's through update_weights; its log-probs
    are HF's; a second generation without an update (weights released and resumed in between) gives the same
    greedy tokens and log-probs; after the weights move, the log-probs are the new model's."""
    pytest.importorskip("sglang")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rollout = get_rollout_class("sglang")(tiny_model_dir, rollout_config(load_format="dummy"), tokenizer, device="cuda")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).cuda().eval()

    rollout.update_weights({k: v.detach().clone() for k, v in model.state_dict().items()})
    out = rollout.generate_sequences(make_prompts(tokenizer, seed=1, validate=True))
    assert out.batch["responses"].shape == (len(TEXTS), RESPONSE_LEN)
    torch.testing.assert_close(out.batch["rollout_log_probs"], hf_log_probs(model, out), atol=1e-3, rtol=0)
    again = rollout.generate_sequences(make_prompts(tokenizer, seed=1, validate=True))
    assert torch.equal(out.batch["responses"], again.batch["responses"])
    torch.testing.assert_close(again.batch["rollout_log_probs"], out.batch["rollout_log_probs"], atol=1e-4, rtol=0)

    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    rollout.update_weights({k: v.detach().clone() for k, v in model.state_dict().items()})
    new = rollout.generate_sequences(make_prompts(tokenizer, seed=1, validate=True))
    torch.testing.assert_close(new.batch["rollout_log_probs"], hf_log_probs(model, new), atol=1e-3, rtol=0)
