"""Groups stay intact where advantages are computed and are spread across micro-batches after `actor.shuffle`.

The trainer repeats each prompt `rollout.n` times next to each other and computes GRPO advantages per `uid`
group on the driver (core_algos.compute_advantage); the actor then shuffles the assembled batch before cutting it
into mini- and micro-batches (dp_actor.update_policy, micro-batches cut by its training engine). Checked here on a tiny random Qwen2: every row keeps the
advantage of its own group, each micro-batch mixes groups, and the order is new every step but the same when a
step is replayed (a resumed run).
"""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transformers import Qwen2Config, Qwen2ForCausalLM

import verl.workers.actor.dp_actor as dp_actor
import verl.workers.engine.fsdp.transformer_impl as engine_impl
from verl.protocol import DataProto
from verl.trainer.ppo import core_algos

GROUPS, N, PROMPT_LEN, RESPONSE_LEN, VOCAB = 4, 4, 4, 3, 48
REAL_PLAN = engine_impl.micro_batch_plan
SCORES = [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0], [0.0, 0.5, 1.0, 0.5], [2.0, 0.0, 1.0, 1.0]]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=32, vocab_size=VOCAB, max_position_embeddings=32,
    )  # fmt: skip
    return Qwen2ForCausalLM(config)


def grouped_batch() -> DataProto:
    """GROUPS prompts x N samples laid out as the trainer does (prompt g's samples in rows g*N .. g*N+N-1),
    distinct random tokens per row, the score at the last response token."""
    bs = GROUPS * N
    gen = torch.Generator().manual_seed(3)
    input_ids = torch.randint(1, VOCAB, (bs, PROMPT_LEN + RESPONSE_LEN), generator=gen)
    scores = torch.zeros(bs, RESPONSE_LEN)
    scores[:, -1] = torch.tensor(SCORES).flatten()
    uids = np.array([f"prompt-{g}" for g in range(GROUPS) for _ in range(N)], dtype=object)
    return DataProto.from_dict(
        tensors={
            "input_ids": input_ids,
            "responses": input_ids[:, PROMPT_LEN:],
            "attention_mask": torch.ones_like(input_ids),
            "position_ids": torch.arange(PROMPT_LEN + RESPONSE_LEN).expand(bs, -1).clone(),
            "response_mask": torch.ones(bs, RESPONSE_LEN, dtype=torch.long),
            "token_level_rewards": scores,
        },
        non_tensors={"uid": uids},
        meta_info={"temperature": 1.0},
    )


def test_advantages_are_computed_per_intact_group():
    batch = core_algos.compute_advantage(grouped_batch(), adv_estimator="grpo", num_repeat=N)
    uids = batch.non_tensor_batch["uid"]
    for g, group_scores in enumerate(SCORES):
        rows = list(range(g * N, (g + 1) * N))
        assert set(uids[rows]) == {f"prompt-{g}"}  # the group is contiguous when its advantages are computed
        mean = sum(group_scores) / N
        std = (sum((s - mean) ** 2 for s in group_scores) / (N - 1)) ** 0.5  # unbiased, as torch.std
        for row, score in zip(rows, group_scores):
            expected = (score - mean) / (std + 1e-6)
            assert batch.batch["advantages"][row].tolist() == pytest.approx([expected] * RESPONSE_LEN, abs=1e-5)


def run_update(batch: DataProto, shuffle: bool, global_steps: int, monkeypatch) -> list[DataProto]:
    """One update_policy (one mini-batch of the whole batch, micro-batches of N rows); returns the micro-batches."""
    seen: list[DataProto] = []

    def recording_plan(data, *args, **kwargs):
        micro_batches, order = REAL_PLAN(data, *args, **kwargs)
        seen.extend(micro_batches)
        return micro_batches, order

    monkeypatch.setattr(engine_impl, "micro_batch_plan", recording_plan)
    config = OmegaConf.create(
        {
            "ppo_mini_batch_size": GROUPS * N,
            "ppo_micro_batch_size_per_gpu": N,
            "ppo_epochs": 1,
            "shuffle": shuffle,
            "data_loader_seed": 1,
            "grad_clip": 1.0,
            "policy_loss": {"loss_mode": "vanilla"},
            "loss_agg_mode": "token-mean",
        }
    )
    model = tiny_model()
    data = DataProto(batch=batch.batch.clone(), non_tensor_batch=dict(batch.non_tensor_batch),
                     meta_info={**batch.meta_info, "global_steps": global_steps})  # fmt: skip
    dp_actor.DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=0.1)).update_policy(data)
    return seen


def row_of(batch: DataProto, input_ids: torch.Tensor) -> int:
    matches = (batch.batch["input_ids"] == input_ids).all(dim=-1).nonzero().flatten().tolist()
    assert len(matches) == 1
    return matches[0]


def test_shuffle_spreads_groups_over_micro_batches_and_rows_keep_their_advantage(monkeypatch):
    batch = core_algos.compute_advantage(grouped_batch(), adv_estimator="grpo", num_repeat=N)
    with torch.no_grad():  # old log-probs: any fixed values; the test is about which rows go where
        batch.batch["old_log_probs"] = -torch.rand(GROUPS * N, RESPONSE_LEN, generator=torch.Generator().manual_seed(1))

    unshuffled = run_update(batch, shuffle=False, global_steps=1, monkeypatch=monkeypatch)
    groups_of = lambda micro: {row_of(batch, ids) // N for ids in micro.batch["input_ids"]}  # noqa: E731
    assert [groups_of(m) for m in unshuffled] == [{0}, {1}, {2}, {3}]  # the control: one group per micro-batch

    step1 = run_update(batch, shuffle=True, global_steps=1, monkeypatch=monkeypatch)
    rows = [row_of(batch, ids) for micro in step1 for ids in micro.batch["input_ids"]]
    assert sorted(rows) == list(range(GROUPS * N))  # every sample exactly once
    assert len(step1) == GROUPS and all(len(m) == N for m in step1)
    assert sum(len(groups_of(m)) > 1 for m in step1) >= GROUPS - 1  # groups are spread
    for micro in step1:  # each row still carries the advantage and old log-prob of its own group member
        for ids, adv, old in zip(micro.batch["input_ids"], micro.batch["advantages"], micro.batch["old_log_probs"]):
            row = row_of(batch, ids)
            assert torch.equal(adv, batch.batch["advantages"][row])
            assert torch.equal(old, batch.batch["old_log_probs"][row])

    order = lambda micros: [row_of(batch, ids) for m in micros for ids in m.batch["input_ids"]]  # noqa: E731
    replay = run_update(batch, shuffle=True, global_steps=1, monkeypatch=monkeypatch)
    step2 = run_update(batch, shuffle=True, global_steps=2, monkeypatch=monkeypatch)
    assert order(replay) == order(step1)  # the same step replayed (a resume) shuffles the same way
    assert order(step2) != order(step1)  # the next step gets a new order
