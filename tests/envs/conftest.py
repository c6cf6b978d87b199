"""Fixtures of the environment tests: the tiny model behind an `hf` engine, and its tokenizer."""

import pytest
from omegaconf import OmegaConf

from verl.workers.rollout.hf_rollout import HFRollout


@pytest.fixture
def engine(model, tokenizer):
    """A fresh `hf` engine (12 new tokens at most, sampling at temperature 1 unless a request says otherwise)."""
    config = OmegaConf.create({"response_length": 12, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                               "do_sample": True, "seed": 0, "calculate_log_probs": False})  # fmt: skip
    return HFRollout(model, config, tokenizer)
