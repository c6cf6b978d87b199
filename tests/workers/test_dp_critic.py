"""Tests of verl/workers/critic/dp_critic.py on a tiny random Qwen2 value model, against hand-written references."""

import copy

import pytest
import torch
from omegaconf import OmegaConf
from transformers import Qwen2Config, Qwen2ForTokenClassification

from verl.protocol import DataProto
from verl.workers.critic import DataParallelPPOCritic

PROMPT_LEN, RESPONSE_LEN, VOCAB = 5, 4, 64


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and the machine is shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


PROMPT_LENS = [2, 5, 3, 4, 5, 2, 4, 3]
RESPONSE_LENS = [4, 1, 3, 2, 4, 4, 1, 2]


def make_critic_model(seed: int = 0) -> Qwen2ForTokenClassification:
    torch.manual_seed(seed)
    config = Qwen2Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        num_labels=1,
        classifier_dropout=0.0,  # as verl's critic worker sets: train and eval forwards must agree
    )
    return Qwen2ForTokenClassification(config)


def make_batch(seed: int = 0) -> DataProto:
    """Left-padded prompts and right-padded responses (pad id 0) with their masks and position ids."""
    bs = len(PROMPT_LENS)
    gen = torch.Generator().manual_seed(seed)
    prompt_mask = torch.arange(PROMPT_LEN).expand(bs, -1) >= (PROMPT_LEN - torch.tensor(PROMPT_LENS)).unsqueeze(1)
    response_mask = torch.arange(RESPONSE_LEN).expand(bs, -1) < torch.tensor(RESPONSE_LENS).unsqueeze(1)
    prompts = torch.randint(1, VOCAB, (bs, PROMPT_LEN), generator=gen) * prompt_mask
    responses = torch.randint(1, VOCAB, (bs, RESPONSE_LEN), generator=gen) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    return DataProto.from_dict(
        tensors={
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
            "response_mask": response_mask.long(),
        }
    )


def critic_config(**overrides):
    base = {
        "ppo_mini_batch_size": 8,
        "ppo_micro_batch_size_per_gpu": 8,
        "forward_micro_batch_size_per_gpu": 3,
        "ppo_epochs": 1,
        "shuffle": False,
        "grad_clip": 1.0e9,
        "cliprange_value": 0.5,
        "loss_agg_mode": "token-mean",
    }
    base.update(overrides)
    return OmegaConf.create(base)


def hand_values(model, batch) -> torch.Tensor:
    """(bs, response_len): the value of response token t is the model output at row PROMPT_LEN - 1 + t, masked."""
    out = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
    ).logits[..., 0]
    values = torch.stack([out[:, PROMPT_LEN - 1 + t] for t in range(RESPONSE_LEN)], dim=1)
    return values * batch["response_mask"]


def params(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_compute_values_matches_hand_slicing():
    model = make_critic_model()
    data = make_batch()
    critic = DataParallelPPOCritic(critic_config(), model, torch.optim.SGD(model.parameters(), lr=0.1))

    values = critic.compute_values(data)  # micro-batches of 3, 3, 2 from forward_micro_batch_size_per_gpu

    with torch.no_grad():
        expected = hand_values(model, data.batch)
    assert values.shape == (8, RESPONSE_LEN)
    torch.testing.assert_close(values, expected, atol=1e-5, rtol=1e-5)
    assert (values[data.batch["response_mask"] == 0] == 0).all()
    assert values.abs().sum() > 0


@pytest.mark.parametrize("micro", [8, 2])
def test_update_equals_hand_sgd_step_on_the_unclipped_value_loss(micro):
    base = make_critic_model()
    data = make_batch()
    mask = data.batch["response_mask"].float()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        data.batch["values"] = hand_values(base, data.batch)
    data.batch["returns"] = torch.randn(8, RESPONSE_LEN, generator=gen) * mask

    reference = copy.deepcopy(base)
    hand_loss = 0.5 * ((hand_values(reference, data.batch) - data.batch["returns"]) ** 2 * mask).sum() / mask.sum()
    hand_loss.backward()
    lr = 0.5
    model = copy.deepcopy(base)
    critic = DataParallelPPOCritic(
        critic_config(ppo_micro_batch_size_per_gpu=micro), model, torch.optim.SGD(model.parameters(), lr=lr)
    )

    metrics = critic.update_critic(data)

    after = params(model)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(after[name], p.detach() - lr * p.grad, atol=1e-6, rtol=1e-5)
    assert metrics["critic/vf_loss"] == [pytest.approx(hand_loss.item(), rel=1e-5)]
    assert metrics["critic/vf_clipfrac"] == [0.0] * (8 // micro)
    grad_norm = torch.sqrt(sum((p.grad**2).sum() for p in reference.parameters())).item()
    assert metrics["critic/grad_norm"] == [pytest.approx(grad_norm, rel=1e-4)]
    assert metrics["critic/nonfinite_steps"] == 0.0


def test_update_reduces_the_value_loss_on_a_fixed_target():
    model = make_critic_model()
    data = make_batch()
    mask = data.batch["response_mask"].float()
    data.batch["returns"] = torch.randn(8, RESPONSE_LEN, generator=torch.Generator().manual_seed(4)) * mask
    critic = DataParallelPPOCritic(
        critic_config(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, cliprange_value=100.0),
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
    )

    def value_loss() -> float:
        values = critic.compute_values(data)
        return (0.5 * ((values - data.batch["returns"]) ** 2 * mask).sum() / mask.sum()).item()

    start = value_loss()
    for _ in range(6):
        data.batch["values"] = critic.compute_values(data)
        critic.update_critic(data)
    assert value_loss() < 0.5 * start


def test_clipped_value_loss_takes_the_clipped_term_and_gives_no_gradient():
    base = make_critic_model()
    data = make_batch()
    mask = data.batch["response_mask"].float()
    with torch.no_grad():
        vpreds = hand_values(base, data.batch)
    # old values 10 below the prediction, target 1 above it: the prediction is clipped to values + 0.5,
    # whose error (10.5^2) beats the unclipped one (1^2), and clipping cuts the gradient
    data.batch["values"] = vpreds - 10.0
    data.batch["returns"] = vpreds + 1.0
    model = copy.deepcopy(base)
    critic = DataParallelPPOCritic(critic_config(), model, torch.optim.SGD(model.parameters(), lr=1.0))

    metrics = critic.update_critic(data)

    assert metrics["critic/vf_clipfrac"] == [pytest.approx(1.0)]
    assert metrics["critic/vf_loss"] == [pytest.approx(0.5 * 10.5**2, rel=1e-4)]
    assert metrics["critic/vpred_mean"] == [pytest.approx(((vpreds * mask).sum() / mask.sum()).item(), abs=1e-4)]
    assert metrics["critic/grad_norm"] == [0.0]
    assert all(torch.equal(p, q) for p, q in zip(params(model).values(), params(base).values()))


def test_nonfinite_returns_skip_the_step_and_bad_config_is_rejected():
    base = make_critic_model()
    data = make_batch()
    data.batch["values"] = torch.zeros(8, RESPONSE_LEN)
    data.batch["returns"] = torch.zeros(8, RESPONSE_LEN)
    data.batch["returns"][0, 0] = float("nan")
    model = copy.deepcopy(base)
    critic = DataParallelPPOCritic(critic_config(), model, torch.optim.SGD(model.parameters(), lr=1.0))
    metrics = critic.update_critic(data)
    assert metrics["critic/nonfinite_steps"] == 1.0
    assert all(torch.equal(p, q) for p, q in zip(params(model).values(), params(base).values()))
    with pytest.raises(ValueError, match="loss_agg_mode"):
        DataParallelPPOCritic(critic_config(loss_agg_mode="avg"), model, None)
    with pytest.raises(KeyError, match="returns"):
        critic.update_critic(make_batch())
