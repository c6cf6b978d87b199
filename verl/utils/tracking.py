"""Experiment tracking: `Tracking.log(metrics, step)` fans out to the backends `trainer.logger` names (verl's list) and
always to `<log_dir>/metrics.jsonl` (read by `verl.utils.plot`). An unknown name stops start-up; a backend that is
missing or cannot reach its server costs one notice (wandb, swanlab and clearml go offline, mlflow writes a local
store). Layer 1: no Ray.
"""

from __future__ import annotations

import importlib
import json
import math
import netrc
import os
import re
import socket
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

SUPPORTED_BACKENDS = (
    "console",
    "wandb",
    "tensorboard",
    "mlflow",
    "swanlab",
    "clearml",
    "trackio",
    "file",
    "vemlp_wandb",
    "rl_insight",
)

# metrics shown on the one console line per step, in this order, when present
CONSOLE_KEYS = (
    "critic/score/mean",
    "val/reward/mean",
    "val/reward/greedy",
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/entropy",
    "actor/grad_norm",
    "response_length/mean",
    "timing_s/step",
)
SHORT_NAMES = {
    "critic/score/mean": "score",
    "val/reward/mean": "val",
    "val/reward/greedy": "val_greedy",
    "actor/pg_loss": "pg_loss",
    "actor/kl_loss": "kl",
    "actor/entropy": "entropy",
    "actor/grad_norm": "gnorm",
    "response_length/mean": "resp_len",
    "timing_s/step": "s/step",
}


def format_console_line(step: int, metrics: dict[str, Any]) -> str:
    parts = [f"step {step}"]
    for key in CONSOLE_KEYS:
        if key in metrics:
            parts.append(f"{SHORT_NAMES[key]} {float(metrics[key]):.4g}")
    return " | ".join(parts)


def _md_cell(text: str, limit: int = 500) -> str:
    """One markdown table cell: pipes escaped, newlines as <br>, long text cut."""
    text = text if len(text) <= limit else text[:limit] + " ..."
    return text.replace("|", "\\|").replace("\n", "<br>")


def parse_backends(default_backend) -> list[str]:
    """`trainer.logger` as a list: a single string or a list/tuple of names (verl's deprecated `tracking` reads as
    `wandb`); ValueError naming the value and the allowed names otherwise."""
    names = [default_backend] if isinstance(default_backend, str) else list(default_backend or [])
    backends: list[str] = []
    for name in names:
        name = "wandb" if name == "tracking" else name
        if name not in SUPPORTED_BACKENDS:
            raise ValueError(f"trainer.logger has unknown backend {name!r}; allowed: {list(SUPPORTED_BACKENDS)}")
        if name not in backends:
            backends.append(name)
    return backends


def _import(name: str):
    """The module `name`, or None when it is not installed (or fails to import)."""
    try:
        return importlib.import_module(name)
    except Exception:
        return None


def _reachable(url: str, timeout: float = 2.0) -> bool:
    parsed = urlparse(url)
    try:
        socket.create_connection((parsed.hostname, parsed.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _wandb_key_known(base_url: str) -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators(urlparse(base_url).hostname) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as {"a/b/c": value} (lists by index), for mlflow parameters."""
    out: dict[str, Any] = {}
    items = config.items() if isinstance(config, Mapping) else enumerate(config) if isinstance(config, list) else None
    if items is None:
        return {prefix: config} if prefix else {}
    for key, value in items:
        out.update(_flatten(value, f"{prefix}/{key}" if prefix else str(key)))
    return out


class Tracking:
    """Log scalar metrics (and validation generation tables) to the chosen backends.

    Args:
        project_name, experiment_name: the run's names for every backend.
        default_backend: `trainer.logger`, one name or a list among SUPPORTED_BACKENDS.
        log_dir: folder for metrics.jsonl, val_generations.jsonl, TensorBoard events (unless TENSORBOARD_DIR is
            set) and the local stores of offline backends; default `logs/<project>/<experiment>`.
        config: the run config (a plain dict) stored with wandb/mlflow/swanlab/clearml/trackio runs.
        print_fn: where console lines and notices go (tqdm.write keeps a progress bar intact).
    """

    def __init__(
        self,
        project_name: str,
        experiment_name: str,
        default_backend="console",
        log_dir: str | None = None,
        config: dict | None = None,
        print_fn=print,
    ):
        self.backends = parse_backends(default_backend)
        self.project_name, self.experiment_name = project_name, experiment_name
        self.log_dir = log_dir or os.path.join("logs", str(project_name), str(experiment_name))
        self.config = config
        self.print_fn = print_fn
        self.notices: list[str] = []
        self._finished = False
        os.makedirs(self.log_dir, exist_ok=True)
        self._jsonl = open(os.path.join(self.log_dir, "metrics.jsonl"), "a", encoding="utf-8")
        self._file = None  # verl's `file` backend
        self._tb = None
        self._wandb = None  # the wandb (or vemlp wandb) run
        self._wandb_name, self._wandb_module = "wandb", None
        self._mlflow = None
        self._swanlab = None
        self._clearml = None
        self._trackio = None
        self._rl_insight = None
        for backend in self.backends:
            if backend == "console":
                continue
            try:
                getattr(self, f"_start_{backend}")()
            except Exception as err:  # a backend that cannot start must not cost the run
                self._notice(f"trainer.logger: {backend} could not start ({type(err).__name__}: {err}); skipping it")

    def _notice(self, text: str) -> None:
        self.notices.append(text)
        self.print_fn(f"notice: {text}")

    def _missing(self, backend: str, package: str) -> None:
        self._notice(f"trainer.logger: {backend} is not installed (pip install {package}); skipping it")

    # ------------------------------------------------------------------ starting each backend
    def _start_file(self) -> None:
        """verl's FileLogger: `{"step", "data"}` lines at VERL_FILE_LOGGER_PATH, else
        `$VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl` (root default `.`); appended, so a resume keeps history."""
        path = os.getenv("VERL_FILE_LOGGER_PATH")
        if path is None:
            root = os.path.expanduser(os.getenv("VERL_FILE_LOGGER_ROOT", "."))
            path = os.path.join(root, str(self.project_name), f"{self.experiment_name}.jsonl")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")

    def _start_tensorboard(self) -> None:
        if _import("tensorboard") is None:
            return self._missing("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self._tb = SummaryWriter(log_dir=os.environ.get("TENSORBOARD_DIR") or os.path.join(self.log_dir, "tensorboard"))

    def _start_wandb(self) -> None:
        wandb = _import("wandb")
        if wandb is None:
            return self._missing("wandb", "wandb")
        mode = os.environ.get("WANDB_MODE")
        if mode is None:
            base_url = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
            if not _wandb_key_known(base_url):
                mode, why = "offline", "no API key (WANDB_API_KEY or `wandb login`)"
            elif not _reachable(base_url):
                mode, why = "offline", f"{base_url} is not reachable"
            if mode == "offline":
                self._notice(
                    f"trainer.logger: wandb runs offline ({why}); sync later with `wandb sync {self.log_dir}/wandb`"
                )
        proxy = ((self.config or {}).get("trainer") or {}).get("wandb_proxy")
        self._wandb = wandb.init(
            project=self.project_name,
            name=self.experiment_name,
            entity=os.environ.get("WANDB_ENTITY"),
            config=self.config,
            dir=self.log_dir,
            mode=mode,
            settings=wandb.Settings(https_proxy=proxy) if proxy else None,
        )
        self._wandb_module = wandb

    def _start_vemlp_wandb(self) -> None:
        platform = _import("volcengine_ml_platform")
        if platform is None:
            return self._missing("vemlp_wandb", "volcengine-ml-platform")
        keys = ("VOLC_ACCESS_KEY_ID", "VOLC_SECRET_ACCESS_KEY", "MLP_TRACKING_REGION")
        if not all(os.environ.get(k) for k in keys):
            return self._notice(
                f"trainer.logger: vemlp_wandb needs the environment variables {list(keys)}; skipping it"
            )
        from volcengine_ml_platform import wandb as vemlp_wandb

        platform.init(ak=os.environ[keys[0]], sk=os.environ[keys[1]], region=os.environ[keys[2]])
        self._wandb = vemlp_wandb.init(
            project=self.project_name, name=self.experiment_name, config=self.config, sync_tensorboard=True
        )
        self._wandb_name, self._wandb_module = "vemlp_wandb", vemlp_wandb

    def _start_mlflow(self) -> None:
        mlflow = _import("mlflow")
        if mlflow is None:
            return self._missing("mlflow", "mlflow")
        uri = os.environ.get("MLFLOW_TRACKING_URI") or "file://" + os.path.abspath(os.path.join(self.log_dir, "mlruns"))
        mlflow.set_tracking_uri(uri)
        run_id = os.environ.get("MLFLOW_RUN_ID")  # set by e.g. Azure ML or Databricks: attach to that run
        if run_id:
            mlflow.start_run(run_id=run_id)
        else:
            experiment = mlflow.set_experiment(str(self.project_name))
            mlflow.start_run(experiment_id=experiment.experiment_id, run_name=str(self.experiment_name))
        params = _flatten(self.config or {})
        if params:
            mlflow.log_params({k: str(v)[:500] for k, v in params.items()})
        self._mlflow = mlflow

    def _start_swanlab(self) -> None:
        swanlab = _import("swanlab")
        if swanlab is None:
            return self._missing("swanlab", "swanlab")
        key, mode = os.environ.get("SWANLAB_API_KEY"), os.environ.get("SWANLAB_MODE")
        if key:
            swanlab.login(key)
        elif mode is None:
            mode = "offline"
            self._notice("trainer.logger: swanlab runs offline (no SWANLAB_API_KEY); its files stay under the log dir")
        swanlab.init(
            project=self.project_name,
            experiment_name=self.experiment_name,
            config={"FRAMEWORK": "verl", **(self.config or {})},
            logdir=os.environ.get("SWANLAB_LOG_DIR") or os.path.join(self.log_dir, "swanlog"),
            mode=mode or "cloud",
        )
        self._swanlab = swanlab

    def _start_clearml(self) -> None:
        clearml = _import("clearml")
        if clearml is None:
            return self._missing("clearml", "clearml")
        configured = os.environ.get("CLEARML_API_ACCESS_KEY") or os.path.isfile(os.path.expanduser("~/clearml.conf"))
        if not configured:
            clearml.Task.set_offline(offline_mode=True)
            self._notice("trainer.logger: clearml runs offline (no CLEARML_API_ACCESS_KEY or ~/clearml.conf)")
        task = clearml.Task.init(
            task_name=self.experiment_name, project_name=self.project_name, continue_last_task=True, output_uri=False
        )
        task.connect_configuration(self.config or {}, name="Hyperparameters")
        self._clearml = task

    def _start_trackio(self) -> None:
        trackio = _import("trackio")
        if trackio is None:
            return self._missing("trackio", "trackio")
        trackio.init(project=self.project_name, name=self.experiment_name, config=self.config)
        self._trackio = trackio

    def _start_rl_insight(self) -> None:
        rl_insight = _import("rl_insight")
        if rl_insight is None:
            return self._missing("rl_insight", "rl-insight")
        if os.getenv("VERL_RL_INSIGHT_ENABLE") != "1":
            return self._notice("trainer.logger: rl_insight is off unless VERL_RL_INSIGHT_ENABLE=1 (as in verl)")
        settings = ((self.config or {}).get("trainer") or {}).get("rl_insight") or {}
        rl_insight.init(project=self.project_name, experiment_name=self.experiment_name, config=settings)
        self._rl_insight = rl_insight

    # ------------------------------------------------------------------ logging
    def _each(self, what: str, name: str, call) -> None:
        """Run one backend's call; a failure costs one notice and that backend (the run goes on)."""
        try:
            call()
        except Exception as err:
            self._notice(f"trainer.logger: {name} failed to {what} ({type(err).__name__}: {err}); it is switched off")
            setattr(self, {"wandb": "_wandb", "vemlp_wandb": "_wandb"}.get(name, f"_{name}"), None)

    def log(self, data: dict[str, Any], step: int, backend=None) -> None:
        """Log the numeric values of `data` at `step` (other values are dropped); `backend` restricts the call to
        the named backends, as in verl (metrics.jsonl is always written)."""
        clean = {}
        for key, value in data.items():
            try:
                clean[key] = float(value)
            except (TypeError, ValueError):
                continue
        record = {"step": step, **{k: (v if math.isfinite(v) else str(v)) for k, v in clean.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        wanted = lambda name: name in self.backends and (backend is None or name in backend)  # noqa: E731
        if self._file is not None and wanted("file"):
            values = {k: v for k, v in record.items() if k != "step"}
            self._file.write(json.dumps({"step": step, "data": values}) + "\n")
            self._file.flush()
        if self._tb is not None and wanted("tensorboard"):
            for key, value in clean.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None and wanted(self._wandb_name):
            self._each("log", self._wandb_name, lambda: self._wandb.log(clean, step=step))
        if self._mlflow is not None and wanted("mlflow"):
            metrics = {re.sub(r"[^/\w.\- :]", "_", k.replace("@", "_at_")): v for k, v in clean.items()}
            self._each("log", "mlflow", lambda: self._mlflow.log_metrics(metrics, step=step))
        if self._swanlab is not None and wanted("swanlab"):
            self._each("log", "swanlab", lambda: self._swanlab.log(clean, step=step))
        if self._clearml is not None and wanted("clearml"):
            self._each("log", "clearml", lambda: self._clearml_log(clean, step))
        if self._trackio is not None and wanted("trackio"):
            self._each("log", "trackio", lambda: self._trackio.log(clean, step=step))
        if self._rl_insight is not None and wanted("rl_insight"):
            self._each(
                "log",
                "rl_insight",
                lambda: [self._rl_insight.metric_gauge(k.replace("/", "_"), v) for k, v in clean.items()],
            )
        if wanted("console"):
            self.print_fn(format_console_line(step, clean))

    def _clearml_log(self, clean: dict[str, float], step: int) -> None:
        logger = self._clearml.get_logger()
        for key, value in clean.items():
            title, _, series = key.partition("/")
            logger.report_scalar(title=title, series=series or title, value=value, iteration=step)

    def log_generations(self, rows: list[dict[str, Any]], step: int) -> None:
        """A few validation samples ({input, output, score}) as a table: appended to `val_generations.jsonl`,
        a markdown table in TensorBoard (text tab, `val/generations`), a wandb Table, an mlflow artifact."""
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
            table = self._wandb_module.Table(columns=["step", "input", "output", "score"])
            for row in rows:
                table.add_data(step, row["input"], row["output"], float(row["score"]))
            self._each(
                "log generations", self._wandb_name, lambda: self._wandb.log({"val/generations": table}, step=step)
            )
        if self._mlflow is not None:
            text = json.dumps([{k: row[k] for k in ("input", "output", "score")} for row in rows])
            self._each("log generations", "mlflow", lambda: self._mlflow.log_text(text, f"val_step{step}.json"))

    def finish(self, exit_code: int = 0) -> None:
        """Flush and close every backend, once."""
        if self._finished:
            return
        self._finished = True
        self._jsonl.close()
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._each("finish", self._wandb_name, lambda: self._wandb.finish(exit_code=exit_code))
        if self._mlflow is not None and self._mlflow.active_run() is not None:
            self._each("finish", "mlflow", self._mlflow.end_run)
        for name in ("swanlab", "trackio", "rl_insight"):
            module = getattr(self, f"_{name}")
            if module is not None:
                self._each("finish", name, module.finish)
        if self._clearml is not None:
            self._each("finish", "clearml", self._clearml.close)
