"""Tests for verl.utils.device and verl.utils.fsdp_utils on a tiny Qwen2 built here (FSDP2 over gloo, 1 and 2 ranks)."""

import copy
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from transformers import Qwen2ForCausalLM

from tests.multirank import run_ranks
from verl.models.tiny import random_qwen2
from verl.utils.device import get_device_name, get_dist_backend, get_torch_device, set_attention_backends
from verl.utils.fsdp_utils import (
    apply_fsdp2,
    build_lr_scheduler,
    build_optimizer,
    clip_grad_norm_,
    destroy_distributed,
    free_port,
    get_full_state_dict,
    init_distributed,
    load_causal_lm,
    load_full_state_dict,
    load_token_classification_model,
    set_torch_threads_from_env,
)

OPTIM_CFG = {"lr": 1e-3, "weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-6}


def tiny_qwen2(seed: int = 0, tie: bool = False) -> Qwen2ForCausalLM:
    return random_qwen2(seed, tie_word_embeddings=tie)


def batch_ids(bs: int = 4, seq_len: int = 10) -> torch.Tensor:
    return torch.randint(0, 100, (bs, seq_len), generator=torch.Generator().manual_seed(123))


# ---------------------------------------------------------------- device helpers
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_device_name_without_gpu():
    assert get_device_name() == "cpu" and get_device_name("cpu") == "cpu"
    with pytest.raises(RuntimeError, match="'cuda' was asked for"):
        get_device_name("cuda")
    assert get_torch_device() is torch.cpu


def test_device_helpers_reject_unknown_names():
    with pytest.raises(ValueError, match=r"\['auto', 'cpu', 'cuda'\], got 'tpu'"):
        get_device_name("tpu")
    assert get_dist_backend("cpu") == "gloo" and get_dist_backend("cuda") == "nccl"
    with pytest.raises(ValueError, match="got 'npu'"):
        get_dist_backend("npu")
    assert get_torch_device("cuda") is torch.cuda


def test_cuda_workers_turn_cudnn_attention_off_and_cpu_leaves_it():
    # the flag is process-wide: put it back for the other tests
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        set_attention_backends("cpu")
        assert torch.backends.cuda.cudnn_sdp_enabled()
        set_attention_backends("cuda")
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


# ---------------------------------------------------------------- process group and FSDP2 in one process
def test_init_distributed_is_idempotent(process_group):
    assert process_group == (0, 1)
    assert init_distributed() == (0, 1) and dist.get_backend() == "gloo"


def test_apply_fsdp2_one_rank_matches_plain_adamw_step(process_group):
    plain = tiny_qwen2(seed=0)
    sharded = apply_fsdp2(copy.deepcopy(plain))
    assert isinstance(sharded, FSDPModule)
    assert all(isinstance(layer, FSDPModule) for layer in sharded.model.layers)
    ids = batch_ids()
    with torch.no_grad():
        torch.testing.assert_close(sharded(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=0, atol=1e-6)

    ref_optim = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-6)
    plain(input_ids=ids, labels=ids).loss.backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
    ref_optim.step()

    optim = build_optimizer(sharded, OPTIM_CFG)
    sharded(input_ids=ids, labels=ids).loss.backward()
    norm = clip_grad_norm_(sharded, 0.5)
    optim.step()
    assert ref_norm > 0.5  # so the clipping really scaled the gradients
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
    full = get_full_state_dict(sharded)
    ref = plain.state_dict()
    assert set(full) == set(ref)
    assert max((full[k] - ref[k]).abs().max().item() for k in ref) < 1e-5


def test_full_state_dict_round_trip(process_group):
    plain = tiny_qwen2(seed=1, tie=True)
    original = {k: v.clone() for k, v in plain.state_dict().items()}
    sharded = apply_fsdp2(plain)
    full = get_full_state_dict(sharded)
    assert set(full) == set(original)
    assert all(torch.equal(full[k], original[k]) and full[k].device.type == "cpu" for k in original)

    perturbed = {k: v + 0.5 for k, v in original.items()}
    perturbed["lm_head.weight"] = perturbed["model.embed_tokens.weight"]  # tied
    given = dict(perturbed)
    load_full_state_dict(sharded, perturbed)
    assert perturbed.keys() == given.keys() and all(perturbed[k] is given[k] for k in given)  # input untouched
    reloaded = get_full_state_dict(sharded)
    assert all(torch.equal(reloaded[k], perturbed[k]) for k in perturbed)

    incomplete = dict(perturbed)
    incomplete.pop("model.norm.weight")
    incomplete["extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing keys \['model.norm.weight'\], unexpected keys \['extra.weight'\]"):
        load_full_state_dict(sharded, incomplete)


def test_clip_grad_norm_on_plain_model_and_non_finite():
    model = torch.nn.Linear(2, 1, bias=True)
    model.weight.grad = torch.tensor([[3.0, 0.0]])
    model.bias.grad = torch.tensor([4.0])
    norm = clip_grad_norm_(model, 1.0)
    assert norm.item() == pytest.approx(5.0)
    torch.testing.assert_close(model.weight.grad, torch.tensor([[0.6, 0.0]]), rtol=1e-5, atol=0)
    torch.testing.assert_close(model.bias.grad, torch.tensor([0.8]), rtol=1e-5, atol=0)

    model.weight.grad = torch.tensor([[float("inf"), 1.0]])
    model.bias.grad = torch.tensor([2.0])
    assert math.isinf(clip_grad_norm_(model, 1.0).item())
    assert model.bias.grad.item() == 2.0 and model.weight.grad[0, 1].item() == 1.0  # not scaled
    assert clip_grad_norm_(torch.nn.Linear(2, 2), 1.0).item() == 0.0  # no gradients at all


# ---------------------------------------------------------------- two ranks over gloo
def _two_rank_step_worker(rank: int, world_size: int, port: int, out_path: str, fsdp_size: int = -1) -> None:
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )
    torch.set_num_threads(1)
    assert init_distributed("gloo") == (rank, world_size)
    model = apply_fsdp2(tiny_qwen2(seed=0), fsdp_size=fsdp_size)
    assert next(model.parameters()).device_mesh.ndim == (2 if 0 < fsdp_size < world_size else 1)
    optim = build_optimizer(model, OPTIM_CFG)
    local_ids = batch_ids().chunk(world_size)[rank]
    model(input_ids=local_ids, labels=local_ids).loss.backward()
    norm = clip_grad_norm_(model, 0.5)
    optim.step()
    full = get_full_state_dict(model)
    if rank == 0:
        torch.save({"state": full, "norm": norm}, out_path)
    destroy_distributed()


@pytest.mark.slow  # 2 ranks forked from the preloaded fork server (tests/multirank.py)
@pytest.mark.parametrize("fsdp_size", [-1, 1])  # 1: verl's fsdp_size as a (ddp 2, fsdp 1) mesh, hybrid sharding
def test_two_ranks_adamw_step_matches_one_process_on_whole_batch(tmp_path, fsdp_size):
    out_path = str(tmp_path / "two_rank.pt")
    run_ranks(_two_rank_step_worker, 2, free_port(), out_path, fsdp_size)

    reference = tiny_qwen2(seed=0)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-6)
    ids = batch_ids()
    reference(input_ids=ids, labels=ids).loss.backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    ref_optim.step()

    result = torch.load(out_path, weights_only=True)
    torch.testing.assert_close(result["norm"], ref_norm, rtol=1e-5, atol=0)
    ref = reference.state_dict()
    assert set(result["state"]) == set(ref)
    assert max((result["state"][k] - ref[k]).abs().max().item() for k in ref) < 1e-5


def _unsharded_worker(rank: int, world_size: int, port: int, out_path: str) -> None:
    """Forwards of different counts per rank inside `unsharded` (no collective may run there), then a training step
    on the resharded model; rank 0 saves the logits seen inside, the sharding state after and the trained weights."""
    from verl.utils.fsdp_utils import unsharded

    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )
    torch.set_num_threads(1)
    init_distributed("gloo")
    model = apply_fsdp2(tiny_qwen2(seed=0))
    ids = batch_ids()
    with torch.no_grad(), unsharded(model):
        for _ in range(2 + 3 * rank):  # rank 0: 2 forwards, rank 1: 5
            logits = model(input_ids=ids).logits
    resharded = all(p.to_local().numel() < p.numel() for p in model.parameters() if p.dim() == 2)
    optim = build_optimizer(model, OPTIM_CFG)
    local_ids = ids.chunk(world_size)[rank]
    model(input_ids=local_ids, labels=local_ids).loss.backward()
    optim.step()
    full = get_full_state_dict(model)
    if rank == 0:
        torch.save({"logits": logits, "resharded": resharded, "state": full}, out_path)
    destroy_distributed()


@pytest.mark.slow
def test_unsharded_runs_uneven_forwards_without_collectives_then_trains_resharded(tmp_path):
    """What the hf engine does with the actor's own FSDP2 module: gather once, generate (ranks stop at different
    lengths), reshard; the forwards inside equal the plain model's and the training step after is unchanged."""
    out_path = str(tmp_path / "unsharded.pt")
    run_ranks(_unsharded_worker, 2, free_port(), out_path)
    result = torch.load(out_path, weights_only=True)
    reference = tiny_qwen2(seed=0)
    ids = batch_ids()
    with torch.no_grad():
        torch.testing.assert_close(result["logits"], reference(input_ids=ids).logits, atol=1e-6, rtol=0)
    assert result["resharded"]
    optim = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-6)
    reference(input_ids=ids, labels=ids).loss.backward()
    optim.step()
    ref = reference.state_dict()
    assert max((result["state"][k] - ref[k]).abs().max().item() for k in ref) < 1e-5


# ---------------------------------------------------------------- optimizer and LR schedule
def test_build_optimizer_reads_config_and_skips_frozen_params():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    model[0].weight.requires_grad_(False)
    optim = build_optimizer(model, {"lr": 0.1, "weight_decay": 0.0, "betas": [0.8, 0.9], "eps": 1e-5})
    group = optim.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["betas"], group["eps"]) == (0.1, 0.0, (0.8, 0.9), 1e-5)
    assert len(group["params"]) == 3
    defaults = build_optimizer(model.parameters(), {"lr": 0.5}).param_groups[0]
    assert (defaults["weight_decay"], defaults["betas"], defaults["eps"]) == (0.01, (0.9, 0.999), 1e-8)


def _adamw_steps(optimizer_of, steps: int = 5) -> list[torch.Tensor]:
    """The parameters of a small model after `steps` AdamW steps on fixed gradients."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    optimizer = optimizer_of(model)
    grads = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=grads)
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def test_build_optimizer_takes_the_fused_kernel_on_cpu_with_torchs_default_results():
    cfg = {"lr": 1e-2, "weight_decay": 0.1}
    group = build_optimizer(torch.nn.Linear(2, 2), cfg).param_groups[0]
    assert group["fused"] is True
    ours = _adamw_steps(lambda m: build_optimizer(m, cfg))
    plain = _adamw_steps(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1))
    torch.testing.assert_close(ours, plain, rtol=1e-6, atol=1e-8)  # the same arithmetic, float32 rounding apart
    assert not torch.equal(ours[0], _adamw_steps(lambda m: build_optimizer(m, cfg), steps=4)[0])  # steps taken


def test_override_optimizer_config_reaches_adamw_and_refuses_unknown_keys():
    override = {"amsgrad": True, "betas": [0.5, 0.6], "foreach": True}
    group = build_optimizer(torch.nn.Linear(2, 2), {"lr": 0.1, "override_optimizer_config": override}).param_groups[0]
    assert (group["amsgrad"], group["betas"], group["foreach"], group["fused"]) == (True, (0.5, 0.6), True, None)
    ours = _adamw_steps(lambda m: build_optimizer(m, {"lr": 1e-2, "override_optimizer_config": {"amsgrad": True}}))
    plain = _adamw_steps(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, amsgrad=True))
    torch.testing.assert_close(ours, plain, rtol=1e-6, atol=1e-8)
    with pytest.raises(ValueError, match="override_optimizer_config has 'momentum', which torch.optim.AdamW does not"):
        build_optimizer(torch.nn.Linear(2, 2), {"override_optimizer_config": {"momentum": 0.9}})
    with pytest.raises(ValueError, match="override_optimizer_config=3: Cannot assign int"):
        build_optimizer(torch.nn.Linear(2, 2), {"override_optimizer_config": 3})


def lrs_over(optim_cfg: dict, total: int, steps: int) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = build_lr_scheduler(optimizer, optim_cfg, total)
    values = []
    for _ in range(steps):
        values.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return values


def test_constant_schedule_with_warmup_steps_and_ratio():
    assert lrs_over({"lr_warmup_steps": 4, "warmup_style": "constant"}, 10, 6) == pytest.approx(
        [0.0, 0.025, 0.05, 0.075, 0.1, 0.1]
    )
    # lr_warmup_steps <= 0 -> int(0.25 * 10) = 2 warmup steps
    assert lrs_over({"lr_warmup_steps": -1, "lr_warmup_steps_ratio": 0.25}, 10, 4) == pytest.approx(
        [0.0, 0.05, 0.1, 0.1]
    )
    assert lrs_over({}, -1, 3) == pytest.approx([0.1, 0.1, 0.1])


def test_cosine_schedule_values():
    # warmup 2, total 10, min ratio 0.1: step s >= 2 -> 0.1 * (0.1 + 0.9 * 0.5 * (1 + cos(pi * (s - 2) / 8)))
    values = lrs_over({"lr_warmup_steps": 2, "lr_scheduler_type": "cosine", "min_lr_ratio": 0.1}, 10, 12)
    assert values[:3] == pytest.approx([0.0, 0.05, 0.1])
    assert values[4] == pytest.approx(0.1 * (0.1 + 0.45 * (1 + math.cos(math.pi / 4))))  # 0.08182
    assert values[6] == pytest.approx(0.055)  # half way: 0.1 * (0.1 + 0.45)
    assert values[10] == pytest.approx(0.01) and values[11] == pytest.approx(0.01)  # floor, also past the end


def test_schedule_errors():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match=r"warmup_style='linear': one of \['constant', 'cosine'\]"):
        build_lr_scheduler(optimizer, {"warmup_style": "linear"}, 10)
    with pytest.raises(ValueError, match="total_training_steps must be > 0.*got -1"):
        build_lr_scheduler(optimizer, {"warmup_style": "cosine"}, -1)
    with pytest.raises(ValueError, match=r"min_lr_ratio=1.5: must lie in \[0, 1\]"):
        build_lr_scheduler(optimizer, {"min_lr_ratio": 1.5}, 10)


# ---------------------------------------------------------------- HF loading
def test_load_causal_lm_round_trip_and_options(tmp_path):
    saved = tiny_qwen2(seed=2)
    saved.save_pretrained(str(tmp_path))
    model = load_causal_lm(str(tmp_path), gradient_checkpointing=True)
    assert type(model) is Qwen2ForCausalLM
    assert all(layer.gradient_checkpointing for layer in model.model.layers)  # HF's flag, in every version
    assert all(torch.equal(v, saved.state_dict()[k]) for k, v in model.state_dict().items())
    assert next(model.parameters()).device.type == "cpu"
    assert load_causal_lm(str(tmp_path), dtype="bfloat16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        load_causal_lm(str(tmp_path), dtype="float8")


def test_load_causal_lm_errors_name_the_path(tmp_path):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=f"{missing}.*does not exist"):
        load_causal_lm(missing)
    with pytest.raises(ValueError, match="has no config.json"):
        load_causal_lm(str(tmp_path))
    from transformers import ViTConfig

    vit_dir = tmp_path / "vit"
    ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8).save_pretrained(vit_dir)
    with pytest.raises(ValueError, match=f"{vit_dir}.*ViTConfig.*not a causal LM"):
        load_causal_lm(str(vit_dir))


def test_token_classification_model_from_causal_lm_checkpoint(tmp_path, process_group):
    causal = tiny_qwen2(seed=3)
    causal.save_pretrained(str(tmp_path))
    critic = load_token_classification_model(str(tmp_path))
    assert type(critic).__name__ == "Qwen2ForTokenClassification" and critic.config.num_labels == 1
    assert torch.count_nonzero(critic.score.weight) == 0
    backbone = causal.model.state_dict()
    assert all(torch.equal(v, backbone[k]) for k, v in critic.model.state_dict().items())
    ids = batch_ids(bs=2, seq_len=5)
    values = apply_fsdp2(critic)(input_ids=ids).logits
    assert values.shape == (2, 5, 1) and torch.count_nonzero(values) == 0


def test_set_torch_threads_from_env(monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        monkeypatch.delenv("VERL_NUM_THREADS", raising=False)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert set_torch_threads_from_env() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert set_torch_threads_from_env() == 2  # OMP_NUM_THREADS=1 keeps the current setting
        monkeypatch.setenv("VERL_NUM_THREADS", "1")
        assert set_torch_threads_from_env() == 1
        monkeypatch.setenv("VERL_NUM_THREADS", "two")
        with pytest.raises(ValueError, match="VERL_NUM_THREADS must be a positive integer, got 'two'"):
            set_torch_threads_from_env()
    finally:
        torch.set_num_threads(before)


def test_apply_fsdp2_on_peft_lora_model_trains_only_adapters(process_group):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_qwen2(seed=4), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    apply_fsdp2(model)
    assert sum(isinstance(m, FSDPModule) for m in model.modules()) == 3  # 2 decoder layers + the root
    before = get_full_state_dict(model)
    optimizer = build_optimizer(model, OPTIM_CFG)
    ids = batch_ids(bs=2, seq_len=6)
    model(input_ids=ids, labels=ids).loss.backward()
    assert clip_grad_norm_(model, 1.0) > 0
    optimizer.step()
    after = get_full_state_dict(model)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("lora_" in k for k in changed)


# ---------------------------------------------------------------- verl's fsdp_config: offload, wrap policy, mesh
def test_offload_settings_on_cuda_ask_for_cpu_offload_policy():
    from torch.distributed.fsdp import CPUOffloadPolicy

    from verl.utils.fsdp_utils import offload_settings

    policy, offload_optimizer = offload_settings({"param_offload": True, "optimizer_offload": True}, "cuda", "a")
    assert isinstance(policy, CPUOffloadPolicy) and policy.pin_memory
    assert offload_optimizer is False  # the optimizer step runs on the CPU shards already
    assert isinstance(offload_settings({"offload_policy": True}, "cuda", "a")[0], CPUOffloadPolicy)
    assert offload_settings({"optimizer_offload": True}, "cuda", "a") == (None, True)
    assert offload_settings({}, "cuda", "a") == (None, False)


def test_offload_settings_on_cpu_do_nothing_and_say_so_once(monkeypatch, capsys):
    from verl.utils import fsdp_utils

    monkeypatch.setattr(fsdp_utils, "_NOTICES_PRINTED", set())
    assert fsdp_utils.offload_settings({"param_offload": False}, "cpu", "x.fsdp_config") == (None, False)
    assert capsys.readouterr().err == ""
    flags = {"param_offload": True, "optimizer_offload": True}
    assert fsdp_utils.offload_settings(flags, "cpu", "x.fsdp_config") == (None, False)
    assert fsdp_utils.offload_settings(flags, "cpu", "y.fsdp") == (None, False)
    assert capsys.readouterr().err.splitlines() == [
        "notice: x.fsdp_config.param_offload/optimizer_offload=true has no effect on CPU: parameters and optimizer "
        "state already live in host memory"
    ]


def test_worker_wrapping_passes_the_policy_to_every_fully_shard(monkeypatch, process_group):
    """`wrap_fsdp2` (the FSDP engine) on a CUDA worker: fully_shard gets CPUOffloadPolicy, the verl knobs arrive."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    from verl.utils import fsdp_utils
    from verl.workers.engine.fsdp.transformer_impl import wrap_fsdp2

    calls = []
    monkeypatch.setattr(fsdp_utils, "fully_shard", lambda module, **kwargs: calls.append((module, kwargs)))
    model = tiny_qwen2()
    cfg = {"param_offload": True, "reshard_after_forward": False, "wrap_policy": {"min_num_params": 0}, "dtype": "bf16"}
    _, offload_optimizer = wrap_fsdp2(model, cfg, "cuda", "actor_rollout_ref.actor.fsdp_config")
    assert offload_optimizer is False
    assert [m for m, _ in calls] == [*model.model.layers, model]
    for _, kwargs in calls:
        assert isinstance(kwargs["offload_policy"], CPUOffloadPolicy)
        assert kwargs["reshard_after_forward"] is False and kwargs["mp_policy"].param_dtype == torch.bfloat16
    calls.clear()
    _, offload_optimizer = wrap_fsdp2(tiny_qwen2(), {"optimizer_offload": True}, "cuda", "critic.fsdp")
    assert offload_optimizer is True and all("offload_policy" not in kwargs for _, kwargs in calls)


def test_wrap_policy_picks_the_sharded_units():
    from verl.utils.fsdp_utils import _wrap_targets

    model = tiny_qwen2()
    layers = list(model.model.layers)
    assert _wrap_targets(model, {"min_num_params": 0}) == layers  # verl's default: the decoder layers
    assert _wrap_targets(model, {"transformer_layer_cls_to_wrap": ["Qwen2MLP"]}) == [layer.mlp for layer in layers]
    with pytest.raises(
        ValueError, match=r"transformer_layer_cls_to_wrap=\['Nope'\] matches no module.*Qwen2DecoderLayer"
    ):
        _wrap_targets(model, {"transformer_layer_cls_to_wrap": "Nope"})
    # size-based (FSDP1's policy): post-order, each unit holds >= min_num_params parameters not in a unit below it
    layer_params = sum(p.numel() for p in layers[0].parameters())
    big_leaves = [m for m in (model.model.embed_tokens, model.lm_head) if m.weight.numel() >= layer_params]
    expected = [m for m in (model.model.embed_tokens, *layers, model.lm_head) if m in layers or m in big_leaves]
    assert _wrap_targets(model, {"min_num_params": layer_params}) == expected
    mlp_params = sum(p.numel() for p in layers[0].mlp.parameters())
    units = _wrap_targets(model, {"min_num_params": mlp_params})
    assert all(layer.mlp in units for layer in layers)  # a child big enough gets its own unit, before its parent
    assert all(units.index(layer.mlp) < units.index(layer) for layer in layers if layer in units)
    assert _wrap_targets(model, {"min_num_params": 10**9}) == []  # nothing big enough: the root alone
    tied = tiny_qwen2(tie=True)
    units = _wrap_targets(tied, {"min_num_params": 1})
    assert tied.model.embed_tokens not in units and tied.lm_head not in units  # a tied weight stays with the root


def test_forward_prefetch_links_each_layer_to_the_next(process_group):
    model = apply_fsdp2(tiny_qwen2(), forward_prefetch=True)
    layers = list(model.model.layers)
    for layer, following in zip(layers, layers[1:]):
        assert layer._get_fsdp_state()._states_to_forward_prefetch == [following._get_fsdp_state()]
    plain = apply_fsdp2(tiny_qwen2())
    assert all(not layer._get_fsdp_state()._states_to_forward_prefetch for layer in plain.model.layers)
    ids = batch_ids()
    torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_fsdp_size_mesh(process_group):
    from verl.utils.fsdp_utils import fsdp_device_mesh

    assert fsdp_device_mesh("cpu", 1, -1).mesh_dim_names == ("fsdp",)
    assert fsdp_device_mesh("cpu", 1, 4).shape == (1,)  # >= world size: all ranks
    with pytest.raises(ValueError, match="fsdp_size must be -1"):
        fsdp_device_mesh("cpu", 1, 0)
