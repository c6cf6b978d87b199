"""Generation time per token against response length: what grows and why (the `hf` rollout, bench model shape).

For response lengths 64-512 (every row runs to the limit) this times `HFRollout.generate_sequences` on the bench
batch shape (16 prompts x 8 samples, ~98-token prompts, the bench model `s` with random weights, 2 threads) on
three paths: the CPU speed-ups with the shared-prompt decode attention (the default, `verl/cpu/shared_prefix.py`),
the CPU speed-ups with every row holding its own copy of its prompt's keys and values (the per-row cache), and the
generic path (`VERL_CPU_ACCELERATION=0`: HF's forward over the per-row cache, torch's sampling), which is what
the speed-ups are worth against. Next to each it prints
what one decode step must read from the KV cache (float32 keys and values of every layer over the visible context,
the prompt part once per prompt in the shared case), that read's time at the machine's measured memory bandwidth (a
`sum` over 512 MiB), and the rest of the time per token. Each new token attends over every earlier one, so the KV
read grows with length whatever the cache layout; the columns show how much of the growth it explains at full
bandwidth, and how much the rest grows.

    python benchmarks/bench_decode.py                 # lengths 64,128,256,512
    python benchmarks/bench_decode.py --lengths 64,512 --repeats 1 --paths cpu-shared,generic
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from unittest import mock

import torch
from omegaconf import OmegaConf
from transformers import Qwen2Config, Qwen2ForCausalLM

from verl.models.tiny import MODEL_SIZES
from verl.protocol import DataProto
from verl.utils import acceleration
from verl.workers.rollout.hf_rollout import HFRollout

PROMPTS, SAMPLES, PROMPT_LEN, MEAN_PROMPT = 16, 8, 128, 98  # the bench batch (benchmarks/README.md)
THREADS = 2


def memory_bandwidth_gbs() -> float:
    """Read bandwidth of this machine as torch sees it: the best of 5 `sum`s over 512 MiB of float32."""
    x = torch.ones(128 << 20)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def bench_prompts(seed: int = 0) -> DataProto:
    """16 left-padded prompts of 70-127 tokens (mean ~98, as GSM8K's in the bench), each repeated 8 times."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(70, PROMPT_LEN, (PROMPTS,), generator=gen)
    mask = (torch.arange(PROMPT_LEN)[None] >= PROMPT_LEN - lengths[:, None]).long()
    ids = torch.randint(3, 2048, (PROMPTS, PROMPT_LEN), generator=gen) * mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    batch = DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": mask, "position_ids": positions},
        meta_info={"eos_token_id": 1, "pad_token_id": 0},
    )
    return batch.repeat(SAMPLES, interleave=True)


def kv_bytes_per_step(config: Qwen2Config, prompt_tokens: float, response_pos: float, shared: bool) -> float:
    """Bytes of float32 keys and values one decode step reads over all layers, at `response_pos` tokens in."""
    rows = PROMPTS * SAMPLES
    prompt_rows = PROMPTS if shared else rows
    per_position = 2 * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * 4
    return config.num_hidden_layers * per_position * (prompt_rows * prompt_tokens + rows * response_pos)


PATHS = ("cpu-shared", "cpu-per_row", "generic")


def time_generation(model, prompts: DataProto, length: int, path: str, repeats: int) -> float:
    """Median seconds of one `generate_sequences` over the batch, every row running to `length` tokens, on `path`
    (one of PATHS)."""
    config = OmegaConf.create(dict(response_length=length, ignore_eos=True, temperature=1.0, top_k=-1, top_p=1.0,
                                   do_sample=True, seed=0, calculate_log_probs=True))  # fmt: skip
    cpu = acceleration.for_device("cpu")
    real_cache = type(cpu).shared_prefix_cache
    if path == "cpu-per_row":
        type(cpu).shared_prefix_cache = lambda self, config, capacity: None
    try:
        with mock.patch.dict(os.environ, {acceleration.SWITCH_ENV: "0" if path == "generic" else "1"}):
            rollout = HFRollout(model, config)
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                rollout.generate_sequences(prompts)
                times.append(time.perf_counter() - start)
    finally:
        type(cpu).shared_prefix_cache = real_cache
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="64,128,256,512", help="response lengths (default 64,128,256,512)")
    parser.add_argument("--repeats", type=int, default=2, help="timed generations per point, median (default 2)")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"paths to compare (default {','.join(PATHS)})")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    paths = args.paths.split(",")
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        parser.error(f"--paths: unknown {unknown}; allowed are {list(PATHS)}")
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=2048, tie_word_embeddings=True, **MODEL_SIZES["s"])
    config._attn_implementation = "sdpa"
    model = Qwen2ForCausalLM(config).eval()
    prompts = bench_prompts()
    prompt_tokens = float(prompts.batch["attention_mask"][::SAMPLES].sum(-1).float().mean())
    time_generation(model, prompts, 8, "cpu-shared", 1)  # warm-up
    bandwidth = memory_bandwidth_gbs()
    print(f"bench model s, {PROMPTS} prompts x {SAMPLES} samples, mean prompt {prompt_tokens:.1f} tokens, "
          f"{THREADS} threads; memory read bandwidth {bandwidth:.1f} GB/s")  # fmt: skip
    print(f"{'path':>12} {'tokens':>6} {'gen s':>7} {'us/token':>9} {'x at 64':>8} {'KV MB/step':>11} "
          f"{'KV read us/token':>17} {'rest us/token':>14}")  # fmt: skip
    for path in paths:
        shared = path == "cpu-shared"
        first = None
        for length in lengths:
            seconds = time_generation(model, prompts, length, path, args.repeats)
            per_token = seconds / (PROMPTS * SAMPLES * length) * 1e6
            first = first or per_token
            kv = kv_bytes_per_step(config, prompt_tokens, (length - 1) / 2, shared)  # mean over the decode steps
            kv_us = kv / (bandwidth * 1e9) / (PROMPTS * SAMPLES) * 1e6
            print(f"{path:>12} {length:>6} {seconds:>7.2f} {per_token:>9.1f} "
                  f"{per_token / first:>8.2f} {kv / 1e6:>11.1f} {kv_us:>17.1f} {per_token - kv_us:>14.1f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
