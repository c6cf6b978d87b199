"""Fixtures of the rollout-workflow tests: the tiny model, its tokenizer, an `hf` engine factory and prompts."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl.protocol import DataProto
from verl.utils.torch_functional import compute_position_id_with_mask
from verl.workers.rollout.hf_rollout import HFRollout

PROMPT_LEN = 16


def rollout_config(**overrides):
    cfg = dict(
        name="hf", temperature=1.0, top_k=-1, top_p=1.0, do_sample=True, prompt_length=PROMPT_LEN,
        response_length=8, micro_batch_size=None, calculate_log_probs=False, seed=0, workflow="rlvr",
        workflow_kwargs={}, max_concurrent_episodes=None, agenerate_window_ms=5, agenerate_max_batch_size=None,
        multi_turn=dict(max_turns=4, tool_modules=[], tools=None, tool_timeout_s=5, max_tool_response_length=200),
        val_kwargs=dict(n=1, do_sample=False, temperature=0, top_k=-1, top_p=1.0),
    )  # fmt: skip
    for key, value in overrides.items():
        cfg[key] = value
    return OmegaConf.create(cfg)


@pytest.fixture
def make_rollout(model, tokenizer):
    def make(**overrides) -> HFRollout:
        return HFRollout(model, rollout_config(**overrides), tokenizer)

    return make


def _make_prompts(tokenizer, texts, prompt_len=PROMPT_LEN, non_tensors=None, **meta) -> DataProto:
    """Left-padded prompts (as the dataset makes them) with `uid`s and the trainer's generation meta_info."""
    pad = tokenizer.pad_token_id
    ids = torch.full((len(texts), prompt_len), pad, dtype=torch.long)
    mask = torch.zeros((len(texts), prompt_len), dtype=torch.long)
    for i, text in enumerate(texts):
        tok = tokenizer(text, add_special_tokens=False)["input_ids"][-prompt_len:]
        ids[i, prompt_len - len(tok) :] = torch.tensor(tok)
        mask[i, prompt_len - len(tok) :] = 1
    meta = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": pad, "seed": 3, "validate": False, **meta}
    non_tensors = {"uid": np.array([f"u{i}" for i in range(len(texts))], dtype=object), **(non_tensors or {})}
    return DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": mask, "position_ids": compute_position_id_with_mask(mask)},
        non_tensors=non_tensors,
        meta_info=meta,
    )


@pytest.fixture
def make_prompts(tokenizer):
    """make_prompts(texts, prompt_len=16, non_tensors=None, **meta) -> DataProto."""
    return lambda texts, **kwargs: _make_prompts(tokenizer, texts, **kwargs)


@pytest.fixture
def make_config():
    """make_config(**overrides) -> the rollout config section the tests use."""
    return rollout_config


# ----------------------------------------------------------------------------------------------- scripted model
# A tiny model trained (in the fixture, ~100 Adam steps) to write exactly these model turns, so a multi-turn
# episode and an environment rollout can be checked token for token on a real model. Odd segments are the
# model's turns (trained), even ones the prompt and the observations the workflow inserts (not trained).
TOOL_QUESTION = "Divide 6 by 3."
TOOL_TRANSCRIPT = [
    '<tool_call>{"name": "div", "arguments": {"a": 1, "b": 0}}</tool_call>',
    "\n<obs> error: tool 'div' raised ZeroDivisionError: division by zero </obs>\n",
    '<tool_call>{"name": "div",}</tool_call>',
    "\n<obs> error: the tool call is not valid JSON (Expecting property name enclosed in double quotes at column "
    '16): "{\\"name\\": \\"div\\",}" </obs>\n',
    '<tool_call>{"name": "div", "arguments": {"a": 6, "b": 3}}</tool_call>',
    "\n<obs> 2.0 </obs>\n",
    "<response> 2 </response><|im_end|>",
]
GSM8K_QUESTION = "Janet has 16 eggs and eats 3. How many are left?"
GSM8K_ANSWER = "16 - 3 = 13\n#### 13<|im_end|>"


def chat_prompt(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)  # fmt: skip


@pytest.fixture(scope="session")
def scripted_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model fine-tuned until it writes TOOL_TRANSCRIPT's model turns and GSM8K_ANSWER greedily."""
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    segment_lists = [[chat_prompt(tokenizer, TOOL_QUESTION), *TOOL_TRANSCRIPT],
                     [chat_prompt(tokenizer, GSM8K_QUESTION), GSM8K_ANSWER]]  # fmt: skip
    rows = []
    for segments in segment_lists:
        ids, trained = [], []
        for k, text in enumerate(segments):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += piece
            trained += [k % 2 == 1] * len(piece)
        rows.append((ids, trained))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    for i, (ids, trained) in enumerate(rows):
        input_ids[i, : len(ids)], attention[i, : len(ids)] = torch.tensor(ids), 1
        labels[i, : len(ids)] = torch.where(torch.tensor(trained), torch.tensor(ids), -100)
    optimizer = torch.optim.Adam(model.parameters(), lr=4e-3)
    for _ in range(200):
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.01:
            break
    out = tmp_path_factory.mktemp("scripted_model")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def script():
    """The texts the scripted model was trained on."""
    return {"tool_question": TOOL_QUESTION, "tool_transcript": TOOL_TRANSCRIPT, "gsm8k_question": GSM8K_QUESTION,
            "gsm8k_answer": GSM8K_ANSWER, "chat_prompt": chat_prompt}  # fmt: skip
