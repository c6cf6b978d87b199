"""Cost curves of a GRPO step: ours (Ray, the default entry point) against TRL's GRPOTrainer over response
length, samples per prompt and model size; run by `python benchmarks/bench_grpo.py --sweep`.

Owns the sweep's points, its runs (each point: ours, then TRL, each a fresh subprocess through
`bench_grpo.launch`), its table and its PNG. Every point is the bench config (bench_runs.py) with one thing
changed: response length 64, 128, 256, 512 new tokens, n = 4, 8, 16 samples per prompt, model size "s" (the bench
model, ~3.5M parameters) and "s4x" (hidden 384, 8 layers: ~4x the matmul work per token); the model is made to
emit until the limit (ours: `rollout.ignore_eos`; TRL: `min_new_tokens`), so every row has the same length.
A cut sweep resumes: runs already finished in the workdir (same run, point and steps) are reused, and a run that
fails (killed for memory on a shared machine) leaves its point out of the table instead of stopping the sweep.
Figures per point: median step time, response tokens per second of step time, generation time per generated
token (flat in response length when the KV cache is preallocated: no per-step copy of the cache), the FLOP
floor (flops.py, one matmul-rate measurement for the whole sweep) and ours / TRL.

A benchmark helper (benchmarks/ is not a package).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import bench_grpo
import flops
from bench_runs import PROMPTS_PER_STEP, Shape, prepare, prompt_length_stats

LENGTHS = (64, 128, 256, 512)
GROUP_SIZES = (4, 8, 16)
MODEL_SIZES = {"s": "s (3.5M)", "s4x": "s4x (14.6M)"}  # size -> label (parameters, tied embeddings)
AXES = {
    "response length": [(L, Shape(response_len=L, ignore_eos=True)) for L in LENGTHS],
    "samples per prompt (n)": [(n, Shape(n=n, ignore_eos=True)) for n in GROUP_SIZES],
    "model size": [(label, Shape(model_size=size, ignore_eos=True)) for size, label in MODEL_SIZES.items()],
}
RUNS = ("ours", "trl")
RATIO_BAR = 0.5  # ours / TRL step time at every point
FLAT_BAR = 1.25  # generation time per token at the longest response over the shortest


def unique_shapes() -> list[Shape]:
    return list(dict.fromkeys(shape for points in AXES.values() for _, shape in points))


def finished_result(workdir: str, run: str, shape: Shape, steps: int) -> dict | None:
    """A complete result of `run` at `shape` with `steps` steps left in `workdir` by an earlier (cut) sweep."""
    wanted = json.loads(shape.to_json())
    for name in sorted(os.listdir(workdir)):
        if not name.startswith(f"result_{run}_"):
            continue
        with open(os.path.join(workdir, name), encoding="utf-8") as f:
            result = json.load(f)
        if result.get("shape") == wanted and "peak_rss_mb" in result and len(result["step_s"]) == steps:
            return result
    return None


def run_point(run: str, workdir: str, steps: int, log_path: str, shape: Shape) -> dict | None:
    """The result of `run` at `shape`: an earlier one from `workdir`, else a fresh run; None if the run failed
    (e.g. killed for memory: the sweep goes on and the table shows the point as missing)."""
    result = finished_result(workdir, run, shape, steps)
    if result is not None:
        return result
    try:
        return bench_grpo.launch(run, workdir, steps, log_path, shape)
    except RuntimeError as e:
        print(f"  {run} at L={shape.response_len} n={shape.n} model={shape.model_size} failed: {e}", flush=True)
        return None


def point_figures(result: dict, warmup: int, shape: Shape) -> dict:
    """Median step seconds, response tokens per second of step time and generation microseconds per token."""
    step = statistics.median(result["step_s"][warmup:])
    gen = result["gen_s"][warmup:]
    tokens = result["gen_tokens"][warmup:]
    return {
        "step_s": step,
        "tokens_per_s": PROMPTS_PER_STEP * shape.n * shape.response_len / step,
        "gen_s": statistics.median(gen),
        "cpu_s": statistics.median(result["cpu_s"][warmup:]) if result.get("cpu_s") else None,
        "gen_us_per_token": 1e6 * sum(gen) / sum(tokens),
        "peak_rss_mb": result["peak_rss_mb"],
    }


def floor_of(workdir: str, shape: Shape, rates: dict[str, float]) -> float:
    """The FLOP floor (seconds) of one step of `shape` at the measured model-shape rates."""
    paths = prepare(workdir, shape.model_size)
    with open(os.path.join(paths["model"], "config.json"), encoding="utf-8") as f:
        model = flops.ModelShape.from_config(json.load(f))
    lengths = prompt_length_stats(paths["data"])
    step = flops.StepShape(PROMPTS_PER_STEP, shape.n, lengths["mean"], lengths["mean_sq"], shape.response_len)
    return flops.floor_seconds(flops.step_flops(model, step), rates)["floor"]


def table(rows: list[dict]) -> str:
    """The sweep as a markdown table."""
    lines = [
        "| axis | value | ours s/step | TRL s/step | ours/TRL | ours/TRL CPU s | ours tok/s | TRL tok/s "
        "| ours gen us/token | TRL gen us/token | floor s | ours/floor | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        o, t = r["ours"], r["trl"]
        cpu = f"{o['cpu_s'] / t['cpu_s']:.3f}" if o.get("cpu_s") and t.get("cpu_s") else "-"
        lines.append(
            f"| {r['axis']} | {r['value']} | {o['step_s']:.2f} | {t['step_s']:.2f} | {o['step_s'] / t['step_s']:.3f} "
            f"| {cpu} "
            f"| {o['tokens_per_s']:.0f} | {t['tokens_per_s']:.0f} | {o['gen_us_per_token']:.1f} "
            f"| {t['gen_us_per_token']:.1f} | {r['floor_s']:.2f} | {o['step_s'] / r['floor_s']:.2f} | {r['load']} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    """One row of panels per axis: step time (with the floor), tokens/s, generation time per token."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes_names = list(dict.fromkeys(r["axis"] for r in rows))
    fig, grid = plt.subplots(len(axes_names), 3, figsize=(14, 3.6 * len(axes_names)), squeeze=False)
    panels = [("step_s", "s / step"), ("tokens_per_s", "response tokens / s"), ("gen_us_per_token", "gen us / token")]
    for row, axis in zip(grid, axes_names):
        points = [r for r in rows if r["axis"] == axis]
        labels = [str(r["value"]) for r in points]
        x = list(range(len(points)))
        for ax, (key, ylabel) in zip(row, panels):
            for run, style in (("ours", "o-"), ("trl", "s--")):
                ax.plot(x, [r[run][key] for r in points], style, label="ours (Ray)" if run == "ours" else "TRL")
            if key == "step_s":
                ax.plot(x, [r["floor_s"] for r in points], ":", color="gray", label="FLOP floor")
            ax.set_xticks(x, labels)
            ax.set_xlabel(axis)
            ax.set_ylabel(ylabel)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        row[0].legend()
    fig.suptitle("GRPO step cost, ours vs TRL GRPOTrainer (16 prompts per step, 2 CPU threads, float32)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_bars(rows: list[dict]) -> dict[str, float]:
    worst = max(r["ours"]["step_s"] / r["trl"]["step_s"] for r in rows)
    lengths = [r for r in rows if r["axis"] == "response length"]
    out = {"worst ours/TRL step time": worst}
    print("\nbars (measured in this sweep):")
    verdict = "met" if worst <= RATIO_BAR else f"MISSED by {(worst - RATIO_BAR) / RATIO_BAR:.0%}"
    print(f"  ours / TRL step time at every point: worst {worst:.3f}, bar <= {RATIO_BAR}: {verdict}")
    if len(lengths) >= 2:
        flat = lengths[-1]["ours"]["gen_us_per_token"] / lengths[0]["ours"]["gen_us_per_token"]
        trl_flat = lengths[-1]["trl"]["gen_us_per_token"] / lengths[0]["trl"]["gen_us_per_token"]
        out["gen per token, longest / shortest response"] = flat
        verdict = "met" if flat <= FLAT_BAR else f"MISSED by {(flat - FLAT_BAR) / FLAT_BAR:.0%}"
        print(
            f"  ours generation time per token, {lengths[-1]['value']} over {lengths[0]['value']} new tokens: {flat:.2f} "
            f"(TRL {trl_flat:.2f}), bar <= {FLAT_BAR} (flat): {verdict}"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="GRPO cost curves: ours vs TRL (bench_grpo.py --sweep)")
    parser.add_argument("--steps", type=int, default=4, help="steps per point and run (default 4)")
    parser.add_argument("--warmup", type=int, default=1, help="first steps not counted (default 1)")
    parser.add_argument("--axes", default=",".join(AXES), help="which axes (comma list of their names)")
    parser.add_argument("--workdir", default=None, help="where the models, data and runs go (default: a temp dir)")
    parser.add_argument("--out", default=None, help="prefix of the outputs (default: <workdir>/sweep)")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must be more than --warmup ({args.warmup})")
    axes = [a for a in args.axes.split(",") if a]
    for axis in axes:
        if axis not in AXES:
            parser.error(f"--axes: unknown axis {axis!r}; allowed: {', '.join(AXES)}")
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_sweep_")
    os.makedirs(workdir, exist_ok=True)
    out = args.out or os.path.join(workdir, "sweep")
    log_path = os.path.join(workdir, "sweep.log")
    start = time.perf_counter()
    shapes = [s for s in unique_shapes() if any(s == shape for a in axes for _, shape in AXES[a])]
    for shape in shapes:
        prepare(workdir, shape.model_size)
    print(
        f"sweep: {len(shapes)} points x {RUNS}, {args.steps} steps each; load {os.getloadavg()[0]:.2f}; log {log_path}"
    )
    rates = bench_grpo.measure_rates(workdir, log_path)["rates"]
    figures: dict[Shape, dict] = {}
    for shape in shapes:
        load = os.getloadavg()[0]
        figures[shape] = {"load": f"{load:.1f}"}
        for run in RUNS:
            result = run_point(run, workdir, args.steps, log_path, shape)
            figures[shape][run] = point_figures(result, args.warmup, shape) if result else None
        figures[shape]["load"] += f"->{os.getloadavg()[0]:.1f}"
        o, t = figures[shape]["ours"], figures[shape]["trl"]
        if o and t:
            print(
                f"  L={shape.response_len} n={shape.n} model={shape.model_size}: ours {o['step_s']:.2f} s, "
                f"TRL {t['step_s']:.2f} s, ratio {o['step_s'] / t['step_s']:.3f} (load {figures[shape]['load']})",
                flush=True,
            )
    rows = [
        {"axis": axis, "value": value, **figures[shape], "floor_s": floor_of(workdir, shape, rates)}
        for axis in axes
        for value, shape in AXES[axis]
        if figures[shape]["ours"] and figures[shape]["trl"]
    ]
    print("\n" + table(rows))
    bar_values = print_bars(rows)
    plot(rows, out + ".png")
    with open(out + ".json", "w", encoding="utf-8") as f:
        json.dump({"rows": rows, "rates": rates, "bars": bar_values, "steps": args.steps}, f, indent=2, default=str)
    with open(out + ".md", "w", encoding="utf-8") as f:
        f.write(table(rows) + "\n")
    print(f"\n{out}.png, {out}.md, {out}.json written; sweep took {time.perf_counter() - start:.0f} s")
    return 0
