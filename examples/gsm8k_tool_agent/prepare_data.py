"""Parquet rows for the gsm8k_tool_agent example, in the layout of verl's GSM8K multi-turn tool recipe.

Each row: `data_source` "openai/gsm8k" (scored by the GSM8K rule), `agent_name` "tool_agent" (verl's tool agent
loop runs it), `prompt` (a system message naming the tools, then the question), `ability`, `reward_model`
(`ground_truth`: the answer number) and `extra_info` (`split`, `index`, `question`, `expression`: the arithmetic
that solves it, `need_tools_kwargs`, and `tools_kwargs`: the answer tool's `create_kwargs` with the ground truth,
which the agent-loop rollout passes to `Gsm8kAnswerTool.create`).

By default the problems are small synthetic word problems (one operation each, seeded); with `--gsm8k_dir DIR`
they are GSM8K's `train.jsonl` / `test.jsonl` (`{"question", "answer"}` lines, the answer ending in `#### N`).

    python examples/gsm8k_tool_agent/prepare_data.py --local_dir data/gsm8k_tool [--n_train 64 --n_test 16]
"""

from __future__ import annotations

import argparse
import json
import os
import random

import pandas as pd

from verl.utils.reward_score.gsm8k import extract_ground_truth

SYSTEM = (
    "You solve math word problems. Use the `calculator` tool for arithmetic, check your answer with the "
    "`calc_gsm8k_reward` tool, then give the final answer as `#### <number>`."
)
INSTRUCTION = "Let's think step by step and output the final answer after `####`."
NAMES = ("Janet", "Omar", "Lena", "Ravi", "Mia", "Tom")
ITEMS = ("apples", "eggs", "pencils", "coins", "books", "stickers")


def synthetic_problem(rng: random.Random) -> tuple[str, str, str]:
    """(question, expression, answer) of one seeded one-step word problem."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 40), rng.randint(2, 12)
    kind = rng.choice(("add", "sub", "mul"))
    if kind == "add":
        question = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
        return question, f"{a} + {b}", str(a + b)
    if kind == "sub":
        question = f"{name} has {a + b} {item} and gives away {b}. How many {item} are left?"
        return question, f"{a + b} - {b}", str(a)
    question = f"{name} buys {a} bags with {b} {item} in each. How many {item} is that?"
    return question, f"{a} * {b}", str(a * b)


def row(split: str, index: int, question: str, expression: str, answer: str) -> dict:
    return {
        "data_source": "openai/gsm8k",
        "agent_name": "tool_agent",
        "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {
            "split": split,
            "index": index,
            "question": question,
            "expression": expression,
            "need_tools_kwargs": True,
            "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": answer}}},
        },
    }


def gsm8k_rows(path: str, split: str, limit: int) -> list[dict]:
    rows = []
    with open(path) as lines:
        for line in lines:
            if line.strip() and len(rows) < limit:
                item = json.loads(line)
                rows.append(row(split, len(rows), item["question"], "", extract_ground_truth(item["answer"])))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_dir", required=True, help="folder for train.parquet and test.parquet")
    parser.add_argument("--n_train", type=int, default=64)
    parser.add_argument("--n_test", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gsm8k_dir", default=None, help="GSM8K train.jsonl/test.jsonl instead of synthetic problems")
    args = parser.parse_args()
    os.makedirs(args.local_dir, exist_ok=True)
    rng = random.Random(args.seed)
    for split, n in (("train", args.n_train), ("test", args.n_test)):
        if args.gsm8k_dir:
            rows = gsm8k_rows(os.path.join(args.gsm8k_dir, f"{split}.jsonl"), split, n)
        else:
            rows = [row(split, i, *synthetic_problem(rng)) for i in range(n)]
        pd.DataFrame(rows).to_parquet(os.path.join(args.local_dir, f"{split}.parquet"))
        print(f"wrote {len(rows)} {split} rows to {os.path.join(args.local_dir, split + '.parquet')}")


if __name__ == "__main__":
    main()
