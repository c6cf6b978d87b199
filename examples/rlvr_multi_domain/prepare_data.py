"""Data of the multi-domain RLVR example: three domains, each a `train.parquet` + `test.parquet` in verl's layout.

    math/   GSM8K-style word problems ("... #### N"), data_source "openai/gsm8k": generated arithmetic by default,
            or the first rows of real GSM8K with --gsm8k_dir (../shared/data/gsm8k), via
            examples/data_preprocess/gsm8k.py
    tools/  synthetic RLLA tool calls (verl/utils/dataset/rlla_synthetic.py), data_source "rlla"
    code/   small stdin/stdout programs checked by the code sandbox, data_source "code"

Usage: python examples/rlvr_multi_domain/prepare_data.py --local_dir DIR [--n_train 32] [--n_test 8] [--gsm8k_dir D]
Deterministic for a given --seed. Nothing here is downloaded; the data is written only under --local_dir.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys

import pandas as pd

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)

from verl.utils.dataset.rlla_synthetic import generate_records, records_to_rows  # noqa: E402

MATH_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
CODE_INSTRUCTION = (
    "Write a Python program that reads from standard input and prints the answer. Put it in ```python```."
)
_NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana"]
_THINGS = ["apples", "books", "coins", "marbles", "stamps", "pencils"]


def _math_problem(rng: random.Random) -> tuple[str, int]:
    name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
    a, b, c = rng.randint(2, 20), rng.randint(2, 20), rng.randint(2, 5)
    kind = rng.choice(["add", "sub", "mul"])
    if kind == "add":
        return f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?", a + b
    if kind == "sub":
        return f"{name} has {a + b} {thing} and gives away {b}. How many {thing} are left?", a
    return f"{name} buys {c} boxes with {a} {thing} in each box. How many {thing} does {name} buy?", a * c


def math_rows(n: int, split: str, rng: random.Random) -> list[dict]:
    rows = []
    for i in range(n):
        question, answer = _math_problem(rng)
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": f"{question} {MATH_INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {"split": split, "index": i, "question": question},
            }
        )
    return rows


# (task text with {k}, expected output of an input text given k, input generator, reference program with {k})
_CODE_TASKS = [
    (
        "Read an integer n and print n + {k}.",
        lambda s, k: str(int(s) + k),
        lambda r: str(r.randint(-50, 50)),
        "print(int(input()) + {k})",
    ),
    (
        "Read an integer n and print n * {k}.",
        lambda s, k: str(int(s) * k),
        lambda r: str(r.randint(-20, 20)),
        "print(int(input()) * {k})",
    ),
    (
        "Read a word and print it reversed.",
        lambda s, k: s[::-1],
        lambda r: r.choice(["abc", "level", "code"]),
        "print(input()[::-1])",
    ),
    (
        "Read a word and print it in upper case.",
        lambda s, k: s.upper(),
        lambda r: r.choice(["hi", "rl", "ok"]),
        "print(input().upper())",
    ),
    (
        "Read integers separated by spaces and print their sum.",
        lambda s, k: str(sum(map(int, s.split()))),
        lambda r: " ".join(str(r.randint(0, 9)) for _ in range(r.randint(2, 5))),
        "print(sum(map(int, input().split())))",
    ),
]


def code_rows(n: int, split: str, rng: random.Random) -> list[dict]:
    rows = []
    for i in range(n):
        text, solve, make_input, reference = rng.choice(_CODE_TASKS)
        k = rng.randint(2, 9)
        inputs = [make_input(rng) for _ in range(3)]
        tests = {"inputs": [x + "\n" for x in inputs], "outputs": [solve(x, k) + "\n" for x in inputs]}
        rows.append(
            {
                "data_source": "code",
                "prompt": [{"role": "user", "content": f"{text.format(k=k)} {CODE_INSTRUCTION}"}],
                "ability": "code",
                "reward_model": {"style": "rule", "ground_truth": json.dumps(tests)},
                "extra_info": {"split": split, "index": i, "reference": reference.format(k=k)},
            }
        )
    return rows


def _write(rows: list[dict], path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pd.DataFrame(rows).to_parquet(path)


def _real_gsm8k(gsm8k_dir: str, out_dir: str, n_train: int, n_test: int) -> None:
    script = os.path.join(REPO_ROOT, "examples", "data_preprocess", "gsm8k.py")
    subprocess.run(
        [sys.executable, script, "--input_dir", gsm8k_dir, "--local_dir", out_dir, "--max_train", str(n_train)],
        check=True,
    )
    test = pd.read_parquet(os.path.join(out_dir, "test.parquet")).head(n_test)
    test.to_parquet(os.path.join(out_dir, "test.parquet"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_dir", required=True, help="output folder (gets math/, tools/, code/)")
    parser.add_argument("--n_train", type=int, default=32, help="training prompts per domain")
    parser.add_argument("--n_test", type=int, default=8, help="validation prompts per domain")
    parser.add_argument("--gsm8k_dir", default=None, help="real GSM8K jsonl folder for the math domain (optional)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    out = args.local_dir
    if args.gsm8k_dir:
        _real_gsm8k(args.gsm8k_dir, os.path.join(out, "math"), args.n_train, args.n_test)
    else:
        _write(math_rows(args.n_train, "train", rng), os.path.join(out, "math", "train.parquet"))
        _write(math_rows(args.n_test, "test", rng), os.path.join(out, "math", "test.parquet"))
    records = generate_records(args.n_train + args.n_test, seed=args.seed)
    _write(records_to_rows(records[: args.n_train], "train"), os.path.join(out, "tools", "train.parquet"))
    _write(records_to_rows(records[args.n_train :], "test"), os.path.join(out, "tools", "test.parquet"))
    _write(code_rows(args.n_train, "train", rng), os.path.join(out, "code", "train.parquet"))
    _write(code_rows(args.n_test, "test", rng), os.path.join(out, "code", "test.parquet"))
    print(f"multi-domain data written to {out}: math/, tools/, code/ ({args.n_train} train, {args.n_test} test each)")


if __name__ == "__main__":
    main()
