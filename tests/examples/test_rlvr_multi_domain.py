"""examples/rlvr_multi_domain: its data is what it claims (every code task's reference program passes the sandbox,
every math answer is the problem's), the run script trains the tiny model 2 steps on three domains at once with
per-domain metrics, reward workers, dynamic sampling and per-domain sampler state in the checkpoint; and bad domain
settings through the real entry point end with one line before Ray starts."""

import json
import os
import subprocess
import sys

import pandas as pd
import pytest
import torch

from verl.utils.reward_score import default_compute_score, sandbox

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "rlvr_multi_domain")
DOMAINS = ("math", "tools", "code")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("rlvr_data")
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLE, "prepare_data.py"), "--local_dir", str(out), "--n_train", "12"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def test_prepared_data_is_scored_right_by_its_domains_reward(data_dir):
    for domain in DOMAINS:
        for split, size in (("train", 12), ("test", 8)):
            assert len(pd.read_parquet(data_dir / domain / f"{split}.parquet")) == size
    code = pd.read_parquet(data_dir / "code" / "test.parquet")
    for _, row in code.iterrows():
        program = f"```python\n{row['extra_info']['reference']}\n```"
        assert sandbox.compute_score(program, row["reward_model"]["ground_truth"]) == 1.0
        assert sandbox.compute_score("```python\nprint('?')\n```", row["reward_model"]["ground_truth"]) == 0.0
    for _, row in pd.read_parquet(data_dir / "math" / "test.parquet").iterrows():
        truth = row["reward_model"]["ground_truth"]
        assert default_compute_score(row["data_source"], f"so #### {truth}", truth) == 1.0
        assert int(truth) >= 0 and row["prompt"][0]["content"].endswith('after "####".')
    tools = pd.read_parquet(data_dir / "tools" / "test.parquet")
    assert set(tools["data_source"]) == {"rlla"}


def _env(tmp_path, model):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "BASE_MODEL": model}
    env.update({"WORK_DIR": str(tmp_path / "work"), "PYTHON": sys.executable})
    env.pop("RAY_ADDRESS", None)
    return env


@pytest.mark.slow
@pytest.mark.ray
def test_example_trains_two_steps_on_three_domains(tiny_model_dir, data_dir, tmp_path):
    args = [
        "trainer.total_training_steps=2",
        "trainer.save_freq=2",
        "trainer.val_before_train=false",
        "trainer.ray_init.num_cpus=2",
        "trainer.logger=[console]",
        "actor_rollout_ref.rollout.n=2",
    ]
    env = {**_env(tmp_path, tiny_model_dir), "DATA_DIR": str(data_dir)}
    proc = subprocess.run(
        ["bash", os.path.join(EXAMPLE, "run_rlvr_multi_domain.sh"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "training finished" in proc.stdout
    run_dir = tmp_path / "work" / "checkpoints"
    rows = [json.loads(line) for line in open(run_dir / "logs" / "metrics.jsonl")]
    steps = {r["step"]: r for r in rows if r["step"] > 0}
    assert sorted(steps) == [1, 2]
    last = steps[2]
    for domain, prompts in (("math", 2), ("tools", 1), ("code", 1)):  # 50/25/25 of 4 prompts, 2 samples each
        assert last[f"{domain}/actor/samples_total"] == prompts * 2
        for key in ("critic/score/mean", "critic/rewards/mean", "response_length/mean", "critic/advantages/mean"):
            assert f"{domain}/{key}" in last, f"{domain}/{key}"
        assert f"val_correct/{domain}/mean" in last  # data.val_tag_key=domain
    assert last["tools/reward_extra/format/mean"] <= 1.0 and "math/reward_extra/format/mean" not in last
    weighted = (
        2 * last["math/critic/score/mean"] + last["tools/critic/score/mean"] + last["code/critic/score/mean"]
    ) / 4
    assert last["critic/score/mean"] == pytest.approx(weighted)  # the verifier scores, all domains together
    assert 1 <= last["train/num_gen_batches"] <= 2 and "dynamic_sampling/filtered_frac" in last
    assert "val_correct/all/mean" in last
    for worker in ("actor_rollout_rank0", "reward_math_rule_0", "reward_rlla_0", "reward_code_sandbox_0", "driver"):
        assert last[f"system/{worker}/rss_gb"] > 0.05 and f"system/{worker}/cpu_percent" in last
    state = torch.load(run_dir / "global_step_2" / "trainer_state.pt", weights_only=False)
    drawn = state["domain_sampler"]["domains"]
    rounds = int(steps[1]["train/num_gen_batches"] + steps[2]["train/num_gen_batches"])
    assert [drawn[d]["position"] for d in DOMAINS] == [2 * rounds, rounds, rounds]  # each domain's own place
    assert state["domain_sampler"]["batches"] == 2 and set(state["rlvr"]["running"]) == set(DOMAINS)


@pytest.mark.slow
@pytest.mark.parametrize(
    "override, message",
    [
        ("data.domain_interleave_probs={math: 0.5, tools: 0.25, code: 0.5}", "must sum to 1, got 1.25"),
        ("data.domains.code.reward=code_interpreter", "data.domains.code.reward='code_interpreter' is not a known"),
    ],  # the other mistakes (a probability for a missing domain, no train_files, ...): tests/trainer/ppo/test_domains.py
)
def test_bad_domain_settings_fail_with_one_line_before_ray(tiny_model_dir, data_dir, tmp_path, override, message):
    env = {**_env(tmp_path, tiny_model_dir), "DATA_DIR": str(data_dir)}
    proc = subprocess.run(
        ["bash", os.path.join(EXAMPLE, "run_rlvr_multi_domain.sh"), override],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and message in last, proc.stderr[-2000:]
    assert "Started a local Ray instance" not in proc.stderr + proc.stdout
