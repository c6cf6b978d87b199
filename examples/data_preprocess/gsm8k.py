"""Turn GSM8K JSONL (`{"question", "answer"}` per line) into verl parquet files `train.parquet`/`test.parquet`.

Each row (verl's layout):
    data_source  "openai/gsm8k"
    prompt       [{"role": "user", "content": question + " " + INSTRUCTION}]
    ability      "math"
    reward_model {"style": "rule", "ground_truth": final number after "####", commas removed}
    extra_info   {"split", "index" (line order within the split), "answer" (full worked answer), "question"}

A bad line (not JSON, missing or non-string key, no "#### <number>") stops with an error naming the file
and the 1-based line number, exit code 1; nothing is written. Blank lines are skipped.

Usage (from the repository root; the default input is ../shared/data/gsm8k next to the repository):
    python examples/data_preprocess/gsm8k.py [--input_dir DIR] [--local_dir data/gsm8k] [--max_train N]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile

import pyarrow as pa
import pyarrow.parquet as pq

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_INPUT_DIR = os.path.join(os.path.dirname(REPO_ROOT), "shared", "data", "gsm8k")
DEFAULT_LOCAL_DIR = os.path.join(REPO_ROOT, "data", "gsm8k")
DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_FINAL_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


class GSM8KError(ValueError):
    """A JSONL line that cannot be converted; the message names the file and line."""


def extract_solution(answer: str) -> str:
    """The final number after "#### " with thousands separators removed ("1,234" -> "1234")."""
    match = _FINAL_ANSWER.search(answer)
    if match is None:
        raise GSM8KError(f"no '#### <number>' in answer {answer[-60:]!r}")
    return match.group(1).replace(",", "")


def read_jsonl(path: str) -> list[dict]:
    """Validated `{"question", "answer"}` records of one JSONL file."""
    if not os.path.isfile(path):
        raise GSM8KError(f"input file {path!r} does not exist")
    records = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise GSM8KError(f"{where}: not valid JSON ({err})") from err
            if not isinstance(record, dict):
                raise GSM8KError(f"{where}: expected a JSON object, got {type(record).__name__}")
            for key in ("question", "answer"):
                if not isinstance(record.get(key), str):
                    raise GSM8KError(f"{where}: key {key!r} missing or not a string; the line has {sorted(record)}")
            try:
                extract_solution(record["answer"])
            except GSM8KError as err:
                raise GSM8KError(f"{where}: {err}") from err
            records.append(record)
    if not records:
        raise GSM8KError(f"{path!r} holds no records")
    return records


def to_row(record: dict, split: str, index: int) -> dict:
    """One verl parquet row for a GSM8K record."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": record["question"] + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": extract_solution(record["answer"])},
        "extra_info": {"split": split, "index": index, "answer": record["answer"], "question": record["question"]},
    }


def write_parquet(rows: list[dict], path: str) -> None:
    """Write rows to `path` through a temporary file in the same directory (never a half-written file)."""
    fd, tmp = tempfile.mkstemp(prefix=".gsm8k.", suffix=".parquet.tmp", dir=os.path.dirname(path))
    os.close(fd)
    try:
        pq.write_table(pa.Table.from_pylist(rows), tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Convert GSM8K JSONL to verl train/test parquet.")
    parser.add_argument("--input_dir", default=DEFAULT_INPUT_DIR, help="directory with train.jsonl and test.jsonl")
    parser.add_argument("--local_dir", default=DEFAULT_LOCAL_DIR, help="output directory")
    parser.add_argument("--max_train", type=int, default=None, help="keep only the first N train records")
    args = parser.parse_args(argv)
    if args.max_train is not None and args.max_train < 1:
        parser.error(f"--max_train must be >= 1, got {args.max_train}")

    try:
        splits = {split: read_jsonl(os.path.join(args.input_dir, f"{split}.jsonl")) for split in ("train", "test")}
    except GSM8KError as err:
        print(f"error: {err}; nothing written", file=sys.stderr)
        return 1
    if args.max_train is not None:
        splits["train"] = splits["train"][: args.max_train]
    os.makedirs(args.local_dir, exist_ok=True)
    for split, records in splits.items():
        path = os.path.join(args.local_dir, f"{split}.parquet")
        write_parquet([to_row(r, split, i) for i, r in enumerate(records)], path)
        print(f"{len(records)} {split} records -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
