"""Tests of the `vllm` rollout engine (verl/workers/rollout/vllm_rollout.py) and of the worker extension it hands to
vLLM (verl/workers/rollout/vllm_worker_extension.py).

On CPU, without vLLM: the failure path (asking for vLLM without a GPU names the problem and the CPU choice); the pure
functions that map the rollout config to `vllm.LLM(...)` / `SamplingParams(...)` keyword arguments; the peft-name
check; what a LoRA actor sends this engine (plain HF names, W + alpha/r * B @ A computed here from the adapters);
and the weight path end to end: `load_weights_into_llm` -> `collective_rpc` -> `VLLMWorkerExtension.verl_load_weights`
-> the model's `load_weights`, into a tiny HF Qwen2. vLLM's own pieces are replaced there by the least that runs the
same calls in-process (`InProcessLLM`: `collective_rpc` runs the worker method, as vLLM's single-process executor
does; `LoadsHFNames`: `load_weights` copies each HF-named tensor into the parameter of that name, as vLLM's default
weight loader does for an unfused parameter); the check is a real forward pass against peft's own merged model.
vLLM's fused Qwen2 `load_weights` (q/k/v -> qkv_proj), sleep mode and generation need CUDA and vllm: marked `gpu`.
"""

import sys

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from verl.models.tiny import random_qwen2
from verl.protocol import DataProto
from verl.utils.torch_functional import compute_position_id_with_mask
from verl.workers.lora import apply_lora
from verl.workers.rollout import GPU_ENGINE_KEY_DEFAULTS, get_rollout_class
from verl.workers.rollout.base import SamplingSettings
from verl.workers.rollout.vllm_rollout import (
    VLLMRollout,
    load_weights_into_llm,
    sampled_log_probs,
    vllm_engine_kwargs,
    vllm_sampling_kwargs,
)
from verl.workers.rollout.vllm_worker_extension import (
    LOAD_WEIGHTS_METHOD,
    WORKER_EXTENSION_CLS,
    VLLMWorkerExtension,
    peft_name_problem,
)
from verl.workers.weight_sync import actor_weight_buckets, actor_weights, sync_mode

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
        "logprobs_mode": "processed_logprobs", "worker_extension_cls": WORKER_EXTENSION_CLS,
    }  # fmt: skip
    assert WORKER_EXTENSION_CLS == f"{VLLMWorkerExtension.__module__}.{VLLMWorkerExtension.__qualname__}"
    assert hasattr(VLLMWorkerExtension, LOAD_WEIGHTS_METHOD)
    # more than one rank: vLLM joins the workers' torch.distributed group (external_launcher), as verl's SPMD engine
    assert (
        vllm_engine_kwargs(rollout_config(), "/m", world_size=4)["distributed_executor_backend"] == "external_launcher"
    )
    assert "distributed_executor_backend" not in vllm_engine_kwargs(rollout_config(), "/m", world_size=1)
    assert vllm_engine_kwargs(rollout_config(load_format="dummy_dtensor"), "/m")["load_format"] == "dummy"  # verl's


def test_llm_kwargs_engine_kwargs_win_and_chunked_prefill_off_raises_the_token_budget():
    cfg = rollout_config(
        engine_kwargs={"vllm": {"swap_space": 4, "max_num_seqs": 8, "quantization": None}, "sglang": {"x": 1}}
    )
    got = vllm_engine_kwargs(cfg, "/m")
    assert got["swap_space"] == 4 and got["max_num_seqs"] == 8 and "quantization" not in got and "x" not in got
    got = vllm_engine_kwargs(rollout_config(enable_chunked_prefill=False, max_num_batched_tokens=10), "/m")
    assert got["max_num_batched_tokens"] == PROMPT_LEN + RESPONSE_LEN  # vLLM needs >= max_model_len (as verl does)


@pytest.mark.parametrize(
    "key, value",
    [("enable_lora", True), ("quantization", "fp8"), ("worker_extension_cls", "my.Extension")],
)
def test_llm_kwargs_refuse_what_the_engine_cannot_honour(key, value):
    with pytest.raises(ValueError, match=rf"engine_kwargs\.vllm\.{key}=.*remove it"):
        vllm_engine_kwargs(rollout_config(engine_kwargs={"vllm": {key: value}}), "/m")
    harmless = {"enable_lora": False, "worker_extension_cls": WORKER_EXTENSION_CLS}
    if key in harmless:
        assert (
            vllm_engine_kwargs(rollout_config(engine_kwargs={"vllm": {key: harmless[key]}}), "/m")[key] == harmless[key]
        )


def test_sampling_kwargs():
    sampling = SamplingSettings(do_sample=True, temperature=0.7, top_k=5, top_p=0.9)
    got = vllm_sampling_kwargs(sampling, 8, [2, 3], seed=11, want_log_probs=True)
    assert got == {"n": 1, "temperature": 0.7, "top_k": 5, "top_p": 0.9, "max_tokens": 8, "stop_token_ids": [2, 3],
                   "ignore_eos": False, "logprobs": 0, "seed": 11, "detokenize": False}  # fmt: skip
    greedy = SamplingSettings(do_sample=False, temperature=1.0, top_k=-1, top_p=1.0)
    got = vllm_sampling_kwargs(greedy, 8, [2], seed=0, want_log_probs=False, ignore_eos=True)
    assert got["temperature"] == 0.0 and got["logprobs"] is None
    assert got["ignore_eos"] is True and got["stop_token_ids"] == []


def test_sampled_log_probs_reads_the_sampled_tokens_entry():
    class Logprob:  # vLLM's `Logprob` holds `.logprob` (and rank, decoded token)
        def __init__(self, value):
            self.logprob = value

    steps = [{5: Logprob(-0.5), 9: Logprob(-1.0)}, {2: Logprob(-2.5)}]  # logprobs=0: the sampled token, maybe top-1
    assert sampled_log_probs([9, 2], steps) == [-1.0, -2.5]
    with pytest.raises(ValueError, match="no log-probs"):
        sampled_log_probs([9], None)


# ---------------------------------------------------------------------------------------------- weights
LORA = {"lora_rank": 4, "lora_alpha": 8}


def lora_actor(seed: int = 0) -> nn.Module:
    """A peft LoRA actor on a tiny untied Qwen2 whose adapters are non-zero (fresh ones have B = 0)."""
    actor = apply_lora(random_qwen2(seed), LORA)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if "lora_" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return actor


def test_peft_names_are_refused_and_hf_names_pass():
    for name in random_qwen2(0).state_dict():
        assert peft_name_problem(name) is None, name
    for name in lora_actor().state_dict():
        if name.startswith("base_model.model."):
            assert "must be merged" in peft_name_problem(name)


def test_a_lora_actor_reaches_vllm_merged_under_the_hf_names():
    """What the worker streams to this engine from a LoRA actor: exactly the HF model's state-dict names, and each
    LoRA layer's weight = W + (alpha / r) * B @ A, computed here from the peft layer's own tensors."""
    actor = lora_actor()
    mode = sync_mode(VLLMRollout, use_lora=True)
    assert mode == "merged"
    sent = dict(actor_weights(actor, mode=mode))
    assert sorted(sent) == sorted(random_qwen2(0).state_dict())  # untied: embed_tokens and lm_head both
    assert all(peft_name_problem(name) is None for name in sent)
    scale = LORA["lora_alpha"] / LORA["lora_rank"]
    merged_layers = 0
    for prefix, layer in actor.named_modules():
        if not hasattr(layer, "lora_A"):
            continue
        base = layer.base_layer.weight.detach()
        a, b = layer.lora_A["default"].weight.detach(), layer.lora_B["default"].weight.detach()
        name = prefix.removeprefix("base_model.model.") + ".weight"
        torch.testing.assert_close(sent[name], base + scale * b @ a, atol=1e-6, rtol=0, msg=name)
        assert not torch.allclose(sent[name], base)
        merged_layers += 1
    assert merged_layers == 2 * 7  # every linear of both layers (target_modules all-linear, lm_head excluded)
    torch.testing.assert_close(sent["lm_head.weight"], actor.base_model.model.lm_head.weight.detach())


class LoadsHFNames(nn.Module):
    """A HF model behind vLLM's `model.load_weights(weights=...)`: each `(HF name, tensor)` is copied into the
    parameter of that name (vLLM's default weight loader for an unfused parameter); an unknown name is a KeyError,
    as vLLM's own `params_dict[name]` lookup."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf

    @torch.no_grad()
    def load_weights(self, weights):
        params = dict(self.hf.named_parameters())
        loaded = set()
        for name, tensor in weights:
            params[name].copy_(tensor)
            loaded.add(name)
        return loaded


class Worker(VLLMWorkerExtension):
    """What vLLM does with `worker_extension_cls`: a worker class whose bases gain the extension; `get_model` is the
    worker's own method."""

    def __init__(self, model: nn.Module):
        self._model = model

    def get_model(self) -> nn.Module:
        return self._model


class InProcessLLM:
    """The `vllm.LLM` methods `load_weights_into_llm` calls, run in-process: `collective_rpc` runs the worker
    method on the one worker and returns its result in a list (vLLM's single-process executor); the memory calls are
    recorded."""

    def __init__(self, worker: Worker):
        self.worker = worker
        self.calls: list = []

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("collective_rpc", method, [name for name, _ in args[0]]))
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


def logits(model: nn.Module) -> torch.Tensor:
    ids = torch.arange(1, 13).reshape(2, 6)
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("form", ["buckets", "pairs", "state_dict"])
def test_weights_load_through_collective_rpc_and_the_worker_extension(form):
    """A LoRA actor's merged weights, in each form `update_weights` takes, loaded bucket by bucket into another
    model through the extension's `verl_load_weights`: afterwards it computes what peft's merge_and_unload does."""
    actor = lora_actor()
    engine_model = random_qwen2(7).eval()  # other weights: everything must be overwritten
    llm = InProcessLLM(Worker(LoadsHFNames(engine_model)))
    bucket = 8 * 1024
    mode = sync_mode(VLLMRollout, use_lora=True)
    weights = {
        "buckets": lambda: actor_weight_buckets(actor, bucket, mode=mode),
        "pairs": lambda: actor_weights(actor, mode=mode),
        "state_dict": lambda: dict(actor_weights(actor, mode=mode)),
    }[form]()
    loaded = load_weights_into_llm(llm, weights, bucket, torch.float32, sleeps=True)

    assert loaded == len(engine_model.state_dict())
    rpcs = [c for c in llm.calls if c[0] == "collective_rpc"]
    assert len(rpcs) > 2 and all(c[1] == LOAD_WEIGHTS_METHOD for c in rpcs)
    assert llm.calls[0] == ("wake_up", ["weights"]) and llm.calls[-2:] == [("reset_prefix_cache",), ("sleep", 1)]
    reference = lora_actor().merge_and_unload().eval()
    torch.testing.assert_close(logits(engine_model), logits(reference), atol=1e-5, rtol=0)


def test_a_peft_named_weight_is_refused_after_the_stream_is_read_to_its_end():
    actor = lora_actor()
    engine_model = random_qwen2(7).eval()
    llm = InProcessLLM(Worker(LoadsHFNames(engine_model)))
    read = []

    def stream():  # under FSDP2 every item is a collective: all of it must be read
        for name, tensor in actor.state_dict().items():  # peft names
            read.append(name)
            yield name, tensor

    with pytest.raises(ValueError, match="peft name part.*must be merged"):
        load_weights_into_llm(llm, stream(), 1024, None, sleeps=True)
    assert len(read) == len(actor.state_dict())
    assert not any(c[0] == "collective_rpc" for c in llm.calls)  # nothing loaded
    assert llm.calls[-1] == ("sleep", 1)  # back to sleep all the same
    with pytest.raises(ValueError, match="peft name part"):  # the extension checks too, before loading
        Worker(LoadsHFNames(engine_model)).verl_load_weights([("base_model.model.lm_head.weight", torch.zeros(1))])


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
    pytest.importorskip("vllm")
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
