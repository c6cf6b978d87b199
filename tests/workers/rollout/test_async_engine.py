"""Tests of the request-level engine API (verl/workers/rollout/async_engine.py) on the tiny Qwen2 model:
concurrent `agenerate` calls are batched into few generate calls and forward passes, each response equals an
independent reference (the engine's own batched call, a full forward for log-probs, HF greedy decoding), and
budgets, stop strings and bad requests behave as documented."""

import asyncio

import pytest
import torch

from verl.workers.rollout.async_engine import (
    AsyncRolloutEngine,
    GenerationHyperparameters,
    ModelRequest,
    agenerate_samples,
    first_stop_position,
)

TEXTS = ["How many apples?", "Hi", "Convert 5 dollars to euro please", "What time is it", "Send an email to ben",
         "Weather in Paris", "Find flights", "Remind me"]  # fmt: skip


def prompt_ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class ForwardCounter:
    """Counts forward passes of a module (each decoding step of `generate` is one)."""

    def __init__(self, module):
        self.count = 0
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.count += 1

    def close(self):
        self.handle.remove()


def test_concurrent_requests_share_one_generate_call(make_rollout, make_prompts, tokenizer, model):
    rollout = make_rollout(response_length=6)
    meta = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, "seed": 11}
    engine = AsyncRolloutEngine(rollout, meta)
    requests = [ModelRequest(prompt_ids(tokenizer, t), engine.default_gconfig()) for t in TEXTS]

    async def concurrent():
        return await asyncio.gather(*(engine.agenerate(r) for r in requests))

    counter = ForwardCounter(model)
    try:
        responses = asyncio.run(concurrent())
        batched_forwards = counter.count
        counter.count = 0
        sequential = AsyncRolloutEngine(rollout, meta)

        async def one_by_one():
            return [await sequential.agenerate(r) for r in requests]

        asyncio.run(one_by_one())
        sequential_forwards = counter.count
    finally:
        counter.close()
    n = len(TEXTS)
    assert engine.num_requests == n and engine.num_generate_calls == 1
    assert sequential.num_generate_calls == n
    assert batched_forwards <= 6  # one batched decode of at most response_length steps
    assert sequential_forwards >= n and batched_forwards < sequential_forwards / 4

    # independent reference: the engine's own batched call on the same prompts with the same seed
    reference = rollout.generate_sequences(make_prompts(TEXTS, seed=11, calculate_log_probs=True))
    for i, resp in enumerate(responses):
        length = int(reference.batch["response_mask"][i].sum())
        assert resp.output_tokens == reference.batch["responses"][i, :length].tolist()
        assert resp.input_tokens == requests[i].input_ids and resp.rid == requests[i].rid
        assert torch.allclose(torch.tensor(resp.output_logprobs), reference.batch["rollout_log_probs"][i, :length])
        assert resp.output_versions == [0] * length
        assert resp.stop_reason == ("stop" if resp.output_tokens[-1] == tokenizer.eos_token_id else "length")


def test_log_probs_match_a_full_forward(make_rollout, tokenizer, model):
    engine = AsyncRolloutEngine(make_rollout(response_length=5), {"seed": 2})
    gconfig = GenerationHyperparameters(max_new_tokens=5, temperature=0.7)
    resp = asyncio.run(engine.agenerate(ModelRequest(prompt_ids(tokenizer, "Hi there"), gconfig)))
    ids = torch.tensor([resp.input_tokens + resp.output_tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(resp.input_tokens) - 1 : -1] / 0.7
    expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(resp.output_tokens)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(resp.output_logprobs), expected, atol=1e-4)


def test_greedy_and_sampled_requests_are_grouped_and_greedy_matches_hf(make_rollout, tokenizer, model):
    engine = AsyncRolloutEngine(make_rollout(response_length=6), {"seed": 4})
    base = engine.default_gconfig()
    ids = prompt_ids(tokenizer, "Weather in Paris")

    async def run():
        return await asyncio.gather(
            engine.agenerate(ModelRequest(ids, base)),
            engine.agenerate(ModelRequest(ids, base.new(greedy=True))),
            engine.agenerate(ModelRequest(ids, base)),
        )

    _, greedy, _ = asyncio.run(run())
    assert engine.num_generate_calls == 2  # one per sampling setting
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=6,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    expected = out[0, len(ids) :].tolist()
    if tokenizer.eos_token_id in expected:
        expected = expected[: expected.index(tokenizer.eos_token_id) + 1]
    assert greedy.output_tokens == expected


def test_budget_and_stop_strings_cut_the_output(make_rollout, tokenizer):
    engine = AsyncRolloutEngine(make_rollout(response_length=8, do_sample=False), {})
    ids = prompt_ids(tokenizer, "Convert 5 dollars")
    full = asyncio.run(engine.agenerate(ModelRequest(ids, engine.default_gconfig())))
    short = asyncio.run(engine.agenerate(ModelRequest(ids, engine.default_gconfig().new(max_new_tokens=3))))
    assert short.output_tokens == full.output_tokens[:3] and short.stop_reason == "length"
    assert len(short.output_logprobs) == len(short.output_versions) == 3

    # a stop string: the text of tokens 2..3 of the greedy output; the output ends where it first appears
    stop = tokenizer.decode(full.output_tokens[2:4])
    cut = asyncio.run(engine.agenerate(ModelRequest(ids, engine.default_gconfig().new(stop=[stop]))))
    text = tokenizer.decode(cut.output_tokens)
    assert stop in text and stop not in tokenizer.decode(cut.output_tokens[:-1])
    assert full.output_tokens[: len(cut.output_tokens)] == cut.output_tokens and cut.stop_reason == "stop"
    assert first_stop_position(tokenizer, full.output_tokens, (stop,)) == len(cut.output_tokens)
    assert first_stop_position(tokenizer, full.output_tokens, ("no such text",)) is None


def test_max_batch_size_caps_a_flush_and_samples_share_a_call(make_rollout, tokenizer):
    engine = AsyncRolloutEngine(make_rollout(response_length=3), {}, max_batch_size=2)
    requests = [ModelRequest(prompt_ids(tokenizer, t), engine.default_gconfig()) for t in TEXTS[:5]]

    async def run():
        return await asyncio.gather(*(engine.agenerate(r) for r in requests))

    assert len(asyncio.run(run())) == 5 and engine.num_generate_calls == 3

    engine = AsyncRolloutEngine(make_rollout(response_length=3), {})
    request = ModelRequest(prompt_ids(tokenizer, "Hi"), engine.default_gconfig().new(n_samples=3))
    samples = asyncio.run(agenerate_samples(engine, request))
    assert len(samples) == 3 and engine.num_generate_calls == 1
    assert len({s.rid for s in samples}) == 3


def test_every_engine_offers_agenerate(make_rollout, tokenizer):
    rollout = make_rollout(response_length=4)

    async def run():
        gconfig = GenerationHyperparameters(max_new_tokens=4)
        return await asyncio.gather(
            *(rollout.agenerate(ModelRequest(prompt_ids(tokenizer, t), gconfig)) for t in TEXTS[:4])
        )

    responses = asyncio.run(run())
    assert all(1 <= r.output_len <= 4 for r in responses)
    assert rollout._async_engine.num_generate_calls == 1


def test_bad_requests_fail_with_a_clear_message(make_rollout, tokenizer):
    engine = AsyncRolloutEngine(make_rollout(response_length=4), {})
    ids = prompt_ids(tokenizer, "Hi")
    with pytest.raises(ValueError, match="n_samples=2.*agenerate_samples"):
        asyncio.run(engine.agenerate(ModelRequest(ids, GenerationHyperparameters(n_samples=2, max_new_tokens=4))))
    with pytest.raises(ValueError, match="max_new_tokens=9 exceeds.*response_length=4"):
        asyncio.run(engine.agenerate(ModelRequest(ids, GenerationHyperparameters(max_new_tokens=9))))
    with pytest.raises(ValueError, match="input_ids is empty"):
        asyncio.run(engine.agenerate(ModelRequest([], GenerationHyperparameters(max_new_tokens=4))))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        GenerationHyperparameters(temperature=0.0)
    with pytest.raises(ValueError, match="top_p must be in"):
        GenerationHyperparameters(top_p=1.5)
