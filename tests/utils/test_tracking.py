"""trainer.logger backends (verl/utils/tracking.py): one name or a list; a backend that is not installed or cannot
reach its server costs one notice and the run goes on; metrics.jsonl is always written."""

import json
import os
import sys
import types

import pytest

from verl.utils import tracking
from verl.utils.tracking import SUPPORTED_BACKENDS, Tracking


def _jsonl(path):
    return [json.loads(line) for line in open(path)]


@pytest.fixture
def no_credentials(monkeypatch, tmp_path):
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc


def test_a_single_string_is_one_backend(tmp_path):
    lines = []
    tracker = Tracking("p", "e", "console", str(tmp_path), print_fn=lines.append)
    tracker.log({"critic/score/mean": 1.0}, step=1)
    tracker.finish()
    tracker.finish()  # finishing twice is harmless
    assert tracker.backends == ["console"] and lines == ["step 1 | score 1"]


def test_unknown_backend_lists_the_allowed_ones_and_tracking_means_wandb():
    with pytest.raises(ValueError, match=r"unknown backend 'neptune'; allowed: \['console', 'wandb', 'tensorboard'"):
        tracking.parse_backends(["console", "neptune"])
    assert tracking.parse_backends(["tracking", "wandb", "file"]) == ["wandb", "file"]
    assert set(SUPPORTED_BACKENDS) >= {"mlflow", "swanlab", "clearml", "trackio", "file", "vemlp_wandb"}


@pytest.mark.parametrize("backend", ["wandb", "mlflow", "swanlab", "clearml", "trackio", "vemlp_wandb", "rl_insight"])
def test_missing_package_costs_one_notice_and_metrics_are_still_written(tmp_path, monkeypatch, backend):
    for module in ("wandb", "mlflow", "swanlab", "clearml", "trackio", "volcengine_ml_platform", "rl_insight"):
        monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    lines = []
    tracker = Tracking("p", "e", ["console", backend], str(tmp_path), print_fn=lines.append)
    for step in (1, 2, 3):
        tracker.log({"critic/score/mean": step / 2}, step=step)
    tracker.log_generations([{"input": "q", "output": "a", "score": 1.0}], step=3)
    tracker.finish()
    notices = [line for line in lines if line.startswith("notice:")]
    assert len(notices) == 1 and f"{backend} is not installed" in notices[0] and "skipping it" in notices[0]
    assert [row["step"] for row in _jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert lines[-1] == "step 3 | score 1.5"


class FakeWandb(types.ModuleType):
    """Records what Tracking asks of wandb."""

    def __init__(self, fail_log=False):
        super().__init__("wandb")
        self.inits, self.logged, self.finished, self.fail_log = [], [], [], fail_log
        fake = self

        class Run:
            def log(self, data, step):
                if fake.fail_log:
                    raise ConnectionError("server went away")
                fake.logged.append((step, data))

            def finish(self, exit_code=0):
                fake.finished.append(exit_code)

        self.Run = Run
        self.Settings = dict

        class Table:
            def __init__(self, columns):
                self.columns, self.rows = columns, []

            def add_data(self, *row):
                self.rows.append(row)

        self.Table = Table

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self.Run()


def test_wandb_without_api_key_runs_offline_in_the_log_dir(tmp_path, monkeypatch, no_credentials):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    lines = []
    tracker = Tracking("proj", "exp", ["console", "wandb"], str(tmp_path), config={"a": 1}, print_fn=lines.append)
    tracker.log({"critic/score/mean": 0.5, "text": "dropped"}, step=2)
    tracker.log_generations([{"input": "q", "output": "a", "score": 1.0}], step=2)
    tracker.finish()
    (init,) = fake.inits
    assert init["mode"] == "offline" and init["dir"] == str(tmp_path)
    assert (init["project"], init["name"], init["config"]) == ("proj", "exp", {"a": 1})
    assert fake.logged[0] == (2, {"critic/score/mean": 0.5})
    assert fake.logged[1][1]["val/generations"].rows == [(2, "q", "a", 1.0)]
    assert fake.finished == [0]
    notices = [line for line in lines if line.startswith("notice:")]
    assert len(notices) == 1 and "wandb runs offline (no API key" in notices[0]


def test_wandb_with_key_but_no_network_runs_offline_and_an_explicit_mode_is_kept(tmp_path, monkeypatch, no_credentials):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_API_KEY", "k")
    monkeypatch.setattr(tracking, "_reachable", lambda url, timeout=2.0: False)
    lines = []
    Tracking("p", "e", "wandb", str(tmp_path / "a"), print_fn=lines.append).finish()
    assert fake.inits[-1]["mode"] == "offline" and "is not reachable" in lines[0]
    monkeypatch.setattr(tracking, "_reachable", lambda url, timeout=2.0: True)
    Tracking("p", "e", "wandb", str(tmp_path / "b"), print_fn=lines.append).finish()
    assert fake.inits[-1]["mode"] is None and len(lines) == 1  # online: no notice
    monkeypatch.setenv("WANDB_MODE", "disabled")
    Tracking("p", "e", "wandb", str(tmp_path / "c"), print_fn=lines.append).finish()
    assert fake.inits[-1]["mode"] == "disabled" and len(lines) == 1


def test_a_backend_failing_mid_run_is_switched_off_with_one_notice(tmp_path, monkeypatch, no_credentials):
    monkeypatch.setitem(sys.modules, "wandb", FakeWandb(fail_log=True))
    lines = []
    tracker = Tracking("p", "e", ["wandb"], str(tmp_path), print_fn=lines.append)
    for step in (1, 2):
        tracker.log({"x": 1.0}, step=step)
    tracker.finish()
    failures = [line for line in lines if "failed to log" in line]
    assert len(failures) == 1 and "ConnectionError" in failures[0]
    assert len(_jsonl(tmp_path / "metrics.jsonl")) == 2


def test_mlflow_defaults_to_a_file_store_under_the_log_dir(tmp_path, monkeypatch, no_credentials):
    calls = []
    mlflow = types.ModuleType("mlflow")
    mlflow.set_tracking_uri = lambda uri: calls.append(("uri", uri))
    mlflow.set_experiment = lambda name: calls.append(("experiment", name)) or types.SimpleNamespace(experiment_id="7")
    mlflow.start_run = lambda **kw: calls.append(("run", kw))
    mlflow.log_params = lambda params: calls.append(("params", params))
    mlflow.log_metrics = lambda metrics, step: calls.append(("metrics", step, metrics))
    mlflow.active_run = lambda: object()
    mlflow.end_run = lambda: calls.append(("end",))
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    tracker = Tracking("p", "e", "mlflow", str(tmp_path), config={"trainer": {"seed": 1}, "tags": [3]})
    tracker.log({"val/acc@5": 1.0}, step=4)
    tracker.finish()
    assert calls[0] == ("uri", "file://" + os.path.abspath(tmp_path / "mlruns"))
    assert ("run", {"experiment_id": "7", "run_name": "e"}) in calls
    assert ("params", {"trainer/seed": "1", "tags/0": "3"}) in calls
    assert ("metrics", 4, {"val/acc_at_5": 1.0}) in calls and calls[-1] == ("end",)


def test_file_backend_writes_verls_records(tmp_path, monkeypatch):
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(tmp_path / "root"))
    tracker = Tracking("proj", "exp", ["file", "console"], str(tmp_path / "logs"), print_fn=lambda line: None)
    tracker.log({"a": 1.0, "b": float("nan")}, step=1)
    tracker.log({"a": 2.0}, step=2, backend=["console"])  # verl's backend filter: not to the file
    tracker.finish()
    assert _jsonl(tmp_path / "root" / "proj" / "exp.jsonl") == [{"step": 1, "data": {"a": 1.0, "b": "nan"}}]
    assert len(_jsonl(tmp_path / "logs" / "metrics.jsonl")) == 2


@pytest.mark.skipif(tracking._import("wandb") is None, reason="wandb is not installed in this environment")
def test_real_wandb_offline_writes_a_local_run(tmp_path, monkeypatch, no_credentials):
    tracker = Tracking("p", "e", "wandb", str(tmp_path), print_fn=lambda line: None)
    tracker.log({"x": 1.0}, step=1)
    tracker.finish()
    assert any(name.startswith("offline-run") for name in os.listdir(tmp_path / "wandb"))
