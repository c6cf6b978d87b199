"""Tests of the decode lanes (verl/workers/rollout/decode_lanes.py) and of the `hf` rollout generating in them: the
split of a micro-batch, the threads' settings, and samples that do not depend on the number of lanes or on the
micro-batch size (the tiny Qwen2 model; `model` and `tokenizer` from this folder's conftest)."""

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.multirank import shard_on_cpu
from tests.workers.test_hf_rollout import full_forward_log_probs, make_prompts, recorded_forwards, rollout_config
from verl.workers.rollout import decode_lanes, shared_prefix
from verl.workers.rollout.hf_rollout import HFRollout


def test_split_keeps_prompt_groups_whole_and_balances_rows():
    # group sizes 3, 1, 2, 1: group 0 -> lane 0, group 2 -> lane 1, group 1 -> lane 1 (2 < 3 rows), group 3 -> lane 0
    groups = torch.tensor([0, 0, 0, 1, 2, 2, 3])
    lanes = decode_lanes.split_into_lanes(groups, 2)
    assert [lane.tolist() for lane in lanes] == [[0, 1, 2, 6], [3, 4, 5]]
    assert [lane.tolist() for lane in decode_lanes.split_into_lanes(groups, 1)] == [list(range(7))]


def test_lane_count_follows_threads_rows_and_groups(two_threads):
    cpu = torch.device("cpu")
    assert decode_lanes.lane_count(cpu, rows=128, groups=16) == 2
    assert decode_lanes.lane_count(cpu, rows=12, groups=4) == 1  # under MIN_ROWS_PER_LANE rows per lane
    assert decode_lanes.lane_count(cpu, rows=128, groups=1) == 1  # one prompt group cannot be split
    assert decode_lanes.lane_count(cpu, rows=6, groups=4, requested=3) == 3
    assert decode_lanes.lane_count(cpu, rows=6, groups=2, requested=3) == 2
    assert decode_lanes.lane_count(torch.device("cuda"), rows=128, groups=16) == 1


@pytest.mark.parametrize(
    "env, spin", [({}, True), ({"OMP_WAIT_POLICY": "passive"}, False), ({"OMP_WAIT_POLICY": "ACTIVE"}, True),
                  ({"GOMP_SPINCOUNT": "0"}, False), ({"GOMP_SPINCOUNT": "10000"}, True)])  # fmt: skip
def test_lane_count_with_the_shared_cache_follows_openmp_waiting(two_threads, monkeypatch, env, spin):
    """Spinning OpenMP threads: one lane on all threads when the decode uses the shared-prompt cache; sleeping
    threads: one lane per thread. The per-row cache keeps one lane per thread either way."""
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cpu = torch.device("cpu")
    assert decode_lanes.openmp_threads_spin() is spin
    assert decode_lanes.lane_count(cpu, rows=128, groups=16, shared_cache=True) == (1 if spin else 2)
    assert decode_lanes.lane_count(cpu, rows=128, groups=16, shared_cache=False) == 2
    assert decode_lanes.lane_count(cpu, rows=128, groups=16, requested=2, shared_cache=True) == 2


def test_lanes_run_in_threads_of_one_torch_thread_without_grad(two_threads):
    barrier = threading.Barrier(2, timeout=10)  # both lanes must be running at once to pass it

    def probe():
        barrier.wait()
        return threading.current_thread().name, torch.get_num_threads(), torch.is_grad_enabled()

    results = decode_lanes.run_lanes([probe, probe])
    names = [r[0] for r in results]
    assert len(set(names)) == 2 and all(name.startswith("decode-lane") for name in names)
    assert all(r[1] == 1 and r[2] is False for r in results)
    assert torch.get_num_threads() == 2  # the caller's count is back
    assert {r[0] for r in decode_lanes.run_lanes([probe, probe])} == set(names)  # the same threads again

    def fail():
        raise ValueError("boom in a lane")

    with pytest.raises(ValueError, match="boom in a lane"):
        decode_lanes.run_lanes([fail, lambda: torch.get_num_threads()])
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("shared", [True, False], ids=["shared_prefix", "per_row_cache"])
def test_samples_are_the_same_in_any_number_of_lanes_and_micro_batches(
    model, tokenizer, monkeypatch, two_threads, shared
):
    """4 prompts x 3 samples, some rows stopping at an eos: one lane, two lanes (two threads, each its own
    forwards) and micro-batches of 5 rows give the same tokens, and log-probs equal to a full forward's."""
    if not shared:
        monkeypatch.setattr(shared_prefix, "applies_to", lambda config: False)

    def prompts(eos):
        return make_prompts(tokenizer, seed=3, eos_token_id=eos).repeat(3, interleave=True)

    def generate(batch, lanes, micro=None):
        rollout = HFRollout(model, rollout_config(calculate_log_probs=True, micro_batch_size=micro), tokenizer)
        rollout.decode_lanes = lanes
        with recorded_forwards(model) as calls:
            return rollout.generate_sequences(batch), [(name, rows) for name, rows, _ in calls]

    free, _ = generate(prompts(2047), 1)
    eos = [int(free.batch["responses"][0, 2]), int(free.batch["responses"][7, 1])]  # rows 0 and 7 stop early
    one, one_calls = generate(prompts(eos), 1)
    two, two_calls = generate(prompts(eos), 2)
    micro, _ = generate(prompts(eos), 1, micro=5)
    lengths = one.batch["response_mask"].sum(-1)
    assert lengths.min() < lengths.max()  # some rows did stop early
    assert {name for name, _ in one_calls} == {threading.main_thread().name}
    lane_threads = {name for name, _ in two_calls}
    assert len(lane_threads) == 2 and all(name.startswith("decode-lane") for name in lane_threads)
    assert max(rows for _, rows in two_calls) == 6  # each lane decodes 2 prompts x 3 samples
    for other in (two, micro):
        assert torch.equal(other.batch["responses"], one.batch["responses"])
        torch.testing.assert_close(other.batch["rollout_log_probs"], one.batch["rollout_log_probs"], atol=1e-5, rtol=0)
    ref = full_forward_log_probs(model, two, 1.0) * two.batch["response_mask"]
    torch.testing.assert_close(two.batch["rollout_log_probs"], ref, atol=1e-5, rtol=0)
    assert model.config._attn_implementation == "sdpa"


def test_lanes_generate_with_the_actors_fsdp2_module(model, tokenizer, tiny_model_dir, own_process_group, two_threads):
    """The hf engine generating with the actor's own FSDP2 module (the worker's default): FSDP2's hooks are not
    thread-safe, so the lanes run its forwards with the hooks idle (`fsdp_utils.concurrent_forwards`); the samples
    equal the plain model's in one lane, twice in a row, and the module is sharded and usable afterwards."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from verl.utils.fsdp_utils import free_port

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    sharded = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    shard_on_cpu(sharded)
    prompts = make_prompts(tokenizer, seed=3).repeat(3, interleave=True)
    cfg = rollout_config(calculate_log_probs=True)
    one = HFRollout(model, cfg, tokenizer)
    one.decode_lanes = 1
    expected = one.generate_sequences(prompts)
    rollout = HFRollout(sharded, cfg, tokenizer)
    rollout.decode_lanes = 2
    for _ in range(2):
        out = rollout.generate_sequences(prompts)
        assert torch.equal(out.batch["responses"], expected.batch["responses"])
        torch.testing.assert_close(
            out.batch["rollout_log_probs"], expected.batch["rollout_log_probs"], atol=1e-5, rtol=0
        )
    assert all(isinstance(p, DTensor) for p in sharded.parameters())  # resharded
    ids = out.batch["input_ids"][:2]
    loss = sharded(input_ids=ids).logits.float().logsumexp(-1).mean()
    loss.backward()  # hooks working again: gradients reach the sharded parameters
    assert all(p.grad is not None for p in sharded.parameters() if p.requires_grad)
