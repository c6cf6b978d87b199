"""Independent evaluation of an HF model folder on RLLA validation prompts: greedy and sampled, ToolRL's reward.

Used by `learn_vs_trl.py` to score our GRPO model, TRL's and the SFT start with the same code, outside either
trainer: HF `generate` on the chat-templated prompts of a verl parquet file (left-padded batches, at most
`max_new_tokens` tokens, stopping at the model's eos ids), each response decoded without special tokens and scored
by `verl.utils.reward_score.rlla.compute_score` against the row's `reward_model.ground_truth`.

- greedy: one answer per prompt, `do_sample=False`;
- sampled: `n` answers per prompt at temperature 1, no top-k / top-p (the trainer's validation setting):
  mean@n (per-prompt mean, averaged over prompts) and best@n (per-prompt best, averaged over prompts, over the n
  answers drawn; the trainer's best@n is bootstrapped, so the two differ slightly).

Usage: `python benchmarks/eval_rlla.py MODEL_DIR DATA_DIR/test.parquet [--n 4] [--seed 0] [--json OUT]`.
A benchmark helper, not a library module: it may import anything of the package.
"""

from __future__ import annotations

import argparse
import json
import time

MAX_NEW_TOKENS = 100
BATCH_PROMPTS = 32


def read_rows(parquet_path: str) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(parquet_path).to_pylist()


def _generate(model, tokenizer, prompts: list[str], do_sample: bool, n: int, max_new_tokens: int) -> list[str]:
    """`n` decoded responses per prompt (prompt-major), each up to its first eos."""
    import torch

    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    kwargs = {"do_sample": True, "temperature": 1.0, "top_k": None, "top_p": 1.0} if do_sample else {"do_sample": False}
    with torch.no_grad():
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            num_return_sequences=n,
            eos_token_id=model.generation_config.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **kwargs,
        )
    responses = out[:, enc["input_ids"].shape[1] :]
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    texts = []
    for row in responses.tolist():
        end = next((i for i, t in enumerate(row) if t in eos_ids), len(row))
        texts.append(tokenizer.decode(row[:end], skip_special_tokens=True))
    return texts


def evaluate_model(
    model_dir: str, parquet_path: str, n: int = 4, seed: int = 0, max_new_tokens: int = MAX_NEW_TOKENS
) -> dict:
    """Greedy and sampled ToolRL reward of the model in `model_dir` on the rows of `parquet_path`.

    Returns {"greedy": mean reward of the greedy answers, "greedy_format", "greedy_correctness",
    f"mean@{n}", f"best@{n}", "sampled_format", "sampled_correctness", "prompts", "seconds"}.
    """
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl.utils.reward_score import rlla

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = read_rows(parquet_path)
    prompts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    truths = [r["reward_model"]["ground_truth"] for r in rows]
    start = time.perf_counter()
    torch.manual_seed(seed)
    greedy, sampled = [], []
    for lo in range(0, len(rows), BATCH_PROMPTS):
        chunk, gts = prompts[lo : lo + BATCH_PROMPTS], truths[lo : lo + BATCH_PROMPTS]
        for text, gt in zip(_generate(model, tokenizer, chunk, False, 1, max_new_tokens), gts):
            greedy.append(rlla.compute_score(text, gt))
        texts = _generate(model, tokenizer, chunk, True, n, max_new_tokens)
        for i, text in enumerate(texts):
            sampled.append(rlla.compute_score(text, gts[i // n]))
    g = np.asarray([s[:3] for s in greedy], dtype=float)  # (prompts, [score, format, correctness])
    s = np.asarray([x[:3] for x in sampled], dtype=float).reshape(len(rows), n, 3)
    return {
        "greedy": float(g[:, 0].mean()),
        "greedy_format": float(g[:, 1].mean()),
        "greedy_correctness": float(g[:, 2].mean()),
        f"mean@{n}": float(s[:, :, 0].mean()),
        f"best@{n}": float(s[:, :, 0].max(axis=1).mean()),
        "sampled_format": float(s[:, :, 1].mean()),
        "sampled_correctness": float(s[:, :, 2].mean()),
        "prompts": len(rows),
        "seconds": round(time.perf_counter() - start, 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", help="HF model folder (config, weights, tokenizer)")
    parser.add_argument("parquet", help="verl parquet file with prompt and reward_model.ground_truth")
    parser.add_argument("--n", type=int, default=4, help="sampled answers per prompt")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampled answers")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    result = evaluate_model(args.model_dir, args.parquet, n=args.n, seed=args.seed)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
