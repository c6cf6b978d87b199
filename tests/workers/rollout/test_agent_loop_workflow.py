"""Tests of the `agent_loop` workflow (verl/workers/rollout/workflows/agent_loop.py) on the tiny model's `hf` engine:

- `single_turn_agent` gives the rows of `rlvr` (same tokens, masks, log-probs, position ids where attended, one
  batched generate call), with verl's stable extra-field columns;
- `tool_agent` with the gsm8k_tool_agent example's tool YAML on a model warm-started to call those tools
  (examples/gsm8k_tool_agent/warm_start.py): tool results in the rows with response_mask 0 and log-prob 0, every
  turn of every episode batched into one generate call per wave, tool rewards and turns in the row fields;
- `EngineServerManager`, the server manager of the loops: greedy at temperature 0, `stop_token_ids`,
  `max_tokens`, log-probs only when asked, and what it refuses;
- the workflow's own checks (truncation side, default loop, tool config file, the chat `raw_prompt`).
"""

from __future__ import annotations

import asyncio
import os
import random
import sys

import numpy as np
import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from verl.protocol import DataProto
from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn
from verl.workers.rollout.async_engine import AsyncRolloutEngine, ModelRequest, batching_options
from verl.workers.rollout.hf_rollout import HFRollout
from verl.workers.rollout.workflows import get_workflow_class
from verl.workers.rollout.workflows.agent_loop import AgentLoopWorkflow, EngineServerManager
from verl.workers.rollout.workflows.base import run_episodes_sync
from verl.workers.rollout.workflows.rlvr import RLVRWorkflow

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "gsm8k_tool_agent")
TOOL_CONFIG = os.path.abspath(os.path.join(EXAMPLE, "tool_config.yaml"))
QUESTIONS = ["How many apples?", "Hi", "Convert 5 dollars to euro please", "What time is it"]
MULTI_TURN = dict(enable=True, format="hermes", max_assistant_turns=None, max_user_turns=None, max_parallel_calls=1,
                  max_tool_response_length=256, tool_response_truncate_side="middle", tool_config_path=None,
                  function_tool_path=None)  # fmt: skip
AGENT = dict(num_workers=8, default_agent_loop="single_turn_agent", agent_loop_config_path=None)


def agent_config(make_config, multi_turn=None, agent=None, **overrides):
    return make_config(multi_turn={**MULTI_TURN, **(multi_turn or {})}, agent={**AGENT, **(agent or {})},
                       full_determinism=False, **overrides)  # fmt: skip


def run(rollout, data, workflow):
    engine = AsyncRolloutEngine(rollout, data.meta_info, **batching_options(rollout.config))
    return run_episodes_sync(engine, data, workflow), engine


def chat_prompts(make_prompts, tokenizer, questions, prompt_len=32, **meta):
    """The questions' chat prompts, tokenised as the dataset does, with their messages as `raw_prompt`."""
    messages = [[{"role": "user", "content": q}] for q in questions]
    texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages]
    raw = np.empty(len(messages), dtype=object)
    raw[:] = messages
    return make_prompts(texts, prompt_len=prompt_len, non_tensors={"raw_prompt": raw}, **meta)


def test_the_workflow_is_registered():
    assert get_workflow_class("agent_loop") is AgentLoopWorkflow


@pytest.mark.parametrize("log_probs", [True, False])
def test_single_turn_agent_gives_the_rlvr_rows(model, tokenizer, make_config, make_prompts, log_probs):
    config = agent_config(make_config, prompt_length=32, response_length=10, calculate_log_probs=log_probs)
    rollout = HFRollout(model, config, tokenizer)
    expected, _ = run(rollout, chat_prompts(make_prompts, tokenizer, QUESTIONS * 2), RLVRWorkflow(config, tokenizer))
    got, engine = run(
        rollout, chat_prompts(make_prompts, tokenizer, QUESTIONS * 2), AgentLoopWorkflow(config, tokenizer)
    )
    assert (engine.num_generate_calls, engine.num_requests) == (1, 8)
    assert set(got.batch.keys()) == set(expected.batch.keys())
    attended = expected.batch["attention_mask"].bool()
    for key in expected.batch.keys():  # position ids on padding: verl's agent loop repeats the last one, rlvr counts on
        got_values, expected_values = got.batch[key], expected.batch[key]
        if key == "position_ids":
            got_values, expected_values = got_values[attended], expected_values[attended]
        assert torch.equal(got_values, expected_values), key
    fields = got.non_tensor_batch
    assert list(fields["__num_turns__"]) == [2] * 8 and list(fields["reward_score"]) == [None] * 8
    assert all(r == [] for r in fields["tool_rewards"]) and list(fields["extras"]) == [None] * 8
    assert list(fields["min_global_steps"]) == [0] * 8 and list(fields["max_global_steps"]) == [0] * 8
    assert fields["tool_extra_fields"][0]["max_global_steps"] == 0
    assert fields["tool_extra_fields"][0]["raw_prompt"] == [{"role": "user", "content": QUESTIONS[0]}]
    assert fields["agent_loop_metrics"][0]["generate_sequences"] > 0


# ----------------------------------------------------------------------------------------------- tool_agent
@pytest.fixture(scope="module")
def tool_model(tiny_model_dir, tmp_path_factory):
    """The tiny model warm-started on the example's demonstrations (calculator, then answer check, then answer)
    of 4 synthetic problems, the rows written by the example's data builder, and its tokenizer's folder."""
    sys.path.insert(0, os.path.abspath(EXAMPLE))
    try:
        import prepare_data
        import warm_start
    finally:
        sys.path.pop(0)
    out = tmp_path_factory.mktemp("tool_agent")
    rng = random.Random(0)
    rows = [prepare_data.row("train", i, *prepare_data.synthetic_problem(rng)) for i in range(4)]
    pd.DataFrame(rows).to_parquet(out / "train.parquet")
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model trains fastest on one thread, on a busy machine by far
    try:
        warm_start.warm_start(tiny_model_dir, str(out / "train.parquet"), str(out / "model"), 300, 3e-3, 0.1)
    finally:
        torch.set_num_threads(threads)
    return str(out / "model"), str(out / "train.parquet")


def expected_mask(tokenizer, ids: list[int]) -> list[int]:
    """1 on the model's tokens, 0 from after each model turn's <|im_end|> through the next assistant header."""
    header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    mask, i, model_turn = [], 0, True
    while i < len(ids):
        if model_turn:
            mask.append(1)
            model_turn = ids[i] != im_end
            i += 1
        elif ids[i : i + len(header)] == header:
            mask += [0] * len(header)
            i, model_turn = i + len(header), True
        else:
            mask.append(0)
            i += 1
    return mask


def test_tool_agent_rows_mask_tool_results_and_batch_every_turn(tool_model, tokenizer, make_config, monkeypatch):
    model_dir, train_file = tool_model
    monkeypatch.syspath_prepend(os.path.abspath(EXAMPLE))  # the YAML names gsm8k_tools.<Class>
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = agent_config(make_config, multi_turn={"tool_config_path": TOOL_CONFIG}, prompt_length=160,
                          response_length=256, calculate_log_probs=True)  # fmt: skip
    dataset = RLHFDataset(train_file, tokenizer, OmegaConf.create({"max_prompt_length": 160, "return_raw_chat": True}))
    data = DataProto.from_single_dict(collate_fn([dataset[i] for i in range(4)]))
    data.meta_info = {"eos_token_id": [2, 0], "pad_token_id": tokenizer.pad_token_id, "seed": 1, "validate": True}
    out, engine = run(HFRollout(model, config, tokenizer), data, AgentLoopWorkflow(config, tokenizer))

    turns = [int(t) for t in out.non_tensor_batch["__num_turns__"]]
    assert max(turns) >= 4, turns  # at least one episode called a tool (model turn, tool turn, model turn)
    model_turns = [t // 2 for t in turns]  # turns = model turns + tool turns + 1, the tool turns one fewer
    assert engine.num_generate_calls == max(model_turns)  # each wave of turns is one batched generate call
    for i in range(len(out)):
        n = int(out.batch["attention_mask"][i, -256:].sum())
        ids = out.batch["responses"][i, :n].tolist()
        mask = out.batch["response_mask"][i, :n].tolist()
        assert mask == expected_mask(tokenizer, ids), tokenizer.decode(ids)
        assert not out.batch["rollout_log_probs"][i, :n][torch.tensor(mask) == 0].any()
        rewards = out.non_tensor_batch["tool_rewards"][i]
        assert len(rewards) == (turns[i] - 2) // 2 and all(r in (0.0, -0.05) for r in rewards)
        prompt = tokenizer.apply_chat_template(list(data.non_tensor_batch["raw_prompt"][i]), add_generation_prompt=True)
        assert out.batch["prompts"][i][out.batch["attention_mask"][i, :160].bool()].tolist() == prompt["input_ids"]
    text = tokenizer.decode(out.batch["responses"][turns.index(max(turns))])
    assert "<|im_start|>tool\n" in text and "<tool_call>" in text


# ----------------------------------------------------------------------------------------------- server manager
def test_engine_server_manager(model, tokenizer, make_config, make_prompts):
    rollout = HFRollout(model, agent_config(make_config, response_length=12), tokenizer)
    prompt = tokenizer("How many apples?", add_special_tokens=False)["input_ids"]

    async def generate(sampling_params, **media):
        engine = AsyncRolloutEngine(rollout, {"eos_token_id": [2, 0], "pad_token_id": 0, "seed": 3})
        return await EngineServerManager(engine).generate("r", prompt_ids=prompt, sampling_params=sampling_params,
                                                          **media)  # fmt: skip

    async def greedy_request():
        engine = AsyncRolloutEngine(rollout, {"eos_token_id": [2, 0], "pad_token_id": 0, "seed": 3})
        return await engine.agenerate(ModelRequest(prompt, engine.default_gconfig().new(greedy=True)))

    greedy = asyncio.run(generate({"temperature": 0, "logprobs": True}))
    reference = asyncio.run(greedy_request())
    assert greedy.token_ids == reference.output_tokens and greedy.log_probs == reference.output_logprobs
    assert greedy.extra_fields == {"global_steps": 0, "min_global_steps": 0, "max_global_steps": 0}
    assert len(greedy.token_ids) >= 4
    stop = greedy.token_ids[len(greedy.token_ids) // 2]
    cut = asyncio.run(generate({"temperature": 0, "stop_token_ids": [stop]}))
    assert cut.token_ids == greedy.token_ids[: greedy.token_ids.index(stop) + 1] and cut.stop_reason == "completed"
    assert cut.log_probs is None
    short = asyncio.run(generate({"temperature": 0, "max_tokens": 2}))
    assert short.token_ids == greedy.token_ids[:2] and short.stop_reason == "length"
    assert asyncio.run(generate({"temperature": 0, "max_tokens": 100})).token_ids == greedy.token_ids  # capped
    with pytest.raises(ValueError, match=r"sampling_params \['min_p'\] are not supported"):
        asyncio.run(generate({"min_p": 0.1}))
    with pytest.raises(ValueError, match="repetition_penalty=1.2 is not supported"):
        asyncio.run(generate({"repetition_penalty": 1.2}))
    with pytest.raises(NotImplementedError, match=r"multi-modal inputs \['image_data'\]"):
        asyncio.run(generate({}, image_data=["an image"]))


# ----------------------------------------------------------------------------------------------- checks
def test_the_workflow_refuses_what_it_does_not_implement(tokenizer, make_config, tmp_path, make_prompts, model):
    with pytest.raises(ValueError, match="tool_response_truncate_side='up' is not supported"):
        AgentLoopWorkflow(agent_config(make_config, multi_turn={"tool_response_truncate_side": "up"}), tokenizer)
    with pytest.raises(ValueError, match="default_agent_loop='nope' is not a registered agent loop"):
        AgentLoopWorkflow(agent_config(make_config, agent={"default_agent_loop": "nope"}), tokenizer)
    with pytest.raises(FileNotFoundError, match="multi_turn.tool_config_path="):
        AgentLoopWorkflow(
            agent_config(make_config, multi_turn={"tool_config_path": str(tmp_path / "no.yaml")}), tokenizer
        )
    with pytest.raises(ValueError, match="multi_turn.format='nope'"):
        AgentLoopWorkflow(agent_config(make_config, multi_turn={"format": "nope"}), tokenizer)
    config = agent_config(make_config)
    with pytest.raises(KeyError, match="data.return_raw_chat=true"):
        run(HFRollout(model, config, tokenizer), make_prompts(["Hi"]), AgentLoopWorkflow(config, tokenizer))
    config = agent_config(make_config, prompt_length=32)
    wide = chat_prompts(make_prompts, tokenizer, ["Hi"], prompt_len=40)
    with pytest.raises(ValueError, match="prompt_length=32 differs from the batch's prompt width 40"):
        run(HFRollout(model, config, tokenizer), wide, AgentLoopWorkflow(config, tokenizer))
