"""AReaL-lite-style workflows (dict rows in, TensorDict rows out) on a tiny Qwen2 (async_engine.rollout_batch,
workflows/episode_rows.py).

- In a hand-written loop: `engine.rollout_batch(rows, workflow)` runs one episode per dict row, stacks the TensorDicts
  right-padded, stamps `set_version`'s version on generated tokens, drops rejected episodes;
- in the trainer: the same workflow class runs unchanged through `rollout_batch(rollout, DataProto, workflow)` (its
  row is an `EpisodeRow`) and its TensorDicts become training rows (prompt, response, loss mask, reward at the last
  completion token), checked against the episode's own tokens.
"""

import asyncio
import concurrent.futures

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from verl.protocol import DataProto
from verl.workers.engine import WeightUpdateMeta
from verl.workers.rollout.async_engine import AsyncRolloutEngine, GenerationHyperparameters, ModelRequest
from verl.workers.rollout.workflows import RolloutWorkflow, rollout_batch
from verl.workers.rollout.workflows.episode_rows import EpisodeRow

QUESTIONS = ["How many apples?", "Hi", "Convert 5 dollars to euro please"]


def chat(tokenizer, question):
    return [{"role": "user", "content": question}]


def prompt_ids(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


class ReMaxShaped(RolloutWorkflow):
    """Written as AReaL-lite's tutorial writes it: tokenizes `data["messages"]`, a sampled and a greedy request at
    once, reward difference on every token. The reward is the completion's length (spread on a random model)."""

    def __init__(self, tokenizer, gconfig, reject_prompt=None):
        self.tokenizer, self.gconfig, self.reject_prompt = tokenizer, gconfig, reject_prompt
        self.seen = []

    async def arun_episode(self, engine, data):
        self.seen.append(data)
        if data["messages"][0]["content"] == self.reject_prompt:
            return None
        input_ids = prompt_ids(self.tokenizer, data["messages"])
        resp, greedy = await asyncio.gather(
            engine.agenerate(ModelRequest(rid="r", input_ids=input_ids, gconfig=self.gconfig)),
            engine.agenerate(ModelRequest(rid="r", input_ids=input_ids, gconfig=self.gconfig.new(greedy=True))),
        )
        length = resp.input_len + resp.output_len
        reward = float(resp.output_len - greedy.output_len) + 0.5
        return TensorDict(
            {
                "input_ids": torch.tensor(resp.input_tokens + resp.output_tokens).unsqueeze(0),
                "loss_mask": torch.tensor([0] * resp.input_len + [1] * resp.output_len).unsqueeze(0),
                "versions": torch.tensor([-1] * resp.input_len + resp.output_versions).unsqueeze(0),
                "attention_mask": torch.ones(length, dtype=torch.bool).unsqueeze(0),
                "logprobs": torch.tensor([0.0] * resp.input_len + resp.output_logprobs).unsqueeze(0),
                "rewards": torch.full((1, length), reward),
            },
            batch_size=[1],
        )


def test_rollout_batch_on_dict_rows_pads_versions_and_drops_rejected(make_rollout, tokenizer):
    engine = AsyncRolloutEngine(make_rollout(response_length=8, calculate_log_probs=True), {"seed": 7})
    engine.set_version(3)
    workflow = ReMaxShaped(tokenizer, GenerationHyperparameters(max_new_tokens=8), reject_prompt="Hi")
    rows = [{"messages": chat(tokenizer, q), "answer": str(i)} for i, q in enumerate(QUESTIONS)]
    batch = engine.rollout_batch(rows, workflow=workflow)
    assert workflow.seen == rows and engine.get_version() == 3
    assert batch.batch_size == torch.Size([2])  # "Hi" rejected
    lengths = batch["attention_mask"].sum(-1).tolist()
    assert batch["input_ids"].shape[1] == max(lengths)
    for i, question in enumerate([QUESTIONS[0], QUESTIONS[2]]):
        n, prompt = lengths[i], prompt_ids(tokenizer, chat(tokenizer, question))
        assert batch["input_ids"][i, : len(prompt)].tolist() == prompt
        assert (batch["input_ids"][i, n:] == engine.pad_token_id).all()  # right padding with the pad id
        assert batch["loss_mask"][i, : len(prompt)].sum() == 0 and batch["loss_mask"][i, len(prompt) : n].all()
        generated = batch["loss_mask"][i].bool()
        assert set(batch["versions"][i][generated].tolist()) == {3}
    # the stacked rows: two generate calls (sampled, greedy) for all episodes at once
    assert engine.num_generate_calls == 2
    with pytest.raises(RuntimeError, match="all 1 episodes were rejected"):
        engine.rollout_batch(rows[:1], workflow=workflow, should_accept=lambda td: False)
    with pytest.raises(TypeError, match="list of dict rows"):
        engine.rollout_batch(DataProto(), workflow=workflow)


def test_colocated_update_future_is_done_and_checks_its_engine(make_rollout):
    engine = AsyncRolloutEngine(make_rollout(), {})
    future = engine.update_weights(WeightUpdateMeta.from_colocated(engine))
    assert isinstance(future, concurrent.futures.Future) and future.done() and future.result() is None
    other = AsyncRolloutEngine(make_rollout(), {})
    with pytest.raises(ValueError, match="names another inference engine"):
        engine.update_weights(WeightUpdateMeta.from_colocated(other))


def test_the_same_workflow_in_the_trainer_gives_training_rows(make_rollout, make_prompts, tokenizer):
    questions = QUESTIONS
    raw = np.empty(len(questions), dtype=object)
    raw[:] = [chat(tokenizer, q) for q in questions]
    prompts = make_prompts([tokenizer.decode(prompt_ids(tokenizer, m)) for m in raw], prompt_len=24,
                           non_tensors={"raw_prompt": raw})  # fmt: skip
    rollout = make_rollout(response_length=8, calculate_log_probs=True)
    workflow = ReMaxShaped(tokenizer, GenerationHyperparameters(max_new_tokens=8), reject_prompt="Hi")
    out = rollout_batch(rollout, prompts, workflow)
    assert out.batch["rollout_accepted"].tolist() == [True, False, True]
    assert {"prompts", "responses", "response_mask", "token_level_scores", "rollout_log_probs"} <= set(out.batch.keys())
    assert "versions" not in out.batch.keys()
    for i in (0, 2):
        prompt = prompt_ids(tokenizer, raw[i])
        row_prompt = out.batch["prompts"][i][out.batch["attention_mask"][i, :24].bool()].tolist()
        assert row_prompt == prompt  # the workflow's own prompt tokens, left-padded to the batch's width
        n = int(out.batch["response_mask"][i].sum())
        assert n >= 1 and out.batch["attention_mask"][i, 24 : 24 + n].all()
        scores = out.batch["token_level_scores"][i]
        assert scores.nonzero().flatten().tolist() == [n - 1]  # the reward sits on the last completion token
        assert float(scores[n - 1]) == pytest.approx(float(scores.sum()))
    assert out.batch["response_mask"][1].sum() == 0 and out.batch["token_level_scores"][1].abs().sum() == 0
    # what the workflow saw: an EpisodeRow that is a one-row DataProto and reads like a dict row
    row = workflow.seen[0]
    assert isinstance(row, EpisodeRow) and isinstance(row, DataProto) and len(row) == 1
    assert row["messages"] == raw[0] and row["uid"] == "u0" and "messages" in row and row.get("nope", 5) == 5
    assert {**row}.keys() == {"uid", "raw_prompt", "messages"}


def test_episode_row_without_the_raw_chat_says_how_to_keep_it(make_prompts):
    row = EpisodeRow.of(make_prompts(["Hi"])[0:1])
    with pytest.raises(KeyError, match="data.return_raw_chat=true"):
        row["messages"]
    assert isinstance(row[0:1], DataProto)
