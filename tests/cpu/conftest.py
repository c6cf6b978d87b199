"""Fixtures of the CPU speed-up tests: the tiny model and its tokenizer (the same as the hf rollout's tests)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
