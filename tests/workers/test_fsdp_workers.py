"""Tests of the FSDP2 workers (verl/workers/fsdp_workers.py) on the tiny Qwen2 model.

In-process (world size 1, no Ray): the Worker base class fills in RANK/WORLD_SIZE and init_model starts a
single-process gloo group. With Ray: a 2-rank actor update equals the 1-rank one, and a fused actor_rollout +
critic group runs a step. Configs are the project's real `ppo_trainer.yaml` with small overrides.
"""

import contextlib
import os

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import verl
from tests.cpu_overrides import cpu_config
from verl.protocol import DataProto
from verl.single_controller.base.worker import ENV_KEYS
from verl.utils.fsdp_utils import get_full_state_dict
from verl.utils.torch_functional import compute_position_id_with_mask
from verl.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker, RewardModelWorker
from verl.workers.rollout.base import build_rollout_output

PROMPT_LEN, RESPONSE_LEN, N = 12, 5, 2
TEXTS = ["How many apples?", "Hi", "Convert 5 dollars to euro.", "What time is it in Zurich"]
CONFIG_YAML = os.path.join(os.path.dirname(verl.__file__), "trainer", "config", "ppo_trainer.yaml")


def trainer_config(model_dir: str, **actor_overrides) -> OmegaConf:
    cfg = cpu_config()
    cfg.data.max_prompt_length, cfg.data.max_response_length = PROMPT_LEN, RESPONSE_LEN
    arr = cfg.actor_rollout_ref
    arr.model.path = model_dir
    arr.actor.ppo_mini_batch_size = len(TEXTS)  # one mini-batch of all prompts
    arr.actor.ppo_micro_batch_size_per_gpu = 4
    arr.actor.shuffle = False
    arr.actor.optim.lr, arr.actor.optim.weight_decay = 1e-2, 0.0
    arr.rollout.n = N
    arr.rollout.calculate_log_probs = True
    arr.rollout.log_prob_micro_batch_size_per_gpu = 3
    arr.ref.log_prob_micro_batch_size_per_gpu = 5
    for key, value in actor_overrides.items():
        OmegaConf.update(arr, key, value)
    return cfg


def make_prompts(tokenizer, repeat: int = N, seed: int = 0) -> DataProto:
    ids = torch.full((len(TEXTS), PROMPT_LEN), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, text in enumerate(TEXTS):
        tok = tokenizer(text)["input_ids"][:PROMPT_LEN]
        ids[i, PROMPT_LEN - len(tok) :], mask[i, PROMPT_LEN - len(tok) :] = torch.tensor(tok), 1
    prompts = DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": mask, "position_ids": compute_position_id_with_mask(mask)},
        non_tensors={"uid": np.array([str(i) for i in range(len(TEXTS))], dtype=object)},
        meta_info={"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, "seed": seed},
    )
    return prompts.repeat(repeat, interleave=True)


def with_advantages(batch: DataProto) -> DataProto:
    """Fixed +-1 sequence advantages broadcast over the response (what GRPO would give a 2-sample group)."""
    signs = torch.tensor([1.0, -1.0]).repeat(len(batch) // 2).unsqueeze(-1)
    batch.batch["advantages"] = signs * batch.batch["response_mask"]
    return batch


def rollout_state(worker: ActorRolloutRefWorker) -> dict:
    """The weights the rollout engine generates with (the actor's own, gathered, when it shares the actor's module)."""
    if worker.rollout.module is worker.actor_module:
        return get_full_state_dict(worker.actor_module)
    return {k: v.detach().clone() for k, v in worker.rollout.module.state_dict().items()}


# ------------------------------------------------------------------------------------ in process
@contextlib.contextmanager
def restored_dist_env():
    """Undo the RANK/MASTER_PORT/... variables an in-process Worker writes to os.environ: a Ray session started
    later would hand them to its workers (rank 0 would then reuse this process's port)."""
    saved = {key: os.environ.get(key) for key in ENV_KEYS}
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(autouse=True)
def _dist_env():
    with restored_dist_env():
        yield


@pytest.fixture(scope="module")
def worker(tiny_model_dir):
    with restored_dist_env():
        w = ActorRolloutRefWorker(trainer_config(tiny_model_dir).actor_rollout_ref, role="actor_rollout_ref")
        w.init_model()
    return w


def test_config_normalisation_and_errors(tiny_model_dir):
    cfg = trainer_config(tiny_model_dir)
    w = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor")
    assert w.config.actor.ppo_mini_batch_size == len(TEXTS) * N  # prompts * n / world size 1
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == len(TEXTS)  # the caller's config is untouched
    with pytest.raises(ValueError, match=r"'critic'.*actor_rollout_ref"):
        ActorRolloutRefWorker(cfg.actor_rollout_ref, role="critic")
    bad = trainer_config(tiny_model_dir, **{"actor.ppo_micro_batch_size_per_gpu": 3})
    with pytest.raises(ValueError, match=r"8 samples.*ppo_micro_batch_size_per_gpu=3"):
        ActorRolloutRefWorker(bad.actor_rollout_ref, role="actor_rollout")
    big_micro = trainer_config(tiny_model_dir, **{"actor.ppo_micro_batch_size_per_gpu": 64})
    assert (
        ActorRolloutRefWorker(big_micro.actor_rollout_ref, role="actor").config.actor.ppo_micro_batch_size_per_gpu == 8
    )
    with pytest.raises(ValueError, match=r"lora_rank must be an integer >= 0.*got -1"):
        ActorRolloutRefWorker(trainer_config(tiny_model_dir, **{"model.lora_rank": -1}).actor_rollout_ref, role="actor")
    reuse = {"actor.recompute_old_log_prob": False}
    no_lp = trainer_config(tiny_model_dir, **reuse, **{"rollout.calculate_log_probs": False})
    with pytest.raises(ValueError, match="set actor_rollout_ref.rollout.calculate_log_probs=true"):
        ActorRolloutRefWorker(no_lp.actor_rollout_ref, role="actor_rollout")
    other_dtype = trainer_config(tiny_model_dir, **reuse, **{"rollout.dtype": "bfloat16"})
    with pytest.raises(ValueError, match="rollout.dtype='bfloat16', actor.fsdp_config.dtype='float32'"):
        ActorRolloutRefWorker(other_dtype.actor_rollout_ref, role="actor_rollout")
    ActorRolloutRefWorker(trainer_config(tiny_model_dir, **reuse).actor_rollout_ref, role="actor_rollout")
    checkpointed = {"model.share_prompt_prefix": True, "model.enable_gradient_checkpointing": True}
    with pytest.raises(ValueError, match="share_prompt_prefix=true needs a KV cache"):
        ActorRolloutRefWorker(trainer_config(tiny_model_dir, **checkpointed).actor_rollout_ref, role="actor")
    ref_only = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="ref")
    with pytest.raises(RuntimeError, match="update_actor needs a worker of role actor"):
        ref_only.update_actor(DataProto())


def test_generate_logprob_update_sync_checkpoint_round_trip(worker, tmp_path):
    # the hf engine in the actor's dtype generates with the actor's own FSDP2 module: no second copy, no sync
    assert worker.rollout.module is worker.actor_module
    # generate: rollout log-probs equal the actor's on the same weights
    gen = worker.generate_sequences(make_prompts(worker.tokenizer, seed=1))
    assert gen.batch["responses"].shape == (len(TEXTS) * N, RESPONSE_LEN)
    assert gen.non_tensor_batch["uid"].tolist() == ["0", "0", "1", "1", "2", "2", "3", "3"]
    old = worker.compute_log_prob(gen)
    mask = gen.batch["response_mask"].bool()
    rollout_lp = gen.batch["rollout_log_probs"]
    assert (old.batch["old_log_probs"] - rollout_lp)[mask].abs().max() < 1e-5
    assert old.meta_info["metrics"]["training/rollout_probs_diff_max"] < 1e-5
    assert old.batch["entropys"].shape == mask.shape and (old.batch["entropys"][mask] > 0).all()
    ref = worker.compute_ref_log_prob(gen)
    torch.testing.assert_close(ref.batch["ref_log_prob"], old.batch["old_log_probs"], atol=1e-6, rtol=0)

    # update: metrics, new weights in the rollout engine
    batch = with_advantages(gen.union(old))
    out = worker.update_actor(batch)
    assert len(out) == 0
    metrics = out.meta_info["metrics"]
    assert metrics["actor/lr"] == pytest.approx(1e-2)
    assert np.isfinite(metrics["actor/pg_loss"]).all() and metrics["actor/nonfinite_steps"] == 0
    actor_weights = get_full_state_dict(worker.actor_module)
    rollout_weights = rollout_state(worker)
    for name, value in actor_weights.items():
        assert torch.equal(rollout_weights[name], value), name
    after = worker.compute_log_prob(gen).batch["old_log_probs"]
    assert (after - old.batch["old_log_probs"])[mask].abs().max() > 1e-3  # the update moved the policy
    ref_after = worker.compute_ref_log_prob(gen).batch["ref_log_prob"]
    torch.testing.assert_close(ref_after, ref.batch["ref_log_prob"], atol=0, rtol=0)  # the reference is frozen

    # the next rollout samples from the new weights: its log-probs match the updated actor's
    gen2 = worker.generate_sequences(make_prompts(worker.tokenizer, seed=2))
    old2 = worker.compute_log_prob(gen2)
    mask2 = gen2.batch["response_mask"].bool()
    assert (old2.batch["old_log_probs"] - gen2.batch["rollout_log_probs"])[mask2].abs().max() < 1e-5
    assert old2.meta_info["metrics"]["training/rollout_probs_diff_max"] < 1e-5

    # checkpoint round trip: save, update again, load -> the saved policy (actor and rollout) is back
    worker.save_checkpoint(str(tmp_path / "ckpt"), global_step=1, save_hf=True)
    assert os.path.isfile(tmp_path / "ckpt" / "huggingface" / "config.json")
    worker.update_actor(with_advantages(gen2.union(old2)))
    moved = worker.compute_log_prob(gen).batch["old_log_probs"]
    assert (moved - after)[mask].abs().max() > 1e-3
    worker.load_checkpoint(str(tmp_path / "ckpt"))
    torch.testing.assert_close(worker.compute_log_prob(gen).batch["old_log_probs"], after, atol=1e-6, rtol=0)
    for name, value in rollout_state(worker).items():
        assert torch.equal(value, actor_weights[name]), name
    assert worker.actor_lr_scheduler.last_epoch == 1


def test_lora_trains_and_syncs_only_adapters_and_the_reference_is_the_base(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    overrides = {"model.lora_rank": 4, "model.lora_alpha": 8, "actor.optim.lr": 5e-2}
    cfg = trainer_config(tiny_model_dir, **overrides)
    w = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor_rollout_ref")
    w.init_model()
    trainable = [n for n, p in w.actor_module.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert not hasattr(w, "ref_module") and w.ref_policy.actor_module is w.actor_module  # no second model
    optimized = {id(p) for group in w.actor_optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for n, p in w.actor_module.named_parameters() if "lora_" in n}

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    gen = w.generate_sequences(make_prompts(w.tokenizer, seed=3))
    mask = gen.batch["response_mask"].bool()
    with torch.no_grad():
        b = gen.batch
        logits = base(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"])
        logits = logits.logits[:, -RESPONSE_LEN - 1 : -1]
    base_lp = torch.log_softmax(logits, -1).gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1)
    ref = w.compute_ref_log_prob(gen)
    torch.testing.assert_close(ref.batch["ref_log_prob"][mask], base_lp[mask], atol=1e-5, rtol=0)

    before = {n: p.detach().clone() for n, p in w.actor_module.named_parameters()}
    old = w.compute_log_prob(gen)
    w.update_actor(with_advantages(gen.union(old).union(ref)))
    changed = [n for n, p in w.actor_module.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert changed and all("lora_" in n for n in changed)  # the base weights never move
    # the rollout generates with the actor's module, new adapters included: its log-probs equal the updated actor's
    assert w.rollout.module is w.actor_module
    gen2 = w.generate_sequences(make_prompts(w.tokenizer, seed=4))
    old2 = w.compute_log_prob(gen2)
    mask2 = gen2.batch["response_mask"].bool()
    assert (old2.batch["old_log_probs"] - gen2.batch["rollout_log_probs"])[mask2].abs().max() < 1e-5
    assert (w.compute_log_prob(gen).batch["old_log_probs"] - old.batch["old_log_probs"])[mask].abs().max() > 1e-3
    # the reference is still the base model (adapters disabled), although the adapters moved
    ref_after = w.compute_ref_log_prob(gen).batch["ref_log_prob"]
    torch.testing.assert_close(ref_after, ref.batch["ref_log_prob"], atol=1e-6, rtol=0)


def test_a_rollout_in_another_dtype_gets_its_own_copy_written_after_every_update(tiny_model_dir):
    """rollout.dtype=bfloat16 with a float32 actor: the hf engine holds a bf16 copy; after an update it holds the
    actor's new weights cast to bf16 (written in place from the shards), and its samples score as the actor's would
    up to bf16 rounding."""
    w = ActorRolloutRefWorker(trainer_config(tiny_model_dir, **{"rollout.dtype": "bfloat16"}).actor_rollout_ref,
                              role="actor_rollout")  # fmt: skip
    w.init_model()
    assert w.rollout.module is not w.actor_module
    assert {p.dtype for p in w.rollout.module.parameters()} == {torch.bfloat16}
    gen = w.generate_sequences(make_prompts(w.tokenizer, seed=5))
    old = w.compute_log_prob(gen)
    w.update_actor(with_advantages(gen.union(old)))
    actor = get_full_state_dict(w.actor_module)
    for name, value in rollout_state(w).items():
        assert torch.equal(value, actor[name].to(torch.bfloat16)), name
    gen2 = w.generate_sequences(make_prompts(w.tokenizer, seed=6))
    mask = gen2.batch["response_mask"].bool()
    diff = (w.compute_log_prob(gen2).batch["old_log_probs"] - gen2.batch["rollout_log_probs"])[mask].abs()
    assert diff.max() < 0.1  # bf16 generation of the fp32 weights


def test_critic_values_update_and_checkpoint(worker, tiny_model_dir, tmp_path):
    cfg = trainer_config(tiny_model_dir)
    cfg.critic.rollout_n = N
    cfg.critic.ppo_micro_batch_size_per_gpu, cfg.critic.forward_micro_batch_size_per_gpu = 4, 3
    cfg.critic.optim.lr = 1e-2
    cfg.critic.checkpoint.save_contents = ["model", "extra"]  # checkpoint.save_contents reaches the engine
    critic = CriticWorker(cfg.critic)
    assert critic.config.ppo_mini_batch_size == len(TEXTS) * N
    critic.init_model()
    gen = worker.generate_sequences(make_prompts(worker.tokenizer, seed=3))
    values = critic.compute_values(gen).batch["values"]
    assert values.shape == gen.batch["responses"].shape
    assert torch.equal(values, torch.zeros_like(values))  # fresh zero-initialised value head
    gen.batch["values"] = values
    gen.batch["returns"] = torch.ones_like(values) * gen.batch["response_mask"]
    metrics = critic.update_critic(gen).meta_info["metrics"]
    assert metrics["critic/lr"] == pytest.approx(1e-2)
    new_values = critic.compute_values(gen).batch["values"]
    mask = gen.batch["response_mask"].bool()
    assert (new_values[mask] > 0).all()  # moved towards the returns of 1
    critic.save_checkpoint(str(tmp_path / "critic"))
    assert sorted(p.name.split("_world")[0] for p in (tmp_path / "critic").glob("*.pt")) == ["extra_state", "model"]
    critic.update_critic(gen)
    critic.load_checkpoint(str(tmp_path / "critic"))
    torch.testing.assert_close(critic.compute_values(gen).batch["values"], new_values, atol=1e-6, rtol=0)


def test_reward_model_scores_last_response_token(worker, tiny_model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    rm_dir = str(tmp_path / "rm")
    AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1).save_pretrained(rm_dir)
    rm = RewardModelWorker(OmegaConf.create({"model": {"path": rm_dir}, "micro_batch_size_per_gpu": 3}))
    rm.init_model()

    tok = worker.tokenizer
    eos = pad = tok.pad_token_id  # pad == eos: HF's own pooling would pick the wrong token
    prompts = make_prompts(tok, repeat=1)
    responses = torch.tensor([[7, 8, eos, pad, pad], [9, 10, 11, 12, 13], [14, eos, pad, pad, pad], [eos] + [pad] * 4])
    batch = build_rollout_output(prompts, responses, eos, pad)
    scores = rm.compute_rm_score(batch).batch["rm_scores"]

    plain = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    with torch.no_grad():
        hidden = plain.model(
            input_ids=batch.batch["input_ids"],
            attention_mask=batch.batch["attention_mask"],
            position_ids=batch.batch["position_ids"],
        ).last_hidden_state
        token_scores = plain.score(hidden)[..., 0]
    last_response_token = [2, 4, 1, 0]  # by hand: index of the first eos, or the last token
    expected = torch.zeros(4, RESPONSE_LEN)
    for i, j in enumerate(last_response_token):
        expected[i, j] = token_scores[i, PROMPT_LEN + j]
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)
    assert (scores.abs().sum(-1) > 0).all()


# ------------------------------------------------------------------------------------ with Ray
def _group(ray_cls_dict: dict, n_ranks: int):
    from verl.single_controller.ray import RayResourcePool, RayWorkerGroup, create_colocated_worker_cls

    pool = RayResourcePool(process_on_nodes=[n_ranks], use_gpu=False)
    if len(ray_cls_dict) == 1:
        return pool, {next(iter(ray_cls_dict)): RayWorkerGroup(pool, next(iter(ray_cls_dict.values())))}
    fused = RayWorkerGroup(pool, create_colocated_worker_cls(ray_cls_dict))
    return pool, fused.spawn(prefix_set=ray_cls_dict.keys())


def _one_update(cfg, n_ranks: int, batch: DataProto) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """log-probs of `batch` before and after one actor update in a group of `n_ranks`, and its metrics."""
    from verl.single_controller.ray import RayClassWithInitArgs

    cls = RayClassWithInitArgs(ActorRolloutRefWorker, config=cfg.actor_rollout_ref, role="actor_rollout")
    pool, groups = _group({"actor_rollout": cls}, n_ranks)
    try:
        wg = groups["actor_rollout"]
        wg.init_model()
        before = wg.compute_log_prob(batch)
        metrics = wg.update_actor(with_advantages(batch.select(deepcopy=True).union(before))).meta_info["metrics"]
        after = wg.compute_log_prob(batch).batch["old_log_probs"]
    finally:
        pool.remove_placement_groups()
    return before.batch["old_log_probs"], after, metrics


@pytest.mark.ray
@pytest.mark.slow
def test_two_rank_update_equals_one_rank_update(ray_session, worker, tiny_model_dir):
    # AdamW with a large eps makes the step proportional to the gradient, so a wrongly scaled or partial
    # gradient (e.g. one rank's only) shows up in the updated log-probs.
    overrides = {"actor.optim.eps": 1.0, "actor.optim.lr": 1.0, "actor.grad_clip": 1e9}  # no clipping either
    cfg = trainer_config(tiny_model_dir, **overrides)
    batch = worker.generate_sequences(make_prompts(worker.tokenizer, seed=4))
    batch = batch.select(batch_keys=["input_ids", "attention_mask", "position_ids", "responses", "response_mask"])
    before1, after1, metrics1 = _one_update(cfg, 1, batch)
    before2, after2, metrics2 = _one_update(cfg, 2, batch)
    mask = batch.batch["response_mask"].bool()
    torch.testing.assert_close(before2, before1, atol=1e-6, rtol=0)
    change = (after1 - before1)[mask].abs().max()
    assert change > 1e-3, f"the update should move the log-probs, moved {change}"
    assert (after2 - after1)[mask].abs().max() < 1e-3 * change + 1e-6
    assert np.mean(metrics2["actor/pg_loss"]) == pytest.approx(np.mean(metrics1["actor/pg_loss"]), abs=1e-6)
    assert metrics2["actor/grad_norm"][0] == pytest.approx(metrics1["actor/grad_norm"][0], rel=1e-5)


@pytest.mark.ray
@pytest.mark.slow
def test_colocated_actor_rollout_and_critic_run_a_step(ray_session, tiny_model_dir):
    from verl.single_controller.ray import RayClassWithInitArgs

    cfg = trainer_config(tiny_model_dir)
    cfg.critic.rollout_n = N
    classes = {
        "actor_rollout": RayClassWithInitArgs(
            ActorRolloutRefWorker, config=cfg.actor_rollout_ref, role="actor_rollout"
        ),
        "critic": RayClassWithInitArgs(CriticWorker, config=cfg.critic),
    }
    pool, groups = _group(classes, 2)
    try:
        actor_wg, critic_wg = groups["actor_rollout"], groups["critic"]
        critic_wg.init_model()
        actor_wg.init_model()
        from transformers import AutoTokenizer

        gen = actor_wg.generate_sequences(make_prompts(AutoTokenizer.from_pretrained(tiny_model_dir), seed=5))
        assert gen.batch["responses"].shape == (len(TEXTS) * N, RESPONSE_LEN)
        old = actor_wg.compute_log_prob(gen)
        assert max(old.meta_info["metrics"]["training/rollout_probs_diff_max"]) < 1e-5
        batch = with_advantages(gen.union(old))
        batch = batch.union(critic_wg.compute_values(batch))
        batch.batch["returns"] = batch.batch["advantages"]
        critic_metrics = critic_wg.update_critic(batch).meta_info["metrics"]
        actor_metrics = actor_wg.update_actor(batch).meta_info["metrics"]
        assert len(critic_metrics["critic/lr"]) == 2 and len(actor_metrics["actor/lr"]) == 2  # one per rank
        gen2 = actor_wg.generate_sequences(make_prompts(AutoTokenizer.from_pretrained(tiny_model_dir), seed=6))
        old2 = actor_wg.compute_log_prob(gen2)
        assert max(old2.meta_info["metrics"]["training/rollout_probs_diff_max"]) < 1e-5
        mask = gen2.batch["response_mask"].bool()
        lp_diff = (old2.batch["old_log_probs"] - gen2.batch["rollout_log_probs"])[mask].abs().max()
        assert lp_diff < 1e-5  # both ranks' rollout engines sample from the updated weights
        moved = actor_wg.compute_log_prob(gen).batch["old_log_probs"] - old.batch["old_log_probs"]
        assert moved[gen.batch["response_mask"].bool()].abs().max() > 1e-3  # so a stale engine would show
    finally:
        pool.remove_placement_groups()


def test_fsdp_config_keys_on_cpu_offload_notice_once_and_bf16_master_weights(tiny_model_dir, monkeypatch, capsys):
    """verl's fsdp_config on a CPU worker: param/optimizer offload print one notice per process and change nothing;
    model_dtype=bf16 keeps the actor's FSDP parameters in bf16; wrap_policy/forward_prefetch/fsdp_size are taken;
    a step still trains."""
    from verl.utils import fsdp_utils

    monkeypatch.setattr(fsdp_utils, "_NOTICES_PRINTED", set())
    fsdp = {"param_offload": True, "optimizer_offload": True, "model_dtype": "bf16", "forward_prefetch": True,
            "fsdp_size": -1, "wrap_policy": {"min_num_params": 0}, "reshard_after_forward": True}  # fmt: skip
    cfg = trainer_config(tiny_model_dir, **{"actor.fsdp_config": fsdp, "ref.fsdp_config": fsdp})
    with restored_dist_env():
        w = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor_rollout_ref")
        w.init_model()
    assert w.offload_actor_optimizer is False
    assert {p.dtype for p in w.actor_module.parameters()} == {torch.bfloat16}
    assert all(p.device.type == "cpu" for p in w.actor_module.parameters())
    gen = w.generate_sequences(make_prompts(w.tokenizer, seed=1))
    old = w.compute_log_prob(gen)
    before = get_full_state_dict(w.actor_module)
    metrics = w.update_actor(with_advantages(gen.union(old))).meta_info["metrics"]
    assert np.isfinite(metrics["actor/pg_loss"]).all()
    after = get_full_state_dict(w.actor_module)
    assert any(not torch.equal(before[k], after[k]) for k in before)  # it trained
    assert capsys.readouterr().err.count("has no effect on CPU") == 1  # actor and ref: one notice per process


def test_critic_reads_verl_0_9_fsdp_section_first():
    from verl.workers.fsdp_workers import critic_fsdp_config

    cfg = OmegaConf.create(
        {"model": {"fsdp_config": {"param_offload": True, "fsdp_size": 2, "model_dtype": "bf16"}},
         "fsdp_config": {"fsdp_size": 4}, "fsdp": {"param_offload": False}}
    )  # fmt: skip
    assert critic_fsdp_config(cfg) == {"param_offload": False, "fsdp_size": 4, "model_dtype": "bf16"}
    assert critic_fsdp_config(OmegaConf.create({"model": {}})) == {}
