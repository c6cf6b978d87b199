"""Train one model on the RLLA tool-calling task with GRPO and with PPO (GAE + critic), one run after the other,
and print their validation rewards side by side. Each run is `python -m verl.trainer.main_ppo` with the same
data and model, so its folder, logs and checkpoints are those of a normal run.

    python examples/rlla_train_grpo_ppo.py                     # embedded default: tiny SFT model, synthetic RLLA
    python examples/rlla_train_grpo_ppo.py --model /models/qwen --data_dir dataset/rlla_4k --steps 200 \
        -- trainer.device=cuda trainer.n_gpus_per_node=8 actor_rollout_ref.rollout.name=vllm

Without --model the embedded default is prepared (`verl.trainer.prepare_default`). Without train.parquet in
--data_dir, the data is made by `dataset/rlla_4k_raw/rlla.py` (from --raw, or `--synthetic 2000` records when no
raw JSON is given). Words after `--` are passed to both runs as Hydra overrides.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ALGORITHMS = {
    "grpo": [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.actor.use_kl_loss=true",
    ],
    "ppo": [
        "algorithm.adv_estimator=gae",
        "algorithm.lam=0.95",
        "actor_rollout_ref.rollout.n=1",
        "critic.optim.lr=1e-4",
    ],
}


def prepare(args: argparse.Namespace) -> tuple[str, str]:
    """(model dir, data dir), making whichever is missing."""
    model, data_dir = args.model, args.data_dir
    if model is None:
        work = os.path.join(REPO, "outputs", "default")
        _run([sys.executable, "-m", "verl.trainer.prepare_default", "--out", work, "--seed", str(args.seed)])
        model, data_dir = os.path.join(work, "sft_model"), data_dir or os.path.join(work, "data")
    data_dir = data_dir or os.path.join(REPO, "dataset", "rlla_4k")
    if not os.path.isfile(os.path.join(data_dir, "train.parquet")):
        source = ["--input", args.raw] if args.raw else ["--synthetic", "2000"]
        _run(
            [sys.executable, os.path.join(REPO, "dataset", "rlla_4k_raw", "rlla.py"), "--local_dir", data_dir, *source]
        )
    return model, data_dir


def _run(command: list[str]) -> None:
    print("$ " + " ".join(command), flush=True)
    subprocess.run(command, cwd=REPO, check=True)


def final_validation(run_dir: str) -> tuple[float | None, float | None]:
    """(first, last) `val/reward/mean` logged by a run, from its metrics.jsonl."""
    path = os.path.join(run_dir, "logs", "metrics.jsonl")
    if not os.path.isfile(path):
        return None, None
    values = [row["val/reward/mean"] for row in map(json.loads, open(path)) if "val/reward/mean" in row]
    return (values[0], values[-1]) if values else (None, None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    overrides = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF model dir (default: the embedded tiny SFT model)")
    parser.add_argument("--data_dir", default=None, help="folder with train.parquet and test.parquet")
    parser.add_argument("--raw", default=None, help="ToolRL raw JSON (rlla_rl.json) used to make missing data")
    parser.add_argument("--algos", nargs="+", default=["grpo", "ppo"], choices=sorted(ALGORITHMS))
    parser.add_argument("--steps", type=int, default=40, help="training steps of each run")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default=os.path.join(REPO, "checkpoints", "rlla_grpo_ppo"), help="runs folder")
    args = parser.parse_args(argv)
    model, data_dir = prepare(args)
    results = {}
    for algo in args.algos:
        run_dir = os.path.join(args.out, algo)
        command = [
            sys.executable, "-m", "verl.trainer.main_ppo",
            f"data.train_files={data_dir}/train.parquet", f"data.val_files={data_dir}/test.parquet",
            f"actor_rollout_ref.model.path={model}", "data.max_prompt_length=384", "data.max_response_length=64",
            "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.actor.optim.lr=1e-4", "actor_rollout_ref.rollout.val_kwargs.n=4",
            "actor_rollout_ref.rollout.val_kwargs.do_sample=true", "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
            f"trainer.total_training_steps={args.steps}", f"trainer.seed={args.seed}", "trainer.test_freq=10",
            f"trainer.experiment_name=rlla_{algo}", f"trainer.default_local_dir={run_dir}",
            *ALGORITHMS[algo], *overrides,
        ]  # fmt: skip
        _run(command)
        results[algo] = final_validation(run_dir)
    print("\nvalidation reward (mean over val_kwargs.n samples per prompt): before -> after")
    for algo, (before, after) in results.items():
        print(
            f"  {algo:5s} {before if before is None else f'{before:.4f}'} -> {after if after is None else f'{after:.4f}'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
