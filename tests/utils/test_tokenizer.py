"""Tests of verl/utils/tokenizer.py: loading, the pad-token fallback, and flattening token ids."""

import time

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from verl.utils.tokenizer import hf_tokenizer, normalize_token_ids

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def no_pad_dir(tmp_path_factory):
    """A small byte-level BPE tokenizer with eos <|im_end|> and no pad token, saved in HF format."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["hello world, what is the weather"] * 20, trainer)
    out = tmp_path_factory.mktemp("no_pad_tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", chat_template=CHAT_TEMPLATE).save_pretrained(
        out
    )
    return str(out)


def test_pad_falls_back_to_eos_with_warning(no_pad_dir):
    with pytest.warns(UserWarning, match="no pad token"):
        tok = hf_tokenizer(no_pad_dir)
    assert tok.pad_token == "<|im_end|>" and tok.pad_token_id == tok.eos_token_id
    untouched = hf_tokenizer(no_pad_dir, correct_pad_token=False)
    assert untouched.pad_token_id is None


def test_tiny_model_tokenizer_keeps_its_pad(tiny_model_dir):
    tok = hf_tokenizer(tiny_model_dir)
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"


@pytest.mark.parametrize("name", ["/no/such/tokenizer/dir", "./missing_tokenizer", "nobody-here/not-a-model"])
def test_missing_path_fails_fast_and_clearly(name):
    start = time.monotonic()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        hf_tokenizer(name)
    assert time.monotonic() - start < 5  # no minute of hub retries


def test_normalize_chat_template_batch_encoding(no_pad_dir):
    tok = hf_tokenizer(no_pad_dir, correct_pad_token=False)
    messages = [{"role": "user", "content": "hello world"}]
    encoded = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = tok("<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert normalize_token_ids(encoded) == expected["input_ids"]
    assert len(normalize_token_ids(encoded)) > 2  # not the number of BatchEncoding keys


def test_normalize_other_shapes():
    assert normalize_token_ids([3, 1, 2]) == [3, 1, 2]
    assert normalize_token_ids((3, 1)) == [3, 1]
    assert normalize_token_ids([[4, 5]]) == [4, 5]
    assert normalize_token_ids(torch.tensor([[4, 5, 6]])) == [4, 5, 6]
    assert normalize_token_ids(np.array([7, 8], dtype=np.int32)) == [7, 8]
    assert normalize_token_ids({"input_ids": [[9]], "attention_mask": [[1]]}) == [9]
    assert normalize_token_ids([]) == []
    out = normalize_token_ids(np.array([1]))
    assert type(out[0]) is int


def test_normalize_rejects_ambiguous_or_bad_input():
    with pytest.raises(ValueError, match="batch of 2"):
        normalize_token_ids([[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="input_ids"):
        normalize_token_ids({"attention_mask": [1]})
    with pytest.raises(TypeError, match="position 1"):
        normalize_token_ids([1, "2"])
    with pytest.raises(TypeError):
        normalize_token_ids("1 2 3")
