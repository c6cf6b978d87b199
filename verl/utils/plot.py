"""Plot a run's curves (validation reward, training reward, KL, entropy, response length) from its
`metrics.jsonl` into a PNG. `python -m verl.utils.plot <run dir or log dir>` redraws it for any run.

Layer 1 (utils): reads files only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# (title, keys): a panel draws the first of its keys the run logged, or, for the panels in DRAW_ALL, each of them
PANELS = (
    ("validation reward", ("val/reward/mean", "val/reward/greedy")),  # sampled answers' mean, greedy (val_greedy)
    ("training reward", ("critic/score/mean",)),
    ("KL", ("actor/kl_loss", "actor/reward_kl_penalty", "actor/ppo_kl")),  # to the reference, else old -> new policy
    ("entropy", ("actor/entropy",)),
    ("response length", ("response_length/mean",)),
)
DRAW_ALL = ("validation reward",)


def find_metrics_file(path: str) -> str:
    """Return the metrics.jsonl under `path` (the file itself, the log dir, or the run dir)."""
    candidates = [path, os.path.join(path, "metrics.jsonl"), os.path.join(path, "logs", "metrics.jsonl")]
    for candidate in candidates:
        if os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(f"no metrics.jsonl found at {path!r} (looked at {candidates[1:]})")


def read_metrics(metrics_file: str) -> list[dict]:
    """The logged rows, one per line; a line that does not parse (cut by a killed run) is skipped."""
    rows = []
    with open(metrics_file, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)):
            steps.append(row["step"])
            values.append(float(value))
    return steps, values


def plot_run(path: str, out_png: str | None = None) -> str:
    """Draw the run's panels and return the PNG path (default: next to metrics.jsonl)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics_file = find_metrics_file(path)
    rows = read_metrics(metrics_file)
    out_png = out_png or os.path.join(os.path.dirname(metrics_file), "curves.png")
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 3.2))
    for ax, (title, keys) in zip(axes, PANELS):
        drawn = []
        for key in keys:
            steps, values = series(rows, key)
            if steps:
                ax.plot(steps, values, marker="o" if len(steps) < 30 else None, label=key)
                drawn.append(key)
                if title not in DRAW_ALL:
                    break
        if not drawn:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        elif len(drawn) > 1:
            ax.legend(fontsize=7)
        elif len(keys) > 1:  # which of the panel's metrics this run logged
            title = f"{title} ({drawn[0]})"
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=90)
    plt.close(fig)
    return out_png


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("run_dir", help="run folder, its logs folder, or a metrics.jsonl file")
    parser.add_argument("--out", default=None, help="PNG path (default: curves.png beside metrics.jsonl)")
    args = parser.parse_args(argv)
    try:
        print(plot_run(args.run_dir, args.out))
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
