"""Tests of verl/workers/actor/dp_actor.py on a tiny random Qwen2, against hand-written references."""

import copy
import os
import tempfile

import pytest
import torch
from omegaconf import OmegaConf
from transformers import Qwen2Config, Qwen2ForCausalLM

from tests.multirank import run_ranks, shard_on_cpu
from verl.protocol import DataProto
from verl.utils.fsdp_utils import free_port
from verl.workers.actor import DataParallelPPOActor

PROMPT_LEN, RESPONSE_LEN, VOCAB = 5, 4, 64


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and the machine is shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_model(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=64,
    )
    return Qwen2ForCausalLM(config)


def make_batch(prompt_lens: list[int], response_lens: list[int], seed: int = 0, temperature: float = 1.0) -> DataProto:
    """Left-padded prompts and right-padded responses (pad id 0) with their masks and position ids."""
    bs = len(prompt_lens)
    gen = torch.Generator().manual_seed(seed)
    prompt_mask = torch.arange(PROMPT_LEN).expand(bs, -1) >= (PROMPT_LEN - torch.tensor(prompt_lens)).unsqueeze(1)
    response_mask = torch.arange(RESPONSE_LEN).expand(bs, -1) < torch.tensor(response_lens).unsqueeze(1)
    prompts = torch.randint(1, VOCAB, (bs, PROMPT_LEN), generator=gen) * prompt_mask
    responses = torch.randint(1, VOCAB, (bs, RESPONSE_LEN), generator=gen) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "response_mask": response_mask.long(),
        },
        meta_info={"temperature": temperature},
    )


PROMPT_LENS = [2, 5, 3, 4, 5, 2, 4, 3]
RESPONSE_LENS = [4, 1, 3, 2, 4, 4, 1, 2]


def actor_config(**overrides):
    base = {
        "ppo_mini_batch_size": 8,
        "ppo_micro_batch_size_per_gpu": 8,
        "ppo_epochs": 1,
        "shuffle": False,
        "data_loader_seed": 1,
        "grad_clip": 1.0e9,
        "clip_ratio": 0.2,
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.2,
        "clip_ratio_c": 3.0,
        "policy_loss": {"loss_mode": "vanilla"},
        "loss_agg_mode": "token-mean",
        "entropy_coeff": 0.0,
        "use_kl_loss": False,
        "kl_loss_coef": 0.001,
        "kl_loss_type": "low_var_kl",
        "use_dynamic_bsz": False,
    }
    base.update(overrides)
    return OmegaConf.create(base)


def hand_logits(model, batch) -> torch.Tensor:
    """Logits (bs, response_len, vocab) predicting each response token: row PROMPT_LEN - 1 + t predicts token t."""
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
    ).logits
    return torch.stack([logits[:, PROMPT_LEN - 1 + t] for t in range(RESPONSE_LEN)], dim=1)


def hand_log_probs(model, batch, temperature: float = 1.0) -> torch.Tensor:
    log_softmax = torch.log_softmax(hand_logits(model, batch) / temperature, dim=-1)
    return log_softmax.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)


def add_ppo_fields(data: DataProto, model, seed: int = 1, old_shift: float = 0.0) -> DataProto:
    """old_log_probs (current log-probs + old_shift * noise) and per-sample advantages broadcast on the mask."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        log_probs = hand_log_probs(model, data.batch)
    bs = len(data)
    mask = data.batch["response_mask"].float()
    data.batch["old_log_probs"] = log_probs + old_shift * torch.randn(bs, RESPONSE_LEN, generator=gen)
    data.batch["advantages"] = torch.randn(bs, 1, generator=gen) * mask
    return data


def params(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


# ---------------------------------------------------------------------------------------------- compute_log_prob
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_compute_log_prob_matches_hand_log_softmax(temperature):
    model = make_model()
    data = make_batch(PROMPT_LENS, RESPONSE_LENS, temperature=temperature)
    data.meta_info["micro_batch_size"] = 3  # 8 rows -> micro-batches of 3, 3, 2
    actor = DataParallelPPOActor(actor_config(), model)

    log_probs, entropys = actor.compute_log_prob(data, calculate_entropy=True)

    with torch.no_grad():
        logits = hand_logits(model, data.batch) / temperature
    expected = torch.log_softmax(logits, -1).gather(-1, data.batch["responses"].unsqueeze(-1)).squeeze(-1)
    probs = torch.softmax(logits, -1)
    expected_entropy = -(probs * torch.log(probs)).sum(-1)
    assert log_probs.shape == (8, RESPONSE_LEN)
    assert torch.isfinite(log_probs).all()
    torch.testing.assert_close(log_probs, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropys, expected_entropy, atol=1e-5, rtol=1e-5)
    assert actor.compute_log_prob(data)[1] is None


def test_compute_log_prob_rejects_bad_temperature():
    actor = DataParallelPPOActor(actor_config(), make_model())
    data = make_batch(PROMPT_LENS, RESPONSE_LENS, temperature=0.0)
    data.meta_info["micro_batch_size"] = 8
    with pytest.raises(ValueError, match="temperature"):
        actor.compute_log_prob(data)


# ---------------------------------------------------------------------------------------------- update_policy
@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_update_is_the_same_for_one_or_four_micro_batches(loss_agg_mode):
    base = make_model()
    data = add_ppo_fields(make_batch(PROMPT_LENS, RESPONSE_LENS), base, old_shift=0.3)
    before = params(base)
    results = []
    for micro in (8, 2):
        model = copy.deepcopy(base)
        actor = DataParallelPPOActor(
            actor_config(ppo_micro_batch_size_per_gpu=micro, loss_agg_mode=loss_agg_mode),
            model,
            torch.optim.SGD(model.parameters(), lr=0.5),
        )
        metrics = actor.update_policy(data)
        assert metrics["actor/nonfinite_steps"] == 0.0
        assert len(metrics["actor/pg_clipfrac"]) == 8 // micro
        results.append((params(model), metrics))
    (one, m_one), (four, m_four) = results
    assert max_diff(one, before) > 1e-3  # the update moved the weights
    assert max_diff(one, four) < 1e-6
    assert m_one["actor/pg_loss"][0] == pytest.approx(m_four["actor/pg_loss"][0], abs=1e-6)
    assert m_one["actor/grad_norm"][0] == pytest.approx(m_four["actor/grad_norm"][0], rel=1e-5)


def hand_loss(model, data: DataProto, kl_coef: float = 0.0, entropy_coeff: float = 0.0) -> torch.Tensor:
    """Vanilla PPO loss at ratio 1 (old == current), token-mean over the whole batch, plus the optional terms."""
    batch = data.batch
    mask = batch["response_mask"].float()
    n_tokens = mask.sum()
    logits = hand_logits(model, batch)
    log_probs = torch.log_softmax(logits, -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(log_probs - batch["old_log_probs"])
    loss = (-batch["advantages"] * ratio * mask).sum() / n_tokens
    if kl_coef:
        x = batch["ref_log_prob"] - log_probs
        loss = loss + kl_coef * ((torch.exp(x) - x - 1) * mask).sum() / n_tokens
    if entropy_coeff:
        probs = torch.softmax(logits, -1)
        entropy = -(probs * torch.log_softmax(logits, -1)).sum(-1)
        loss = loss - entropy_coeff * (entropy * mask).sum() / n_tokens
    return loss


def hand_grads(model, data: DataProto, **kwargs) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model)
    model.zero_grad()
    hand_loss(model, data, **kwargs).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("clip", [False, True])
def test_single_update_equals_hand_adamw_step(clip):
    base = make_model()
    data = add_ppo_fields(make_batch(PROMPT_LENS, RESPONSE_LENS), base)  # old == current: ratio 1
    grads = hand_grads(base, data)
    grad_norm = torch.sqrt(sum((g**2).sum() for g in grads.values())).item()
    max_norm = 0.5 * grad_norm if clip else 1.0e9
    scale = min(1.0, max_norm / (grad_norm + 1e-6))
    lr, weight_decay, eps = 0.01, 0.1, 1.0  # eps = 1 keeps the step proportional to the gradient's size

    model = copy.deepcopy(base)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, eps=eps)
    actor = DataParallelPPOActor(actor_config(grad_clip=max_norm, ppo_micro_batch_size_per_gpu=4), model, optimizer)
    metrics = actor.update_policy(data)

    # first AdamW step: the bias-corrected moments are g and g^2
    for name, p in base.named_parameters():
        g = grads[name] * scale
        expected = p.detach() * (1 - lr * weight_decay) - lr * g / (g.abs() + eps)
        torch.testing.assert_close(dict(model.named_parameters())[name].detach(), expected, atol=1e-7, rtol=1e-5)
    assert metrics["actor/grad_norm"] == [pytest.approx(grad_norm, rel=1e-4)]
    with torch.no_grad():
        assert metrics["actor/pg_loss"] == [pytest.approx(hand_loss(base, data).item(), abs=1e-6)]
    assert metrics["actor/pg_clipfrac"] == [0.0, 0.0]
    assert metrics["actor/ppo_kl"] == [pytest.approx(0.0, abs=1e-6)] * 2


def test_kl_and_entropy_terms_give_the_hand_gradient():
    base = make_model()
    data = add_ppo_fields(make_batch(PROMPT_LENS, RESPONSE_LENS), base)
    gen = torch.Generator().manual_seed(5)
    data.batch["ref_log_prob"] = data.batch["old_log_probs"] - torch.rand(8, RESPONSE_LEN, generator=gen)
    kl_coef, entropy_coeff, lr = 0.7, 0.05, 0.5
    grads = hand_grads(base, data, kl_coef=kl_coef, entropy_coeff=entropy_coeff)
    grads_without = hand_grads(base, data)

    model = copy.deepcopy(base)
    config = actor_config(use_kl_loss=True, kl_loss_coef=kl_coef, entropy_coeff=entropy_coeff)
    config.ppo_micro_batch_size_per_gpu = 2
    actor = DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=lr))
    metrics = actor.update_policy(data)

    after = params(model)
    for name, p in base.named_parameters():
        torch.testing.assert_close(after[name], p.detach() - lr * grads[name], atol=1e-6, rtol=1e-5)
    assert max((grads[k] - grads_without[k]).abs().max().item() for k in grads) > 1e-3  # the terms matter
    mask = data.batch["response_mask"].float()
    x = data.batch["ref_log_prob"] - data.batch["old_log_probs"]
    expected_kl = ((torch.exp(x) - x - 1) * mask).sum() / mask.sum()
    assert metrics["actor/kl_loss"] == [pytest.approx(expected_kl.item(), rel=1e-4)]
    assert metrics["actor/kl_coef"] == [kl_coef]
    assert metrics["actor/entropy"][0] > 0


def test_nonfinite_gradient_skips_the_step_and_is_counted():
    base = make_model()
    data = add_ppo_fields(make_batch(PROMPT_LENS, RESPONSE_LENS), base)
    data.batch["advantages"][0, 0] = float("inf")
    model = copy.deepcopy(base)
    actor = DataParallelPPOActor(actor_config(), model, torch.optim.AdamW(model.parameters(), lr=0.1))

    metrics = actor.update_policy(data)

    assert metrics["actor/nonfinite_steps"] == 1.0
    assert not torch.isfinite(torch.tensor(metrics["actor/grad_norm"][0]))
    assert max_diff(params(model), params(base)) == 0.0
    # the next, finite update works from clean gradients
    data.batch["advantages"][0, 0] = 1.0
    metrics = actor.update_policy(data)
    assert metrics["actor/nonfinite_steps"] == 0.0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert max_diff(params(model), params(base)) > 1e-3


def test_clipfrac_when_old_log_probs_differ_strongly():
    base = make_model()
    data = add_ppo_fields(make_batch(PROMPT_LENS, RESPONSE_LENS), base)
    data.batch["advantages"] = data.batch["advantages"].abs() + data.batch["response_mask"]  # A > 0
    data.batch["old_log_probs"] = data.batch["old_log_probs"] - 1.0  # ratio e > 1 + 0.2: every token clipped
    actor = DataParallelPPOActor(actor_config(), base, torch.optim.SGD(base.parameters(), lr=0.0))

    metrics = actor.update_policy(data)

    assert metrics["actor/pg_clipfrac"][0] == pytest.approx(1.0)
    assert metrics["actor/ppo_kl"][0] == pytest.approx(-1.0, abs=1e-5)
    assert metrics["actor/grad_norm"][0] == pytest.approx(0.0, abs=1e-9)  # clipped tokens carry no gradient


def test_shuffle_is_seeded_and_bad_sizes_are_rejected():
    base = make_model()
    data = add_ppo_fields(make_batch(PROMPT_LENS, RESPONSE_LENS), base, old_shift=0.3)
    results = []
    for seed in (1, 1, 2):
        model = copy.deepcopy(base)
        config = actor_config(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4, shuffle=True)
        config.data_loader_seed = seed
        DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=0.5)).update_policy(data)
        results.append(params(model))
    assert max_diff(results[0], results[1]) == 0.0
    assert max_diff(results[0], results[2]) > 1e-6
    actor = DataParallelPPOActor(actor_config(ppo_micro_batch_size_per_gpu=0), base, torch.optim.SGD(base.parameters()))
    with pytest.raises(ValueError, match="ppo_micro_batch_size_per_gpu"):
        actor.update_policy(data)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        DataParallelPPOActor(actor_config(loss_agg_mode="mean"), base)


# ---------------------------------------------------------------------------------------------- data parallel
# Rank r holds rows RANK_ROWS[r] of the batch; token counts per rank are unequal (13 vs 8).
RANK_ROWS = [[0, 2, 4, 5], [1, 3, 6, 7]]
DP_LR = 0.5


def dp_data() -> DataProto:
    return add_ppo_fields(make_batch(PROMPT_LENS, RESPONSE_LENS), make_model(), old_shift=0.3)


def run_dp_rank(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """One rank: FSDP2-shard the tiny model, update on this rank's rows in 2 mini-batches of 2, save the result."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        model = make_model()
        shard_on_cpu(model)
        config = actor_config(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=1)
        actor = DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=DP_LR))
        metrics = actor.update_policy(dp_data()[RANK_ROWS[rank]])
        full = {name: p.full_tensor() for name, p in model.named_parameters()}
        if rank == 0:
            torch.save(full, os.path.join(out_dir, "params.pt"))
        torch.save(metrics, os.path.join(out_dir, f"metrics_{rank}.pt"))
        dist.barrier()  # gloo aborts if a rank tears down while its peer is still connected
    finally:
        dist.destroy_process_group()


def test_two_rank_fsdp2_equals_one_process_on_the_whole_batch():
    with tempfile.TemporaryDirectory() as out_dir:
        run_ranks(run_dp_rank, 2, free_port(), out_dir)
        dp_params = torch.load(os.path.join(out_dir, "params.pt"))
        dp_metrics = [torch.load(os.path.join(out_dir, f"metrics_{r}.pt")) for r in range(2)]

    # one process, the same two global mini-batches: rank 0's first 2 rows + rank 1's first 2 rows, then the rest
    order = RANK_ROWS[0][:2] + RANK_ROWS[1][:2] + RANK_ROWS[0][2:] + RANK_ROWS[1][2:]
    model = make_model()
    before = params(model)
    config = actor_config(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4)
    actor = DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=DP_LR))
    metrics = actor.update_policy(dp_data()[order])

    single = params(model)
    assert max_diff(single, before) > 1e-3
    assert max_diff(dp_params, single) < 1e-5
    for step in range(2):
        assert dp_metrics[0]["actor/grad_norm"][step] == pytest.approx(metrics["actor/grad_norm"][step], rel=1e-4)
        rank_mean = (dp_metrics[0]["actor/pg_loss"][step] + dp_metrics[1]["actor/pg_loss"][step]) / 2
        assert rank_mean == pytest.approx(metrics["actor/pg_loss"][step], abs=1e-6)


# ---------------------------------------------------------------------------------------------- padding rows
ODD_ROWS = 7  # not divisible by 2 ranks: DP_COMPUTE_PROTO pads it to 8 with a copy of row 0


def run_padded_rank(rank: int, world_size: int, port: int, out_dir: str, loss_agg_mode: str) -> None:
    """One rank: update on its DP_COMPUTE_PROTO chunk of an odd batch (rank 1's last row is padding)."""
    import torch.distributed as dist

    from verl.single_controller.base.decorator import Dispatch, dispatch_calls

    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        model = make_model()
        shard_on_cpu(model)
        calls = dispatch_calls(Dispatch.DP_COMPUTE_PROTO, world_size, (dp_data()[list(range(ODD_ROWS))],), {})
        config = actor_config(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, loss_agg_mode=loss_agg_mode)
        actor = DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=DP_LR))
        actor.update_policy(calls.args[rank][0])
        full = {name: p.full_tensor() for name, p in model.named_parameters()}
        if rank == 0:
            torch.save(full, os.path.join(out_dir, "params.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_padding_rows_of_an_odd_batch_are_not_trained_on(loss_agg_mode):
    """2 ranks, 7 rows: the padded update (rank 1 holds a copy of row 0) equals one process on the 7 real rows."""
    with tempfile.TemporaryDirectory() as out_dir:
        run_ranks(run_padded_rank, 2, free_port(), out_dir, loss_agg_mode)
        dp_params = torch.load(os.path.join(out_dir, "params.pt"))

    model = make_model()
    before = params(model)
    config = actor_config(
        ppo_mini_batch_size=ODD_ROWS, ppo_micro_batch_size_per_gpu=ODD_ROWS, loss_agg_mode=loss_agg_mode
    )
    DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=DP_LR)).update_policy(
        dp_data()[list(range(ODD_ROWS))]
    )
    single = params(model)
    assert max_diff(single, before) > 1e-3
    assert max_diff(dp_params, single) < 1e-6
