"""Experiment tracking: one `Tracking.log(metrics, step)` call fans out to the console, TensorBoard,
a `metrics.jsonl` file (always written, read by `verl.utils.plot`) and wandb when asked.

Layer 1 (utils): no Ray, no trainer logic.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

SUPPORTED_BACKENDS = ("console", "tensorboard", "wandb", "file")  # file: metrics.jsonl, always written

# metrics shown on the one console line per step, in this order, when present
CONSOLE_KEYS = (
    "critic/score/mean",
    "val/reward/mean",
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/entropy",
    "actor/grad_norm",
    "response_length/mean",
    "timing_s/step",
)


def _short(key: str) -> str:
    return {
        "critic/score/mean": "score",
        "val/reward/mean": "val",
        "actor/pg_loss": "pg_loss",
        "actor/kl_loss": "kl",
        "actor/entropy": "entropy",
        "actor/grad_norm": "gnorm",
        "response_length/mean": "resp_len",
        "timing_s/step": "s/step",
    }.get(key, key)


def format_console_line(step: int, metrics: dict[str, Any]) -> str:
    parts = [f"step {step}"]
    for key in CONSOLE_KEYS:
        if key in metrics:
            parts.append(f"{_short(key)} {float(metrics[key]):.4g}")
    return " | ".join(parts)


def _md_cell(text: str, limit: int = 500) -> str:
    """One markdown table cell: pipes escaped, newlines as <br>, long text cut."""
    text = text if len(text) <= limit else text[:limit] + " ..."
    return text.replace("|", "\\|").replace("\n", "<br>")


class Tracking:
    """Log scalar metrics to the chosen backends.

    Args:
        project_name, experiment_name: names used by wandb and in the console header.
        default_backend: list of backends among SUPPORTED_BACKENDS.
        log_dir: folder for TensorBoard event files and metrics.jsonl.
        config: run config (a plain dict) stored with wandb runs.
        print_fn: where console lines go (tqdm.write keeps a progress bar intact).
    """

    def __init__(
        self, project_name: str, experiment_name: str, default_backend, log_dir: str, config=None, print_fn=print
    ):
        backends = [default_backend] if isinstance(default_backend, str) else list(default_backend or [])
        for backend in backends:
            if backend not in SUPPORTED_BACKENDS:
                raise ValueError(f"trainer.logger has unknown backend {backend!r}; allowed: {list(SUPPORTED_BACKENDS)}")
        self.backends = backends
        self.log_dir = log_dir
        self.print_fn = print_fn
        os.makedirs(log_dir, exist_ok=True)
        self._jsonl = open(os.path.join(log_dir, "metrics.jsonl"), "a", encoding="utf-8")
        self._tb = None
        self._wandb = None
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=os.path.join(log_dir, "tensorboard"))
        if "wandb" in backends:
            try:
                import wandb
            except ImportError as e:
                raise ImportError(
                    "trainer.logger includes 'wandb' but wandb is not installed: pip install -e .[wandb]"
                ) from e
            self._wandb = wandb.init(project=project_name, name=experiment_name, config=config)

    def log(self, data: dict[str, Any], step: int) -> None:
        clean = {}
        for key, value in data.items():
            try:
                clean[key] = float(value)
            except (TypeError, ValueError):
                continue
        record = {"step": step, **{k: (v if math.isfinite(v) else str(v)) for k, v in clean.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in clean.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        if "console" in self.backends:
            self.print_fn(format_console_line(step, clean))

    def log_generations(self, rows: list[dict[str, Any]], step: int) -> None:
        """A few validation samples ({input, output, score}) as a table: appended to `val_generations.jsonl`,
        a markdown table in TensorBoard (text tab, `val/generations`), a wandb Table when wandb is on."""
        if not rows:
            return
        with open(os.path.join(self.log_dir, "val_generations.jsonl"), "a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}) + "\n")
        if self._tb is not None:
            lines = ["| input | output | score |", "|---|---|---|"]
            for row in rows:
                cells = [_md_cell(row["input"]), _md_cell(row["output"]), f"{float(row['score']):.4g}"]
                lines.append("| " + " | ".join(cells) + " |")
            self._tb.add_text("val/generations", "\n".join(lines), step)
            self._tb.flush()
        if self._wandb is not None:
            import wandb

            table = wandb.Table(columns=["step", "input", "output", "score"])
            for row in rows:
                table.add_data(step, row["input"], row["output"], float(row["score"]))
            self._wandb.log({"val/generations": table}, step=step)

    def finish(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
