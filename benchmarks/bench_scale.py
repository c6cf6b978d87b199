"""GRPO at a real model size on this machine: Qwen2.5-0.5B's shape with 1 and 2 worker processes.

The model is `verl.models.tiny` at size `qwen2.5-0.5b` (hidden 896, 24 layers, 14 heads / 2 KV heads, intermediate
4864, vocabulary 151,936, tied embeddings: 494M parameters, random weights) with a local tokenizer trained on GSM8K
text; it is built once and cached in the work directory. Each configuration runs GRPO through `main_ppo.run_ppo`
(the entry point's code path) in a subprocess of its own (fresh memory, fresh Ray): 8 GSM8K prompts x 8 samples,
256 new tokens at temperature 1 (a random model almost never stops early), a KL loss to a reference model (k3,
beta 0.04), one mini-batch per step, float32, the `hf` rollout engine, packed forwards, gradient checkpointing
(`--no-gradient-checkpointing` to compare), the rollout's log-probs reused as old log-probs.

Printed per configuration: s/step, generation and step tokens/s, the phases, the peak RSS of every process of the
run (the driver, each worker, each of Ray's daemons; a thread of this script samples them every 2 s), and, per
rank, the RSS before the weight sync and its peak during the sync (`system/actor_rollout_rank{r}/weight_sync_*`,
sampled every 2 ms inside the worker), next to the sizes that bound it: the rank's FSDP shard, the rollout copy and
one bucket (the `hf` engine receives one gathered tensor at a time: the largest is the tied embedding). When the
rollout runs in the actor's dtype (float32 here) the `hf` engine generates with the actor's own FSDP2 module, so
there is no rollout copy and no sync, and the script says so.

Usage (from the repository root):
    python benchmarks/bench_scale.py                           # 2 then 1 workers, 2 steps each (hours on 2 cores)
    python benchmarks/bench_scale.py --workers 2 --steps 1     # one configuration, one step
    python benchmarks/bench_scale.py --quick                   # smoke run: size xs, 2 x 2 samples, 16 tokens, 1 step
Figures go to --out (JSON, default <workdir>/bench_scale.json). A run that passes --timeout-min is stopped and
reports the steps it finished.

A benchmark, not a library module: it may import anything of the package.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_grpo import REPO_ROOT, gsm8k_rows  # noqa: E402  (benchmarks/ is not a package)
from bench_runs import tokenizer_corpus  # noqa: E402
from tree_memory import TreeMemory  # noqa: E402

THREADS = 2  # the machine's cores: one worker gets both, two workers one each
KL_BETA = 0.04
LR = 1e-6
MB = 2**20

# The bar setting and a smoke setting small enough for a unit test.
FULL = {"size": "qwen2.5-0.5b", "prompts": 8, "samples": 8, "response_length": 256, "micro_batch": 8}
QUICK = {"size": "xs", "prompts": 2, "samples": 2, "response_length": 16, "micro_batch": 2}


# ------------------------------------------------------------------------------------------------ set-up
def prepare(workdir: str, size: str, num_prompts: int) -> dict[str, str]:
    """Build the model of `size` (tokenizer trained on GSM8K text, as bench_grpo) and the parquet prompts once."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from verl.models.tiny import build_tiny_model

    model_dir = os.path.join(workdir, f"model_{size}")
    data_path = os.path.join(workdir, f"train_{size}_{num_prompts}.parquet")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        build_tiny_model(model_dir + ".tmp", size=size, seed=0, corpus=tokenizer_corpus())
        os.replace(model_dir + ".tmp", model_dir)  # a cut build is never taken for a finished one
    if not os.path.isfile(data_path):
        rows = gsm8k_rows(AutoTokenizer.from_pretrained(model_dir), limit=num_prompts)
        pq.write_table(pa.Table.from_pylist(rows), data_path)
    return {"model": model_dir, "data": data_path}


def overrides(setting: dict, paths: dict[str, str], workers: int, steps: int, run_dir: str, ckpt: bool) -> list[str]:
    """The trainer's overrides: GRPO with a KL-loss reference, the CPU job's settings, packed forwards."""
    batch = setting["prompts"] * setting["samples"]
    micro = setting["micro_batch"]
    return [
        f"data.train_files={paths['data']}",
        "data.val_files=null",
        "data.max_prompt_length=128",
        f"data.max_response_length={setting['response_length']}",
        f"data.train_batch_size={setting['prompts']}",
        "data.dataloader_num_workers=0",
        "algorithm.adv_estimator=grpo",
        f"actor_rollout_ref.model.path={paths['model']}",
        f"actor_rollout_ref.model.enable_gradient_checkpointing={str(ckpt).lower()}",
        "actor_rollout_ref.model.use_remove_padding=true",
        f"actor_rollout_ref.rollout.n={setting['samples']}",
        "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.actor.recompute_old_log_prob=false",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={setting['prompts']}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={min(micro, batch // workers)}",
        "actor_rollout_ref.actor.ppo_epochs=1",
        "actor_rollout_ref.actor.use_kl_loss=true",
        f"actor_rollout_ref.actor.kl_loss_coef={KL_BETA}",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        f"actor_rollout_ref.actor.optim.lr={LR}",
        "actor_rollout_ref.actor.fsdp_config.dtype=float32",
        "actor_rollout_ref.ref.fsdp_config.dtype=float32",
        "trainer.val_before_train=false",
        "trainer.save_freq=-1",
        "trainer.logger=[console]",
        "trainer.device=cpu",
        f"trainer.n_gpus_per_node={workers}",
        f"trainer.ray_init.num_cpus={THREADS}",
        f"trainer.total_training_steps={steps}",
        f"trainer.default_local_dir={run_dir}",
        "trainer.resume_mode=disable",
    ]


def run_child(config_overrides: list[str]) -> None:
    """One run: our trainer through `main_ppo.run_ppo`; the figures are its metrics.jsonl."""
    from omegaconf import OmegaConf

    from verl.trainer import main_ppo

    config = OmegaConf.load(os.path.join(REPO_ROOT, "verl", "trainer", "config", "ppo_trainer.yaml"))
    config.pop("defaults", None)
    config.pop("hydra", None)
    config = OmegaConf.merge(config, OmegaConf.from_dotlist(config_overrides))
    OmegaConf.resolve(config)
    main_ppo.run_ppo(config)


# ------------------------------------------------------------------------------------------ run + memory
def model_sizes(model_dir: str, workers: int) -> dict[str, float]:
    """Parameter count and, in MB (float32), the rank's FSDP shard of one model, the rollout's full copy and the
    largest single tensor (what the `hf` engine's stream holds at once: its bucket)."""
    from safetensors import safe_open

    sizes = []
    for name in os.listdir(model_dir):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, name), framework="pt") as f:
                for key in f.keys():
                    shape = f.get_slice(key).get_shape()
                    sizes.append(4 * math.prod(shape))
    total = sum(sizes)
    return {
        "parameters": total / 4,
        "shard_mb": total / workers / MB,
        "rollout_copy_mb": total / MB,
        "largest_tensor_mb": max(sizes) / MB,
    }


def _kill_tree(pid: int) -> None:
    """Kill a run's process tree (the run's driver, its Ray daemons and workers: all started by this script)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def _labelled(peaks: dict[int, tuple[str, str, float]]) -> list[tuple[str, str, float]]:
    """(kind, label, peak MB): the driver, then the workers as `worker 0`, `worker 1`, ... (by pid: in start order),
    then Ray's daemons by name."""
    rows = sorted(peaks.items(), key=lambda item: ({"driver": 0, "workers": 1}.get(item[1][0], 2), item[1][1], item[0]))
    out, workers = [], 0
    for _, (kind, name, mb) in rows:
        if kind == "workers":
            name, workers = f"worker {workers}", workers + 1
        out.append((kind, name, mb))
    return out


def launch(args: argparse.Namespace, setting: dict, paths: dict, workers: int) -> dict:
    """Run one configuration in a subprocess; return its per-step metrics and the peak RSS of every process."""
    run_dir = tempfile.mkdtemp(prefix=f"run_w{workers}_", dir=args.workdir)
    ckpt = not args.no_gradient_checkpointing
    config_path = os.path.join(run_dir, "overrides.json")
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(overrides(setting, paths, workers, args.steps, run_dir, ckpt), f)
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", config_path]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads are ~10x slower on a shared CPU
    env.pop("RAY_ADDRESS", None)  # a fresh local Ray per run
    log_path = os.path.join(args.workdir, "bench_scale.log")
    start = time.perf_counter()
    timed_out = False
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"\n==== {workers} worker(s): {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=args.workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
        memory = TreeMemory(proc.pid, interval=args.sample_s)
        try:
            code = proc.wait(timeout=args.timeout_min * 60 if args.timeout_min else None)
        except subprocess.TimeoutExpired:
            timed_out, code = True, None
            _kill_tree(proc.pid)
            proc.wait()
        memory.stop()
    metrics_path = os.path.join(run_dir, "logs", "metrics.jsonl")
    records = []
    if os.path.isfile(metrics_path):
        with open(metrics_path, encoding="utf-8") as f:
            records = [r for r in map(json.loads, f) if r.get("step", 0) > 0]
    if not records and not timed_out:
        raise RuntimeError(f"{workers}-worker run failed (exit code {code}); see {log_path}")
    return {
        "workers": workers,
        "gradient_checkpointing": ckpt,
        "timed_out": timed_out,
        "run_s": time.perf_counter() - start,
        "records": records,
        "peak_rss_mb": memory.peak_mb,
        "peak_pss_mb": memory.peak_pss_mb,
        "processes": _labelled(memory.peak_by_process),
        "sizes": model_sizes(paths["model"], workers),
    }


# ---------------------------------------------------------------------------------------------- report
def summarize(result: dict, setting: dict) -> dict:
    """s/step, tokens/s and phases (median over the steps run), the per-process and weight-sync memory."""
    records = result["records"]

    def median(key: str) -> float | None:
        values = [float(r[key]) for r in records if key in r]
        return statistics.median(values) if values else None

    batch = setting["prompts"] * setting["samples"]
    step_s, gen_s = median("timing_s/step"), median("timing_s/gen")
    response_tokens = median("response_length/mean")
    all_tokens = median("perf/total_num_tokens")
    phases = {
        k[len("timing_s/") :]: median(k) for k in sorted({k for r in records for k in r}) if k.startswith("timing_s/")
    }
    sync = {}
    for rank in range(result["workers"]):
        prefix = f"system/actor_rollout_rank{rank}/weight_sync_"
        before = [r[prefix + "rss_before_gb"] for r in records if prefix + "rss_before_gb" in r]
        peak = [r[prefix + "peak_rss_gb"] for r in records if prefix + "peak_rss_gb" in r]
        if peak:
            sync[rank] = {
                "rss_before_mb": max(before) * 1024,
                "peak_rss_mb": max(peak) * 1024,
                "peak_above_before_mb": max(p - b for p, b in zip(peak, before)) * 1024,
            }
    return {
        "workers": result["workers"],
        "gradient_checkpointing": result["gradient_checkpointing"],
        "steps": len(records),
        "timed_out": result["timed_out"],
        "step_s": step_s,
        "step_s_each": [r.get("timing_s/step") for r in records],
        "gen_s": gen_s,
        "gen_tokens_per_s": response_tokens * batch / gen_s if gen_s and response_tokens else None,
        "tokens_per_s": all_tokens / step_s if step_s and all_tokens else None,
        "response_length_mean": response_tokens,
        "phases_s": phases,
        "peak_rss_mb": result["peak_rss_mb"],
        "peak_pss_mb": result["peak_pss_mb"],
        "processes": [{"kind": k, "name": n, "peak_rss_mb": mb} for k, n, mb in result["processes"]],
        "weight_sync": sync,
        "sizes": result["sizes"],
    }


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_table(summaries: list[dict]) -> None:
    header = f"{'workers':>8}{'steps':>7}{'s/step':>9}{'gen s':>8}{'gen tok/s':>11}{'tok/s':>8}{'RSS sum MB':>12}{'PSS MB':>9}"
    print("\n" + header + "\n" + "-" * len(header))
    for s in summaries:
        print(
            f"{s['workers']:>8}{s['steps']:>7}{_fmt(s['step_s']):>9}{_fmt(s['gen_s']):>8}{_fmt(s['gen_tokens_per_s']):>11}"
            f"{_fmt(s['tokens_per_s']):>8}{s['peak_rss_mb']:>12.0f}{s['peak_pss_mb']:>9.0f}"
            + ("  (timed out)" if s["timed_out"] else "")
        )
    for s in summaries:
        w = s["workers"]
        print(f"\n{w} worker(s): phases (median s): " + ", ".join(f"{k} {_fmt(v)}" for k, v in s["phases_s"].items()))
        print(f"{w} worker(s): peak RSS by process (MB): " + ", ".join(
            f"{p['name']} {p['peak_rss_mb']:.0f}" for p in s["processes"]
        ))  # fmt: skip
        z = s["sizes"]
        print(
            f"{w} worker(s): per rank, float32: shard {z['shard_mb']:.0f} MB (one model), rollout copy "
            f"{z['rollout_copy_mb']:.0f} MB, one bucket (hf: one tensor, the largest) {z['largest_tensor_mb']:.0f} MB"
        )
        if not s["weight_sync"]:  # the hf engine in the actor's dtype generates with the actor's FSDP2 module
            print(f"{w} worker(s): no weight sync: the rollout generates with the actor's own module (no copy)")
        for rank, m in s["weight_sync"].items():
            print(
                f"{w} worker(s): rank {rank} weight sync: RSS before {m['rss_before_mb']:.0f} MB, peak "
                f"{m['peak_rss_mb']:.0f} MB (+{m['peak_above_before_mb']:.0f} MB)"
            )


# ------------------------------------------------------------------------------------------- update probe
def probe_child(spec: dict) -> dict:
    """One micro-batch of the actor's update pass (`_forward_micro_batch` with entropy, then backward) on the model
    alone, in this process, without FSDP: the RSS it adds over the loaded model (parameter gradients included) and
    its seconds. `chunked` false computes the LM head over the whole micro-batch at once (one chunk)."""
    import torch
    from omegaconf import OmegaConf

    from verl.utils import fsdp_utils
    from verl.utils.system_metrics import phase_memory, process_metrics
    from verl.workers.actor import DataParallelPPOActor
    from verl.workers.engine import head_stats

    torch.set_num_threads(THREADS)
    if not spec["chunked"]:
        head_stats.HEAD_CHUNK_ELEMENTS = 2**62
    model = fsdp_utils.load_causal_lm(spec["model"], "float32", "sdpa", gradient_checkpointing=spec["ckpt"]).train()
    for param in model.parameters():  # touch the (lazily loaded) weights before measuring
        param.data.add_(0)
    rows, prompt_len, response_len = spec["rows"], 128, spec["response_length"]
    ids = torch.randint(10, 2000, (rows, prompt_len + response_len), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    batch = {"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1}
    batch["responses"] = ids[:, prompt_len:]
    actor = DataParallelPPOActor(OmegaConf.create({"use_remove_padding": True}), model)
    with phase_memory("probe"):
        start = time.perf_counter()
        log_prob, _, _ = actor._forward_micro_batch(batch, 1.0, calculate_entropy=True, entropy_grad=False)
        log_prob.mean().backward()
        seconds = time.perf_counter() - start
    metrics = process_metrics()
    grads_mb = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None) / MB
    added_mb = (metrics["probe_peak_rss_gb"] - metrics["probe_rss_before_gb"]) * 1024
    return {**spec, "tokens": rows * (prompt_len + response_len), "added_mb": added_mb, "grads_mb": grads_mb,
            "seconds": seconds}  # fmt: skip


def run_probes(args: argparse.Namespace, setting: dict, paths: dict) -> list[dict]:
    """`probe_child` in a fresh process for gradient checkpointing on/off x LM head chunked / whole micro-batch."""
    results = []
    for ckpt in (True, False):
        for chunked in (True, False):
            spec = {"model": paths["model"], "rows": setting["micro_batch"], "ckpt": ckpt, "chunked": chunked}
            spec["response_length"] = setting["response_length"]
            out_path = os.path.join(args.workdir, f"probe_{int(ckpt)}{int(chunked)}.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--_probe", json.dumps(spec), "--out", out_path]
            env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": REPO_ROOT}
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"probe {spec} failed:\n{proc.stderr[-3000:]}")
            with open(out_path, encoding="utf-8") as f:
                results.append(json.load(f))
            r = results[-1]
            print(
                f"probe: {r['rows']} samples ({r['tokens']} tokens), gradient checkpointing {'on ' if ckpt else 'off'}, "
                f"LM head {'in chunks' if chunked else 'at once '}: +{r['added_mb']:.0f} MB over the model "
                f"(parameter gradients {r['grads_mb']:.0f} MB of it), {r['seconds']:.1f} s",
                flush=True,
            )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="2,1", help="worker-process counts to run, in order (default 2,1)")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps per configuration (default 2, quick 1)")
    parser.add_argument("--quick", action="store_true", help="size xs, 2 prompts x 2 samples, 16 tokens, 1 step")
    parser.add_argument("--size", default=None, help="model size of verl.models.tiny (default qwen2.5-0.5b)")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per step (default 8)")
    parser.add_argument("--samples", type=int, default=None, help="samples per prompt (default 8)")
    parser.add_argument("--response-length", type=int, default=None, help="new tokens (default 256)")
    parser.add_argument("--micro-batch", type=int, default=None, help="samples per forward (default 8)")
    parser.add_argument("--no-gradient-checkpointing", action="store_true", help="keep every layer's activations")
    parser.add_argument(
        "--sample-s",
        type=float,
        default=None,
        help="memory sampling period (default 2 s, quick 0.2 s: PSS of big "
        "processes is costly to read, ~40%% of a core at 0.2 s for the 0.5B run)",
    )
    parser.add_argument("--timeout-min", type=float, default=None, help="stop a run after this many minutes")
    parser.add_argument("--workdir", default=None, help="model cache, data and runs (default: a temp dir)")
    parser.add_argument("--out", default=None, help="JSON file for the figures (default <workdir>/bench_scale.json)")
    parser.add_argument("--probe", action="store_true", help="only the update-pass memory probes (--micro-batch)")
    parser.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_probe", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._child:
        with open(args._child, encoding="utf-8") as f:
            run_child(json.load(f))
        return 0
    if args._probe:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(probe_child(json.loads(args._probe)), f)
        return 0

    setting = dict(QUICK if args.quick else FULL)
    args.steps = args.steps or (1 if args.quick else 2)
    args.sample_s = args.sample_s or (0.2 if args.quick else 2.0)
    for key in ("size", "prompts", "samples", "response_length", "micro_batch"):
        if getattr(args, key) is not None:
            setting[key] = getattr(args, key)
    workers = [int(w) for w in args.workers.split(",") if w]
    if not workers or any(w < 1 for w in workers) or args.steps < 1:
        parser.error(f"--workers must list counts >= 1 and --steps must be >= 1, got {args.workers!r}, {args.steps}")
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="bench_scale_")
    os.makedirs(args.workdir, exist_ok=True)
    paths = prepare(args.workdir, setting["size"], max(64, setting["prompts"] * args.steps))
    out = args.out or os.path.join(args.workdir, "bench_scale.json")
    if args.probe:
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"setting": setting, "probes": run_probes(args, setting, paths)}, f, indent=2)
        return 0

    summaries = []
    for count in workers:
        result = launch(args, setting, paths, count)
        summary = summarize(result, setting)
        summaries.append(summary)
        print(f"{count} worker(s): {summary['steps']} step(s), median {_fmt(summary['step_s'])} s/step "
              f"({result['run_s']:.0f} s with start-up)", flush=True)  # fmt: skip
    print_table(summaries)
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"setting": setting, "summaries": summaries}, f, indent=2)
    print(f"\nfigures written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
