"""Tests of the in-process OpenAI-compatible client (verl/envs/openai_client.py) over the tiny model's `hf`
engine: response shapes, sampling arguments, the recorded token ids and log-probs, and multi-turn chat
conversations joined into one training trajectory on the token level."""

import asyncio

import pytest
import torch

from verl.envs.openai_client import OpenAIClient
from verl.workers.rollout.async_engine import get_async_engine

MESSAGES = [{"role": "user", "content": "Hello there"}]


def create(client, **kwargs):
    return asyncio.run(client.chat.completions.create(model="policy", **kwargs))


def test_chat_completion_shape_and_records(engine, tokenizer, model):
    client = OpenAIClient(engine)
    response = create(client, messages=MESSAGES, temperature=0, max_tokens=6, logprobs=True)
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    choice = response.choices[0]
    assert (
        response.object == "chat.completion" and response.model == "policy" and response.prompt_token_ids == prompt_ids
    )
    with torch.no_grad():  # independent reference: HF greedy decoding
        out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=6,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    assert choice.token_ids == out[0, len(prompt_ids) :].tolist()
    assert choice.message.role == "assistant" and choice.message.content == tokenizer.decode(
        choice.token_ids, skip_special_tokens=True
    )
    assert choice.finish_reason == "length" and response.usage.completion_tokens == 6
    assert response.usage.total_tokens == len(prompt_ids) + 6
    record = client.records[-1]
    assert record.prompt_ids == prompt_ids and record.completion_ids == choice.token_ids
    assert [e["logprob"] for e in choice.logprobs["content"]] == record.logprobs and len(record.logprobs) == 6
    assert all(lp < 0 for lp in record.logprobs) and record.versions == [0] * 6
    assert response.model_dump()["choices"][0]["message"]["content"] == choice.message.content


def test_n_choices_share_one_generate_call_and_sampling_args(engine, tokenizer):
    client = OpenAIClient(engine)
    response = create(client, messages=MESSAGES, n=3, temperature=0.8, top_p=0.9, max_completion_tokens=4,
                      extra_body={"top_k": 20}, seed=7)  # fmt: skip
    assert [c.index for c in response.choices] == [0, 1, 2] and len(client.records) == 3
    assert get_async_engine(engine).num_generate_calls == 1
    assert all(len(c.token_ids) <= 4 for c in response.choices)
    greedy = create(client, messages=MESSAGES, temperature=0, max_tokens=3).choices[0]
    stop_text = tokenizer.decode(greedy.token_ids[1:3])
    cut = create(client, messages=MESSAGES, temperature=0, max_tokens=12, stop=stop_text).choices[0]
    assert cut.finish_reason == "stop" and stop_text in cut.message.content and len(cut.token_ids) <= 3


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"stream": True}, ValueError, "stream=True is not supported"),
        ({"frequency_penalty": 0.5}, ValueError, "frequency_penalty=0.5 is not supported"),
        ({"best_of": 2}, TypeError, r"unsupported arguments \['best_of'\]"),
        ({"max_tokens": 99}, ValueError, "max_new_tokens=99 exceeds the engine's rollout.response_length=12"),
        ({"temperature": -1}, ValueError, "temperature must be >= 0"),
        ({"n": 0}, ValueError, "n must be >= 1"),
    ],
)
def test_bad_arguments(engine, kwargs, error, match):
    with pytest.raises(error, match=match):
        create(OpenAIClient(engine), messages=MESSAGES, **kwargs)


def test_bad_messages(engine):
    with pytest.raises(ValueError, match="messages must be a non-empty list"):
        create(OpenAIClient(engine), messages=[])


def test_multi_turn_chat_is_one_token_trajectory(engine, tokenizer):
    client = OpenAIClient(engine)
    first = create(client, messages=MESSAGES, temperature=0, max_tokens=5)
    history = MESSAGES + [{"role": "assistant", "content": first.choices[0].message.content},
                          {"role": "user", "content": "And tomorrow?"}]  # fmt: skip
    second = create(client, messages=history, temperature=0, max_tokens=5)
    one, two = client.records
    assert two.parent == 0 and two.prompt_ids[: len(one.prompt_ids) + 5] == one.prompt_ids + one.completion_ids
    # the new tokens are the rendered text the first turn did not cover
    rendered = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(two.prompt_ids, skip_special_tokens=False) == rendered
    trajectory = client.trajectory()
    assert trajectory.num_completions == 2 and trajectory.prompt_ids == one.prompt_ids
    assert trajectory.response_ids == two.prompt_ids[len(one.prompt_ids) :] + second.choices[0].token_ids
    between = len(two.prompt_ids) - len(one.prompt_ids) - 5
    assert trajectory.loss_mask == [1] * 5 + [0] * between + [1] * len(second.choices[0].token_ids)
    assert trajectory.logprobs[5 : 5 + between] == [0.0] * between and trajectory.logprobs[:5] == one.logprobs

    # a conversation that does not extend a recorded one starts a new chain
    create(client, messages=[{"role": "system", "content": "Be brief."}] + MESSAGES, temperature=0, max_tokens=2)
    assert client.records[-1].parent is None and client.trajectory().num_completions == 1
    assert client.trajectory(1).num_completions == 2


def test_text_completions(engine, tokenizer):
    client = OpenAIClient(engine)
    ids = tokenizer("Hello", add_special_tokens=False)["input_ids"]
    from_text = asyncio.run(
        client.completions.create(model="m", prompt="Hello", temperature=0, max_tokens=4, logprobs=1)
    )
    from_ids = asyncio.run(client.completions.create(model="m", prompt=ids, temperature=0, max_tokens=4))
    assert from_text.prompt_token_ids == ids and from_text.object == "text_completion"
    assert from_text.choices[0].token_ids == from_ids.choices[0].token_ids
    assert from_text.choices[0].text == tokenizer.decode(from_ids.choices[0].token_ids, skip_special_tokens=True)
    assert from_text.choices[0].logprobs["token_logprobs"] == client.records[0].logprobs
    with pytest.raises(ValueError, match="prompt must be a string"):
        asyncio.run(client.completions.create(model="m", prompt=3))
