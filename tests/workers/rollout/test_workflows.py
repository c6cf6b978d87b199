"""Tests of the rollout workflows (verl/workers/rollout/workflows/) on tiny Qwen2 models.

- `rlvr` gives exactly the engine's `generate_sequences` output (same tokens, masks, log-probs) for a seed;
- `remax` trains on the sampled completion with r(sample) at its last token and r(greedy) as the baseline,
  both checked against independent engine calls and the reward function applied by hand;
- `multi_turn_tool` on a model fine-tuned to call a failing tool, then write bad JSON, then a good call:
  the episode is checked token for token (observations inserted, loss mask 0 on them, turn limit, budget);
- `environment` runs `GSM8KEnv` through the in-process OpenAI client and scores with its weighted rubric;
- rejected samples become placeholder rows and the trainer's drop rule keeps GRPO groups consistent.
"""

import asyncio

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from verl.envs.tools import ToolRegistry
from verl.protocol import DataProto
from verl.workers.rollout.async_engine import AsyncRolloutEngine, ModelRequest, batching_options
from verl.workers.rollout.hf_rollout import HFRollout
from verl.workers.rollout.workflows import (
    RolloutWorkflow,
    build_workflow,
    drop_rejected_rows,
    get_workflow_class,
    register_workflow,
    rollout_batch,
)
from verl.workers.rollout.workflows.base import run_episodes_sync
from verl.workers.rollout.workflows.multi_turn_tool import MultiTurnToolWorkflow
from verl.workers.rollout.workflows.rlvr import RLVRWorkflow

TEXTS = ["How many apples?", "Hi", "Convert 5 dollars to euro please", "What time is it"]


def length_reward(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """A reward with some spread on a random model: the length of the decoded response."""
    return float(len(solution_str))


def run(rollout, data, workflow, max_concurrent=None):
    """What `rollout_batch` does, keeping the engine to read its counters."""
    engine = AsyncRolloutEngine(rollout, data.meta_info, **batching_options(rollout.config))
    return run_episodes_sync(engine, data, workflow, max_concurrent), engine


def decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True)


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------------------------- rlvr
@pytest.mark.parametrize("log_probs,validate", [(True, False), (False, False), (False, True)])
def test_rlvr_gives_exactly_the_engine_output(make_rollout, make_prompts, make_config, tokenizer, log_probs, validate):
    rollout = make_rollout(calculate_log_probs=log_probs, response_length=10)
    direct = rollout.generate_sequences(make_prompts(TEXTS * 2, validate=validate))
    via = rollout_batch(rollout, make_prompts(TEXTS * 2, validate=validate), build_workflow(rollout.config, tokenizer))
    assert via.batch.pop("rollout_accepted").all()
    assert set(via.batch.keys()) == set(direct.batch.keys())
    for key in direct.batch.keys():
        assert torch.equal(via.batch[key], direct.batch[key]), key
    assert list(via.non_tensor_batch["uid"]) == list(direct.non_tensor_batch["uid"])
    assert via.meta_info == direct.meta_info == {}
    _, engine = run(rollout, make_prompts(TEXTS * 2, validate=validate), build_workflow(rollout.config, tokenizer))
    assert (engine.num_generate_calls, engine.num_requests) == (1, 8)


@pytest.mark.parametrize("row_by_row", [False, True], ids=["in_one_go", "row_by_row"])
def test_rlvr_with_ignore_eos_keeps_every_token_as_the_engine_does(make_rollout, make_prompts, tokenizer, row_by_row):
    """verl's `rollout.ignore_eos` on the default path: an eos in the middle of a response does not cut it."""
    free = make_rollout(response_length=10).generate_sequences(make_prompts(TEXTS, seed=5))
    eos = int(free.batch["responses"][0, 2])  # a token the model draws mid-response: the eos of the runs below
    rollout = make_rollout(response_length=10, ignore_eos=True)
    direct = rollout.generate_sequences(make_prompts(TEXTS, seed=5, eos_token_id=eos))
    assert direct.batch["response_mask"].all()
    workflow = (RLVRRowByRow if row_by_row else RLVRWorkflow)(rollout.config, tokenizer)
    via = rollout_batch(rollout, make_prompts(TEXTS, seed=5, eos_token_id=eos), workflow)
    via.batch.pop("rollout_accepted")
    for key in direct.batch.keys():
        assert torch.equal(via.batch[key], direct.batch[key]), key
    cut = rollout_batch(make_rollout(response_length=10), make_prompts(TEXTS, seed=5, eos_token_id=eos),
                        RLVRWorkflow(rollout.config, tokenizer))  # fmt: skip
    assert cut.batch["response_mask"][0].tolist() == [1] * 3 + [0] * 7  # without it the row ends at that eos


class RLVRRowByRow(RLVRWorkflow):
    """The same episode, overridden: `run_batch` then leaves the rows to `arun_episode`, one coroutine each."""

    async def arun_episode(self, engine, data):
        return await super().arun_episode(engine, data)


@pytest.mark.parametrize("log_probs", [True, False])
def test_rlvr_in_one_go_equals_its_episodes_row_by_row(make_rollout, make_prompts, tokenizer, monkeypatch, log_probs):
    from verl.workers.rollout.workflows import base

    episodes = []
    original_of = base.EpisodeRow.of
    monkeypatch.setattr(base.EpisodeRow, "of", lambda row: episodes.append(1) or original_of(row))
    rollout = make_rollout(calculate_log_probs=log_probs, response_length=10)
    texts = TEXTS * 3  # prompts of different lengths, each 3 times
    at_once, engine = run(rollout, make_prompts(texts, seed=7), RLVRWorkflow(rollout.config, tokenizer))
    assert not episodes and (engine.num_generate_calls, engine.num_requests) == (1, 12)  # no per-row episode ran
    row_by_row, engine = run(rollout, make_prompts(texts, seed=7), RLVRRowByRow(rollout.config, tokenizer))
    assert len(episodes) == 12 and (engine.num_generate_calls, engine.num_requests) == (1, 12)
    assert set(at_once.batch.keys()) == set(row_by_row.batch.keys())
    for key in row_by_row.batch.keys():
        assert torch.equal(at_once.batch[key], row_by_row.batch[key]), key
    assert at_once.batch["response_mask"].sum() > 12  # real responses, not placeholders
    assert list(at_once.non_tensor_batch["uid"]) == list(row_by_row.non_tensor_batch["uid"])
    assert at_once.meta_info == row_by_row.meta_info == {}


def test_rlvr_rows_that_need_several_calls_run_row_by_row(make_rollout, make_prompts, tokenizer):
    """A batch cap below the rows (or a concurrency cap) splits the episodes over calls, each with its own seed:
    the rows are then the episodes', not one call's."""
    rollout = make_rollout(response_length=4, agenerate_max_batch_size=5)
    out, engine = run(rollout, make_prompts(TEXTS * 3, seed=7), RLVRWorkflow(rollout.config, tokenizer))
    assert len(out) == 12 and engine.num_generate_calls == 3
    requests = [ModelRequest(input_ids=encode(tokenizer, t), gconfig=engine.default_gconfig()) for t in TEXTS * 3]
    with pytest.raises(ValueError, match="12 requests do not fit one call"):
        engine.generate_all(requests)
    with pytest.raises(ValueError, match="one sampling"):
        engine.generate_all([requests[0], ModelRequest(input_ids=[5], gconfig=requests[0].gconfig.new(greedy=True))])
    rollout = make_rollout(response_length=4)
    out, engine = run(rollout, make_prompts(TEXTS * 3, seed=7), RLVRWorkflow(rollout.config, tokenizer), 6)
    assert len(out) == 12 and engine.num_generate_calls >= 2


def test_registry_names_and_dotted_paths(make_config, tokenizer):
    assert get_workflow_class("rlvr") is RLVRWorkflow
    assert get_workflow_class("verl.workers.rollout.workflows.rlvr:RLVRWorkflow") is RLVRWorkflow
    assert build_workflow(make_config(workflow=None), tokenizer) is None
    with pytest.raises(ValueError, match=r"unknown rollout workflow 'rlhf'.*\['agent_loop', 'environment', 'multi"):
        get_workflow_class("rlhf")
    with pytest.raises(ValueError, match="cannot be imported"):
        get_workflow_class("no_such_pkg.module:Workflow")
    with pytest.raises(TypeError, match="not a RolloutWorkflow subclass"):
        get_workflow_class("verl.envs.gsm8k:GSM8KEnv")
    with pytest.raises(TypeError, match=r"unknown rollout.workflow_kwargs \['turns'\]"):
        build_workflow(make_config(workflow="rlvr", workflow_kwargs={"turns": 3}), tokenizer)
    with pytest.raises(ValueError, match="already registered"):
        register_workflow("remax")(RLVRWorkflow)


# ----------------------------------------------------------------------------------------------- remax
def test_remax_rows_carry_sample_reward_and_greedy_baseline(make_rollout, make_prompts, make_config, tokenizer):
    config = make_config(workflow="remax", workflow_kwargs={"reward_fn": f"{__file__}:length_reward"},
                         response_length=8)  # fmt: skip
    rollout = HFRollout(make_rollout().module, config, tokenizer)
    non_tensors = {"data_source": np.array(["toy"] * 4, dtype=object),
                   "reward_model": np.array([{"ground_truth": "x"}] * 4, dtype=object)}  # fmt: skip
    out, engine = run(rollout, make_prompts(TEXTS, non_tensors=non_tensors), build_workflow(config, tokenizer))
    assert engine.num_generate_calls == 2  # all samples in one call, all greedy in another

    sampled = rollout.generate_sequences(make_prompts(TEXTS))  # same seed: the sampled group went first
    greedy = rollout.generate_sequences(make_prompts(TEXTS, do_sample=False))
    assert torch.equal(out.batch["responses"], sampled.batch["responses"])
    for i in range(len(TEXTS)):
        length = int(out.batch["response_mask"][i].sum())
        scores = out.batch["token_level_scores"][i]
        assert scores[length - 1] == len(decode(tokenizer, out.batch["responses"][i, :length].tolist()))
        assert scores.abs().sum() == scores[length - 1].abs()
        g_len = int(greedy.batch["response_mask"][i].sum())
        assert out.batch["reward_baselines"][i] == len(decode(tokenizer, greedy.batch["responses"][i, :g_len].tolist()))

    val, engine = run(rollout, make_prompts(TEXTS, non_tensors=non_tensors, validate=True),
                      build_workflow(config, tokenizer))  # fmt: skip
    assert engine.num_generate_calls == 1 and not val.batch["reward_baselines"].any()


# ----------------------------------------------------------------------------------------------- multi-turn tools
@pytest.fixture(scope="module")
def scripted_model(scripted_model_dir):
    return AutoModelForCausalLM.from_pretrained(scripted_model_dir, dtype=torch.float32).eval()


def div(a: int, b: int) -> float:
    """Divide a by b."""
    return a / b


def tool_rollout(scripted_model, make_config, tokenizer, **overrides):
    config = make_config(workflow="multi_turn_tool", do_sample=False, calculate_log_probs=True,
                         **{"response_length": 256, **overrides})  # fmt: skip
    registry = ToolRegistry()
    registry.register(div)
    return HFRollout(scripted_model, config, tokenizer), MultiTurnToolWorkflow(config, tokenizer, registry=registry)


def expected_trajectory(tokenizer, segments):
    ids, mask = [], []
    for k, text in enumerate(segments):
        piece = encode(tokenizer, text)
        ids += piece
        mask += [1 - k % 2] * len(piece)  # model turns are segments 0, 2, 4, ...
    return ids, mask


@pytest.mark.slow  # the scripted model is fine-tuned once (~10-25 s on 2 busy cores)
def test_multi_turn_tool_episode_token_for_token(scripted_model, make_config, make_prompts, tokenizer, script):
    rollout, workflow = tool_rollout(scripted_model, make_config, tokenizer)
    prompt = script["chat_prompt"](tokenizer, script["tool_question"])
    out, engine = run(rollout, make_prompts([prompt, prompt], prompt_len=24), workflow)
    ids, mask = expected_trajectory(tokenizer, script["tool_transcript"])
    n = len(ids)
    for row in range(2):
        assert out.batch["responses"][row, :n].tolist() == ids, decode(tokenizer, out.batch["responses"][row].tolist())
        assert out.batch["response_mask"][row, :n].tolist() == mask
        assert not out.batch["response_mask"][row, n:].any() and out.batch["attention_mask"][row, 24 : 24 + n].all()
        assert not out.batch["attention_mask"][row, 24 + n :].any()
        lps = out.batch["rollout_log_probs"][row, :n]
        assert (lps[torch.tensor(mask) == 0] == 0).all() and (lps[torch.tensor(mask) == 1] < 0).all()
        assert out.non_tensor_batch["num_turns"][row] == 4
    # the failing tool and the bad JSON came back as observations: the model saw exactly those texts
    text = decode(tokenizer, out.batch["responses"][0, :n].tolist())
    assert "raised ZeroDivisionError: division by zero" in text and "is not valid JSON" in text
    assert engine.num_generate_calls == 4 and engine.num_requests == 8  # 2 episodes x 4 turns, batched per turn
    position = out.batch["position_ids"][0]
    assert torch.equal(position[24:], position[23] + torch.arange(1, 257))


@pytest.mark.slow  # the scripted model is fine-tuned once (~10-25 s on 2 busy cores)
def test_multi_turn_tool_stops_at_max_turns_and_budget(scripted_model, make_config, make_prompts, tokenizer, script):
    multi_turn = dict(max_turns=2, tool_modules=[], tools=None, tool_timeout_s=5, max_tool_response_length=200)
    rollout, workflow = tool_rollout(scripted_model, make_config, tokenizer, multi_turn=multi_turn)
    prompt = script["chat_prompt"](tokenizer, script["tool_question"])
    out = rollout_batch(rollout, make_prompts([prompt], prompt_len=24), workflow)
    ids, mask = expected_trajectory(tokenizer, script["tool_transcript"][:3])  # turn, observation, turn: no 2nd obs
    assert out.batch["responses"][0, : len(ids)].tolist() == ids
    assert out.batch["response_mask"][0].tolist() == mask + [0] * (256 - len(ids))
    assert int(out.batch["attention_mask"][0, 24:].sum()) == len(ids) and out.non_tensor_batch["num_turns"][0] == 2

    rollout, workflow = tool_rollout(scripted_model, make_config, tokenizer, response_length=40)
    out = rollout_batch(rollout, make_prompts([prompt], prompt_len=24), workflow)
    full_ids, full_mask = expected_trajectory(tokenizer, script["tool_transcript"])
    assert out.batch["responses"][0].tolist() == full_ids[:40]  # the shared budget cuts the episode
    assert out.batch["response_mask"][0].tolist() == full_mask[:40]


def test_multi_turn_tool_needs_tools(make_config, tokenizer, tmp_path):
    with pytest.raises(ValueError, match="no tools"):
        MultiTurnToolWorkflow(make_config(), tokenizer, registry=ToolRegistry())
    tools_file = tmp_path / "my_tools.py"
    tools_file.write_text("from verl.envs.tools import tool\n\n@tool\ndef shout(text: str) -> str:\n"
                          "    '''Upper-case a text.'''\n    return text.upper()\n")  # fmt: skip
    multi_turn = dict(max_turns=3, tool_modules=[str(tools_file)], tools=["shout"])
    workflow = MultiTurnToolWorkflow(make_config(multi_turn=multi_turn), tokenizer)
    assert workflow.registry.names() == ["shout"] and workflow.max_turns == 3
    with pytest.raises(ValueError, match=r"unknown tools \['nope'\]"):
        MultiTurnToolWorkflow(make_config(multi_turn={**multi_turn, "tools": ["nope"]}), tokenizer)
    assert workflow.tool_call_format.stop == "</tool_call>"  # multi_turn.format: verl's default hermes
    qwen3 = MultiTurnToolWorkflow(make_config(multi_turn={**multi_turn, "format": "qwen3_coder"}), tokenizer)
    assert qwen3.tool_call_format.stop == "</tool_call>"
    with pytest.raises(ValueError, match=r"multi_turn.format='nope' is not a known tool-call format"):
        MultiTurnToolWorkflow(make_config(multi_turn={**multi_turn, "format": "nope"}), tokenizer)


# ----------------------------------------------------------------------------------------------- environment
@pytest.mark.slow  # the scripted model is fine-tuned once (~10-25 s on 2 busy cores)
def test_environment_workflow_scores_gsm8k_with_the_rubric(scripted_model, make_config, make_prompts, tokenizer,
                                                            script):  # fmt: skip
    config = make_config(workflow="environment", workflow_kwargs={"env": "verl.envs.gsm8k.GSM8KEnv"},
                         do_sample=False, response_length=32)  # fmt: skip
    rollout = HFRollout(scripted_model, config, tokenizer)
    messages = [{"role": "user", "content": script["gsm8k_question"]}]
    non_tensors = {"raw_prompt": np.array([messages, messages], dtype=object),
                   "reward_model": np.array([{"ground_truth": "13"}, {"ground_truth": "12"}], dtype=object)}  # fmt: skip
    prompt = script["chat_prompt"](tokenizer, script["gsm8k_question"])
    data = make_prompts([prompt, prompt], prompt_len=40, non_tensors=non_tensors)
    out = rollout_batch(rollout, data, build_workflow(config, tokenizer))
    answer = encode(tokenizer, script["gsm8k_answer"])
    assert torch.equal(out.batch["prompts"], data.batch["input_ids"])  # the client tokenised the chat the same way
    for row, reward in enumerate([1.0 + 0.1, 0.0 + 0.1]):  # correct_answer (weight 1) + answer_format (weight 0.1)
        assert out.batch["responses"][row, : len(answer)].tolist() == answer
        assert out.batch["response_mask"][row].sum() == len(answer)
        scores = out.batch["token_level_scores"][row]
        assert scores[len(answer) - 1].item() == pytest.approx(reward) and scores.sum().item() == pytest.approx(reward)


# ----------------------------------------------------------------------------------------------- rejection
class RejectOddRows(RLVRWorkflow):
    extra_output_keys = {"token_level_scores": "response", "note": "object"}

    async def arun_episode(self, engine, data):
        if int(data.non_tensor_batch["uid"][0][1:]) % 2:
            return None
        row = await super().arun_episode(engine, data)
        row.batch["token_level_scores"] = torch.ones(row.batch["responses"].shape)
        row.non_tensor_batch["note"] = np.array(["kept"], dtype=object)
        return row


def test_rejected_rows_are_placeholders(make_rollout, make_prompts, tokenizer):
    rollout = make_rollout(response_length=5, calculate_log_probs=True)
    out = rollout_batch(rollout, make_prompts(TEXTS), RejectOddRows(rollout.config, tokenizer))
    assert out.batch["rollout_accepted"].tolist() == [True, False, True, False]
    for row in (1, 3):
        assert not out.batch["response_mask"][row].any() and not out.batch["attention_mask"][row, 16:].any()
        assert (out.batch["responses"][row] == tokenizer.pad_token_id).all()
        assert not out.batch["token_level_scores"][row].any() and out.non_tensor_batch["note"][row] is None
        assert not out.batch["rollout_log_probs"][row].any()
    assert out.non_tensor_batch["note"][0] == "kept" and out.batch["token_level_scores"][0].all()


def test_drop_rule_keeps_groups_with_two_or_more_rows():
    batch = DataProto.from_dict(
        tensors={"x": torch.arange(6), "rollout_accepted": torch.tensor([1, 0, 1, 1, 0, 0]).bool()},
        non_tensors={"uid": np.array(["a", "a", "b", "b", "c", "c"], dtype=object)},
    )
    kept, metrics = drop_rejected_rows(batch, n=2)
    assert kept.batch["x"].tolist() == [2, 3] and "rollout_accepted" not in kept.batch.keys()
    assert metrics == {"rollout/rejected_samples": 3.0, "rollout/dropped_samples": 4.0}
    batch.batch["rollout_accepted"] = torch.tensor([1, 0, 1, 1, 0, 0]).bool()
    kept, _ = drop_rejected_rows(batch, n=1)
    assert kept.batch["x"].tolist() == [0, 2, 3]
    batch.batch["rollout_accepted"] = torch.zeros(6).bool()
    with pytest.raises(RuntimeError, match="rejected every sample"):
        drop_rejected_rows(batch, n=2)
    plain = DataProto.from_dict(tensors={"x": torch.arange(3)})
    assert drop_rejected_rows(plain, n=2) == (plain, {})


class TwoRows(RolloutWorkflow):
    async def arun_episode(self, engine, data):
        return DataProto.concat([data, data])


class UndeclaredKey(RLVRWorkflow):
    async def arun_episode(self, engine, data):
        row = await super().arun_episode(engine, data)
        row.batch["bonus"] = torch.zeros(1)
        return row


class DeclaredKeyNeverSet(RLVRWorkflow):  # the episode is rlvr's, which never sets the declared field
    extra_output_keys = {"bonus": "scalar"}


def test_bad_episode_outputs_fail_clearly(make_rollout, make_prompts, tokenizer):
    rollout = make_rollout(response_length=3)
    with pytest.raises(KeyError, match="extra_output_keys"):  # checked row by row, not built in one go
        rollout_batch(rollout, make_prompts(TEXTS[:2]), DeclaredKeyNeverSet(rollout.config, tokenizer))
    with pytest.raises(TypeError, match="one-row DataProto or None; row 0 gave 2 rows"):
        rollout_batch(rollout, make_prompts(TEXTS[:1]), TwoRows(rollout.config, tokenizer))
    with pytest.raises(KeyError, match="extra_output_keys"):
        rollout_batch(rollout, make_prompts(TEXTS[:1]), UndeclaredKey(rollout.config, tokenizer))
    with pytest.raises(ValueError, match="max_concurrent_episodes must be a positive int"):
        rollout_batch(rollout, make_prompts(TEXTS[:1]), RLVRWorkflow(rollout.config, tokenizer), max_concurrent=0)


def test_concurrency_cap_limits_episodes_in_flight(make_rollout, make_prompts, tokenizer):
    class Counting(RLVRWorkflow):
        running = peak = 0

        async def arun_episode(self, engine, data):
            Counting.running += 1
            Counting.peak = max(Counting.peak, Counting.running)
            await asyncio.sleep(0.01)
            try:
                return await super().arun_episode(engine, data)
            finally:
                Counting.running -= 1

    rollout = make_rollout(response_length=3)
    out, engine = run(rollout, make_prompts(TEXTS * 2), Counting(rollout.config, tokenizer), max_concurrent=3)
    assert len(out) == 8 and Counting.peak == 3
    assert engine.num_generate_calls >= 3  # 8 episodes, at most 3 requests per call
