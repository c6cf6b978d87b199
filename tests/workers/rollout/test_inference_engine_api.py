"""AReaL-lite's start-up and request inputs on the inference engine (verl/workers/rollout/async_engine.py), on the
tiny Qwen2: `ModelRequest` takes what `apply_chat_template(tokenize=True)` returns (a BatchEncoding), a dict with
input_ids, a tensor or a tuple as the same list of ints and generates the same tokens from it; anything else is a
TypeError at construction; `initialize(None, ft_spec)` is accepted, a server address refused; `.device` is the
model's."""

import asyncio
import re

import numpy as np
import pytest
import torch

from verl.workers.engine import FinetuneSpec
from verl.workers.rollout.async_engine import AsyncRolloutEngine, GenerationHyperparameters, ModelRequest

MESSAGES = [{"role": "user", "content": "How many apples are there?"}]


def test_every_token_id_form_becomes_the_same_request_and_the_same_output(make_rollout, tokenizer):
    encoding = tokenizer.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=True)
    ids = list(encoding["input_ids"])
    assert not isinstance(encoding, list) and ids and all(isinstance(t, int) for t in ids)
    forms = [encoding, {"input_ids": ids}, tuple(ids), torch.tensor(ids), torch.tensor([ids]), np.array(ids),
             [np.int64(t) for t in ids]]  # fmt: skip
    for form in forms:
        request = ModelRequest(form)
        assert request.input_ids == ids and all(type(t) is int for t in request.input_ids), type(form)
    engine = AsyncRolloutEngine(make_rollout(response_length=6), {})
    greedy = GenerationHyperparameters(greedy=True, max_new_tokens=6)

    async def generate_all():
        return await asyncio.gather(*(engine.agenerate(ModelRequest(form, greedy)) for form in forms))

    responses = asyncio.run(generate_all())
    assert all(resp.input_tokens == ids for resp in responses)
    assert all(resp.output_tokens == responses[0].output_tokens for resp in responses) and responses[0].output_len


@pytest.mark.parametrize(
    "bad, shown",
    [("How many apples?", "str 'How many apples?'"), (torch.tensor([[1, 2], [3, 4]]), "Tensor"),
     (torch.tensor([1.0, 2.0]), "Tensor"), ([1, "2"], "list"), ([True, False], "list"), (7, "int 7"),
     ({"text": "hi"}, "dict"), (None, "NoneType")],
)  # fmt: skip
def test_anything_else_is_a_type_error_at_construction(bad, shown):
    with pytest.raises(TypeError, match=r"input_ids takes token ids: .*BatchEncoding.*; got " + re.escape(shown)):
        ModelRequest(bad)


def test_initialize_in_process_and_device(make_rollout, model):
    engine = AsyncRolloutEngine(make_rollout(), {})
    assert engine.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=4, train_batch_size=2)) is None
    engine.initialize()
    with pytest.raises(ValueError, match=r"initialize\(addr='10.0.0.1:30000'\): this engine generates in this process"):
        engine.initialize("10.0.0.1:30000")
    assert engine.device == next(model.parameters()).device == torch.device("cpu")
