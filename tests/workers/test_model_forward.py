"""The three forward layouts of verl/workers/engine/model_forward.py (padded, packed = use_remove_padding, shared
prompt = share_prompt_prefix) against a plain full forward, and the actor/critic passes built on them: equal
log-probs, values and gradients, dynamic batch size (token budget) equal to fixed micro-batches, row order kept."""

import pytest
import torch
from omegaconf import OmegaConf
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForTokenClassification

from tests.multirank import run_ranks, shard_on_cpu
from verl.protocol import DataProto
from verl.utils.fsdp_utils import free_port
from verl.workers.actor import DataParallelPPOActor
from verl.workers.actor.dp_actor import micro_batch_plan
from verl.workers.critic.dp_critic import DataParallelPPOCritic
from verl.workers.engine.model_forward import response_outputs, scatter_to_responses

PROMPT_LEN, RESPONSE_LEN, VOCAB = 6, 4, 64
# rows 0, 2, 5 share prompt A; rows 3, 4 share prompt B; 1, 6, 7 have their own
PROMPT_OF = [0, 1, 0, 2, 2, 0, 3, 4]
PROMPT_LENS = [3, 6, 2, 5, 1]
RESPONSE_LENS = [4, 2, 4, 1, 3, 4, 2, 4]
LAYOUTS = [{}, {"use_remove_padding": True}, {"share_prompt_prefix": True}]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def qwen2_config() -> Qwen2Config:
    return Qwen2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64, num_labels=1,
    )  # fmt: skip


def make_model(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(qwen2_config())


def make_batch(seed: int = 0, prompt_of: list[int] = PROMPT_OF) -> DataProto:
    """Left-padded prompts (some shared), right-padded responses, masks and position ids as the rollout makes."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen) for n in PROMPT_LENS]
    bs = len(prompt_of)
    ids = torch.zeros(bs, PROMPT_LEN + RESPONSE_LEN, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (p, r) in enumerate(zip(prompt_of, RESPONSE_LENS)):
        n = PROMPT_LENS[p]
        ids[row, PROMPT_LEN - n : PROMPT_LEN] = prompts[p]
        ids[row, PROMPT_LEN : PROMPT_LEN + r] = torch.randint(1, VOCAB, (r,), generator=gen)
        mask[row, PROMPT_LEN - n : PROMPT_LEN + r] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    position_ids[:, PROMPT_LEN:] = position_ids[:, PROMPT_LEN - 1 : PROMPT_LEN] + torch.arange(1, RESPONSE_LEN + 1)
    response_mask = mask[:, PROMPT_LEN:]
    return DataProto.from_dict(
        tensors={
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": position_ids,
            "responses": ids[:, PROMPT_LEN:],
            "response_mask": response_mask,
        },
        meta_info={"temperature": 1.0},
    )


def full_forward_log_probs(model, batch, temperature=1.0) -> torch.Tensor:
    """Independent reference: one padded forward, log_softmax(logits / T) at row PROMPT_LEN - 1 + t."""
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
    ).logits[:, PROMPT_LEN - 1 : -1]
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return log_probs.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("layout", LAYOUTS, ids=["padded", "packed", "shared_prompt"])
def test_layout_log_probs_and_gradients_equal_a_full_forward(layout):
    model, batch = make_model(), make_batch().batch
    mask = batch["response_mask"].float()
    reference = full_forward_log_probs(model, batch)
    (reference * mask).sum().backward()
    reference_grads = grads(model)
    model.zero_grad()

    logits, where = response_outputs(model, batch, RESPONSE_LEN, is_lm=True, **layout)
    log_probs = torch.log_softmax(logits.float(), dim=-1).gather(-1, batch["responses"][where].unsqueeze(-1))
    log_probs = scatter_to_responses(log_probs.squeeze(-1), where)
    torch.testing.assert_close(log_probs * mask, reference.detach() * mask, atol=2e-6, rtol=0)
    (log_probs * mask).sum().backward()
    torch.testing.assert_close(grads(model), reference_grads, atol=2e-5, rtol=1e-5)
    if layout.get("use_remove_padding"):  # only real tokens are computed: position t needs token t-1
        previous_real = torch.cat([torch.ones(len(mask), 1), mask[:, :-1]], dim=1).bool()
        assert torch.equal(where, previous_real)


@pytest.mark.parametrize("layout", LAYOUTS, ids=["padded", "packed", "shared_prompt"])
def test_cpu_attention_keeps_the_kv_heads_grouped(layout, monkeypatch):
    """On CPU no layout copies a KV head to the query heads that share it (HF's sdpa does so whenever a mask is
    given): every SDPA call of the forward and of the update's backward gets the model's 2 KV heads and
    `enable_gqa`, the masked calls (padding, the prompt cache) included. Equal log-probs and gradients: the tests
    above."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, *args, **kwargs):
        calls.append(
            (query.shape[1], key.shape[1], kwargs.get("enable_gqa", False), kwargs.get("attn_mask") is not None)
        )
        return sdpa(query, key, value, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    model, batch = make_model(), make_batch().batch
    logits, where = response_outputs(model, batch, RESPONSE_LEN, is_lm=True, **layout)
    logits.sum().backward()
    assert calls and all(c[:3] == (4, 2, True) for c in calls), calls
    assert any(masked for *_, masked in calls) == (not layout.get("use_remove_padding"))


@pytest.mark.parametrize("prompt_of, broadcast", [([0, 0, 1, 1, 2, 2, 3, 3], True), ([0, 0, 1, 1, 2, 2, 3, 4], False),
                                                 ([1, 1, 0, 0, 2, 2, 3, 3], True), ([0, 1, 0, 1, 2, 2, 3, 3], False)])  # fmt: skip
def test_shared_prompt_copies_the_prompt_cache_by_broadcast_when_rows_are_in_group_order(prompt_of, broadcast):
    """Rows in group order, n each: each prompt's keys/values reach its rows by a broadcast (no index); otherwise
    by `batch_select_indices`. Either way log-probs and gradients equal a full forward."""
    from transformers import DynamicCache

    model, batch = make_model(), make_batch(prompt_of=prompt_of).batch
    mask = batch["response_mask"].float()
    reference = full_forward_log_probs(model, batch)
    (reference * mask).sum().backward()
    reference_grads = grads(model)
    model.zero_grad()
    indexed = []
    original = DynamicCache.batch_select_indices
    DynamicCache.batch_select_indices = lambda cache, indices: indexed.append(indices) or original(cache, indices)
    try:
        logits, where = response_outputs(model, batch, RESPONSE_LEN, is_lm=True, share_prompt_prefix=True)
    finally:
        DynamicCache.batch_select_indices = original
    assert (not indexed) == broadcast
    log_probs = torch.log_softmax(logits.float(), dim=-1).gather(-1, batch["responses"][where].unsqueeze(-1))
    log_probs = scatter_to_responses(log_probs.squeeze(-1), where)
    torch.testing.assert_close(log_probs * mask, reference.detach() * mask, atol=2e-6, rtol=0)
    (log_probs * mask).sum().backward()
    torch.testing.assert_close(grads(model), reference_grads, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS, ids=["padded", "packed", "shared_prompt"])
def test_critic_values_equal_for_every_layout(layout):
    torch.manual_seed(3)
    model = Qwen2ForTokenClassification(qwen2_config()).eval()
    data = make_batch()
    config = OmegaConf.create({"forward_micro_batch_size_per_gpu": 3, "model": layout, "loss_agg_mode": "token-mean"})
    critic = DataParallelPPOCritic(config, model, torch.optim.SGD(model.parameters(), lr=0.1))
    values = critic.compute_values(data)
    with torch.no_grad():
        b = data.batch
        full = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"])
    expected = full.logits[:, PROMPT_LEN - 1 : -1, 0] * b["response_mask"]
    torch.testing.assert_close(values, expected, atol=2e-6, rtol=0)


def actor_config(**overrides):
    base = {
        "ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 8, "ppo_epochs": 1, "shuffle": False,
        "grad_clip": 1.0e9, "clip_ratio": 0.2, "policy_loss": {"loss_mode": "vanilla"},
        "loss_agg_mode": "token-mean", "entropy_coeff": 0.0, "use_kl_loss": True, "kl_loss_coef": 0.1,
        "kl_loss_type": "low_var_kl", "use_dynamic_bsz": False,
    }  # fmt: skip
    base.update(overrides)
    return OmegaConf.create(base)


def ppo_batch(model) -> DataProto:
    data = make_batch()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        log_probs = full_forward_log_probs(model, data.batch)
    mask = data.batch["response_mask"].float()
    data.batch["old_log_probs"] = log_probs + 0.05 * torch.randn(log_probs.shape, generator=gen)
    data.batch["ref_log_prob"] = log_probs + 0.1 * torch.randn(log_probs.shape, generator=gen)
    data.batch["advantages"] = torch.randn(len(data), 1, generator=gen) * mask
    return data


def updated_params(**overrides) -> tuple[dict, dict]:
    model = make_model(seed=1)
    data = ppo_batch(model)
    actor = DataParallelPPOActor(actor_config(**overrides), model, torch.optim.SGD(model.parameters(), lr=1.0))
    metrics = actor.update_policy(data)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, metrics


@pytest.mark.parametrize(
    "overrides",
    [
        {"ppo_micro_batch_size_per_gpu": 3},
        {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 20},
        {"use_remove_padding": True, "ppo_micro_batch_size_per_gpu": 4},
        {"share_prompt_prefix": True, "ppo_micro_batch_size_per_gpu": 4, "shuffle": True},
        {"share_prompt_prefix": True, "use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 30},
        {"use_remove_padding": True, "use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 16},
    ],
    ids=["micro3", "dynamic_bsz", "packed", "shared_prompt_shuffled", "shared_dynamic", "packed_dynamic"],
)
def test_update_equals_the_single_padded_micro_batch_update(overrides):
    reference, ref_metrics = updated_params()
    params, metrics = updated_params(**overrides)
    assert max((params[k] - reference[k]).abs().max().item() for k in params) < 1e-5
    assert metrics["actor/pg_loss"] == pytest.approx(ref_metrics["actor/pg_loss"], abs=1e-5)
    assert metrics["actor/kl_loss"] == pytest.approx(ref_metrics["actor/kl_loss"], abs=1e-6)


def test_entropy_metric_comes_from_the_update_when_the_old_log_prob_pass_is_skipped():
    model = make_model(seed=1)
    data = ppo_batch(model)
    with torch.no_grad():
        b = data.batch
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"])
        logits = logits.logits[:, PROMPT_LEN - 1 : -1].float()
    entropy = torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)
    expected = (entropy * b["response_mask"]).sum() / b["response_mask"].sum()
    _, metrics = updated_params(recompute_old_log_prob=False)
    assert metrics["actor/entropy"] == [pytest.approx(expected.item(), abs=1e-5)]
    _, default = updated_params()
    assert "actor/entropy" not in default  # the recompute pass reports it instead


@pytest.mark.parametrize(
    "meta",
    [
        {"micro_batch_size": 3},
        {"micro_batch_size": 3, "use_dynamic_bsz": True, "max_token_len": 17},
    ],
)
@pytest.mark.parametrize("layout", LAYOUTS, ids=["padded", "packed", "shared_prompt"])
def test_compute_log_prob_returns_rows_in_input_order(meta, layout):
    model = make_model(seed=2).eval()
    data = make_batch()
    data.meta_info.update(meta)
    actor = DataParallelPPOActor(actor_config(**layout), model)
    log_probs, entropy = actor.compute_log_prob(data, calculate_entropy=True)
    mask = data.batch["response_mask"].float()
    with torch.no_grad():
        expected = full_forward_log_probs(model, data.batch)
    torch.testing.assert_close(log_probs * mask, expected * mask, atol=2e-6, rtol=0)
    assert entropy.shape == mask.shape and (entropy[mask.bool()] > 0).all()


def test_micro_batch_plan_budget_grouping_and_errors():
    data = make_batch()
    lengths = data.batch["attention_mask"].sum(-1)
    micro, order = micro_batch_plan(data, None, True, 16)
    assert sorted(order.tolist()) == list(range(8))
    assert all(int(m.batch["attention_mask"].sum()) <= 16 or len(m) == 1 for m in micro)
    assert torch.equal(torch.cat([m.batch["attention_mask"].sum(-1) for m in micro]), lengths[order])
    micro, order = micro_batch_plan(data, 4, False, None, group_prompts=True)
    prompt_of = torch.tensor(PROMPT_OF)[order]
    assert prompt_of.tolist() == [0, 0, 0, 1, 2, 2, 3, 4]  # same prompts next to each other, first-seen order
    with pytest.raises(ValueError, match="positive max token length.*got 0"):
        micro_batch_plan(data, None, True, 0)
    with pytest.raises(ValueError, match="micro batch size must be a positive int, got 0"):
        micro_batch_plan(data, 0, False, None)


def run_fsdp_rank(rank: int, world_size: int, port: int, out_dir: str, layout: dict) -> None:
    """One rank of a 2-rank FSDP2 update (gloo) on its half of the rows with the given layout."""
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    if dist.is_initialized():  # forked from a pytest process that ran an in-process (world size 1) worker
        dist.destroy_process_group()
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        from verl.workers.engine import head_stats

        layout = dict(layout)
        head_stats.HEAD_CHUNK_ELEMENTS = layout.pop("head_chunk_elements", head_stats.HEAD_CHUNK_ELEMENTS)
        model = make_model(seed=1)
        data = ppo_batch(model)  # built from the unsharded model: the same on both ranks
        shard_on_cpu(model, reshard_after_forward=layout.pop("reshard_root", None))  # None: FSDP2's root default
        config = actor_config(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, **layout)
        actor = DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=1.0))
        actor.update_policy(data[list(range(4 * rank, 4 * rank + 4))])
        full = {name: p.full_tensor() for name, p in model.named_parameters()}
        if rank == 0:
            torch.save(full, os.path.join(out_dir, "params.pt"))
        dist.barrier()  # gloo aborts if a rank tears down while its peer is still connected
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "layout",
    [
        {"use_remove_padding": True},
        {"share_prompt_prefix": True},
        # a budget of 10 tokens gives rank 0 four micro-batches and rank 1 three: both must run four
        {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 10, "share_prompt_prefix": True},
        # the LM head in chunks of 3 rows, checkpointed, on a root resharded after forward (as the workers shard)
        {"use_remove_padding": True, "head_chunk_elements": 3 * VOCAB, "reshard_root": True},
        {"share_prompt_prefix": True, "head_chunk_elements": 3 * VOCAB, "reshard_root": True},
    ],
    ids=["packed", "shared_prompt", "dynamic_bsz_uneven", "packed_head_chunks", "shared_head_chunks"],
)
def test_two_rank_fsdp2_update_equals_one_process(layout, tmp_path):
    """Under FSDP2 every rank must run as many forwards: the shared-prompt layout always makes two model calls,
    and dynamic batch size gives every rank the largest micro-batch count. Gradients match one process."""
    run_ranks(run_fsdp_rank, 2, free_port(), str(tmp_path), layout)
    dp_params = torch.load(tmp_path / "params.pt")
    reference, _ = updated_params()  # one process, all 8 rows, padded
    assert max((dp_params[k] - reference[k]).abs().max().item() for k in reference) < 1e-5


# ---------------------------------------------------------------------------------------------- LM head in chunks
def full_logits_stats(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Independent reference from the full logits: log-prob of the label, entropy, sum pi^2."""
    log_softmax = torch.log_softmax(logits.float(), dim=-1)
    probs = log_softmax.exp()
    log_prob = log_softmax.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return log_prob, -(probs * log_softmax).sum(-1), (probs**2).sum(-1)


def test_head_token_stats_equal_the_full_logits_one_chunk_alive_at_a_time():
    from verl.workers.engine.head_stats import HeadSpec, head_token_stats

    torch.manual_seed(0)
    head = torch.nn.Linear(16, VOCAB, bias=False)
    hidden = torch.randn(10, 16, requires_grad=True)
    labels = torch.randint(0, VOCAB, (10,))
    weights = torch.randn(2, 10)
    log_prob, entropy, sum_sq = full_logits_stats(head(hidden) / 0.7, labels)
    (weights[0] * log_prob + weights[1] * entropy).sum().backward()
    expected_grads = [hidden.grad.clone(), head.weight.grad.clone()]
    hidden.grad = head.weight.grad = None

    rows_seen = []
    head.register_forward_hook(lambda module, args, out: rows_seen.append(args[0].shape[0]))
    spec = HeadSpec(temperature=0.7, entropy=True, sum_pi_squared=True)
    stats = head_token_stats(hidden, head, labels, spec, chunk_rows=3)
    assert rows_seen == [3, 3, 3, 1]  # forward: chunk by chunk, no full logits
    for column, expected in enumerate([log_prob, entropy, sum_sq]):
        torch.testing.assert_close(stats[:, column], expected.detach(), atol=1e-5, rtol=0)
    (weights[0] * stats[:, 0] + weights[1] * stats[:, 1]).sum().backward()
    assert sorted(rows_seen[4:]) == [1, 3, 3, 3]  # backward recomputes each chunk once (checkpointed)
    torch.testing.assert_close([hidden.grad, head.weight.grad], expected_grads, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # no autograd: no checkpoint, no recompute
        head_token_stats(hidden, head, labels, HeadSpec(), chunk_rows=4)
    assert rows_seen[8:] == [4, 4, 2]


@pytest.mark.parametrize("entropy_grad", [True, False], ids=["entropy_grad", "entropy_no_grad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_linear_head_stats_equal_the_full_logits_with_its_own_backward(dtype, entropy_grad, monkeypatch):
    """A plain nn.Linear head (bias, temperature 0.7) takes `_LinearHeadStats`: statistics and gradients equal the
    full logits' (float64: to 1e-10), chunk by chunk, each chunk's logits made once in forward and once in backward,
    and the checkpointed path (a head with a hook) gives the same numbers."""
    from verl.workers.engine import head_stats
    from verl.workers.engine.head_stats import HeadSpec, head_token_stats

    torch.manual_seed(0)
    head = torch.nn.Linear(16, VOCAB, dtype=dtype)
    hidden = (3 * torch.randn(10, 16, dtype=dtype)).requires_grad_()  # spread-out logits: a peaked softmax
    labels = torch.randint(0, VOCAB, (10,))
    weights = torch.randn(2, 10, dtype=dtype)
    log_softmax = torch.log_softmax(head(hidden) / 0.7, dim=-1)  # the reference, in the head's dtype
    log_prob = log_softmax.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy, sum_sq = -(log_softmax.exp() * log_softmax).sum(-1), (log_softmax.exp() ** 2).sum(-1)
    loss_weights = (weights[0], weights[1] if entropy_grad else torch.zeros_like(weights[1]))
    (loss_weights[0] * log_prob + loss_weights[1] * entropy).sum().backward()
    expected = [hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()]
    hidden.grad = head.weight.grad = head.bias.grad = None

    rows_seen = []
    linear_logits = head_stats._linear_logits
    monkeypatch.setattr(
        head_stats, "_linear_logits", lambda h, *a: rows_seen.append(h.shape[0]) or linear_logits(h, *a)
    )
    spec = HeadSpec(temperature=0.7, entropy=True, entropy_grad=entropy_grad, sum_pi_squared=True)
    stats = head_token_stats(hidden, head, labels, spec, chunk_rows=3)
    assert rows_seen == [3, 3, 3, 1]
    tolerance = {"atol": 1e-10 if dtype == torch.float64 else 2e-5, "rtol": 0}
    for column, value in enumerate([log_prob, entropy, sum_sq]):
        torch.testing.assert_close(stats[:, column], value.detach(), **tolerance)
    (weights[0] * stats[:, 0] + weights[1] * stats[:, 1]).sum().backward()  # entropy's weight counts only with grad
    assert sorted(rows_seen[4:]) == [1, 3, 3, 3]
    torch.testing.assert_close([hidden.grad, head.weight.grad, head.bias.grad], expected, **tolerance)

    hooked_grads = [hidden.grad.clone(), head.weight.grad.clone()]
    hidden.grad = head.weight.grad = head.bias.grad = None
    head.register_forward_hook(lambda *args: None)  # any other head module: the checkpointed general path
    checkpointed = head_token_stats(hidden, head, labels, spec, chunk_rows=3)
    assert len(rows_seen) == 8  # not through _LinearHeadStats
    torch.testing.assert_close(checkpointed, stats, atol=1e-5 if dtype == torch.float32 else 1e-10, rtol=0)
    (weights[0] * checkpointed[:, 0] + weights[1] * checkpointed[:, 1]).sum().backward()
    torch.testing.assert_close([hidden.grad, head.weight.grad], hooked_grads, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=["padded", "packed", "shared_prompt"])
def test_actor_forward_in_vocab_chunks_equals_the_full_logits(layout, lora, monkeypatch):
    """Log-probs, entropy (with gradient), sum pi^2 and gradients of the actor's chunked LM head (3 rows per chunk)
    against the unchunked log_softmax of one full padded forward, in every layout, also through peft LoRA."""
    from verl.workers.engine import head_stats
    from verl.workers.lora import apply_lora

    monkeypatch.setattr(head_stats, "HEAD_CHUNK_ELEMENTS", 3 * VOCAB)
    model = make_model(seed=4)
    if lora:
        model = apply_lora(model, OmegaConf.create({"lora_rank": 4, "lora_alpha": 8, "target_modules": "all-linear"}))
        for name, param in model.named_parameters():  # non-zero B, so the adapters change the output
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.1)
    batch = make_batch().batch
    mask = batch["response_mask"].float()
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
    ).logits[:, PROMPT_LEN - 1 : -1]
    log_prob, entropy, sum_sq = full_logits_stats(logits / 0.8, batch["responses"])
    ((log_prob + 0.3 * entropy) * mask).sum().backward()
    expected_grads = grads(model)
    model.zero_grad()

    actor = DataParallelPPOActor(actor_config(**layout), model)
    got = actor._forward_micro_batch(batch, 0.8, calculate_entropy=True, calculate_sum_pi_squared=True)
    for value, expected in zip(got, [log_prob, entropy, sum_sq]):
        torch.testing.assert_close(value * mask, expected.detach() * mask, atol=1e-5, rtol=0)
    assert not got[2].requires_grad
    ((got[0] + 0.3 * got[1]) * mask).sum().backward()
    torch.testing.assert_close(grads(model), expected_grads, atol=1e-5, rtol=1e-5)
    assert model.get_output_embeddings() is not None and "_HeadCall" not in str(type(model.get_output_embeddings()))


def test_flash_varlen_applies_only_to_cuda_half_precision_without_dropout():
    from verl.workers.engine.model_forward import _flash_varlen_applies

    query = torch.zeros(1, 4, 5, 8)
    assert not _flash_varlen_applies(query, 0.0)  # CPU: the per-sequence loop
    assert not _flash_varlen_applies(query.bfloat16(), 0.0)
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8:
        assert _flash_varlen_applies(query.cuda().bfloat16(), 0.0)
        assert not _flash_varlen_applies(query.cuda().bfloat16(), 0.1)  # dropout: the loop
        assert not _flash_varlen_applies(query.cuda(), 0.0)  # float32: the loop


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_layout_on_cuda_runs_one_varlen_flash_call_per_layer_and_equals_a_full_forward(dtype, monkeypatch):
    from verl.workers.engine import model_forward

    calls = []
    flash_varlen = model_forward._flash_varlen
    monkeypatch.setattr(model_forward, "_flash_varlen", lambda *a: calls.append(1) or flash_varlen(*a))
    batch = make_batch().batch.to("cuda")
    mask = batch["response_mask"].double()
    reference_model = make_model().to("cuda", torch.float64)
    reference = full_forward_log_probs(reference_model, batch)
    (reference * mask).sum().backward()
    reference_grads = grads(reference_model)

    model = make_model().to("cuda", dtype)
    logits, where = response_outputs(model, batch, RESPONSE_LEN, is_lm=True, use_remove_padding=True)
    assert len(calls) == qwen2_config().num_hidden_layers
    log_probs = torch.log_softmax(logits.double(), dim=-1).gather(-1, batch["responses"][where].unsqueeze(-1))
    log_probs = scatter_to_responses(log_probs.squeeze(-1), where)
    # bf16 rounding moves these log-probs by ~1e-3; attention that is not causal moves them by 0.09
    torch.testing.assert_close(log_probs * mask, reference.detach() * mask, atol=0.01, rtol=0)
    (log_probs * mask).sum().backward()
    error = (grads(model).double() - reference_grads).norm() / reference_grads.norm()
    assert error < 0.05, f"relative gradient error {error:.3g}"
