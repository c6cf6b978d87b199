"""Tests for verl.models.tiny: tokenizer ids survive save/reload, model reload, determinism, sizes."""

import json
import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from verl.models.tiny import ADDED_TOKENS, MODEL_SIZES, build_tiny_model, build_tokenizer, default_corpus

TOOL_CALL = '{"name": "get_weather", "parameters": {"location": "São Paulo", "unit": "C", "days": 3}}'
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant. Tools: get_weather(location, unit)."},
    {"role": "user", "content": "What's the weather in São Paulo? 12 + 7 = ?"},
    {"role": "assistant", "content": f"<think>call the tool</think>\n<tool_call>\n{TOOL_CALL}\n</tool_call>"},
    {"role": "user", "content": "Thanks!! 😀 日本語"},
]
ROUNDTRIP_STRINGS = [
    "Hello world!",
    "  leading and trailing spaces  ",
    "line one\nline two\r\n\n\ttabbed",
    "0 7 42 1234567890 3.14159 -0.5 1e-9 $1,000.00 50%",
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72",
    TOOL_CALL,
    '[{"a": null, "b": true, "c": [1, 2.5, "x"]}]',
    "café naïve über Zürich Ελληνικά русский 中文 한국어 😀🚀",
    "e\u0301 vs \u00e9 and A\u030a",  # NFC must compose these identically on both sides
    "I'll, we've, THEY'RE, it's, don't",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "<think>plan</think><tool_call>\n{}\n</tool_call><response>done</response>",
    "a<think>b</think>c<response>",
    "!!! ??? ... ;;; ::: ((( ))) [[[ ]]] {{{ }}} ~`@#$%^&*_-+=|\\/<>",
    "",
]


@pytest.fixture(scope="module")
def trained_tokenizer():
    return build_tokenizer(default_corpus(0), vocab_size=2048, seed=0)


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny")), size="xs", seed=0)


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def test_tokenizer_ids_survive_save_and_reload(trained_tokenizer, saved_dir):
    reloaded = AutoTokenizer.from_pretrained(saved_dir)
    assert type(reloaded).__name__ == "Qwen2Tokenizer"
    templated = trained_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    corpus_sample = default_corpus(seed=123, n=200)
    for text in ROUNDTRIP_STRINGS + [templated] + corpus_sample:
        assert _ids(reloaded, text) == _ids(trained_tokenizer, text), text
    assert reloaded.get_vocab() == trained_tokenizer.get_vocab()
    # chat template is saved and gives the same ids through tokenize=True (a BatchEncoding in transformers 5)
    enc = reloaded.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    assert list(enc["input_ids"]) == _ids(trained_tokenizer, templated)


def test_chat_template_is_qwen_style(saved_dir):
    tok = AutoTokenizer.from_pretrained(saved_dir)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    )
    with_prompt = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert with_prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_special_and_added_tokens(saved_dir):
    tok = AutoTokenizer.from_pretrained(saved_dir)
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    for t in ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *ADDED_TOKENS]:
        ids = _ids(tok, t)
        assert len(ids) == 1 and tok.convert_ids_to_tokens(ids[0]) == t
    text = "<|im_start|>assistant\n<think>x</think><tool_call>{}</tool_call><|im_end|>"
    # the six tags are not special: skip_special_tokens drops the chat markers but keeps the tags
    assert (
        tok.decode(_ids(tok, text), skip_special_tokens=True) == "assistant\n<think>x</think><tool_call>{}</tool_call>"
    )
    # digits are single tokens (Qwen2's \p{N} split), so arithmetic is tokenised digit by digit
    assert len(_ids(tok, "1234567")) == 7
    # every byte is covered: arbitrary text decodes back exactly
    for s in ROUNDTRIP_STRINGS[:9]:
        import unicodedata

        assert tok.decode(_ids(tok, s)) == unicodedata.normalize("NFC", s)


def test_config_ids_consistent(saved_dir):
    tok = AutoTokenizer.from_pretrained(saved_dir)
    cfg = AutoConfig.from_pretrained(saved_dir)
    assert cfg.model_type == "qwen2" and cfg.tie_word_embeddings
    assert cfg.vocab_size == len(tok) == 2048
    assert cfg.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert cfg.pad_token_id == tok.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    with open(os.path.join(saved_dir, "generation_config.json")) as f:
        gen = json.load(f)
    assert tok.eos_token_id in gen["eos_token_id"] and gen["pad_token_id"] == tok.pad_token_id


def test_model_reload_gives_identical_logits(saved_dir):
    model = AutoModelForCausalLM.from_pretrained(saved_dir).eval()
    again = AutoModelForCausalLM.from_pretrained(saved_dir).eval()
    ids = torch.tensor([[1, 5, 9, 300, 2, 7, 2040, 0]])
    with torch.no_grad():
        a, b = model(ids).logits, again(ids).logits
    assert a.shape == (1, 8, 2048)
    assert torch.equal(a, b)
    # random init is not degenerate: different positions give different distributions
    assert not torch.allclose(a[0, 0], a[0, 1])


def test_same_seed_same_weights_and_vocab(saved_dir, tmp_path):
    same = build_tiny_model(str(tmp_path / "same"), size="xs", seed=0)
    other = build_tiny_model(str(tmp_path / "other"), size="xs", seed=1)
    m0, m_same, m_other = (AutoModelForCausalLM.from_pretrained(d) for d in (saved_dir, same, other))
    sd0, sd_same, sd_other = m0.state_dict(), m_same.state_dict(), m_other.state_dict()
    assert all(torch.equal(sd0[k], sd_same[k]) for k in sd0)
    assert not torch.equal(sd0["model.embed_tokens.weight"], sd_other["model.embed_tokens.weight"])
    with open(os.path.join(saved_dir, "tokenizer.json")) as f0, open(os.path.join(same, "tokenizer.json")) as f1:
        assert f0.read() == f1.read()


@pytest.mark.parametrize("size, low, high", [("xs", 0.8e6, 1.2e6), ("s", 3.0e6, 4.0e6), ("m", 10e6, 20e6)])
def test_parameter_counts(size, low, high, tmp_path):
    out = build_tiny_model(str(tmp_path / size), size=size, seed=0)
    model = AutoModelForCausalLM.from_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    assert low <= n <= high, f"{size}: {n} parameters"
    assert model.config.hidden_size == MODEL_SIZES[size]["hidden_size"]


def test_bad_arguments_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny model size 'xl'"):
        build_tiny_model(str(tmp_path), size="xl")
    with pytest.raises(ValueError, match="vocab_size=100 is too small"):
        build_tokenizer(["some text"], vocab_size=100)
    with pytest.raises(ValueError, match="corpus is empty"):
        build_tokenizer([], vocab_size=2048)


def test_small_corpus_gives_smaller_vocab_and_matching_model(tmp_path):
    out = build_tiny_model(str(tmp_path), size="xs", corpus=["tiny corpus text", "more tiny text"], vocab_size=2048)
    tok = AutoTokenizer.from_pretrained(out)
    assert 256 + 9 <= len(tok) < 2048
    assert AutoConfig.from_pretrained(out).vocab_size == len(tok)
    assert (
        _ids(tok, "tiny text")
        == build_tokenizer(["tiny corpus text", "more tiny text"], 2048)("tiny text")["input_ids"]
    )


def test_qwen2_5_0_5b_shape_without_building_it():
    """The real-shape preset: Qwen2.5-0.5B's config values and parameter count (on the meta device: no memory)."""
    from transformers import Qwen2ForCausalLM

    from verl.models.tiny import tiny_config

    config = tiny_config("qwen2.5-0.5b", tokenizer_size=2048, pad_id=0, eos_id=2)
    shape = (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads)
    assert shape == (896, 24, 14, 2)
    assert (config.intermediate_size, config.vocab_size, config.tie_word_embeddings) == (4864, 151936, True)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == 494_032_768
    assert tiny_config("xs", tokenizer_size=300, pad_id=0, eos_id=2).vocab_size == 300  # tiny sizes: the tokenizer's
    with pytest.raises(ValueError, match="vocab_size 151936, fewer than the tokenizer's 200000 ids"):
        tiny_config("qwen2.5-0.5b", tokenizer_size=200_000, pad_id=0, eos_id=2)


def test_saved_parameter_count_reads_safetensors_headers(saved_dir):
    from verl.models.tiny import saved_parameter_count

    model = AutoModelForCausalLM.from_pretrained(saved_dir)
    assert saved_parameter_count(saved_dir) == sum(p.numel() for p in model.parameters())
