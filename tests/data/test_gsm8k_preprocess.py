"""Tests of examples/data_preprocess/gsm8k.py against the real GSM8K files and broken inputs."""

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "examples", "data_preprocess", "gsm8k.py")
GSM8K = os.path.join(os.path.dirname(REPO), "shared", "data", "gsm8k")
needs_real = pytest.mark.skipif(
    not os.path.isfile(os.path.join(GSM8K, "test.jsonl")), reason=f"GSM8K not found at {GSM8K}"
)
SUFFIX = ' Let\'s think step by step and output the final answer after "####".'


def run_script(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("gsm8k"))
    result = run_script("--local_dir", out, "--max_train", "50")  # default --input_dir: ../shared/data/gsm8k
    assert result.returncode == 0, result.stderr
    return out


@needs_real
@pytest.mark.parametrize("split, expected_rows", [("train", 50), ("test", 1319)])
def test_rows_against_the_real_file(out_dir, split, expected_rows):
    rows = pq.read_table(os.path.join(out_dir, f"{split}.parquet")).to_pylist()
    source = read_lines(os.path.join(GSM8K, f"{split}.jsonl"))[:expected_rows]
    assert len(rows) == expected_rows
    for i, (row, record) in enumerate(zip(rows, source)):
        final = record["answer"].split("####")[-1].strip().replace(",", "")
        assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
        assert row["prompt"] == [{"role": "user", "content": record["question"] + SUFFIX}]
        assert row["reward_model"] == {"style": "rule", "ground_truth": final}
        assert row["extra_info"] == {
            "split": split,
            "index": i,
            "answer": record["answer"],
            "question": record["question"],
        }


@needs_real
def test_ground_truth_strips_commas(out_dir):
    rows = pq.read_table(os.path.join(out_dir, "test.parquet")).to_pylist()
    with_comma = [r for r in rows if "," in r["extra_info"]["answer"].split("####")[-1]]
    assert with_comma, "the GSM8K test split has answers like '#### 1,600'"
    for r in with_comma:
        gt = r["reward_model"]["ground_truth"]
        assert "," not in gt and float(gt) == float(r["extra_info"]["answer"].split("####")[-1].replace(",", ""))
    first = rows[0]
    assert first["reward_model"]["ground_truth"] == "18"  # Janet's ducks: "#### 18"


@needs_real
def test_parquet_loads_in_rlhf_dataset(out_dir, tiny_model_dir):
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.utils.tokenizer import hf_tokenizer

    ds = RLHFDataset(os.path.join(out_dir, "train.parquet"), hf_tokenizer(tiny_model_dir), {"max_prompt_length": 512})
    assert len(ds) == 50 and ds[7]["index"] == 7


@pytest.mark.parametrize(
    "bad_line, fragment",
    [("{not json", "not valid JSON"), ('{"question": "q"}', "'answer'"), ('{"question": "q", "answer": "7"}', "####")],
)
def test_bad_line_names_line_number(tmp_path, bad_line, fragment):
    good = json.dumps({"question": "1+1?", "answer": "1+1=2\n#### 2"})
    (tmp_path / "train.jsonl").write_text(f"{good}\n{good}\n{bad_line}\n")
    (tmp_path / "test.jsonl").write_text(f"{good}\n")
    out = tmp_path / "out"
    result = run_script("--input_dir", str(tmp_path), "--local_dir", str(out))
    assert result.returncode != 0
    assert "train.jsonl:3" in result.stderr and fragment in result.stderr, result.stderr
    assert not out.exists()


def test_small_input_with_negative_and_comma(tmp_path):
    lines = [{"question": "q0", "answer": "steps\n#### -3"}, {"question": "q1", "answer": "x\n#### 12,345"}]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    (tmp_path / "test.jsonl").write_text(json.dumps(lines[0]) + "\n")
    assert run_script("--input_dir", str(tmp_path), "--local_dir", str(tmp_path)).returncode == 0
    rows = pq.read_table(str(tmp_path / "train.parquet")).to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["-3", "12345"]
