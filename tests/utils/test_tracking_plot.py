"""Tracking writes metrics.jsonl (and TensorBoard), console lines, and the plot reads them back."""

import json
import os

import pytest

from verl.utils import plot
from verl.utils.tracking import Tracking, format_console_line


def test_tracking_writes_jsonl_tensorboard_and_console(tmp_path):
    lines = []
    tracker = Tracking("p", "e", ["console", "tensorboard"], str(tmp_path), print_fn=lines.append)
    tracker.log({"critic/score/mean": 0.5, "timing_s/step": 2.0, "note": "skip me"}, step=1)
    tracker.log({"val/reward/mean": 1.25}, step=2)
    tracker.finish()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert rows == [{"step": 1, "critic/score/mean": 0.5, "timing_s/step": 2.0}, {"step": 2, "val/reward/mean": 1.25}]
    assert os.listdir(tmp_path / "tensorboard")
    assert lines[0] == "step 1 | score 0.5 | s/step 2"


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="'mlflowx'.*allowed"):
        Tracking("p", "e", ["mlflowx"], "/tmp/unused_log_dir_verl")


def test_plot_run_draws_png_and_cli(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in range(4):
            f.write(json.dumps({"step": step, "val/reward/mean": step * 0.1, "critic/score/mean": step}) + "\n")
    out = plot.plot_run(str(tmp_path))
    assert out.endswith("curves.png") and os.path.getsize(out) > 1000
    assert plot.main([str(tmp_path / "nowhere")]) == 1


def test_console_line_orders_known_keys():
    assert (
        format_console_line(3, {"actor/pg_loss": 0.25, "critic/score/mean": 1.0}) == "step 3 | score 1 | pg_loss 0.25"
    )


def test_generations_table_written_to_jsonl_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = Tracking("p", "e", ["tensorboard"], str(tmp_path))
    rows = [{"input": "q | 1", "output": "a\nb", "score": 0.5}, {"input": "q2", "output": "c", "score": -1.0}]
    tracker.log_generations(rows, step=3)
    tracker.log_generations([], step=4)  # nothing to log: nothing written
    tracker.finish()
    saved = [json.loads(line) for line in open(tmp_path / "val_generations.jsonl")]
    assert saved == [{"step": 3, **rows[0]}, {"step": 3, **rows[1]}]
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    (text,) = events.Tensors("val/generations/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert text.step == 3
    assert "| q \\| 1 | a<br>b | 0.5 |" in table and "| q2 | c | -1 |" in table
