"""Tests of the `hf` rollout engine (verl/workers/rollout/hf_rollout.py) and the shared post-processing (base.py)
on the tiny random Qwen2 model."""

import contextlib
import threading

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from verl.cpu import lean_decode
from verl.protocol import DataProto
from verl.utils.torch_functional import compute_position_id_with_mask
from verl.workers.rollout import get_rollout_class
from verl.workers.rollout.base import build_rollout_output, resolve_sampling
from verl.workers.rollout.hf_rollout import HFRollout

TEXTS = ["How many apples does Weng have?", "Hi", "Convert 5 dollars to euro please, now.", "What time is it"]
PROMPT_LEN = 16
RESPONSE_LEN = 6
UNUSED_EOS = 2047  # an id the random model practically never emits first; keeps responses full length


def rollout_config(**overrides):
    cfg = dict(
        name="hf", temperature=1.0, top_k=-1, top_p=1.0, do_sample=True, prompt_length=PROMPT_LEN,
        response_length=RESPONSE_LEN, micro_batch_size=None, calculate_log_probs=False, seed=0,
        val_kwargs=dict(n=1, do_sample=False, temperature=0, top_k=-1, top_p=1.0),
    )  # fmt: skip
    cfg.update(overrides)
    return OmegaConf.create(cfg)


def make_prompts(tokenizer, texts=TEXTS, prompt_len=PROMPT_LEN, **meta) -> DataProto:
    """Left-padded prompts built by hand (pad id on the left, mask 0 there)."""
    pad = tokenizer.pad_token_id
    ids = torch.full((len(texts), prompt_len), pad, dtype=torch.long)
    mask = torch.zeros((len(texts), prompt_len), dtype=torch.long)
    for i, text in enumerate(texts):
        tok = tokenizer(text)["input_ids"][:prompt_len]
        ids[i, prompt_len - len(tok) :] = torch.tensor(tok)
        mask[i, prompt_len - len(tok) :] = 1
    meta.setdefault("eos_token_id", UNUSED_EOS)
    meta.setdefault("pad_token_id", pad)
    return DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": mask, "position_ids": compute_position_id_with_mask(mask)},
        non_tensors={"uid": np.array([f"u{i}" for i in range(len(texts))], dtype=object)},
        meta_info=meta,
    )


def full_forward_log_probs(model, out: DataProto, temperature: float) -> torch.Tensor:
    """Independent reference: one forward over prompt+response, log_softmax(logits / T) of each response token."""
    with torch.no_grad():
        logits = model(
            input_ids=out.batch["input_ids"],
            attention_mask=out.batch["attention_mask"],
            position_ids=out.batch["position_ids"],
        ).logits
    resp = out.batch["responses"]
    logits = logits[:, -resp.shape[1] - 1 : -1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, resp.unsqueeze(-1)).squeeze(-1)


def test_registry_names_engines_and_rejects_unknown():
    assert get_rollout_class("hf") is HFRollout
    with pytest.raises(ValueError, match=r"'trtllm'.*\['hf', 'sglang', 'vllm'\]"):
        get_rollout_class("trtllm")


def test_build_rollout_output_masks_and_positions_by_hand():
    prompts = DataProto.from_dict(
        tensors={
            "input_ids": torch.tensor([[0, 0, 11, 12], [21, 22, 23, 24]]),
            "attention_mask": torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]),
            "position_ids": torch.tensor([[0, 0, 0, 1], [0, 1, 2, 3]]),
        },
        non_tensors={"data_source": np.array(["a", "b"], dtype=object)},
    )
    eos, pad = [7, 8], 0
    responses = torch.tensor([[5, 7, 6, 8, 9], [5, 6, 6, 6, 8]])
    lp = torch.full((2, 5), -1.0)
    out = build_rollout_output(prompts, responses, eos, pad, lp)
    assert out.batch["responses"].tolist() == [[5, 7, 0, 0, 0], [5, 6, 6, 6, 8]]
    assert out.batch["response_mask"].tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert out.batch["input_ids"].tolist() == [[0, 0, 11, 12, 5, 7, 0, 0, 0], [21, 22, 23, 24, 5, 6, 6, 6, 8]]
    assert out.batch["attention_mask"].tolist() == [[0, 0, 1, 1, 1, 1, 0, 0, 0], [1] * 9]
    assert out.batch["position_ids"].tolist() == [[0, 0, 0, 1, 2, 3, 4, 5, 6], list(range(9))]
    assert out.batch["prompts"].tolist() == prompts.batch["input_ids"].tolist()
    assert out.batch["rollout_log_probs"].tolist() == [[-1, -1, 0, 0, 0], [-1] * 5]
    assert out.non_tensor_batch["data_source"].tolist() == ["a", "b"]


def test_resolve_sampling_picks_val_kwargs_and_greedy():
    cfg = rollout_config(temperature=0.7, top_k=5, top_p=0.9)
    train = resolve_sampling(cfg, {})
    assert (train.do_sample, train.temperature, train.top_k, train.top_p) == (True, 0.7, 5, 0.9)
    assert not resolve_sampling(cfg, {"validate": True}).do_sample
    assert not resolve_sampling(rollout_config(temperature=0.0), {}).do_sample
    assert not resolve_sampling(cfg, {"do_sample": False}).do_sample
    with pytest.raises(ValueError, match="top_p"):
        resolve_sampling(rollout_config(top_p=1.5), {})


def test_same_seed_same_samples_other_seed_differs(model, tokenizer):
    rollout = HFRollout(model, rollout_config(), tokenizer)
    a = rollout.generate_sequences(make_prompts(tokenizer, seed=3))
    b = rollout.generate_sequences(make_prompts(tokenizer, seed=3))
    c = rollout.generate_sequences(make_prompts(tokenizer, seed=4))
    assert torch.equal(a.batch["responses"], b.batch["responses"])
    assert not torch.equal(a.batch["responses"], c.batch["responses"])
    # without a seed in meta_info each call draws config.seed + call counter: a fresh engine replays the sequence
    first = [
        HFRollout(model, rollout_config(), tokenizer).generate_sequences(make_prompts(tokenizer)) for _ in range(2)
    ]
    assert torch.equal(first[0].batch["responses"], first[1].batch["responses"])
    # and the global RNG is left as it was
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    rollout.generate_sequences(make_prompts(tokenizer, seed=3))
    assert torch.equal(torch.rand(3), expected)


def test_output_fields_and_non_tensor_pass_through(model, tokenizer):
    prompts = make_prompts(tokenizer, seed=0)
    out = HFRollout(model, rollout_config(), tokenizer).generate_sequences(prompts)
    bs = len(TEXTS)
    assert out.batch["responses"].shape == (bs, RESPONSE_LEN)
    assert out.batch["input_ids"].shape == (bs, PROMPT_LEN + RESPONSE_LEN)
    assert torch.equal(out.batch["input_ids"][:, :PROMPT_LEN], prompts.batch["input_ids"])
    assert torch.equal(out.batch["prompts"], prompts.batch["input_ids"])
    last = prompts.batch["position_ids"][:, -1:]
    assert torch.equal(out.batch["position_ids"][:, PROMPT_LEN:], last + torch.arange(1, RESPONSE_LEN + 1))
    assert out.non_tensor_batch["uid"].tolist() == ["u0", "u1", "u2", "u3"]


def test_greedy_batched_equals_each_prompt_alone(model, tokenizer):
    """Length-sorted micro-batches with stripped left padding give what each unpadded prompt gives alone."""
    cfg = rollout_config(micro_batch_size=3)
    batched = HFRollout(model, cfg, tokenizer).generate_sequences(make_prompts(tokenizer, validate=True))
    for i, text in enumerate(TEXTS):
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        alone = model.generate(ids, do_sample=False, max_new_tokens=RESPONSE_LEN, eos_token_id=UNUSED_EOS,
                               pad_token_id=tokenizer.pad_token_id, top_k=None)  # fmt: skip
        assert batched.batch["responses"][i].tolist() == alone[0, ids.shape[1] :].tolist()


def test_eos_stops_response_and_masks_after_it(model, tokenizer):
    rollout = HFRollout(model, rollout_config(), tokenizer)
    free = rollout.generate_sequences(make_prompts(tokenizer, texts=TEXTS[:1], seed=11))
    tokens = free.batch["responses"][0].tolist()
    k = next(i for i in range(2, RESPONSE_LEN) if tokens[i] not in tokens[:i])  # first new token from index 2 on
    eos = tokens[k]
    pad = tokenizer.pad_token_id
    # same seed: the same draws up to the eos, then the response stops
    out = rollout.generate_sequences(make_prompts(tokenizer, texts=TEXTS[:1], seed=11, eos_token_id=[eos, UNUSED_EOS]))
    expected = tokens[: k + 1] + [pad] * (RESPONSE_LEN - k - 1)
    assert out.batch["responses"][0].tolist() == expected
    assert out.batch["response_mask"][0].tolist() == [1] * (k + 1) + [0] * (RESPONSE_LEN - k - 1)
    assert out.batch["attention_mask"][0, PROMPT_LEN:].tolist() == out.batch["response_mask"][0].tolist()


def test_ignore_eos_runs_to_response_length_and_keeps_every_token(model, tokenizer):
    """verl's `rollout.ignore_eos`: the eos does not stop a row, and all generated tokens are in the response."""
    free = HFRollout(model, rollout_config(), tokenizer).generate_sequences(
        make_prompts(tokenizer, texts=TEXTS[:1], seed=11)
    )
    tokens = free.batch["responses"][0].tolist()
    eos = tokens[1]
    rollout = HFRollout(model, rollout_config(ignore_eos=True), tokenizer)
    out = rollout.generate_sequences(make_prompts(tokenizer, texts=TEXTS[:1], seed=11, eos_token_id=eos))
    assert out.batch["responses"][0].tolist() == tokens  # the same draws, not cut at the eos
    assert out.batch["response_mask"][0].tolist() == [1] * RESPONSE_LEN


def test_validate_is_greedy_whatever_the_seed(model, tokenizer):
    rollout = HFRollout(model, rollout_config(), tokenizer)
    a = rollout.generate_sequences(make_prompts(tokenizer, validate=True, seed=1))
    b = rollout.generate_sequences(make_prompts(tokenizer, validate=True, seed=2))
    assert torch.equal(a.batch["responses"], b.batch["responses"])
    top1 = HFRollout(model, rollout_config(top_k=1), tokenizer).generate_sequences(make_prompts(tokenizer, seed=5))
    assert torch.equal(top1.batch["responses"], a.batch["responses"])


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_rollout_log_probs_match_a_full_forward(model, tokenizer, temperature):
    cfg = rollout_config(calculate_log_probs=True, temperature=temperature, micro_batch_size=2)
    out = HFRollout(model, cfg, tokenizer).generate_sequences(make_prompts(tokenizer, seed=7))
    ref = full_forward_log_probs(model, out, temperature) * out.batch["response_mask"]
    torch.testing.assert_close(out.batch["rollout_log_probs"], ref, atol=1e-5, rtol=0)
    assert out.batch["rollout_log_probs"].abs().sum() > 0


def test_update_weights_changes_generation_and_checks_keys(model, tokenizer, tiny_model_dir):
    copy = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    rollout = HFRollout(copy, rollout_config(calculate_log_probs=True), tokenizer)
    other = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    rollout.update_weights(other.state_dict())
    for name, p in other.state_dict().items():
        assert torch.equal(copy.state_dict()[name], p), name
    out = rollout.generate_sequences(make_prompts(tokenizer, seed=0))
    ref = full_forward_log_probs(other, out, 1.0) * out.batch["response_mask"]
    torch.testing.assert_close(out.batch["rollout_log_probs"], ref, atol=1e-5, rtol=0)

    partial = {k: v for k, v in other.state_dict().items() if "layers.0.mlp" not in k}
    with pytest.raises(KeyError, match="misses"):
        rollout.update_weights(partial)
    with pytest.raises(KeyError, match="does not"):
        rollout.update_weights({**other.state_dict(), "extra.weight": torch.zeros(1)})


def test_bad_config_is_rejected(model):
    with pytest.raises(ValueError, match="response_length"):
        HFRollout(model, rollout_config(response_length=0))
    with pytest.raises(ValueError, match="micro_batch_size"):
        HFRollout(model, rollout_config(micro_batch_size=0))


@contextlib.contextmanager
def recorded_forwards(model):
    """Within the block, every forward of `model` as (thread name, rows, sequence length): its own forward calls
    (the prefill, and each decode step under HF's forward) and the lean decoder's steps (`lean_decode.py`, one
    token per row)."""
    calls = []
    handle = model.register_forward_pre_hook(
        lambda _m, _args, kwargs: calls.append((threading.current_thread().name, *kwargs["input_ids"].shape)),
        with_kwargs=True,
    )
    step = lean_decode.LeanDecoder.step

    def recorded_step(self, tokens, *args):
        calls.append((threading.current_thread().name, len(tokens), 1))
        return step(self, tokens, *args)

    lean_decode.LeanDecoder.step = recorded_step
    try:
        yield calls
    finally:
        lean_decode.LeanDecoder.step = step
        handle.remove()


def test_repeated_prompts_are_prefilled_once_and_match_a_full_forward(model, tokenizer):
    """rollout.n copies of a prompt share one prefill; their samples and log-probs are those of a full forward."""
    prompts = make_prompts(tokenizer, seed=7).repeat(3, interleave=True)
    with recorded_forwards(model) as calls:
        out = HFRollout(model, rollout_config(calculate_log_probs=True), tokenizer).generate_sequences(prompts)
    calls = [(rows, length) for _, rows, length in calls]
    longest = max(len(tokenizer(t)["input_ids"]) for t in TEXTS)
    assert calls[0] == (len(TEXTS), longest)  # one prefill row per distinct prompt, common left padding cut
    assert all(shape == (3 * len(TEXTS), 1) for shape in calls[1:])  # decode steps on all 12 rows
    assert len(calls) == RESPONSE_LEN  # the last sampled token needs no forward
    ref = full_forward_log_probs(model, out, 1.0) * out.batch["response_mask"]
    torch.testing.assert_close(out.batch["rollout_log_probs"], ref, atol=1e-5, rtol=0)
    responses = out.batch["responses"].view(len(TEXTS), 3, RESPONSE_LEN)
    assert any(not torch.equal(r[0], r[1]) for r in responses)  # copies draw their own samples

    greedy = HFRollout(model, rollout_config(), tokenizer).generate_sequences(
        make_prompts(tokenizer, validate=True).repeat(2, interleave=True)
    )
    for i, text in enumerate(TEXTS):
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        alone = model.generate(ids, do_sample=False, max_new_tokens=RESPONSE_LEN, eos_token_id=UNUSED_EOS,
                               pad_token_id=tokenizer.pad_token_id, top_k=None)  # fmt: skip
        for copy in (2 * i, 2 * i + 1):
            assert greedy.batch["responses"][copy].tolist() == alone[0, ids.shape[1] :].tolist()


def test_finished_rows_leave_the_batch(model, tokenizer):
    """A row that emitted an eos costs no further forward rows; its response stops at the eos."""
    rollout = HFRollout(model, rollout_config(), tokenizer)
    free = rollout.generate_sequences(make_prompts(tokenizer, validate=True))
    eos = int(free.batch["responses"][0, 1])  # greedy row 0 emits this token at step 1
    with recorded_forwards(model) as calls:
        out = rollout.generate_sequences(make_prompts(tokenizer, validate=True, eos_token_id=[eos, UNUSED_EOS]))
    ended = [i for i in range(len(TEXTS)) if eos in free.batch["responses"][i].tolist()]
    assert 0 in ended
    batch_sizes = [rows for _, rows, _ in calls]
    assert batch_sizes[0] == len(TEXTS) and batch_sizes[-1] < len(TEXTS)  # the batch shrinks
    first_eos = [free.batch["responses"][i].tolist().index(eos) for i in ended]
    # decode forwards: a row whose first eos is token f feeds tokens 0..f-1 only; the others feed R-1 tokens
    expected_rows = sum(min(RESPONSE_LEN - 1, f) for f in first_eos) + (len(TEXTS) - len(ended)) * (RESPONSE_LEN - 1)
    assert sum(batch_sizes[1:]) == expected_rows
    f = first_eos[0]
    assert out.batch["response_mask"][0].tolist() == [1] * (f + 1) + [0] * (RESPONSE_LEN - f - 1)
    assert out.batch["responses"][0].tolist() == free.batch["responses"][0, : f + 1].tolist() + [
        tokenizer.pad_token_id
    ] * (RESPONSE_LEN - f - 1)


def test_decode_products_go_through_openblas_where_the_worker_chose_it(model, tokenizer, monkeypatch):
    """With `cpu_blas` prepared (the worker's choice on AMD CPUs), a CPU generation's products of at least MIN_ROWS
    rows run through OpenBLAS and give the samples torch's kernels give (the rounding differs, not enough to move a
    token of the tiny model here); after the call torch's kernels are back."""
    from verl.cpu import blas as cpu_blas

    prompts = make_prompts(tokenizer).repeat(64)  # 128 rows
    baseline = HFRollout(model, rollout_config(), tokenizer).generate_sequences(prompts)
    try:
        if not cpu_blas.prepare("openblas"):
            pytest.skip("OpenBLAS not chosen here")
    except RuntimeError as e:
        pytest.skip(str(e))
    monkeypatch.setattr(cpu_blas, "MIN_FLOPS", 1 << 12)  # the tiny model's products are small
    rows, real = [], cpu_blas._gemm
    monkeypatch.setattr(cpu_blas, "_gemm", lambda *args: rows.append(args[0].shape[0]) or real(*args))
    try:
        out = HFRollout(model, rollout_config(), tokenizer).generate_sequences(prompts)
    finally:
        cpu_blas.prepare("torch")
    assert rows and min(rows) >= cpu_blas.MIN_ROWS
    assert not cpu_blas.active()
    assert torch.equal(out.batch["responses"], baseline.batch["responses"])
