"""Cost curves of a GRPO step: ours (Ray, the default entry point) against TRL's GRPOTrainer over response
length, samples per prompt and model size; run by `python benchmarks/bench_grpo.py --sweep`.

Owns the sweep's points, its runs (each a fresh subprocess through `bench_grpo.launch`), its table and its PNG.
The points run in `--rounds` passes (default 2) that alternate direction: the first goes through the points in
order with ours then TRL at each, the second in reverse order with TRL then ours (ABBA). This machine's speed
drifts 10-20% over minutes; a linear drift then weighs on both runs of a point alike and on the first and last
point alike, so neither ours/TRL nor the growth of generation time along the length axis reads the drift. A
point's figures pool the counted steps of all its rounds; the table also gives ours/TRL of each round.

Every point is the bench config (bench_runs.py) with one thing changed: response length 64, 128, 256, 512 new
tokens, n = 4, 8, 16 samples per prompt, model size "s" (the bench model, ~3.5M parameters) and "s4x" (hidden 384,
8 layers: ~4x the matmul work per token); the model is made to emit until the limit (ours: `rollout.ignore_eos`;
TRL: `min_new_tokens`), so every row has the same length. A cut sweep resumes: runs already finished in the
workdir (same run, point, steps and round) are reused, and a run that fails (killed for memory on a shared
machine) leaves its round of the point out of the table instead of stopping the sweep. Figures per point: median
step time, response tokens per second of step time, generation time per generated token (flat in response length
when the KV cache is preallocated: no per-step copy of the cache), the FLOP floor (flops.py, one matmul-rate
measurement for the whole sweep) and ours / TRL.

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


def finished_result(workdir: str, run: str, shape: Shape, steps: int, index: int = 0) -> dict | None:
    """The `index`-th (in the order they were written) complete result of `run` at `shape` with `steps` steps
    left in `workdir` by an earlier (cut) sweep, or None."""
    wanted = json.loads(shape.to_json())
    found = 0
    for name in sorted(os.listdir(workdir)):  # result_<run>_<time_ns>.json: in the order written
        if not name.startswith(f"result_{run}_"):
            continue
        with open(os.path.join(workdir, name), encoding="utf-8") as f:
            result = json.load(f)
        if result.get("shape") == wanted and "peak_rss_mb" in result and len(result["step_s"]) == steps:
            if found == index:
                return result
            found += 1
    return None


def run_point(run: str, workdir: str, steps: int, log_path: str, shape: Shape, round_index: int = 0) -> dict | None:
    """The result of `run` at `shape` in round `round_index`: an earlier one from `workdir`, else a fresh run;
    None if the run failed (e.g. killed for memory: the sweep goes on and the table shows the point as missing)."""
    result = finished_result(workdir, run, shape, steps, round_index)
    if result is not None:
        return result
    try:
        return bench_grpo.launch(run, workdir, steps, log_path, shape)
    except RuntimeError as e:
        print(f"  {run} at L={shape.response_len} n={shape.n} model={shape.model_size} failed: {e}", flush=True)
        return None


def counted(results: list[dict], key: str, warmup: int) -> list[float]:
    """`key`'s per-step values of every result, each without its first `warmup` steps."""
    return [value for result in results for value in result[key][warmup:]]


def median_step(result: dict, warmup: int) -> float:
    """Median step seconds of one run, its first `warmup` steps not counted."""
    return statistics.median(result["step_s"][warmup:])


def point_figures(results: list[dict], warmup: int, shape: Shape) -> dict:
    """Over the counted steps of `results` (one run per round): median step seconds, response tokens per second
    of step time, generation microseconds per token, and each round's median step seconds."""
    step = statistics.median(counted(results, "step_s", warmup))
    gen, tokens = counted(results, "gen_s", warmup), counted(results, "gen_tokens", warmup)
    cpu = counted(results, "cpu_s", warmup) if all(r.get("cpu_s") for r in results) else []
    return {
        "step_s": step,
        "round_step_s": [median_step(r, warmup) for r in results],
        "tokens_per_s": PROMPTS_PER_STEP * shape.n * shape.response_len / step,
        "gen_s": statistics.median(gen),
        "cpu_s": statistics.median(cpu) if cpu else None,
        "gen_us_per_token": 1e6 * sum(gen) / sum(tokens),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in results),
    }


def round_ratios(row: dict) -> str:
    """ours / TRL step time of each round at a point, e.g. "0.45, 0.52"."""
    pairs = zip(row["ours"]["round_step_s"], row["trl"]["round_step_s"])
    return ", ".join(f"{o / t:.3f}" for o, t in pairs)


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
        "| axis | value | ours s/step | TRL s/step | ours/TRL | by round | ours/TRL CPU s | ours tok/s | TRL tok/s "
        "| ours gen us/token | TRL gen us/token | floor s | ours/floor | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        o, t = r["ours"], r["trl"]
        cpu = f"{o['cpu_s'] / t['cpu_s']:.3f}" if o.get("cpu_s") and t.get("cpu_s") else "-"
        lines.append(
            f"| {r['axis']} | {r['value']} | {o['step_s']:.2f} | {t['step_s']:.2f} | {o['step_s'] / t['step_s']:.3f} "
            f"| {round_ratios(r)} | {cpu} "
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


def run_rounds(
    shapes: list[Shape], rounds: int, steps: int, warmup: int, workdir: str, log_path: str
) -> tuple[dict[Shape, dict[str, dict[int, dict]]], dict[Shape, list[str]]]:
    """Every point's runs in `rounds` passes of alternating direction (module docstring): shape -> run -> round ->
    result (a failed run leaves its round out), and each point's load average before -> after, per round."""
    results: dict[Shape, dict[str, dict[int, dict]]] = {shape: {run: {} for run in RUNS} for shape in shapes}
    loads: dict[Shape, list[str]] = {shape: [] for shape in shapes}
    for round_index in range(rounds):
        forward = round_index % 2 == 0  # odd rounds: the points in reverse order, TRL first (ABBA)
        for shape in shapes if forward else shapes[::-1]:
            load = os.getloadavg()[0]
            for run in RUNS if forward else RUNS[::-1]:
                result = run_point(run, workdir, steps, log_path, shape, round_index)
                if result is not None:
                    results[shape][run][round_index] = result
            loads[shape].append(f"{load:.1f}->{os.getloadavg()[0]:.1f}")
            ours, trl = (results[shape][run].get(round_index) for run in RUNS)
            if ours and trl:
                o, t = median_step(ours, warmup), median_step(trl, warmup)
                print(
                    f"  round {round_index + 1} L={shape.response_len} n={shape.n} model={shape.model_size}: "
                    f"ours {o:.2f} s, TRL {t:.2f} s, ratio {o / t:.3f} (load {loads[shape][-1]})",
                    flush=True,
                )
    return results, loads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="GRPO cost curves: ours vs TRL (bench_grpo.py --sweep)")
    parser.add_argument("--steps", type=int, default=4, help="steps per point and run (default 4)")
    parser.add_argument("--warmup", type=int, default=1, help="first steps not counted (default 1)")
    parser.add_argument(
        "--rounds", type=int, default=2, help="passes over the points, alternating direction (default 2)"
    )
    parser.add_argument("--axes", default=",".join(AXES), help="which axes (comma list of their names)")
    parser.add_argument("--workdir", default=None, help="where the models, data and runs go (default: a temp dir)")
    parser.add_argument("--out", default=None, help="prefix of the outputs (default: <workdir>/sweep)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
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
        f"sweep: {len(shapes)} points x {RUNS}, {args.rounds} rounds (alternating direction), {args.steps} steps "
        f"per run; load {os.getloadavg()[0]:.2f}; log {log_path}"
    )
    rates = bench_grpo.measure_rates(workdir, log_path)["rates"]
    results, loads = run_rounds(shapes, args.rounds, args.steps, args.warmup, workdir, log_path)
    figures: dict[Shape, dict] = {}
    for shape in shapes:  # the rounds in which both runs of the point finished
        rounds = sorted(set(results[shape]["ours"]) & set(results[shape]["trl"]))
        figures[shape] = {"load": ", ".join(loads[shape])}
        for run in RUNS:
            kept = [results[shape][run][i] for i in rounds]
            figures[shape][run] = point_figures(kept, args.warmup, shape) if kept else None
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
        json.dump(
            {"rows": rows, "rates": rates, "bars": bar_values, "steps": args.steps, "rounds": args.rounds},
            f,
            indent=2,
            default=str,
        )
    with open(out + ".md", "w", encoding="utf-8") as f:
        f.write(table(rows) + "\n")
    print(f"\n{out}.png, {out}.md, {out}.json written; sweep took {time.perf_counter() - start:.0f} s")
    return 0
