"""Turn ToolRL's raw RLLA records into verl parquet files: `train.parquet` and `test.parquet`.

Input: a JSON list of `{"instruction", "input", "output"}` records (ToolRL's `rlla_rl.json`), or, with
`--synthetic N`, N records from `verl.utils.dataset.rlla_synthetic.generate_records(N, seed)`.

Split: the list is shuffled in place with `random.Random(31415).shuffle(records)` (Python's Mersenne
Twister, the same order on every platform); the last 2% (`max(1, n // 50)` records) become the test split,
the rest the train split.

Each parquet row (verl's layout):
    data_source  "rlla"
    prompt       [{"role": "system", "content": instruction}, {"role": "user", "content": input}]
    ability      "tool_use"
    reward_model {"style": "rule", "ground_truth": output}
    extra_info   {"split", "index" (row number within the split), "instruction", "input", "output"}

Bad input (not a JSON list, a record that is not a dict, a missing or non-string key) stops with an error
naming the record's position (0-based, in the file's order) and exit code 1; nothing is written. Outputs are
written to temporary files and renamed into place only when both splits are complete.

Usage (from the repository root):
    python dataset/rlla_4k_raw/rlla.py [--input dataset/rlla_4k_raw/rlla_rl.json] [--local_dir dataset/rlla_4k]
    python dataset/rlla_4k_raw/rlla.py --synthetic 4000 [--seed 0] [--local_dir dataset/rlla_4k]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import sys
import tempfile

import pyarrow as pa
import pyarrow.parquet as pq

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_INPUT = os.path.join(HERE, "rlla_rl.json")
DEFAULT_LOCAL_DIR = os.path.join(os.path.dirname(HERE), "rlla_4k")
SHUFFLE_SEED = 31415
RECORD_KEYS = ("instruction", "input", "output")


class RecordError(ValueError):
    """A raw record that cannot be converted; the message names its position."""


def load_records(path: str) -> list[dict]:
    """Read and validate the raw JSON list; raise RecordError naming the first bad record and key."""
    if not os.path.isfile(path):
        raise RecordError(f"input file {path!r} does not exist")
    with open(path, encoding="utf-8") as f:
        try:
            records = json.load(f)
        except json.JSONDecodeError as err:
            raise RecordError(f"{path!r} is not valid JSON: {err}") from err
    if not isinstance(records, list):
        raise RecordError(f"{path!r} must hold a JSON list of records, got a JSON {type(records).__name__}")
    for position, record in enumerate(records):
        if not isinstance(record, dict):
            raise RecordError(
                f"record {position} (0-based) of {path!r} is a {type(record).__name__}, expected an object "
                f"with keys {list(RECORD_KEYS)}"
            )
        for key in RECORD_KEYS:
            if key not in record:
                raise RecordError(
                    f"record {position} (0-based) of {path!r} is missing key {key!r}; "
                    f"it has {sorted(record)}, expected {list(RECORD_KEYS)}"
                )
            if not isinstance(record[key], str):
                raise RecordError(
                    f"record {position} (0-based) of {path!r}: key {key!r} must be a string, "
                    f"got {type(record[key]).__name__}"
                )
    return records


def split_records(records: list[dict], seed: int = SHUFFLE_SEED) -> tuple[list[dict], list[dict]]:
    """Shuffle a copy with `random.Random(seed).shuffle`; the last `max(1, n // 50)` records are the test split."""
    if len(records) < 2:
        raise RecordError(f"need at least 2 records to make a train and a test split, got {len(records)}")
    shuffled = list(records)
    random.Random(seed).shuffle(shuffled)
    n_test = max(1, len(shuffled) // 50)
    return shuffled[:-n_test], shuffled[-n_test:]


def write_splits(splits: dict[str, list[dict]], local_dir: str) -> dict[str, str]:
    """Write `{split}.parquet` for each split atomically: all temporaries first, then the renames."""
    os.makedirs(local_dir, exist_ok=True)
    temporaries: dict[str, str] = {}
    try:
        for split, records in splits.items():
            table = pa.Table.from_pylist(_load_synthetic_module().records_to_rows(records, split))
            fd, tmp = tempfile.mkstemp(prefix=f".{split}.", suffix=".parquet.tmp", dir=local_dir)
            os.close(fd)
            temporaries[split] = tmp
            pq.write_table(table, tmp)
    except BaseException:
        for tmp in temporaries.values():
            if os.path.exists(tmp):
                os.remove(tmp)
        raise
    outputs = {}
    for split, tmp in temporaries.items():
        outputs[split] = os.path.join(local_dir, f"{split}.parquet")
        os.replace(tmp, outputs[split])
    return outputs


def _load_synthetic_module():
    """verl/utils/dataset/rlla_synthetic.py (the generator and the row format), loaded by path: the module needs
    only the standard library, while importing the `verl` package would import torch (seconds per run)."""
    if "rlla_synthetic" in sys.modules:
        return sys.modules["rlla_synthetic"]
    path = os.path.join(os.path.dirname(os.path.dirname(HERE)), "verl", "utils", "dataset", "rlla_synthetic.py")
    if not os.path.isfile(path):
        from verl.utils.dataset import rlla_synthetic

        return rlla_synthetic
    spec = importlib.util.spec_from_file_location("rlla_synthetic", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Convert RLLA raw JSON (or synthetic records) to train/test parquet.")
    parser.add_argument("--input", default=DEFAULT_INPUT, help="JSON list of {instruction, input, output} records")
    parser.add_argument("--local_dir", default=DEFAULT_LOCAL_DIR, help="output directory for train/test.parquet")
    parser.add_argument("--synthetic", type=int, default=None, metavar="N", help="generate N synthetic records")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic generator (with --synthetic)")
    args = parser.parse_args(argv)

    try:
        if args.synthetic is not None:
            generate_records = _load_synthetic_module().generate_records
            if args.synthetic < 2:
                raise RecordError(f"--synthetic must be at least 2, got {args.synthetic}")
            records, source = generate_records(args.synthetic, seed=args.seed), f"synthetic (seed {args.seed})"
        else:
            records, source = load_records(args.input), args.input
        train, test = split_records(records)
    except RecordError as err:
        print(f"error: {err}; nothing written", file=sys.stderr)
        return 1
    outputs = write_splits({"train": train, "test": test}, args.local_dir)
    print(f"{len(records)} records from {source}: {len(train)} -> {outputs['train']}, {len(test)} -> {outputs['test']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
