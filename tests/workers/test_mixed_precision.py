"""Mixed precision of the FSDP workers: verl's `fsdp_config.mixed_precision` {param_dtype, reduce_dtype, buffer_dtype}.

Rules (`verl/utils/mixed_precision.py`), their start-up checks (`verl.trainer.config`), and on the tiny Qwen2
model on CPU (in process, a 1-rank gloo group): with `param_dtype=bf16` the forward computes in bf16 while the
parameters, the AdamW state and the saved checkpoints stay fp32, and a few updates train; `reduce_dtype` and
`buffer_dtype` are applied. The end-to-end `main_ppo` run is marked slow.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from tests.cpu_overrides import cpu_config
from tests.workers.test_fsdp_workers import make_prompts, restored_dist_env, trainer_config, with_advantages
from verl.trainer.config import CONFIG_YAML, prepare_config, resolve_cpu_dtypes
from verl.utils import fsdp_utils
from verl.utils.mixed_precision import MixedPrecision, resolve_mixed_precision
from verl.workers.engine.fsdp.transformer_impl import wrap_fsdp2
from verl.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker, compute_dtype

BF16 = {"param_dtype": "bf16"}
ACTOR = "actor_rollout_ref.actor.fsdp_config"


# ------------------------------------------------------------------------------------ rules and start-up checks
def test_param_dtype_wins_over_dtype_and_missing_keys_take_verls_defaults():
    assert resolve_mixed_precision(None) == MixedPrecision(None, None, None)
    assert resolve_mixed_precision({"dtype": "float32"}) == MixedPrecision(None, None, None)
    assert resolve_mixed_precision({"dtype": "bfloat16"}) == MixedPrecision("bfloat16", "float32", None)
    mp = {"dtype": "float32", "mixed_precision": BF16}
    assert resolve_mixed_precision(mp) == MixedPrecision("bfloat16", "float32", "float32")
    mp = {"dtype": "float16", "mixed_precision": {"reduce_dtype": "bfloat16", "buffer_dtype": 16}}
    assert resolve_mixed_precision(mp) == MixedPrecision("float16", "bfloat16", "float16")  # param from dtype
    assert compute_dtype({"dtype": "float32", "mixed_precision": OmegaConf.create(BF16)}) == "bfloat16"
    assert compute_dtype({"dtype": "bf16"}) == "bfloat16" and compute_dtype({}) == "float32"


@pytest.mark.parametrize(
    "override, message",
    [
        (
            f"+{ACTOR}.mixed_precision.param_dtype=int8",
            f"{ACTOR}.mixed_precision.param_dtype='int8' is not a supported dtype; "
            "allowed: fp32, bf16, fp16 (or float32, bfloat16, float16)",
        ),
        (
            "+critic.fsdp.mixed_precision.reduce_dtype=fp8",
            "critic.fsdp.mixed_precision.reduce_dtype='fp8' is not a supported dtype; allowed: fp32, bf16, fp16",
        ),
        (
            "+actor_rollout_ref.ref.fsdp_config.mixed_precision.keep_low_precision_grads=true",
            "actor_rollout_ref.ref.fsdp_config.mixed_precision has unknown key(s) ['keep_low_precision_grads']; "
            "allowed: param_dtype, reduce_dtype, buffer_dtype",
        ),
        (f"{ACTOR}.mixed_precision=bf16", f"{ACTOR}.mixed_precision='bf16' has type str; expected dict"),
        (f"{ACTOR}.dtype=int4", f"{ACTOR}.dtype='int4' is not a supported dtype"),
    ],
    ids=["param_dtype", "reduce_dtype", "unknown_key", "not_a_mapping", "dtype"],
)
def test_bad_values_fail_at_start_up_with_one_line(override, message):
    config = cpu_config(override.removeprefix("+"))
    with pytest.raises(ValueError) as err:
        prepare_config(config, notify=lambda _msg: None)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_cpu_keeps_an_explicit_param_dtype_and_turns_the_implicit_default_into_float32():
    config = OmegaConf.load(CONFIG_YAML)  # verl's defaults: every dtype bfloat16
    OmegaConf.update(config, f"{ACTOR}.mixed_precision", BF16, force_add=True)
    prepare_config(config, notify=lambda _msg: None)  # a mapping passes the type check and the dtype check
    notices = []
    resolve_cpu_dtypes(config, "cpu", notices.append)
    assert compute_dtype(config.actor_rollout_ref.actor.fsdp_config) == "bfloat16"  # explicit: kept on CPU
    assert compute_dtype(config.actor_rollout_ref.ref.fsdp_config) == "float32"  # verl's GPU default: float32
    assert compute_dtype(config.critic.fsdp) == "float32"
    assert len(notices) == 1 and f"{ACTOR}.dtype" not in notices[0] and "critic.fsdp.dtype" in notices[0]


# ------------------------------------------------------------------------------------ FSDP2 on CPU
@pytest.fixture(autouse=True)
def _dist_env():
    with restored_dist_env():
        yield


def _grads_after_backward(model_dir: str, fsdp_cfg: dict) -> list[torch.Tensor]:
    model = fsdp_utils.load_causal_lm(model_dir, dtype=fsdp_cfg.get("model_dtype", "float32"))
    model, _ = wrap_fsdp2(model, fsdp_cfg, "cpu", ACTOR)
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids).logits.float().square().mean().backward()
    return [p.grad.to_local() for p in model.parameters() if p.grad is not None]


def _bf16_exact(t: torch.Tensor) -> bool:
    return torch.equal(t, t.to(torch.bfloat16).to(t.dtype))


def test_reduce_dtype_and_buffer_dtype_are_applied(tiny_model_dir):
    fsdp_utils.init_distributed()
    # fp32 compute: gradients are reduced in reduce_dtype (bf16 rounds them), then kept in the fp32 parameters' dtype
    low = _grads_after_backward(tiny_model_dir, {"mixed_precision": {"param_dtype": "fp32", "reduce_dtype": "bf16"}})
    assert {g.dtype for g in low} == {torch.float32} and all(_bf16_exact(g) for g in low)
    full = _grads_after_backward(tiny_model_dir, {"mixed_precision": {"param_dtype": "fp32", "reduce_dtype": "fp32"}})
    assert not all(_bf16_exact(g) for g in full)
    # buffers: cast to buffer_dtype (default fp32), which FSDP2's MixedPrecisionPolicy cannot do
    for buffer_dtype, expected in ((None, torch.float32), ("bf16", torch.bfloat16)):
        mp = {**BF16, "buffer_dtype": buffer_dtype}
        model = fsdp_utils.load_causal_lm(tiny_model_dir, dtype="bfloat16")
        model, _ = wrap_fsdp2(model, {"mixed_precision": mp, "model_dtype": "bf16"}, "cpu", ACTOR)
        assert {b.dtype for b in model.buffers() if b.is_floating_point()} == {expected}


@contextlib.contextmanager
def _forward_dtypes(module: torch.nn.Module):
    """The dtypes of the logits (the LM head's outputs: the actor computes log-probs from them chunk by chunk inside
    the forward) and of the weights a linear layer computes with."""
    seen: dict[str, set] = {"out": set(), "weight": set()}
    linear = next(m for m in module.modules() if isinstance(m, torch.nn.Linear))
    hooks = [
        module.get_output_embeddings().register_forward_hook(lambda _m, _i, out: seen["out"].add(out.dtype)),
        linear.register_forward_pre_hook(lambda m, _i: seen["weight"].add(m.weight.dtype)),
    ]
    try:
        yield seen
    finally:
        for hook in hooks:
            hook.remove()


def test_bf16_compute_trains_with_fp32_master_weights_optimizer_state_and_checkpoints(tiny_model_dir, tmp_path):
    """`mixed_precision.param_dtype=bf16` over `dtype=float32` (the CPU overrides): bf16 forward, fp32 parameters,
    fp32 AdamW state, the PPO loss falls over a few updates on one batch, and the checkpoint holds fp32 weights."""
    cfg = trainer_config(tiny_model_dir, **{"actor.fsdp_config.mixed_precision": BF16, "actor.optim.lr": 2e-3})
    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor_rollout_ref")
    worker.init_model()
    module = worker.actor_module
    gen = worker.generate_sequences(make_prompts(worker.tokenizer, seed=1))
    with _forward_dtypes(module) as seen:
        old = worker.compute_log_prob(gen)
    assert seen == {"out": {torch.bfloat16}, "weight": {torch.bfloat16}}
    assert old.batch["old_log_probs"].dtype == torch.float32  # log-probs are taken in float32 from bf16 logits
    with _forward_dtypes(worker.ref_module) as seen:
        worker.compute_ref_log_prob(gen)
    assert seen["out"] == {torch.float32}  # the reference has its own fsdp_config: float32 here

    batch = with_advantages(gen.union(old))
    losses = []
    for _ in range(4):
        metrics = worker.update_actor(batch).meta_info["metrics"]
        losses.append(float(np.mean(metrics["actor/pg_loss"])))
    assert losses[-1] < losses[0] - 0.05, losses  # it trains: the clipped surrogate of the fixed batch falls
    assert {p.dtype for p in module.parameters()} == {torch.float32}
    state = worker.actor_optimizer.state.values()
    assert state and {s[k].dtype for s in state for k in ("exp_avg", "exp_avg_sq")} == {torch.float32}

    worker.save_checkpoint(str(tmp_path / "ckpt"), global_step=4, save_hf=True)
    shard = torch.load(tmp_path / "ckpt" / "model_world_size_1_rank_0.pt", weights_only=False)
    assert {t.dtype for t in shard.values() if torch.is_tensor(t)} == {torch.float32}
    optim = torch.load(tmp_path / "ckpt" / "optim_world_size_1_rank_0.pt", weights_only=False)
    assert {s["exp_avg"].dtype for s in optim["state"].values()} == {torch.float32}
    hf = load_file(str(tmp_path / "ckpt" / "huggingface" / "model.safetensors"))
    assert {t.dtype for t in hf.values()} == {torch.float32}
    trained = fsdp_utils.get_full_state_dict(module)
    assert all(torch.equal(hf[k], trained[k]) for k in hf)  # the trained fp32 master weights, not a bf16 copy


def test_critic_computes_in_bf16_and_keeps_fp32_weights(tiny_model_dir):
    cfg = trainer_config(tiny_model_dir)
    cfg.critic.fsdp.mixed_precision = BF16
    cfg.critic.rollout_n, cfg.critic.optim.lr = 2, 1e-2
    cfg.critic.ppo_micro_batch_size_per_gpu = cfg.critic.forward_micro_batch_size_per_gpu = 4
    critic = CriticWorker(cfg.critic)
    critic.init_model()
    gen = make_prompts(critic.tokenizer)
    gen.batch["responses"] = gen.batch["input_ids"][:, -4:]
    gen.batch["response_mask"] = gen.batch["attention_mask"][:, -4:]
    seen = set()
    hook = critic.critic_module.register_forward_hook(lambda _m, _i, out: seen.add(out.logits.dtype))
    values = critic.compute_values(gen).batch["values"]
    hook.remove()
    assert seen == {torch.bfloat16} and values.dtype == torch.float32
    gen.batch["values"], gen.batch["returns"] = values, torch.ones_like(values) * gen.batch["response_mask"]
    critic.update_critic(gen)
    assert {p.dtype for p in critic.critic_module.parameters()} == {torch.float32}
    assert (critic.compute_values(gen).batch["values"][gen.batch["response_mask"].bool()] > 0).all()


# ------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_main_ppo_trains_with_bf16_compute_on_cpu(tiny_model_dir, tmp_path):
    from tests.ppo_e2e import grpo_args, hf_weights, run_ppo, step_metrics, write_data

    data_dir = write_data(tmp_path, n_train=8)
    run_dir = tmp_path / "run"
    args = grpo_args(
        tiny_model_dir, data_dir, run_dir, "trainer.total_training_steps=2", "trainer.save_freq=2",
        "trainer.single_process=true", f"{ACTOR}.dtype=bfloat16", f"+{ACTOR}.mixed_precision.param_dtype=bf16",
    )  # fmt: skip
    proc = run_ppo(args, tmp_path)
    assert "GPU setting" not in proc.stderr  # no CPU dtype notice: the explicit bf16 request is kept
    steps = step_metrics(run_dir)
    assert sorted(steps) == [1, 2] and np.isfinite(steps[2]["actor/pg_loss"])
    assert {t.dtype for t in hf_weights(run_dir, 2).values()} == {torch.float32}
