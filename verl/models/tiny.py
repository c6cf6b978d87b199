"""Tiny random-weight Qwen2 models with a locally trained tokenizer: the project's embedded default model.

Owns `build_tokenizer` (byte-level BPE with Qwen2's normaliser and pre-tokeniser, so transformers' `Qwen2Tokenizer`
reload keeps the ids; a Qwen-style chat template) and `build_tiny_model` (random weights saved in HF format;
`size="qwen2.5-0.5b"` has Qwen2.5-0.5B's exact shape). Nothing is downloaded.
CLI: `python -m verl.models.tiny --out DIR [--size xs|s|m|qwen2.5-0.5b] [--seed 0] [--corpus FILE]`.
Layer 0: must not import Ray or trainer code.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
from collections.abc import Iterable
from typing import Any

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

# Qwen2's pre-tokenisation regex (same string as transformers' Qwen2Tokenizer uses).
QWEN2_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]
# Added (non-special) tokens: kept by decode(skip_special_tokens=True), never split by BPE.
ADDED_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<response>", "</response>"]

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] if message['content'] is not none else '')"
    " + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

DEFAULT_VOCAB_SIZE = 2048

# name -> Qwen2Config shape. Parameter counts (vocab 2048, tied embeddings): xs ~1.05M, s ~3.5M, m ~11M. A shape
# with its own `vocab_size` keeps it whatever the tokenizer's size (a real model's embedding and LM-head cost).
MODEL_SIZES: dict[str, dict[str, Any]] = {
    "xs": dict(
        hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=384
    ),
    "s": dict(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=704
    ),
    "m": dict(
        hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2, intermediate_size=1152
    ),
    # Qwen/Qwen2.5-0.5B's config.json (494,032,768 parameters with tied embeddings)
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
    ),
}


# ----------------------------------------------------------------------------------------------- corpus
_NAMES = ["Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Ken", "Alexis", "Tina", "Randy", "Mark", "Joy",
          "Maria", "Omar", "Priya", "Chen", "Lucas", "Sofia", "Noah", "Emma", "Liam", "Ava", "Yuki", "Ahmed"]  # fmt: skip
_ITEMS = ["apples", "clips", "books", "pencils", "cookies", "marbles", "stickers", "eggs", "tickets", "shirts",
          "cups", "bottles", "flowers", "cards", "coins", "boxes", "candies", "toys", "plates", "balloons"]  # fmt: skip
_WORDS = ("the a an of to and in is was for on with as by at from that this it be are or have has not but what all "
          "were when we there can which their said if do will each about how up out them then she many some so "
          "these would other into more her two like him see time could no make than first been its who now people "
          "my made over did down only way find use may water long little very after words called just where most "
          "know get through back much before go good new write our used me man too any day same right look think "
          "also around another came come work three word must because does part even place well such here take why "
          "things help put years different away again off went old number great tell men say small every found "
          "still between name should home big give air line set own under read last never us left end along while "
          "might next sound below saw something thought both few those always looked show large often together "
          "asked house world going want school important until form food keep children feet land side without boy "
          "once animals life enough took sometimes four head above kind began almost live page got earth need far "
          "hand high year mother light parts country father let night following picture being study second eyes "
          "soon times story boys since white days ever paper hard near sentence better best across during today "
          "others however sure means knew answer question reasoning tool call function result user assistant system "
          "weather search calculate convert translate schedule meeting temperature city price stock query location "
          "date total each per cost money dollars hours minutes miles percent half twice remaining left spend earn").split()  # fmt: skip
_TOOLS = ["get_weather", "search_web", "calculator", "convert_currency", "get_stock_price", "send_email",
          "translate_text", "create_event", "find_restaurant", "get_time", "book_flight", "lookup_word"]  # fmt: skip
_ARG_NAMES = ["location", "query", "expression", "amount", "from_currency", "to_currency", "symbol", "recipient",
              "subject", "text", "target_language", "date", "city", "cuisine", "timezone", "word", "unit"]  # fmt: skip


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
    text = " ".join(words)
    text = text[0].upper() + text[1:]
    return text + rng.choice([".", ".", ".", "?", "!", ";", ":", ","])


def _json_tool_call(rng: random.Random) -> str:
    args = {}
    for name in rng.sample(_ARG_NAMES, rng.randint(1, 3)):
        kind = rng.random()
        if kind < 0.4:
            args[name] = rng.choice(_WORDS) + (" " + rng.choice(_WORDS) if rng.random() < 0.5 else "")
        elif kind < 0.7:
            args[name] = rng.randint(0, 10000)
        elif kind < 0.85:
            args[name] = round(rng.uniform(-100, 100), rng.randint(1, 3))
        else:
            args[name] = rng.choice([True, False, None])
    call = {"name": rng.choice(_TOOLS), "parameters": args}
    calls = [call] + ([{"name": rng.choice(_TOOLS), "parameters": {}}] if rng.random() < 0.2 else [])
    return "\n".join(json.dumps(c) for c in calls)


def _math_problem(rng: random.Random) -> str:
    """A GSM8K-style word problem with a worked answer ending in `#### N`."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b, price = rng.randint(2, 99), rng.randint(2, 20), rng.randint(1, 12)
    total = a * b
    question = (
        f"{name} buys {b} packs of {item}. Each pack has {a} {item} and costs ${price}. "
        f"How many {item} does {name} have, and how much money did {name} spend?"
    )
    answer = (
        f"{name} has {b} * {a} = <<{b}*{a}={total}>>{total} {item}.\n"
        f"{name} spent {b} * {price} = <<{b}*{price}={b * price}>>{b * price} dollars.\n#### {total}"
    )
    return question + "\n" + answer


def _digits_and_punctuation(rng: random.Random) -> str:
    parts = [
        str(rng.randint(0, 10 ** rng.randint(1, 9))),
        f"{rng.uniform(-1000, 1000):.{rng.randint(0, 4)}f}",
        f"{rng.randint(1, 12):02d}/{rng.randint(1, 28):02d}/{rng.randint(1990, 2030)}",
        f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}",
        f"{rng.randint(1, 99)}% of {rng.randint(1, 999)} = ?",
        "".join(rng.choice("()[]{}<>+-*/=_,.;:!?'\"@#$%^&|~`\\") for _ in range(rng.randint(1, 8))),
    ]
    return " ".join(rng.sample(parts, rng.randint(2, len(parts))))


def _chat_sample(rng: random.Random) -> str:
    """Text shaped like the chat-templated training data (tags included as plain text)."""
    user = _sentence(rng)
    think = " ".join(_sentence(rng) for _ in range(rng.randint(1, 2)))
    if rng.random() < 0.5:
        body = f"<tool_call>\n{_json_tool_call(rng)}\n</tool_call>"
    else:
        body = f"<response>{_sentence(rng)}</response>"
    return (
        f"{IM_START}system\nYou are a helpful assistant.{IM_END}\n{IM_START}user\n{user}{IM_END}\n"
        f"{IM_START}assistant\n<think>{think}</think>\n{body}{IM_END}\n"
    )


def _unicode_sample(rng: random.Random) -> str:
    samples = ["café", "naïve", "über", "façade", "niño", "Zürich", "São Paulo", "Ελληνικά", "русский", "日本語",
               "中文", "한국어", "emoji 😀 🚀", "e\u0301", "Å", "℃", "½"]  # fmt: skip
    return " ".join(rng.sample(samples, rng.randint(1, 4)))


def default_corpus(seed: int = 0, n: int = 1000) -> list[str]:
    """The built-in tokenizer training text: English, digits, JSON tool calls, math, chat-shaped text.

    Deterministic in `seed`. Adds `verl.utils.dataset.rlla_synthetic.corpus_texts(n, seed)` when that module
    is importable, so the task's own text gets compact tokens.
    """
    rng = random.Random(seed)
    makers = [_sentence, _json_tool_call, _math_problem, _digits_and_punctuation, _chat_sample, _unicode_sample]
    weights = [4, 2, 2, 1, 2, 0.3]
    texts = [rng.choices(makers, weights)[0](rng) for _ in range(n)]
    try:
        from verl.utils.dataset.rlla_synthetic import corpus_texts
    except ImportError:
        return texts
    return texts + list(corpus_texts(n, seed))


# -------------------------------------------------------------------------------------------- tokenizer
def build_tokenizer(corpus: Iterable[str], vocab_size: int, seed: int = 0) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on `corpus` with Qwen2's normaliser and pre-tokeniser.

    The result has `len(tokenizer) <= vocab_size` (equal unless the corpus runs out of pairs to merge): ids
    0..2 are `<|endoftext|>` (pad), `<|im_start|>`, `<|im_end|>` (eos), then the BPE vocabulary, then the six
    added tags (`<think>` ... `</response>`).
    BPE training is deterministic given the corpus; `seed` only shuffles the corpus order, which does not
    change the merges.
    """
    min_size = 256 + len(SPECIAL_TOKENS) + len(ADDED_TOKENS)
    if vocab_size < min_size:
        raise ValueError(f"vocab_size={vocab_size} is too small: need at least {min_size} (256 bytes + tokens)")
    texts = list(corpus)
    if not texts:
        raise ValueError("corpus is empty: give at least one text to train the tokenizer on")
    random.Random(seed).shuffle(texts)

    tok = Tokenizer(
        models.BPE(
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(ADDED_TOKENS),
        min_frequency=2,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        unk_token=None,
        bos_token=None,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# ---------------------------------------------------------------------------------------------- model
def _read_corpus_file(path: str) -> list[str]:
    """One text per non-empty line; a `.jsonl` file contributes every string value of each record."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"corpus file {path!r} does not exist")
    texts: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            if path.endswith(".jsonl"):
                texts.extend(v for v in json.loads(line).values() if isinstance(v, str))
            else:
                texts.append(line.rstrip("\n"))
    return texts


def random_qwen2(
    seed: int = 0,
    *,
    vocab_size: int = 100,
    hidden_size: int = 32,
    intermediate_size: int = 45,
    num_hidden_layers: int = 2,
    tie_word_embeddings: bool = False,
) -> Qwen2ForCausalLM:
    """A random-weight Qwen2ForCausalLM without a tokenizer, for tests of sharding, checkpoints and merging.

    4 heads and 2 KV heads; the default intermediate size 45 is odd so that the MLP shards unevenly over 2 ranks.
    """
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie_word_embeddings,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def tiny_config(size: str, tokenizer_size: int, pad_id: int, eos_id: int) -> Qwen2Config:
    """The Qwen2Config of `size` (`MODEL_SIZES`) for a tokenizer of `tokenizer_size` ids: tied embeddings, float32,
    vocabulary = the tokenizer's unless the shape fixes its own (which must hold every tokenizer id)."""
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown tiny model size {size!r}; allowed: {sorted(MODEL_SIZES)}")
    shape = {"vocab_size": tokenizer_size, "max_position_embeddings": 2048, "rope_theta": 10000.0, **MODEL_SIZES[size]}
    if shape["vocab_size"] < tokenizer_size:
        raise ValueError(
            f"size {size!r} has vocab_size {shape['vocab_size']}, fewer than the tokenizer's {tokenizer_size} ids; "
            "train a smaller tokenizer (--vocab-size)"
        )
    return Qwen2Config(
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
        **shape,
    )


def build_tiny_model(
    out_dir: str,
    size: str = "xs",
    seed: int = 0,
    corpus: Iterable[str] | None = None,
    vocab_size: int | None = None,
) -> str:
    """Build a random-weight Qwen2ForCausalLM of `size` plus its tokenizer and save both to `out_dir`.

    Reload with `AutoModelForCausalLM.from_pretrained(out_dir)` and `AutoTokenizer.from_pretrained(out_dir)`.
    Same `seed` (and corpus) gives identical weights and vocabulary. Returns `out_dir`.
    """
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown tiny model size {size!r}; allowed: {sorted(MODEL_SIZES)}")
    vocab_size = vocab_size or DEFAULT_VOCAB_SIZE
    tokenizer = build_tokenizer(default_corpus(seed) if corpus is None else corpus, vocab_size, seed=seed)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)

    config = tiny_config(size, len(tokenizer), pad_id, eos_id)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=pad_id, eos_token_id=[eos_id, pad_id], pad_token_id=pad_id)

    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _mark_tokenizer_as_qwen2(out_dir)
    return out_dir


def _mark_tokenizer_as_qwen2(out_dir: str) -> None:
    """Declare `Qwen2Tokenizer` in tokenizer_config.json so every loader rebuilds the same tokenizer class."""
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "Qwen2Tokenizer"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build a tiny random-weight Qwen2 model and a local tokenizer.")
    parser.add_argument("--out", required=True, help="output directory (HF format)")
    parser.add_argument("--size", default="xs", choices=sorted(MODEL_SIZES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus", default=None, help="text file (one text a line) or .jsonl to train the tokenizer")
    parser.add_argument("--vocab-size", type=int, default=None, help="tokenizer vocabulary (default 2048)")
    args = parser.parse_args(argv)
    corpus = _read_corpus_file(args.corpus) if args.corpus else None
    out = build_tiny_model(args.out, size=args.size, seed=args.seed, corpus=corpus, vocab_size=args.vocab_size)
    print(f"Qwen2 ({args.size}, {saved_parameter_count(out) / 1e6:.2f}M params) written to {out}")


def saved_parameter_count(model_dir: str) -> int:
    """Parameters stored in a folder's safetensors files (a tied weight once), read from their headers only."""
    from safetensors import safe_open

    total = 0
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, name), framework="pt") as f:
                for key in f.keys():
                    total += math.prod(f.get_slice(key).get_shape())
    return total


if __name__ == "__main__":
    main()
