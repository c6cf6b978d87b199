"""Per-rank memory of one actor -> rollout weight sync from the FSDP2 shards (`verl.workers.weight_sync`): written in
place into the engine's parameters (`in_place`: what the hf engine gets), streamed one gathered tensor at a time
(`tensor`: an engine loading by name, e.g. hf with LoRA adapters) or in buckets (`bucket`: what vllm and sglang get),
against the old full gather (`full`: `fsdp_utils.get_full_state_dict` + `update_weights(state_dict)`).

Each rank builds a random Qwen2 (default ~166M parameters, 0.66 GB in fp32), FSDP2-shards it over gloo and keeps a
plain copy for the `hf` engine, as `ActorRolloutRefWorker` does; then it syncs once while a thread samples the
process's RSS every 0.5 ms. Reported per rank: the shard and rollout-copy sizes, the RSS before the sync and the
sync's peak RSS above it, and (streamed) `GatherStats`: the most bytes of gathered tensors alive at once and the
largest tensor. Every configuration runs in fresh processes with `MALLOC_MMAP_THRESHOLD_` fixed, so that freed
tensors go back to the OS and RSS follows what is alive.

Usage (from the repository root):
    python benchmarks/bench_weight_sync.py                      # 2 ranks, buckets of 64 MB, all four methods
    python benchmarks/bench_weight_sync.py --bucket-mb 16 --hidden 512 --layers 4 --world-size 1
    python benchmarks/bench_weight_sync.py --qwen2-0.5b --bucket-mb 256      # Qwen2.5-0.5B's shapes, ~5 min

A benchmark, not a library module: it may import anything of the package.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

MB = 1 << 20


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Samples RSS in a thread while the block runs; `peak` is the largest value seen."""

    def __init__(self, interval: float = 0.0005):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()

    def __enter__(self):
        self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.interval)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def child(args: argparse.Namespace) -> None:
    """One rank: build, shard, copy, then sync once under the RSS sampler; write the figures as JSON."""
    import copy
    import gc

    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from verl.utils.fsdp_utils import apply_fsdp2, get_full_state_dict
    from verl.workers.rollout.hf_rollout import HFRollout
    from verl.workers.weight_sync import GatherStats, sync_rollout_weights

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world_size)
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 448),
        tie_word_embeddings=args.tie,
    )
    torch.manual_seed(0)
    with torch.no_grad():
        model = Qwen2ForCausalLM(config)
        rollout = HFRollout(copy.deepcopy(model).eval().requires_grad_(False), {"response_length": 1})
        actor = apply_fsdp2(model)
        for p in actor.parameters():  # an "update": the engine's copy is stale
            p.to_local().add_(0.01)
    del model
    gc.collect()
    shard = sum(p.to_local().numel() * p.to_local().element_size() for p in actor.parameters())
    full = sum(p.numel() * p.element_size() for p in rollout.module.parameters())
    dist.barrier()
    before = rss_bytes()
    stats = GatherStats()
    start = time.perf_counter()
    with PeakRSS() as sampler:
        if args.method in ("in_place", "tensor", "bucket"):
            rollout.takes_buckets = args.method == "bucket"
            if args.method != "in_place":
                rollout.in_place_module = lambda: None
            cfg = {"checkpoint_engine": {"update_weights_bucket_megabytes": args.bucket_mb}}
            sync_rollout_weights(actor, rollout, cfg, use_lora=False, stats=stats)
        else:
            rollout.update_weights(get_full_state_dict(actor, cpu_offload=True))
    seconds = time.perf_counter() - start
    probe = next(iter(rollout.module.parameters()))
    ok = torch.equal(probe, next(iter(actor.parameters())).full_tensor())
    result = {
        "rank": args.rank,
        "method": args.method,
        "shard_mb": shard / MB,
        "rollout_copy_mb": full / MB,
        "rss_before_mb": before / MB,
        "sync_peak_above_before_mb": (sampler.peak - before) / MB,
        "gathered_peak_mb": stats.peak / MB,
        "largest_tensor_mb": stats.largest / MB,
        "buckets": stats.buckets,
        "seconds": seconds,
        "synced": ok,
    }
    with open(os.path.join(args.out_dir, f"{args.method}_{args.rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=64)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--intermediate", type=int, default=0, help="default: hidden * 11 / 4")
    parser.add_argument("--tie", action="store_true", help="tied input/output embeddings")
    parser.add_argument("--qwen2-0.5b", dest="qwen05", action="store_true", help="Qwen2.5-0.5B's shapes (494M)")
    parser.add_argument("--methods", default="in_place,tensor,bucket,full")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", default="tensor", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.qwen05:
        args.hidden, args.layers, args.vocab, args.intermediate, args.tie = 896, 24, 151936, 4864, True
    if args.child:
        child(args)
        return
    from verl.utils.fsdp_utils import free_port

    rows = []
    with tempfile.TemporaryDirectory() as out_dir:
        for method in args.methods.split(","):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
            env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)  # freed tensors go back to the OS: RSS = what is alive
            shared = ["--child", "--method", method, "--out-dir", out_dir, "--world-size", str(args.world_size)]
            shared += ["--bucket-mb", str(args.bucket_mb), "--hidden", str(args.hidden), "--layers", str(args.layers)]
            shared += ["--vocab", str(args.vocab), "--intermediate", str(args.intermediate)]
            shared += ["--tie"] if args.tie else []
            procs = [
                subprocess.Popen([sys.executable, __file__, *shared, "--rank", str(r)], env=env)
                for r in range(args.world_size)
            ]
            if any(p.wait() != 0 for p in procs):
                raise SystemExit(f"a rank of the {method} run failed")
            for r in range(args.world_size):
                with open(os.path.join(out_dir, f"{method}_{r}.json")) as f:
                    rows.append(json.load(f))
    print(f"bucket {args.bucket_mb} MB, {args.world_size} rank(s)")
    for row in rows:
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}))


if __name__ == "__main__":
    main()
