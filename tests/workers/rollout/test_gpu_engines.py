"""Tests of verl/workers/rollout/gpu_engines.py: what the vllm and sglang engines share.

Request preparation (left-padded batch -> unpadded token-id prompts, stop ids, seeds, log-prob switch), output
assembly (generated ids + sampled log-probs -> the PPO batch) and weight buckets by size, on plain tensors; no engine
package is needed.
"""

import pytest
import torch
from omegaconf import OmegaConf

from verl.protocol import DataProto
from verl.utils.torch_functional import compute_position_id_with_mask
from verl.workers.rollout.gpu_engines import (
    assemble_output,
    engine_kwargs_section,
    import_gpu_engine,
    max_model_len,
    prepare_requests,
    weight_buckets_by_size,
)

EOS, PAD = 2, 0


def config(**overrides):
    cfg = dict(
        temperature=0.7, top_k=5, top_p=0.9, do_sample=True, prompt_length=4, response_length=5,
        calculate_log_probs=False, seed=3, val_kwargs=dict(do_sample=False, temperature=0, top_k=-1, top_p=1.0),
    )  # fmt: skip
    cfg.update(overrides)
    return OmegaConf.create(cfg)


def prompts(**meta) -> DataProto:
    ids = torch.tensor([[PAD, PAD, 7, 8], [9, 10, 11, 12]])
    mask = (ids != PAD).long()
    meta = {"eos_token_id": EOS, "pad_token_id": PAD, **meta}
    return DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": mask, "position_ids": compute_position_id_with_mask(mask)},
        meta_info=meta,
    )


def test_prepare_requests_unpads_prompts_and_resolves_the_settings():
    req = prepare_requests(config(), prompts(), tokenizer=None, call_index=0)
    assert req.prompt_ids == [[7, 8], [9, 10, 11, 12]]
    assert (req.sampling.do_sample, req.sampling.temperature, req.sampling.top_k) == (True, 0.7, 5)
    assert req.stop_token_ids == [EOS] and req.eos_token_id == EOS and req.pad_token_id == PAD
    assert req.want_log_probs is False and req.ignore_eos is False
    assert prepare_requests(config(), prompts(), None, 1).seed != req.seed  # a new seed per call
    assert (
        prepare_requests(config(), prompts(seed=11), None, 0).seed
        == prepare_requests(config(), prompts(seed=11), None, 5).seed
    )

    val = prepare_requests(config(ignore_eos=True), prompts(validate=True, calculate_log_probs=True), None, 0)
    assert val.sampling.do_sample is False and val.want_log_probs is True
    assert val.stop_token_ids == [] and val.ignore_eos is True
    multi = prepare_requests(config(), prompts(eos_token_id=[EOS, 5]), None, 0)
    assert multi.stop_token_ids == [EOS, 5]


def test_assemble_output_pads_masks_and_places_log_probs():
    req = prepare_requests(config(), prompts(calculate_log_probs=True), None, 0)
    generated = [[20, EOS], [21, 22, 23, 24, 25, 26]]  # row 1 runs past response_length (cut)
    log_probs = [[-0.1, -0.2], [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0]]
    out = assemble_output(prompts(), req, generated, log_probs, response_length=5)
    assert out.batch["responses"].tolist() == [[20, EOS, PAD, PAD, PAD], [21, 22, 23, 24, 25]]
    assert out.batch["response_mask"].tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    torch.testing.assert_close(
        out.batch["rollout_log_probs"], torch.tensor([[-0.1, -0.2, 0, 0, 0], [-1.0, -2.0, -3.0, -4.0, -5.0]])
    )
    assert out.batch["input_ids"].shape == (2, 9) and out.batch["position_ids"][0, -5:].tolist() == [2, 3, 4, 5, 6]

    no_lp = assemble_output(prompts(), prepare_requests(config(), prompts(), None, 0), generated, None, 5)
    assert "rollout_log_probs" not in no_lp.batch.keys()
    with pytest.raises(ValueError, match="returned none"):
        assemble_output(prompts(), req, generated, None, 5)
    # ignore_eos (every row runs to response_length): an eos in the middle does not end the response
    ignoring = prepare_requests(config(ignore_eos=True), prompts(), None, 0)
    out = assemble_output(prompts(), ignoring, [[EOS, 30, 31, 32, 33], [34, 35, EOS, EOS, 36]], None, 5)
    assert out.batch["response_mask"].tolist() == [[1] * 5, [1] * 5]
    assert out.batch["responses"].tolist() == [[EOS, 30, 31, 32, 33], [34, 35, EOS, EOS, 36]]


def test_config_helpers():
    cfg = config(engine_kwargs={"vllm": {"swap_space": 4, "quantization": None}})
    assert engine_kwargs_section(cfg, "vllm") == {"swap_space": 4}
    assert engine_kwargs_section(cfg, "sglang") == {} and engine_kwargs_section(config(), "vllm") == {}
    assert max_model_len(config()) == 9 and max_model_len(config(max_model_len=100)) == 100


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU failure message")
def test_import_gpu_engine_names_the_cpu_engine():
    with pytest.raises(RuntimeError, match=r"'sglang' needs a CUDA GPU.*rollout\.name=hf"):
        import_gpu_engine("sglang", "sglang", "pip install sglang")


# ---------------------------------------------------------------------------------------------- buckets
def tensors():
    """name -> tensor of 400 B (fp32, 100 elements), 800 B, 1600 B, 40 B and an int64 buffer of 80 B."""
    return {
        "a": torch.ones(100),
        "b": torch.ones(200),
        "c": torch.ones(400),
        "d": torch.ones(10),
        "steps": torch.arange(10),
    }


def names(buckets):
    return [[name for name, _ in bucket] for bucket in buckets]


def nbytes(bucket):
    return sum(t.numel() * t.element_size() for _, t in bucket)


def test_buckets_group_pairs_in_order_up_to_the_size():
    got = list(weight_buckets_by_size(iter(tensors().items()), max_bytes=1200))
    assert names(got) == [["a", "b"], ["c"], ["d", "steps"]]  # c alone: 1200 + 1600 > 1200 and 1600 > 1200
    assert all(nbytes(b) <= 1200 or len(b) == 1 for b in got)
    assert names(weight_buckets_by_size(tensors(), max_bytes=1200)) == names(got)  # a state dict: the same
    assert names(weight_buckets_by_size(tensors(), max_bytes=1)) == [[n] for n in tensors()]  # every tensor alone
    assert names(weight_buckets_by_size(tensors(), max_bytes=1 << 30)) == [list(tensors())]  # one bucket
    for bucket in weight_buckets_by_size(tensors(), 1200):
        for name, tensor in bucket:
            assert torch.equal(tensor, tensors()[name])


def test_buckets_cast_floating_tensors_and_size_them_in_the_engine_dtype():
    got = list(weight_buckets_by_size(tensors(), max_bytes=1200, dtype=torch.bfloat16))
    assert names(got) == [["a", "b"], ["c", "d", "steps"]]  # bf16: 200 + 400, then 800 + 20 + 80
    dtypes = {name: t.dtype for bucket in got for name, t in bucket}
    assert dtypes == {"a": torch.bfloat16, "b": torch.bfloat16, "c": torch.bfloat16, "d": torch.bfloat16,
                      "steps": torch.int64}  # fmt: skip


def test_buckets_already_made_pass_through_and_pairs_before_them_are_flushed():
    t = tensors()
    stream = [("a", t["a"]), [("b", t["b"]), ("c", t["c"])], ("d", t["d"])]
    got = list(weight_buckets_by_size(iter(stream), max_bytes=1 << 30, dtype=torch.bfloat16))
    assert names(got) == [["a"], ["b", "c"], ["d"]]  # the sender's buckets are kept as they are
    assert all(tensor.dtype == torch.bfloat16 for bucket in got for _, tensor in bucket)


def test_buckets_are_read_lazily():
    read = []

    def stream():
        for name, tensor in tensors().items():
            read.append(name)
            yield name, tensor

    buckets = weight_buckets_by_size(stream(), max_bytes=1200)
    assert names([next(buckets)]) == [["a", "b"]] and read == ["a", "b", "c"]  # c opened the next bucket
    assert names(buckets) == [["c"], ["d", "steps"]] and read == list(tensors())
    with pytest.raises(ValueError, match="max_bytes must be > 0, got 0"):
        next(weight_buckets_by_size(tensors(), 0))
