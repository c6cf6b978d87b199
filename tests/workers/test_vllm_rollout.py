"""Tests of the `vllm` rollout engine (verl/workers/rollout/vllm_rollout.py).

On CPU: the failure path (asking for vLLM without a GPU or without vllm names the problem and the CPU choice) and
the pure functions that map the rollout config to `vllm.LLM(...)` / `SamplingParams(...)` keyword arguments. The
generation tests need CUDA and vllm and are marked `gpu`.
"""

import sys

import pytest
import torch
from omegaconf import OmegaConf

from verl.protocol import DataProto
from verl.utils.torch_functional import compute_position_id_with_mask
from verl.workers.rollout import GPU_ENGINE_KEY_DEFAULTS, get_rollout_class
from verl.workers.rollout.base import SamplingSettings
from verl.workers.rollout.vllm_rollout import vllm_engine_kwargs, vllm_sampling_kwargs

PROMPT_LEN, RESPONSE_LEN = 16, 8
TEXTS = ["How many apples does Weng have?", "Hi", "Convert 5 dollars to euro please, now.", "What time is it"]


def rollout_config(**overrides):
    cfg = dict(
        name="vllm", temperature=1.0, top_k=-1, top_p=1.0, do_sample=True, prompt_length=PROMPT_LEN,
        response_length=RESPONSE_LEN, calculate_log_probs=True, seed=0, dtype="float32",
        gpu_memory_utilization=0.3, tensor_model_parallel_size=1,
        val_kwargs=dict(n=1, do_sample=False, temperature=0, top_k=-1, top_p=1.0),
    )  # fmt: skip
    cfg.update(overrides)
    return OmegaConf.create(cfg)


def make_prompts(tokenizer, **meta) -> DataProto:
    ids = torch.full((len(TEXTS), PROMPT_LEN), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, text in enumerate(TEXTS):
        tok = tokenizer(text)["input_ids"][:PROMPT_LEN]
        ids[i, PROMPT_LEN - len(tok) :], mask[i, PROMPT_LEN - len(tok) :] = torch.tensor(tok), 1
    meta.setdefault("eos_token_id", tokenizer.eos_token_id)
    meta.setdefault("pad_token_id", tokenizer.pad_token_id)
    return DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": mask, "position_ids": compute_position_id_with_mask(mask)},
        meta_info=meta,
    )


# rollout key -> (a value other than verl's default, the vllm.LLM keyword it must reach)
VLLM_KEYS = {
    "load_format": ("safetensors", "load_format"),
    "gpu_memory_utilization": (0.37, "gpu_memory_utilization"),
    "tensor_model_parallel_size": (3, "tensor_parallel_size"),
    "enforce_eager": (True, "enforce_eager"),
    "free_cache_engine": (False, "enable_sleep_mode"),
    "max_num_batched_tokens": (4321, "max_num_batched_tokens"),
    "max_model_len": (999, "max_model_len"),
    "max_num_seqs": (17, "max_num_seqs"),
    "enable_chunked_prefill": (False, "enable_chunked_prefill"),
    "enable_prefix_caching": (False, "enable_prefix_caching"),
    "disable_log_stats": (False, "disable_log_stats"),
    "seed": (1234, "seed"),
    "dtype": ("float16", "dtype"),
}


def test_llm_kwargs_carry_every_engine_key():
    assert set(GPU_ENGINE_KEY_DEFAULTS) <= set(VLLM_KEYS)  # a new engine key needs a row here
    for key, (value, kwarg) in VLLM_KEYS.items():
        got = vllm_engine_kwargs(rollout_config(**{key: value}), "/m")
        assert got[kwarg] == value, (key, got[kwarg])
    defaults = vllm_engine_kwargs(OmegaConf.create(dict(prompt_length=16, response_length=8)), "/m", True)
    assert defaults == {
        "model": "/m", "dtype": "bfloat16", "load_format": "dummy", "trust_remote_code": True, "max_model_len": 24,
        "max_num_seqs": 256, "max_num_batched_tokens": 8192, "enable_chunked_prefill": True,
        "enable_prefix_caching": True, "enable_sleep_mode": True, "enforce_eager": False,
        "gpu_memory_utilization": 0.5, "disable_log_stats": True, "tensor_parallel_size": 1, "seed": 0,
        "logprobs_mode": "processed_logprobs",
    }  # fmt: skip


def test_llm_kwargs_engine_kwargs_win_and_chunked_prefill_off_raises_the_token_budget():
    cfg = rollout_config(
        engine_kwargs={"vllm": {"swap_space": 4, "max_num_seqs": 8, "quantization": None}, "sglang": {"x": 1}}
    )
    got = vllm_engine_kwargs(cfg, "/m")
    assert got["swap_space"] == 4 and got["max_num_seqs"] == 8 and "quantization" not in got and "x" not in got
    got = vllm_engine_kwargs(rollout_config(enable_chunked_prefill=False, max_num_batched_tokens=10), "/m")
    assert got["max_num_batched_tokens"] == PROMPT_LEN + RESPONSE_LEN  # vLLM needs >= max_model_len (as verl does)


def test_sampling_kwargs():
    sampling = SamplingSettings(do_sample=True, temperature=0.7, top_k=5, top_p=0.9)
    got = vllm_sampling_kwargs(sampling, 8, [2, 3], seed=11, want_log_probs=True)
    assert got == {"n": 1, "temperature": 0.7, "top_k": 5, "top_p": 0.9, "max_tokens": 8, "stop_token_ids": [2, 3],
                   "ignore_eos": False, "logprobs": 0, "seed": 11, "detokenize": False}  # fmt: skip
    greedy = SamplingSettings(do_sample=False, temperature=1.0, top_k=-1, top_p=1.0)
    got = vllm_sampling_kwargs(greedy, 8, [2], seed=0, want_log_probs=False, ignore_eos=True)
    assert got["temperature"] == 0.0 and got["logprobs"] is None
    assert got["ignore_eos"] is True and got["stop_token_ids"] == []


def test_registry_is_lazy_about_vllm():
    get_rollout_class("vllm")
    assert "vllm" not in sys.modules or torch.cuda.is_available()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU failure message")
def test_vllm_on_cpu_fails_with_a_clear_message(tmp_path):
    cls = get_rollout_class("vllm")
    with pytest.raises(RuntimeError, match=r"needs a CUDA GPU.*rollout\.name=hf"):
        cls(str(tmp_path), rollout_config())


@pytest.mark.gpu
def test_vllm_generates_with_log_probs_matching_hf_and_takes_new_weights(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rollout = get_rollout_class("vllm")(tiny_model_dir, rollout_config(), tokenizer)
    out = rollout.generate_sequences(make_prompts(tokenizer, seed=1))
    assert out.batch["responses"].shape == (len(TEXTS), RESPONSE_LEN)
    again = rollout.generate_sequences(make_prompts(tokenizer, seed=1))
    assert torch.equal(out.batch["responses"], again.batch["responses"])

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).cuda().eval()

    def hf_log_probs(batch: DataProto) -> torch.Tensor:
        with torch.no_grad():
            logits = (
                model(
                    input_ids=batch.batch["input_ids"].cuda(),
                    attention_mask=batch.batch["attention_mask"].cuda(),
                    position_ids=batch.batch["position_ids"].cuda(),
                )
                .logits[:, -RESPONSE_LEN - 1 : -1]
                .float()
            )
        lp = torch.log_softmax(logits, -1).gather(-1, batch.batch["responses"].cuda().unsqueeze(-1)).squeeze(-1)
        return lp.cpu() * batch.batch["response_mask"]

    torch.testing.assert_close(out.batch["rollout_log_probs"], hf_log_probs(out), atol=1e-3, rtol=0)

    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    rollout.update_weights({k: v.cpu() for k, v in model.state_dict().items()})
    new = rollout.generate_sequences(make_prompts(tokenizer, seed=1))
    torch.testing.assert_close(new.batch["rollout_log_probs"], hf_log_probs(new), atol=1e-3, rtol=0)
