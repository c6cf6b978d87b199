"""Tests of dataset/rlla_4k_raw/rlla.py: real and synthetic records to parquet, split, determinism, errors."""

import json
import os
import random
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.utils.dataset.rlla_synthetic import generate_records

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "dataset", "rlla_4k_raw", "rlla.py")
REAL = os.path.join(os.path.dirname(REPO), "shared", "data", "rlla", "rlla_sft.json")
needs_real = pytest.mark.skipif(not os.path.isfile(REAL), reason=f"real RLLA records not found at {REAL}")


def run_script(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def read_rows(directory, split):
    return pq.read_table(os.path.join(directory, f"{split}.parquet")).to_pylist()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from verl.utils.tokenizer import hf_tokenizer

    return hf_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def real_dir(tmp_path_factory):
    if not os.path.isfile(REAL):
        pytest.skip(f"real RLLA records not found at {REAL}")
    out = str(tmp_path_factory.mktemp("rlla_real"))
    result = run_script("--input", REAL, "--local_dir", out)
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="module")
def synthetic_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("rlla_synthetic"))
    result = run_script("--synthetic", "4000", "--seed", "7", "--local_dir", out)
    assert result.returncode == 0, result.stderr
    return out


@needs_real
def test_real_records_split_and_rows(real_dir):
    with open(REAL, encoding="utf-8") as f:
        records = json.load(f)
    train, test = read_rows(real_dir, "train"), read_rows(real_dir, "test")
    assert (len(train), len(test)) == (392, 8)  # last 2% of 400
    shuffled = list(records)
    random.Random(31415).shuffle(shuffled)
    for split, rows, expected in (("train", train, shuffled[:392]), ("test", test, shuffled[392:])):
        for i, (row, record) in enumerate(zip(rows, expected)):
            assert row["data_source"] == "rlla" and row["ability"] == "tool_use"
            assert row["prompt"] == [
                {"role": "system", "content": record["instruction"]},
                {"role": "user", "content": record["input"]},
            ]
            assert row["reward_model"] == {"style": "rule", "ground_truth": record["output"]}
            assert row["extra_info"] == {"split": split, "index": i, **record}


@needs_real
def test_real_parquet_loads_in_rlhf_dataset(real_dir, tokenizer):
    config = {"max_prompt_length": 4096, "return_raw_chat": True}
    ds = RLHFDataset(os.path.join(real_dir, "test.parquet"), tokenizer, config)
    assert len(ds) == 8
    item = ds[3]
    row = read_rows(real_dir, "test")[3]
    assert item["index"] == 3 and item["raw_prompt"] == row["prompt"]
    assert item["reward_model"]["ground_truth"] == row["reward_model"]["ground_truth"]
    assert item["input_ids"].shape == (4096,) and item["attention_mask"].sum() == len(item["raw_prompt_ids"])


def test_synthetic_split_sizes_and_content(synthetic_dir):
    train, test = read_rows(synthetic_dir, "train"), read_rows(synthetic_dir, "test")
    assert (len(train), len(test)) == (3920, 80)
    # The exact order of an independent generate + shuffle: the script is deterministic and forwards --seed.
    shuffled = generate_records(4000, seed=7)
    random.Random(31415).shuffle(shuffled)
    for rows, expected in ((train, shuffled[:3920]), (test, shuffled[3920:])):
        assert [r["reward_model"]["ground_truth"] for r in rows] == [r["output"] for r in expected]
        assert [r["prompt"][0]["content"] for r in rows] == [r["instruction"] for r in expected]
        assert [r["prompt"][1]["content"] for r in rows] == [r["input"] for r in expected]
    assert [r["extra_info"]["index"] for r in train[:3]] == [0, 1, 2]
    assert {r["extra_info"]["split"] for r in test} == {"test"}


def test_synthetic_parquet_loads_in_rlhf_dataset(synthetic_dir, tokenizer):
    ds = RLHFDataset(os.path.join(synthetic_dir, "test.parquet"), tokenizer, {"max_prompt_length": 512})
    assert len(ds) == 80  # no prompt is filtered at 512 tokens
    item = ds[10]
    assert item["index"] == 10 and item["data_source"] == "rlla"
    assert item["reward_model"]["ground_truth"] == read_rows(synthetic_dir, "test")[10]["reward_model"]["ground_truth"]


def _write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f)
    return str(path)


@pytest.mark.parametrize(
    "payload, fragments",
    [
        ("missing_key", ["record 3", "'output'"]),
        ("not_dict", ["record 1", "str"]),
        ("not_list", ["JSON list"]),
        ("not_string", ["record 0", "'input'", "string"]),
    ],
)
def test_bad_input_writes_nothing(tmp_path, payload, fragments):
    good = {"instruction": "sys", "input": "user", "output": "<think> x </think>\n<response> y </response>"}
    records = [dict(good) for _ in range(6)]
    if payload == "missing_key":
        del records[3]["output"]
    elif payload == "not_dict":
        records[1] = "oops"
    elif payload == "not_string":
        records[0]["input"] = ["not", "text"]
    data = {"records": records} if payload == "not_list" else records
    source = _write_json(tmp_path / "raw.json", data)
    out = tmp_path / "out"
    out.mkdir()
    sentinel = b"previous output, must survive"
    (out / "train.parquet").write_bytes(sentinel)

    result = run_script("--input", source, "--local_dir", str(out))
    assert result.returncode != 0
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr
    assert sorted(os.listdir(out)) == ["train.parquet"]
    assert (out / "train.parquet").read_bytes() == sentinel


def test_missing_input_file(tmp_path):
    result = run_script("--input", str(tmp_path / "absent.json"), "--local_dir", str(tmp_path / "out"))
    assert result.returncode != 0 and "absent.json" in result.stderr
    assert not (tmp_path / "out").exists()


def test_small_input_keeps_one_test_record(tmp_path):
    good = {"instruction": "sys", "input": "user", "output": "<think> x </think>\n<response> y </response>"}
    source = _write_json(tmp_path / "raw.json", [dict(good, input=f"u{i}") for i in range(7)])
    assert run_script("--input", source, "--local_dir", str(tmp_path)).returncode == 0
    assert (len(read_rows(tmp_path, "train")), len(read_rows(tmp_path, "test"))) == (6, 1)
