"""Prepare the embedded default job (train_grpo.sh / train_ppo.sh without BASE_MODEL):
`python -m verl.trainer.prepare_default --out outputs/default [--seed 1]`.

Makes synthetic RLLA records (disjoint SFT, RL and validation sets; SFT targets from the imperfect demonstrator),
a tiny Qwen2 model with a tokenizer trained on that text, and a short SFT warm start saved as `<out>/sft_model`.
A stage whose output exists is skipped. Layer 8 helper.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import time

import pandas as pd
from omegaconf import OmegaConf

from verl.utils.dataset.rlla_synthetic import corpus_texts, demonstration, generate_records, records_to_rows

N_SFT, N_RL_TRAIN, N_RL_VAL = 1500, 2000, 128
SFT_STEPS = 300  # ~3.5 min on 2 cores; fewer leaves the tool calls too broken for GRPO to find a reward signal


def _write_parquet(rows: list[dict], path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    pd.DataFrame(rows).to_parquet(tmp)
    os.replace(tmp, path)


def prepare_data(out: str, seed: int) -> str:
    data_dir = os.path.join(out, "data")
    if os.path.isfile(os.path.join(data_dir, "test.parquet")) and os.path.isfile(
        os.path.join(out, "sft", "train.parquet")
    ):
        return data_dir
    records = generate_records(N_SFT + N_RL_TRAIN + N_RL_VAL, seed=seed)
    sft, rl_train, rl_val = records[:N_SFT], records[N_SFT : N_SFT + N_RL_TRAIN], records[N_SFT + N_RL_TRAIN :]
    stale = random.Random(f"demonstrations-{seed}")  # which demonstrations are stale (rlla_synthetic.demonstration)
    sft_rows = [
        {
            "messages": [
                {"role": "system", "content": r["instruction"]},
                {"role": "user", "content": r["input"]},
                {"role": "assistant", "content": demonstration(r, stale)},
            ]
        }
        for r in sft
    ]
    _write_parquet(sft_rows[: len(sft_rows) - 50], os.path.join(out, "sft", "train.parquet"))
    _write_parquet(sft_rows[len(sft_rows) - 50 :], os.path.join(out, "sft", "val.parquet"))
    _write_parquet(records_to_rows(rl_train, split="train"), os.path.join(data_dir, "train.parquet"))
    _write_parquet(records_to_rows(rl_val, split="test"), os.path.join(data_dir, "test.parquet"))
    return data_dir


def prepare_base_model(out: str, seed: int, size: str) -> str:
    from verl.models.tiny import build_tiny_model

    path = os.path.join(out, "base_model")
    if not os.path.isfile(os.path.join(path, "config.json")):
        build_tiny_model(path, size=size, seed=seed, corpus=list(corpus_texts(3000, seed=seed)))
    return path


def prepare_sft_model(out: str, base_model: str, seed: int, steps: int) -> str:
    from verl.trainer.fsdp_sft_trainer import run_sft

    final = os.path.join(out, "sft_model")
    if os.path.isfile(os.path.join(final, "config.json")):
        return final
    config_path = os.path.join(os.path.dirname(__file__), "config", "sft_trainer.yaml")
    config = OmegaConf.merge(
        OmegaConf.load(config_path),
        OmegaConf.create(
            {
                "data": {
                    "train_files": os.path.join(out, "sft", "train.parquet"),
                    "val_files": os.path.join(out, "sft", "val.parquet"),
                    "messages_key": "messages",
                    "max_length": 512,
                    "truncation": "right",
                    "train_batch_size": 16,
                    "micro_batch_size_per_gpu": 16,
                },
                "model": {"partial_pretrain": base_model},
                "optim": {"lr": 3e-3, "warmup_steps_ratio": 0.05, "lr_scheduler": "cosine"},
                "trainer": {
                    "default_local_dir": os.path.join(out, "sft_run"),
                    "total_training_steps": steps,
                    "total_epochs": 10,
                    "seed": seed,
                    "logger": ["console"],
                    "save_freq": -1,
                    "test_freq": -1,
                    "device": "cpu",
                },
            }
        ),
    )
    hf_path = run_sft(config)
    tmp = final + ".tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    shutil.copytree(hf_path, tmp)
    os.replace(tmp, final)
    return final


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/default", help="folder for data, models and runs")
    parser.add_argument("--seed", type=int, default=1, help="seed of data, model init and SFT")
    parser.add_argument("--size", default="xs", choices=["xs", "s", "m"], help="tiny model size")
    parser.add_argument("--sft_steps", type=int, default=SFT_STEPS, help="SFT optimizer steps")
    args = parser.parse_args(argv)
    start = time.time()
    data_dir = prepare_data(args.out, args.seed)
    base = prepare_base_model(args.out, args.seed, args.size)
    sft = prepare_sft_model(args.out, base, args.seed, args.sft_steps)
    print(f"default job prepared in {time.time() - start:.0f} s: data {data_dir}, SFT model {sft}", flush=True)


if __name__ == "__main__":
    main()
