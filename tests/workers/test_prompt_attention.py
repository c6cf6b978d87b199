"""The shared-prompt forward's two-part attention for long responses (verl/workers/engine/prompt_attention.py):
log-probs, values and gradients equal to a plain full forward, in several query blocks; when it applies."""

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForTokenClassification

from verl.workers.engine import prompt_attention
from verl.workers.engine.model_forward import VARLEN_SDPA, response_outputs, scatter_to_responses

VOCAB, PROMPT_LEN, RESPONSE_LEN = 64, 7, 11
PROMPT_LENS = [3, 7, 5]  # three prompts, left-padded to 7
RESPONSE_LENS = [11, 6, 11, 9, 1, 11]  # rows 2k, 2k + 1 sample prompt k; right-padded to 11


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Apply from 8 response tokens in blocks of 4: the 11 response positions make blocks 0-3, 4-7 and 8-10."""
    monkeypatch.setattr(prompt_attention, "MIN_RESPONSE_LENGTH", 8)
    monkeypatch.setattr(prompt_attention, "BLOCK", 4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def config() -> Qwen2Config:
    return Qwen2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=64, num_labels=1, attn_implementation="sdpa",
    )  # fmt: skip


def make_batch(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(RESPONSE_LENS), PROMPT_LEN + RESPONSE_LEN, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for k, n in enumerate(PROMPT_LENS):
        prompt = torch.randint(1, VOCAB, (n,), generator=gen)
        for row in (2 * k, 2 * k + 1):
            r = RESPONSE_LENS[row]
            ids[row, PROMPT_LEN - n : PROMPT_LEN] = prompt
            ids[row, PROMPT_LEN : PROMPT_LEN + r] = torch.randint(1, VOCAB, (r,), generator=gen)
            mask[row, PROMPT_LEN - n : PROMPT_LEN + r] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    position_ids[:, PROMPT_LEN:] = position_ids[:, PROMPT_LEN - 1 : PROMPT_LEN] + torch.arange(1, RESPONSE_LEN + 1)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids}


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def count_two_part_calls(monkeypatch) -> list:
    calls = []
    original = prompt_attention._TwoPartAttention.apply
    monkeypatch.setattr(prompt_attention._TwoPartAttention, "apply", lambda *a: calls.append(1) or original(*a))
    return calls


def test_log_probs_and_gradients_equal_a_full_forward(monkeypatch):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config())
    batch = make_batch()
    responses = batch["input_ids"][:, PROMPT_LEN:]
    mask = batch["attention_mask"][:, PROMPT_LEN:].float()

    logits = model(**batch).logits[:, PROMPT_LEN - 1 : -1]  # independent reference: one padded forward
    reference = torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    (reference * mask).sum().backward()
    reference_grads = grads(model)
    model.zero_grad()

    calls = count_two_part_calls(monkeypatch)
    out, where = response_outputs(model, batch, RESPONSE_LEN, is_lm=True, share_prompt_prefix=True)
    assert len(calls) == config().num_hidden_layers  # every layer's response call ran the two-part attention
    # switched back after the call (to the actor's sdpa, which keeps CPU's grouped attention for the padded calls)
    assert model.config._attn_implementation == VARLEN_SDPA
    log_probs = torch.log_softmax(out, -1).gather(-1, responses[where].unsqueeze(-1)).squeeze(-1)
    log_probs = scatter_to_responses(log_probs, where)
    torch.testing.assert_close(log_probs * mask, reference.detach() * mask, atol=2e-6, rtol=0)
    (log_probs * mask).sum().backward()
    torch.testing.assert_close(grads(model), reference_grads, atol=2e-5, rtol=1e-5)


def test_critic_values_and_gradients_equal_a_full_forward(monkeypatch):
    torch.manual_seed(1)
    model = Qwen2ForTokenClassification(config()).eval()  # no dropout in the value head
    batch = make_batch(seed=1)
    mask = batch["attention_mask"][:, PROMPT_LEN:].float()
    reference = model(**batch).logits[:, PROMPT_LEN - 1 : -1, 0]
    (reference * mask).sum().backward()
    reference_grads = grads(model)
    model.zero_grad()

    calls = count_two_part_calls(monkeypatch)
    out, where = response_outputs(model, batch, RESPONSE_LEN, is_lm=False, share_prompt_prefix=True)
    values = scatter_to_responses(out[:, 0], where)
    assert calls
    torch.testing.assert_close(values * mask, reference.detach() * mask, atol=2e-6, rtol=0)
    (values * mask).sum().backward()
    torch.testing.assert_close(grads(model), reference_grads, atol=2e-5, rtol=1e-5)


def test_attention_equals_sdpa_over_the_concatenated_cache():
    """The attention function alone, three prompts x 4 rows, 4 heads over 2 KV heads, padded prompts: output and
    the gradients of query, prompt keys/values and response keys/values against sdpa over [prompt | response]."""
    torch.manual_seed(2)
    groups, n, heads, kv_heads, dim, prompt, length = 3, 4, 4, 2, 16, 9, 10
    pad = torch.zeros(groups, prompt, dtype=torch.bool)
    pad[0, :4], pad[2, :1] = True, True
    query = torch.randn(groups * n, heads, length, dim, requires_grad=True)
    prompt_k, prompt_v = (torch.randn(groups, kv_heads, prompt, dim, requires_grad=True) for _ in range(2))
    keys, values = (torch.randn(groups * n, kv_heads, length, dim, requires_grad=True) for _ in range(2))
    cache = prompt_attention.PromptCache(num_layers=1)
    cache.update(prompt_k, prompt_v, 0)
    cache.start_responses(n, ~pad)
    module = torch.nn.Module()
    module.layer_idx = 0
    out, _ = prompt_attention._prompt_blocks_attention(module, query, keys, values, None, 0.3, prompt_attention=cache)

    full_k = torch.cat([prompt_k.repeat_interleave(n, 0), keys], dim=2)
    full_v = torch.cat([prompt_v.repeat_interleave(n, 0), values], dim=2)
    allowed = torch.ones(groups * n, 1, length, prompt + length, dtype=torch.bool)
    allowed[..., :prompt] = ~pad.repeat_interleave(n, 0)[:, None, None, :]
    allowed[..., prompt:] = torch.ones(length, length, dtype=torch.bool).tril()
    reference = F.scaled_dot_product_attention(query, full_k, full_v, attn_mask=allowed, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, reference.transpose(1, 2), atol=2e-6, rtol=0)
    upstream = torch.randn_like(out)
    inputs = (query, prompt_k, prompt_v, keys, values)
    ours = torch.autograd.grad(out, inputs, upstream)
    theirs = torch.autograd.grad(reference.transpose(1, 2), inputs, upstream)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_applies_only_to_long_right_padded_responses_of_plain_sdpa_models_on_cpu():
    model = Qwen2ForCausalLM(config())
    right_padded = torch.tensor([[1] * 9 + [0] * 2, [1] * 11])
    assert prompt_attention.applies(model, 11, right_padded)
    assert not prompt_attention.applies(model, 7, right_padded[:, :7])  # shorter than MIN_RESPONSE_LENGTH
    holed = right_padded.clone()
    holed[1, 4] = 0  # a masked token inside a response: its key must stay masked for the later ones
    assert not prompt_attention.applies(model, 11, holed)
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()  # 5.17's name
    assert not prompt_attention.applies(model, 11, right_padded)
    eager = Qwen2ForCausalLM(Qwen2Config(**{**config().to_dict(), "attn_implementation": "eager"}))
    assert not prompt_attention.applies(eager, 11, right_padded)


def test_rows_out_of_group_order_keep_the_copied_prompt_cache(monkeypatch):
    torch.manual_seed(3)
    model = Qwen2ForCausalLM(config())
    batch = {k: v[[0, 2, 1, 3, 4, 5]] for k, v in make_batch().items()}  # prompts 0, 1, 0, 1, 2, 2
    calls = count_two_part_calls(monkeypatch)
    out, where = response_outputs(model, batch, RESPONSE_LEN, is_lm=True, share_prompt_prefix=True)
    assert not calls
    reference = model(**batch).logits[:, PROMPT_LEN - 1 : -1][where]
    torch.testing.assert_close(out, reference.detach(), atol=2e-5, rtol=0)


@pytest.mark.parametrize("micro_batch", [6, 2], ids=["one_micro_batch", "a_prompt_per_micro_batch"])
def test_actor_update_equals_the_padded_update(micro_batch, monkeypatch):
    """The PPO actor's update (KL loss to the reference, the log-probs of the two-part attention under autograd)
    gives the parameters the padded forward's update gives."""
    from tests.workers.test_model_forward import actor_config
    from verl.protocol import DataProto
    from verl.workers.actor import DataParallelPPOActor

    def update(**overrides):
        torch.manual_seed(4)
        model = Qwen2ForCausalLM(config())
        batch = make_batch(seed=4)
        response_mask = batch["attention_mask"][:, PROMPT_LEN:]
        gen = torch.Generator().manual_seed(6)
        data = DataProto.from_dict(
            tensors={
                **batch,
                "responses": batch["input_ids"][:, PROMPT_LEN:],
                "response_mask": response_mask,
                "old_log_probs": -3 + 0.1 * torch.randn(response_mask.shape, generator=gen),
                "ref_log_prob": -3 + 0.1 * torch.randn(response_mask.shape, generator=gen),
                "advantages": torch.randn(len(response_mask), 1, generator=gen) * response_mask,
            },
            meta_info={"temperature": 1.0},
        )
        settings = {"ppo_mini_batch_size": 6, "ppo_micro_batch_size_per_gpu": micro_batch, **overrides}
        actor = DataParallelPPOActor(actor_config(**settings), model, torch.optim.SGD(model.parameters(), lr=1.0))
        metrics = actor.update_policy(data)
        return {n: p.detach().clone() for n, p in model.named_parameters()}, metrics

    reference, reference_metrics = update()
    calls = count_two_part_calls(monkeypatch)
    params, metrics = update(share_prompt_prefix=True)
    assert len(calls) == 2 * (6 // micro_batch)  # both layers of every micro-batch
    assert max((params[k] - reference[k]).abs().max().item() for k in params) < 1e-5
    assert metrics["actor/pg_loss"] == pytest.approx(reference_metrics["actor/pg_loss"], abs=1e-5)
    assert metrics["actor/kl_loss"] == pytest.approx(reference_metrics["actor/kl_loss"], abs=1e-6)
