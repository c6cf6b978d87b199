"""The FSDP2 training engine (verl/workers/engine/fsdp/transformer_impl.py, packed.py) on a tiny random Qwen2.

- verl's path: `train_batch(data, partial(ppo_loss, config))` gives exactly the Hydra actor's update
  (`DataParallelPPOActor.update_policy`), which runs on it;
- AReaL-lite's path: `train_batch(data, loss_fn, loss_weight_fn)` over packed sequences equals one step of the
  token-weighted loss over the whole padded batch written by hand, however the batch is cut into micro-batches,
  and on 2 FSDP2 ranks with unequal rows equals 1 process on all rows; `eval_batch` / `forward` against the model;
- save/load (HF folder, sharded with optimizer) and weight updates (colocated stream, disk) read back.
"""

import copy
import functools
import os
import tempfile

import pytest
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict

from tests.multirank import run_ranks, shard_on_cpu
from verl.models.tiny import random_qwen2
from verl.protocol import DataProto
from verl.utils import tensordict_utils as tu
from verl.utils.fsdp_utils import free_port
from verl.workers.actor import DataParallelPPOActor
from verl.workers.engine import FSDPEngine, FSDPEngineWithLMHead
from verl.workers.utils.losses import ppo_loss

VOCAB = 48


def make_model(seed: int = 0):
    return random_qwen2(seed, vocab_size=VOCAB, intermediate_size=64)


def params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


# ------------------------------------------------------------------------------------------ verl's path (PPO)
def ppo_batch() -> DataProto:
    gen = torch.Generator().manual_seed(3)
    bs, prompt_len, response_len = 6, 4, 5
    prompt_mask = torch.arange(prompt_len).expand(bs, -1) >= torch.tensor([0, 1, 2, 0, 3, 1]).unsqueeze(1)
    response_mask = torch.arange(response_len).expand(bs, -1) < torch.tensor([5, 2, 4, 1, 5, 3]).unsqueeze(1)
    prompts = torch.randint(1, VOCAB, (bs, prompt_len), generator=gen) * prompt_mask
    responses = torch.randint(1, VOCAB, (bs, response_len), generator=gen) * response_mask
    attention = torch.cat([prompt_mask, response_mask], dim=1).long()
    tensors = {
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention,
        "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
        "response_mask": response_mask.long(),
        "old_log_probs": -torch.rand(bs, response_len, generator=gen) * 4,
        "advantages": torch.randn(bs, response_len, generator=gen),
        "ref_log_prob": -torch.rand(bs, response_len, generator=gen) * 4,
    }
    return DataProto.from_dict(tensors=tensors, meta_info={"temperature": 0.9})


def ppo_config():
    return OmegaConf.create(
        {
            "ppo_mini_batch_size": 6, "ppo_micro_batch_size_per_gpu": 2, "ppo_epochs": 1, "shuffle": False,
            "grad_clip": 1.0, "clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0,
            "policy_loss": {"loss_mode": "vanilla"}, "loss_agg_mode": "token-mean", "entropy_coeff": 0.01,
            "use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "low_var_kl", "use_dynamic_bsz": False,
        }
    )  # fmt: skip


def test_ppo_loss_on_the_engine_is_the_actors_update():
    """The Hydra trainer's actor update and a user's `engine.train_batch(data, partial(ppo_loss, config))` on the
    same batch give the same weights and the same losses (to 1e-6): one code path."""
    config, data = ppo_config(), ppo_batch()
    base = make_model(1)
    trainer_model, engine_model = copy.deepcopy(base), copy.deepcopy(base)
    actor = DataParallelPPOActor(config, trainer_model, torch.optim.AdamW(trainer_model.parameters(), lr=1e-2))
    metrics = actor.update_policy(data)

    engine = FSDPEngineWithLMHead.from_module(
        engine_model, torch.optim.AdamW(engine_model.parameters(), lr=1e-2), optimizer_config={"clip_grad": 1.0}
    )
    batch = data.batch.clone()
    tu.assign_non_tensor(batch, temperature=0.9, micro_batch_size_per_gpu=2, calculate_entropy=True)
    with engine.train_mode():
        out = engine.train_batch(batch, functools.partial(ppo_loss, OmegaConf.create(OmegaConf.to_container(config))))
    assert max_diff(params(trainer_model), params(engine_model)) < 1e-6
    assert max_diff(params(base), params(engine_model)) > 1e-4  # it did train
    assert sum(out["metrics"]["actor/pg_loss"]) == pytest.approx(metrics["actor/pg_loss"][0], abs=1e-6)
    assert sum(out["metrics"]["actor/kl_loss"]) == pytest.approx(metrics["actor/kl_loss"][0], abs=1e-6)
    assert out["metrics"]["grad_norm"] == pytest.approx(metrics["actor/grad_norm"][0], abs=1e-6)
    assert len(out["loss"]) == 3 and out["model_output"]["log_probs"].shape == (6, 5)


def test_infer_batch_returns_rows_in_input_order_whatever_the_micro_batches():
    model = make_model(2)
    engine = FSDPEngineWithLMHead.from_module(model)
    data = ppo_batch().batch
    outputs = []
    for settings in ({"micro_batch_size_per_gpu": 6}, {"micro_batch_size_per_gpu": 4},
                     {"use_dynamic_bsz": True, "max_token_len_per_gpu": 12}):  # fmt: skip
        batch = data.clone()
        tu.assign_non_tensor(batch, temperature=1.0, calculate_entropy=True, **settings)
        with engine.eval_mode():
            outputs.append(engine.infer_batch(batch)["model_output"])
    for other in outputs[1:]:
        for key in ("log_probs", "entropy"):
            torch.testing.assert_close(other[key], outputs[0][key], atol=1e-6, rtol=0)
    batch = data.clone()
    tu.assign_non_tensor(batch, temperature=1.0, micro_batch_size_per_gpu=None)
    with pytest.raises(ValueError, match="micro batch size must be a positive int"):
        engine.infer_batch(batch)


def count_gathers(monkeypatch) -> list[bool]:
    """A list that gets one entry per FSDP2 unshard call, True when the call really gathers (not already gathered)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    gathers = []
    real_unshard = FSDPParamGroup.unshard

    def counted(group, *args, **kwargs):
        gathers.append(group._all_gather_result is None and not group.is_unsharded)
        return real_unshard(group, *args, **kwargs)

    monkeypatch.setattr(FSDPParamGroup, "unshard", counted)
    return gathers


def test_infer_batch_on_one_fsdp2_rank_gathers_once_and_gives_the_same_outputs(process_group, monkeypatch):
    """One rank: the forward-only pass gathers each FSDP2 unit once for all its micro-batches (not once per
    micro-batch), gives the same log-probs as FSDP2's own per-forward gathering (to the bit) and as the unsharded
    model, and leaves the module sharded, with FSDP2's hooks working: a training step after it equals one without."""
    from torch.distributed.tensor import DTensor

    from verl.utils.fsdp_utils import apply_fsdp2
    from verl.workers.engine.fsdp import transformer_impl
    from verl.workers.engine.utils import one_rank_fsdp2

    base = make_model(6)
    plain = FSDPEngineWithLMHead.from_module(copy.deepcopy(base))
    engines = [
        FSDPEngineWithLMHead.from_module(
            m, torch.optim.SGD(m.parameters(), lr=0.1), optimizer_config={"clip_grad": 1e9}
        )
        for m in (apply_fsdp2(copy.deepcopy(base)), apply_fsdp2(copy.deepcopy(base)))
    ]
    assert one_rank_fsdp2(engines[0].module) and not one_rank_fsdp2(plain.module)
    units = sum(1 for m in engines[0].module.modules() if hasattr(m, "unshard"))
    gathers = count_gathers(monkeypatch)

    def log_probs(engine):
        batch = ppo_batch().batch
        tu.assign_non_tensor(batch, temperature=0.9, micro_batch_size_per_gpu=2, calculate_entropy=True)
        with engine.eval_mode():
            return engine.infer_batch(batch)["model_output"]

    want = log_probs(plain)
    gathers.clear()
    got = log_probs(engines[0])
    assert sum(gathers) == units  # 3 micro-batches, each unit gathered once
    assert all(isinstance(p, DTensor) for p in engines[0].module.parameters())  # resharded after
    with monkeypatch.context() as m:
        m.setattr(transformer_impl, "one_rank_fsdp2", lambda module: False)
        gathers.clear()
        per_forward = log_probs(engines[1])
        assert sum(gathers) == 3 * units
    for key in ("log_probs", "entropy"):
        assert torch.equal(got[key], per_forward[key])
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=0)

    config = OmegaConf.create(OmegaConf.to_container(ppo_config()))
    for engine in engines:  # engines[1] never took the one-gather path
        batch = ppo_batch().batch
        tu.assign_non_tensor(batch, temperature=0.9, micro_batch_size_per_gpu=2, calculate_entropy=True)
        with engine.train_mode():
            engine.train_batch(batch, functools.partial(ppo_loss, config))
    trained = [{n: p.full_tensor() for n, p in e.module.named_parameters()} for e in engines]
    assert max_diff(trained[0], trained[1]) == 0.0 and max_diff(params(base), trained[0]) > 1e-4


def test_training_on_one_cpu_rank_gathers_once_for_all_micro_batches_with_the_same_result(process_group, monkeypatch):
    """One CPU rank: a training pass gathers each FSDP2 unit once for its 3 micro-batches (FSDP2 alone gathers it
    for every forward and again for every backward: 6 times), and two steps give bit for bit the weights, losses and
    gradient norms of FSDP2's own gathering; the module is sharded again after each pass."""
    from torch.distributed.tensor import DTensor

    from verl.utils.fsdp_utils import apply_fsdp2
    from verl.workers.engine.fsdp import transformer_impl

    base = make_model(7)
    engines = []
    for _ in range(2):
        module = apply_fsdp2(copy.deepcopy(base))
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
        engines.append(FSDPEngineWithLMHead.from_module(module, optimizer, optimizer_config={"clip_grad": 1.0}))
    units = sum(1 for m in engines[0].module.modules() if hasattr(m, "unshard"))
    gathers = count_gathers(monkeypatch)
    config = OmegaConf.create(OmegaConf.to_container(ppo_config()))

    def train(engine):
        batch = ppo_batch().batch
        tu.assign_non_tensor(batch, temperature=0.9, micro_batch_size_per_gpu=2, calculate_entropy=True)
        gathers.clear()
        with engine.train_mode():
            out = engine.train_batch(batch, functools.partial(ppo_loss, config))
        assert all(isinstance(p, DTensor) for p in engine.module.parameters())  # resharded after
        return out, sum(gathers)

    runs = []
    for index, engine in enumerate(engines):
        with monkeypatch.context() as m:
            if index == 1:  # FSDP2's own gathering
                m.setattr(transformer_impl, "one_rank_fsdp2", lambda module: False)
            runs.append([train(engine) for _ in range(2)])
    assert [g for _, g in runs[0]] == [units, units] and [g for _, g in runs[1]] == [6 * units, 6 * units]
    for (ours, _), (theirs, _) in zip(runs[0], runs[1]):
        assert ours["loss"] == theirs["loss"] and ours["metrics"]["grad_norm"] == theirs["metrics"]["grad_norm"]
    trained = [{n: p.full_tensor() for n, p in e.module.named_parameters()} for e in engines]
    assert max_diff(trained[0], trained[1]) == 0.0 and max_diff(params(base), trained[0]) > 1e-4


# ------------------------------------------------------------------------------------------ AReaL-lite's path
LENGTHS = [7, 3, 9, 5, 6]  # sequence lengths; the first 3 tokens of each are the prompt (loss mask 0)


def packed_batch(rows: list[int] | None = None) -> TensorDict:
    """Right-padded sequences with a loss mask on the completion and a per-sequence reward on every token."""
    rows = list(range(len(LENGTHS))) if rows is None else rows
    gen = torch.Generator().manual_seed(5)
    width = max(LENGTHS)
    ids = torch.randint(1, VOCAB, (len(LENGTHS), width), generator=gen)
    rewards = torch.randn(len(LENGTHS), generator=gen)
    positions = torch.arange(width).expand(len(LENGTHS), -1)
    mask = positions < torch.tensor(LENGTHS).unsqueeze(1)
    loss_mask = mask & (positions >= 3)
    td = TensorDict(
        {
            "input_ids": ids * mask,
            "attention_mask": mask,
            "loss_mask": loss_mask.long(),
            "rewards": rewards.unsqueeze(1).expand(-1, width) * mask,
        },
        batch_size=[len(LENGTHS)],
    )
    return td[torch.tensor(rows)]


def reinforce_loss_fn(logits, data):
    """-log p * reward over completion tokens, token-mean (labels and mask shifted: position t predicts t + 1)."""
    labels = torch.roll(data["input_ids"], shifts=-1)
    mask = torch.roll(data["loss_mask"], shifts=-1).bool()
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return torch.where(mask, -logprobs * data["rewards"], 0.0).sum() / mask.count_nonzero()


def loss_weight_fn(data):
    return data["loss_mask"].count_nonzero()


def hand_loss(model, td: TensorDict) -> torch.Tensor:
    """The same loss over the whole padded batch at once, with plain HF calls."""
    logits = model(input_ids=td["input_ids"], attention_mask=td["attention_mask"].long()).logits[:, :-1]
    logprobs = torch.log_softmax(logits, -1).gather(-1, td["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
    mask = td["loss_mask"][:, 1:].bool()
    return torch.where(mask, -logprobs * td["rewards"][:, 1:], 0.0).sum() / mask.count_nonzero()


@pytest.mark.parametrize("settings", [{}, {"micro_batch_size_per_gpu": 2}, {"use_dynamic_bsz": True, "max_token_len_per_gpu": 10}],
                         ids=["one", "rows_of_2", "token_budget"])  # fmt: skip
def test_packed_loss_step_equals_the_whole_batch_loss_written_by_hand(settings):
    base = make_model(3)
    ref_model, engine_model = copy.deepcopy(base), copy.deepcopy(base)
    reference = hand_loss(ref_model, packed_batch())
    reference.backward()
    torch.optim.SGD(ref_model.parameters(), lr=0.5).step()

    engine = FSDPEngine.from_module(engine_model, torch.optim.SGD(engine_model.parameters(), lr=0.5),
                                    optimizer_config={"clip_grad": 1e9})  # fmt: skip
    data = packed_batch()
    tu.assign_non_tensor(data, **settings)
    stats = engine.train(True).train_batch(data, loss_fn=reinforce_loss_fn, loss_weight_fn=loss_weight_fn)
    assert stats["loss"] == pytest.approx(float(reference), abs=1e-6)
    assert stats["update_successful"] == 1.0 and stats["lr"] == 0.5
    assert max_diff(params(ref_model), params(engine_model)) < 1e-6


def test_eval_batch_and_forward_match_the_model():
    model = make_model(4)
    engine = FSDPEngine.from_module(model)
    engine.micro_batch_size_per_gpu = 2  # the engine's default micro-batch, for batches that carry none
    data = packed_batch()
    before = params(model)
    assert engine.eval_batch(data, reinforce_loss_fn, loss_weight_fn) == pytest.approx(
        float(hand_loss(model, data)), abs=1e-6
    )
    assert max_diff(before, params(model)) == 0.0
    logits = engine.forward(data)
    full = model(input_ids=data["input_ids"], attention_mask=data["attention_mask"].long()).logits
    mask = data["attention_mask"]
    torch.testing.assert_close(logits[mask], full[mask].detach(), atol=1e-5, rtol=0)
    assert (logits[~mask] == 0).all()
    hooked = engine.forward(data, post_hook=lambda out, mb: out.argmax(-1))
    assert torch.equal(hooked[mask], full[mask].argmax(-1))
    with pytest.raises(TypeError, match="needs loss_weight_fn"):
        engine.train_batch(data, loss_fn=reinforce_loss_fn)
    with pytest.raises(ValueError, match="total weight of 0"):
        engine.eval_batch(data, reinforce_loss_fn, lambda mb: 0)


# 2 ranks with unequal rows (3 and 2; micro-batches of 2: rank 1 has one fewer row, rank 0 a half-full micro-batch)
RANK_PACKED_ROWS = [[0, 2, 4], [1, 3]]


def run_packed_rank(rank: int, world_size: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        model = make_model(3)
        shard_on_cpu(model)
        engine = FSDPEngine.from_module(model, torch.optim.SGD(model.parameters(), lr=0.5),
                                        optimizer_config={"clip_grad": 1e9})  # fmt: skip
        engine.micro_batch_size_per_gpu = 1 if rank == 0 else 2  # 3 micro-batches on rank 0, 1 on rank 1
        stats = engine.train_batch(packed_batch(RANK_PACKED_ROWS[rank]), reinforce_loss_fn, loss_weight_fn)
        full = {name: p.full_tensor() for name, p in model.named_parameters()}
        if rank == 0:
            torch.save({"params": full, "stats": stats}, os.path.join(out_dir, "result.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_packed_loss_on_two_fsdp2_ranks_equals_one_process_on_all_rows():
    base = make_model(3)
    reference = hand_loss(base, packed_batch())
    reference.backward()
    torch.optim.SGD(base.parameters(), lr=0.5).step()
    with tempfile.TemporaryDirectory() as out_dir:
        run_ranks(run_packed_rank, 2, free_port(), out_dir)
        result = torch.load(os.path.join(out_dir, "result.pt"))
    assert result["stats"]["loss"] == pytest.approx(float(reference), abs=1e-6)
    assert max_diff(params(base), result["params"]) < 1e-6
