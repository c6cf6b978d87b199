"""Tests of `AgentLoopWorker` (verl/experimental/agent_loop/agent_loop_worker.py) with the tiny model's tokenizer and
an echo server manager (it answers a prompt with fixed tokens and records the sampling parameters it got).

Checked against hand-built tensors: the padding of one episode (prompt on the left, response on the right, the
response mask zero on padding, position ids, log-probs, routed experts placed at the prompt's first token), the
batch `_postprocess` makes (stable extra-field columns, None where a loop did not set a field, `rm_scores` at the
last response token only when every episode has a score), `generate_sequences` end to end (default loop, verl's
sampling parameters, validation, REMAX's `__do_sample__`), `build_agent_loop` through hydra, the trace log line,
and what the constructor refuses.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from verl.experimental.agent_loop import agent_loop as agent_loop_module
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    build_agent_loop,
    rollout_trace_attr,
)
from verl.experimental.agent_loop.agent_loop_worker import STABLE_EXTRA_FIELDS, AgentLoopWorker, object_column
from verl.protocol import DataProto
from verl.workers.rollout.replica import TokenOutput

ANSWER = [7, 8, 9]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


class EchoServer:
    """Answers every prompt with ANSWER (log-prob -0.25 each when asked); records the sampling parameters."""

    def __init__(self):
        self.params = []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs) -> TokenOutput:
        self.params.append(dict(sampling_params))
        log_probs = [-0.25] * len(ANSWER) if sampling_params.get("logprobs") else None
        return TokenOutput(token_ids=list(ANSWER), log_probs=log_probs, extra_fields={"max_global_steps": 3})


def trainer_config(prompt_length=32, response_length=6, **agent):
    rollout = {"prompt_length": prompt_length, "response_length": response_length, "temperature": 0.7, "top_p": 0.9,
               "top_k": 5, "calculate_log_probs": True, "val_kwargs": {"temperature": 0.0, "top_p": 1.0, "top_k": -1},
               "multi_turn": {"format": "hermes"}, "agent": agent}  # fmt: skip
    return OmegaConf.create({"actor_rollout_ref": {"rollout": rollout}, "data": {}})


def make_worker(tok, server=None, **kwargs) -> AgentLoopWorker:
    return AgentLoopWorker(trainer_config(**kwargs), server or EchoServer(), tokenizer=tok)


def episode(**fields) -> AgentLoopOutput:
    values = dict(prompt_ids=[11, 12, 13], response_ids=[21, 22], response_mask=[1, 0], metrics=AgentLoopMetrics())
    return AgentLoopOutput(**{**values, **fields})


def postprocess(worker, output, **kwargs):
    return asyncio.run(worker._agent_loop_postprocess(output, False, raw_prompt=[{"role": "user", "content": "q"}],
                                                      **kwargs))  # fmt: skip


# ----------------------------------------------------------------------------------------------- one episode
def test_pad_token_ids_pads_either_side_and_keeps_the_tokenizers_side(tok):
    worker, pad = make_worker(tok), tok.pad_token_id
    side = tok.padding_side
    left = worker._pad_token_ids([5, 6], max_length=4, padding_side="left", return_attention_mask=True)
    assert left["input_ids"].tolist() == [[pad, pad, 5, 6]] and left["attention_mask"].tolist() == [[0, 0, 1, 1]]
    right = worker._pad_token_ids([5, 6], max_length=4, padding_side="right", return_attention_mask=False)
    assert right["input_ids"].tolist() == [[5, 6, pad, pad]] and set(right) == {"input_ids"}
    empty = worker._pad_token_ids([], max_length=3, padding_side="right", return_attention_mask=True)
    assert empty["input_ids"].tolist() == [[pad] * 3] and empty["attention_mask"].tolist() == [[0, 0, 0]]
    assert tok.padding_side == side
    with pytest.raises(ValueError, match="returned 5 token ids where at most 4 fit"):
        worker._pad_token_ids([1] * 5, max_length=4, padding_side="left", return_attention_mask=True)


def test_one_episode_is_padded_with_its_masks_positions_and_log_probs(tok):
    worker, pad = make_worker(tok, prompt_length=5, response_length=4), tok.pad_token_id
    out = postprocess(worker, episode(response_logprobs=[-1.0, 0.0], num_turns=3, extra_fields={"turn_scores": [1]}))
    assert out.prompt_ids.tolist() == [[pad, pad, 11, 12, 13]]
    assert out.response_ids.tolist() == [[21, 22, pad, pad]]
    assert out.input_ids.tolist() == [[pad, pad, 11, 12, 13, 21, 22, pad, pad]]
    assert out.attention_mask.tolist() == [[0, 0, 1, 1, 1, 1, 1, 0, 0]]
    assert out.position_ids.tolist() == [[0, 0, 0, 1, 2, 3, 4, 4, 4]]
    assert out.response_mask.tolist() == [[1, 0, 0, 0]]
    assert out.response_logprobs.tolist() == [[-1.0, 0.0, 0.0, 0.0]]
    assert out.routed_experts is None and out.multi_modal_inputs == {} and out.num_turns == 3
    assert out.extra_fields == {"turn_scores": [1], "raw_prompt": [{"role": "user", "content": "q"}]}


def test_routed_experts_start_at_the_prompts_first_token(tok):
    worker = make_worker(tok, prompt_length=5, response_length=4)
    experts = np.arange(10).reshape(5, 2, 1)  # 3 prompt tokens and 2 response tokens, 2 layers, top-1
    experts.setflags(write=False)
    out = postprocess(worker, episode(routed_experts=experts))
    expected = torch.zeros((1, 9, 2, 1), dtype=torch.int16)
    expected[0, 2:7] = torch.arange(10, dtype=torch.int16).reshape(5, 2, 1)
    assert out.routed_experts.dtype == torch.int16 and torch.equal(out.routed_experts, expected)
    with pytest.raises(TypeError, match="routed_experts must be a numpy array or a torch tensor, got list"):
        postprocess(worker, episode(routed_experts=[[1]]))


def test_multi_modal_episodes_are_refused(tok):
    with pytest.raises(NotImplementedError, match="multi-modal"):
        postprocess(make_worker(tok), episode(multi_modal_data={"images": ["an image"]}))


# ----------------------------------------------------------------------------------------------- the batch
def test_postprocess_keeps_a_stable_schema_and_scores_only_when_every_episode_has_one(tok):
    worker = make_worker(tok, prompt_length=4, response_length=3)
    tool = postprocess(worker, episode(response_ids=[21, 22, 23], response_mask=[1, 0, 1], reward_score=0.5,
                                       num_turns=4, extra_fields={"tool_rewards": [0.1], "mine": "x"}))  # fmt: skip
    single = postprocess(worker, episode(response_ids=[31], response_mask=[1], reward_score=2.0, num_turns=2))
    rows = {"uid": np.array(["a", "b"], dtype=object)}
    batch = worker._postprocess([tool, single], input_non_tensor_batch=rows)
    assert isinstance(batch, DataProto) and len(batch) == 2
    assert batch.batch["rm_scores"].tolist() == [[0.0, 0.0, 0.5], [2.0, 0.0, 0.0]]
    assert batch.batch["responses"][:, 0].tolist() == [21, 31] and "rollout_log_probs" not in batch.batch.keys()
    columns = batch.non_tensor_batch
    assert columns["__num_turns__"].dtype == np.int32 and columns["__num_turns__"].tolist() == [4, 2]
    assert list(columns["uid"]) == ["a", "b"] and list(columns["mine"]) == ["x", None]
    assert list(columns["tool_rewards"]) == [[0.1], None] and set(STABLE_EXTRA_FIELDS) <= set(columns)
    assert all(columns[key].shape == (2,) for key in columns)
    assert batch.meta_info["reward_extra_keys"] == [] and len(batch.meta_info["metrics"]) == 2

    unscored = postprocess(worker, episode(response_ids=[31], response_mask=[1]))
    batch = worker._postprocess([tool, unscored])
    assert "rm_scores" not in batch.batch.keys() and set(batch.meta_info) == {"metrics"}


def test_generate_sequences_runs_every_row_with_verls_sampling_parameters(tok):
    server = EchoServer()
    worker = make_worker(tok, server, prompt_length=32, response_length=6)
    prompts = [[{"role": "user", "content": text}] for text in ("Hi", "What is 2 + 2?", "Bye")]
    rows = {"raw_prompt": object_column(prompts), "index": np.array([4, 4, 9]),
            "__do_sample__": np.array([True, False, True])}  # fmt: skip
    data = DataProto(non_tensor_batch=rows, meta_info={"global_steps": 2})
    out = asyncio.run(worker.generate_sequences(data))
    sampled = {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "repetition_penalty": 1.0, "logprobs": True}
    assert server.params == [sampled, {**sampled, "temperature": 0, "top_p": 1.0, "top_k": -1}, sampled]
    assert list(out.non_tensor_batch["agent_name"]) == ["single_turn_agent"] * 3
    for i, messages in enumerate(prompts):
        prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
        assert out.batch["prompts"][i][out.batch["attention_mask"][i, :32].bool()].tolist() == prompt
    assert out.batch["responses"][:, :3].tolist() == [ANSWER] * 3
    assert out.batch["rollout_log_probs"].tolist() == [[-0.25] * 3 + [0.0] * 3] * 3
    assert list(out.non_tensor_batch["max_global_steps"]) == [3, 3, 3]
    assert list(out.non_tensor_batch["turn_scores"]) == [[], [], []] and "__do_sample__" in out.non_tensor_batch

    server.params.clear()
    validation = DataProto(non_tensor_batch={"raw_prompt": rows["raw_prompt"][:1]}, meta_info={"validate": True})
    asyncio.run(worker.generate_sequences(validation))
    assert server.params == [{**sampled, "temperature": 0.0, "top_p": 1.0, "top_k": -1}]


# ----------------------------------------------------------------------------------------------- building loops
class GreetingLoop(AgentLoopBase):
    """Not registered: reachable only through a registry entry naming its module path (as a YAML entry does)."""

    def __init__(self, *args, greeting: str = "hi", **kwargs):
        super().__init__(*args, **kwargs)
        self.greeting = greeting

    async def run(self, sampling_params, **kwargs):
        return episode()


def test_a_registry_entry_is_built_through_hydra_with_its_arguments(tok):
    registry = agent_loop_module._agent_loop_registry
    registry["greeting"] = {"name": "greeting", "_target_": f"{__name__}.GreetingLoop", "greeting": "hello"}
    try:
        worker = make_worker(tok)
        loop = build_agent_loop("greeting", trainer_config=agent_loop_module.DictConfigWrap(worker.config),
                                server_manager=None, tokenizer=tok, processor=None, dataset_cls=None,
                                data_config=agent_loop_module.DictConfigWrap(worker.config.data))  # fmt: skip
        assert type(loop).__name__ == "GreetingLoop" and loop.greeting == "hello" and loop.tokenizer is tok
    finally:
        registry.pop("greeting")


def test_rollout_trace_attr_logs_the_episode(caplog):
    with caplog.at_level(logging.DEBUG, logger=agent_loop_module.__name__):
        with rollout_trace_attr(sample_index=3, step=1, rollout_n=0, name="agent_loop"):
            pass
        with rollout_trace_attr(sample_index=4, step=1, rollout_n=0, trace=False):
            pass
    assert len(caplog.records) == 1 and "agent_loop step=1 sample_index=3 rollout_n=0" in caplog.records[0].message


def test_the_constructor_loads_the_tokenizer_and_refuses_what_is_not_provided(tok, tiny_model_dir):
    config = trainer_config()
    config.actor_rollout_ref.model = {"path": tiny_model_dir}
    assert AgentLoopWorker(config, EchoServer()).tokenizer.get_vocab() == tok.get_vocab()
    with pytest.raises(NotImplementedError, match="teacher clients"):
        AgentLoopWorker(config, EchoServer(), teacher_client={"t": object()}, tokenizer=tok)
    with pytest.raises(NotImplementedError, match="reward-loop workers"):
        AgentLoopWorker(config, EchoServer(), reward_loop_worker_handles=[object()], tokenizer=tok)
    with pytest.raises(ValueError, match="default_agent_loop='nope' is not a registered agent loop"):
        make_worker(tok, default_agent_loop="nope")
