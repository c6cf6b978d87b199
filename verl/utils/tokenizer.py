"""Tokenizer helpers: `hf_tokenizer` (AutoTokenizer with an eos pad-token fallback and a clear error for a missing
path) and `normalize_token_ids` (what transformers returns, e.g. a `BatchEncoding` from
`apply_chat_template(tokenize=True)` in transformers 5, as a flat `list[int]`). Layer 1: never Ray.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["hf_tokenizer", "normalize_token_ids", "set_pad_token_id"]


def _in_hf_cache(repo_id: str) -> bool:
    """Whether `repo_id` is a hub id whose tokenizer files are already in the local Hugging Face cache."""
    from huggingface_hub import try_to_load_from_cache

    for filename in ("tokenizer_config.json", "tokenizer.json"):
        try:
            if isinstance(try_to_load_from_cache(repo_id, filename), str):
                return True
        except Exception:  # an invalid repo id (a path-like string) is simply not cached
            return False
    return False


def set_pad_token_id(tokenizer: Any) -> None:
    """Use eos as the pad token when the tokenizer has none (with a warning), as verl does."""
    if tokenizer.pad_token_id is not None:
        return
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} has neither a pad token nor an eos token; "
            "set one of them (e.g. tokenizer.pad_token = '<|endoftext|>') before training"
        )
    tokenizer.pad_token = tokenizer.eos_token
    warnings.warn(
        f"tokenizer has no pad token; using its eos token {tokenizer.eos_token!r} "
        f"(id {tokenizer.eos_token_id}) as pad token",
        stacklevel=2,
    )


def hf_tokenizer(name_or_path: str, correct_pad_token: bool = True, **kwargs: Any) -> Any:
    """Load a tokenizer with `transformers.AutoTokenizer.from_pretrained(name_or_path, **kwargs)`.

    Args:
        name_or_path: a local directory, or a hub id already in the local Hugging Face cache (a missing path
            fails at once instead of retrying the hub for a minute).
        correct_pad_token: when the tokenizer has no pad token, use its eos token (with a warning).
        **kwargs: passed to `AutoTokenizer.from_pretrained` (e.g. `trust_remote_code`).

    Raises:
        FileNotFoundError: `name_or_path` is neither an existing path nor a cached hub id.
    """
    from transformers import AutoTokenizer

    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"tokenizer name_or_path must be a str or path, got {type(name_or_path).__name__}")
    name_or_path = os.path.expanduser(os.fspath(name_or_path))
    if not os.path.exists(name_or_path) and not _in_hf_cache(name_or_path):
        raise FileNotFoundError(
            f"tokenizer path {name_or_path!r} does not exist (and is not a model id in the local Hugging Face "
            "cache; nothing is downloaded here): pass a directory holding tokenizer.json / "
            "tokenizer_config.json, e.g. the output of verl.models.tiny.build_tiny_model"
        )
    if not os.path.exists(name_or_path):
        kwargs.setdefault("local_files_only", True)  # cached hub id: do not spend a minute retrying the hub
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
    except OSError as err:
        raise OSError(
            f"could not load a tokenizer from {name_or_path!r}: it is neither a local tokenizer directory "
            f"nor a model id available offline ({err})"
        ) from err
    if correct_pad_token:
        set_pad_token_id(tokenizer)
    return tokenizer


def normalize_token_ids(x: Any) -> list[int]:
    """Flatten token ids returned by a tokenizer into a `list[int]`.

    Accepts a list/tuple of ints, a batch of one row (`[[...]]`, shape (1, n)), a torch tensor or numpy
    array of shape (n,) or (1, n), or a Mapping such as transformers 5's `BatchEncoding`
    (its `input_ids` is used). A batch of more than one row is rejected: it has no single flat form.
    """
    if isinstance(x, Mapping):
        if "input_ids" not in x:
            raise ValueError(f"cannot take token ids from a mapping without 'input_ids'; keys are {list(x.keys())}")
        x = x["input_ids"]
    if isinstance(x, (torch.Tensor, np.ndarray)):
        x = x.tolist()
    if isinstance(x, (int, np.integer)):
        return [int(x)]
    if not isinstance(x, (list, tuple)):
        raise TypeError(f"expected token ids as a list, tensor, array or BatchEncoding, got {type(x).__name__}")
    if len(x) > 0 and isinstance(x[0], (list, tuple, torch.Tensor, np.ndarray)):
        if len(x) != 1:
            raise ValueError(f"expected the token ids of one sequence, got a batch of {len(x)} sequences")
        return normalize_token_ids(x[0])
    ids = []
    for i, tok in enumerate(x):
        if isinstance(tok, bool) or not isinstance(tok, (int, np.integer)):
            raise TypeError(f"token id at position {i} is {tok!r} ({type(tok).__name__}), expected an int")
        ids.append(int(tok))
    return ids
