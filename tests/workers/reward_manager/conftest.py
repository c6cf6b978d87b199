"""Fixtures of the reward-manager tests: a character-level tokenizer and a DataProto builder.

The tokenizer is built here with `tokenizers` (one token per ASCII character, plus <pad>/<eos>/<unk>),
so that decoding reproduces text exactly (newlines included) without depending on other modules.
"""

import numpy as np
import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from verl.protocol import DataProto


@pytest.fixture(scope="session")
def char_tokenizer():
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for char in [chr(code) for code in range(32, 127)] + ["\n"]:
        vocab[char] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


@pytest.fixture
def make_batch(char_tokenizer):
    """`make_batch(responses, ground_truths, data_sources, ...)` -> DataProto of one PPO step's reward inputs.

    Prompts are left-padded, responses are text + <eos> right-padded to `response_len`; the response
    mask covers the text and the <eos>, so a response of n characters has its last valid token at n.
    """

    def build(
        responses,
        ground_truths,
        data_sources,
        prompts=None,
        extra_infos=None,
        response_len=None,
        meta_info=None,
        with_response_mask=True,
        index=None,
    ):
        tok = char_tokenizer
        prompts = prompts or ["q?"] * len(responses)
        prompt_ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
        response_ids = [tok.encode(r, add_special_tokens=False) + [tok.eos_token_id] for r in responses]
        prompt_len = max(len(ids) for ids in prompt_ids)
        response_len = response_len or max(len(ids) for ids in response_ids) + 2
        prompt_t = torch.full((len(responses), prompt_len), tok.pad_token_id)
        response_t = torch.full((len(responses), response_len), tok.pad_token_id)
        prompt_mask = torch.zeros_like(prompt_t)
        response_mask = torch.zeros_like(response_t)
        for row, (p_ids, r_ids) in enumerate(zip(prompt_ids, response_ids)):
            r_ids = r_ids[:response_len]
            prompt_t[row, prompt_len - len(p_ids) :] = torch.tensor(p_ids)
            prompt_mask[row, prompt_len - len(p_ids) :] = 1
            response_t[row, : len(r_ids)] = torch.tensor(r_ids)
            response_mask[row, : len(r_ids)] = 1
        tensors = {
            "prompts": prompt_t,
            "responses": response_t,
            "input_ids": torch.cat([prompt_t, response_t], dim=1),
            "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
        }
        if with_response_mask:
            tensors["response_mask"] = response_mask
        non_tensors = {
            "data_source": np.array(data_sources, dtype=object),
            "reward_model": np.array([{"ground_truth": gt} for gt in ground_truths], dtype=object),
            "extra_info": np.array(extra_infos or [{"i": i} for i in range(len(responses))], dtype=object),
        }
        if index is not None:
            non_tensors["index"] = np.array(index, dtype=object)
        return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info or {})

    return build
