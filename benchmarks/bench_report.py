"""Figures of a `bench_grpo.py` run: per-run medians, where each phase's time went, the FLOP floor, and the bars.

Owns `summarize` (per run name: medians over the counted steps pooled over rounds, peak memory, orchestration
share, phase and probe medians), `floor_figures`, `bars` (each bar of the issue: measured, limit, met or not, by
how much) and the printing of all of it. Every ratio is computed from runs of the same script run.
A benchmark helper (benchmarks/ is not a package); imports nothing of the trainer.
"""

from __future__ import annotations

import statistics

# (key in the bars dict, what it compares, limit, "<=" or ">=")
BAR_SPECS = [
    ("ray/single_process step time", "ours (Ray) step time / ours-single_process step time", 1.05, "<="),
    ("ray orchestration share", "1 - sum(phases) / wall time of the whole step (Ray)", 0.05, "<="),
    ("ray/trl peak RSS", "peak RSS of all processes, Ray daemons included: ours (Ray) / TRL", 1.0, "<="),
    ("ray/floor step time", "ours (Ray) step time / FLOP floor at the model's matmul shapes", 2.5, "<="),
    ("ray/trl step time", "ours (Ray) step time / TRL step time", 0.5, "<="),
    ("ray/bare-hf generation tokens/s", "ours (Ray) generation tokens/s / bare HF generate", 1.0, ">="),
]
PROBE_PHASES = ("step", "gen", "ref", "update_actor")


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _orchestration_shares(run: dict, warmup: int) -> list[float]:
    """Per counted step: 1 - (sum of the phases) / (wall time of the whole step, log call to log call)."""
    shares = []
    timing, walls = run["timing"], run["wall_s"]
    for i in range(warmup, len(timing.get("step", []))):
        wall = walls[i] if i < len(walls) else None
        if not wall:
            continue
        inner = sum(v[i] for k, v in timing.items() if k != "step" and i < len(v))
        shares.append(1.0 - inner / wall)
    return shares


def _probe_medians(runs: list[dict], warmup: int) -> dict[str, dict[str, float]]:
    steps = [s for r in runs for s in r.get("probe", [])[warmup:]]
    out = {}
    for phase in PROBE_PHASES:
        rows = [s[phase] for s in steps if phase in s]
        if rows:
            out[phase] = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    return out


def _cpu_per_step_by_process(runs: list[dict], warmup: int) -> dict[str, float]:
    """Median CPU seconds per counted step of each process (by short name) of ours' process tree."""
    deltas: dict[str, list[float]] = {}
    for r in runs:
        steps = r.get("probe", [])
        for before, after in zip(steps[max(warmup - 1, 0) :], steps[max(warmup, 1) :]):
            a, b = before.get("cpu_by_process", {}), after.get("cpu_by_process", {})
            for name in b:
                deltas.setdefault(name, []).append(b[name] - a.get(name, 0.0))
    return {name: statistics.median(v) for name, v in deltas.items()}


def summarize(results: list[dict], warmup: int) -> dict[str, dict]:
    """Per run name: median step/wall/gen seconds (pooled over rounds, warm-up steps dropped), tokens/s,
    phase medians, the orchestration share, CPU figures per phase and the peak memory (max over rounds)."""
    summary: dict[str, dict] = {}
    for name in dict.fromkeys(r["name"] for r in results):
        runs = [r for r in results if r["name"] == name]

        def pooled(key: str, runs=runs) -> list[float]:
            return [v for r in runs for v in r[key][warmup:] if v is not None]

        gen, tokens = pooled("gen_s"), pooled("gen_tokens")
        entry = {
            "kind": runs[0]["kind"],
            "rounds": len(runs),
            "step_s": _median(pooled("step_s")),
            "step_s_per_round": [_median(r["step_s"][warmup:]) for r in runs],
            "cpu_s": _median([v for r in runs for v in r.get("cpu_s", [])[warmup:]]),
            "wall_s": _median(pooled("wall_s")),
            "gen_s": _median(gen),
            "gen_tokens_per_s": sum(tokens) / sum(gen) if gen and sum(gen) > 0 else None,
            "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
            "peak_rss_work_mb": max(r["peak_rss_work_mb"] for r in runs),
            "peak_pss_mb": max(r.get("peak_pss_mb", 0.0) for r in runs),
            "peak_rss_by_process_mb": _peak_by_process(runs),
            "load": [r.get("load") for r in runs],
        }
        if "timing" in runs[0]:
            phases = sorted({k for r in runs for k in r["timing"]})
            entry["phases_s"] = {
                k: _median([v for r in runs for v in r["timing"].get(k, [])[warmup:]]) or 0.0 for k in phases
            }
            entry["orchestration_share"] = _median([s for r in runs for s in _orchestration_shares(r, warmup)])
            entry["probe"] = _probe_medians(runs, warmup)
            entry["cpu_per_step_by_process"] = _cpu_per_step_by_process(runs, warmup)
            entry["compute_process"] = runs[0].get("compute_process")
        summary[name] = entry
    return summary


def _peak_by_process(runs: list[dict]) -> dict[str, float]:
    """Peak RSS per process name (the largest over rounds; several processes of one name summed)."""
    out: dict[str, float] = {}
    for r in runs:
        per_name: dict[str, float] = {}
        for _pid, (_kind, name, peak) in r.get("peak_rss_by_pid", {}).items():
            per_name[name] = per_name.get(name, 0.0) + peak
        for name, peak in per_name.items():
            out[name] = max(out.get(name, 0.0), peak)
    return out


def floor_figures(rates: dict | None, ours: dict | None) -> dict | None:
    """Floor seconds (see flops.py) and ours / floor, from the rates run and ours' summary."""
    if not rates:
        return None
    import flops

    seconds = flops.floor_seconds(rates["flops"], rates["rates"])
    out = {
        "tflop_ours_count": sum(rates["flops"].values()) / 1e12,
        "tflop_padded_count": sum(rates["flops_padded"].values()) / 1e12,
        "gflops_rates": {k: v / 1e9 for k, v in rates["rates"].items()},
        "floor_s": seconds,
    }
    if ours and ours.get("step_s"):
        out["ours/floor"] = ours["step_s"] / seconds["floor"]
        out["ours/floor_large_square"] = ours["step_s"] / seconds["floor_large_square"]
        out["achieved_gflops"] = sum(rates["flops"].values()) / ours["step_s"] / 1e9
    return out


def bars(summary: dict[str, dict], floor: dict | None) -> dict[str, float]:
    """The measured value of every bar whose runs ran (see BAR_SPECS)."""
    ours, single = summary.get("ours"), summary.get("ours-single_process")
    trl, bare = summary.get("trl"), summary.get("bare-hf")
    out: dict[str, float] = {}
    if not ours:
        return out
    if single:
        out["ray/single_process step time"] = ours["step_s"] / single["step_s"]
    if ours.get("orchestration_share") is not None:
        out["ray orchestration share"] = ours["orchestration_share"]
    if trl:
        out["ray/trl peak RSS"] = ours["peak_rss_mb"] / trl["peak_rss_mb"]
        out["ray/trl step time"] = ours["step_s"] / trl["step_s"]
    if floor and "ours/floor" in floor:
        out["ray/floor step time"] = floor["ours/floor"]
    if bare and bare.get("gen_tokens_per_s") and ours.get("gen_tokens_per_s"):
        out["ray/bare-hf generation tokens/s"] = ours["gen_tokens_per_s"] / bare["gen_tokens_per_s"]
    return out


def ratios(summary: dict[str, dict]) -> dict[str, float]:
    """Ratios beside the bars, for each of ours' runs against TRL and bare HF."""
    out = {}
    trl, bare = summary.get("trl"), summary.get("bare-hf")
    for name, e in summary.items():
        if e["kind"] != "ours" or not e.get("step_s"):
            continue
        if trl:
            out[f"{name}/trl step time"] = e["step_s"] / trl["step_s"]
            if e.get("cpu_s") and trl.get("cpu_s"):  # does not depend on the load: CPU seconds per step
                out[f"{name}/trl CPU seconds per step"] = e["cpu_s"] / trl["cpu_s"]
            out[f"{name}/trl peak RSS (all processes)"] = e["peak_rss_mb"] / trl["peak_rss_mb"]
            out[f"{name}/trl peak RSS (driver + workers)"] = e["peak_rss_work_mb"] / trl["peak_rss_mb"]
            if e["peak_pss_mb"] and trl["peak_pss_mb"]:
                out[f"{name}/trl peak PSS (all processes)"] = e["peak_pss_mb"] / trl["peak_pss_mb"]
        if bare:
            out[f"{name}/bare-hf step time"] = e["step_s"] / bare["step_s"]
    return out


# ------------------------------------------------------------------------------------------------ print
def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _load(entry: dict) -> str:
    loads = [x for x in entry["load"] if x]
    return ", ".join(f"{a[0]:.1f}->{b[0]:.1f}" for a, b in loads) if loads else "-"


def print_report(summary: dict[str, dict], floor: dict | None, bar_values: dict[str, float], ratio: dict) -> None:
    header = (
        f"{'run':<26}{'step s':>8}{'wall s':>8}{'CPU s':>7}{'gen s':>8}{'gen tok/s':>10}{'RSS MB':>8}{'RSS work':>9}"
        f"{'PSS MB':>8}{'orch':>7}  load (1-min, start->end of each round)"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for name, e in summary.items():
        orch = e.get("orchestration_share")
        print(
            f"{name:<26}{_fmt(e['step_s']):>8}{_fmt(e['wall_s']):>8}{_fmt(e.get('cpu_s')):>7}{_fmt(e['gen_s']):>8}"
            f"{_fmt(e['gen_tokens_per_s'], 0):>10}{e['peak_rss_mb']:>8.0f}{e['peak_rss_work_mb']:>9.0f}"
            f"{e['peak_pss_mb']:>8.0f}{'-' if orch is None else f'{orch:.2%}':>7}  {_load(e)}"
        )
    for name, e in summary.items():
        parts = ", ".join(f"{k} {v:.0f}" for k, v in sorted(e["peak_rss_by_process_mb"].items(), key=lambda kv: -kv[1]))
        print(f"  {name} peak RSS by process (MB, each at its own peak): {parts}")
        if e.get("phases_s"):
            print(f"  {name} phases (median s): " + ", ".join(f"{k} {v:.2f}" for k, v in e["phases_s"].items()))
    print_probe(summary)
    print_floor(floor)
    print("\nratios (same script run):")
    for key, value in ratio.items():
        print(f"  {key:<56}{value:.3f}")
    print_bars(bar_values)


def print_probe(summary: dict[str, dict]) -> None:
    """Per phase of ours' runs: wall and CPU seconds of the compute process, the driver, Ray's daemons and
    every other process on the machine; CPU/wall of the compute process is the number of cores it got."""
    entries = {name: e for name, e in summary.items() if e.get("probe")}
    if not entries:
        return
    print("\nwhere the time went (median per step; CPU = user + system seconds; 'others' = every process not ours)")
    print(
        f"  {'run':<26}{'phase':<14}{'wall':>7}{'compute CPU':>12}{'cores':>7}{'busy thr':>9}{'driver':>8}"
        f"{'daemons':>8}{'others':>8}{'preempt':>9}{'faults':>9}"
    )
    for name, e in entries.items():
        for phase, p in e["probe"].items():
            cores = p["compute_cpu_s"] / p["wall_s"] if p["wall_s"] else 0.0
            print(
                f"  {name:<26}{phase:<14}{p['wall_s']:>7.2f}{p['compute_cpu_s']:>12.2f}{cores:>7.2f}"
                f"{p['busy_threads']:>9.0f}{p['driver_cpu_s']:>8.2f}{p['rest_of_tree_cpu_s']:>8.2f}"
                f"{p['other_processes_cpu_s']:>8.2f}{p['involuntary_ctx_switches']:>9.0f}{p.get('minor_faults', 0):>9.0f}"
            )
        by_process = sorted(e.get("cpu_per_step_by_process", {}).items(), key=lambda kv: -kv[1])
        print(f"  {name:<26}CPU s per step by process: " + ", ".join(f"{k} {v:.3f}" for k, v in by_process))
        info = e.get("compute_process") or {}
        print(
            f"  {name:<26}compute process: nice {info.get('nice')}, affinity {info.get('affinity')}, "
            f"{info.get('os_threads')} OS threads, env {info.get('env')}"
        )


def print_floor(floor: dict | None) -> None:
    if not floor:
        return
    rates, seconds = floor["gflops_rates"], floor["floor_s"]
    print(
        f"\nfloor: {floor['tflop_ours_count']:.3f} TFLOP per step (the least work; padded as TRL/bare HF: "
        f"{floor['tflop_padded_count']:.3f}); float32 matmul GFLOP/s: decode shapes {rates['decode']:.1f}, "
        f"training shapes {rates['train']:.1f}, {2048}^3 {rates['large_square']:.1f}"
    )
    print(
        "  floor s: "
        + ", ".join(f"{k} {v:.2f}" for k, v in seconds.items() if k not in ("floor", "floor_large_square"))
        + f" -> floor {seconds['floor']:.2f} s (all at the large-square rate: {seconds['floor_large_square']:.2f} s)"
    )
    if "ours/floor" in floor:
        print(
            f"  ours / floor {floor['ours/floor']:.2f} (/ large-square floor {floor['ours/floor_large_square']:.2f});"
            f" ours runs at {floor['achieved_gflops']:.1f} GFLOP/s of useful matmul work"
        )


def print_bars(bar_values: dict[str, float]) -> None:
    print("\nbars (measured in this script run):")
    for key, what, limit, sense in BAR_SPECS:
        if key not in bar_values:
            print(f"  {what:<80} not measured (its runs did not run)")
            continue
        value = bar_values[key]
        met = value <= limit if sense == "<=" else value >= limit
        margin = (limit - value) / limit if sense == "<=" else (value - limit) / limit
        verdict = f"met, {margin:.0%} to spare" if met else f"MISSED by {-margin:.0%}"
        print(f"  {what:<80} {value:7.3f}  bar {sense} {limit:<5} {verdict}")
