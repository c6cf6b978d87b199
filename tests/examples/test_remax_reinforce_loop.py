"""examples/remax_reinforce_loop: the hand-written ReMax + REINFORCE loop runs 3 steps in 1 process and on 2
processes (torchrun, gloo), with a reward that has spread on a random model; every step trains on tokens made by
the policy version of the step before (weights streamed into the colocated engine), its statistics come from
`stats_tracker` (over all ranks), and the rewards before and after are reported."""

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl.utils.fsdp_utils import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "examples", "remax_reinforce_loop", "main.py")
GSM8K = os.path.join(os.path.dirname(REPO), "shared", "data", "gsm8k", "train.jsonl")
REWARD = """
def even_token_reward(prompt, completions, prompt_ids, completion_ids, **kwargs):
    return sum(1 for t in completion_ids if t % 2 == 0) / max(len(completion_ids), 1)
"""


@pytest.fixture(scope="module")
def loop_files(tmp_path_factory):
    out = tmp_path_factory.mktemp("loop")
    rows = []
    with open(GSM8K, encoding="utf-8") as f:
        for line, _ in zip(f, range(20)):
            record = json.loads(line)
            rows.append({"prompt": [{"role": "user", "content": record["question"][:160]}], "data_source": "openai/gsm8k",
                         "reward_model": {"ground_truth": record["answer"].split("####")[-1].strip()}})  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows[:12]), out / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[12:]), out / "test.parquet")
    (out / "reward.py").write_text(REWARD)
    return out


def run_loop(tiny_model_dir, files, launcher: list[str]) -> dict:
    out = files / f"result_{len(launcher)}.json"
    args = ["--model_path", tiny_model_dir, "--train_file", str(files / "train.parquet"), "--test_file",
            str(files / "test.parquet"), "--steps", "3", "--batch_size", "4", "--max_new_tokens", "12",
            "--eval_rows", "4", "--lr", "1e-2", "--reward_fn", f"{files / 'reward.py'}:even_token_reward",
            "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": REPO}  # fmt: skip
    proc = subprocess.run([*launcher, SCRIPT, *args], env=env, capture_output=True, text=True, timeout=300, cwd=files)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "reward before:" in proc.stdout and "reward after:" in proc.stdout
    return json.loads(out.read_text())


def check_steps(result: dict) -> None:
    assert [s["step"] for s in result["steps"]] == [1, 2, 3]
    # the rollout of step k ran on the weights after k - 1 updates, streamed into the engine
    assert [s["versions"] for s in result["steps"]] == [[0], [1], [2]]
    for stats in result["steps"]:  # stats_tracker's export: the engine's stats under "actor/", timings, the token stat
        assert stats["actor/update_successful"] == 1.0 and stats["actor/grad_norm"] > 0 and stats["actor/lr"] > 0
        assert all(stats[f"timeperf/{name}"] > 0 for name in ("rollout", "train_step", "update_weights"))
        assert stats["actor/n_tokens"] >= 1
        assert stats["actor/advantage/min"] <= stats["actor/advantage/avg"] <= stats["actor/advantage/max"]
    assert set(result["before"]) == set(result["after"]) == {"greedy", "sampled"}


@pytest.mark.slow
def test_loop_runs_in_one_process(tiny_model_dir, loop_files):
    result = run_loop(tiny_model_dir, loop_files, [sys.executable])
    assert result["world_size"] == 1
    check_steps(result)


@pytest.mark.slow
def test_loop_runs_on_two_processes(tiny_model_dir, loop_files):
    port = str(free_port())
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port]
    result = run_loop(tiny_model_dir, loop_files, torchrun)
    assert result["world_size"] == 2
    check_steps(result)
