"""The sweep's protocol (benchmarks/bench_sweep.py) with the runs faked: the rounds alternate direction (ABBA over
points and over ours/TRL), a point pools the counted steps of its rounds, and a cut sweep reuses each round's run."""

import json
import os
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))

import bench_grpo  # noqa: E402
import bench_sweep  # noqa: E402

AXIS = "samples per prompt (n)"
ORDER = (8, 4, 16)  # the sweep's order of this axis' points: n = 8 is the bench shape, the first point of the sweep


@pytest.fixture
def fake_runs(monkeypatch, tmp_path):
    """`bench_grpo.launch` replaced by a run that records its call and writes a result file as the real one does:
    4 steps, the first slow (the warm-up), the rest at a time set by run, n and the call's position."""
    calls = []

    def launch(run, workdir, steps, log_path, shape):
        calls.append((run, shape.n))
        seconds = (1.0 if run == "ours" else 3.0) * shape.n / 4 * (1 + 0.1 * len(calls))  # a drifting machine
        result = {
            "step_s": [100.0] + [seconds] * (steps - 1),
            "gen_s": [1.0] * steps,
            "gen_tokens": [1000.0] * steps,
            "cpu_s": [2 * seconds] * steps,
            "shape": json.loads(shape.to_json()),
            "peak_rss_mb": 500.0 + len(calls),
        }
        with open(os.path.join(workdir, f"result_{run}_{len(calls):04d}.json"), "w") as f:
            json.dump(result, f)
        return result

    monkeypatch.setattr(bench_grpo, "launch", launch)
    monkeypatch.setattr(bench_grpo, "measure_rates", lambda workdir, log_path: {"rates": {}})
    monkeypatch.setattr(bench_sweep, "prepare", lambda workdir, size: {})
    monkeypatch.setattr(bench_sweep, "floor_of", lambda workdir, shape, rates: 1.0)
    monkeypatch.setattr(bench_sweep, "plot", lambda rows, path: None)
    return calls


def sweep(tmp_path, rounds):
    args = ["--axes", AXIS, "--workdir", str(tmp_path), "--rounds", str(rounds)]
    assert bench_sweep.main(args) == 0
    with open(tmp_path / "sweep.json") as f:
        return json.load(f)


def test_rounds_alternate_direction_and_pool_their_steps(fake_runs, tmp_path):
    out = sweep(tmp_path, rounds=2)
    forward = [(run, n) for n in ORDER for run in ("ours", "trl")]
    assert fake_runs == forward + forward[::-1]
    rows = {row["value"]: row for row in out["rows"]}
    # n = 4: ours ran 3rd and 10th, TRL 4th and 9th; 3 counted steps each, the median of the pooled 6
    ours = [1.0 * (1 + 0.1 * i) for i in (3, 10)]
    trl = [3.0 * (1 + 0.1 * i) for i in (4, 9)]
    assert rows[4]["ours"]["step_s"] == pytest.approx(sum(ours) / 2)
    assert rows[4]["trl"]["step_s"] == pytest.approx(sum(trl) / 2)
    assert rows[4]["ours"]["round_step_s"] == pytest.approx(ours)
    assert rows[4]["ours"]["peak_rss_mb"] == 510.0  # the larger of its rounds
    assert bench_sweep.round_ratios(rows[4]) == f"{ours[0] / trl[0]:.3f}, {ours[1] / trl[1]:.3f}"
    assert out["bars"]["worst ours/TRL step time"] == pytest.approx(
        max(r["ours"]["step_s"] / r["trl"]["step_s"] for r in out["rows"])
    )
    assert "| by round |" in (tmp_path / "sweep.md").read_text()


def test_a_cut_sweep_reuses_each_rounds_run(fake_runs, tmp_path):
    first = sweep(tmp_path, rounds=2)
    fake_runs.clear()
    again = sweep(tmp_path, rounds=2)
    assert fake_runs == []  # every run of both rounds found in the workdir, none launched
    assert again["rows"] == first["rows"]
    sweep(tmp_path, rounds=3)  # a third round (forward again): only its runs are new
    assert fake_runs == [(run, n) for n in ORDER for run in ("ours", "trl")]


def test_rounds_below_one_are_refused(fake_runs, tmp_path):
    with pytest.raises(SystemExit):
        bench_sweep.main(["--axes", AXIS, "--workdir", str(tmp_path), "--rounds", "0"])
    assert fake_runs == []
