"""Fixtures for the dataset tests: the tiny model's tokenizer and a writer of small parquet files."""

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    """The tiny Qwen2 model's locally trained tokenizer (pad <|endoftext|>, eos <|im_end|>, Qwen chat template)."""
    from verl.utils.tokenizer import hf_tokenizer

    return hf_tokenizer(tiny_model_dir)


@pytest.fixture
def write_parquet(tmp_path):
    """write_parquet(rows, name="data.parquet") -> path of a parquet file holding `rows` (a list of dicts)."""

    def _write(rows, name="data.parquet", schema=None):
        path = os.path.join(tmp_path, name)
        table = pa.Table.from_pylist(rows, schema=schema)
        pq.write_table(table, path)
        return path

    return _write
