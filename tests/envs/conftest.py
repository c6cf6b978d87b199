"""Fixtures of the environment tests: the tiny model behind an `hf` engine, and its tokenizer."""

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl.workers.rollout.hf_rollout import HFRollout


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture
def engine(model, tokenizer):
    """A fresh `hf` engine (12 new tokens at most, sampling at temperature 1 unless a request says otherwise)."""
    config = OmegaConf.create({"response_length": 12, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                               "do_sample": True, "seed": 0, "calculate_log_probs": False})  # fmt: skip
    return HFRollout(model, config, tokenizer)
