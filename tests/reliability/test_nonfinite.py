"""Non-finite values: a NaN/inf loss or grad norm skips the update and is counted (`actor/nonfinite_steps`,
`critic/nonfinite_steps`); `trainer.max_nonfinite_steps` such steps in a row stop the run with one clear
error; weights holding NaN/inf are never saved as a checkpoint (the previous checkpoint stays the latest).

End to end through `python -m verl.trainer.main_ppo`: a GAE run whose critic starts from a model folder with a
NaN weight (every value, advantage and loss is NaN), and a run resumed from a checkpoint whose optimizer
state was corrupted with NaN (the first update makes the actor's weights NaN with a finite grad norm).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tests.ppo_e2e import file_snapshot, grpo_args, run_ppo, shard_state, write_data
from verl.trainer.ppo import checkpoint as ckpt
from verl.trainer.ppo.failures import NonFiniteStepsError, count_nonfinite_steps
from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager, NonFiniteWeightsError


# ------------------------------------------------------------------------------------------ counting
def test_count_resets_on_a_clean_step_and_stops_at_the_limit(tmp_path):
    bad, clean = {"actor/nonfinite_steps": 2.0}, {"actor/nonfinite_steps": 0.0, "critic/nonfinite_steps": 0.0}
    assert count_nonfinite_steps(0, bad, 3, "run") == 1
    assert count_nonfinite_steps(1, {"critic/nonfinite_steps": 1.0}, 3, "run") == 2  # the critic counts too
    assert count_nonfinite_steps(2, clean, 3, "run") == 0
    with pytest.raises(NonFiniteStepsError, match=r"3 steps in a row .*max_nonfinite_steps=3.* kept in /runs/x"):
        count_nonfinite_steps(2, bad, 3, "/runs/x")
    for never in (0, None, -1):  # 0 / null / negative: count, never stop (a clean step must not stop the run)
        assert count_nonfinite_steps(0, clean, never, "run") == 0
        assert count_nonfinite_steps(99, bad, never, "run") == 100


# ------------------------------------------------------------------------------------------ saving
def test_checkpoint_manager_refuses_nonfinite_weights_and_writes_nothing(tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    manager = FSDPCheckpointManager(model)
    manager.save_checkpoint(str(tmp_path / "good"), global_step=1)
    assert sorted(os.listdir(tmp_path / "good")) == [
        "extra_state_world_size_1_rank_0.pt",
        "model_world_size_1_rank_0.pt",
    ]
    for value in (float("nan"), float("inf")):
        with torch.no_grad():
            model.model.norm.weight[3] = value
        with pytest.raises(NonFiniteWeightsError, match=r"refusing to save step 2 .*NaN/inf .*'model.norm.weight'"):
            manager.save_checkpoint(str(tmp_path / "bad"), global_step=2)
        assert not (tmp_path / "bad").exists()


# ------------------------------------------------------------------------------------------ end to end
def _last_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines, "empty stderr"
    return lines[-1]


def _nan_model(src: str, dst: Path) -> Path:
    """A copy of the model folder whose final norm weight is NaN (every hidden state becomes NaN)."""
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    weights["model.norm.weight"] = torch.full_like(weights["model.norm.weight"], float("nan"))
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.slow
@pytest.mark.ray
def test_nan_losses_are_skipped_counted_and_stop_the_run(tiny_model_dir, tmp_path):
    data_dir = write_data(tmp_path, n_train=16)
    critic = _nan_model(tiny_model_dir, tmp_path / "nan_critic")
    run_dir = tmp_path / "run"
    args = grpo_args(
        tiny_model_dir,
        data_dir,
        run_dir,
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.actor.use_kl_loss=false",
        f"critic.model.path={critic}",
        "critic.ppo_micro_batch_size_per_gpu=4",
        "trainer.save_freq=-1",
        "trainer.max_nonfinite_steps=2",
        "trainer.total_training_steps=4",
    )
    proc = run_ppo(args, cwd=tmp_path, check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = _last_error_line(proc.stderr)
    assert last.startswith("error: NonFiniteStepsError: 2 steps in a row had a non-finite loss or grad norm"), last
    assert "trainer.max_nonfinite_steps=2" in last and "Traceback" not in proc.stderr
    logged = [json.loads(line) for line in open(run_dir / "logs" / "metrics.jsonl")]
    assert [r["step"] for r in logged] == [1]  # step 2 ran to the end (its rollout used finite actor weights)
    step1 = logged[0]
    # 4 prompts x 2 samples in mini-batches of 2 prompts: both optimizer steps of actor and critic skipped
    assert step1["actor/nonfinite_steps"] == 2.0 and step1["critic/nonfinite_steps"] == 2.0
    assert not any(run_dir.glob("global_step_*"))


@pytest.mark.slow
@pytest.mark.ray
def test_nan_weights_are_never_saved_and_the_last_checkpoint_stays(reference_run, tmp_path):
    ref, run_dir = reference_run, tmp_path / "run"
    shutil.copytree(ref.run_dir, run_dir)
    last = max(ref.metrics)
    optim_path = Path(ckpt.step_dir(str(run_dir), last)) / "actor" / "optim_world_size_1_rank_0.pt"
    optim = shard_state(run_dir, last, "optim")
    for state in optim["state"].values():  # a corrupted optimizer: the next update writes NaN into the weights
        state["exp_avg"] = torch.full_like(state["exp_avg"], float("nan"))
    torch.save(optim, optim_path)
    before = file_snapshot(run_dir / f"global_step_{last}")

    proc = run_ppo(ref.args(run_dir, f"trainer.total_training_steps={last + 1}"), cwd=tmp_path, check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = _last_error_line(proc.stderr)
    assert line.startswith(f"error: NonFiniteWeightsError: refusing to save step {last + 1} "), line
    assert "NaN/inf" in line and f"the latest complete checkpoint stays {run_dir}/global_step_{last}" in line
    assert ckpt.find_latest_checkpoint(str(run_dir)) == ckpt.step_dir(str(run_dir), last)
    assert (run_dir / ckpt.TRACKER_FILE).read_text().strip() == str(last)
    assert file_snapshot(run_dir / f"global_step_{last}") == before
    assert sorted(p.name for p in run_dir.iterdir()) == sorted([f"global_step_{last}", ckpt.TRACKER_FILE, "logs"])
