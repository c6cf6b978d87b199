"""Learning at equal wall time: the default job's GRPO against TRL's GRPOTrainer, beside the reward-free control.

For each seed, in a fresh folder `<workdir>/seed<s>`:
1. `SEED=s bash train_grpo.sh` (prepare + train, the README's main job): its total wall time, its GRPO phase's
   (`main_ppo`'s fit: start-up excluded, validations included) and its validation figures before and after;
2. `CONTROL=1 SEED=s bash train_grpo.sh` on the same prepared model and data: the reward-free control;
3. TRL's `GRPOTrainer` from the same SFT model, on the same training prompts, with the same reward (ToolRL's score),
   per-step batch (8 prompts x 8 answers, one optimizer step), learning rate, clipping, KL and entropy terms and
   float32 on the same 2 threads, for as long as step 1's GRPO phase took (TRL's model loading excluded, and it
   runs no validation in that time); its steps are counted;
4. one independent evaluation (`eval_rlla.py`: HF generate, greedy and 4 answers at temperature 1) of the SFT model
   and of the three final models on the 128 validation prompts.
Each finished part is kept in `<workdir>/seed<s>/result.json` and skipped when the script runs again. Prints one
row per seed in the README's layout. Run nothing else on the machine meanwhile: the budget is wall time.

Usage (from the repository root; TRL from benchmarks/requirements.txt):
    python benchmarks/learn_vs_trl.py --seeds 1,2,3 --workdir /tmp/learn_vs_trl
    python benchmarks/learn_vs_trl.py --seeds 1 --parts trl,eval --budget_s 300      # TRL alone, a fixed budget
Extra arguments after `--` go to both `train_grpo.sh` runs as overrides (e.g. a shortened job for a smoke test).

A benchmark, not a library module: it may import anything of the package, TRL included.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from eval_rlla import evaluate_model, read_rows  # noqa: E402  (benchmarks/ is not a package)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ("ours", "control", "trl", "eval")
THREADS = 2
USER_OMP_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY")


def _torch_in_this_process():
    """torch for TRL and the evaluation here, with 2 threads that sleep instead of spinning while they wait, as our
    job's Ray workers run (`OMP_WAIT_POLICY=PASSIVE`: a spinning thread on a shared 2-core machine is up to 10x
    slower, see benchmarks/README.md). Must run before the first torch import of this process."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    torch.set_num_threads(THREADS)
    return torch


# ------------------------------------------------------------------------------------------- our job
def _job_settings() -> dict[str, float]:
    """The default job's GRPO settings TRL must share, read from train_grpo.sh's embedded defaults."""
    text = open(os.path.join(REPO_ROOT, "train_grpo.sh"), encoding="utf-8").read()

    def value(key: str, default: str) -> str:
        found = re.findall(rf"{re.escape(key)}=(\S+)", text)
        return found[-1] if found else default

    return {
        "prompts": int(value("data.train_batch_size", "8")),
        "n": int(value("actor_rollout_ref.rollout.n", "8")),
        "max_response": int(value("data.max_response_length", "100")),
        "lr": float(value("actor_rollout_ref.actor.optim.lr", "1e-6")),
        "entropy_coeff": float(value("actor_rollout_ref.actor.entropy_coeff", "0")),
        "kl_coef": float(value("actor_rollout_ref.actor.kl_loss_coef", "0"))
        if value("actor_rollout_ref.actor.use_kl_loss", "false") == "true"
        else 0.0,
    }


def run_job(seed_dir: str, seed: int, control: bool, extra: list[str]) -> dict:
    """`bash train_grpo.sh` for the seed (the control with CONTROL=1); figures from its output and metrics.jsonl,
    and its final model merged into `<run>/final_hf`."""
    name = "control" if control else "grpo"
    run_dir = os.path.join(seed_dir, "runs", name)
    env = {**os.environ, "SEED": str(seed), "WORK_DIR": os.path.join(seed_dir, "default"), "CONTROL": str(int(control))}
    for key in ("BASE_MODEL", "DATA_DIR", "RAY_ADDRESS", "EXPERIMENT_NAME"):
        env.pop(key, None)
    if USER_OMP_WAIT_POLICY is None:  # the job as a user starts it (its workers set their own policy)
        env.pop("OMP_WAIT_POLICY", None)
    cmd = ["bash", "train_grpo.sh", f"trainer.default_local_dir={run_dir}", "trainer.resume_mode=disable", *extra]
    start = time.time()
    log_path = os.path.join(seed_dir, f"{name}.log")
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    total = time.time() - start
    out = open(log_path, encoding="utf-8").read()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}); see {log_path}")
    fit = re.search(r"steps: (\d+)\s+wall time: ([\d.]+) s", out)
    prepared = re.search(r"default job prepared in (\d+) s", out)
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "logs", "metrics.jsonl"), encoding="utf-8")]
    val = [r for r in rows if "val/reward/mean" in r]
    step = int(fit.group(1))
    final = os.path.join(run_dir, "final_hf")
    subprocess.run(
        [sys.executable, "-m", "verl.model_merger", "--local_dir", os.path.join(run_dir, f"global_step_{step}", "actor"),
         "--target_dir", final, "--overwrite"],
        cwd=REPO_ROOT, check=True, capture_output=True,
    )  # fmt: skip
    return {
        "total_s": round(total, 1),
        "prepare_s": float(prepared.group(1)) if prepared else None,
        "grpo_s": float(fit.group(2)),
        "steps": step,
        "val_before": _val_figures(val[0]),
        "val_after": _val_figures(val[-1]),
        "final_model": final,
        "load_after": os.getloadavg(),
    }


def _val_figures(row: dict) -> dict:
    return {k.split("/", 2)[2]: v for k, v in row.items() if k.startswith("val-core/")}


# ------------------------------------------------------------------------------------------------ TRL
def run_trl(model_dir: str, train_parquet: str, out_dir: str, budget_s: float, seed: int) -> dict:
    """TRL's GRPOTrainer from `model_dir` on the job's settings until `budget_s` seconds of training have passed
    (checked after each step); the model is saved to `out_dir`."""
    torch = _torch_in_this_process()
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from verl.utils.reward_score import rlla

    job = _job_settings()
    rows = [
        {"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]} for r in read_rows(train_parquet)
    ]

    def toolrl_reward(completions, ground_truth, **kwargs):
        return [rlla.compute_score(c[0]["content"], gt)[0] for c, gt in zip(completions, ground_truth)]

    args = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=job["prompts"] * job["n"],  # one optimizer step per batch, as ours
        gradient_accumulation_steps=1,
        num_generations=job["n"],
        max_completion_length=job["max_response"],
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        beta=job["kl_coef"],
        entropy_coef=job["entropy_coeff"],  # same sign as verl's entropy_coeff (positive = bonus)
        num_iterations=1,
        epsilon=0.2,
        loss_type="dapo",  # token mean over the batch: verl's loss_agg_mode=token-mean
        scale_rewards="group",  # verl's norm_adv_by_std_in_grpo=true
        learning_rate=job["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.01,  # verl's actor optim default
        max_grad_norm=1.0,
        max_steps=100_000,  # stopped by the wall-time budget
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        seed=seed,
        disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rewards: list[float] = []

    class Budget(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if time.perf_counter() - self.start >= budget_s:
                control.should_training_stop = True

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    budget = Budget()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=toolrl_reward,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[budget],
    )
    trainer.train()
    seconds = time.perf_counter() - budget.start
    trainer.save_model(out_dir)
    tokenizer.save_pretrained(out_dir)
    return {"steps": trainer.state.global_step, "train_s": round(seconds, 1), "budget_s": budget_s,
            "reward_first10": sum(rewards[:10]) / max(len(rewards[:10]), 1),
            "reward_last10": sum(rewards[-10:]) / max(len(rewards[-10:]), 1), "final_model": out_dir}  # fmt: skip


# ------------------------------------------------------------------------------------------- driver
def run_seed(seed: int, workdir: str, parts: list[str], budget_s: float | None, extra: list[str]) -> dict:
    seed_dir = os.path.join(workdir, f"seed{seed}")
    os.makedirs(seed_dir, exist_ok=True)
    path = os.path.join(seed_dir, "result.json")
    result = json.load(open(path, encoding="utf-8")) if os.path.isfile(path) else {"seed": seed}

    def save():
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)

    for name, control in (("ours", False), ("control", True)):
        if name in parts and name not in result:
            print(f"seed {seed}: {name} run (load {os.getloadavg()[0]:.2f})", flush=True)
            result[name] = {"load_before": os.getloadavg(), **run_job(seed_dir, seed, control, extra)}
            save()
    if "trl" in parts and "trl" not in result:
        budget = budget_s if budget_s is not None else result["ours"]["grpo_s"]
        print(f"seed {seed}: TRL for {budget:.0f} s (load {os.getloadavg()[0]:.2f})", flush=True)
        prepared = os.path.join(seed_dir, "default")
        result["trl"] = {"load_before": os.getloadavg(), **run_trl(
            os.path.join(prepared, "sft_model"), os.path.join(prepared, "data", "train.parquet"),
            os.path.join(seed_dir, "runs", "trl"), budget, seed)}  # fmt: skip
        result["trl"]["load_after"] = os.getloadavg()
        save()
    if "eval" in parts:
        _torch_in_this_process()
        test = os.path.join(seed_dir, "default", "data", "test.parquet")
        models = {"sft": os.path.join(seed_dir, "default", "sft_model")}
        models.update({k: result[k]["final_model"] for k in ("ours", "control", "trl") if k in result})
        result.setdefault("eval", {})
        for name, model_dir in models.items():
            if name not in result["eval"]:
                print(f"seed {seed}: evaluating {name}", flush=True)
                result["eval"][name] = evaluate_model(model_dir, test, n=4, seed=seed)
                save()
    return result


def table_row(r: dict) -> str:
    """One README row: SFT, after GRPO, control (the runs' own validation: greedy / mean@4), TRL and ours by
    the independent evaluation, steps and wall times."""

    def run_val(part: str, when: str) -> str:
        v = r.get(part, {}).get(when, {})
        return f"{v.get('reward/greedy', float('nan')):.2f} / {v.get('reward/mean@4', float('nan')):.2f}"

    def ev(part: str) -> str:
        e = r.get("eval", {}).get(part)
        return f"{e['greedy']:.2f} / {e['mean@4']:.2f}" if e else "n/a"

    ours, trl = r.get("ours", {}), r.get("trl", {})
    wall = "n/a"
    if "total_s" in ours:
        total, load = ours["total_s"], ours["load_after"]
        wall = f"{int(total // 60)}m{int(total % 60):02d}s ({ours['prepare_s']} s + {ours['grpo_s']} s; load {load[1]:.1f})"
    return (
        f"| {r['seed']} | {run_val('ours', 'val_before')} | {run_val('ours', 'val_after')} | "
        f"{run_val('control', 'val_after')} | {ev('ours')} | {ev('trl')} | {ours.get('steps')} / {trl.get('steps')} | "
        f"{wall} |"
    )


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1,2,3", help="comma list of seeds")
    parser.add_argument("--workdir", default="outputs/learn_vs_trl", help="one fresh folder per seed inside")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {PARTS}")
    parser.add_argument("--budget_s", type=float, default=None, help="TRL's wall time (default: our GRPO phase's)")
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}; allowed: {PARTS}")
    workdir = os.path.abspath(args.workdir)
    results = [run_seed(int(s), workdir, parts, args.budget_s, extra) for s in args.seeds.split(",")]
    print("| seed | SFT greedy / mean@4 | after GRPO | control | ours (eval) | TRL (eval) | steps ours / TRL "
          "| wall time (prepare + GRPO) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(table_row(r))
    with open(os.path.join(workdir, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
