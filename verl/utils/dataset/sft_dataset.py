"""SFT dataset: parquet rows of chat `messages` (every assistant turn trained) or prompt/response pairs (the response
plus eos trained) -> padded token tensors and `loss_mask`, aligned with `input_ids` (not shifted: 1 on assistant
tokens and their `<|im_end|>`, 0 on the chat header). Owns `SFTDataset`. Layer 4: never Ray.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch.utils.data import Dataset

from verl.utils.torch_functional import compute_position_id_with_mask

__all__ = ["SFTDataset"]

TRUNCATION_MODES = ("error", "left", "right")


def _cfg_get(config: Any, key: str, default: Any) -> Any:
    if config is None:
        return default
    value = config.get(key, default)
    return default if value is None else value


def _as_messages(value: Any, where: str) -> list[dict[str, Any]]:
    """A parquet chat cell (list / numpy array of dicts) as a list of plain {role, content} dicts."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(
            f"{where}: expected a non-empty list of {{role, content}} messages, got {type(value).__name__}"
        )
    messages = []
    for i, msg in enumerate(value):
        if not isinstance(msg, Mapping) or "role" not in msg or "content" not in msg:
            raise ValueError(f"{where}: message {i} must be a dict with 'role' and 'content', got {msg!r}")
        messages.append({"role": str(msg["role"]), "content": msg["content"]})
    return messages


def _chat_ids(tokenizer: Any, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class SFTDataset(Dataset):
    """Tokenised SFT examples read from one or more parquet files.

    Args:
        parquet_files: a path or list of paths.
        tokenizer: a Hugging Face tokenizer with a chat template and a pad token.
        config: dict-like with `messages_key` (default "messages"), `prompt_key` ("prompt"),
            `response_key` ("response"), `max_length` (1024), `truncation` ("error" | "left" | "right").

    Each item is a dict of 1-D tensors of length `max_length`: `input_ids`, `attention_mask`, `position_ids`,
    `loss_mask` (right-padded with the pad token; padding has attention_mask 0 and loss_mask 0).
    """

    def __init__(self, parquet_files: str | Sequence[str], tokenizer: Any, config: Any = None):
        if isinstance(parquet_files, (str, os.PathLike)):
            parquet_files = [parquet_files]
        self.parquet_files = [os.fspath(f) for f in parquet_files]
        if not self.parquet_files:
            raise ValueError("SFTDataset needs at least one parquet file, got an empty list")
        self.tokenizer = tokenizer
        self.messages_key = _cfg_get(config, "messages_key", "messages")
        self.prompt_key = _cfg_get(config, "prompt_key", "prompt")
        self.response_key = _cfg_get(config, "response_key", "response")
        self.max_length = int(_cfg_get(config, "max_length", 1024))
        self.truncation = _cfg_get(config, "truncation", "error")
        if self.truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation={self.truncation!r} is not supported; allowed: {list(TRUNCATION_MODES)}")
        if self.max_length < 2:
            raise ValueError(f"data.max_length must be >= 2, got {self.max_length}")
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token; set tokenizer.pad_token before building SFTDataset")
        self.rows: list[tuple[str, int, Any, Any]] = []  # (file, row index, prompt-or-messages, response)
        self._tokenized: dict[int, tuple[list[int], list[int]]] = {}  # `tokenize`'s result, each row once per run
        self.multiturn: bool | None = None
        for path in self.parquet_files:
            self._read(path)

    def _read(self, path: str) -> None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"SFT data file {path!r} does not exist")
        df = pd.read_parquet(path)
        if self.messages_key in df.columns:
            multiturn, columns = True, [self.messages_key]
        elif self.prompt_key in df.columns and self.response_key in df.columns:
            multiturn, columns = False, [self.prompt_key, self.response_key]
        else:
            raise ValueError(
                f"SFT data file {path!r} has columns {list(df.columns)}; it needs either a "
                f"'{self.messages_key}' column (data.messages_key) or both '{self.prompt_key}' (data.prompt_key) "
                f"and '{self.response_key}' (data.response_key)"
            )
        if self.multiturn is not None and multiturn != self.multiturn:
            raise ValueError(f"SFT data file {path!r} mixes layouts with the files before it: use one layout")
        self.multiturn = multiturn
        if multiturn:
            self.rows += [(path, i, v, None) for i, v in enumerate(df[columns[0]].tolist())]
            for i, value in enumerate(df[columns[0]].tolist()):  # fail at load time, not mid-run
                messages = _as_messages(value, f"{path} row {i} column '{self.messages_key}'")
                if not any(m["role"] == "assistant" for m in messages):
                    raise ValueError(
                        f"{path} row {i}: the conversation has no assistant message, so nothing would be trained"
                    )
        else:
            pairs = zip(df[columns[0]].tolist(), df[columns[1]].tolist())
            self.rows += [(path, i, p, r) for i, (p, r) in enumerate(pairs)]

    def __len__(self) -> int:
        return len(self.rows)

    def tokenize(self, index: int) -> tuple[list[int], list[int]]:
        """Unpadded (token ids, loss mask) of row `index`. Kept after the first call: an epoch after the first
        renders no chat template again (each conversation's prefixes are rendered and tokenised one by one)."""
        if index not in self._tokenized:
            path, row, first, response = self.rows[index]
            where = f"{path} row {row}"
            if self.multiturn:
                messages = _as_messages(first, f"{where} column '{self.messages_key}'")
                self._tokenized[index] = self._tokenize_messages(messages, where)
            else:
                self._tokenized[index] = self._tokenize_prompt_response(first, response, where)
        ids, mask = self._tokenized[index]
        return list(ids), list(mask)

    def _tokenize_messages(self, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
        """Tokenise a conversation; assistant turns (to their first eos) get loss_mask 1.

        Uses prefix renderings of the chat template: message i's tokens are the ids added by rendering
        messages[:i+1] over messages[:i]; for an assistant turn the header is the generation prompt.
        """
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{where}: the conversation has no assistant message, so nothing would be trained")
        eos = self.tokenizer.eos_token_id
        ids: list[int] = []
        mask: list[int] = []
        for i, msg in enumerate(messages):
            full = _chat_ids(self.tokenizer, messages[: i + 1], add_generation_prompt=False)
            if full[: len(ids)] != ids:
                raise ValueError(
                    f"{where}: the chat template does not render message {i} as an extension of the messages "
                    "before it, so the assistant tokens cannot be located; use a prefix-stable template"
                )
            if msg["role"] == "assistant":
                header = _chat_ids(self.tokenizer, messages[:i], add_generation_prompt=True)
                if full[: len(header)] != header:
                    raise ValueError(f"{where}: the generation prompt is not a prefix of assistant message {i}")
                body = full[len(header) :]
                n_trained = body.index(eos) + 1 if eos in body else len(body)
                mask += [0] * (len(header) - len(ids)) + [1] * n_trained + [0] * (len(body) - n_trained)
            else:
                mask += [0] * (len(full) - len(ids))
            ids = full
        return ids, mask

    def _tokenize_prompt_response(self, prompt: Any, response: Any, where: str) -> tuple[list[int], list[int]]:
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = _as_messages(prompt, f"{where} column '{self.prompt_key}'")
        if not isinstance(response, str):
            raise ValueError(
                f"{where} column '{self.response_key}': expected a string response, got {type(response).__name__}"
            )
        prompt_ids = _chat_ids(self.tokenizer, messages, add_generation_prompt=True)
        response_ids = self.tokenizer(response + self.tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        return prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids, mask = self.tokenize(index)
        ids, mask = self._truncate(ids, mask, index)
        pad = self.max_length - len(ids)
        input_ids = torch.tensor(ids + [self.tokenizer.pad_token_id] * pad, dtype=torch.long)
        attention_mask = torch.tensor([1] * len(ids) + [0] * pad, dtype=torch.long)
        loss_mask = torch.tensor(mask + [0] * pad, dtype=torch.long)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": compute_position_id_with_mask(attention_mask),
            "loss_mask": loss_mask,
        }

    def _truncate(self, ids: list[int], mask: list[int], index: int) -> tuple[list[int], list[int]]:
        if len(ids) <= self.max_length:
            return ids, mask
        if self.truncation == "error":
            path, row = self.rows[index][:2]
            raise ValueError(
                f"{path} row {row}: {len(ids)} tokens exceed data.max_length={self.max_length}; raise max_length "
                "or set data.truncation=left|right"
            )
        if self.truncation == "left":
            return ids[-self.max_length :], mask[-self.max_length :]
        return ids[: self.max_length], mask[: self.max_length]
