"""GRPO step-time benchmark: our trainer against TRL's GRPOTrainer and a bare-PyTorch floor, in one script run.

The bench config (the same for all three): a tiny Qwen2 built locally (`verl.models.tiny`, size "s": hidden
256, 4 layers, 4 heads, 2 KV heads, ~3.5M parameters) whose tokenizer is trained on GSM8K text; 512 GSM8K
prompts from ../shared/data/gsm8k/train.jsonl (chat-templated, at most 128 tokens) with the GSM8K reward;
16 prompts x 8 samples per step, responses of at most 64 tokens at temperature 1; GRPO with a k3 KL loss
(beta 0.04) to the reference model, 1 PPO epoch, one mini-batch per step, micro-batches of 32 samples;
AdamW lr 1e-6; 2 torch threads. The model is random, so nearly every response runs to 64 tokens.

Each run is a subprocess (fresh memory, fresh Ray) whose process tree is sampled for RSS and PSS
(`tree_memory.py`) by this script.
Runs alternate (ours, TRL, floor, ours, TRL, floor, ...) so that load on the machine hits all of them alike,
and every ratio is computed within the run. Step time = median over the steps after the warm-up ones.

Usage (from the repository root; TRL from benchmarks/requirements.txt):
    python benchmarks/bench_grpo.py                        # full: 12 steps (2 warm-up), 2 rounds, variants
    python benchmarks/bench_grpo.py --quick                # smoke run: 3 steps (1 warm-up), 1 round, < 2 min
    python benchmarks/bench_grpo.py --runs ours,floor --steps 4 --rounds 1
Figures are printed as a table and written to --out (JSON).

A benchmark, not a library module: it may import anything of the package, TRL included.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tree_memory import TreeMemory  # noqa: E402  (benchmarks/ is not a package)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K_TRAIN = os.path.join(os.path.dirname(REPO_ROOT), "shared", "data", "gsm8k", "train.jsonl")
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

NUM_PROMPTS = 512
PROMPTS_PER_STEP = 16
SAMPLES_PER_PROMPT = 8
MAX_PROMPT_LEN = 128
MAX_RESPONSE_LEN = 64
MICRO_BATCH = 32
LR = 1e-6
KL_BETA = 0.04
THREADS = 2

# Our trainer's overrides for the bench config; the variants below add to them.
OURS_BASE = [
    f"data.max_prompt_length={MAX_PROMPT_LEN}",
    f"data.max_response_length={MAX_RESPONSE_LEN}",
    f"data.train_batch_size={PROMPTS_PER_STEP}",
    "data.val_files=null",
    "algorithm.adv_estimator=grpo",
    f"actor_rollout_ref.rollout.n={SAMPLES_PER_PROMPT}",
    "actor_rollout_ref.rollout.temperature=1.0",
    f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={MICRO_BATCH}",
    f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={MICRO_BATCH}",
    f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS_PER_STEP}",
    f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={MICRO_BATCH}",
    "actor_rollout_ref.actor.ppo_epochs=1",
    "actor_rollout_ref.actor.use_kl_loss=true",
    f"actor_rollout_ref.actor.kl_loss_coef={KL_BETA}",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    f"actor_rollout_ref.actor.optim.lr={LR}",
    "trainer.val_before_train=false",
    "trainer.save_freq=-1",
    "trainer.logger=[console]",
    "trainer.n_gpus_per_node=1",
    "trainer.device=cpu",
    f"trainer.ray_init.num_cpus={THREADS}",
    # verl's defaults are GPU settings; the CPU bench sets float32 compute, no gradient checkpointing, padded
    # forwards (the "ours" variant turns packing on), the rollout engine hf and no data-loader processes.
    "actor_rollout_ref.rollout.name=hf",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.dtype=float32",
    "actor_rollout_ref.actor.fsdp_config.dtype=float32",
    "actor_rollout_ref.ref.fsdp_config.dtype=float32",
    "actor_rollout_ref.model.enable_gradient_checkpointing=false",
    "actor_rollout_ref.model.use_remove_padding=false",
    "data.dataloader_num_workers=0",
]

# The fast configuration: reuse the rollout's log-probs (no old-log-prob pass), each prompt once per micro-batch
# in the ref/update passes, packed (unpadded) forwards where prompts do not repeat.
REUSE = ["actor_rollout_ref.rollout.calculate_log_probs=true", "actor_rollout_ref.actor.recompute_old_log_prob=false"]
REMOVE_PADDING = ["actor_rollout_ref.model.use_remove_padding=true"]
SHARE_PROMPT = ["actor_rollout_ref.model.share_prompt_prefix=true"]
DYNAMIC_BSZ = [
    "actor_rollout_ref.actor.use_dynamic_bsz=true",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=6144",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=6144",
]
FAST = REUSE + REMOVE_PADDING + SHARE_PROMPT

# name -> extra overrides. "ours" is the fast configuration; the others show what each change is worth (the
# rollout's shared prefill and early stop have no switch: every variant has them).
OURS_VARIANTS: dict[str, list[str]] = {
    "ours": FAST,
    "ours-defaults": [],
    "ours+reuse_logprobs": REUSE,
    "ours+reuse+remove_padding": REUSE + REMOVE_PADDING,
    "ours+dynamic_bsz": FAST + DYNAMIC_BSZ,
    "ours-workflow_null": FAST + ["actor_rollout_ref.rollout.workflow=null"],
    "ours-lora": FAST + ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16"],
    "ours-single_process": FAST + ["trainer.single_process=true"],  # the worker in the driver, no Ray
}


# ------------------------------------------------------------------------------------------------ set-up
def gsm8k_rows(tokenizer, limit: int = NUM_PROMPTS) -> list[dict]:
    """The first `limit` GSM8K train records whose chat-templated prompt fits in MAX_PROMPT_LEN tokens."""
    from verl.utils.reward_score.gsm8k import extract_ground_truth

    rows = []
    with open(GSM8K_TRAIN, encoding="utf-8") as f:
        for index, line in enumerate(f):
            record = json.loads(line)
            messages = [{"role": "user", "content": record["question"] + " " + INSTRUCTION}]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            if len(tokenizer(text, add_special_tokens=False)["input_ids"]) > MAX_PROMPT_LEN:
                continue
            rows.append(
                {
                    "data_source": "openai/gsm8k",
                    "prompt": messages,
                    "ability": "math",
                    "reward_model": {"style": "rule", "ground_truth": extract_ground_truth(record["answer"])},
                    "extra_info": {"split": "train", "index": index},
                }
            )
            if len(rows) == limit:
                break
    return rows


def prepare(workdir: str) -> dict[str, str]:
    """Build the model (tokenizer trained on GSM8K text) and the parquet prompts once; return their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from verl.models.tiny import build_tiny_model

    model_dir = os.path.join(workdir, "model")
    data_path = os.path.join(workdir, "train.parquet")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        corpus = []
        with open(GSM8K_TRAIN, encoding="utf-8") as f:
            for line in f:
                record = json.loads(line)
                corpus += [record["question"], record["answer"]]
        build_tiny_model(model_dir, size="s", seed=0, corpus=corpus + [INSTRUCTION])
    if not os.path.isfile(data_path):
        rows = gsm8k_rows(AutoTokenizer.from_pretrained(model_dir))
        pq.write_table(pa.Table.from_pylist(rows), data_path)
    return {"model": model_dir, "data": data_path}


def median_after_warmup(values: list[float], warmup: int) -> float | None:
    kept = values[warmup:] if len(values) > warmup else values
    return statistics.median(kept) if kept else None


# ------------------------------------------------------------------------------------------------- ours
def ours_overrides(paths: dict[str, str], variant: str, steps: int, run_dir: str) -> list[str]:
    return (
        OURS_BASE
        + OURS_VARIANTS[variant]
        + [
            f"data.train_files={paths['data']}",
            f"actor_rollout_ref.model.path={paths['model']}",
            f"trainer.total_training_steps={steps}",
            f"trainer.default_local_dir={run_dir}",
            "trainer.resume_mode=disable",
        ]
    )


def run_ours(paths: dict[str, str], variant: str, steps: int, run_dir: str) -> dict:
    """Our trainer through `main_ppo.run_ppo` (the entry point's code path); figures from metrics.jsonl."""
    from omegaconf import OmegaConf

    from verl.trainer import main_ppo
    from verl.utils import tracking

    config = OmegaConf.load(os.path.join(REPO_ROOT, "verl", "trainer", "config", "ppo_trainer.yaml"))
    config.pop("defaults", None)
    config.pop("hydra", None)
    config = OmegaConf.merge(config, OmegaConf.from_dotlist(ours_overrides(paths, variant, steps, run_dir)))
    OmegaConf.resolve(config)

    log_times: list[float] = []
    original_log = tracking.Tracking.log

    def timed_log(self, data, step):  # wall clock of every step, loop overhead included
        log_times.append(time.perf_counter())
        return original_log(self, data, step)

    tracking.Tracking.log = timed_log
    main_ppo.run_ppo(config)
    with open(os.path.join(run_dir, "logs", "metrics.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    records = [r for r in records if r.get("step", 0) > 0]
    batch = PROMPTS_PER_STEP * SAMPLES_PER_PROMPT
    timing = {}
    for record in records:
        for key, value in record.items():
            if key.startswith("timing_s/"):
                timing.setdefault(key[len("timing_s/") :], []).append(float(value))
    return {
        "step_s": timing.get("step", []),
        "wall_s": [b - a for a, b in zip(log_times, log_times[1:])],
        "gen_s": timing.get("gen", []),
        "gen_tokens": [r["response_length/mean"] * batch for r in records],
        "timing": timing,
        "score": [r.get("critic/score/mean") for r in records],
    }


# -------------------------------------------------------------------------------------------------- TRL
def run_trl(paths: dict[str, str], steps: int, run_dir: str) -> dict:
    """TRL's GRPOTrainer on the same model, prompts, reward and batch (generation via HF generate)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from verl.utils.reward_score import gsm8k

    torch.set_num_threads(THREADS)
    rows = [
        {"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]}
        for r in _read_parquet_rows(paths["data"])
    ]

    def gsm8k_reward(completions, ground_truth, **kwargs):
        return [gsm8k.compute_score(c[0]["content"], gt) for c, gt in zip(completions, ground_truth)]

    args = GRPOConfig(
        output_dir=run_dir,
        per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=PROMPTS_PER_STEP * SAMPLES_PER_PROMPT // MICRO_BATCH,
        num_generations=SAMPLES_PER_PROMPT,
        max_completion_length=MAX_RESPONSE_LEN,
        temperature=1.0,
        top_k=0,
        beta=KL_BETA,
        num_iterations=1,
        loss_type="dapo",
        learning_rate=LR,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,  # float32 like ours (TRL's default is bf16)
        gradient_checkpointing=False,  # like ours (TRL's default is on, which costs a recompute)
        seed=1,
        disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(paths["model"], dtype=torch.float32, attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(paths["model"])
    step_s: list[float] = []
    gen_s: list[float] = []
    gen_tokens: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_args, **_kwargs):
            self.start = time.perf_counter()
            gen_s.append(0.0)
            gen_tokens.append(0.0)

        def on_step_end(self, *_args, **_kwargs):
            step_s.append(time.perf_counter() - self.start)

    original_generate = model.generate

    def timed_generate(*args, **kwargs):
        start = time.perf_counter()
        out = original_generate(*args, **kwargs)
        if gen_s:
            gen_s[-1] += time.perf_counter() - start
            completion = out[:, kwargs["input_ids"].shape[1] :]
            gen_tokens[-1] += float(_count_until_eos(completion, tokenizer.eos_token_id))
        return out

    model.generate = timed_generate
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=gsm8k_reward,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[StepTimer()],
    )
    trainer.train()
    return {"step_s": step_s, "wall_s": step_s, "gen_s": gen_s, "gen_tokens": gen_tokens}


def _count_until_eos(completion, eos_id: int) -> int:
    """Response tokens up to and including the first eos (what our `response_mask` counts)."""
    from verl.utils.torch_functional import get_response_mask

    return int(get_response_mask(completion, eos_id).sum().item())


def _read_parquet_rows(path: str) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


# ------------------------------------------------------------------------------------------------ floor
def floor_log_probs(module, seq: dict, rows: slice):
    """Log-probs (rows, response_len) of the responses in `seq` under `module`: one padded forward."""
    from verl.utils.torch_functional import logprobs_from_logits

    logits = module(
        input_ids=seq["input_ids"][rows],
        attention_mask=seq["attention_mask"][rows],
        position_ids=seq["position_ids"][rows],
    ).logits
    response_len = seq["responses"].shape[1]
    return logprobs_from_logits(logits[:, -response_len - 1 : -1].float(), seq["responses"][rows])


def floor_rollout(model, tokenizer, batch: list[dict]) -> tuple[dict, float]:
    """HF generate for the batch (prompts padded to the batch's longest, as TRL does); returns the sequences
    and the generation seconds."""
    import torch

    from verl.utils.torch_functional import get_response_mask

    texts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in batch]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    prompt_ids = enc["input_ids"].repeat_interleave(SAMPLES_PER_PROMPT, dim=0)
    prompt_mask = enc["attention_mask"].repeat_interleave(SAMPLES_PER_PROMPT, dim=0)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    model.eval()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=True, temperature=1.0, top_k=0,
            top_p=1.0, max_new_tokens=MAX_RESPONSE_LEN, eos_token_id=eos, pad_token_id=pad,
        )  # fmt: skip
    seconds = time.perf_counter() - start
    responses = out[:, prompt_ids.shape[1] :]
    response_mask = get_response_mask(responses, eos)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    seq = {
        "input_ids": torch.cat([prompt_ids, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": responses,
        "response_mask": response_mask.float(),
    }
    return seq, seconds


def floor_advantages(tokenizer, seq: dict, batch: list[dict]):
    """GSM8K scores and GRPO advantages (group mean and std) as a (bs, 1) column."""
    import torch

    from verl.utils.reward_score import gsm8k

    texts = tokenizer.batch_decode(seq["responses"], skip_special_tokens=True)
    truths = [r["reward_model"]["ground_truth"] for r in batch for _ in range(SAMPLES_PER_PROMPT)]
    scores = torch.tensor([gsm8k.compute_score(t, g) for t, g in zip(texts, truths)])
    grouped = scores.view(-1, SAMPLES_PER_PROMPT)
    return ((grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True) + 1e-6)).view(-1, 1)


def run_floor(paths: dict[str, str], steps: int) -> dict:
    """The same step as bare code in one process: HF generate for the batch, one no-grad forward for the
    reference log-probs, one forward+backward (micro-batches) and an AdamW step. No framework."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(THREADS)
    torch.manual_seed(1)
    tokenizer = AutoTokenizer.from_pretrained(paths["model"])
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(paths["model"], dtype=torch.float32, attn_implementation="sdpa")
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    rows = _read_parquet_rows(paths["data"])
    step_s, gen_s, gen_tokens = [], [], []
    for step in range(steps):
        start = time.perf_counter()
        batch = rows[step * PROMPTS_PER_STEP : (step + 1) * PROMPTS_PER_STEP]
        seq, seconds = floor_rollout(model, tokenizer, batch)
        gen_s.append(seconds)
        gen_tokens.append(float(seq["response_mask"].sum()))
        adv = floor_advantages(tokenizer, seq, batch)
        micro = [slice(i, i + MICRO_BATCH) for i in range(0, len(adv), MICRO_BATCH)]
        with torch.no_grad():
            ref_lp = torch.cat([floor_log_probs(ref, seq, rows_) for rows_ in micro])
        model.train()
        mask, n_tokens = seq["response_mask"], seq["response_mask"].sum()
        for rows_ in micro:
            log_prob = floor_log_probs(model, seq, rows_)
            pg = -adv[rows_] * torch.exp(log_prob - log_prob.detach())  # on-policy ratio (1, with its gradient)
            delta = ref_lp[rows_] - log_prob
            kl = torch.exp(delta) - delta - 1  # k3, as low_var_kl and TRL
            (((pg + KL_BETA * kl) * mask[rows_]).sum() / n_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        step_s.append(time.perf_counter() - start)
    return {"step_s": step_s, "wall_s": step_s, "gen_s": gen_s, "gen_tokens": gen_tokens}


# ------------------------------------------------------------------------------------- process + memory
def launch(kind: str, variant: str, workdir: str, steps: int, log_path: str) -> dict:
    """Run one benchmark run in a subprocess; return its figures plus the peak RSS of its process tree."""
    result_path = os.path.join(workdir, f"result_{variant}_{time.time_ns()}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", kind, "--_variant", variant]
    cmd += ["--workdir", workdir, "--steps", str(steps), "--_result", result_path]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    # the same OpenMP setting for all three runs: spinning threads are ~10x slower on a shared, busy CPU
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    start = time.perf_counter()
    with open(log_path, "a", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
        memory = TreeMemory(proc.pid)
        code = proc.wait()
        memory.stop()
    if code != 0 or not os.path.isfile(result_path):
        raise RuntimeError(f"benchmark run {variant!r} failed with exit code {code}; see {log_path}")
    with open(result_path, encoding="utf-8") as f:
        result = json.load(f)
    result.update(
        {
            "name": variant,
            "kind": kind,
            "peak_rss_mb": memory.peak_mb,
            "peak_rss_work_mb": memory.peak_work_mb,
            "peak_pss_mb": memory.peak_pss_mb,
            "peak_rss_by_process_mb": memory.peak_by_kind,
        }
    )
    result["run_s"] = time.perf_counter() - start
    with open(result_path, "w", encoding="utf-8") as f:  # complete, so `--summarize` can rebuild a cut run
        json.dump(result, f)
    return result


def child_main(args: argparse.Namespace) -> None:
    paths = prepare(args.workdir)
    run_dir = tempfile.mkdtemp(prefix=f"run_{args._variant}_", dir=args.workdir)
    if args._child == "ours":
        result = run_ours(paths, args._variant, args.steps, run_dir)
    elif args._child == "trl":
        result = run_trl(paths, args.steps, run_dir)
    else:
        result = run_floor(paths, args.steps)
    with open(args._result, "w", encoding="utf-8") as f:
        json.dump(result, f)


# ---------------------------------------------------------------------------------------------- report
def summarize(results: list[dict], warmup: int) -> dict[str, dict]:
    """Per run name: median step/wall/gen seconds (pooled over rounds, warm-up steps dropped), tokens/s,
    phase medians, the orchestration share and the peak RSS (max over rounds)."""
    summary: dict[str, dict] = {}
    for name in dict.fromkeys(r["name"] for r in results):
        runs = [r for r in results if r["name"] == name]

        def pooled(key: str, runs=runs) -> list[float]:
            return [v for r in runs for v in r[key][warmup:]]

        step, wall, gen = pooled("step_s"), pooled("wall_s"), pooled("gen_s")
        tokens = pooled("gen_tokens")
        entry = {
            "kind": runs[0]["kind"],
            "rounds": len(runs),
            "step_s": statistics.median(step) if step else None,
            "step_s_per_round": [median_after_warmup(r["step_s"], warmup) for r in runs],
            "wall_s": statistics.median(wall) if wall else None,
            "gen_s": statistics.median(gen) if gen else None,
            "gen_tokens_per_s": sum(tokens) / sum(gen) if gen and sum(gen) > 0 else None,
            "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
            "peak_rss_work_mb": max(r["peak_rss_work_mb"] for r in runs),
            "peak_pss_mb": max(r.get("peak_pss_mb", 0.0) for r in runs),
            "peak_rss_by_process_mb": {
                k: max(r["peak_rss_by_process_mb"].get(k, 0.0) for r in runs) for k in runs[0]["peak_rss_by_process_mb"]
            },
        }
        if "timing" in runs[0]:
            phases = {k for r in runs for k in r["timing"]}
            entry["phases_s"] = {
                k: statistics.median([v for r in runs for v in r["timing"].get(k, [])[warmup:]] or [0.0])
                for k in sorted(phases)
            }
            shares = []
            for r in runs:
                steps_ = r["timing"]["step"]
                for i in range(warmup, len(steps_)):
                    inner = sum(v[i] for k, v in r["timing"].items() if k != "step" and i < len(v))
                    shares.append(1.0 - inner / steps_[i])
            entry["orchestration_share"] = statistics.median(shares) if shares else None
        summary[name] = entry
    return summary


def ratios(summary: dict[str, dict]) -> dict[str, float]:
    """The bars' ratios for "ours" and, when it ran, "ours-single_process" (the worker in the driver)."""
    out = {}
    trl, floor = summary.get("trl"), summary.get("floor")
    for name in ("ours", "ours-single_process"):
        ours = summary.get(name)
        if ours and trl:
            out[f"{name}/trl step time"] = ours["step_s"] / trl["step_s"]
            out[f"{name}/trl peak RSS (work processes)"] = ours["peak_rss_work_mb"] / trl["peak_rss_mb"]
            out[f"{name}/trl peak RSS (all, Ray daemons too)"] = ours["peak_rss_mb"] / trl["peak_rss_mb"]
            if ours["peak_pss_mb"] and trl["peak_pss_mb"]:
                out[f"{name}/trl peak PSS (all processes)"] = ours["peak_pss_mb"] / trl["peak_pss_mb"]
        if ours and floor:
            out[f"{name}/floor step time"] = ours["step_s"] / floor["step_s"]
            out[f"{name}/floor generation tokens/s"] = ours["gen_tokens_per_s"] / floor["gen_tokens_per_s"]
        if ours and ours.get("orchestration_share") is not None:
            out[f"{name} orchestration share"] = ours["orchestration_share"]
    return out


def print_table(summary: dict[str, dict], ratio: dict[str, float]) -> None:
    header = (
        f"{'run':<22}{'step s':>8}{'wall s':>8}{'gen s':>8}{'gen tok/s':>11}{'RSS MB':>9}{'RSS work':>10}{'PSS MB':>9}"
        f"{'orch':>7}"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for name, e in summary.items():
        orch = e.get("orchestration_share")
        print(
            f"{name:<22}{_fmt(e['step_s']):>8}{_fmt(e['wall_s']):>8}{_fmt(e['gen_s']):>8}"
            f"{_fmt(e['gen_tokens_per_s'], 0):>11}{e['peak_rss_mb']:>9.0f}{e['peak_rss_work_mb']:>10.0f}"
            f"{e['peak_pss_mb']:>9.0f}"
            f"{'' if orch is None else f'{orch:.2%}':>7}"
        )
    for name, e in summary.items():
        parts = ", ".join(f"{k} {v:.0f}" for k, v in e["peak_rss_by_process_mb"].items())
        print(f"  {name} peak RSS by process kind (MB): {parts}")
        if e.get("phases_s"):
            print(f"  {name} phases (median s): " + ", ".join(f"{k} {v:.2f}" for k, v in e["phases_s"].items()))
    print()
    for key, value in ratio.items():
        print(f"{key:<58}{value:.3f}")


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def finished_runs(workdir: str) -> list[dict]:
    """The complete run results left in `workdir` by earlier runs, oldest first."""
    paths = sorted(
        (os.path.join(workdir, f) for f in os.listdir(workdir) if f.startswith("result_")), key=os.path.getmtime
    )
    results = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            result = json.load(f)
        if "peak_rss_mb" in result:
            results.append(result)
    if not results:
        raise SystemExit(f"no finished runs in {workdir}")
    return results


def schedule(runs: list[str], variants: list[str], rounds: int) -> list[tuple[str, str]]:
    """(kind, name) in run order: each round runs ours, TRL, floor in turn; the extra variants once, last."""
    order = []
    for _ in range(rounds):
        order += [(kind, kind) for kind in runs]
    order += [("ours", v) for v in variants]
    return order


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="steps per run (default 12)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps not counted (default 2)")
    parser.add_argument("--rounds", type=int, default=2, help="times ours/TRL/floor alternate (default 2)")
    parser.add_argument("--runs", default="ours,trl,floor", help="which of ours,trl,floor alternate")
    parser.add_argument("--variants", default=None, help="extra runs of ours to show each change (comma list)")
    parser.add_argument("--quick", action="store_true", help="3 steps, 1 warm-up, 1 round, no variants")
    parser.add_argument("--workdir", default=None, help="where the model, data and runs go (default: a temp dir)")
    parser.add_argument("--out", default=None, help="JSON file for the figures (default: <workdir>/bench.json)")
    parser.add_argument("--summarize", action="store_true", help="only rebuild the table from <workdir>'s runs")
    parser.add_argument("--_child", choices=["ours", "trl", "floor"], help=argparse.SUPPRESS)
    parser.add_argument("--_variant", default="ours", help=argparse.SUPPRESS)
    parser.add_argument("--_result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.workdir is None:
        args.workdir = tempfile.mkdtemp(prefix="bench_grpo_")
    os.makedirs(args.workdir, exist_ok=True)
    if args._child:
        child_main(args)
        return 0

    if args.quick:
        args.steps, args.warmup, args.rounds = 3, 1, 1
    if args.variants is None:
        args.variants = "" if args.quick else ",".join(OURS_VARIANTS)
    variants = [v for v in args.variants.split(",") if v]
    variants = [v for v in variants if v != "ours"]
    runs = [r for r in args.runs.split(",") if r]
    for name in runs:
        if name not in ("ours", "trl", "floor"):
            parser.error(f"--runs: unknown run {name!r}; allowed: ours, trl, floor")
    for name in variants:
        if name not in OURS_VARIANTS:
            parser.error(f"--variants: unknown variant {name!r}; allowed: {', '.join(OURS_VARIANTS)}")
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must be more than --warmup ({args.warmup})")

    if args.summarize:
        results = finished_runs(args.workdir)
    else:
        prepare(args.workdir)
        log_path = os.path.join(args.workdir, "bench.log")
        results = []
        for kind, name in schedule(runs, variants, args.rounds):
            result = launch(kind, name, args.workdir, args.steps, log_path)
            step = median_after_warmup(result["step_s"], args.warmup)
            print(
                f"{name}: median step {step:.2f} s, peak RSS {result['peak_rss_mb']:.0f} MB ({result['run_s']:.0f} s)"
            )
            results.append(result)
    summary = summarize(results, args.warmup)
    ratio = ratios(summary)
    print_table(summary, ratio)
    out = args.out or os.path.join(args.workdir, "bench.json")
    config = {"steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "threads": THREADS}
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"config": config, "summary": summary, "ratios": ratio, "runs": results}, f, indent=2)
    print(f"\nfigures written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
