"""Tests of verl/workers/weight_sync.py: the actor's weights streamed bucket by bucket into a rollout engine.

Pure parts (names, LoRA merge, buckets, the engines' stream readers) on plain tiny Qwen2 models; then 1- and 2-rank
FSDP2 runs over gloo (forked processes) where, after a sync, the hf engine's log-probs equal the actor's (fp32,
1e-5) with and without LoRA, and the gathered bytes alive never exceed one tensor (tensor-by-tensor engines) or
one bucket plus the largest tensor (engines that take buckets, as sglang).
"""

import os
import tempfile

import pytest
import torch
from torch import nn

from tests.multirank import run_ranks
from verl.models.tiny import random_qwen2
from verl.utils.fsdp_utils import free_port
from verl.workers.lora import apply_lora
from verl.workers.rollout.base import engine_dtype, named_tensor_stream
from verl.workers.rollout.gpu_engines import weight_buckets_by_size
from verl.workers.rollout.hf_rollout import HFRollout
from verl.workers.weight_sync import (
    GatherStats,
    actor_weight_buckets,
    actor_weights,
    bucket_bytes,
    engine_name,
    merge_lora_weight,
    merged_lora_name,
    sync_mode,
)

LORA = {"lora_rank": 4, "lora_alpha": 8}
BUCKET = 8 * 1024  # bytes: the tiny model's matrices are 2-13 KB, so buckets hold one to a few tensors


def perturbed(module: nn.Module, seed: int, only_lora: bool = False) -> nn.Module:
    """Add noise to every parameter (or only the adapters): weights no other copy has."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if not only_lora or "lora_" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return module


def token_log_probs(module: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """(bs, seq_len - 1) log-probs of each next token."""
    with torch.no_grad():
        logits = module(input_ids=ids).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def engine(module: nn.Module) -> HFRollout:
    return HFRollout(module.eval(), {"response_length": 4})


# ---------------------------------------------------------------------------------------------- pure parts
def test_names_config_and_modes():
    assert engine_name("_orig_mod.model._fsdp_wrapped_module.layers.0._checkpoint_wrapped_module.mlp.weight") == (
        "model.layers.0.mlp.weight"
    )
    assert merged_lora_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == (
        "model.layers.0.self_attn.q_proj.weight"
    )
    assert merged_lora_name("base_model.model.lm_head.weight") == "lm_head.weight"
    assert bucket_bytes({}) == 2048 << 20  # verl's default
    assert bucket_bytes({"checkpoint_engine": {"update_weights_bucket_megabytes": 16}}) == 16 << 20
    with pytest.raises(ValueError, match="update_weights_bucket_megabytes must be > 0, got 0"):
        bucket_bytes({"checkpoint_engine": {"update_weights_bucket_megabytes": 0}})
    assert sync_mode(HFRollout, False) == "full" and sync_mode(HFRollout, True) == "adapters"
    assert sync_mode(type("Path", (), {"builds_from_path": True}), True) == "merged"
    assert engine_dtype("bf16") is torch.bfloat16 and engine_dtype("auto") is None
    with pytest.raises(ValueError, match="rollout.dtype='int4'"):
        engine_dtype("int4")
    with pytest.raises(ValueError, match="unknown weight sync mode 'all'"):
        next(actor_weight_buckets(random_qwen2(0), BUCKET, mode="all"))
    with pytest.raises(ValueError, match="no lora_ parameters"):
        next(actor_weight_buckets(random_qwen2(0), BUCKET, mode="adapters"))


def test_merge_lora_weight_is_peft_merge():
    gen = torch.Generator().manual_seed(0)
    w, a, b = (torch.randn(shape, generator=gen) for shape in ((6, 5), (2, 5), (6, 2)))
    expected = w + 0.5 * b @ a
    torch.testing.assert_close(merge_lora_weight(w, [(a, b, 0.5)]), expected)
    torch.testing.assert_close(merge_lora_weight(w.T.contiguous(), [(a, b, 0.5)], fan_in_fan_out=True), expected.T)
    fresh = w.clone()
    assert merge_lora_weight(fresh, [(a, b, 0.5)], inplace=True) is fresh
    with pytest.raises(ValueError, match="float32 weight"):
        merge_lora_weight(w.bfloat16(), [(a, b, 0.5)], inplace=True)


def test_merged_stream_equals_peft_merge_and_unload_under_hf_names():
    """What vllm/sglang get from a LoRA actor: peft's own merged model, by its plain HF names."""
    actor = perturbed(apply_lora(random_qwen2(0, tie_word_embeddings=True), LORA), seed=1, only_lora=True)
    sent = {name: t for bucket in actor_weight_buckets(actor, BUCKET, mode="merged") for name, t in bucket}
    reference = perturbed(apply_lora(random_qwen2(0, tie_word_embeddings=True), LORA), seed=1, only_lora=True)
    merged = reference.merge_and_unload()
    expected = dict(merged.named_parameters())  # the tied lm_head once, as embed_tokens
    assert sorted(sent) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(sent[name], value.detach(), atol=1e-6, rtol=0, msg=name)
    assert any(not torch.equal(sent[n], p) for n, p in random_qwen2(0).named_parameters() if n in sent)


def test_buckets_hold_at_most_the_bucket_size_and_cover_the_model_once():
    model = random_qwen2(0, tie_word_embeddings=True)
    buckets = list(actor_weight_buckets(model, BUCKET, dtype=torch.bfloat16))
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= BUCKET or len(bucket) == 1
        assert all(t.dtype is torch.bfloat16 for _, t in bucket)
    names = [n for bucket in buckets for n, _ in bucket]
    assert names == [n for n, _ in model.named_parameters()]  # module order, the tied weight once
    assert len(buckets) > 3
    whole = list(actor_weight_buckets(model, 1 << 30))
    assert len(whole) == 1 and [n for n, _ in whole[0]] == names


def test_gathered_bytes_alive_stay_within_one_tensor_or_one_bucket():
    """bf16 casts are new tensors even in one process, so `GatherStats` sees every tensor sent."""
    model = random_qwen2(0)
    total = sum(p.numel() * 2 for p in model.parameters())
    per_tensor = GatherStats()
    for _, tensor in named_tensor_stream(actor_weights(model, torch.bfloat16, stats=per_tensor)):
        del tensor
    assert per_tensor.peak == per_tensor.largest and per_tensor.tensors == len(list(model.parameters()))
    bucketed = GatherStats()
    for _, tensor in named_tensor_stream(actor_weight_buckets(model, BUCKET, torch.bfloat16, stats=bucketed)):
        del tensor
    assert bucketed.largest < bucketed.peak <= BUCKET + bucketed.largest and bucketed.alive == 0
    kept = GatherStats()  # a reader that keeps everything: the counter sees the whole model
    everything = list(actor_weight_buckets(model, BUCKET, torch.bfloat16, stats=kept))
    assert kept.peak == total and len(everything) == kept.buckets


def test_engine_readers_take_dicts_pairs_and_buckets():
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    for source in ({"a": a, "b": b, "c": c}, [("a", a), ("b", b), ("c", c)], [[("a", a), ("b", b)], [("c", c)]]):
        assert [n for n, _ in named_tensor_stream(source)] == ["a", "b", "c"]
    big, one = 1 << 20, a.numel() * a.element_size()  # every tensor in one bucket; one tensor per bucket
    assert [[n for n, _ in bk] for bk in weight_buckets_by_size({"a": a, "b": b}, big)] == [["a", "b"]]
    assert [[n for n, _ in bk] for bk in weight_buckets_by_size(iter([("a", a), ("b", b)]), one)] == [["a"], ["b"]]
    assert [[n for n, _ in bk] for bk in weight_buckets_by_size(iter([[("a", a), ("b", b)]]), one)] == [["a", "b"]]


def test_hf_engine_reads_the_whole_stream_before_rejecting_a_name():
    """The sender's gathers are collectives: an engine that stopped at a bad name would leave peer ranks hanging."""
    rollout = engine(random_qwen2(1))
    state = dict(random_qwen2(0).state_dict())
    read = []

    def stream():
        for name in ["extra.weight", *state]:
            read.append(name)
            yield [(name, state.get(name, torch.zeros(1)))]

    with pytest.raises(KeyError, match=r"does not: \['extra.weight'\]"):
        rollout.update_weights(stream())
    assert read == ["extra.weight", *state]


# ---------------------------------------------------------------------------------------------- FSDP2 ranks
def _sync_case(mode: str, tie: bool, path: str, rank: int) -> dict:
    """One actor (FSDP2, perturbed: a policy no copy has) and one hf engine; log-probs before and after a sync.
    `path`: `in_place` (the hf engine's own way for full weights), `tensor` (one gathered tensor at a time, as an
    engine without `in_place_module` gets them) or `bucket` (the engine takes buckets, as sglang does)."""
    from verl.utils.fsdp_utils import apply_fsdp2
    from verl.workers.weight_sync import sync_rollout_weights

    lora = mode != "full"
    actor = random_qwen2(0, tie_word_embeddings=tie)
    actor = perturbed(apply_lora(actor, LORA), seed=1, only_lora=True) if lora else perturbed(actor, seed=1)
    actor = apply_fsdp2(actor, reshard_after_forward=not tie)  # tied: parameters left unsharded by a forward
    rollout_model = random_qwen2(2, tie_word_embeddings=tie)
    if mode == "adapters":  # the hf engine of a LoRA actor: the same base, its own fresh adapters
        rollout_model = apply_lora(random_qwen2(0, tie_word_embeddings=tie), LORA)
    rollout = engine(rollout_model)
    if mode == "merged":  # an engine built from model.path (vllm, sglang): merged weights, HF names
        rollout.builds_from_path = True
    rollout.takes_buckets = path == "bucket"
    if path != "in_place":
        rollout.in_place_module = lambda: None
    ids = torch.randint(0, 100, (3, 12), generator=torch.Generator().manual_seed(rank))
    before = (token_log_probs(actor, ids) - token_log_probs(rollout.module, ids)).abs().max().item()
    stats = GatherStats()
    cfg = {"checkpoint_engine": {"update_weights_bucket_megabytes": BUCKET / (1 << 20)}}
    sync_rollout_weights(actor, rollout, cfg, use_lora=lora, stats=stats)
    after = (token_log_probs(actor, ids) - token_log_probs(rollout.module, ids)).abs().max().item()
    total = sum(p.numel() * p.element_size() for p in rollout.module.parameters())
    return {"before": before, "after": after, "peak": stats.peak, "largest": stats.largest,
            "alive": stats.alive, "buckets": stats.buckets, "tensors": stats.tensors, "total": total}  # fmt: skip


# (mode, tied embeddings, path)
CASES = [("full", False, "in_place"), ("full", True, "in_place"), ("full", False, "tensor"), ("full", True, "bucket")]
CASES += [("adapters", False, "tensor"), ("merged", True, "tensor"), ("merged", False, "bucket")]


def _export_case(rank: int) -> dict:
    """Async mode's stream: rank 0 gets the weights as CPU buckets of at most the bucket size (a larger tensor
    alone), which together are the whole state dict under HF names; the other ranks None; `[]` on every rank ends
    it, and the next call starts again from the first bucket."""
    from verl.utils.fsdp_utils import apply_fsdp2, get_full_state_dict
    from verl.workers.weight_stream import BucketExporter

    actor = apply_fsdp2(perturbed(random_qwen2(0), seed=1))
    exporter = BucketExporter(actor, "full", bucket_bytes=20_000, keep=rank == 0)
    buckets = list(iter(exporter.next_bucket, []))
    again = exporter.next_bucket()
    full = get_full_state_dict(actor)
    if rank != 0:
        return {"none": all(b is None for b in buckets), "again": again is None}
    exported = dict(pair for bucket in buckets for pair in bucket)
    sizes = [sum(t.numel() * t.element_size() for _, t in bucket) for bucket in buckets]
    return {
        "same": sorted(exported) == sorted(full) and all(torch.equal(exported[k], full[k]) for k in full),
        "cpu": all(t.device.type == "cpu" for t in exported.values()),
        "bounded": all(size <= 20_000 or len(bucket) == 1 for size, bucket in zip(sizes, buckets)),
        "several": len(buckets) > 3,
        "again": [n for n, _ in again] == [n for n, _ in buckets[0]],
    }


def _run_rank(rank: int, world_size: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        results = {case: _sync_case(*case, rank) for case in CASES}
        results["export"] = _export_case(rank)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # gloo aborts if a rank tears down while its peer is still connected
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [1, 2])
def test_synced_engine_log_probs_equal_the_actors_holding_one_tensor_or_bucket(world_size):
    with tempfile.TemporaryDirectory() as out_dir:
        run_ranks(_run_rank, world_size, free_port(), out_dir)
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world_size)]
    assert results[0].pop("export") == {"same": True, "cpu": True, "bounded": True, "several": True, "again": True}
    assert all(r.pop("export") == {"none": True, "again": True} for r in results[1:])
    for rank_results in results:
        for (mode, _, path), r in rank_results.items():
            case = (mode, path)
            assert r["before"] > 1e-2, case  # the engine starts with other weights
            assert r["after"] < 1e-5, case
            assert r["alive"] == 0, case  # the engine dropped everything it was sent
            if path == "in_place":  # written into the engine's parameters: nothing gathered, nothing copied
                assert r["peak"] == 0 and r["tensors"] > 0, case
                continue
            if path == "bucket":
                assert r["peak"] <= BUCKET + r["largest"], case
            elif mode == "merged":  # the gathered base weight, its adapters, the merged copy on 1 rank
                assert r["peak"] <= 2 * r["largest"], case
            else:
                assert r["peak"] <= r["largest"], case  # one tensor at a time
            if world_size == 2:  # on 1 rank a gathered fp32 tensor is the shard itself: nothing new
                assert 0 < r["peak"] < r["total"] / 2, case
                assert r["buckets"] > 1 or path != "bucket", case
