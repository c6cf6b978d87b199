"""Tests of the `vllm` rollout engine (verl/workers/rollout/vllm_rollout.py).

On CPU only the failure path runs: asking for vLLM without a GPU (or without vllm) names the problem and the
CPU choice. The generation tests need CUDA and vllm and are marked `gpu`.
"""

import sys

import pytest
import torch
from omegaconf import OmegaConf

from verl.protocol import DataProto
from verl.utils.torch_functional import compute_position_id_with_mask
from verl.workers.rollout import get_rollout_class

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
